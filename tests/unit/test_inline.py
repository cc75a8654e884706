"""A RunStep's inline inputs and targets (``stage_server.inline.decode``): what it accepts,
and the clear error each malformed entry gets before anything is delivered."""

from __future__ import annotations

import pytest
import torch

from elasticpipe.errors import InvalidRequest, TooLarge
from elasticpipe.security import bounds
from elasticpipe.stage_server.inline import decode
from elasticpipe.stage_server.mailbox import Slot
from elasticpipe.transport.sending import Outgoing, data_message
from elasticpipe.v1 import stage_pb2

pytestmark = pytest.mark.timeout(30)

SECRET = bytes(range(16))
LIMIT = 1 << 20


def _request(*messages: stage_pb2.DataMessage, micro_batches: int = 2) -> stage_pb2.RunStepRequest:
    return stage_pb2.RunStepRequest(
        epoch=3, run=7, step=5, micro_batches=micro_batches, secret=SECRET, inline=messages
    )


def _input(micro_batch: int, value: object = None, **header: object) -> stage_pb2.DataMessage:
    x = torch.arange(6.0).reshape(2, 3) if value is None else value
    msg = data_message(Outgoing("Forward", 3, 7, 5, micro_batch, x, secret=SECRET))  # type: ignore[arg-type]
    for field, v in header.items():
        setattr(msg.header, field, v)
    return msg


def _target(micro_batch: int, scale: float = 0.5) -> stage_pb2.DataMessage:
    y = torch.tensor([1, 0, 2])
    return data_message(Outgoing("Targets", 3, 7, 5, micro_batch, y, scale, SECRET))


def test_inputs_targets_and_bundles_decode_to_what_was_sent() -> None:
    bundle = (torch.ones(2, 2), torch.tensor([3, 4]))
    got = decode(_request(_input(0), _input(1, bundle), _target(0), _target(1, 0.25)), LIMIT)
    assert [(i.slot, i.micro_batch) for i in got] == [
        (Slot.INPUT, 0),
        (Slot.INPUT, 1),
        (Slot.TARGET, 0),
        (Slot.TARGET, 1),
    ]
    assert torch.equal(got[0].value, torch.arange(6.0).reshape(2, 3))  # type: ignore[arg-type]
    assert isinstance(got[1].value, tuple) and torch.equal(got[1].value[0], torch.ones(2, 2))
    assert torch.equal(got[1].value[1], torch.tensor([3, 4]))
    assert got[2].nbytes == 24 and got[3].loss_scale == 0.25
    assert decode(_request(), LIMIT) == []


@pytest.mark.parametrize(
    ("message", "error", "named"),
    [
        (lambda: _input(0, run=8), InvalidRequest, "run 8"),
        (lambda: _input(0, epoch=2), InvalidRequest, "epoch 2"),
        (lambda: _input(0, step=4), InvalidRequest, "step 4"),
        (lambda: _input(0, secret=bytes(16)), InvalidRequest, "another secret"),
        (lambda: _input(2), InvalidRequest, "micro_batch 2"),
    ],
)
def test_an_entry_that_is_not_this_runs_data_is_refused(
    message: object, error: type[Exception], named: str
) -> None:
    msg = message()  # type: ignore[operator]
    with pytest.raises(error, match=named):
        decode(_request(msg), LIMIT)


def test_a_gradient_is_refused_naming_its_slot() -> None:
    msg = _input(0)
    msg.slot = stage_pb2.GRAD
    with pytest.raises(InvalidRequest, match=f"slot {stage_pb2.GRAD}: only INPUT and TARGET"):
        decode(_request(msg), LIMIT)


def test_a_micro_batch_given_twice_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="input of micro-batch 1 twice"):
        decode(_request(_input(1), _target(1), _input(1)), LIMIT)


def test_bytes_that_do_not_match_the_declared_tensor_are_refused() -> None:
    msg = _input(0)
    msg.data = msg.data[:-4]
    with pytest.raises(InvalidRequest, match="20 bytes for 24 declared"):
        decode(_request(msg), LIMIT)


def test_more_than_the_bound_in_all_is_refused_before_it_is_assembled() -> None:
    msg = _input(0)
    msg.header.meta.shape[:] = [1 << 20, 3]  # declares 12 MiB, carries 24 bytes
    msg.header.meta.nbytes = 12 << 20
    with pytest.raises(TooLarge, match=f"at most {bounds.MAX_INLINE_BYTES}"):
        decode(_request(msg), 64 << 20)
    with pytest.raises(TooLarge):  # one tensor over the stage's own limit
        decode(_request(msg), LIMIT)
