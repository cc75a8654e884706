"""Hugging Face causal LMs (``elasticpipe.models.hf:causal_lm``) trained through three real stages
equal the Hugging Face model's own forward, loss, backward and optimizer step, and
``LocalPipeline``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from elasticpipe import cli, models
from elasticpipe.client.pipeline import Pipeline
from elasticpipe.errors import ModelError
from elasticpipe.local.cluster import LocalCluster
from elasticpipe.local.reference import LocalPipeline
from elasticpipe.models import hf
from tests.support import hf_configs
from tests.support.numerics import assert_losses_close, stage_threads

transformers = pytest.importorskip("transformers")

MODEL = "elasticpipe.models.hf:causal_lm"
VOCAB = 37
# Tiny configs, dropout off; untied heads so that both sides train the same parameters.
CONFIGS: dict[str, dict[str, Any]] = {
    "gpt2": hf_configs.tiny("gpt2", VOCAB, tie_word_embeddings=False),
    "llama": hf_configs.tiny("llama", VOCAB, attention_dropout=0.0),
}
# SGD, not Adam: a key bias gets a gradient of exactly zero in exact arithmetic (softmax
# ignores a constant per row), and Adam would blow the rounding noise up to a full step.
SGD = {"lr": 0.5, "momentum": 0.9}


def _job(directory: Path) -> dict[str, Any]:
    """The job (model and training) of the save_pretrained ``directory``: its weights, SGD,
    two micro-batches; a ``Pipeline`` adds the coordinator and stages."""
    return {
        "model": MODEL,
        "model_kwargs": hf.model_kwargs(str(directory)),
        "init_state": directory,
        "optimizer": "sgd",
        "optimizer_kwargs": SGD,
        "micro_batches": 2,
    }


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """Three stages (the packaged factory needs no --allow-models)."""
    with LocalCluster(stages=3, auto_rebalance=False, heartbeat_s=0.2) as c:
        yield c


def _pretrained(family: str, directory: Path, **overrides: Any) -> Any:
    """A Hugging Face model from a tiny config, saved with save_pretrained (no hub)."""
    torch.manual_seed(5)
    config = transformers.AutoConfig.for_model(**{**CONFIGS[family], **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    return model


def _hf_state(pipe: Pipeline, family: str) -> dict[str, torch.Tensor]:
    """The pipeline's weights under their Hugging Face names."""
    state = pipe.state_dict()
    names = hf.source_keys({"config": CONFIGS[family]}, list(state), set())
    return {names[k]: v for k, v in state.items()}


@pytest.mark.numerics
@pytest.mark.timeout(180)
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_training_through_three_stages_equals_the_hugging_face_model(
    cluster: LocalCluster, tmp_path: Path, family: str
) -> None:
    """Same losses and weights as HF's forward(labels=...) + backward + SGD, 3 steps, and
    LocalPipeline's: both run under a stage's thread count; the pipeline splits each batch
    into 2 micro-batches, HF does not, so losses and weights are compared at float32's
    tolerance (the losses as float32, which they are)."""
    reference = _pretrained(family, tmp_path)
    optimizer = torch.optim.SGD(reference.parameters(), **SGD)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (4, 9), generator=g) for _ in range(3)]
    expected = []
    with stage_threads():
        for ids in batches:
            optimizer.zero_grad()
            loss = reference(input_ids=ids, labels=ids).loss  # HF shifts the labels itself
            loss.backward()
            optimizer.step()
            expected.append(float(loss.detach()))
    with Pipeline(coordinator=cluster.coordinator, **_job(tmp_path), stages=3) as pipe:
        assert pipe.partition.num_stages == 3
        losses = [pipe.train_step(ids[:, :-1], ids[:, 1:]) for ids in batches]
        assert_losses_close(losses, expected)
        got = _hf_state(pipe, family)
        pipe_state = pipe.state_dict()
    want = reference.state_dict()
    assert got.keys() == want.keys()
    torch.testing.assert_close(got, dict(want))
    with (
        stage_threads(),
        LocalPipeline(**_job(tmp_path)) as local,
    ):
        local_losses = [local.train_step(ids[:, :-1], ids[:, 1:]) for ids in batches]
        assert_losses_close(local_losses, losses)
        torch.testing.assert_close(local.state_dict(), pipe_state)


@pytest.mark.numerics
@pytest.mark.timeout(120)
def test_a_tied_gpt2_checkpoint_loads_its_embedding_into_the_head(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """A tied save_pretrained directory (no lm_head.weight in it) predicts as HF does."""
    reference = _pretrained("gpt2", tmp_path, tie_word_embeddings=True).eval()
    ids = torch.randint(0, VOCAB, (3, 8), generator=torch.Generator().manual_seed(2))
    with (
        pytest.warns(UserWarning, match="tied"),  # trained apart (none is, here)
        Pipeline(
            coordinator=cluster.coordinator,
            model=MODEL,
            model_kwargs={"path": str(tmp_path)},  # every stage reads the same local directory
            init_state=tmp_path,
            micro_batches=1,
            stages=3,
        ) as pipe,
    ):
        got = pipe.predict(ids)
    with torch.no_grad(), stage_threads():
        torch.testing.assert_close(got, reference(input_ids=ids).logits)


@pytest.mark.timeout(60)
def test_without_init_state_the_error_names_it() -> None:
    """transformers' layers have no reset_parameters: the error points to init_state."""
    with pytest.raises(ModelError, match="init_state"):
        models.build(MODEL, config=CONFIGS["gpt2"])
    with pytest.raises(ModelError, match="model_type"):
        models.build_skeleton(MODEL, {"config": {"model_type": "bert"}})


@pytest.mark.timeout(180)
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_model_trained_on_two_stages_exports_to_transformers_and_predicts_the_same(
    cluster: LocalCluster, tmp_path: Path, family: str
) -> None:
    """hf.save_pretrained of a Pipeline and `elasticpipe export-hf` of its checkpoint load
    with from_pretrained and predict pipe.predict's logits, the tied embedding and head
    having been trained apart."""
    _pretrained(family, tmp_path / "src", tie_word_embeddings=True)
    g = torch.Generator().manual_seed(3)
    with (
        pytest.warns(UserWarning, match="tied"),
        Pipeline(coordinator=cluster.coordinator, **_job(tmp_path / "src"), stages=2) as pipe,
    ):
        assert pipe.partition.num_stages == 2
        for _ in range(3):
            ids = torch.randint(0, VOCAB, (4, 9), generator=g)
            pipe.train_step(ids[:, :-1], ids[:, 1:])
        ids = torch.randint(0, VOCAB, (3, 8), generator=g)
        got = pipe.predict(ids)
        hf.save_pretrained(pipe, hf.model_kwargs(str(tmp_path / "src")), tmp_path / "live")
        pipe.save(tmp_path / "ckpt")
    # The command line: the config from the checkpoint's manifest (save_pretrained's None).
    assert cli.main(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "from-ckpt")]) == 0
    # Stages run one intra-op thread (LocalCluster): so does the reference. float32's
    # tolerance (assert_close's defaults), as in tests/unit/test_hf.py: the untied head
    # tied back to the embedding is off by ~1e-1.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for out in ("live", "from-ckpt"):
            back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / out).eval()
            assert back.config.tie_word_embeddings is False, out
            with torch.no_grad():
                torch.testing.assert_close(back(input_ids=ids).logits, got, msg=out)
    finally:
        torch.set_num_threads(threads)
