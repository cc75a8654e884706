"""Running one stage's ops of a step: take inputs, compute, send on, keep the loss.

The op list comes from ``elasticpipe.training.schedule`` (GPipe, 1F1B or ZB-H1); each op waits in
the mailbox for what it needs (an activation from the previous stage, a gradient from the
next, a target on the last; a W op nothing), computes, and queues its output on the link
to the next or previous stage without waiting for the network. The last stage turns its
output and the micro-batch's target into the scaled loss and its gradient. Nothing here
touches the step protocol: the caller owns the run's state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from elasticpipe.errors import DeadlineExceeded
from elasticpipe.partition import Placement
from elasticpipe.stage_server.devicepath import DevicePath, PlainPath, losses_to_floats
from elasticpipe.stage_server.layers import LayerSlice
from elasticpipe.stage_server.links import Link
from elasticpipe.stage_server.mailbox import Mailbox, Slot
from elasticpipe.stage_server.stash import Stash
from elasticpipe.stage_server.tracing import Span, SpanKind, Tracer
from elasticpipe.training.objectives import scaled_loss_tensor
from elasticpipe.training.schedule import Op, OpKind
from elasticpipe.transport.sending import Outgoing
from elasticpipe.wire import compress, structure
from elasticpipe.wire.structure import Value

FLUSH_SLICE_S = 0.1
# How often a wait for a tensor reads the answers to this thread's sends (``Link.collect``):
# a refused send then fails the run within this, not at the run's deadline.
ANSWER_POLL_S = 0.02
STASH_COUNT_EVERY = 16  # runs of one kind between two counts of their stashed bytes


class StashMeter:
    """Which runs count the bytes their stashes hold, and the last count.

    Counting costs a Python hook per tensor autograd saves (``LayerSlice.forward``'s
    ``count``). What a run holds is a function of its *kind* -- the epoch's layers, the
    ops, and the inputs' shapes and dtypes -- so the meter counts the first run of a kind
    and one in ``STASH_COUNT_EVERY`` after (for layers whose saved tensors depend on the
    data), and a run it does not count reports the last count of its kind.
    """

    def __init__(self) -> None:
        self._kind: tuple[Any, ...] | None = None  # of the last run that counted
        self._since = 0  # runs of the kind since it was last counted
        self.last_bytes = 0
        self.inputs: dict[int, Any] = {}  # that run's input signatures, by micro-batch

    def begins(self, kind: tuple[Any, ...]) -> bool:
        """Whether the run of ``kind`` starting now counts (``counted`` then says what it
        found; a counted run that fails leaves the next run of its kind to count)."""
        if kind != self._kind or self._since + 1 >= STASH_COUNT_EVERY:
            return True
        self._since += 1
        return False

    def counted(self, kind: tuple[Any, ...], nbytes: int, inputs: dict[int, Any]) -> None:
        """The peak bytes of the run of ``kind`` that counted, to the end, and the
        signatures of its inputs by micro-batch."""
        self._kind, self._since, self.last_bytes, self.inputs = kind, 0, nbytes, inputs

    def forget(self) -> None:
        """The next run counts, whatever its kind: a run that did not count met inputs
        of other shapes than the counted run (a batch split otherwise after micro-batch 0)."""
        self._kind = None


@dataclass
class StepResult:
    """What one run of a stage's ops produced."""

    run: int
    losses: list[float] = field(default_factory=list)
    outputs: dict[int, Value] = field(default_factory=dict)  # inference, last stage
    peak_stashed: int = 0
    peak_stashed_bytes: int = 0
    compute_s: float = 0.0
    wall_s: float = 0.0
    forward_s: dict[int, float] = field(default_factory=dict)  # by micro-batch, loss included
    backward_s: dict[int, float] = field(default_factory=dict)  # ZB-H1: the B op's
    weight_s: dict[int, float] = field(default_factory=dict)  # ZB-H1: the W op's
    op_seconds: list[tuple[str, float]] = field(default_factory=list)  # (kind, s), in order
    grad_sq_norm: float = 0.0  # clipping or fp16: of the accumulated (unscaled) gradients
    loss_scale: float = 0.0  # fp16: the loss scale of the run
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
    secret: bytes  # the run's, from its RunStep: every message sent carries it
    step: int
    train: bool
    deadline: float  # time.monotonic() value
    tracer: Tracer = field(default_factory=Tracer)
    path: DevicePath | None = None  # host <-> device copies; None: ``PlainPath``
    stash_meter: StashMeter | None = None  # None: every run counts its stashed bytes
    first_micro_batch: int = 0  # the step's id of the run's micro-batch 0 (a replica's share)
    # told of each layer whose gradients are whole, in the run's last backward (replicas:
    # its reduction may start), highest first; None: nobody waits for them
    layer_done: Callable[[int], None] | None = None


