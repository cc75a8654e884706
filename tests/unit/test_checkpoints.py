"""``client/checkpoints.py``: a checkpoint directory round-trips every layer's weights and
optimizer state (tensors in safetensors shards, the rest in the manifest)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from elasticpipe import models
from elasticpipe.client import checkpoints
from elasticpipe.errors import InvalidRequest
from elasticpipe.models import weights
from elasticpipe.training.job import JobConfig
from elasticpipe.training.objectives import make_optimizer

MLP = {"sizes": [4, 8, 2]}


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [("adam", {"lr": 0.1}), ("sgd", {"lr": 0.1}), ("sgd", {"lr": 0.1, "momentum": 0.9})],
)
def test_optimizer_state_round_trips_through_a_directory(
    tmp_path: Path, name: str, kwargs: dict[str, Any]
) -> None:
    """Weights, optimizer tensors, scalars (SGD's None buffers) and param groups come back."""
    model = models.build("mlp", seed=1, **MLP)
    optimizers = {}
    for i, layer in enumerate(model):
        params = list(layer.parameters())
        if params:
            optimizers[i] = make_optimizer(name, params, kwargs)
            layer(torch.randn(3, layer.in_features)).sum().backward()
            optimizers[i].step()
    job = JobConfig(model="mlp", model_kwargs=MLP, optimizer=name, optimizer_kwargs=kwargs)
    _, params = weights.expected_state("mlp", MLP)
    writer = checkpoints.Writer(tmp_path / "c", job, params)
    for i, layer in enumerate(model):
        state: dict[str, Any] = {"index": i, "model": layer.state_dict()}
        if i in optimizers:
            state["optimizer"] = optimizers[i].state_dict()
        writer.add(state)
    writer.commit(step=7)
    reader = checkpoints.Reader(tmp_path / "c")
    assert reader.step == 7
    for i, layer in enumerate(model):
        got = reader.layer_state(i, layer.state_dict(), params[i])
        if i not in optimizers:
            assert "optimizer" not in got
            continue
        fresh = make_optimizer(
            name, [torch.nn.Parameter(p.detach().clone()) for p in layer.parameters()], {}
        )
        fresh.load_state_dict(got["optimizer"])
        want = optimizers[i].state_dict()
        # JSON has no tuples: Adam's betas come back as a list, which Adam takes alike.
        assert fresh.state_dict()["param_groups"] == json.loads(json.dumps(want["param_groups"]))
        torch.testing.assert_close(fresh.state_dict()["state"], want["state"])
    reader.close()
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert manifest["optimizer"]["param_groups"]["0"][0]["params"] == ["weight", "bias"]


def test_a_directory_of_another_format_is_refused(tmp_path: Path) -> None:
    """A manifest of another format names both formats."""
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(InvalidRequest, match="something-else"):
        checkpoints.Reader(tmp_path)
