"""Tests of the wire codec: tensor round-trips, size checks before allocation, layer state."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticpipe.errors import InvalidRequest, TooLarge
from elasticpipe.v1 import tensor_pb2
from elasticpipe.wire.codec import (
    TensorAssembler,
    check_meta,
    from_proto,
    pack_state,
    tensor_chunks,
    tensor_meta,
    to_proto,
    unpack_state,
)

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.float64,
    torch.uint8,
    torch.bool,
]
WIRE = {
    torch.float32: tensor_pb2.FLOAT32,
    torch.float16: tensor_pb2.FLOAT16,
    torch.bfloat16: tensor_pb2.BFLOAT16,
    torch.int64: tensor_pb2.INT64,
    torch.int32: tensor_pb2.INT32,
    torch.float64: tensor_pb2.FLOAT64,
    torch.uint8: tensor_pb2.UINT8,
    torch.bool: tensor_pb2.BOOL,
}
ITEMSIZE = {d: torch.empty((), dtype=d).element_size() for d in DTYPES}


def _bits(tensor: torch.Tensor) -> bytes:
    """The tensor's raw bytes, computed independently of the codec."""
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _assert_identical(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    assert tuple(got.shape) == tuple(want.shape)
    assert _bits(got) == _bits(want)  # bitwise: NaN payloads and -0.0 survive too


@st.composite
def tensors(draw: st.DrawFn, max_dim: int = 5) -> torch.Tensor:
    """Tensors of every supported dtype and random (possibly zero-size or 0-d) shapes."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, max_dim), max_size=4))
    nbytes = math.prod(shape) * ITEMSIZE[dtype]
    raw = draw(st.binary(min_size=nbytes, max_size=nbytes))
    if dtype is torch.bool:
        raw = bytes(b % 2 for b in raw)  # other bit patterns are not valid bools
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=dtype).reshape(shape).clone()


def _meta(dtype: int, shape: list[int], nbytes: int) -> tensor_pb2.TensorMeta:
    return tensor_pb2.TensorMeta(dtype=dtype, shape=shape, nbytes=nbytes)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- tensor round-trips


@settings(deadline=None, max_examples=150)
@given(tensor=tensors(), chunk_bytes=st.integers(1, 64))
def test_tensor_chunks_round_trip_through_assembler(tensor: torch.Tensor, chunk_bytes: int) -> None:
    """Any supported tensor split into chunks of any size reassembles bit for bit."""
    meta, chunks = tensor_chunks(tensor, chunk_bytes)
    assembler = TensorAssembler(meta)
    for chunk in chunks:
        assembler.add(chunk)
    _assert_identical(assembler.finish(), tensor)


@settings(deadline=None, max_examples=100)
@given(tensor=tensors(), chunk_bytes=st.integers(1, 64))
def test_tensor_chunks_are_bounded_and_never_empty(tensor: torch.Tensor, chunk_bytes: int) -> None:
    """Chunks are non-empty, at most chunk_bytes long, and add up to the declared size."""
    meta, chunks = tensor_chunks(tensor, chunk_bytes)
    sizes = [len(c) for c in chunks]
    assert all(0 < s <= chunk_bytes for s in sizes)
    assert sum(sizes) == meta.nbytes == tensor.numel() * ITEMSIZE[tensor.dtype]


@settings(deadline=None, max_examples=150)
@given(tensor=tensors())
def test_to_proto_from_proto_round_trip(tensor: torch.Tensor) -> None:
    """A tensor encoded in one message decodes to the same dtype, shape and bits."""
    message = tensor_pb2.Tensor.FromString(to_proto(tensor).SerializeToString())
    _assert_identical(from_proto(message), tensor)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensor_meta_describes_dtype_shape_and_bytes(dtype: torch.dtype) -> None:
    """The wire description carries the dtype's enum, the shape and numel * itemsize."""
    meta = tensor_meta(torch.zeros(2, 3, dtype=dtype))
    assert (meta.dtype, list(meta.shape), meta.nbytes) == (WIRE[dtype], [2, 3], 6 * ITEMSIZE[dtype])


def test_non_contiguous_tensor_round_trips_by_value() -> None:
    """A transposed (non-contiguous) tensor arrives with its logical values."""
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    meta, chunks = tensor_chunks(tensor, 5)
    assembler = TensorAssembler(meta)
    for chunk in chunks:
        assembler.add(chunk)
    assert torch.equal(assembler.finish(), tensor)


def test_unsupported_dtype_is_refused_by_name() -> None:
    """Encoding a dtype the wire does not carry raises InvalidRequest naming the dtype."""
    with pytest.raises(InvalidRequest, match="complex64"):
        to_proto(torch.zeros(2, dtype=torch.complex64))


# --------------------------------------------------------------------------- check_meta


def test_worked_example_over_limit_is_too_large() -> None:
    """The docstring's example: a (2, 3) float32 (24 bytes) is refused by a 16-byte limit."""
    meta = _meta(tensor_pb2.FLOAT32, [2, 3], 24)
    assert check_meta(meta, 24) is torch.float32
    with pytest.raises(TooLarge, match="24"):
        check_meta(meta, 16)


@pytest.mark.parametrize(
    ("meta", "error", "values"),
    [
        (_meta(99, [2], 8), InvalidRequest, ["99"]),
        (_meta(tensor_pb2.DTYPE_UNSPECIFIED, [2], 8), InvalidRequest, ["0"]),
        (_meta(tensor_pb2.FLOAT32, [2, -3], 0), InvalidRequest, ["-3"]),
        (_meta(tensor_pb2.FLOAT32, [2, 3], 25), InvalidRequest, ["24", "25"]),
        (_meta(tensor_pb2.INT64, [4], 4), InvalidRequest, ["32", "4"]),
        (_meta(tensor_pb2.FLOAT32, [1024], 4096), TooLarge, ["4096", "1000"]),
    ],
    ids=["unknown-dtype", "unspecified-dtype", "negative-dim", "nbytes-off", "itemsize", "limit"],
)
def test_check_meta_rejects_with_the_values(
    meta: tensor_pb2.TensorMeta, error: type[Exception], values: list[str]
) -> None:
    """Inconsistent or oversized declarations raise the right error naming the values."""
    with pytest.raises(error) as info:
        check_meta(meta, 1000)
    for value in values:
        assert value in str(info.value)


@pytest.mark.parametrize(
    ("meta", "error"),
    [
        (_meta(tensor_pb2.FLOAT32, [2**58], 2**60), TooLarge),
        (_meta(tensor_pb2.UINT8, [2**30, 2**30], 2**60), TooLarge),
        (_meta(tensor_pb2.FLOAT64, [2**62, 2**62], 2**64 - 1), InvalidRequest),
        (_meta(tensor_pb2.FLOAT32, [2**40], 8), InvalidRequest),
    ],
    ids=["consistent-2^60", "2d-2^60", "overflowing-shape", "huge-shape-small-bytes"],
)
def test_huge_declarations_fail_before_allocating(
    meta: tensor_pb2.TensorMeta, error: type[Exception]
) -> None:
    """A declared exabyte tensor is refused by the assembler without trying to allocate it."""
    with pytest.raises(error):
        TensorAssembler(meta)
    with pytest.raises(error):
        from_proto(tensor_pb2.Tensor(meta=meta))


# --------------------------------------------------------------------------- assembler


def test_assembler_overflow_is_invalid() -> None:
    """Bytes beyond the declared size raise InvalidRequest naming both counts."""
    assembler = TensorAssembler(_meta(tensor_pb2.FLOAT32, [2], 8))
    assembler.add(b"\0" * 6)
    with pytest.raises(InvalidRequest, match=r"10 bytes .* 8 bytes"):
        assembler.add(b"\0" * 4)


def test_assembler_missing_bytes_is_invalid() -> None:
    """Finishing before every declared byte arrived raises InvalidRequest naming both counts."""
    assembler = TensorAssembler(_meta(tensor_pb2.FLOAT32, [2], 8))
    assembler.add(b"\0" * 7)
    with pytest.raises(InvalidRequest, match=r"7 bytes .* 8 bytes"):
        assembler.finish()


def test_from_proto_with_short_data_is_invalid() -> None:
    """A one-message tensor whose data is shorter than its meta raises InvalidRequest."""
    message = to_proto(torch.ones(4))
    message.data = message.data[:-1]
    with pytest.raises(InvalidRequest):
        from_proto(message)


# --------------------------------------------------------------------------- layer state


def _same(got: Any, want: Any) -> bool:
    """Structural equality where tensors compare by dtype, shape and bits."""
    if isinstance(want, torch.Tensor):
        return (
            isinstance(got, torch.Tensor)
            and got.dtype == want.dtype
            and got.shape == want.shape
            and _bits(got) == _bits(want)
        )
    if isinstance(want, dict):
        return (
            isinstance(got, dict)
            and got.keys() == want.keys()
            and all(_same(got[k], want[k]) for k in want)
        )
    if isinstance(want, (list, tuple)):
        return (
            isinstance(got, list)
            and len(got) == len(want)
            and all(_same(g, w) for g, w in zip(got, want, strict=True))
        )
    return type(got) is type(want) and got == want


SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    tensors(max_dim=3),
)
STATES = st.recursive(
    SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.one_of(st.integers(-50, 50), st.text(max_size=5)), children, max_size=4),
    ),
    max_leaves=12,
)


