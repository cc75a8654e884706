"""Family certificates may not take over a name held by an individual certificate.

A family certificate (``host-*``) covers every name with its prefix, so it also covers
``host-0`` when ``host-0`` has a certificate of its own. The coordinator remembers which
live incarnations spoke with an individual certificate (at ``Register``, and again at
each heartbeat, so a restarted coordinator learns it within one interval) and refuses a
family certificate's ``Register`` of a name such an incarnation holds while it is alive.
Family prefixes should not overlap individual names at all (docs/security.md).
"""

from __future__ import annotations

import threading

from elasticpipe.coordinator.membership import Membership
from elasticpipe.errors import PermissionDenied
from elasticpipe.security import authz


class Claims:
    """Which live incarnations hold their name by an individual certificate."""

    def __init__(self, members: Membership):
        self.members = members
        self._lock = threading.Lock()
        self._individual: set[str] = set()  # stage ids

    def check_register(self, name: str) -> None:
        """Refuses a family certificate's claim of a name an individual one holds.

        Raises:
            PermissionDenied: naming the certificate, the name and its holder.
        """
        identity = authz.caller()
        if identity is None or not identity[0].endswith("*"):
            return
        with self._lock:
            individual = set(self._individual)
        for member in self.members.members():
            row = member.row
            if row.name == name and row.stage_id in individual and self.members.alive(member):
                raise PermissionDenied(
                    f"the family certificate {identity[0]!r} cannot register as {name!r}: "
                    f"{name!r} is held by its own certificate (incarnation {row.stage_id}); "
                    "family prefixes must not overlap individual names"
                )

    def spoke(self, stage_id: str) -> None:
        """Notes the certificate an incarnation registered or heartbeats with."""
        identity = authz.caller()
        if identity is None or identity[0].endswith("*"):
            return
        with self._lock:
            self._individual.add(stage_id)
