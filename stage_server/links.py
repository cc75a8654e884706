"""Links to the neighbouring stages: asynchronous sends of activations and gradients.

The executor never waits for the network. A micro-batch's tensor (up to
``bulk.DIRECT_BYTES``) is written on the link's open bulk connection by the executor's own
thread, as far as the socket's buffer takes it at once (the link's thread writes the rest),
and nothing waits for a thread to wake before the bytes leave. The answers come in the
order of the messages. A message written whole by a thread that said it reads its own
answers (``put(answer_here=True)``: the executor's) has its answer read by that thread,
when it has come: at its next send (``collect``), while it waits for a tensor
(``collect``, every ``executor.ANSWER_POLL_S``) and at the run's end (``flush``), so that no
thread wakes per message. Every other answer is read by the link's thread, which first
reads those before it. Anything else -- a large tensor, the first message, TLS, gRPC -- is
queued for the link's thread, which sends one message at a time with a deadline (and no
direct write overtakes a queued message on the connection). A failed send fails the run it
belonged to, naming the peer, so the step ends with an error instead of a hang.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

import grpc

from elasticpipe.errors import ElasticPipeError, StageUnavailable
from elasticpipe.logs import get_logger
from elasticpipe.security.tls import TLS
from elasticpipe.stage_server.tracing import Span, SpanKind, Tracer
from elasticpipe.transport import rpc
from elasticpipe.transport.sending import Outgoing, Sender
from elasticpipe.v1 import stage_pb2_grpc
from elasticpipe.wire import structure

log = get_logger(__name__)

READ_ANSWER_S = 1.0  # at least, to read an answer that has come (an error's body follows)


class Link:
    """An ordered queue of sends to one peer, drained by its own thread."""

    def __init__(
        self,
        address: str,
        on_failure: Callable[[int, ElasticPipeError], None],
        timeout: float,
        tls: TLS | None = None,
        on_sent: Callable[[str, int], None] | None = None,
        tracer: Tracer | None = None,
        use_bulk: bool = True,
    ):
        self.address = address
        self._on_sent = on_sent  # (peer, tensor bytes) of each delivered send: metrics
        self._channel = rpc.channel(address, tls)
        self._sender = Sender(
            stage_pb2_grpc.StageServiceStub(self._channel), address, tls, use_bulk
        )
        self._on_failure = on_failure
        self._timeout = timeout
        self._tracer = tracer
        self._queue: queue.Queue[Outgoing | _Written | _Owed | None] = queue.Queue()
        self._pending = 0
        self._wire = threading.Lock()  # a direct write, and the count below
        self._queued = 0  # queued messages the thread has not sent yet: no direct write
        # Direct writes whose answers are unread, in the order they were written (appended
        # under ``_wire``); an answer is read, and its write taken off, under ``_reading``.
        self._unread: deque[_Written] = deque()
        self._reading = threading.Lock()
        self._idle = threading.Condition()
        self._thread = threading.Thread(target=self._drain, name=f"link-{address}", daemon=True)
        self._thread.start()

    def put(self, msg: Outgoing, answer_here: bool = False) -> None:
        """Sends ``msg``: written now when it can be, else queued; returns without waiting
        for the network either way. ``answer_here``: the calling thread reads the answer of
        a message written whole (``collect``, ``flush``); else the link's thread does."""
        if answer_here:
            self.collect()  # the answers come in order: those already here make room
        with self._idle:
            self._pending += 1
        with self._wire:
            if not self._queued:
                start = self._tracer.now_ns() if self._tracer is not None else 0
                try:
                    written = self._sender.write_now(msg, self._timeout)
                except Exception:  # e.g. a dtype the wire cannot carry: ``send`` says so
                    written = None
                if written is not None:
                    deadline, partial = written
                    here = answer_here and not partial
                    end = self._tracer.now_ns() if here and self._tracer is not None else 0
                    item = _Written(msg, start, deadline, partial, here, end)
                    self._unread.append(item)
                    if not here:
                        self._queue.put(item)
                    return
            self._queued += 1
        self._queue.put(msg)

    def collect(self, wait_until: float | None = None) -> None:
        """Reads the answers of the direct writes at the head of the line whose writer reads
        them (``put(answer_here=True)``), as far as they have come; with ``wait_until`` (a
        ``time.monotonic()`` value), waiting for them until then. A refusal fails its run
        (``on_failure``). Returns at once while the link's thread reads answers (without
        ``wait_until``) and at the first write whose answer is the link's thread's."""
        if wait_until is None:
            if not self._unread or not self._reading.acquire(blocking=False):
                return
        elif not self._reading.acquire(timeout=max(0.0, wait_until - time.monotonic())):
            return
        try:
            while self._unread and self._unread[0].here:
                item = self._unread[0]
                wait = 0.0 if wait_until is None else max(0.0, wait_until - time.monotonic())
                if not self._sender.answer_waiting(wait) and time.monotonic() < item.deadline:
                    return
                self._answer(item)
        finally:
            self._reading.release()

    def flush(self, timeout: float) -> bool:
        """Waits until every send is done (delivered or failed), reading the answers this
        thread owes (``collect``); False on timeout."""
        until = time.monotonic() + timeout
        while True:
            self.collect(until)
            with self._idle:
                if self._pending == 0:
                    return True
                remaining = until - time.monotonic()
                if remaining <= 0:
                    return False
                # woken by every answer: one this thread owes may now be first in line
                self._idle.wait_for(lambda: self._pending == 0 or self._owed_first(), remaining)

    def _owed_first(self) -> bool:
        try:  # (the link's thread may take the last one off meanwhile)
            return self._unread[0].here
        except IndexError:
            return False

    def leave_answers(self) -> None:
        """The writer will not read the answers it owes (its run failed): the link's thread
        reads them, up to the last written now, so that their tensors go and a refusal is
        still reported."""
        with self._wire:
            last = self._unread[-1] if self._unread else None
        if last is not None and last.here:
            self._queue.put(_Owed(last))

    def close(self) -> None:
        """Stops the sender thread and closes the channel."""
        self._queue.put(None)
        self._thread.join(timeout=5)  # the thread closes its sender as it ends
        self._channel.close()

    def _drain(self) -> None:
        try:
            self._send_all()
        finally:
            self._sender.close()

    def _send_all(self) -> None:
        while (item := self._queue.get()) is not None:
            if isinstance(item, _Owed):
                with self._reading:
                    if any(w is item.last for w in self._unread):  # not read meanwhile
                        while self._unread and self._unread[0].here:
                            head = self._unread[0]
                            self._answer(head)
                            if head is item.last:
                                break
                continue
            if isinstance(item, _Written):
                with self._reading:
                    self._answer_before(item)
                    self._answer(item)
                continue
            start = self._tracer.now_ns() if self._tracer is not None else 0
            error: ElasticPipeError | None = None
            try:
                with self._reading:
                    self._answer_before(None)
                self._sender.send(item, self._timeout)
            except ElasticPipeError as exc:
                error = exc
            except grpc.RpcError as exc:  # defensive: rpc.call translates these already
                error = rpc.translate(exc, self.address)
            except BaseException as exc:  # a bug: the run fails, the thread ends with it
                error = StageUnavailable(f"send to {self.address} failed: {exc!r}")
                raise
            finally:
                with self._wire:
                    self._queued -= 1
                self._done(item, start, error)

    def _answer_before(self, item: _Written | None) -> None:
        """Reads the answers of the writes ahead of ``item`` (None: of all of them): those
        their writer reads, which it has not read yet (``_reading`` held)."""
        while self._unread and self._unread[0] is not item:
            self._answer(self._unread[0])

    def _answer(self, item: _Written) -> None:
        """Reads the answer to ``item``, the oldest write (``_reading`` held; the link's
        thread first writes the rest of a partial write, or sends it again)."""
        error: ElasticPipeError | None = None
        try:
            if item.partial and not self._finished(item):
                self._resend(item.msg)
            elif self._sender.answer_waiting(0.0):
                # come in time or not, it has come (a writer may read it long after): what
                # may follow it (an error's body) gets the rest of its time, or a little
                now = time.monotonic()
                self._sender.read_answer(max(item.deadline, now + READ_ANSWER_S))
            else:
                self._sender.read_answer(item.deadline)
        except ElasticPipeError as exc:
            error = exc
        except grpc.RpcError as exc:  # defensive, as in ``_send_all``
            error = rpc.translate(exc, self.address)
        except BaseException as exc:  # a bug: the run fails, and so does the reader
            error = StageUnavailable(f"send to {self.address} failed: {exc!r}")
            raise
        finally:
            self._unread.popleft()
            self._done(item.msg, item.start_ns, error, item.end_ns)

    def _done(
        self, msg: Outgoing, start: int, error: ElasticPipeError | None, end: int = 0
    ) -> None:
        """One send ended: counted and traced if delivered, its run failed if not
        (``end``: when its writer finished writing it, for a write whose answer that
        writer read -- its span is the write; 0: the span ends now, with the answer)."""
        try:
            if error is not None:
                log.warning(
                    "send_failed",
                    peer=self.address,
                    method=msg.method,
                    run=msg.run,
                    micro_batch=msg.micro_batch,
                    error=str(error),
                )
                self._on_failure(msg.run, error)
                return
            if self._on_sent is not None:
                self._on_sent(self.address, structure.nbytes(msg.tensor))
            if self._tracer is not None:
                self._tracer.record(
                    Span(
                        SpanKind.SEND,
                        start,
                        end or self._tracer.now_ns(),
                        msg.step,
                        msg.run,
                        msg.micro_batch,
                        peer=self.address,
                        epoch=msg.epoch,
                        inference=msg.inference,
                    )
                )
        finally:
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()

    def _resend(self, msg: Outgoing) -> None:
        """Sends a direct write that a broken connection cut short (it was delivered
        nowhere) on a new one, counted as queued so that no direct write shares it."""
        with self._wire:
            self._queued += 1
        try:
            self._sender.send(msg, self._timeout)
        finally:
            with self._wire:
                self._queued -= 1

    def _finished(self, item: _Written) -> bool:
        """Writes the rest of a direct write; False when the connection broke first."""
        try:
            self._sender.finish(item.deadline)
        except StageUnavailable as exc:
            log.info("direct_write_resent", peer=self.address, run=item.msg.run, error=str(exc))
            return False
        return True


class _Owed(NamedTuple):
    """Queued by ``leave_answers``: the link's thread reads the answers the writer owes,
    through ``last``."""

    last: _Written


class _Written(NamedTuple):
    """A message written from the caller's thread (``Link.put``): its answer is still to
    read."""

    msg: Outgoing
    start_ns: int
    deadline: float
    partial: bool  # the socket took only part of it: the link's thread writes the rest
    here: bool  # its writer reads its answer (``collect``); else the link's thread
    end_ns: int  # (``here``) when it was written: its span's end