def _loss(
    ctx: RunContext, y: Value, micro_batch: int, target: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scaled loss of one micro-batch (a tensor: read once a step) and the gradient of
    the slice's output."""
    layers = ctx.layers
    last = f"layer {layers.indices[-1]} returned" if layers.indices else "the model returned"
    return scaled_loss_tensor(
        layers.job.loss,
        layers.loss,
        structure.single(y, last),
        target,
        scale,
        f"on micro-batch {micro_batch}",
        layers.loss_scale(),
    )


def _message(method: str, ctx: RunContext, micro_batch: int) -> Callable[[Value], Outgoing]:
    """Wraps a sent value (on the host, once its copy completed) as the link's message."""
    epoch = ctx.placement.epoch
    inference = not ctx.train
    return lambda value: Outgoing(
        method, epoch, ctx.run, ctx.step, micro_batch, value, secret=ctx.secret, inference=inference
    )


def execute(ops: Sequence[Op], ctx: RunContext) -> StepResult:
    """Runs ``ops`` in order and waits for every send to leave. The ops number their
    micro-batches from 0 (the mailbox's and the messages' numbering); the layers see them
    from ``ctx.first_micro_batch`` (a replica's share of the step: their random draws and
    their place in the gradient sum follow the step's global micro-batch ids).

    Raises:
        ElasticPipeError: the run failed (a peer's failure recorded in the mailbox, a
            deadline, the user's code); the caller discards the run.
    """
    result = StepResult(run=ctx.run)
    losses: dict[int, torch.Tensor] = {}
    started = time.perf_counter()
    path = ctx.path or PlainPath(ctx.device)
    # the chain's links only: a reduction under way sends to the other replicas' holders
    placement = ctx.placement
    chain = [ctx.links[a] for a in (placement.prev, placement.next) if a in ctx.links]
    # the gradients of a backward join the sums after its input gradients left (an emulated
    # slow device's sums stay within its device time: ``Slowdown``)
    ctx.layers.defer_takes = ctx.train and ctx.layers.slowdown.factor == 1.0
    try:
        _run_ops(ops, ctx, path, chain, result, losses)
    except BaseException:
        for link in chain:
            link.leave_answers()  # this thread reads no more of them
        path.abandon()  # a link may still read the run's buffers: none is reused
        raise
    finally:
        ctx.layers.defer_takes = False
    path.finish()
    ctx.layers.settle_timings()  # the run's CUDA-event timings: one wait
    result.losses = losses_to_floats([losses[i] for i in sorted(losses)])
    result.wall_s = time.perf_counter() - started
    return result


def _run_ops(
    ops: Sequence[Op],
    ctx: RunContext,
    path: DevicePath,
    chain: Sequence[Link],
    result: StepResult,
    losses: dict[int, torch.Tensor],
) -> None:
    """The ops of ``execute`` (``chain``: the links to the neighbours; ``losses`` by
    micro-batch, read once at the end)."""
    placement, mailbox, run = ctx.placement, ctx.mailbox, ctx.run
    first, last = placement.index == 0, placement.index == placement.num_stages - 1
    # only the plain path's sends leave their answers to this thread (``_take`` reads them)
    owed = chain if isinstance(path, PlainPath) else []
    stashes: dict[int, Stash] = {}
    held: dict[int, int] = {}  # bytes each live stash holds, counted once (``Stash.nbytes``)
    count: bool | None = None  # whether this run counts them: decided at its first forward
    kind: tuple[Any, ...] = ()
    inputs: dict[int, Any] = {}  # each forward's input signature, by micro-batch
    loss_grads: dict[int, torch.Tensor] = {}
    split = any(op.kind is OpKind.WEIGHT for op in ops)  # ZB-H1: B, then W
    whole = OpKind.WEIGHT if split else OpKind.BACKWARD  # the ops after which grads are whole
    final = max((n for n, op in enumerate(ops) if op.kind is whole), default=-1)
    wire_dtype = ctx.layers.job.wire_dtype
    tracer, now, epoch = ctx.tracer, ctx.tracer.now_ns, placement.epoch
    lo, hi, inference = placement.lo, placement.hi, not ctx.train

    def span(kind: SpanKind, i: int, start: int, end: int) -> None:
        tracer.record(Span(kind, start, end, ctx.step, run, i, lo, hi, "", epoch, inference))

    for n, op in enumerate(ops):
        i = op.micro_batch
        done = ctx.layer_done if n == final else None
        if (failure := mailbox.failure(run)) is not None:
            raise failure
        if op.kind is OpKind.FORWARD:
            w0 = now()
            x = path.to_device(_take(ctx, owed, Slot.INPUT, i))
            if not first:
                x = compress.decode_value(x, wire_dtype)  # on the device: half the bytes copied
            target = _take(ctx, owed, Slot.TARGET, i) if last and ctx.train else None
            t0 = now()
            span(SpanKind.RECV_WAIT, i, w0, t0)
            if ctx.stash_meter is not None:
                inputs[i] = structure.signature(x)
            if count is None:
                kind = (epoch, lo, hi, ctx.train, tuple(ops), inputs.get(i))
                count = ctx.stash_meter is None or ctx.stash_meter.begins(kind)
            y, stash = ctx.layers.forward(
                x,
                ctx.train,
                input_grad=not first,
                micro_batch=ctx.first_micro_batch + i,
                step=ctx.step,
                count=count,
                split=split,
            )
            result.compute_s += (now() - t0) / 1e9
            if target is not None:
                target_on = path.to_device(target[0])
                assert isinstance(target_on, torch.Tensor)
                loss_grads[i], losses[i] = _loss(ctx, y, i, target_on, target[1])
            t1 = now()
            span(SpanKind.FORWARD, i, t0, t1)
            result.forward_s[i] = (t1 - t0) / 1e9
            result.op_seconds.append(("forward", result.forward_s[i]))
            if last and not ctx.train:
                result.outputs[i] = path.to_host(structure.detached(y))
            elif not last:
                path.send(
                    ctx.links[placement.next],
                    compress.encode_value(structure.detached(y), wire_dtype),
                    _message("Forward", ctx, i),
                )
            if stash is not None:
                stashes[i] = stash
                result.peak_stashed = max(result.peak_stashed, len(stashes))
                if count:
                    held[i] = stash.nbytes()
                    result.peak_stashed_bytes = max(result.peak_stashed_bytes, sum(held.values()))
        elif op.kind is OpKind.WEIGHT:
            t0 = now()
            held.pop(i, None)
            ctx.layers.backward_weights(
                stashes.pop(i), micro_batch=ctx.first_micro_batch + i, done=done
            )
            t1 = now()
            result.compute_s += (t1 - t0) / 1e9
            span(SpanKind.WEIGHT, i, t0, t1)
            result.weight_s[i] = (t1 - t0) / 1e9
            result.op_seconds.append(("weight", result.weight_s[i]))
        else:
            w0 = now()
            grad: Value
            if last:
                grad = loss_grads.pop(i)
            else:
                taken = path.to_device(_take(ctx, owed, Slot.GRAD, i))
                grad = compress.decode_value(taken, wire_dtype)
            t0 = now()
            if not last:
                span(SpanKind.RECV_WAIT, i, w0, t0)
            stash = stashes[i] if split else stashes.pop(i)
            if not split:
                held.pop(i, None)
            grad_in = ctx.layers.backward(
                stash, grad, micro_batch=ctx.first_micro_batch + i, split=split, done=done
            )
            t1 = now()
            result.compute_s += (t1 - t0) / 1e9
            span(SpanKind.BACKWARD, i, t0, t1)
            result.backward_s[i] = (t1 - t0) / 1e9
            result.op_seconds.append(("backward", result.backward_s[i]))
            if not first and grad_in is not None:
                path.send(
                    ctx.links[placement.prev],
                    compress.encode_value(structure.detached(grad_in), wire_dtype),
                    _message("Backward", ctx, i),
                )
            t2 = now()
            ctx.layers.take_owed()  # this backward's gradients into the sums, once sent on
            took = (now() - t2) / 1e9  # (the backward's, though after its span and send)
            result.compute_s += took
            result.backward_s[i] += took
            result.op_seconds[-1] = ("backward", result.backward_s[i])
            if split and count:  # what W needs is held on: the gradients kept for it
                held[i] = stash.nbytes()
                result.peak_stashed_bytes = max(result.peak_stashed_bytes, sum(held.values()))
    if ctx.stash_meter is not None:
        if count:
            ctx.stash_meter.counted(kind, result.peak_stashed_bytes, inputs)
        elif count is not None:
            result.peak_stashed_bytes = ctx.stash_meter.last_bytes
            if inputs != ctx.stash_meter.inputs:  # a count of other shapes: the next counts
                ctx.stash_meter.forget()
    path.drain(ctx.deadline)  # every device->host copy done and handed to its link
    flush(chain, mailbox, run, ctx.deadline)


def _take(ctx: RunContext, chain: Sequence[Link], slot: Slot, micro_batch: int) -> Any:
    """``Mailbox.take`` that reads, while it waits, the answers to this thread's sends on
    ``chain`` (``Link.collect``): a refused send fails the run now, not at its deadline."""
    while True:
        until = min(ctx.deadline, time.monotonic() + ANSWER_POLL_S) if chain else ctx.deadline
        try:
            return ctx.mailbox.take(ctx.run, slot, micro_batch, until)
        except DeadlineExceeded:
            # the run's failure (a DeadlineExceeded too, for a send that timed out) or its
            # own deadline ends the wait; only the slice's end goes on
            if (failure := ctx.mailbox.failure(ctx.run)) is not None:
                raise failure from None
            if until >= ctx.deadline:
                raise
        for link in chain:
            link.collect()


def flush(links: Iterable[Link], mailbox: Mailbox, run: int, deadline: float) -> None:
    """Waits until every send of ``run`` on ``links`` has left.

    Raises:
        ElasticPipeError: the run failed meanwhile (an abort, a peer's failure, a send
            that failed), or sends were still pending at ``deadline``.
    """
    links = list(links)
    for link in links:
        # Waits for the sends in slices, so that an abort (a recovery preempting the run),
        # a peer's failure or a refusal on another link (``collect``) ends the wait at once.
        while not link.flush(min(FLUSH_SLICE_S, max(0.0, deadline - time.monotonic()))):
            for other in links:
                other.collect()
            if (failure := mailbox.failure(run)) is not None:
                raise failure
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(
                    f"run {run}: sends to {link.address} still pending at the deadline"
                )
    if (failure := mailbox.failure(run)) is not None:
        raise failure
