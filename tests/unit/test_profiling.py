"""The profiling pass builds one layer at a time and measures what each layer needs."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch

from elasticpipe.stage_server import profiling
from elasticpipe.stage_server.layers import LayerSlice, Slowdown
from elasticpipe.training.job import JobConfig

SIZES = [8, 16, 4]  # Linear(8, 16), ReLU, Linear(16, 4)
LINEAR0 = (8 * 16 + 16) * 4  # bytes of layer 0's weight and bias


def _profile(optimizer: str, batch: int = 2) -> list[Any]:
    job = JobConfig(
        model="mlp", model_kwargs={"sizes": SIZES}, optimizer=optimizer, optimizer_kwargs={}
    )
    return profiling.profile_layers(
        job, torch.randn(batch, 8), torch.device("cpu"), Slowdown(1.0), (), 2
    )


@pytest.mark.timeout(30)
def test_state_bytes_count_weights_gradients_and_optimizer_state() -> None:
    """SGD: weights + gradients; Adam adds two moments and a step count per parameter."""
    sgd, adam = _profile("sgd"), _profile("adam")
    assert [t.state_bytes for t in sgd] == [2 * LINEAR0, 0, 2 * (16 * 4 + 4) * 4]
    assert adam[0].state_bytes == 4 * LINEAR0 + 2 * 4  # two float32 step scalars
    assert adam[1].state_bytes == 0


@pytest.mark.timeout(30)
def test_stash_bytes_count_input_output_and_saved_tensors_but_not_weights() -> None:
    """Layer 0 keeps its input and output (the weight autograd saves is state); the ReLU
    its input and output; doubling the micro-batch doubles the stash."""
    small, big = _profile("sgd", 2), _profile("sgd", 4)
    assert small[0].stash_bytes == 2 * 8 * 4 + 2 * 16 * 4
    assert small[1].stash_bytes == 2 * (2 * 16 * 4)
    assert [2 * t.stash_bytes for t in small] == [t.stash_bytes for t in big]
    assert all(t.samples == 2 and t.forward_s > 0 for t in small)


@pytest.mark.timeout(30)
def test_only_one_layer_is_resident_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """When layer l is built, every layer built before it has been freed."""
    built: list[weakref.ref[torch.nn.Module]] = []
    original = LayerSlice.build

    def build(self: LayerSlice, lo: int, hi: int) -> None:
        gc.collect()
        alive = [r for r in built if r() is not None]
        assert not alive, f"{len(alive)} earlier layer(s) still alive when building {lo}"
        original(self, lo, hi)
        built.extend(weakref.ref(m) for m in self.layers.values())

    monkeypatch.setattr(LayerSlice, "build", build)
    timings = _profile("adam")
    assert len(built) == len(timings) == 3
