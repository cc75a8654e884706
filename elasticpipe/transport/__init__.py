"""Every socket: the gRPC boundary, servers, the sender of data messages, the bulk channel.

* ``bulk``: The bulk channel: large activations and gradients on a raw socket beside gRPC.
* ``rpc``: The one boundary between gRPC and the domain: serving servicers, and calling peers.
* ``sending``: Sending one tensor (or a tuple or flat dict of tensors,
  ``elasticpipe.wire.bundle``) to a stage: a unary ``Deliver`` for a small one, the bulk channel
  (``elasticpipe.transport.bulk``) for a large one, or the header-then-chunks stream of
  Forward/Backward/Targets where the peer has no bulk channel.
* ``serving``: Starting a gRPC server of the project: addresses, TLS, limits, health service,
  lifecycle.
"""

from elasticpipe.transport.sending import Outgoing, Sender
from elasticpipe.transport.serving import RunningServer, start_server

__all__ = ["Outgoing", "RunningServer", "Sender", "start_server"]
