"""``elasticpipe.models.weights``: sources of initial weights, read lazily and checked by key and
shape against the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from elasticpipe import models
from elasticpipe.errors import InvalidRequest
from elasticpipe.models import weights

MLP = {"sizes": [4, 8, 2]}


def _state() -> dict[str, torch.Tensor]:
    return models.build("mlp", seed=5, **MLP).state_dict()


def test_expected_state_names_every_key_with_its_layer_and_shape() -> None:
    """The worked example: keys, layers, shapes of an MLP, and its parameters per layer."""
    expected, params = weights.expected_state("mlp", MLP)
    assert {k: (e.layer, e.shape) for k, e in expected.items()} == {
        "0.weight": (0, (8, 4)),
        "0.bias": (0, (8,)),
        "2.weight": (2, (2, 8)),
        "2.bias": (2, (2,)),
    }
    assert params == [["weight", "bias"], [], ["weight", "bias"]]


def test_a_hugging_face_index_directory_reads_only_its_listed_shards(tmp_path: Path) -> None:
    """model.safetensors.index.json decides which files are read; others are ignored."""
    state = _state()
    save_file({k: state[k] for k in ("0.weight", "0.bias")}, str(tmp_path / "m-1.safetensors"))
    save_file({k: state[k] for k in ("2.weight", "2.bias")}, str(tmp_path / "m-2.safetensors"))
    save_file({"junk": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    index = {"weight_map": {k: f"m-{1 if k.startswith('0') else 2}.safetensors" for k in state}}
    (tmp_path / weights.HF_INDEX).write_text(json.dumps(index))
    expected, _ = weights.expected_state("mlp", MLP)
    plan = weights.plan(weights.open_source(tmp_path), expected, weights.no_rename)
    torch.testing.assert_close(
        plan.layer_state(2), {"weight": state["2.weight"], "bias": state["2.bias"]}
    )
    assert plan.layer_state(1) == {}


def test_a_key_in_two_files_and_a_file_that_is_not_safetensors_are_refused(tmp_path: Path) -> None:
    """Ambiguous or unreadable sources raise InvalidRequest naming the files."""
    save_file({"0.bias": torch.zeros(8)}, str(tmp_path / "a.safetensors"))
    save_file({"0.bias": torch.ones(8)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(InvalidRequest, match=r"'0.bias' is in both .*a.safetensors and .*b"):
        weights.open_source(tmp_path)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(InvalidRequest, match=r"cannot read .*bad\.safetensors"):
        weights.open_source(bad)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InvalidRequest, match=r"holds no \.safetensors"):
        weights.open_source(empty)


def test_renamed_keys_are_used_only_when_the_models_own_keys_are_absent() -> None:
    """A factory's source_keys maps names; the shapes are still checked under both names."""
    state = _state()
    expected, _ = weights.expected_state("mlp", MLP)
    foreign = {f"net.{k}": v for k, v in state.items()}

    def rename(keys: list[str], have: set[str]) -> dict[str, str]:
        return {k: f"net.{k}" for k in keys}

    plan = weights.plan(weights.TensorSource(mapping=foreign), expected, rename)
    assert plan.keys["0.weight"] == "net.0.weight"
    foreign["net.0.weight"] = torch.zeros(3, 3)
    with pytest.raises(
        InvalidRequest, match=r"'net.0.weight' has shape \[3, 3\], the model's '0.weight' \[8, 4\]"
    ):
        weights.plan(weights.TensorSource(mapping=foreign), expected, rename)


def test_a_bfloat16_checkpoint_is_widened_to_the_models_float32(tmp_path: Path) -> None:
    """Most published checkpoints are bfloat16: each tensor arrives as the model's dtype
    (what the stage's strict per-tensor check then accepts), rounded as bfloat16 is."""
    state = {k: v.to(torch.bfloat16) for k, v in _state().items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    expected, _ = weights.expected_state("mlp", MLP)
    source = weights.open_source(str(tmp_path / "model.safetensors"))
    p = weights.plan(source, expected, weights.no_rename)
    layer = p.layer_state(0)
    assert layer["weight"].dtype == torch.float32
    assert torch.equal(layer["weight"], state["0.weight"].float())
