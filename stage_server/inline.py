"""A run's inputs and targets carried in its RunStep (``RunStepRequest.inline``).

Small inputs and targets (a language model's token ids, a classifier's labels) would
otherwise travel as one data message per micro-batch from the client, each a round trip,
and the first stage's first forward would wait for the first of them. Carried in the RunStep
they are in the mailbox before the run's first op.

Each entry is the ``DataMessage`` the data path would carry: its header must name this run
(epoch, run, step and secret), its slot is INPUT or TARGET, and it is checked as data is
(``bundle``'s declared tensors, before anything is allocated; then ``Stage.admit`` and
``Stage.deliver``: the micro-batch's range, the room, a target's loss scale) once the run
has begun (``Stage.run_step``), so it is never early data. All of them together hold at
most ``bounds.MAX_INLINE_BYTES`` of tensor bytes.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from elasticpipe.errors import InvalidRequest, TooLarge
from elasticpipe.security import bounds
from elasticpipe.stage_server.mailbox import Slot
from elasticpipe.v1 import stage_pb2
from elasticpipe.wire import bundle
from elasticpipe.wire.structure import Value

if TYPE_CHECKING:  # (the stage imports this module)
    from elasticpipe.stage_server.stage import Stage

_SLOTS = {stage_pb2.INPUT: Slot.INPUT, stage_pb2.TARGET: Slot.TARGET}


@dataclass(frozen=True)
class Inline:
    """One micro-batch's input or target from a RunStep, decoded."""

    slot: Slot
    micro_batch: int
    value: Value
    loss_scale: float
    nbytes: int


def decode(req: stage_pb2.RunStepRequest, max_tensor_bytes: int) -> list[Inline]:
    """A RunStep's inline inputs and targets, checked and decoded.

    Raises:
        InvalidRequest: a slot other than INPUT or TARGET; a header naming another epoch,
            run, step or secret than the RunStep's; a micro-batch outside the run's, or
            one given twice; bytes that do not match the declared tensors (or
            ``bundle.assembler``'s errors).
        TooLarge: more than ``bounds.MAX_INLINE_BYTES`` of tensor bytes in all (or one
            tensor over ``max_tensor_bytes``).
    """
    bounds.count(req.inline, "inline", 2 * bounds.MAX_MICRO_BATCHES)
    out: list[Inline] = []
    seen: set[tuple[Slot, int]] = set()
    total = 0
    for msg in req.inline:
        slot = _SLOTS.get(msg.slot)
        if slot is None:
            raise InvalidRequest(f"inline data of slot {msg.slot}: only INPUT and TARGET")
        head = msg.header
        ours = (req.epoch, req.run, req.step)
        if (head.epoch, head.run, head.step) != ours:
            raise InvalidRequest(
                f"inline data of epoch {head.epoch}, run {head.run}, step {head.step} in the "
                f"RunStep of epoch {req.epoch}, run {req.run}, step {req.step}"
            )
        if not hmac.compare_digest(head.secret, req.secret):
            raise InvalidRequest(f"inline data of run {req.run} under another secret")
        if not 0 <= head.micro_batch < req.micro_batches:
            raise InvalidRequest(
                f"inline micro_batch {head.micro_batch} outside the run's "
                f"{req.micro_batches} micro-batches"
            )
        if (slot, head.micro_batch) in seen:
            raise InvalidRequest(f"inline {slot.value} of micro-batch {head.micro_batch} twice")
        seen.add((slot, head.micro_batch))
        nbytes = bundle.declared_bytes(head, max_tensor_bytes)
        total += nbytes
        if total > bounds.MAX_INLINE_BYTES:
            raise TooLarge(
                f"inline data of {total}+ bytes (at most {bounds.MAX_INLINE_BYTES} in a RunStep)"
            )
        if len(msg.data) != nbytes:
            raise InvalidRequest(
                f"inline {slot.value} of micro-batch {head.micro_batch}: {len(msg.data)} "
                f"bytes for {nbytes} declared"
            )
        assembler = bundle.assembler(head, max_tensor_bytes)
        assembler.add(msg.data)
        out.append(Inline(slot, head.micro_batch, assembler.finish(), head.loss_scale, nbytes))
    return out


def deliver(stage: Stage, epoch: int, run: int, secret: bytes, items: Sequence[Inline]) -> None:
    """Puts a begun run's inline data into the stage's mailbox, as the data path would
    (``Stage.admit``, ``Stage.deliver``: their errors)."""
    for item in items:
        admitted = stage.admit(epoch, run, item.micro_batch, item.nbytes, item.slot)
        stage.deliver(
            admitted,
            item.slot,
            run,
            item.micro_batch,
            item.value,
            item.loss_scale,
            secret=secret,
        )
