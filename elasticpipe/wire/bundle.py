"""Several tensors in one data message: per-tensor metas, a structure, concatenated bytes.

A single tensor travels as it always did (``DataHeader.meta``, then its bytes). A tuple or
flat dict of tensors (``elasticpipe.wire.structure``) sets ``DataHeader.structure`` and declares
each tensor in ``DataHeader.parts``; the bytes of the tensors then follow in order, in one
unary message or over the chunks of a stream, a chunk possibly spanning two tensors.

Worked example: ``(hidden float32 (2, 3), mask bool (2,))`` travels as
``structure='{"tuple":2}'``, ``parts=[FLOAT32 [2,3] 24, BOOL [2] 2]`` and 26 bytes. A
receiver checks every part, the count and the total against its limit before it takes a
byte (``assembler``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple, Protocol

import torch

from elasticpipe.errors import InvalidRequest, TooLarge
from elasticpipe.v1 import stage_pb2, tensor_pb2
from elasticpipe.wire import codec, structure
from elasticpipe.wire.structure import Structure, Value


class Assembler(Protocol):
    """Receives a declared value chunk by chunk (``codec.TensorAssembler`` or ``Bundle``)."""

    def add(self, chunk: bytes) -> None: ...

    def finish(self) -> Value: ...


def describe(head: stage_pb2.DataHeader, value: Value) -> int:
    """Declares ``value`` in ``head`` (``meta`` for a tensor, else ``parts`` and
    ``structure``) and returns its byte count."""
    if isinstance(value, torch.Tensor):
        head.meta.CopyFrom(codec.tensor_meta(value))
        return int(head.meta.nbytes)
    parts, shape = structure.flatten(value, "a message of")
    assert shape is not None
    head.structure = shape.to_json()
    head.parts.extend(codec.tensor_meta(t) for t in parts)
    return sum(int(m.nbytes) for m in head.parts)


def data(value: Value) -> bytes:
    """Every tensor's raw bytes, one after another."""
    return b"".join(codec.tensor_bytes(t) for t in structure.tensors(value))


