"""Who may do what, and how much: TLS identities, the RPC table, allow-lists, bounds, admission.

* ``admission``: Who gets a server's workers: per-peer caps, reserved workers, stream timeouts.
* ``allowlist``: The operator's allow-list: import a callable named ``"package.module:name"``
  only from module prefixes that every stage was started with (``--allow-models``).
* ``authz``: Who may call what: one table of the roles allowed to call each RPC (mutual TLS).
* ``bounds``: Every number a request may carry, bounded before it is used.
* ``tls``: Mutual TLS: a cluster CA, certificates that carry a name and a role, and credentials.
"""

from elasticpipe.security.admission import Guard, Limits
from elasticpipe.security.tls import TLS

__all__ = ["TLS", "Guard", "Limits"]
