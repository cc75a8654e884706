"""Driving one run of a step through the chain: inputs in, targets to the end, reports back.

The client starts every stage's ``RunStep`` at once -- written on the stage's bulk channel
(``transport.bulk_calls``; each answer read when it comes, ``outcomes``), or as a gRPC
future where it has none: no thread per stage, so chains of any length work -- and waits.
Small inputs and targets (``INLINE_BYTES`` in all) travel in the first and the last stage's
RunStep; larger ones stream from one feeder thread, a message per micro-batch. The stages
pass activations and gradients among themselves. On the first failure anywhere the client
aborts the run on every stage, so no stage is left waiting for data that will never come;
the error it raises is the root cause, not the aborts it triggered.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import torch
from google.protobuf.message import DecodeError

from elasticpipe.client.outcomes import Outcomes
from elasticpipe.errors import (
    DeadlineExceeded,
    ElasticPipeError,
    Fenced,
    InvalidRequest,
    StageUnavailable,
    StepAborted,
)
from elasticpipe.layout import Layout
from elasticpipe.logs import get_logger
from elasticpipe.partition import Partition
from elasticpipe.security import bounds
from elasticpipe.security.tls import TLS
from elasticpipe.training.clipping import NO_CLIP, GradClip
from elasticpipe.transport import bulk, bulk_calls, rpc
from elasticpipe.transport.bulk_calls import BulkCaller
from elasticpipe.transport.sending import Outgoing, Sender, data_message
from elasticpipe.v1 import stage_pb2
from elasticpipe.wire import bundle, codec, structure
from elasticpipe.wire.structure import Value

log = get_logger(__name__)

_SCHEDULE = {"gpipe": stage_pb2.GPIPE, "1f1b": stage_pb2.ONE_F_ONE_B, "zb-h1": stage_pb2.ZB_H1}
ABORT_TIMEOUT_S = 15.0
COMMIT_TIMEOUT_S = 30.0
# A chain's inputs, or its targets, of at most this many bytes in all travel in its RunSteps
# (``RunStepRequest.inline``); larger ones go on the data path, a message per micro-batch.
INLINE_BYTES = 256 << 10


class StageClients(rpc.StagePool):
    """The client's channels to the stages, a sender per stage for inputs and targets
    (large ones over the bulk channel, ``elasticpipe.transport.bulk``), used by one send at a
    time, and a bulk connection per stage for its RunSteps and commits (``bulk_calls``),
    used by one call at a time."""

    def __init__(self, tls: TLS | None = None):
        super().__init__(tls=tls)
        self._senders: dict[str, tuple[threading.Lock, Sender]] = {}
        self._callers: dict[str, BulkCaller] = {}

    def send(self, address: str, msg: Outgoing, timeout: float) -> None:
        """Sends one message to ``address`` (``transport.Sender.send``)."""
        stub = self.stub(address)
        with self._lock:
            entry = self._senders.get(address)
            if entry is None:
                entry = self._senders[address] = (
                    threading.Lock(),
                    Sender(stub, address, self.tls),
                )
        lock, sender = entry
        with lock:
            sender.send(msg, timeout)

    def commit_each(
        self, addresses: Sequence[str], request: stage_pb2.CommitStepRequest, timeout: float
    ) -> list[Any | ElasticPipeError]:
        """``CommitStep`` on every stage at once, over each one's bulk channel where it has
        one (``bulk_calls``: every call written, then every answer read), else over gRPC.

        Returns:
            In order, each reply, or the error of that stage.
        """
        deadline = time.monotonic() + timeout
        body = request.SerializeToString()
        out: dict[str, Any] = {}
        started: list[BulkCaller] = []
        try:
            for address in addresses:
                caller = self._start(address, bulk_calls.COMMIT, body, deadline, out)
                if caller is not None:
                    started.append(caller)
            while started:
                caller = started[0]
                try:
                    reply = caller.finish(deadline)
                    out[caller.address] = stage_pb2.CommitStepResponse.FromString(reply)
                except ElasticPipeError as exc:
                    out[caller.address] = exc
                except DecodeError as exc:
                    caller.close()
                    out[caller.address] = StageUnavailable(f"{caller.address}: {exc}")
                started.pop(0)
                caller.lock.release()
        finally:
            for caller in started:  # (interrupted) their answers unread: of no more use
                caller.close()
                caller.lock.release()
        rest = [a for a in addresses if a not in out]
        if rest:
            replies = self.each([(a, request) for a in rest], "CommitStep", timeout)
            out.update(zip(rest, replies, strict=True))
        return [out[a] for a in addresses]

    def start_call(
        self, address: str, kind: bytes, request: Any, deadline: float
    ) -> BulkCaller | None:
        """Writes ``request`` (a RunStep's) on ``address``'s bulk channel and returns its
        caller, locked until its answer is read (``Outcomes``); None when it must go over
        gRPC (no channel, too large a request, or it could not be written)."""
        body = request.SerializeToString()
        if len(body) > bulk.MAX_HEADER_BYTES:
            return None
        return self._start(address, kind, body, deadline, {})

    def _start(
        self, address: str, kind: bytes, body: bytes, deadline: float, refused: dict[str, Any]
    ) -> BulkCaller | None:
        """``address``'s caller with ``body`` written, locked; None, unlocked, when the call
        must go over gRPC (``refused[address]``: the error, where ``OpenBulk`` refused as
        gRPC would the call)."""
        caller = self._caller(address)
        caller.lock.acquire()
        written = False
        try:
            written = caller.start(kind, body, deadline)
        except ElasticPipeError as exc:
            refused[address] = exc
        finally:
            if not written:
                caller.lock.release()
        return caller if written else None

    def _caller(self, address: str) -> BulkCaller:
        stub = self.stub(address)
        with self._lock:
            caller = self._callers.get(address)
            if caller is None:
                caller = self._callers[address] = BulkCaller(stub, address, self.tls)
            return caller

    def close(self) -> None:
        """Closes every bulk connection and channel."""
        with self._lock:
            senders, self._senders = list(self._senders.values()), {}
            callers, self._callers = list(self._callers.values()), {}
        for lock, sender in senders:
            with lock:
                sender.close()
        for caller in callers:
            with caller.lock:
                caller.close()
        super().close()


def new_secret() -> bytes:
    """A fresh run's secret: ``bounds.RUN_SECRET_BYTES`` random bytes. Run ids are ordered
    (the stages fence by them) and so easy to guess; the secret is not, so a process that
    does not hold the job cannot feed a run data (docs/security.md#run-secrets)."""
    return secrets.token_bytes(bounds.RUN_SECRET_BYTES)


class CommitIncomplete(StepAborted):
    """Some stages could not be told to commit (the step is decided: commit)."""

    def __init__(self, message: str, failed: dict[str, ElasticPipeError]):
        super().__init__(message)
        self.failed = failed


def run(
    clients: StageClients,
    partition: Partition,
    run_id: int,
    step: int,
    inputs: Sequence[Value],
    targets: Sequence[torch.Tensor] | None,
    scales: Sequence[float],
    schedule: str,
    timeout: float,
    client: int = 0,
    previous: Sequence[stage_pb2.StepDecision] = (),
    *,
    secret: bytes,
) -> list[stage_pb2.StepReport]:
    """Runs one step (``targets`` given) or inference pass (``targets`` None).

    ``secret`` (``new_secret``) goes to every stage with the RunStep and in every input
    and target: the stages take only data that carries it.

    Returns:
        One report per stage, in chain order.

    Raises:
        ElasticPipeError: the first failure of any stage or send (the run is aborted on
            every stage before this returns).
    """
    chain = Chain(partition, inputs, targets, scales)
    reports = _run([chain], (), run_id, step, schedule, timeout, client, previous, clients, secret)
    return reports[0]


@dataclass(frozen=True)
class Chain:
    """One replica's chain in a run, and the micro-batches it runs (its share)."""

    partition: Partition
    inputs: Sequence[Value]
    targets: Sequence[torch.Tensor] | None
    scales: Sequence[float]


def run_replicas(
    clients: StageClients,
    layout: Layout,
    run_id: int,
    step: int,
    inputs: Sequence[Value],
    targets: Sequence[torch.Tensor],
    scales: Sequence[float],
    schedule: str,
    timeout: float,
    client: int = 0,
    previous: Sequence[stage_pb2.StepDecision] = (),
    *,
    secret: bytes,
    generation: int = 0,
) -> list[list[stage_pb2.StepReport]]:
    """Runs one training step on every replica of ``layout`` at once: each replica's chain
    its share of the step's micro-batches (``inputs``, ``targets`` and ``scales`` are the
    whole step's), one run id and secret for all; the stages reduce their gradients with
    the other replicas' before they report (with collectives, on the process groups of
    ``generation``).

    Returns:
        Per replica, one report per stage in chain order.

    Raises:
        ElasticPipeError: the first failure of any stage or send, in any replica (the run
            is aborted on every stage of every replica before this returns, so that no
            holder waits out its deadline for a piece that will not come).
    """
    chains = [
        Chain(
            replica,
            [inputs[k] for k in layout.share_of(r)],
            [targets[k] for k in layout.share_of(r)],
            [scales[k] for k in layout.share_of(r)],
        )
        for r, replica in enumerate(layout.replicas)
    ]
    shares = layout.shares
    return _run(
        chains,
        shares,
        run_id,
        step,
        schedule,
        timeout,
        client,
        previous,
        clients,
        secret,
        generation,
    )


def _run(
    chains: Sequence[Chain],
    shares: Sequence[int],
    run_id: int,
    step: int,
    schedule: str,
    timeout: float,
    client: int,
    previous: Sequence[stage_pb2.StepDecision],
    clients: StageClients,
    secret: bytes,
    generation: int = 0,
) -> list[list[stage_pb2.StepReport]]:
    """Starts every chain's RunSteps at once (each on its stage's bulk channel, else as a
    gRPC future), feeds each chain that needs it from a thread of its own, and waits
    (``Outcomes``); the first failure aborts the run on every stage."""
    if schedule not in _SCHEDULE:
        raise InvalidRequest(f"unknown schedule {schedule!r}")
    everyone = [a for chain in chains for a in chain.partition.addresses]
    with Outcomes(time.monotonic() + timeout + 5.0) as outcomes:  # the gRPC futures' deadline

        def feed(chain: Chain, inputs: list[Outgoing], targets: list[Outgoing]) -> None:
            addresses = chain.partition.addresses
            try:
                for i in range(max(len(inputs), len(targets))):
                    if i < len(inputs):
                        clients.send(addresses[0], inputs[i], timeout)
                    if i < len(targets):
                        clients.send(addresses[-1], targets[i], timeout)
            except ElasticPipeError as exc:
                outcomes.post("client", exc)
                return
            outcomes.post("client", None)

        def on_done(address: str) -> Any:
            return lambda future: outcomes.post(address, future)

        feeds: list[tuple[Chain, list[Outgoing], list[Outgoing]]] = []
        data = [_data(chain, run_id, step, secret) for chain in chains]
        carried = [(_carried(inputs), _carried(targets)) for inputs, targets in data]
        for chain, (inputs, targets), (first, last) in zip(chains, data, carried, strict=True):
            request = stage_pb2.RunStepRequest(
                epoch=chain.partition.epoch,
                run=run_id,
                step=step,
                micro_batches=len(chain.inputs),
                schedule=_SCHEDULE[schedule],
                mode=stage_pb2.TRAIN if chain.targets is not None else stage_pb2.INFER,
                timeout_s=timeout,
                client=client,
                previous=previous,
                secret=secret,
                shares=shares,
                reduce_generation=generation,
            )
            addresses = chain.partition.addresses
            for k, address in enumerate(addresses):
                inline = (first if k == 0 else []) + (last if k == len(addresses) - 1 else [])
                own = request
                if inline:
                    own = stage_pb2.RunStepRequest()
                    own.CopyFrom(request)
                    own.inline.extend(inline)
                caller = clients.start_call(address, bulk_calls.RUN, own, outcomes.deadline)
                if caller is not None:
                    outcomes.expect(address, caller)
                    continue
                future = clients.stub(address).RunStep.future(own, timeout=timeout + 5.0)
                future.add_done_callback(on_done(address))
            rest = ([] if first else inputs, [] if last else targets)
            if rest[0] or rest[1]:
                feeds.append((chain, *rest))
        for fed in feeds:
            threading.Thread(target=feed, args=fed, name=f"feed-{run_id}", daemon=True).start()

        reports: dict[str, stage_pb2.StepReport] = {}
        errors: list[ElasticPipeError] = []
        for _ in range(len(everyone) + len(feeds)):
            address, outcome = outcomes.next()
            error: ElasticPipeError | None = None
            if address == "client":
                error = outcome
            else:
                try:
                    reports[address] = outcome.result()
                except grpc.RpcError as exc:
                    error = rpc.translate(exc, address)
                except ElasticPipeError as exc:  # (a RunStep on the bulk channel)
                    error = exc
            if error is not None:
                if not errors:
                    abort(clients, everyone, run_id, f"{address} failed: {error}", client)
                    outcomes.shorten(ABORT_TIMEOUT_S)
                errors.append(error)
        if errors:
            root = [e for e in errors if not isinstance(e, StepAborted)] or errors
            raise root[0]
        return [[reports[a] for a in chain.partition.addresses] for chain in chains]


def _data(
    chain: Chain, run_id: int, step: int, secret: bytes
) -> tuple[list[Outgoing], list[Outgoing]]:
    """A chain's inputs (to its first stage) and targets (to its last) as data messages."""
    epoch = chain.partition.epoch
    inputs = [
        Outgoing("Forward", epoch, run_id, step, i, x, secret=secret)
        for i, x in enumerate(chain.inputs)
    ]
    if chain.targets is None:
        return inputs, []
    targets = [
        Outgoing("Targets", epoch, run_id, step, i, chain.targets[i], chain.scales[i], secret)
        for i in range(len(chain.inputs))
    ]
    return inputs, targets


def _carried(messages: list[Outgoing]) -> list[stage_pb2.DataMessage]:
    """``messages`` as a RunStep carries them (``RunStepRequest.inline``) when they are
    small (``INLINE_BYTES`` in all), else none: they go on the data path, one at a time."""
    if not messages or sum(structure.nbytes(m.tensor) for m in messages) > INLINE_BYTES:
        return []
    return [data_message(m) for m in messages]


def _all(
    clients: StageClients, addresses: Sequence[str], method: str, request: Any, timeout: float
) -> dict[str, ElasticPipeError]:
    """Calls ``method`` on every stage at once; the failures by address."""
    results = clients.each([(a, request) for a in addresses], method, timeout)
    return {
        a: r for a, r in zip(addresses, results, strict=True) if isinstance(r, ElasticPipeError)
    }


def abort(
    clients: StageClients, addresses: Sequence[str], run_id: int, reason: str, client: int = 0
) -> None:
    """Discards a run on every stage (best effort: a dead stage has nothing to discard)."""
    request = stage_pb2.AbortStepRequest(run=run_id, reason=reason[:500], client=client)
    for address, error in _all(clients, addresses, "AbortStep", request, ABORT_TIMEOUT_S).items():
        log.debug("abort_not_delivered", stage=address, run=run_id, error=str(error))


def commit(
    clients: StageClients,
    partition: Partition | Layout,
    run_id: int,
    step: int,
    client: int = 0,
    clip: GradClip = NO_CLIP,
) -> None:
    """Commits a completed step on every stage (each records the decision, replies, then
    applies its optimizer step before anything else: ``stage_server.deferral``): every
    stage of every replica, given a layout.

    CommitStep is idempotent: a stage whose commit (or its reply) was lost is asked once
    more.

    Raises:
        Fenced: a stage follows a newer client generation: this client lost the job,
            and the run is decided without it (this step may well be aborted).
        CommitIncomplete: some stages still could not be told; the decision stands
            (commit), and they learn it from the next run or from recovery.
    """
    request = stage_pb2.CommitStepRequest(
        epoch=partition.epoch, run=run_id, step=step, client=client, clip=clip.to_proto()
    )
    addresses = partition.addresses
    results = clients.commit_each(addresses, request, COMMIT_TIMEOUT_S)
    failed = {
        a: r for a, r in zip(addresses, results, strict=True) if isinstance(r, ElasticPipeError)
    }
    retry = [a for a, e in failed.items() if isinstance(e, StageUnavailable | DeadlineExceeded)]
    if retry:
        failed = {a: e for a, e in failed.items() if a not in retry}
        failed |= _all(clients, retry, "CommitStep", request, COMMIT_TIMEOUT_S)
    fenced = [e for e in failed.values() if isinstance(e, Fenced)]
    if fenced:
        raise fenced[0]  # another client holds the job: the coordinator settled this run
    if failed:
        raise CommitIncomplete(
            f"step {step} could not be committed on {sorted(failed)}: "
            f"{next(iter(failed.values()))}",
            failed,
        )


def fetch_output(
    clients: StageClients,
    address: str,
    run_id: int,
    micro_batch: int,
    timeout: float,
    secret: bytes,
) -> Value:
    """Downloads one inference output (a tensor, or a tuple or dict of them) from the last
    stage (``secret``: the run's, as ``run`` sent it)."""
    request = stage_pb2.FetchOutputRequest(run=run_id, micro_batch=micro_batch, secret=secret)
    try:
        stream = iter(clients.stub(address).FetchOutput(request, timeout=timeout))
        header = next(stream).header
        assembler = bundle.assembler(header, codec.DEFAULT_MAX_TENSOR_BYTES)
        for chunk in stream:
            assembler.add(chunk.data)
    except grpc.RpcError as exc:
        raise rpc.translate(exc, address) from exc
    return assembler.finish()
