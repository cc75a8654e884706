"""What a run's waiter hears, as it comes: each stage's ``RunStep`` outcome and each
feeder's.

A RunStep sent over gRPC (a future) and a feeder thread post theirs (``post``); a RunStep
written on a stage's bulk channel (``transport.bulk_calls``) is answered on that socket,
which the waiter reads itself when the answer arrives -- no thread between the stage's
reply and the client (``next`` waits on those sockets and on a wake-up socket that
``post`` writes to).
"""

from __future__ import annotations

import contextlib
import queue
import selectors
import socket
import threading
import time
from typing import Any

from google.protobuf.message import DecodeError

from elasticpipe.errors import DeadlineExceeded, ElasticPipeError, StageUnavailable
from elasticpipe.transport import bulk_calls
from elasticpipe.transport.bulk_calls import BulkCaller
from elasticpipe.v1 import stage_pb2


class Answered:
    """A RunStep's outcome read from its bulk channel: ``result`` as a gRPC future's."""

    def __init__(
        self, reply: stage_pb2.StepReport | None = None, error: ElasticPipeError | None = None
    ):
        self._reply, self._error = reply, error

    def result(self) -> stage_pb2.StepReport:
        """The stage's report, or its error raised."""
        if self._error is not None:
            raise self._error
        assert self._reply is not None
        return self._reply


class Outcomes:
    """A run's outcomes, in the order they arrive (``next``); RunSteps written on bulk
    channels (``expect``) are read by the caller of ``next``, each by ``deadline`` (a
    ``time.monotonic()`` value). Holds each such ``BulkCaller``'s lock until its answer is
    read, or until ``close`` (which closes those connections: their answers never came)."""

    def __init__(self, deadline: float):
        self._queue: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._pending: dict[int, tuple[str, BulkCaller, socket.socket]] = {}
        self._closing = threading.Lock()  # ``close`` against a late ``post``
        self._closed = False
        self._shortened = False
        self.deadline = deadline

    def post(self, address: str, outcome: Any) -> None:
        """An outcome from another thread: a gRPC future (``"address"``) or a feeder's
        error or None (``"client"``)."""
        self._queue.put((address, outcome))
        with self._closing:
            if not self._closed:
                with contextlib.suppress(OSError):  # (a full buffer: a wake-up is pending)
                    self._wake_w.send(b"\0")

    def shorten(self, seconds: float) -> None:
        """Waits at most ``seconds`` more for the RunSteps on bulk channels: the run
        failed and was aborted, so a stage that answers nothing by then is taken as gone
        (over gRPC, its channel's keepalive would have ended such a call)."""
        self.deadline = min(self.deadline, time.monotonic() + seconds)
        self._shortened = True

    def expect(self, address: str, caller: BulkCaller) -> None:
        """A RunStep ``caller`` wrote (holding its lock), to be answered on its socket."""
        sock = caller.connection
        assert sock is not None
        self._selector.register(sock, selectors.EVENT_READ, address)
        self._pending[sock.fileno()] = (address, caller, sock)

    def next(self) -> tuple[str, Any]:
        """The next outcome: (address, an object whose ``result()`` gives the report or
        raises) or ("client", a feeder's error or None)."""
        while True:
            try:
                return self._queue.get_nowait()
            except queue.Empty:
                pass
            if not self._pending:
                return self._queue.get()  # gRPC futures and feeders always post
            left = self.deadline - time.monotonic()
            if left <= 0:
                if self._ready(0):  # answers already here are read, not thrown away
                    continue
                fd = next(iter(self._pending))
                address, caller = self._drop(fd)
                caller.close()  # its answer may yet come: the connection is of no more use
                caller.lock.release()
                if self._shortened:  # as a gRPC channel's keepalive ends a call to it
                    gone = StageUnavailable(f"{address} answered nothing after the abort")
                    return address, Answered(error=gone)
                late = DeadlineExceeded(f"no answer to the RunStep on {address} by its deadline")
                return address, Answered(error=late)
            self._ready(left)

    def _ready(self, timeout: float) -> bool:
        """Reads what is ready within ``timeout`` seconds; whether anything was."""
        events = self._selector.select(timeout)
        for key, _ in events:
            if key.fileobj is self._wake_r:
                self._drain()
            else:
                self._read(key.fd)
        return bool(events)

    def _read(self, fd: int) -> None:
        address, caller = self._drop(fd)
        try:
            answer = caller.finish(time.monotonic() + bulk_calls.READ_S)  # (it is readable)
            outcome = Answered(stage_pb2.StepReport.FromString(answer))
        except ElasticPipeError as exc:
            outcome = Answered(error=exc)
        except DecodeError:
            caller.close()
            outcome = Answered(error=StageUnavailable(f"a malformed report from {address}"))
        finally:
            caller.lock.release()
        self._queue.put((address, outcome))

    def _drop(self, fd: int) -> tuple[str, BulkCaller]:
        address, caller, sock = self._pending.pop(fd)
        self._selector.unregister(sock)
        return address, caller

    def _drain(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def __enter__(self) -> Outcomes:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        """Ends the wait: a RunStep still unanswered leaves its connection closed."""
        for fd in list(self._pending):
            _, caller = self._drop(fd)
            caller.close()
            caller.lock.release()
        with self._closing:
            self._closed = True
            self._selector.close()
            self._wake_r.close()
            self._wake_w.close()
