"""A step's commit on the bulk channel: one small write and one read per stage, where a
gRPC unary call costs the client a polling thread and several thread hops each time.

On a loaded 2-core host, a ``CommitStep`` fan-out over gRPC took 2.2-3.8 ms of a step
(``bench/anatomy.py``'s "commit"): grpcio starts a thread per channel for a burst of
future calls, and the reply crosses the server's and the client's polling threads. A
bulk message's round trip under the same load takes 0.2-0.4 ms.

On its own connection to each stage (``connect``: ``OpenBulk``'s one-time token, and with
TLS the same mutual handshake as for data), the client writes::

    u32 length, b"C", u64 0, CommitStepRequest

and the stage -- which checks the caller's role against ``CommitStep``'s row
(``authz.permit``) and then runs exactly the gRPC handler's checks and commit -- answers::

    OK, u32 length, CommitStepResponse        or an error frame (``bulk.send_error``)

The calls to every stage are written first and their answers read after, so the stages
commit at once. A stage without a bulk channel, or whose call could not be written whole,
is asked over gRPC instead (nothing was delivered); once written, a connection that breaks
before the answer makes the call ``StageUnavailable``, which the client asks once more
over gRPC (``CommitStep`` is idempotent).
"""

from __future__ import annotations

import socket
import threading
import time

from elasticpipe.errors import ElasticPipeError, StageUnavailable
from elasticpipe.logs import get_logger
from elasticpipe.security.tls import TLS
from elasticpipe.transport import bulk
from elasticpipe.v1 import stage_pb2_grpc

log = get_logger(__name__)

COMMIT = b"C"  # a frame's kind: a CommitStepRequest
MAX_REPLY_BYTES = 1 << 16  # a CommitStepResponse is a few bytes


class BulkCaller:
    """One client's control connection to one stage, opened on first use; one call at a
    time (``lock``): ``start`` writes it, ``finish`` reads its answer."""

    def __init__(self, stub: stage_pb2_grpc.StageServiceStub, address: str, tls: TLS | None):
        self._stub = stub
        self.address = address
        self._tls = tls
        self._sock: socket.socket | None = None
        self._grpc_until = 0.0  # time.monotonic(): gRPC only until then
        self.lock = threading.Lock()

    def start(self, kind: bytes, request: bytes, deadline: float) -> bool:
        """Writes one call; False when it must go over gRPC (no channel now, or it broke
        before the call was written whole: nothing was delivered).

        Raises:
            ElasticPipeError: ``OpenBulk`` refused (as gRPC would the call).
        """
        if time.monotonic() < self._grpc_until:
            return False
        if self._sock is not None and bulk.closed_by_peer(self._sock):
            self.close()  # the stage closed it while it idled
        fresh = self._sock is None
        try:
            sock = self._sock = self._sock or bulk.connect(
                self._stub, self.address, self._tls, deadline
            )
            bulk.send_all(sock, bulk.FRAME.pack(len(request), kind, 0) + request, deadline)
        except bulk.NoChannel as exc:
            self._fall_back(str(exc))
            return False
        except ElasticPipeError:
            self.close()
            raise
        except (OSError, ConnectionError) as exc:  # not all written: nothing delivered
            self.close()
            if fresh:
                self._fall_back(f"bulk connection broke before the call was sent: {exc}")
            return False
        return True

    def finish(self, deadline: float) -> bytes:
        """The reply to the call ``start`` wrote.

        Raises:
            ElasticPipeError: the stage refused it (as gRPC would have), or the connection
                broke or the answer was malformed (``StageUnavailable``: the call may or
                may not have been carried out).
        """
        sock = self._sock
        try:
            if sock is None:
                raise ConnectionError("the connection was closed")
            answer = bulk.recv_bytes(sock, 1, deadline)
            if answer == bulk.ERR:
                raise bulk.read_error(sock, self.address, deadline)
            if answer != bulk.OK:
                raise ConnectionError(f"unexpected bulk answer {answer!r}")
            (n,) = bulk.U32.unpack(bulk.recv_bytes(sock, bulk.U32.size, deadline))
            if n > MAX_REPLY_BYTES:
                raise ConnectionError(f"a bulk reply of {n} bytes")
            return bulk.recv_bytes(sock, n, deadline)
        except ElasticPipeError:
            raise  # the stage's refusal (some are OSErrors too): the connection is fine
        except (OSError, ConnectionError) as exc:
            self.close()
            raise StageUnavailable(f"bulk channel to {self.address}: {exc}") from exc

    def close(self) -> None:
        """Closes the connection (the next call opens another)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _fall_back(self, why: str) -> None:
        self.close()
        self._grpc_until = time.monotonic() + bulk.FALLBACK_S
        log.info("bulk_calls_unused", peer=self.address, reason=why, retry_s=bulk.FALLBACK_S)
