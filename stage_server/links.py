"""Links to the neighbouring stages: ordered, asynchronous sends of activations and gradients.

The executor never waits for the network: it queues a tensor and goes on computing; one
sender thread per link streams the tensor in chunks with a deadline. A failed send fails
the run it belonged to, naming the peer, so the step ends with an error instead of a hang.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import grpc

from elasticpipe.errors import ElasticPipeError
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
        self._queue: queue.Queue[Outgoing | None] = queue.Queue()
        self._pending = 0
        self._idle = threading.Condition()
        self._thread = threading.Thread(target=self._drain, name=f"link-{address}", daemon=True)
        self._thread.start()

    def put(self, msg: Outgoing) -> None:
        """Queues a send; returns at once."""
        with self._idle:
            self._pending += 1
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
        while (msg := self._queue.get()) is not None:
            start = self._tracer.now_ns() if self._tracer is not None else 0
            try:
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
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()