def chunks(value: Value, chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
    """The bytes of ``data(value)`` in chunks of at most ``chunk_bytes`` (per tensor)."""
    for t in structure.tensors(value):
        yield from codec.tensor_chunks(t, chunk_bytes)[1]


class Declared(NamedTuple):
    """The tensors a header declares, checked (``declared``)."""

    shape: Structure | None  # None: one tensor, in ``meta``
    metas: list[tensor_pb2.TensorMeta]

    @property
    def nbytes(self) -> int:
        """Their bytes, in all."""
        return sum(int(m.nbytes) for m in self.metas)


def declared(head: stage_pb2.DataHeader, max_bytes: int) -> Declared:
    """The tensors ``head`` declares, checked, and their structure (with a ``structure``,
    ``meta`` is ignored everywhere).

    Raises:
        InvalidRequest / TooLarge: as ``assembler``.
    """
    if not head.structure:
        codec.check_meta(head.meta, max_bytes)
        return Declared(None, [head.meta])
    shape, _ = _check_parts(head, max_bytes)
    return Declared(shape, list(head.parts))


def declared_bytes(head: stage_pb2.DataHeader, max_bytes: int) -> int:
    """The byte count ``head`` declares, after checking every declared tensor.

    Raises:
        InvalidRequest / TooLarge: as ``assembler``.
    """
    return declared(head, max_bytes).nbytes


def _check_parts(head: stage_pb2.DataHeader, max_bytes: int) -> tuple[Structure, int]:
    shape = Structure.from_json(head.structure)
    if len(head.parts) != shape.size:
        raise InvalidRequest(
            f"structure {head.structure} holds {shape.size} tensors but {len(head.parts)} "
            "were declared"
        )
    total = 0
    for meta in head.parts:
        codec.check_meta(meta, max_bytes)
        total += int(meta.nbytes)
    if total > max_bytes:
        raise TooLarge(
            f"{len(head.parts)} tensors of {total} bytes are over the limit of {max_bytes}"
        )
    return shape, total


def assembler(head: stage_pb2.DataHeader, max_bytes: int) -> Assembler:
    """The assembler of the value ``head`` declares, checked before anything is allocated.

    Raises:
        InvalidRequest: an unknown dtype, a bad shape or byte count, a malformed structure,
            or a structure whose size differs from the number of declared tensors.
        TooLarge: a tensor, or all of them together, over ``max_bytes``.
    """
    if not head.structure:
        return codec.TensorAssembler(head.meta, max_bytes)
    shape, _ = _check_parts(head, max_bytes)
    parts = [codec.TensorAssembler(m, max_bytes) for m in head.parts]
    return Bundle(shape, parts, [int(m.nbytes) for m in head.parts])


class Bundle:
    """Several declared tensors filled in order from one byte stream."""

    def __init__(self, shape: Structure, parts: list[codec.TensorAssembler], sizes: list[int]):
        self._shape = shape
        self._parts = parts
        self._sizes = sizes
        self._current = 0
        self._filled = 0  # bytes of the current part

    def add(self, chunk: bytes) -> None:
        """Appends bytes, spilling into the next tensor at each boundary.

        Raises:
            InvalidRequest: more bytes than all the tensors declare.
        """
        view = memoryview(chunk)
        while view:
            while self._current < len(self._sizes) and self._filled == self._sizes[self._current]:
                self._current, self._filled = self._current + 1, 0
            if self._current == len(self._sizes):
                raise InvalidRequest(
                    f"received more than the {sum(self._sizes)} bytes declared for "
                    f"{len(self._sizes)} tensors"
                )
            take = min(len(view), self._sizes[self._current] - self._filled)
            self._parts[self._current].add(bytes(view[:take]))
            self._filled += take
            view = view[take:]

    def finish(self) -> Value:
        """The value; raises InvalidRequest if bytes are missing."""
        return structure.unflatten([p.finish() for p in self._parts], self._shape)


# ---- the profiling sample (JobSpec, ProfileJobRequest) -----------------------------------


def set_sample(message: Any, value: Value) -> None:
    """Puts one micro-batch of inputs in ``message``'s ``sample_input`` (a tensor) or
    ``sample_structure`` and ``sample_parts`` (several)."""
    if isinstance(value, torch.Tensor):
        message.sample_input.CopyFrom(codec.to_proto(value))
        return
    parts, shape = structure.flatten(value, "the sample is")
    assert shape is not None
    message.sample_structure = shape.to_json()
    message.sample_parts.extend(codec.to_proto(t) for t in parts)


def get_sample(message: Any, max_bytes: int = codec.DEFAULT_MAX_TENSOR_BYTES) -> Value | None:
    """The sample ``set_sample`` put in ``message``, or None if there is none.

    Raises:
        InvalidRequest / TooLarge: a malformed structure, a count that disagrees with it, or
            tensors (each, or together) over ``max_bytes``; checked before decoding.
    """
    if not message.sample_structure:
        if not message.HasField("sample_input"):
            return None
        return codec.from_proto(message.sample_input, max_bytes)
    shape = Structure.from_json(message.sample_structure)
    parts = message.sample_parts
    if len(parts) != shape.size:
        raise InvalidRequest(
            f"sample structure {message.sample_structure} holds {shape.size} tensors but "
            f"{len(parts)} were sent"
        )
    total = sum(int(p.meta.nbytes) for p in parts)
    if total > max_bytes:
        raise TooLarge(f"sample of {total} bytes is over the limit of {max_bytes} bytes")
    return structure.unflatten([codec.from_proto(p, max_bytes) for p in parts], shape)


__all__ = [
    "Assembler",
    "Bundle",
    "assembler",
    "chunks",
    "data",
    "declared_bytes",
    "describe",
    "get_sample",
    "set_sample",
]
