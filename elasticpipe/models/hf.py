"""Hugging Face decoder-only causal LMs as pipeline layers (``elasticpipe[hf]``).

``elasticpipe.models.hf:causal_lm`` turns a ``transformers`` model into layers that each take and
return one tensor: the embeddings (token ids in, hidden states out), one layer per
decoder block, and the final norm with the LM head (hidden states in, logits out). A block
wrapper builds what the block needs from its input's shape alone: the position ids, the
rotary embeddings (Llama family) and the causal mask.

Worked example: a GPT-2 with ``n_layer=2`` becomes 4 layers, whose state-dict keys map to
the Hugging Face names as follows (``source_keys``), so ``init_state`` can read a
``save_pretrained`` directory as it is::

    0.wte.weight            transformer.wte.weight
    0.wpe.weight            transformer.wpe.weight
    1.block.ln_1.weight     transformer.h.0.ln_1.weight
    2.block.attn.c_attn.*   transformer.h.1.attn.c_attn.*
    3.ln_f.weight           transformer.ln_f.weight
    3.lm_head.weight        lm_head.weight  (transformer.wte.weight when tied and absent)

Tied input and output embeddings become two tensors (layers on two stages cannot share
one); both start from the checkpoint's value and are trained separately (``init_state``
warns of it).

Back to ``transformers``: ``save_pretrained(pipe, config, DIR)`` writes ``DIR/config.json``
and ``DIR/model.safetensors`` under the Hugging Face names, which
``AutoModelForCausalLM.from_pretrained(DIR)`` loads to predict what the pipeline predicts:
a tied config whose two trained tensors now differ is written with
``tie_word_embeddings=false`` (tying them again would replace the trained head by the
embedding).

The layers are initialised from weights (``Pipeline(..., init_state=DIR)``), not from the
seed: ``transformers`` modules have no ``reset_parameters()``. ``transformers`` is imported
only when the factory runs, so ``import elasticpipe`` does not need it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from elasticpipe.errors import InvalidRequest, ModelError
from elasticpipe.logs import get_logger

__all__ = ["FAMILIES", "causal_lm", "model_kwargs", "save_pretrained", "source_keys"]

log = get_logger(__name__)

MODEL = "elasticpipe.models.hf:causal_lm"

GPT2_FAMILY = ("gpt2",)
LLAMA_FAMILY = ("llama", "mistral", "qwen2")
FAMILIES = (*GPT2_FAMILY, *LLAMA_FAMILY)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ModelError(
            "elasticpipe.models.hf needs transformers: pip install 'elasticpipe[hf]'"
        ) from exc
    return transformers


def _config(config: Mapping[str, Any] | None, path: str | None) -> Any:
    """A transformers config from JSON-able kwargs or a local save_pretrained directory."""
    if (config is None) == (path is None):
        raise ModelError("causal_lm takes exactly one of config={...} or path='DIR'")
    if path is not None:
        config = json.loads((Path(path) / "config.json").read_text())
    assert config is not None
    values = dict(config)
    model_type = values.pop("model_type", None)
    if model_type not in FAMILIES:
        raise ModelError(
            f"causal_lm supports model_type {list(FAMILIES)}, got {model_type!r} "
            "(set config['model_type'])"
        )
    values.pop("architectures", None)
    values.pop("transformers_version", None)
    attention = values.pop("attn_implementation", None) or "sdpa"
    made = _transformers().AutoConfig.for_model(model_type, **values)
    # What from_pretrained would choose; a config made by hand leaves it unset.
    made._attn_implementation = attention
    return made


def model_kwargs(path: str) -> dict[str, Any]:
    """``model_kwargs`` for ``causal_lm`` from a local ``save_pretrained`` directory: its
    ``config.json`` as plain data, so the stages need no copy of the directory."""
    config = json.loads((Path(path) / "config.json").read_text())
    if not isinstance(config, dict):
        raise ModelError(f"{path}/config.json is not a JSON object")
    return {"config": config}


def _causal_mask(hidden: torch.Tensor) -> torch.Tensor:
    """An additive (1, 1, T, T) mask: 0 on and below the diagonal, the dtype's min above."""
    t = hidden.shape[1]
    full = torch.full((t, t), torch.finfo(hidden.dtype).min, device=hidden.device)
    return full.triu(1).to(hidden.dtype)[None, None]


