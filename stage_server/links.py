"""Links to the neighbouring stages: asynchronous sends of activations and gradients.

The executor never waits for the network. A micro-batch's tensor (up to
``bulk.DIRECT_BYTES``) is written on the link's open bulk connection by the executor's own
thread, as far as the socket's buffer takes it at once (the link's thread writes the rest),
and the link's thread reads the answers in order: nothing waits for a thread to wake before
the bytes leave. Anything else -- a large tensor, the first message,
TLS, gRPC -- is queued for the link's thread, which sends one message at a time with a
deadline (and no direct write overtakes a queued message on the connection). A failed
send fails the run it belonged to, naming the peer, so the step ends with an error instead
of a hang.
"""

from __future__ import annotations

import queue
import threading
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
        self._queue: queue.Queue[Outgoing | _Written | None] = queue.Queue()
        self._pending = 0
        self._wire = threading.Lock()  # a direct write, and the count below
        self._queued = 0  # queued messages the thread has not sent yet: no direct write
        self._idle = threading.Condition()
        self._thread = threading.Thread(target=self._drain, name=f"link-{address}", daemon=True)
        self._thread.start()

    def put(self, msg: Outgoing) -> None:
        """Sends ``msg``: written now when it can be (its answer read by the link's
        thread), else queued; returns without waiting for the network either way."""
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
                    self._queue.put(_Written(msg, start, *written))
                    return
            self._queued += 1
        self._queue.put(msg)

    def flush(self, timeout: float) -> bool:
        """Waits until every queued send is done (delivered or failed); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

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
            if isinstance(item, _Written):
                msg, start = item.msg, item.start_ns
            else:
                msg, start = item, self._tracer.now_ns() if self._tracer is not None else 0
            try:
                if isinstance(item, _Written):
                    if item.partial and not self._finished(item):
                        self._resend(msg)
                    else:
                        self._sender.read_answer(item.deadline)
                else:
                    self._sender.send(msg, self._timeout)
                if self._on_sent is not None:
                    self._on_sent(self.address, structure.nbytes(msg.tensor))
                if self._tracer is not None:
                    self._tracer.record(
                        Span(
                            SpanKind.SEND,
                            start,
                            self._tracer.now_ns(),
                            msg.step,
                            msg.run,
                            msg.micro_batch,
                            peer=self.address,
                            epoch=msg.epoch,
                            inference=msg.inference,
                        )
                    )
            except ElasticPipeError as exc:
                log.warning(
                    "send_failed",
                    peer=self.address,
                    method=msg.method,
                    run=msg.run,
                    micro_batch=msg.micro_batch,
                    error=str(exc),
                )
                self._on_failure(msg.run, exc)
            except grpc.RpcError as exc:  # defensive: rpc.call translates these already
                self._on_failure(msg.run, rpc.translate(exc, self.address))
            finally:
                if not isinstance(item, _Written):
                    with self._wire:
                        self._queued -= 1
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


class _Written(NamedTuple):
    """A message the executor's thread wrote (``Link.put``): its answer is still to read."""

    msg: Outgoing
    start_ns: int
    deadline: float
    partial: bool  # the socket took only part of it: the link's thread writes the rest
