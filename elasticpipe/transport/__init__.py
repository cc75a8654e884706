"""Every socket: the gRPC boundary, servers, the sender of data messages, the bulk channel.

* ``bulk``: The bulk channel: large activations and gradients on a raw socket beside gRPC.
* ``rpc``: The one boundary between gRPC and the domain: serving servicers, and calling peers.
* ``sending``: Sending one tensor (or a tuple or flat dict of tensors,
  ``elasticpipe.wire.bundle``) to a stage: over the bulk channel
  (``elasticpipe.transport.bulk``); where the peer has none, a unary ``Deliver`` for a small
  one or the header-then-chunks stream of Forward/Backward/Targets for a large one.
* ``serving``: Starting a gRPC server of the project: addresses, TLS, limits, health service,
  lifecycle.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elasticpipe.transport.sending import Outgoing, Sender
    from elasticpipe.transport.serving import RunningServer, start_server

__all__ = ["Outgoing", "RunningServer", "Sender", "start_server"]

# Imported on first use, so that what needs only ``rpc`` (``elasticpipe admin``) starts
# without importing torch.
_HOMES = {"Outgoing": "sending", "Sender": "sending"}
_HOMES |= {"RunningServer": "serving", "start_server": "serving"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
