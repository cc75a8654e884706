"""Tests of several tensors in one data message: round trips and checks before allocation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticpipe.errors import InvalidRequest, TooLarge
from elasticpipe.v1 import stage_pb2, tensor_pb2
from elasticpipe.wire import bundle, codec


def _head(value: object) -> stage_pb2.DataHeader:
    head = stage_pb2.DataHeader(run=1)
    bundle.describe(head, value)  # type: ignore[arg-type]
    return head


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 7), max_size=4), st.integers(1, 9), st.booleans())
def test_round_trip_over_chunks_that_span_tensors(
    lengths: list[int], chunk: int, as_dict: bool
) -> None:
    """Tensors of mixed dtypes (float, bool, int) come back equal, whatever the chunk size
    (chunks re-cut at arbitrary points, spanning tensor boundaries)."""
    g = torch.Generator().manual_seed(len(lengths))
    parts = [
        [torch.randn(n, generator=g), torch.rand(n, generator=g) > 0.5, torch.arange(n)][k % 3]
        for k, n in enumerate(lengths)
    ]
    value = {f"t{k}": t for k, t in enumerate(parts)} if as_dict else tuple(parts)
    head = _head(value)
    raw = bundle.data(value)  # type: ignore[arg-type]
    assert len(raw) == bundle.declared_bytes(head, 1 << 20)
    assembler = bundle.assembler(head, 1 << 20)
    for start in range(0, len(raw), chunk):
        assembler.add(raw[start : start + chunk])
    back = assembler.finish()
    assert type(back) is type(value)
    want = list(value.values()) if isinstance(value, dict) else list(value)
    got = list(back.values()) if isinstance(back, dict) else list(back)  # type: ignore[arg-type]
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_a_single_tensor_keeps_the_plain_header() -> None:
    """One tensor is declared in ``meta`` alone (no structure, no parts): the old format."""
    head = _head(torch.ones(2, 3))
    assert not head.structure and not head.parts and head.meta.nbytes == 24
    assert b"".join(bundle.chunks(torch.ones(2, 3), 7)) == codec.tensor_bytes(torch.ones(2, 3))


def test_structure_and_parts_must_agree() -> None:
    """A descriptor of 3 tensors over 2 declared ones is refused, naming both counts."""
    head = _head((torch.ones(1), torch.ones(1)))
    head.structure = '{"tuple":3}'
    with pytest.raises(InvalidRequest, match="holds 3 tensors but 2 were declared"):
        bundle.assembler(head, 1 << 20)


def test_each_part_and_the_total_are_checked_before_allocation() -> None:
    """A part with a byte count disagreeing with its shape is invalid; parts each under the
    limit but over it together are too large; nothing is allocated for either."""
    head = _head((torch.ones(4), torch.ones(4)))
    with pytest.raises(TooLarge, match="2 tensors of 32 bytes are over the limit of 20"):
        bundle.declared_bytes(head, 20)
    head.parts[1].nbytes = 15
    with pytest.raises(InvalidRequest, match="15 were declared"):
        bundle.assembler(head, 1 << 20)
    huge = stage_pb2.DataHeader(structure='{"tuple":1}')
    huge.parts.append(
        tensor_pb2.TensorMeta(dtype=tensor_pb2.FLOAT32, shape=[1 << 40], nbytes=4 << 40)
    )
    with pytest.raises(TooLarge):
        bundle.assembler(huge, 1 << 31)


def test_extra_and_missing_bytes_are_invalid() -> None:
    """More bytes than declared, or fewer, are refused."""
    value = (torch.ones(2), torch.zeros(1, dtype=torch.bool))
    raw = bundle.data(value)
    over = bundle.assembler(_head(value), 1 << 20)
    with pytest.raises(InvalidRequest, match="more than the 9 bytes declared for 2 tensors"):
        over.add(raw + b"\0")
    under = bundle.assembler(_head(value), 1 << 20)
    under.add(raw[:8])
    with pytest.raises(InvalidRequest, match="received 0 bytes for a tensor declared as 1"):
        under.finish()


def test_an_empty_tuple_travels() -> None:
    """No floating tensor to send a gradient for: an empty tuple, zero bytes."""
    head = _head(())
    assert head.structure == '{"tuple":0}' and bundle.declared_bytes(head, 1) == 0
    assert bundle.assembler(head, 1).finish() == ()