def _first(output: Any) -> torch.Tensor:
    """A block's hidden states (older transformers return a tuple)."""
    result: torch.Tensor = output[0] if isinstance(output, tuple) else output
    return result


# ---- GPT-2 ---------------------------------------------------------------------------------


class GPT2Embeddings(nn.Module):
    """Token plus learned position embeddings, then dropout."""

    def __init__(self, config: Any):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.drop = nn.Dropout(config.embd_pdrop)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)[None]
        return self.drop(self.wte(ids) + self.wpe(positions))  # type: ignore[no-any-return]


class GPT2Layer(nn.Module):
    """One ``GPT2Block`` under a causal mask."""

    def __init__(self, config: Any, index: int):
        super().__init__()
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        self.block = GPT2Block(config, layer_idx=index)  # type: ignore[no-untyped-call]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return _first(self.block(hidden, attention_mask=_causal_mask(hidden)))


class GPT2Head(nn.Module):
    """Final layer norm and the LM head."""

    def __init__(self, config: Any):
        super().__init__()
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(hidden))  # type: ignore[no-any-return]


# ---- Llama family --------------------------------------------------------------------------


class LlamaEmbeddings(nn.Module):
    """Token embeddings."""

    def __init__(self, config: Any):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)  # type: ignore[no-any-return]


class LlamaLayer(nn.Module):
    """One decoder layer with its rotary embeddings and causal mask built from the input.

    The rotary embedding's ``inv_freq`` is a non-persistent buffer, in no state dict: it is
    kept out of the module tree and built on first use on each device, from the config.
    """

    def __init__(self, config: Any, index: int):
        super().__init__()
        self.block = _decoder(config, index)
        self._config = config
        self._rotary: dict[torch.device, nn.Module] = {}

    def _rotary_on(self, device: torch.device) -> nn.Module:
        rotary = self._rotary.get(device)
        if rotary is None:
            with torch.device("cpu"):
                rotary = _rotary(self._config)
            rotary = rotary.to(device)
            self._rotary[device] = rotary
        return rotary

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch, length = hidden.shape[:2]
        positions = torch.arange(length, device=hidden.device)[None].expand(batch, length)
        cos, sin = self._rotary_on(hidden.device)(hidden, positions)
        out = self.block(
            hidden,
            attention_mask=_causal_mask(hidden),
            position_ids=positions,
            position_embeddings=(cos, sin),
        )
        return _first(out)


def _decoder(config: Any, index: int) -> nn.Module:
    t = _transformers()
    family = {
        "llama": t.models.llama.modeling_llama.LlamaDecoderLayer,
        "mistral": t.models.mistral.modeling_mistral.MistralDecoderLayer,
        "qwen2": t.models.qwen2.modeling_qwen2.Qwen2DecoderLayer,
    }
    layer: nn.Module = family[config.model_type](config, index)
    return layer


def _rotary(config: Any) -> nn.Module:
    t = _transformers()
    family = {
        "llama": t.models.llama.modeling_llama.LlamaRotaryEmbedding,
        "mistral": t.models.mistral.modeling_mistral.MistralRotaryEmbedding,
        "qwen2": t.models.qwen2.modeling_qwen2.Qwen2RotaryEmbedding,
    }
    rotary: nn.Module = family[config.model_type](config)
    return rotary


class LlamaHead(nn.Module):
    """Final RMS norm and the LM head."""

    def __init__(self, config: Any):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))  # type: ignore[no-any-return]


# ---- the factory ---------------------------------------------------------------------------


def causal_lm(*, config: Mapping[str, Any] | None = None, path: str | None = None) -> nn.Sequential:
    """A decoder-only causal LM of ``transformers`` as embeddings, blocks and head.

    Args:
        config: the model's config as plain data (a ``config.json``'s content; it must
            name its ``model_type``: one of ``FAMILIES``).
        path: instead, a local ``save_pretrained`` directory whose ``config.json`` is read
            (on every stage: use ``model_kwargs(path)`` to send the config instead).

    Returns:
        ``1 + num_layers + 1`` layers; the first takes token ids (B, T), the last returns
        logits (B, T, vocab).

    Raises:
        ModelError: no transformers, an unsupported ``model_type``, or both/neither args.
    """
    cfg = _config(config, path)
    if cfg.model_type in GPT2_FAMILY:
        n = cfg.n_layer
        layers: list[nn.Module] = [GPT2Embeddings(cfg)]
        layers += [GPT2Layer(cfg, i) for i in range(n)]
        layers.append(GPT2Head(cfg))
    else:
        n = cfg.num_hidden_layers
        layers = [LlamaEmbeddings(cfg)]
        layers += [LlamaLayer(cfg, i) for i in range(n)]
        layers.append(LlamaHead(cfg))
    return nn.Sequential(*layers)


