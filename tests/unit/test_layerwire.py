"""Layer state on the wire, tensor by tensor: round trips, refusals before allocation, and
the receiver's peak memory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from elasticpipe.errors import InvalidRequest, TooLarge, TransferError
from elasticpipe.v1 import stage_pb2, tensor_pb2
from elasticpipe.wire import layer_state
from elasticpipe.wire.layer_state import Destination, IntoModule, pack

ROOT = Path(__file__).resolve().parents[2]


def _adam_state(layer: nn.Module) -> dict[str, Any]:
    opt = torch.optim.Adam(layer.parameters(), lr=0.1)
    layer(torch.randn(2, layer.in_features)).sum().backward()  # type: ignore[operator]
    opt.step()
    return {
        "index": 3,
        "model": {k: v.detach().clone() for k, v in layer.state_dict().items()},
        "optimizer": opt.state_dict(),
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


class Counting(Destination):
    """Fresh memory, counting allocations."""

    def __init__(self) -> None:
        self.allocated = 0

    def allocate(self, path: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        self.allocated += 1
        return super().allocate(path, dtype, shape)


def _receive(msgs: list[stage_pb2.LayerChunk], dest: Destination | None = None, **kw: int) -> Any:
    limits = (kw.get("max_tensor", 1 << 30), kw.get("max_layer", 1 << 30))
    start = (lambda _: dest) if dest is not None else None
    return list(layer_state.receive(msgs, *limits, start))


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 20])
def test_a_layer_round_trips_exactly_in_any_chunk_size(chunk: int) -> None:
    """Weights, Adam state (tensors, step counters, param_groups), several dtypes and an
    empty tensor come back exactly; every data chunk is at most ``chunk`` bytes."""
    torch.manual_seed(0)
    state = _adam_state(nn.Linear(8, 5))
    state["model"]["extra"] = torch.tensor([True, False])
    state["model"]["half"] = torch.randn(3, dtype=torch.bfloat16)
    state["model"]["empty"] = torch.zeros(0, 4)
    msgs = list(layer_state.messages(3, pack(state), chunk))
    assert all(len(m.data) <= chunk for m in msgs)
    (got,) = _receive(msgs)
    assert got.layer == 3
    assert _same(got.packed.unpack(), state)


def test_a_layer_larger_than_the_tensor_limit_arrives_when_each_tensor_fits() -> None:
    """The limit is per tensor: a layer of three 4 KiB tensors passes a 4 KiB limit."""
    state = {"a": torch.ones(1024), "b": torch.zeros(1024), "c": torch.full((1024,), 2.0)}
    (got,) = _receive(list(layer_state.messages(0, pack(state), 100)), max_tensor=4096)
    assert _same(got.packed.unpack(), state)
    with pytest.raises(TooLarge, match="12288 bytes of tensors"):
        _receive(list(layer_state.messages(0, pack(state), 100)), max_layer=8192)


def test_weights_land_in_the_modules_own_memory() -> None:
    """Received into a new layer, the weights are that layer's parameters (no copy)."""
    source = nn.Linear(6, 4)
    state = _adam_state(source)
    target = nn.Linear(6, 4)
    pointers = {k: v.data_ptr() for k, v in target.state_dict().items()}
    (got,) = _receive(list(layer_state.messages(3, pack(state), 16)), IntoModule(target, "layer 3"))
    out = got.packed.unpack()
    assert {k: v.data_ptr() for k, v in out["model"].items()} == pointers
    torch.testing.assert_close(target.weight.detach(), source.weight.detach())


def test_a_held_snapshot_is_copied_into_a_new_layer_and_stays_intact() -> None:
    """A rollback from a snapshot held here: the weights are copied into the new layer's
    own memory, the optimizer tensors into fresh memory, and the snapshot is untouched."""
    held = pack(_adam_state(nn.Linear(6, 4)))
    target = nn.Linear(6, 4)
    pointers = {k: v.data_ptr() for k, v in target.state_dict().items()}
    out = held.copy_into(IntoModule(target, "layer 3"))
    assert {k: v.data_ptr() for k, v in out["model"].items()} == pointers
    assert _same(out, held.unpack())
    out["optimizer"]["state"][0]["exp_avg"].add_(1.0)
    assert not _same(out, held.unpack())
    with pytest.raises(InvalidRequest, match=r"\[4, 6\], but the layer's is float32 \[5, 6\]"):
        held.copy_into(IntoModule(nn.Linear(6, 5), "layer 3"))


