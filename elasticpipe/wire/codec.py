"""The wire codec: tensors as dtype + shape + raw bytes. (Layer state moves tensor by tensor:
``elasticpipe.wire.layer_state``; ``pack_state``/``unpack_state`` here read and write the one-blob
msgpack form of earlier checkpoint files.)

Nothing here unpickles or evaluates: a receiver checks the declared dtype, shape and byte
count against each other and against its size limit *before* it allocates, then fills a
buffer of exactly that size from the chunks it is sent.

Worked example: a float32 tensor of shape (2, 3) travels as
``TensorMeta(dtype=FLOAT32, shape=[2, 3], nbytes=24)`` followed by 24 bytes, possibly split
over several chunks; a receiver whose limit is 16 bytes refuses it with ``TooLarge`` before
reading any data.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from typing import Any

import msgpack
import torch

from elasticpipe.errors import InvalidRequest, TooLarge
from elasticpipe.v1 import tensor_pb2

DEFAULT_CHUNK_BYTES = 1 << 20  # 1 MiB: grpcio streams fastest around this size
DEFAULT_MAX_TENSOR_BYTES = 1 << 31  # 2 GiB per tensor unless the operator says otherwise
# One layer's packed state (weights, buffers, optimizer state): its tensors are checked one
# by one against the tensor limit, so the layer as a whole is bounded only by this (1 TiB).
DEFAULT_MAX_LAYER_BYTES = 1 << 40
MAX_DIMS = 32

_TO_WIRE: dict[torch.dtype, int] = {
    torch.float32: tensor_pb2.FLOAT32,
    torch.float16: tensor_pb2.FLOAT16,
    torch.bfloat16: tensor_pb2.BFLOAT16,
    torch.int64: tensor_pb2.INT64,
    torch.int32: tensor_pb2.INT32,
    torch.float64: tensor_pb2.FLOAT64,
    torch.uint8: tensor_pb2.UINT8,
    torch.bool: tensor_pb2.BOOL,
}
_FROM_WIRE: dict[int, torch.dtype] = {v: k for k, v in _TO_WIRE.items()}
_DTYPE_NAMES: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in _TO_WIRE}


def wire_dtype(dtype: torch.dtype) -> int:
    """Returns the wire enum of a torch dtype, or raises InvalidRequest naming it."""
    try:
        return _TO_WIRE[dtype]
    except KeyError:
        raise InvalidRequest(
            f"dtype {dtype} cannot travel on the wire (supported: {sorted(_DTYPE_NAMES)})"
        ) from None


def _raw(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 CPU tensor (no copy when already contiguous on CPU)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8)


def tensor_meta(tensor: torch.Tensor) -> tensor_pb2.TensorMeta:
    """Describes a tensor for the wire."""
    return tensor_pb2.TensorMeta(
        dtype=wire_dtype(tensor.dtype),  # type: ignore[arg-type]
        shape=list(tensor.shape),
        nbytes=tensor.numel() * tensor.element_size(),
    )


def tensor_chunks(
    tensor: torch.Tensor, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> tuple[tensor_pb2.TensorMeta, Iterator[bytes]]:
    """Splits a tensor into its wire description and an iterator of byte chunks.

    Args:
        tensor: any tensor of a supported dtype, on any device.
        chunk_bytes: the largest chunk to yield.

    Returns:
        The ``TensorMeta`` and an iterator over the raw bytes (one empty chunk never
        appears; a zero-size tensor yields nothing).
    """
    meta = tensor_meta(tensor)
    raw = _raw(tensor)

    def chunks() -> Iterator[bytes]:
        for start in range(0, raw.numel(), chunk_bytes):
            yield raw[start : start + chunk_bytes].numpy().tobytes()

    return meta, chunks()


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's raw bytes (little-endian, C order)."""
    return _raw(tensor).numpy().tobytes()


def to_proto(tensor: torch.Tensor) -> tensor_pb2.Tensor:
    """Encodes a (small) tensor in one message."""
    return tensor_pb2.Tensor(meta=tensor_meta(tensor), data=tensor_bytes(tensor))


def from_proto(
    message: tensor_pb2.Tensor, max_bytes: int = DEFAULT_MAX_TENSOR_BYTES
) -> torch.Tensor:
    """Decodes a one-message tensor, checking it like any other."""
    assembler = TensorAssembler(message.meta, max_bytes)
    assembler.add(message.data)
    return assembler.finish()


def checked_dtype(meta: tensor_pb2.TensorMeta) -> torch.dtype:
    """The dtype of a tensor ``check_meta`` checked."""
    return _FROM_WIRE[meta.dtype]


