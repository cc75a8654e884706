"""``elasticpipe.hf``: every supported family's layers compute what the Hugging Face model
computes, from its own save_pretrained directory, forward and backward."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from elasticpipe import hf, models, weights

transformers = pytest.importorskip("transformers")

MODEL = "elasticpipe.hf:causal_lm"
LLAMA_LIKE = {
    "num_hidden_layers": 2,
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 16,
    "vocab_size": 29,
    "tie_word_embeddings": False,
}
CONFIGS: dict[str, dict[str, Any]] = {
    "gpt2": {
        "model_type": "gpt2",
        "n_layer": 2,
        "n_embd": 16,
        "n_head": 2,
        "n_positions": 16,
        "vocab_size": 29,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    },
    "llama": {"model_type": "llama", **LLAMA_LIKE},
    "mistral": {"model_type": "mistral", **LLAMA_LIKE},
    "qwen2": {"model_type": "qwen2", **LLAMA_LIKE},
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
    with pytest.raises(models.ModelError, match="exactly one"):
        models.build_skeleton(MODEL, {})
    with pytest.raises(models.ModelError, match="model_type"):
        models.build_skeleton(MODEL, {"config": {"model_type": "t5"}})
