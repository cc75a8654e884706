"""What a stage's backward needs of one micro-batch, held from its forward (``Stash``).

``LayerSlice.forward`` fills one per micro-batch; ``backward`` (and ZB-H1's W,
``backward_weights``) empties it. ``Stash.nbytes`` is what the executor reports as the
activation memory a run held at its peak.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from elasticpipe.stage_server import weightgrad
from elasticpipe.stage_server.devicetime import Lap
from elasticpipe.wire import structure


class WeightWork(NamedTuple):
    """One layer's weight gradients, left by B for W (``weightgrad``); ``grads`` are the
    gradients of its outputs (named in errors), ``b_seconds`` what B spent on it."""

    layer: int
    split: weightgrad.Split
    grads: list[torch.Tensor]
    b_seconds: float | Lap


@dataclass
class Stash:
    """What backward needs of one micro-batch: each layer's (inputs, outputs), as flat
    lists of tensors (``elasticpipe.wire.structure``); an input is detached unless linked;
    the outputs are None for a layer that recomputes its forward during backward (it keeps
    only its inputs)."""

    pairs: list[tuple[list[torch.Tensor], list[torch.Tensor] | None]] = field(default_factory=list)
    # by layer: whether its input is the layer below's output itself, not a detached copy
    # (``LayerSlice.forward``: one autograd pass runs through linked layers)
    linked: list[bool] = field(default_factory=list)
    seeds: dict[int, int] = field(default_factory=dict)  # recomputed layers' RNG seeds
    # recomputed layers' input structures (None: a plain tensor), to rebuild the input
    shapes: dict[int, structure.Structure | None] = field(default_factory=dict)

    saved: list[weakref.ref[torch.Tensor]] = field(default_factory=list)  # by autograd
    counted: bool = True  # whether ``saved`` was noted (``LayerSlice.forward``'s ``count``)
    # ZB-H1: the weight gradients B left for W, in the order B met the layers
    weights: list[WeightWork] = field(default_factory=list)
    # ZB-H1: weight gradients B wrote itself (a layer whose backward cannot be split, as
    # reentrant checkpointing): kept here until W, so that no other micro-batch's B adds
    # to them in ``.grad`` before this one's gradients are taken
    early: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def nbytes(self) -> int:
        """Bytes of activation memory held: every layer's inputs and outputs, what the
        autograd graph still keeps for backward (parameters excluded; only if ``counted``),
        and after a ZB-H1 B the gradients kept for W, each storage once."""
        alive = [t for ref in self.saved if (t := ref()) is not None]
        alive += [t for pair in self.pairs for ts in pair if ts is not None for t in ts]
        alive += [t for w in self.weights for t in (*w.grads, *w.split.tensors())]
        held = {}
        for t in alive:
            storage = t.untyped_storage()
            held[storage.data_ptr()] = storage.nbytes()
        return sum(held.values())
