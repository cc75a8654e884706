"""Which snapshot copies exist where, and which steps a job can be recovered to.

Stages report the complete snapshots they hold (their own and their peer's copy) in their
heartbeats. From those, per step, every layer has a set of holders. A step is
*recoverable* if every layer has at least one live holder, and *safe* if every layer has
``need`` live holders -- two when the chain has two stages or more, so that any single
failure still leaves a copy. The client keeps the mini-batches after the safe step: all
it may have to replay. Worked example, 4 layers on stages a (0-1) and b (2-3), each
copying its snapshot to the other::

    a holds step 10: layers 0,1 (own), 2,3 (b's copy)     b holds step 10: 2,3 and 0,1
    a holds step 20: layers 0,1 (own)                     (b's step-20 copy still in flight)
    -> step 10 is safe (2 holders per layer); step 20 is not yet
    b dies -> step 10 recoverable from a alone; step 20 not (layers 2,3 gone)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from elasticpipe.v1 import stage_pb2

Copies = dict[int, dict[int, set[str]]]  # step -> layer -> stage ids holding it


def copies_by_step(
    holdings: Mapping[str, Sequence[stage_pb2.SnapshotHolding]], job_id: str
) -> Copies:
    """Turns each stage's reported holdings into step -> layer -> holders."""
    out: Copies = {}
    for stage_id, held in holdings.items():
        for h in held:
            if h.job_id != job_id:
                continue
            layers = out.setdefault(int(h.step), {})
            for layer in h.layers:
                layers.setdefault(int(layer), set()).add(stage_id)
    return out


def newest_step(
    copies: Copies, num_layers: int, live: Iterable[str], need: int = 1, at_most: int | None = None
) -> int | None:
    """The newest step whose every layer has ``need`` live holders (None if none has).

    Args:
        copies: from ``copies_by_step``.
        num_layers: layers of the model.
        live: stage ids that are alive.
        need: holders required per layer.
        at_most: ignore steps after this one.
    """
    alive = set(live)
    for step in sorted(copies, reverse=True):
        if at_most is not None and step > at_most:
            continue
        layers = copies[step]
        if all(len(layers.get(layer, set()) & alive) >= need for layer in range(num_layers)):
            return step
    return None


def missing_layers(copies: Copies, step: int, num_layers: int, live: Iterable[str]) -> list[int]:
    """Layers with no live holder at ``step``."""
    alive = set(live)
    layers = copies.get(step, {})
    return [layer for layer in range(num_layers) if not layers.get(layer, set()) & alive]


def lost(
    copies: Copies,
    num_layers: int,
    live: Iterable[str],
    snapshot_every: int,
    otherwise: Iterable[int],
) -> tuple[list[int], str]:
    """When no step has a live copy of every layer (``newest_step`` is None): the layers
    with none at the newest step (``otherwise`` when there is no snapshot at all), and why,
    for the job's failure."""
    newest = max(copies, default=None)
    missing = (
        missing_layers(copies, newest, num_layers, live) if newest is not None else list(otherwise)
    )
    why = (
        "snapshots are off (snapshot_every=0)"
        if not snapshot_every
        else f"no complete snapshot survived (snapshot_every={snapshot_every})"
    )
    return missing, why


def holders_at(
    copies: Copies, step: int, num_layers: int, candidates: Iterable[str]
) -> dict[int, str]:
    """For each layer, the first of ``candidates`` (live stage ids, in preference order)
    holding its copy of ``step`` (``newest_step`` found one for every layer)."""
    ordered = list(candidates)
    layers = copies[step]
    return {
        layer: next(sid for sid in ordered if sid in layers[layer]) for layer in range(num_layers)
    }