def test_a_sealed_layer_is_sent_with_its_kept_digest_and_no_chunk_crcs() -> None:
    """A snapshot copy: the digest taken once at sealing is the trailer's (not computed
    again), the chunks carry no CRC-32, and the receiver verifies the digest and keeps it
    with its copy."""
    sealed = layer_state.seal(pack(_adam_state(nn.Linear(6, 4))))
    assert sealed.digest == sealed.computed_digest() and layer_state.seal(sealed) is sealed
    msgs = list(layer_state.messages(3, sealed, 16, checked_chunks=False))
    assert msgs[0].header.unchecked_chunks
    assert all(m.crc32 == 0 for m in msgs if m.data) and msgs[-1].digest == sealed.digest
    (got,) = _receive(msgs)
    assert _same(got.packed.unpack(), sealed.unpack()) and got.packed.digest == sealed.digest
    # The kept digest is what is sent: a wrong one is caught by the receiver.
    wrong = layer_state.PackedLayer(sealed.state, sealed.tensors, b"\0" * 32)
    with pytest.raises(TransferError, match="digest mismatch"):
        _receive(list(layer_state.messages(3, wrong, 16, checked_chunks=False)))
    # Into a module's own memory (which trains on), the digest is not kept.
    (into,) = _receive(list(layer_state.messages(3, sealed, 16)), IntoModule(nn.Linear(6, 4), "l"))
    assert into.packed.digest == b""


@pytest.mark.parametrize("chunk", [1, 100, 20000, 1 << 20])
def test_pre_encoded_chunks_are_the_messages_in_wire_form(chunk: int) -> None:
    """A push's pre-serialized ``SnapshotChunk``s parse to exactly the messages that
    ``messages`` builds (multi-byte lengths, a large layer index, an empty tensor)."""
    state = {"w": torch.randn(3000), "e": torch.zeros(0), "s": torch.tensor(2.0)}
    sealed = layer_state.seal(pack(state))
    field = stage_pb2.SnapshotChunk.DESCRIPTOR.fields_by_name["chunk"].number
    encoded = list(layer_state.encoded_chunks(300, sealed, chunk, field))
    expected = list(layer_state.messages(300, sealed, chunk, checked_chunks=False))
    assert [stage_pb2.SnapshotChunk.FromString(b).chunk for b in encoded] == expected
    (got,) = _receive([stage_pb2.SnapshotChunk.FromString(b).chunk for b in encoded])
    assert _same(got.packed.unpack(), state) and got.packed.digest == sealed.digest


def test_a_corrupted_chunk_without_crc_fails_the_layers_digest() -> None:
    """With no CRC-32 per chunk, one flipped bit anywhere still refuses the layer."""
    sealed = layer_state.seal(pack({"w": torch.arange(64.0), "v": torch.ones(3)}))
    msgs = list(layer_state.messages(0, sealed, 32, checked_chunks=False))
    for n in [i for i, m in enumerate(msgs) if m.data]:
        corrupt = stage_pb2.LayerChunk()
        corrupt.CopyFrom(msgs[n])
        corrupt.data = corrupt.data[:-1] + bytes([corrupt.data[-1] ^ 0x10])
        with pytest.raises(TransferError, match="digest mismatch"):
            _receive([*msgs[:n], corrupt, *msgs[n + 1 :]])


def test_a_held_snapshot_whose_bytes_changed_is_not_restored() -> None:
    """A restore from a held snapshot checks its bytes against the digest kept with it."""
    held = layer_state.seal(pack(_adam_state(nn.Linear(6, 4))))
    held.copy_into(Destination())  # intact: restored
    held.tensors[1].view(torch.uint8)[0] ^= 1
    with pytest.raises(TransferError, match="held bytes changed"):
        held.copy_into(IntoModule(nn.Linear(6, 4), "layer 3"))


def _header(*metas: tuple[int, list[int], int]) -> stage_pb2.LayerChunk:
    state = pack({"model": {f"t{i}": torch.zeros(1) for i in range(len(metas))}}).state
    return stage_pb2.LayerChunk(
        layer=0,
        header=stage_pb2.LayerHeader(
            state=state,
            tensors=[
                tensor_pb2.TensorMeta(dtype=d, shape=s, nbytes=n)  # type: ignore[arg-type]
                for d, s, n in metas
            ],
        ),
    )


def test_oversized_or_inconsistent_declarations_are_refused_before_allocation() -> None:
    """A tensor over the limit, a layer over its limit, or a byte count that disagrees
    with dtype and shape is refused on the header: nothing is allocated."""
    f32 = tensor_pb2.FLOAT32
    cases: list[tuple[stage_pb2.LayerChunk, type[Exception], str, dict[str, int]]] = [
        (_header((f32, [1 << 40], 4 << 40)), TooLarge, "over the limit", {}),
        (
            _header((f32, [1000], 4000), (f32, [1000], 4000)),
            TooLarge,
            "8000 bytes",
            {"max_layer": 6000},
        ),
        (_header((f32, [2, 3], 25)), InvalidRequest, "needs 24 bytes", {}),
        (_header((99, [2], 8)), InvalidRequest, "unknown tensor dtype", {}),
    ]
    for header, error, match, kw in cases:
        dest = Counting()
        with pytest.raises(error, match=match):
            _receive([header], dest, **kw)
        assert dest.allocated == 0


