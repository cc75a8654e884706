"""A stage's configuration: what the operator chose for it, frozen, parsed once at start-up.

``StageConfig`` is also importable from ``elasticpipe.stage_server.stage`` and the package.
"""

from __future__ import annotations

from dataclasses import dataclass

from elasticpipe.security.tls import TLS
from elasticpipe.wire import codec

__all__ = ["StageConfig"]


@dataclass(frozen=True)
class StageConfig:
    """What the operator chose for this stage (parsed once at start-up)."""

    name: str
    address: str = ""
    device: str = "cpu"
    allow_models: tuple[str, ...] = ()
    slowdown: float = 1.0
    # "cpu" (thread CPU time), "wall", "auto" (cpu on CPU devices, CUDA events on CUDA), or
    # "fastest" (CPU: each op's time the fastest of its recent runs, ``devicetime``)
    timer: str = "auto"
    max_tensor_bytes: int = codec.DEFAULT_MAX_TENSOR_BYTES
    max_layer_bytes: int = codec.DEFAULT_MAX_LAYER_BYTES  # one layer's state, all tensors
    transfer_chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES  # layer state sent in such chunks
    mailbox_bytes: int = 4 << 30
    send_timeout_s: float = 30.0
    commit_lease_s: float = 30.0
    enable_fault_injection: bool = False
    tls: TLS | None = None  # mutual TLS for every connection (server and peers)
    insecure: bool = False  # plaintext beyond loopback, on a trusted network
    advertise: str = ""  # the address peers use (default: derived from the listen address)
    metrics_port: int | None = None  # serve Prometheus metrics here (0: any port)
    memory_bytes: int = 0  # what this stage offers its job (0: measure, see memory.detect)
    replica: str = ""  # the replica this stage is pinned to ("": any)
    metrics_listen: str = ""  # the metrics' host (default: the listen host, loopback only)
    bulk_port: int | None = 0  # the bulk channel's port (0: any free one; None: no channel)