def source_keys(kwargs: Mapping[str, Any], keys: Sequence[str], have: set[str]) -> dict[str, str]:
    """Maps the layers' state-dict keys to the Hugging Face checkpoint's names.

    Args:
        kwargs: ``causal_lm``'s arguments.
        keys: the model's keys ("<layer>.<name>").
        have: the keys the checkpoint holds (a tied head reads the input embedding).
    """
    cfg = _config(kwargs.get("config"), kwargs.get("path"))
    gpt2 = cfg.model_type in GPT2_FAMILY
    n = cfg.n_layer if gpt2 else cfg.num_hidden_layers
    base, blocks = ("transformer.", "transformer.h.") if gpt2 else ("model.", "model.layers.")
    embedding = f"{base}wte.weight" if gpt2 else f"{base}embed_tokens.weight"
    mapped = {}
    for key in keys:
        layer_text, _, name = key.partition(".")
        layer = int(layer_text)
        if layer == 0:
            mapped[key] = base + name
        elif layer <= n:
            mapped[key] = f"{blocks}{layer - 1}.{name.removeprefix('block.')}"
        elif name.startswith("lm_head."):
            mapped[key] = name if name in have or embedding not in have else embedding
        else:
            mapped[key] = base + name
    return mapped


causal_lm.source_keys = source_keys  # type: ignore[attr-defined]


# ---- back to transformers ------------------------------------------------------------------

WEIGHTS_FILE = "model.safetensors"
EMBED_TOKENS = "model.embed_tokens.weight"


def save_pretrained(weights: Any, config: Any, out_dir: str | os.PathLike[str]) -> Path:
    """Writes a ``save_pretrained`` directory of the pipeline's weights for ``transformers``.

    ``AutoModelForCausalLM.from_pretrained(out_dir)`` then predicts what the pipeline
    predicts. ``config.json`` is the model's config with ``architectures`` and ``dtype``
    set to what is written; ``model.safetensors`` holds every tensor under its Hugging
    Face name (``source_keys``). Tied embeddings (``tie_word_embeddings``, GPT-2's
    default) were trained as two tensors: if they are still equal the head is left out,
    as ``transformers`` saves a tied model; if they differ, the config is written with
    ``tie_word_embeddings=false`` and both are kept, since tying them again would put the
    trained embedding in place of the trained head.

    Args:
        weights: a ``Pipeline`` or ``LocalPipeline`` (its ``state_dict()`` is fetched), a
            mapping of the model's keys to tensors (a ``state_dict()``), or a checkpoint
            directory written by ``pipe.save``.
        config: the model's config: a ``config.json``'s content, ``causal_lm``'s
            ``model_kwargs`` (``{"config": ...}`` or ``{"path": DIR}``), or a directory
            holding ``config.json``; ``None`` for a checkpoint directory, whose manifest
            records the ``model_kwargs``.
        out_dir: the directory to write (created if needed; its ``config.json`` and
            ``model.safetensors`` are replaced).

    Returns:
        ``out_dir`` as a ``Path``.

    Raises:
        InvalidRequest: weights that do not fit the config (missing or unexpected keys,
            shapes that differ), or an ``out_dir`` holding other weight files.
        ModelError: no transformers, or a config of an unsupported family.
    """
    from safetensors.torch import save_file

    kwargs = _export_kwargs(weights, config)
    cfg = _config(kwargs.get("config"), kwargs.get("path"))
    state = _state_of(weights)
    _check_fits(state, kwargs)
    names = source_keys(kwargs, list(state), set())
    tensors = {names[k]: v.detach().cpu().contiguous() for k, v in state.items()}
    embedding = "transformer.wte.weight" if cfg.model_type in GPT2_FAMILY else EMBED_TOKENS
    head = "lm_head.weight"
    if getattr(cfg, "tie_word_embeddings", False):
        if torch.equal(tensors[embedding], tensors[head]):
            del tensors[head]  # transformers ties it again on load
        else:
            cfg.tie_word_embeddings = False
            log.info("hf_embeddings_untied", embedding=embedding, head=head)
    architecture = _causal_lm_class(cfg.model_type)
    if architecture:
        cfg.architectures = [architecture]
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(dtypes) == 1:
        # transformers 5 calls it dtype (torch_dtype is its deprecated alias), 4.x torch_dtype.
        setattr(cfg, "dtype" if hasattr(cfg, "dtype") else "torch_dtype", dtypes.pop())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    others = sorted(
        p.name
        for p in out.iterdir()
        if p.name != WEIGHTS_FILE and (p.suffix == ".safetensors" or p.name.endswith(".index.json"))
    )
    if others:
        raise InvalidRequest(
            f"{out} already holds weight files {others}; from_pretrained could read them "
            "instead of the export: write into an empty directory"
        )
    cfg.save_pretrained(str(out))
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    log.info(
        "hf_exported",
        path=str(out),
        tensors=len(tensors),
        tied=bool(getattr(cfg, "tie_word_embeddings", False)),
    )
    return out


