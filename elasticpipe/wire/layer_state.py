"""Layer state on the wire, tensor by tensor: no size cap but the operator's limits, and
about one copy of a layer in memory on each side.

A layer's state (weights, buffers, optimizer state) is split into its small non-tensor
part -- the structure, hyper-parameters, step counters, param_groups, as msgpack with
each tensor replaced by a reference to its index -- and the tensors themselves. It moves
as one stream of ``LayerChunk`` messages::

    header   layer=3  state=<msgpack>  tensors=[float32 (512, 256), float32 (512, 256), ...]
    chunk    layer=3  tensor=0 offset=0       data=<1 MiB>
    chunk    layer=3  tensor=0 offset=1048576 data=...
    chunk    layer=3  tensor=1 offset=0       ...
    trailer  layer=3  digest=<BLAKE3 of the state bytes and every tensor's bytes, in order>

The stages send every layer without a CRC-32 per chunk (``checked_chunks=False``) and say
so in its header: the trailer's digest is the one checksum (a CRC-32 pass on each side
took 8-14% of the pauses of 17-50 MB moves, in one A/B run of ``bench/move_pause.py``). A
receiver still checks the CRC-32 of each chunk where the header asks for it (an older
sender). A snapshot's digest is computed once
when it is packed (``seal``), kept with it, and reused for every copy sent of it; the
receiver computes it once as the bytes arrive and keeps the verified digest with its copy.

A receiver checks the header whole -- every declared dtype and shape against the tensor
limit, their sum against the layer limit, and each against what the destination expects
(a layer's own parameters, say) -- before it allocates anything. Each chunk is then
checked (order, bounds; a CRC-32 where the header asks for one) and copied straight into
its tensor's memory, which is the destination's own where it has one: the layer is never
held twice. Nothing is unpickled; a layer is accepted only whole and matching its digest.

The digest is BLAKE3 (256 bits, ``blake3``): a cryptographic hash like the SHA-256 it
replaced, at about 4x its speed on one core (4.9 against 1.1 GB/s with AVX-512 on the
2-core Xeon of ``bench/first_step.py``; it picks SSE4.1, AVX2 or AVX-512 at run time).
Every layer that moves, loads or is copied is hashed on both sides, so on a host whose
cores also compute, the hash was most of a load's CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch
from blake3 import blake3
from torch import nn

from elasticpipe.errors import InvalidRequest, TooLarge, TransferError
from elasticpipe.v1 import stage_pb2
from elasticpipe.wire import codec

MAX_HEADER_BYTES = 16 << 20  # the non-tensor part of one layer
MAX_TENSORS = 1 << 16  # tensors in one layer
_REF = 2  # msgpack extension: a reference to tensor number n

Path = tuple[Any, ...]  # where a tensor sits in the state: ("model", "weight"), ...


@dataclass(frozen=True)
class PackedLayer:
    """A layer's state split for the wire: the non-tensor part and the tensors."""

    state: bytes  # msgpack, each tensor replaced by a reference to its index
    tensors: tuple[torch.Tensor, ...]  # CPU, contiguous
    digest: bytes = b""  # of the state and every tensor's bytes, in order ("" if not known)

    def computed_digest(self) -> bytes:
        """The digest of the state and every tensor's bytes, in order (computed now)."""
        hasher = new_hasher(self.state)
        for tensor in self.tensors:
            hasher.update(bytes_of(tensor))
        return hasher.digest()

    def verify(self, what: str) -> None:
        """Checks the bytes against the digest kept with them (none kept: nothing to check).

        Raises:
            TransferError: the bytes changed since the digest was taken.
        """
        if self.digest and self.computed_digest() != self.digest:
            raise TransferError(f"{what}: digest mismatch (the held bytes changed)")

    @property
    def nbytes(self) -> int:
        """Bytes held (the state and every tensor)."""
        return len(self.state) + sum(t.numel() * t.element_size() for t in self.tensors)

    def unpack(self) -> Any:
        """The state again, with these tensors in it (not copies)."""
        return _join(_decode(self.state, len(self.tensors))[0], list(self.tensors))

    def copy_into(self, destination: Destination) -> Any:
        """The state with copies of these tensors, in ``destination``'s memory, checked
        against it as a received layer's are (a rollback from a snapshot held here), and
        against the digest kept with them.

        Raises:
            InvalidRequest: a tensor does not fit the destination.
            TransferError: the held bytes no longer match their digest.
        """
        self.verify("held layer state")
        state, paths = _decode(self.state, len(self.tensors))
        for path, tensor in zip(paths, self.tensors, strict=True):
            destination.check(path, tensor.dtype, tuple(tensor.shape))
        copies = [
            destination.allocate(path, t.dtype, tuple(t.shape)).copy_(t)
            for path, t in zip(paths, self.tensors, strict=True)
        ]
        return _join(state, copies)


