"""Running one stage's ops of a step: take inputs, compute, send on, keep the loss.

The op list comes from ``elasticpipe.schedule`` (GPipe or 1F1B); each op waits in the
mailbox for what it needs (an activation from the previous stage, a gradient from the
next, a target on the last), computes, and queues its output on the link to the next or
previous stage without waiting for the network. The last stage turns its output and the
micro-batch's target into the scaled loss and its gradient. Nothing here touches the
step protocol: the caller owns the run's state.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from elasticpipe import wire
from elasticpipe.errors import DeadlineExceeded, ElasticPipeError, UserCodeError
from elasticpipe.partition import Placement
from elasticpipe.schedule import Op, OpKind
from elasticpipe.stage_server.layers import LayerSlice, Stash
from elasticpipe.stage_server.links import Link
from elasticpipe.stage_server.mailbox import Mailbox, Slot
from elasticpipe.training import loss_fn
from elasticpipe.transport import Outgoing

FLUSH_SLICE_S = 0.1


@dataclass
class StepResult:
    """What one run of a stage's ops produced."""

    run: int
    losses: list[float] = field(default_factory=list)
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)  # inference, last stage
    peak_stashed: int = 0
    peak_stashed_bytes: int = 0
    compute_s: float = 0.0
    wall_s: float = 0.0
    op_seconds: list[tuple[str, float]] = field(default_factory=list)  # (kind, compute)
    grad_sq_norm: float = 0.0  # training with clipping: of the accumulated gradients
    lr: float = 0.0  # training: the learning rate the commit applies


@dataclass(frozen=True)
class RunContext:
    """Everything one run computes with, fixed when it starts."""

    placement: Placement
    layers: LayerSlice
    mailbox: Mailbox
    links: dict[str, Link]
    device: torch.device
    run: int
    step: int
    train: bool
    deadline: float  # time.monotonic() value


def _loss(
    ctx: RunContext, y: torch.Tensor, micro_batch: int, deadline: float
) -> tuple[torch.Tensor, float]:
    """The scaled loss of one micro-batch and the gradient of the slice's output."""
    target, scale = ctx.mailbox.take(ctx.run, Slot.TARGET, micro_batch, deadline)
    name = ctx.layers.job.loss
    out = y.detach().requires_grad_(True)
    try:
        loss = loss_fn(name)(out, target.to(ctx.device)) * scale
        torch.autograd.backward(loss)
    except ElasticPipeError:
        raise
    except Exception as exc:  # the user's targets (or loss) may fail in any way
        raise UserCodeError(
            f"loss {name!r} failed on micro-batch {micro_batch} with output "
            f"{list(y.shape)} and target {list(target.shape)} "
            f"({str(target.dtype).removeprefix('torch.')}): {type(exc).__name__}: {exc}"
        ) from exc
    assert out.grad is not None
    return out.grad, float(loss.detach())


def execute(ops: Sequence[Op], ctx: RunContext) -> StepResult:
    """Runs ``ops`` in order and waits for every send to leave.

    Raises:
        ElasticPipeError: the run failed (a peer's failure recorded in the mailbox, a
            deadline, the user's code); the caller discards the run.
    """
    placement, mailbox, run = ctx.placement, ctx.mailbox, ctx.run
    first, last = placement.index == 0, placement.index == placement.num_stages - 1
    result = StepResult(run=run)
    stashes: dict[int, Stash] = {}
    loss_grads: dict[int, torch.Tensor] = {}
    losses: dict[int, float] = {}
    wire_dtype = ctx.layers.job.wire_dtype
    started = time.perf_counter()
    for op in ops:
        i = op.micro_batch
        if (failure := mailbox.failure(run)) is not None:
            raise failure
        if op.kind is OpKind.FORWARD:
            x = mailbox.take(run, Slot.INPUT, i, ctx.deadline)
            if not first:
                x = wire.decode(x, wire_dtype)
            t0 = time.perf_counter()
            y, stash = ctx.layers.forward(
                x.to(ctx.device), ctx.train, input_grad=not first, micro_batch=i
            )
            result.op_seconds.append(("forward", time.perf_counter() - t0))
            result.compute_s += result.op_seconds[-1][1]
            if last and ctx.train:
                loss_grads[i], losses[i] = _loss(ctx, y, i, ctx.deadline)
            elif last:
                result.outputs[i] = y.detach().cpu()
            else:
                ctx.links[placement.next].put(
                    Outgoing(
                        "Forward",
                        placement.epoch,
                        run,
                        ctx.step,
                        i,
                        wire.encode(y.detach(), wire_dtype),
                    )
                )
            if stash is not None:
                stashes[i] = stash
                result.peak_stashed = max(result.peak_stashed, len(stashes))
                held = sum(s.nbytes() for s in stashes.values())
                result.peak_stashed_bytes = max(result.peak_stashed_bytes, held)
        else:
            if last:
                grad = loss_grads.pop(i)
            else:
                grad = wire.decode(mailbox.take(run, Slot.GRAD, i, ctx.deadline), wire_dtype)
            t0 = time.perf_counter()
            grad_in = ctx.layers.backward(stashes.pop(i), grad.to(ctx.device), micro_batch=i)
            result.op_seconds.append(("backward", time.perf_counter() - t0))
            result.compute_s += result.op_seconds[-1][1]
            if not first and grad_in is not None:
                ctx.links[placement.prev].put(
                    Outgoing(
                        "Backward",
                        placement.epoch,
                        run,
                        ctx.step,
                        i,
                        wire.encode(grad_in.detach(), wire_dtype),
                    )
                )
    for link in ctx.links.values():
        # Waits for the sends in slices, so that an abort (a recovery preempting the run)
        # or a peer's failure ends the wait at once.
        while not link.flush(min(FLUSH_SLICE_S, max(0.0, ctx.deadline - time.monotonic()))):
            if (failure := mailbox.failure(run)) is not None:
                raise failure
            if time.monotonic() >= ctx.deadline:
                raise DeadlineExceeded(
                    f"run {run}: sends to {link.address} still pending at the deadline"
                )
    if (failure := mailbox.failure(run)) is not None:
        raise failure
    result.losses = [losses[i] for i in sorted(losses)]
    result.wall_s = time.perf_counter() - started
    return result
