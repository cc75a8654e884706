"""A step's RunSteps and commit on the bulk channel: one small write and one read per
stage, where a gRPC unary call costs the client a polling thread and several thread hops.

On a loaded 2-core host a ``CommitStep`` fan-out over gRPC took 2.2-3.8 ms of a step
(``bench/anatomy.py``'s "commit"), and a RunStep reached its stage 1.3 ms after the client
sent it: grpcio starts a thread per channel for each burst of future calls, and a request
and its reply cross the server's and the client's polling threads. A bulk message's round
trip under the same load takes 0.2-0.4 ms.

On its own connection to each stage (``bulk.connect`` opened with ``bulk.MAGIC_CALLS``,
which an older stage refuses, so that it is called over gRPC: ``OpenBulk``'s one-time token,
and with TLS the same mutual handshake as for data; at most ``CONNECT_S`` to open), the
client writes::

    u32 length, b"S" (RunStepRequest) or b"C" (CommitStepRequest), u64 0, the request

and the stage -- which checks the caller's role against the method's row
(``authz.permit``) and then does exactly what its gRPC handler does (a RunStep's whole
run, on that connection's thread) -- answers::

    OK, u32 length, the reply (StepReport, CommitStepResponse)    or an error frame

A RunStep's answer is read when it comes (``client.outcomes``); a commit's calls to every
stage are written first and their answers read after. A stage without a bulk channel, a
request over ``bulk.MAX_HEADER_BYTES``, or a call that could not be written whole goes over
gRPC instead (nothing was delivered); once written, a connection that breaks, or a commit's
answer that does not come by its deadline (or ``READ_S`` after its first byte), makes the
call ``StageUnavailable`` and closes the connection (a commit is then asked once more over
gRPC: ``CommitStep`` is idempotent). A RunStep's answer that misses the run's deadline is
``DeadlineExceeded``; while a run waits, a stage that stops answering is found by the
others' failures or by the coordinator, and once the run is aborted it has 15 s more
(``client.outcomes``).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from elasticpipe.errors import ElasticPipeError, StageUnavailable
from elasticpipe.logs import get_logger
from elasticpipe.security.tls import TLS
from elasticpipe.transport import bulk, rpc
from elasticpipe.v1 import stage_pb2, stage_pb2_grpc

log = get_logger(__name__)

RUN, COMMIT = b"S", b"C"  # a frame's kind: a RunStepRequest, a CommitStepRequest
CALLS: dict[bytes, tuple[str, Callable[[bytes], Any]]] = {
    RUN: ("RunStep", stage_pb2.RunStepRequest.FromString),
    COMMIT: ("CommitStep", stage_pb2.CommitStepRequest.FromString),
}
MAX_REPLY_BYTES = rpc.MAX_MESSAGE_BYTES  # as gRPC receives (a StepReport's timings)
CONNECT_S = 10.0  # opening a connection (OpenBulk and the handshake), whatever the call's deadline
READ_S = 30.0  # an answer, once its first byte came (a stage writes it at once)


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

    @property
    def connection(self) -> socket.socket | None:
        """The open connection, if any (a call's answer is read from it)."""
        return self._sock

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
            connect_by = min(deadline, time.monotonic() + CONNECT_S)  # (on the caller's thread)
            sock = self._sock = self._sock or bulk.connect(
                self._stub, self.address, self._tls, connect_by, bulk.MAGIC_CALLS
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

    def finish(self, deadline: float, max_bytes: int = MAX_REPLY_BYTES) -> bytes:
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
            deadline = time.monotonic() + READ_S  # the rest, once the first byte came
            if answer == bulk.ERR:
                raise bulk.read_error(sock, self.address, deadline)
            if answer != bulk.OK:
                raise ConnectionError(f"unexpected bulk answer {answer!r}")
            (n,) = bulk.U32.unpack(bulk.recv_bytes(sock, bulk.U32.size, deadline))
            if n > max_bytes:
                raise ConnectionError(f"a bulk reply of {n} bytes (at most {max_bytes})")
            reply = bulk.recv_bytes(sock, n, deadline)
        except ElasticPipeError:
            raise  # the stage's refusal (some are OSErrors too): the connection is fine
        except (OSError, ConnectionError) as exc:
            self.close()
            raise StageUnavailable(f"bulk channel to {self.address}: {exc}") from exc
        return reply

    def close(self) -> None:
        """Closes the connection (the next call opens another)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _fall_back(self, why: str) -> None:
        self.close()
        self._grpc_until = time.monotonic() + bulk.FALLBACK_S
        log.info("bulk_calls_unused", peer=self.address, reason=why, retry_s=bulk.FALLBACK_S)
