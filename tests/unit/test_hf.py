"""``elasticpipe.models.hf``: every supported family's layers compute what the Hugging Face model
computes, from its own save_pretrained directory, forward and backward."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from elasticpipe import models
from elasticpipe.errors import InvalidRequest, ModelError
from elasticpipe.models import hf, weights
from tests.support import hf_configs

transformers = pytest.importorskip("transformers")

MODEL = "elasticpipe.models.hf:causal_lm"
# gpt2 with its default tied head; the llama-like families untied.
CONFIGS: dict[str, dict[str, Any]] = {
    family: hf_configs.tiny(family, 29) for family in ("gpt2", "llama", "mistral", "qwen2")
}


@pytest.mark.numerics
@pytest.mark.timeout(60)
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_layers_equal_the_hugging_face_model_forward_and_backward(
    tmp_path: Path, family: str
) -> None:
    """Logits and every parameter's gradient match the HF model loaded from the same files."""
    assert family in hf.FAMILIES
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**CONFIGS[family])
    reference = transformers.AutoModelForCausalLM.from_config(config)
    reference.save_pretrained(tmp_path)
    kwargs = {"config": CONFIGS[family]}
    expected, _ = weights.expected_state(MODEL, kwargs)
    plan = weights.plan(weights.open_source(tmp_path), expected, weights.source_keys(MODEL, kwargs))
    layers = models.build(MODEL, external=True, **kwargs)
    for i, layer in enumerate(layers):
        layer.load_state_dict(plan.layer_state(i), strict=True)
    ids = torch.randint(0, 29, (2, 7), generator=torch.Generator().manual_seed(1))
    got = layers(ids)
    want = reference(input_ids=ids).logits
    torch.testing.assert_close(got, want)
    got.square().mean().backward()
    want.square().mean().backward()
    hf_grads = {n: p.grad for n, p in reference.named_parameters()}
    shared = {n for n in plan.keys.values() if list(plan.keys.values()).count(n) > 1}
    for key, name in plan.keys.items():
        if name in hf_grads and name not in shared:  # tied: HF sums both uses in one grad
            layer, _, local = key.partition(".")
            param = layers[int(layer)].get_parameter(local)
            torch.testing.assert_close(param.grad, hf_grads[name], msg=key)


@pytest.mark.timeout(30)
def test_keys_map_to_hugging_face_names_and_a_tied_head_reads_the_embedding() -> None:
    """Embeddings, blocks and head map as the module docstring's worked example says."""
    keys = ["0.wte.weight", "1.block.ln_1.weight", "2.block.attn.c_attn.bias", "3.lm_head.weight"]
    tied = hf.source_keys({"config": CONFIGS["gpt2"]}, keys, {"transformer.wte.weight"})
    assert tied == {
        "0.wte.weight": "transformer.wte.weight",
        "1.block.ln_1.weight": "transformer.h.0.ln_1.weight",
        "2.block.attn.c_attn.bias": "transformer.h.1.attn.c_attn.bias",
        "3.lm_head.weight": "transformer.wte.weight",
    }
    untied = hf.source_keys({"config": CONFIGS["gpt2"]}, keys, {"lm_head.weight"})
    assert untied["3.lm_head.weight"] == "lm_head.weight"
    llama = hf.source_keys(
        {"config": CONFIGS["llama"]}, ["0.embed_tokens.weight", "3.norm.weight"], set()
    )
    assert llama == {
        "0.embed_tokens.weight": "model.embed_tokens.weight",
        "3.norm.weight": "model.norm.weight",
    }


@pytest.mark.timeout(30)
def test_bad_arguments_are_model_errors() -> None:
    """Both or neither of config/path, or an unsupported family, say what is wrong."""
    with pytest.raises(ModelError, match="exactly one"):
        models.build_skeleton(MODEL, {})
    with pytest.raises(ModelError, match="model_type"):
        models.build_skeleton(MODEL, {"config": {"model_type": "t5"}})


# ---- back to transformers: save_pretrained -------------------------------------------------

# Logits of the export and of the pipeline are compared at float32's tolerance
# (assert_close's float32 defaults: rtol 1.3e-6, atol 1e-5, a few ulps through two blocks of
# width 16): the weights are the same tensors, but transformers builds its causal mask its
# own way. A head tied back to the trained embedding is off by ~1e-1, four orders above it.
TIED = {"gpt2": CONFIGS["gpt2"], "llama": {**CONFIGS["llama"], "tie_word_embeddings": True}}
EMBEDDING = {"gpt2": "0.wte.weight", "llama": "0.embed_tokens.weight"}


