"""Driving one run of a step through the chain: inputs in, targets to the end, reports back.

The client starts every stage's ``RunStep`` at once, streams the micro-batches' inputs to
the first stage and their targets to the last, and waits. The stages pass activations and
gradients among themselves. On the first failure anywhere the client aborts the run on
every stage, so no stage is left waiting for data that will never come; the error it
raises is the root cause, not the aborts it triggered.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import structlog
import torch

from elasticpipe import codec, rpc
from elasticpipe.errors import (
    DeadlineExceeded,
    ElasticPipeError,
    InvalidRequest,
    StageUnavailable,
    StepAborted,
)
from elasticpipe.transport import Outgoing, send
from elasticpipe.v1 import stage_pb2

log = structlog.get_logger()

_SCHEDULE = {"gpipe": stage_pb2.GPIPE, "1f1b": stage_pb2.ONE_F_ONE_B}


@dataclass(frozen=True)
class Chain:
    """The partition a run is computed under."""

    epoch: int
    addresses: tuple[str, ...]
    boundaries: tuple[int, ...]


class StageClients(rpc.StagePool):
    """The client's channels to the stages, and its pool for calling them in parallel."""


def run(
    clients: StageClients,
    chain: Chain,
    run_id: int,
    step: int,
    inputs: Sequence[torch.Tensor],
    targets: Sequence[torch.Tensor] | None,
    scales: Sequence[float],
    schedule: str,
    timeout: float,
) -> list[stage_pb2.StepReport]:
    """Runs one step (``targets`` given) or inference pass (``targets`` None) on ``chain``.

    Returns:
        One report per stage, in chain order.

    Raises:
        ElasticPipeError: the first failure of any stage or send (the run is aborted on
            every stage before this returns).
    """
    if schedule not in _SCHEDULE:
        raise InvalidRequest(f"unknown schedule {schedule!r}")
    train = targets is not None
    request = stage_pb2.RunStepRequest(
        epoch=chain.epoch,
        run=run_id,
        step=step,
        micro_batches=len(inputs),
        schedule=_SCHEDULE[schedule],
        mode=stage_pb2.TRAIN if train else stage_pb2.INFER,
        timeout_s=timeout,
    )
    first, last = chain.addresses[0], chain.addresses[-1]

    def run_stage(address: str) -> stage_pb2.StepReport:
        return rpc.call(address, clients.stub(address).RunStep, request, timeout=timeout + 5.0)

    def feed() -> stage_pb2.StepReport | None:
        for i, x in enumerate(inputs):
            send(
                clients.stub(first),
                first,
                Outgoing("Forward", chain.epoch, run_id, step, i, x),
                timeout,
            )
            if targets is not None:
                send(
                    clients.stub(last),
                    last,
                    Outgoing("Targets", chain.epoch, run_id, step, i, targets[i], scales[i]),
                    timeout,
                )
        return None

    pending: dict[cf.Future[stage_pb2.StepReport | None], str] = {
        clients.executor.submit(run_stage, a): a for a in chain.addresses
    }
    pending[clients.executor.submit(feed)] = "client"
    reports: dict[str, stage_pb2.StepReport] = {}
    errors: list[tuple[str, ElasticPipeError]] = []
    aborted = False
    while pending:
        done, _ = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
        for future in done:
            address = pending.pop(future)
            try:
                result = future.result()
            except ElasticPipeError as exc:
                errors.append((address, exc))
                if not aborted:
                    aborted = True
                    abort(clients, chain.addresses, run_id, f"{address} failed: {exc}")
                continue
            if isinstance(result, stage_pb2.StepReport):
                reports[address] = result
    if errors:
        root = [e for _, e in errors if not isinstance(e, StepAborted)] or [errors[0][1]]
        raise root[0]
    return [reports[a] for a in chain.addresses]


def abort(clients: StageClients, addresses: Sequence[str], run_id: int, reason: str) -> None:
    """Discards a run on every stage (best effort: a dead stage has nothing to discard)."""
    request = stage_pb2.AbortStepRequest(run=run_id, reason=reason[:500])

    def one(address: str) -> None:
        try:
            rpc.call(address, clients.stub(address).AbortStep, request, timeout=15.0)
        except ElasticPipeError as exc:
            log.debug("abort_not_delivered", stage=address, run=run_id, error=str(exc))

    list(clients.executor.map(one, addresses))


def commit(clients: StageClients, chain: Chain, run_id: int, step: int) -> None:
    """Commits a completed step on every stage (each applies its optimizer step)."""
    request = stage_pb2.CommitStepRequest(epoch=chain.epoch, run=run_id, step=step)

    def one(address: str) -> None:
        # CommitStep is idempotent: a commit whose reply was lost is asked again.
        try:
            rpc.call(address, clients.stub(address).CommitStep, request, timeout=30.0)
        except (StageUnavailable, DeadlineExceeded):
            rpc.call(address, clients.stub(address).CommitStep, request, timeout=30.0)

    futures = [clients.executor.submit(one, a) for a in chain.addresses]
    failures = []
    for address, future in zip(chain.addresses, futures, strict=True):
        try:
            future.result()
        except ElasticPipeError as exc:
            failures.append(f"{address}: {exc}")
    if failures:
        raise StepAborted(f"step {step} was not committed on every stage: {failures}")


def fetch_output(
    clients: StageClients, address: str, run_id: int, micro_batch: int, timeout: float
) -> torch.Tensor:
    """Downloads one inference output from the last stage."""
    request = stage_pb2.FetchOutputRequest(run=run_id, micro_batch=micro_batch)
    try:
        stream = iter(clients.stub(address).FetchOutput(request, timeout=timeout))
        header = next(stream).header
        assembler = codec.TensorAssembler(header.meta)
        for chunk in stream:
            assembler.add(chunk.data)
    except grpc.RpcError as exc:
        raise rpc.translate(exc, address) from exc
    return assembler.finish()
