"""What one snapshot costs, piece by piece, for an 8 MiB and a 64 MiB layer set: the clone
on the training thread, then the background work of the owner (pack, checksums, the push's
messages serialized as gRPC does) and of the peer (parse, check, copy into its copy).

Three ways alternate round by round in one run, on the same clones:

* ``crc+digest`` (the earlier push): a layer's digest and every chunk's CRC-32 computed as it
  is sent, each ``LayerChunk`` built then copied into its ``SnapshotChunk``; the peer checks
  both;
* ``digest-once`` (now): the digest taken once when packing (kept with the snapshot), chunks
  without CRC-32 copied once, from the clone straight into their wire form; the peer
  checks the digest alone;
* ``sha-256-once``: the same as ``digest-once`` with SHA-256 as the digest, as it was before
  BLAKE3 (``layer_state.new_hasher`` swapped for the run of this way only): the digest's
  share, measured beside it.

The digest is BLAKE3 in the first two (``layer_state.new_hasher``).

Prints the best-of-rounds thread CPU of each piece (ms) and one JSON line.

    python bench/snapshot_cost.py --rounds 5

``--quick``: 1 round of a 1 MiB layer set, to check the script end to end in a second.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elasticpipe.stage_server import transfers
from elasticpipe.stage_server.slicestate import tensors_cloned
from elasticpipe.v1 import stage_pb2
from elasticpipe.wire import layer_state
from elasticpipe.wire.layer_state import PackedLayer

CHUNK = 1 << 20
LAYERS = 4


def layer_set(mib: int) -> dict[int, dict[str, Any]]:
    """``LAYERS`` layers of weights and Adam state, ``mib`` MiB in all."""
    n = mib * (1 << 20) // 4 // 3 // LAYERS
    return {
        i: {
            "index": i,
            "model": {"weight": torch.randn(n)},
            "optimizer": {
                "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(n)}},
                "param_groups": [{"lr": 0.1, "params": [0]}],
                "exp_avg_sq": torch.rand(n),
            },
        }
        for i in range(LAYERS)
    }


def timed(f: Callable[[], Any]) -> tuple[Any, float]:
    start = time.thread_time()
    out = f()
    return out, (time.thread_time() - start) * 1e3


def stream(way: str, blobs: dict[int, PackedLayer]) -> Iterator[bytes]:
    """The push's requests in wire form (as gRPC sends them)."""
    yield stage_pb2.SnapshotChunk(job_id="j", step=10, source="s").SerializeToString()
    for layer, packed in blobs.items():
        if way == "crc+digest":
            for chunk in layer_state.messages(layer, packed, CHUNK):
                yield stage_pb2.SnapshotChunk(chunk=chunk).SerializeToString()
        else:
            yield from layer_state.encoded_chunks(layer, packed, CHUNK, transfers._CHUNK_FIELD)


@contextlib.contextmanager
def digest_of(way: str) -> Iterator[None]:
    """SHA-256 as the layer digest while ``way`` is ``sha-256-once``; BLAKE3 otherwise."""
    if way != "sha-256-once":
        yield
        return
    blake3 = layer_state.new_hasher
    layer_state.new_hasher = hashlib.sha256  # type: ignore[assignment]
    try:
        yield
    finally:
        layer_state.new_hasher = blake3


def one(way: str, states: dict[int, dict[str, Any]]) -> dict[str, float]:
    clones, clone_ms = timed(lambda: {i: tensors_cloned(s) for i, s in states.items()})
    if way == "crc+digest":
        blobs, pack_ms = timed(lambda: {i: layer_state.pack(s) for i, s in clones.items()})
    else:
        blobs, pack_ms = timed(
            lambda: {i: layer_state.seal(layer_state.pack(s)) for i, s in clones.items()}
        )
    wire, send_ms = timed(lambda: list(stream(way, blobs)))

    def receive() -> dict[int, PackedLayer]:
        pieces = (stage_pb2.SnapshotChunk.FromString(b).chunk for b in wire[1:])
        return {g.layer: g.packed for g in layer_state.receive(pieces, 1 << 40, 1 << 40)}

    got, receive_ms = timed(receive)
    for i, packed in blobs.items():  # exact, or the figures mean nothing
        assert all(torch.equal(a, b) for a, b in zip(got[i].tensors, packed.tensors, strict=True))
    return {
        "clone": clone_ms,
        "pack": pack_ms,
        "send": send_ms,
        "receive": receive_ms,
        "owner_background": pack_ms + send_ms,
        "total": clone_ms + pack_ms + send_ms + receive_ms,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", default="8,64", help="MiB per layer set, comma-separated")
    parser.add_argument("--quick", action="store_true", help="1 round of a 1 MiB layer set")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.sizes = 1, "1"
    ways = ["crc+digest", "digest-once", "sha-256-once"]
    result: dict[str, Any] = {}
    for mib in (int(s) for s in args.sizes.split(",")):
        states = layer_set(mib)
        best: dict[str, dict[str, float]] = {w: {} for w in ways}
        for r in range(args.rounds):
            for way in ways if r % 2 == 0 else ways[::-1]:
                with digest_of(way):
                    pieces = one(way, states)
                for piece, ms in pieces.items():
                    best[way][piece] = min(ms, best[way].get(piece, float("inf")))
        print(f"{mib} MiB in {LAYERS} layers, best of {args.rounds} rounds, thread CPU ms:")
        print(f"  {'piece':18}" + "".join(f"{w:>13}" for w in ways))
        for piece in best[ways[0]]:
            print(f"  {piece:18}" + "".join(f"{best[w][piece]:13.1f}" for w in ways))
        for way in ways:
            for piece in ("owner_background", "receive", "total"):
                result[f"{way}_{mib}mib_{piece}_ms"] = round(best[way][piece], 2)
        blake3, sha256 = best["digest-once"]["total"], best["sha-256-once"]["total"]
        result[f"blake3_vs_sha256_{mib}mib_total"] = round(blake3 / sha256, 3) if sha256 else 0.0
        print(f"  BLAKE3 over SHA-256, all pieces: {result[f'blake3_vs_sha256_{mib}mib_total']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