def check_meta(meta: tensor_pb2.TensorMeta, max_bytes: int) -> torch.dtype:
    """Validates a declared tensor before anything is allocated for it.

    Raises:
        InvalidRequest: unknown dtype, negative dimension, or byte count that disagrees
            with dtype and shape.
        TooLarge: the declared size is over ``max_bytes``.
    """
    dtype = _FROM_WIRE.get(meta.dtype)
    if dtype is None:
        raise InvalidRequest(f"unknown tensor dtype {meta.dtype} on the wire")
    shape = list(meta.shape)
    if len(shape) > MAX_DIMS:
        raise InvalidRequest(f"tensor shape has {len(shape)} dimensions (at most {MAX_DIMS})")
    if any(d < 0 for d in shape):
        raise InvalidRequest(f"tensor shape {shape} has a negative dimension")
    expected = math.prod(shape) * dtype.itemsize
    if expected != meta.nbytes:
        raise InvalidRequest(
            f"tensor of dtype {_name(dtype)} and shape {shape} needs {expected} bytes, "
            f"but {meta.nbytes} were declared"
        )
    if meta.nbytes > max_bytes:
        raise TooLarge(f"tensor of {meta.nbytes} bytes is over the limit of {max_bytes} bytes")
    return dtype


class TensorAssembler:
    """Receives a declared tensor chunk by chunk; memory grows with the data that arrives
    (a header declaring a large tensor costs nothing until its bytes come)."""

    def __init__(self, meta: tensor_pb2.TensorMeta, max_bytes: int = DEFAULT_MAX_TENSOR_BYTES):
        self._dtype = check_meta(meta, max_bytes)
        self._shape = tuple(meta.shape)
        self._declared = meta.nbytes
        self._chunks: list[bytes] = []
        self._filled = 0

    def add(self, chunk: bytes) -> None:
        """Appends a chunk; raises InvalidRequest if it overflows the declared size."""
        end = self._filled + len(chunk)
        if end > self._declared:
            raise InvalidRequest(
                f"received {end} bytes for a tensor declared as {self._declared} bytes"
            )
        self._chunks.append(chunk)
        self._filled = end

    def finish(self) -> torch.Tensor:
        """Returns the tensor; raises InvalidRequest if bytes are missing."""
        if self._filled != self._declared:
            raise InvalidRequest(
                f"received {self._filled} bytes for a tensor declared as {self._declared} bytes"
            )
        if not self._declared:
            return torch.empty(self._shape, dtype=self._dtype)
        buffer = bytearray(self._declared)  # one copy, into memory the tensor owns
        offset = 0
        for chunk in self._chunks:
            buffer[offset : offset + len(chunk)] = chunk
            offset += len(chunk)
        self._chunks.clear()
        return torch.frombuffer(buffer, dtype=self._dtype).reshape(self._shape)


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as the wire and error messages name it: "float32"."""
    return str(dtype).removeprefix("torch.")


_name = dtype_name


# ---- one-blob layer state (checkpoint files of earlier versions), as msgpack -----------

_TENSOR_EXT = 1


def _default(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        header = msgpack.packb([_name(obj.dtype), list(obj.shape)])
        return msgpack.ExtType(_TENSOR_EXT, header + _raw(obj).numpy().tobytes())
    raise InvalidRequest(f"cannot encode a {type(obj).__name__} in layer state")


def pack_state(state: Any) -> bytes:
    """Encodes nested dicts/lists of numbers, strings and tensors (no pickle)."""
    return bytes(msgpack.packb(state, default=_default, strict_types=False))


def unpack_state(
    blob: bytes,
    max_bytes: int = DEFAULT_MAX_TENSOR_BYTES,
    max_layer_bytes: int = DEFAULT_MAX_LAYER_BYTES,
) -> Any:
    """Decodes what ``pack_state`` wrote, checking every tensor's size against its header
    and against ``max_bytes`` (per tensor); the whole state against ``max_layer_bytes``."""
    if len(blob) > max_layer_bytes:
        raise TooLarge(f"layer state of {len(blob)} bytes is over the limit of {max_layer_bytes}")

    def ext_hook(code: int, data: bytes) -> Any:
        if code != _TENSOR_EXT:
            raise InvalidRequest(f"unknown msgpack extension {code} in layer state")
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=len(data))
        unpacker.feed(data)
        header = unpacker.unpack()
        if not (isinstance(header, list) and len(header) == 2):
            raise InvalidRequest(f"malformed tensor header {header!r} in layer state")
        name, shape = header
        dtype = _DTYPE_NAMES.get(name) if isinstance(name, str) else None
        if dtype is None or not isinstance(shape, list):
            raise InvalidRequest(f"malformed tensor header {header!r} in layer state")
        meta = tensor_pb2.TensorMeta(
            dtype=_TO_WIRE[dtype],  # type: ignore[arg-type]
            shape=shape,
            nbytes=len(data) - unpacker.tell(),
        )
        assembler = TensorAssembler(meta, max_bytes)
        assembler.add(data[unpacker.tell() :])
        return assembler.finish().clone()

    try:
        return msgpack.unpackb(blob, ext_hook=ext_hook, raw=False, strict_map_key=False)
    except (msgpack.UnpackException, ValueError, TypeError) as exc:
        if isinstance(exc, InvalidRequest):
            raise
        raise InvalidRequest(f"malformed layer state ({len(blob)} bytes): {exc}") from exc


# ---- checksums -------------------------------------------------------------------------


def crc32(data: bytes | memoryview) -> int:
    """CRC-32 of one chunk."""
    return zlib.crc32(data) & 0xFFFFFFFF