@settings(deadline=None, max_examples=100)
@given(state=STATES)
def test_pack_unpack_state_round_trip(state: Any) -> None:
    """Nested dicts (int or str keys), lists, None, bools, numbers, strings, tensors survive."""
    assert _same(unpack_state(pack_state(state)), state)


def test_unpacked_tensors_own_their_memory() -> None:
    """Tensors decoded from a blob are independent, writable copies."""
    state = {"w": torch.zeros(3), "b": torch.zeros(2)}
    out = unpack_state(pack_state(state))
    out["w"] += 1
    assert torch.equal(out["b"], torch.zeros(2))
    assert torch.equal(out["w"], torch.ones(3))


def test_adam_state_round_trips_and_loads_into_a_fresh_optimizer() -> None:
    """Adam's state after a step survives the codec and steps on exactly like the original."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    clone = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    clone.load_state_dict(model.state_dict())
    original = torch.optim.Adam(model.parameters(), lr=0.1)
    x = torch.randn(5, 4)
    model(x).square().sum().backward()
    original.step()

    decoded = unpack_state(pack_state(original.state_dict()))
    assert _same(decoded["state"], original.state_dict()["state"])
    clone.load_state_dict(model.state_dict())
    fresh = torch.optim.Adam(clone.parameters(), lr=0.1)
    fresh.load_state_dict(decoded)

    for net, opt in ((model, original), (clone, fresh)):
        opt.zero_grad()
        net(x).square().sum().backward()
        opt.step()
    for a, b in zip(model.parameters(), clone.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_pack_state_refuses_arbitrary_objects() -> None:
    """Objects other than plain data and tensors are refused by name, never pickled."""
    with pytest.raises(InvalidRequest, match="object"):
        pack_state({"x": object()})


def test_unpack_state_over_limit_is_too_large() -> None:
    """A blob longer than the limit is refused before decoding."""
    with pytest.raises(TooLarge):
        unpack_state(pack_state({"w": torch.zeros(100)}), max_bytes=64)


def _tensor_ext(header: Any, payload: bytes) -> bytes:
    return bytes(msgpack.packb(msgpack.ExtType(1, msgpack.packb(header) + payload)))


@pytest.mark.parametrize(
    ("header", "payload"),
    [
        (["float32", [3]], b"\0" * 8),
        (["float32", [2**40]], b"\0" * 8),
        (["float32", [-2]], b""),
        (["float32", [2**63 - 1, 2]], b""),
        (["float32", [2**64 - 1]], b""),
        (["float32", ["2"]], b"\0" * 8),
        (["float32", 2], b"\0" * 8),
        (["complex64", [1]], b"\0" * 8),
        (["torch.float32", [2]], b"\0" * 8),
        (["float32"], b"\0" * 8),
        ({"dtype": "float32"}, b"\0" * 8),
    ],
    ids=[
        "short",
        "huge-shape",
        "negative",
        "overflow",
        "uint64-dim",
        "str-dim",
        "shape-not-list",
        "bad-dtype",
        "prefixed-dtype",
        "one-field",
        "dict-header",
    ],
)
def test_lying_tensor_header_is_invalid(header: Any, payload: bytes) -> None:
    """A tensor ext whose header disagrees with its payload or is malformed is InvalidRequest."""
    with pytest.raises(InvalidRequest):
        unpack_state(_tensor_ext(header, payload))


def test_unknown_extension_is_invalid() -> None:
    """A msgpack extension other than the tensor one is refused, naming its code."""
    with pytest.raises(InvalidRequest, match="7"):
        unpack_state(bytes(msgpack.packb(msgpack.ExtType(7, b"x"))))


@pytest.mark.parametrize(
    "blob", [b"\xc1", b"\x91", b"\x81\x90\x01", b"\x92\x01", b"\xd4\x01", b"\x01\x02"]
)
def test_garbage_state_is_invalid(blob: bytes) -> None:
    """Truncated, reserved, unhashable-key and trailing-data blobs raise InvalidRequest."""
    with pytest.raises(InvalidRequest):
        unpack_state(blob)


def _decodes_or_refuses(blob: bytes) -> None:
    with contextlib.suppress(InvalidRequest, TooLarge):
        unpack_state(blob, max_bytes=1 << 16)


@settings(deadline=None, max_examples=200)
@given(blob=st.binary(max_size=200))
def test_random_bytes_never_raise_other_errors(blob: bytes) -> None:
    """Arbitrary bytes either decode or raise InvalidRequest / TooLarge, nothing else."""
    _decodes_or_refuses(blob)


@settings(deadline=None, max_examples=100)
@given(state=STATES, data=st.data())
def test_corrupted_state_never_raises_other_errors(state: Any, data: st.DataObject) -> None:
    """A valid blob with one byte changed or cut short decodes or raises only domain errors."""
    blob = bytearray(pack_state(state))
    index = data.draw(st.integers(0, len(blob) - 1))
    blob[index] = data.draw(st.integers(0, 255))
    _decodes_or_refuses(bytes(blob))
    _decodes_or_refuses(bytes(blob[: data.draw(st.integers(0, len(blob)))]))


@settings(deadline=None, max_examples=200)
@given(
    header=st.lists(
        st.one_of(
            st.sampled_from(["float32", "bool", "bfloat16", "int64", "x"]),
            st.lists(
                st.one_of(
                    st.integers(-(2**63), 2**64 - 1),
                    st.booleans(),
                    st.none(),
                    st.floats(),
                    st.text(max_size=2),
                ),
                max_size=3,
            ),
            st.integers(),
            st.none(),
        ),
        max_size=3,
    ),
    payload=st.binary(max_size=40),
)
def test_fuzzed_tensor_headers_never_raise_other_errors(header: list[Any], payload: bytes) -> None:
    """Tensor ext headers of any junk decode or raise only InvalidRequest / TooLarge."""
    try:
        blob = _tensor_ext(header, payload)
    except (OverflowError, ValueError):
        return  # msgpack cannot even encode this header
    _decodes_or_refuses(blob)
