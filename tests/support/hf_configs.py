"""Tiny Hugging Face configs of the families the tests build (two layers, width 16, dropout
off), spelled once for the unit and the integration tests: ``tiny(family, vocab)``."""

from __future__ import annotations

from typing import Any

GPT2: dict[str, Any] = {"n_layer": 2, "n_embd": 16, "n_head": 2, "n_positions": 16}
GPT2_NO_DROPOUT: dict[str, Any] = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
LLAMA_LIKE: dict[str, Any] = {  # llama, mistral, qwen2
    "num_hidden_layers": 2,
    "hidden_size": 16,
    "intermediate_size": 24,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 16,
}


def tiny(family: str, vocab: int, **overrides: Any) -> dict[str, Any]:
    """The tiny config of ``family`` ("gpt2", or a llama-like one) with ``vocab`` tokens;
    ``overrides`` add or replace keys; the llama-like ones' heads are untied unless they say."""
    if family == "gpt2":
        return {"model_type": family, **GPT2, "vocab_size": vocab, **GPT2_NO_DROPOUT, **overrides}
    config = {"model_type": family, **LLAMA_LIKE, "vocab_size": vocab, **overrides}
    config.setdefault("tie_word_embeddings", False)
    return config
