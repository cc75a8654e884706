"""The profiling pass builds one layer at a time and measures what each layer needs."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch

from elasticpipe.stage_server import profiling
from elasticpipe.stage_server.devicetime import Slowdown
from elasticpipe.stage_server.layers import LayerSlice
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


def _alike_model() -> list[torch.nn.Module]:
    """Linear(8, 8) x 3 with ReLUs between them (the middle two alike), then a head."""
    return [
        torch.nn.Linear(8, 8),  # 0: the first layer gets an input without a gradient
        torch.nn.ReLU(),
        torch.nn.Linear(8, 8),  # 2
        torch.nn.ReLU(),  # 3: alike to 1
        torch.nn.Linear(8, 8),  # 4: alike to 2
        torch.nn.LeakyReLU(0.1),  # 5: another attribute
        torch.nn.Linear(8, 4),
    ]


@pytest.mark.timeout(30)
def test_alike_layers_are_measured_once_and_take_the_first_ones_figures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Layer 0 differs from 2 and 4 by its input (it needs no input gradient); 3 and 4
    repeat 1 and 2, so they are neither built nor run, and copy their figures."""
    monkeypatch.setattr(
        "elasticpipe.models.contract.resolve_factory", lambda name, allow=(): _alike_model
    )
    built: list[int] = []
    original = LayerSlice.build

    def build(self: LayerSlice, lo: int, hi: int) -> None:
        built.append(lo)
        original(self, lo, hi)

    monkeypatch.setattr(LayerSlice, "build", build)
    job = JobConfig(model="alike", optimizer="adam", optimizer_kwargs={})
    timings = profiling.profile_layers(
        job, torch.randn(2, 8), torch.device("cpu"), Slowdown(1.0), (), 2
    )
    assert built == [0, 1, 2, 5, 6]
    assert len(timings) == 7
    assert timings[3] == timings[1] and timings[3] is not timings[1]
    assert timings[4] == timings[2]
    assert timings[2].state_bytes == timings[0].state_bytes > 0


@pytest.mark.timeout(30)
def test_a_recomputed_layer_is_not_alike_to_one_that_is_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Layer 2 recomputes its forward (it keeps only its input): layer 4, alike to it
    otherwise, is measured for itself, with a larger stash."""
    monkeypatch.setattr(
        "elasticpipe.models.contract.resolve_factory", lambda name, allow=(): _alike_model
    )
    job = JobConfig(model="alike", optimizer="sgd", optimizer_kwargs={}, recompute=(2,))
    timings = profiling.profile_layers(
        job, torch.randn(2, 8), torch.device("cpu"), Slowdown(1.0), (), 2
    )
    assert timings[4].stash_bytes > timings[2].stash_bytes


def test_alike_key_compares_structure_values_and_objects() -> None:
    """Shapes, dtypes, plain attributes and hooks decide; Hugging Face's layer_idx does not."""
    key = profiling.alike_key
    assert key(torch.nn.Linear(8, 8)) == key(torch.nn.Linear(8, 8))
    assert key(torch.nn.Linear(8, 8)) != key(torch.nn.Linear(8, 8, bias=False))
    assert key(torch.nn.Linear(8, 8)) != key(torch.nn.Linear(8, 8, dtype=torch.float64))
    assert key(torch.nn.Dropout(0.1)) != key(torch.nn.Dropout(0.2))
    assert key(torch.nn.GELU("tanh")) != key(torch.nn.GELU())
    a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    a.layer_idx, b.layer_idx = 0, 1  # type: ignore[assignment]
    assert key(a) == key(b)
    a.window, b.window = 16, None  # type: ignore[assignment]
    assert key(a) != key(b)
    shared = {"scale": 2.0}
    a.config = b.config = shared  # type: ignore[assignment]
    b.window = 16  # type: ignore[assignment]
    assert key(a) == key(b)  # the same object
    b.config = {"scale": 2.0}  # type: ignore[assignment]
    assert key(a) == key(b)  # a plain dict: compared by value
    a.config, b.config = object(), object()  # type: ignore[assignment]
    assert key(a) != key(b)  # other objects: only the same one matches
    a.config = b.config  # type: ignore[assignment]
    b.register_forward_hook(lambda module, args, out: out * 2)
    assert key(a) != key(b)


@pytest.mark.timeout(30)
def test_an_optimizer_that_cannot_step_meta_tensors_is_measured_on_the_layer() -> None:
    """Adafactor reads a value in its step: its state is measured by a real step, and
    counts the same bytes as the meta step would for the moments it keeps."""
    job = JobConfig(
        model="mlp",
        model_kwargs={"sizes": SIZES},
        optimizer="torch.optim:Adafactor",
        optimizer_kwargs={},
    )
    timings = profiling.profile_layers(
        job, torch.randn(2, 8), torch.device("cpu"), Slowdown(1.0), ("torch",), 2
    )
    linear = timings[0]
    # weight + bias + their gradients; Adafactor keeps a step count per parameter, a row
    # and a column factor for the matrix and a full second moment for the vector
    expected = 2 * LINEAR0 + 2 * 4 + (16 + 8) * 4 + 16 * 4
    assert linear.state_bytes == expected
