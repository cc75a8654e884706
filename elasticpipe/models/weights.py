"""Weights the user brings (``init_state``): a mapping, a safetensors file or a directory of
shards, read lazily tensor by tensor and checked against the model's layers before use.

Keys are those of the whole model's ``state_dict()`` (``"3.block.attn.c_attn.weight"``:
layer 3's ``block.attn.c_attn.weight``). A factory may declare how its keys are spelled in
its library's own files (``factory.source_keys(model_kwargs, keys)``, as
``elasticpipe.models.hf:causal_lm`` does for Hugging Face names); those names are used when the
files do not carry the model's own keys.

Worked example: for an MLP ``[Linear(4, 8), ReLU(), Linear(8, 2)]`` the expected keys are
``0.weight (8, 4)``, ``0.bias (8,)``, ``2.weight (2, 8)``, ``2.bias (2,)``; a file whose
``2.weight`` is ``(3, 8)`` is refused with both shapes named, before any stage is touched.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from elasticpipe import models
from elasticpipe.errors import InvalidRequest

MANIFEST = "manifest.json"
HF_INDEX = "model.safetensors.index.json"
MAX_LISTED = 8  # keys named in an error message


@dataclass(frozen=True)
class Expected:
    """What one state-dict entry of the model must look like."""

    layer: int
    name: str  # the key inside its layer's state_dict
    shape: tuple[int, ...]
    dtype: torch.dtype


def expected_state(
    model: str, model_kwargs: Mapping[str, Any]
) -> tuple[dict[str, Expected], list[list[str]]]:
    """The model's state-dict keys with layer, shape and dtype, built on the meta device.

    The factory runs in the client's process: it is the user's own code, so it is allowed
    here whatever the stages allow.

    Returns:
        The keys of the whole model, and per layer the names of its trainable parameters
        in the order its optimizer sees them.
    """
    allow = (model.partition(":")[0].split(".")[0],) if ":" in model else ()
    skeleton = models.build_skeleton(model, model_kwargs, allow)
    expected: dict[str, Expected] = {}
    params: list[list[str]] = []
    for i, layer in enumerate(skeleton):
        for name, tensor in layer.state_dict().items():
            expected[f"{i}.{name}"] = Expected(i, name, tuple(tensor.shape), tensor.dtype)
        params.append([n for n, p in layer.named_parameters() if p.requires_grad])
    return expected, params


Rename = Callable[[list[str], set[str]], dict[str, str]]


def no_rename(keys: list[str], have: set[str]) -> dict[str, str]:
    """Keys are read as they are."""
    return {}


def source_keys(model: str, model_kwargs: Mapping[str, Any]) -> Rename:
    """The factory's own renaming of keys (model key -> key in its files), if it has one:
    ``factory.source_keys(model_kwargs, keys, keys_the_files_hold)``."""
    if ":" not in model:
        return no_rename
    allow = (model.partition(":")[0].split(".")[0],)
    factory = models.resolve_factory(model, allow)
    rename = getattr(factory, "source_keys", None)
    if rename is None:
        return no_rename
    return lambda keys, have: dict(rename(dict(model_kwargs), keys, have))


class TensorSource:
    """Tensors by key, read one at a time (safetensors files are memory-mapped lazily)."""

    def __init__(self, files: list[Path] | None = None, mapping: Mapping[str, Any] | None = None):
        self._where: dict[str, Path] = {}
        self._mapping = dict(mapping or {})
        self._opened: dict[Path, Any] = {}
        self._stack = contextlib.ExitStack()
        for key, value in self._mapping.items():
            if not isinstance(key, str) or not isinstance(value, torch.Tensor):
                raise InvalidRequest(
                    f"init_state must map state-dict keys to tensors; {key!r} maps to a "
                    f"{type(value).__name__}"
                )
        for path in files or []:
            for key in self._open(path).keys():  # noqa: SIM118 (safe_open is no dict)
                if key in self._where:
                    raise InvalidRequest(f"key {key!r} is in both {self._where[key]} and {path}")
                self._where[key] = path

    def _open(self, path: Path) -> Any:
        handle = self._opened.get(path)
        if handle is None:
            try:
                handle = self._stack.enter_context(safe_open(str(path), framework="pt"))
            except Exception as exc:  # safetensors raises its own error types
                raise InvalidRequest(f"cannot read {path} as safetensors: {exc}") from exc
            self._opened[path] = handle
        return handle

    def keys(self) -> list[str]:
        """Every key the source holds."""
        return [*self._mapping, *self._where]

    def shape(self, key: str) -> tuple[int, ...]:
        """The tensor's shape, read from the file's header only."""
        if key in self._mapping:
            return tuple(self._mapping[key].shape)
        return tuple(self._open(self._where[key]).get_slice(key).get_shape())

    def get(self, key: str) -> torch.Tensor:
        """Reads one tensor."""
        if key in self._mapping:
            tensor: torch.Tensor = self._mapping[key].detach().cpu()
            return tensor
        loaded: torch.Tensor = self._open(self._where[key]).get_tensor(key)
        return loaded

    def close(self) -> None:
        """Closes the files."""
        self._stack.close()
        self._opened.clear()


def open_source(init_state: Any) -> TensorSource:
    """Opens a mapping, a ``.safetensors`` file or a directory of shards.

    A directory is read as an ElasticPipe checkpoint (its weight shards), a Hugging Face
    ``save_pretrained`` directory (``model.safetensors`` or its index), or else every
    ``*.safetensors`` file in it.

    Raises:
        InvalidRequest: a path that does not exist or holds no safetensors.
    """
    if isinstance(init_state, Mapping):
        return TensorSource(mapping=init_state)
    if not isinstance(init_state, (str, os.PathLike)):
        raise InvalidRequest(
            "init_state must be a mapping of tensors, a .safetensors file or a directory "
            f"(got a {type(init_state).__name__})"
        )
    path = Path(init_state)
    if path.is_file():
        return TensorSource(files=[path])
    if not path.is_dir():
        raise InvalidRequest(f"init_state {str(path)!r} is neither a file nor a directory")
    return TensorSource(files=shard_files(path))


def shard_files(directory: Path) -> list[Path]:
    """The weight shards of a checkpoint, Hugging Face or plain directory."""
    manifest = directory / MANIFEST
    if manifest.is_file():
        data = read_json(manifest)
        return [directory / name for name in data.get("weights", [])]
    index = directory / HF_INDEX
    if index.is_file():
        weight_map = read_json(index).get("weight_map", {})
        return [directory / name for name in sorted(set(weight_map.values()))]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise InvalidRequest(f"init_state directory {str(directory)!r} holds no .safetensors")
    return files


def read_json(path: Path) -> dict[str, Any]:
    """A small JSON object from a file, or InvalidRequest naming the file."""
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidRequest(f"cannot read {path}: {exc}") from exc
    if not isinstance(value, dict):
        raise InvalidRequest(f"{path} does not hold a JSON object")
    return value


@dataclass
class LoadPlan:
    """Where each model key is read from, checked complete and of the right shapes."""

    source: TensorSource
    keys: dict[str, str]  # model key -> source key
    expected: dict[str, Expected]

    def layer_state(self, layer: int) -> dict[str, torch.Tensor]:
        """One layer's weights and buffers, keyed like its own ``state_dict()``; floating
        tensors of another precision (a bfloat16 checkpoint) are cast to the model's.

        Raises:
            InvalidRequest: a non-floating tensor of another dtype.
        """
        state = {}
        for key, e in self.expected.items():
            if e.layer != layer:
                continue
            tensor = self.source.get(self.keys[key])
            if tensor.dtype != e.dtype:
                if not (tensor.is_floating_point() and e.dtype.is_floating_point):
                    raise InvalidRequest(
                        f"init_state {self.keys[key]!r} is {tensor.dtype}, the model's {key!r} "
                        f"{e.dtype}"
                    )
                tensor = tensor.to(e.dtype)
            state[e.name] = tensor
        return state


def plan(
    source: TensorSource,
    expected: dict[str, Expected],
    rename: Rename,
) -> LoadPlan:
    """Matches the source's keys to the model's, or raises naming what does not fit.

    Raises:
        InvalidRequest: missing or unexpected keys, or shapes that differ.
    """
    have = set(source.keys())
    keys = {k: k for k in expected}
    if not set(expected) <= have:
        renamed = rename(list(expected), have)
        if renamed:
            keys = {k: renamed.get(k, k) for k in expected}
    missing = sorted(k for k, s in keys.items() if s not in have)
    unexpected = sorted(have - set(keys.values()))
    problems = []
    if missing:
        problems.append(f"missing keys {_few(missing)}")
    if unexpected:
        problems.append(f"unexpected keys {_few(unexpected)}")
    for key, e in expected.items():
        if keys[key] in have and source.shape(keys[key]) != e.shape:
            problems.append(
                f"{keys[key]!r} has shape {list(source.shape(keys[key]))}, "
                f"the model's {key!r} {list(e.shape)}"
            )
            if len(problems) > MAX_LISTED:
                break
    if problems:
        raise InvalidRequest("init_state does not fit the model: " + "; ".join(problems))
    return LoadPlan(source, keys, expected)


def _few(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:MAX_LISTED])
    more = f" and {len(keys) - MAX_LISTED} more" if len(keys) > MAX_LISTED else ""
    return f"[{shown}{more}]"


def iter_layers(p: LoadPlan, layers: range) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """(layer, its state) for each layer in order, reading only that layer's tensors."""
    for layer in layers:
        yield layer, p.layer_state(layer)