class _Ref:
    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


def pack(state: Any) -> PackedLayer:
    """Splits nested dicts/lists of numbers, strings and tensors (no copy of a CPU
    contiguous tensor; others are moved to the CPU)."""
    tensors: list[torch.Tensor] = []

    def default(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            codec.wire_dtype(obj.dtype)  # refuses a dtype the wire cannot carry, by name
            tensors.append(obj.detach().to("cpu").contiguous())
            return msgpack.ExtType(_REF, (len(tensors) - 1).to_bytes(4, "big"))
        raise InvalidRequest(f"cannot encode a {type(obj).__name__} in layer state")

    data = bytes(msgpack.packb(state, default=default, strict_types=False))
    return PackedLayer(data, tuple(tensors))


def seal(packed: PackedLayer) -> PackedLayer:
    """The same layer with its digest taken (once: every copy sent of it reuses it)."""
    if packed.digest:
        return packed
    return PackedLayer(packed.state, packed.tensors, packed.computed_digest())


def new_hasher(state: bytes) -> blake3:
    """A layer's digest, begun with its state's bytes (the tensors' follow, in order):
    BLAKE3, 256 bits, on the calling thread only (no hashing pool beside the compute)."""
    return blake3(state, max_threads=1)


def bytes_of(tensor: torch.Tensor) -> memoryview:
    """A CPU contiguous tensor's bytes, without a copy."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def _decode(data: bytes, count: int) -> tuple[Any, list[Path]]:
    """Decodes a header's state; returns it with references, and each tensor's path.

    Raises:
        InvalidRequest: malformed, or the references are not each of 0..count-1 once.
    """

    def ext_hook(code: int, payload: bytes) -> Any:
        if code != _REF or len(payload) != 4:
            raise InvalidRequest(f"unexpected msgpack extension {code} in a layer header")
        return _Ref(int.from_bytes(payload, "big"))

    try:
        state = msgpack.unpackb(data, ext_hook=ext_hook, raw=False, strict_map_key=False)
    except (msgpack.UnpackException, ValueError, TypeError) as exc:
        if isinstance(exc, InvalidRequest):
            raise
        raise InvalidRequest(f"malformed layer header ({len(data)} bytes): {exc}") from exc
    paths: list[Path | None] = [None] * count

    def walk(obj: Any, path: Path) -> None:
        if isinstance(obj, _Ref):
            if not 0 <= obj.index < count or paths[obj.index] is not None:
                raise InvalidRequest(
                    f"layer header refers to tensor {obj.index} wrongly ({count} declared)"
                )
            paths[obj.index] = path
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, (*path, k))
        elif isinstance(obj, list):
            for i, v in enumerate(obj):
                walk(v, (*path, i))

    walk(state, ())
    missing = [i for i, p in enumerate(paths) if p is None]
    if missing:
        raise InvalidRequest(f"layer header declares tensors {missing[:8]} that it never uses")
    return state, [p for p in paths if p is not None]


def _join(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, _Ref):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: _join(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_join(v, tensors) for v in obj]
    return obj


# ---- sending --------------------------------------------------------------------------


def messages(
    layer: int,
    packed: PackedLayer,
    chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES,
    checked_chunks: bool = True,
) -> Iterator[stage_pb2.LayerChunk]:
    """One layer as its header, its tensors' chunks and a trailer; a chunk is copied out
    of its tensor only when it is sent. Each chunk carries its CRC-32 unless
    ``checked_chunks`` is False; the trailer's digest is the one kept with ``packed``
    where it has one (not computed again)."""
    for fields in chunk_fields(layer, packed, chunk_bytes, checked_chunks):
        yield stage_pb2.LayerChunk(**fields)


def chunk_fields(
    layer: int, packed: PackedLayer, chunk_bytes: int, checked_chunks: bool, copy: bool = True
) -> Iterator[dict[str, Any]]:
    """The fields of ``messages``' messages, to build them inside another message without
    a copy of the submessage; with ``copy`` False, a chunk's data is a view of its
    tensor's memory."""
    if chunk_bytes < 1:
        raise InvalidRequest(f"chunk size must be positive (got {chunk_bytes})")
    hasher = None if packed.digest else new_hasher(packed.state)
    header = stage_pb2.LayerHeader(
        state=packed.state,
        tensors=[codec.tensor_meta(t) for t in packed.tensors],
        unchecked_chunks=not checked_chunks,
    )
    yield {"layer": layer, "header": header}
    for index, tensor in enumerate(packed.tensors):
        raw = bytes_of(tensor)
        for start in range(0, len(raw), chunk_bytes):
            view = raw[start : start + chunk_bytes]
            data = bytes(view) if copy else view  # the one copy a message needs
            if hasher is not None:
                hasher.update(data)
            fields: dict[str, Any] = {
                "layer": layer,
                "tensor": index,
                "offset": start,
                "data": data,
            }
            if checked_chunks:
                fields["crc32"] = codec.crc32(data)
            yield fields
    yield {"layer": layer, "digest": packed.digest if hasher is None else hasher.digest()}


def encoded_chunks(
    layer: int, packed: PackedLayer, chunk_bytes: int, within: int
) -> Iterator[bytes]:
    """``messages(layer, packed, chunk_bytes, checked_chunks=False)``, each already
    serialized as field number ``within`` of an enclosing message (a ``SnapshotChunk``):
    a chunk's bytes are copied once, from its tensor's memory straight into the message's
    wire form, where building the message and serializing it would copy them twice more.
    """
    for fields in chunk_fields(layer, packed, chunk_bytes, False, copy=False):
        data = fields.pop("data", None)
        inner = stage_pb2.LayerChunk(**fields).SerializeToString()
        if data is None:  # the header or the trailer
            yield _field(within, len(inner)) + inner
            continue
        data_head = _field(_DATA_FIELD, len(data))
        head = _field(within, len(inner) + len(data_head) + len(data)) + inner + data_head
        yield b"".join((head, data))


_DATA_FIELD = stage_pb2.LayerChunk.DESCRIPTOR.fields_by_name["data"].number


def _field(number: int, length: int) -> bytes:
    """A length-delimited field's tag and length, in protobuf's wire format."""
    return _varint((number << 3) | 2) + _varint(length)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# ---- receiving ------------------------------------------------------------------------


class Destination:
    """Where a layer's tensors go: fresh CPU memory, unless a subclass knows better."""

    fresh = True  # the tensors are the received layer's alone (none is in use elsewhere)

    def check(self, path: Path, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        """Checks one declared tensor (already within the limits) against what this
        destination expects; called for every tensor of a layer before any allocation.

        Raises:
            InvalidRequest: the tensor does not fit.
        """

    def allocate(self, path: Path, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """Memory for one checked tensor: contiguous, on the CPU, of its dtype and shape."""
        return torch.empty(shape, dtype=dtype)


class IntoModule(Destination):
    """Receives a layer's weights straight into a module's own parameters and buffers
    (on the CPU), so that loading them copies nothing; other tensors get fresh memory.
    A weight the module lacks, or of another dtype or shape, is refused."""

    fresh = False  # the module trains on: its weights soon differ from the received bytes

    def __init__(self, module: nn.Module, what: str):
        self.module = module
        self._what = what
        self._expected = module.state_dict(keep_vars=False)

    def check(self, path: Path, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        if not (len(path) == 2 and path[0] == "model"):
            return
        expected = self._expected.get(path[1]) if isinstance(path[1], str) else None
        if expected is None:
            raise InvalidRequest(
                f"{self._what}: tensor {path[1]!r} is not in the layer "
                f"(it has {sorted(self._expected)[:16]})"
            )
        if expected.dtype != dtype or tuple(expected.shape) != shape:
            raise InvalidRequest(
                f"{self._what}: tensor {path[1]!r} declared as {codec.dtype_name(dtype)} "
                f"{list(shape)}, but the layer's is {codec.dtype_name(expected.dtype)} "
                f"{list(expected.shape)}"
            )

    def allocate(self, path: Path, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        mine = self._expected.get(path[1]) if len(path) == 2 and path[0] == "model" else None
        if mine is None or mine.device.type != "cpu" or not mine.is_contiguous():
            return super().allocate(path, dtype, shape)  # (copied to the device on load)
        tensor: torch.Tensor = mine
        return tensor


@dataclass(frozen=True)
class Received:
    """One layer received whole and intact."""

    layer: int
    packed: PackedLayer
    destination: Destination


class _Open:
    """A layer being received."""

    def __init__(
        self,
        layer: int,
        header: stage_pb2.LayerHeader,
        limits: tuple[int, int],
        destination: Destination,
    ):
        max_tensor, max_layer = limits
        what = f"layer {layer}"
        if len(header.state) > MAX_HEADER_BYTES:
            raise TooLarge(
                f"{what}: header of {len(header.state)} bytes is over {MAX_HEADER_BYTES}"
            )
        if len(header.tensors) > MAX_TENSORS:
            raise TooLarge(f"{what}: {len(header.tensors)} tensors (at most {MAX_TENSORS})")
        dtypes = [codec.check_meta(meta, max_tensor) for meta in header.tensors]
        total = sum(meta.nbytes for meta in header.tensors)
        if total > max_layer:
            raise TooLarge(f"{what}: {total} bytes of tensors is over the limit of {max_layer}")
        _, paths = _decode(header.state, len(dtypes))
        self.layer = layer
        self.what = what
        self.state = header.state
        self.checked_chunks = not header.unchecked_chunks
        self.sizes = [meta.nbytes for meta in header.tensors]
        declared = list(zip(paths, dtypes, [tuple(m.shape) for m in header.tensors], strict=True))
        for path, dtype, shape in declared:
            destination.check(path, dtype, shape)
        self.tensors = [destination.allocate(*tensor) for tensor in declared]
        self.destination = destination
        self.hasher = new_hasher(header.state)
        self.current, self.filled = 0, 0
        self._skip_empty()

    def _skip_empty(self) -> None:
        while self.current < len(self.sizes) and self.filled == self.sizes[self.current]:
            self.current, self.filled = self.current + 1, 0

    def add(self, chunk: stage_pb2.LayerChunk) -> None:
        """Writes one chunk into its tensor; raises TransferError if it is out of place
        (an empty one where the trailer belongs: a trailer without its digest), too long or
        fails its CRC-32."""
        data = chunk.data
        if (
            chunk.tensor != self.current
            or chunk.offset != self.filled
            or self.current >= len(self.sizes)
            or self.filled + len(data) > self.sizes[self.current]
            or not data
        ):
            if self.current >= len(self.sizes) and not data:
                raise TransferError(
                    f"{self.what}: a trailer without its digest (a sender of an earlier "
                    "release, whose digest was SHA-256 in a field since retired?)"
                )
            expected = (
                f"tensor {self.current} at offset {self.filled}"
                if self.current < len(self.sizes)
                else "the trailer"
            )
            raise TransferError(
                f"{self.what}: chunk of tensor {chunk.tensor} at offset {chunk.offset} "
                f"(+{len(data)} bytes) out of place: expected {expected}"
            )
        if self.checked_chunks and codec.crc32(data) != chunk.crc32:
            raise TransferError(
                f"{self.what}: chunk of tensor {chunk.tensor} at offset {chunk.offset} "
                "failed its CRC-32"
            )
        target = self.tensors[self.current].reshape(-1).view(torch.uint8)
        target[self.filled : self.filled + len(data)].numpy()[:] = np.frombuffer(data, np.uint8)
        self.hasher.update(data)
        self.filled += len(data)
        self._skip_empty()

    def fill(self, read_into: Callable[[memoryview], None], piece_bytes: int = 1 << 20) -> None:
        """Fills every tensor by ``read_into(view)`` of consecutive pieces of its memory
        (a socket's ``recv_into``: the bytes land in the tensor, with no chunk between),
        each hashed while it is still in the cache; for a stream that carries the raw
        bytes of every tensor in order (the bulk channel's, ``transport.bulk_layers``).
        The digest is then checked by ``finish``."""
        for index in range(self.current, len(self.sizes)):
            raw = self.tensors[index].reshape(-1).view(torch.uint8).numpy().data
            for start in range(self.filled, len(raw), piece_bytes):
                view = raw[start : start + piece_bytes]
                read_into(view)
                self.hasher.update(view)
            self.current, self.filled = index + 1, 0

    def finish(self, digest: bytes) -> Received:
        """The layer, once every byte arrived and the digest matches."""
        if self.current < len(self.sizes):
            raise TransferError(
                f"{self.what}: transfer stopped at tensor {self.current} of {len(self.sizes)} "
                f"(byte {self.filled} of {self.sizes[self.current]})"
            )
        if self.hasher.digest() != digest:
            raise TransferError(f"{self.what}: digest mismatch")
        kept = digest if self.destination.fresh else b""  # what the bytes stay equal to
        packed = PackedLayer(self.state, tuple(self.tensors), kept)
        return Received(self.layer, packed, self.destination)


def open_layer(
    layer: int, header: stage_pb2.LayerHeader, limits: tuple[int, int], destination: Destination
) -> _Open:
    """A layer to receive, its header checked whole and its tensors allocated in
    ``destination`` (see ``receive``); filled by chunks (``add``) or raw bytes (``fill``),
    then ``finish``ed.

    Raises:
        TooLarge / InvalidRequest: as ``receive``, for its header.
    """
    return _Open(layer, header, limits, destination)


def receive(
    pieces: Iterable[stage_pb2.LayerChunk],
    max_tensor_bytes: int,
    max_layer_bytes: int,
    start: Callable[[int], Destination] | None = None,
) -> Iterator[Received]:
    """Receives layers one at a time from a stream (a layer's messages are contiguous).

    Args:
        pieces: the ``LayerChunk`` messages.
        max_tensor_bytes: the largest tensor accepted.
        max_layer_bytes: the largest sum of a layer's tensors accepted.
        start: called with a layer's index on its header, before anything of it is
            allocated (where to check that the layer is welcome); returns where its
            tensors go. Default: fresh memory.

    Raises:
        TransferError: a gap, overflow, bad CRC or digest mismatch, or a layer left open.
        InvalidRequest: a layer sent twice, a malformed header, or tensors that do not
            fit the destination.
        TooLarge: a declared tensor or layer over the limits.
    """
    current: _Open | None = None
    done: set[int] = set()
    for piece in pieces:
        if piece.HasField("header"):
            if current is not None:
                raise TransferError(
                    f"layer {piece.layer} started before layer {current.layer} ended"
                )
            if piece.layer in done:
                raise InvalidRequest(f"layer {piece.layer} sent twice")
            destination = start(piece.layer) if start is not None else Destination()
            current = _Open(
                piece.layer, piece.header, (max_tensor_bytes, max_layer_bytes), destination
            )
        elif current is None or piece.layer != current.layer:
            raise TransferError(f"a chunk of layer {piece.layer} came before its header")
        elif piece.digest:
            done.add(piece.layer)
            yield current.finish(piece.digest)
            current = None
        else:
            current.add(piece)
    if current is not None:
        raise TransferError(f"stream ended inside layer {current.layer}")