def _export_kwargs(weights: Any, config: Any) -> dict[str, Any]:
    """``causal_lm``'s kwargs from ``save_pretrained``'s ``config`` argument."""
    if config is None:
        return _checkpoint_kwargs(weights)
    if isinstance(config, (str, os.PathLike)):
        return {"path": str(config)}
    if isinstance(config, Mapping):
        return {"config": dict(config)} if "model_type" in config else dict(config)
    raise InvalidRequest(
        "config must be a config.json's content, causal_lm's model_kwargs or a directory "
        f"holding config.json (got a {type(config).__name__})"
    )


def _checkpoint_kwargs(weights: Any) -> dict[str, Any]:
    """The ``model_kwargs`` a checkpoint directory's manifest records."""
    from elasticpipe.models.weights import MANIFEST, read_json

    if not isinstance(weights, (str, os.PathLike)) or not (Path(weights) / MANIFEST).is_file():
        raise InvalidRequest(
            "config=None needs a checkpoint directory written by pipe.save (its manifest "
            f"records the model_kwargs); got {weights!r}: pass the config (export-hf: --config DIR)"
        )
    job = read_json(Path(weights) / MANIFEST).get("job") or {}
    if job.get("model") != MODEL:
        raise InvalidRequest(
            f"checkpoint {str(weights)!r} is of model {job.get('model')!r}, not {MODEL!r}"
        )
    kwargs: dict[str, Any] = job.get("model_kwargs") or {}
    return kwargs


def _state_of(weights: Any) -> dict[str, torch.Tensor]:
    """The whole model's state dict from a pipeline, a mapping or a checkpoint directory."""
    from elasticpipe.models.weights import open_source

    state_dict = getattr(weights, "state_dict", None)
    if callable(state_dict):
        fetched: dict[str, torch.Tensor] = state_dict()
        return fetched
    if not isinstance(weights, (Mapping, str, os.PathLike)):
        raise InvalidRequest(
            "weights must be a Pipeline, a state dict or a checkpoint directory "
            f"(got a {type(weights).__name__})"
        )
    source = open_source(weights)
    try:
        return {key: source.get(key) for key in source.keys()}  # noqa: SIM118 (no dict)
    finally:
        source.close()


def _check_fits(state: Mapping[str, torch.Tensor], kwargs: Mapping[str, Any]) -> None:
    """Refuses a state whose keys or shapes are not the model's, naming them."""
    from elasticpipe.models.weights import MAX_LISTED, expected_state

    expected, _ = expected_state(MODEL, kwargs)
    problems = []
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing:
        problems.append(f"missing keys {missing[:MAX_LISTED]}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected[:MAX_LISTED]}")
    for key in sorted(set(expected) & set(state)):
        if tuple(state[key].shape) != expected[key].shape:
            problems.append(
                f"{key!r} has shape {list(state[key].shape)}, the model's "
                f"{list(expected[key].shape)}"
            )
    if problems:
        raise InvalidRequest("the weights do not fit the config: " + "; ".join(problems[:8]))


def _causal_lm_class(model_type: str) -> str | None:
    """The ``architectures`` entry ``transformers`` writes for the family's causal LM."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return None
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return name if isinstance(name, str) else None