def test_a_wrong_declared_shape_for_the_layer_is_refused_before_allocation() -> None:
    """Weights of another shape, dtype or name than the layer's are refused on the header."""
    for state, match in [
        ({"index": 0, "model": {"weight": torch.zeros(3, 4), "bias": torch.zeros(4)}}, r"\[3, 4\]"),
        ({"index": 0, "model": {"weight": torch.zeros(4, 6, dtype=torch.float64)}}, "float64"),
        ({"index": 0, "model": {"nope": torch.zeros(4)}}, "'nope' is not in the layer"),
    ]:
        target = nn.Linear(6, 4)
        before = target.weight.detach().clone()
        msgs = list(layer_state.messages(0, pack(state)))
        with pytest.raises(InvalidRequest, match=match):
            _receive(msgs[:1], IntoModule(target, "layer 0"))
        assert torch.equal(target.weight.detach(), before)


def test_corrupt_reordered_or_truncated_streams_are_transfer_errors() -> None:
    """A chunk failing its CRC, out of order, a bad digest, an earlier release's trailer (its
    digest in a retired field), a truncated stream, a chunk before its header, and a layer
    sent twice are all refused."""
    msgs = list(layer_state.messages(0, pack({"w": torch.arange(64.0)}), 32))
    corrupt = stage_pb2.LayerChunk()
    corrupt.CopyFrom(msgs[2])
    corrupt.data = bytes([corrupt.data[0] ^ 1]) + corrupt.data[1:]
    bad_digest = stage_pb2.LayerChunk(layer=0, digest=b"\0" * 32)
    # an earlier release's trailer: its SHA-256 in field 12, since retired (tag 12 << 3 | 2)
    earlier = stage_pb2.LayerChunk.FromString(
        stage_pb2.LayerChunk(layer=0).SerializeToString() + bytes([0x62, 32]) + b"\1" * 32
    )
    for stream, match in [
        ([*msgs[:-1], earlier], "a trailer without its digest"),
        ([*msgs[:2], corrupt, *msgs[3:]], "CRC-32"),
        ([msgs[0], msgs[2], msgs[1], *msgs[3:]], "out of place"),
        ([*msgs[:-1], bad_digest], "digest mismatch"),
        (msgs[:-1], "stream ended inside layer 0"),
        ([*msgs[:3], msgs[-1]], "transfer stopped"),
        (msgs[1:], "before its header"),
    ]:
        with pytest.raises(TransferError, match=match):
            _receive(stream)
    with pytest.raises(InvalidRequest, match="sent twice"):
        _receive(msgs + msgs)


_MEASURE = """
import json, sys, torch
from torch import nn
from elasticpipe.wire import codec
from elasticpipe.wire import layer_state
torch.manual_seed(0)
mib = 1 << 20
mode = sys.argv[1]
sender = nn.Linear(4096, 4096, bias=False)  # 64 MiB of weights
state = {"index": 0, "model": {"weight": sender.weight.detach()}}
packed = layer_state.pack(state)
if mode == "blob":  # the earlier format: one msgpack blob per layer, reassembled whole
    blob = codec.pack_state(state)
    pieces = [blob[i : i + mib] for i in range(0, len(blob), mib)]
    del blob
def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))
# The receiver's peak above this point: the sender's copy and everything else is before.
messages = layer_state.messages(0, packed)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # resets the peak (VmHWM) to the current resident size
base = status("VmRSS")
peak = lambda: status("VmHWM")
if mode == "tensor":
    target = nn.Linear(4096, 4096, bias=False)  # the receiving stage's new layer
    into = layer_state.IntoModule(target, "layer 0")
    (got,) = layer_state.receive(messages, 1 << 40, 1 << 40, lambda _: into)
    target.load_state_dict(got.packed.unpack()["model"])
    ok = torch.equal(target.weight, sender.weight)
else:
    buffer = bytearray()
    for data in pieces:
        buffer += data
    out = codec.unpack_state(bytes(buffer), 1 << 40, 1 << 40)
    target = nn.Linear(4096, 4096, bias=False)
    target.load_state_dict(out["model"])
    ok = torch.equal(target.weight, sender.weight)
print(json.dumps({"ok": ok, "peak": peak() - base}))
"""


@pytest.mark.timeout(60)
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_receiving_a_64_mib_layer_costs_about_one_copy() -> None:
    """The receiver's peak memory for a 64 MiB layer (its new layer included) stays near
    64 MiB (one copy plus a chunk); the old one-blob path needed about four copies."""
    script = _MEASURE

    def run(mode: str) -> float:
        out = subprocess.run(
            [sys.executable, "-c", script, mode],
            capture_output=True,
            text=True,
            timeout=50,
            cwd=ROOT,
            check=True,
        )
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert result["ok"]
        return float(result["peak"]) / (64 << 20)

    tensor_wise, one_blob = run("tensor"), run("blob")
    print(
        f"receiver peak: {tensor_wise:.2f}x the layer tensor by tensor, {one_blob:.2f}x as a blob"
    )
    assert tensor_wise < 1.25 < one_blob