def _tied_directory(family: str, directory: Path) -> Any:
    """A save_pretrained directory whose LM head is tied to its embedding."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**TIED[family])
    assert config.tie_word_embeddings
    reference = transformers.AutoModelForCausalLM.from_config(config)
    reference.save_pretrained(directory)
    return reference


def _local(directory: Path) -> Any:
    from elasticpipe.local.reference import LocalPipeline

    return LocalPipeline(
        model=MODEL,
        model_kwargs=hf.model_kwargs(str(directory)),
        init_state=directory,
        optimizer="sgd",
        optimizer_kwargs={"lr": 0.5},
        micro_batches=2,
    )


def _ids(seed: int, shape: tuple[int, int] = (4, 9)) -> torch.Tensor:
    return torch.randint(0, 29, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("family", sorted(TIED))
def test_a_trained_tied_model_exports_untied_and_predicts_as_the_pipeline(
    tmp_path: Path, family: str
) -> None:
    """After training, from_pretrained of the export gives pipe.predict's logits."""
    reference = _tied_directory(family, tmp_path / "src")
    with pytest.warns(UserWarning, match="tied"):
        pipe = _local(tmp_path / "src")
    for step in range(3):
        ids = _ids(step)
        pipe.train_step(ids[:, :-1], ids[:, 1:])
    state = pipe.state_dict()
    head = f"{len(pipe.layers) - 1}.lm_head.weight"
    assert not torch.equal(state[EMBEDDING[family]], state[head])  # trained apart
    out = hf.save_pretrained(pipe, hf.model_kwargs(str(tmp_path / "src")), tmp_path / "out")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert back.config.tie_word_embeddings is False
    assert back.state_dict().keys() == reference.state_dict().keys()
    ids = _ids(9, (3, 8))
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, pipe.predict(ids))


@pytest.mark.timeout(60)
def test_untrained_tied_weights_stay_tied_and_a_state_dict_exports_too(tmp_path: Path) -> None:
    """Equal embedding and head: the export keeps the tie and, as HF does, no lm_head."""
    from safetensors import safe_open

    reference = _tied_directory("gpt2", tmp_path / "src").eval()
    with pytest.warns(UserWarning):
        pipe = _local(tmp_path / "src")
    out = hf.save_pretrained(pipe.state_dict(), CONFIGS["gpt2"], tmp_path / "out")
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()  # noqa: SIM118 (safe_open is no dict)
        assert "transformer.wte.weight" in f.keys()  # noqa: SIM118
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert back.config.tie_word_embeddings is True
    ids = _ids(3, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, reference(input_ids=ids).logits)


@pytest.mark.timeout(60)
def test_init_state_warns_of_tied_weights_naming_them_and_the_export(tmp_path: Path) -> None:
    """A tied checkpoint warns, naming both keys, the file's tensor and save_pretrained."""
    _tied_directory("gpt2", tmp_path / "tied")
    with pytest.warns(UserWarning) as caught:
        _local(tmp_path / "tied")
    (message,) = [str(w.message) for w in caught if "tied" in str(w.message)]
    for name in ("'0.wte.weight'", "'3.lm_head.weight'", "'transformer.wte.weight'"):
        assert name in message
    assert "elasticpipe.models.hf.save_pretrained" in message
    assert "tie_word_embeddings=false" in message
    assert caught[0].filename == __file__  # points at the user's LocalPipeline(...) line
    torch.manual_seed(0)
    untied = transformers.AutoConfig.for_model(**{**CONFIGS["gpt2"], "tie_word_embeddings": False})
    transformers.AutoModelForCausalLM.from_config(untied).save_pretrained(tmp_path / "untied")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        _local(tmp_path / "untied")


@pytest.mark.timeout(60)
def test_export_refuses_weights_that_do_not_fit_and_a_directory_with_other_shards(
    tmp_path: Path,
) -> None:
    """Missing keys, wrong shapes, stray shards and a config=None without manifest say so."""
    _tied_directory("gpt2", tmp_path / "src")
    with pytest.warns(UserWarning):
        state = _local(tmp_path / "src").state_dict()
    missing = {k: v for k, v in state.items() if k != "2.block.ln_2.bias"}
    with pytest.raises(InvalidRequest, match=r"missing keys \['2.block.ln_2.bias'\]"):
        hf.save_pretrained(missing, CONFIGS["gpt2"], tmp_path / "a")
    wide = {**state, "3.ln_f.weight": torch.ones(17)}
    with pytest.raises(InvalidRequest, match=r"'3.ln_f.weight' has shape \[17\]"):
        hf.save_pretrained(wide, CONFIGS["gpt2"], tmp_path / "b")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "model-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(InvalidRequest, match=r"model-00001-of-00002\.safetensors"):
        hf.save_pretrained(state, CONFIGS["gpt2"], tmp_path / "c")
    with pytest.raises(InvalidRequest, match="config=None"):
        hf.save_pretrained(state, None, tmp_path / "d")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.timeout(30)
def test_the_renaming_and_the_export_are_public() -> None:
    """source_keys and save_pretrained are in elasticpipe.models.hf's __all__."""
    assert {"source_keys", "save_pretrained"} <= set(hf.__all__)


@pytest.mark.timeout(30)
def test_export_hf_of_a_directory_that_is_no_checkpoint_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`elasticpipe export-hf` without --config needs a checkpoint's manifest, and says so."""
    from elasticpipe import cli

    assert cli.main(["export-hf", str(tmp_path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "config=None needs a checkpoint directory" in err and str(tmp_path) in err
