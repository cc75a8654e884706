"""Layers with several tensors: a tuple or flat dict of tensors as a list plus a descriptor.

A layer may take and return a tensor, a tuple of tensors or a flat ``dict`` (``str`` keys)
of tensors. Everything that moves or stores activations works on the flat list of tensors
and carries a small JSON-able ``Structure`` that rebuilds the value; a plain tensor has no
structure (``None``), so its path stays what it always was.

Worked example: ``(hidden, mask)`` flattens to ``[hidden, mask]`` with
``Structure(keys=None, size=2)``, written ``{"tuple":2}`` on the wire;
``{"h": hidden, "m": mask}`` flattens to ``[hidden, mask]`` with
``Structure(keys=("h", "m"), size=2)``, written ``{"dict":["h","m"]}``.

Gradients go back only for the floating tensors: ``floating(tensors)`` gives their
positions, and a gradient message carries one tensor per such position, in order (a plain
tensor when there is exactly one, else a tuple). Integer and bool tensors (masks, ids) pass
along without gradients.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch

from elasticpipe.errors import ElasticPipeError, InvalidRequest, ModelError
from elasticpipe.training.schedule import split_sizes

MAX_PARTS = 64  # tensors in one value
MAX_KEY = 128  # characters of a dict key
MAX_JSON = 16_384  # characters of a structure descriptor

Value: TypeAlias = torch.Tensor | tuple[torch.Tensor, ...] | dict[str, torch.Tensor]


@dataclass(frozen=True)
class Structure:
    """How a flat list of tensors rebuilds a value: a tuple (``keys`` None) or a dict."""

    keys: tuple[str, ...] | None
    size: int

    def to_json(self) -> str:
        """The descriptor as compact JSON (what the wire carries)."""
        body: dict[str, Any] = (
            {"tuple": self.size} if self.keys is None else {"dict": list(self.keys)}
        )
        return json.dumps(body, separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> Structure:
        """Parses and bounds a descriptor that came over the wire.

        Raises:
            InvalidRequest: malformed JSON, an unknown kind, too many parts, or a bad key.
        """
        if len(text) > MAX_JSON:
            raise InvalidRequest(f"structure descriptor of {len(text)} chars (at most {MAX_JSON})")
        try:
            body = json.loads(text)
        except ValueError as exc:
            raise InvalidRequest(f"structure descriptor {text[:80]!r} is not JSON") from exc
        if isinstance(body, dict) and len(body) == 1 and "tuple" in body:
            size = body["tuple"]
            if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_PARTS:
                raise InvalidRequest(f"tuple structure of size {size!r} (in [0, {MAX_PARTS}])")
            return Structure(None, size)
        if isinstance(body, dict) and len(body) == 1 and isinstance(body.get("dict"), list):
            keys = body["dict"]
            _check_keys(keys, InvalidRequest, "a structure descriptor")
            return Structure(tuple(keys), len(keys))
        raise InvalidRequest(
            f"structure descriptor {text[:80]!r} is neither {{'tuple': n}} nor {{'dict': keys}}"
        )


def _check_keys(keys: Sequence[object], error: type[ElasticPipeError], where: str) -> None:
    if len(keys) > MAX_PARTS:
        raise error(f"{where} has {len(keys)} tensors (at most {MAX_PARTS})")
    for key in keys:
        if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY:
            raise error(f"{where} has key {key!r}: keys must be strings of 1 to {MAX_KEY} chars")
    if len(set(keys)) != len(keys):
        raise error(f"{where} repeats a key ({list(keys)})")


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor{list(value.shape)}"
    return type(value).__name__


def flatten(
    value: object, where: str, error: type[ElasticPipeError] = InvalidRequest
) -> tuple[list[torch.Tensor], Structure | None]:
    """Splits a tensor, tuple of tensors or flat dict of tensors into a list and a structure.

    Args:
        value: what a layer took or returned, or what a user passed.
        where: named in errors ("layer 3 (Block) returned", "inputs").
        error: the error class to raise (``ModelError`` for a layer's output).

    Raises:
        error: a nested tuple or dict, a list, a non-tensor element, a non-string key,
            or more than ``MAX_PARTS`` tensors; the message names ``where`` and the element.
    """
    if isinstance(value, torch.Tensor):
        return [value], None
    if isinstance(value, tuple):
        items: list[tuple[object, object]] = list(enumerate(value))
        keys: tuple[str, ...] | None = None
    elif isinstance(value, dict):
        _check_keys(list(value), error, where)
        items = list(value.items())
        keys = tuple(value)
    else:
        raise error(
            f"{where} a {_describe(value)}: a layer takes and returns a tensor, a tuple of "
            "tensors or a flat dict (str keys) of tensors"
        )
    if len(items) > MAX_PARTS:
        raise error(f"{where} {len(items)} tensors (at most {MAX_PARTS})")
    tensors: list[torch.Tensor] = []
    for key, item in items:
        if not isinstance(item, torch.Tensor):
            kind = "nested " if isinstance(item, (tuple, dict)) else ""
            raise error(
                f"{where} a {type(value).__name__} whose element {key!r} is a "
                f"{kind}{_describe(item)}, not a tensor (a tuple or dict of a layer holds "
                "tensors only, not nested)"
            )
        tensors.append(item)
    return tensors, Structure(keys, len(tensors))


def unflatten(tensors: Sequence[torch.Tensor], structure: Structure | None) -> Value:
    """Rebuilds the value that ``flatten`` split (the inverse of ``flatten``).

    Raises:
        InvalidRequest: the number of tensors differs from the structure's.
    """
    if structure is None:
        if len(tensors) != 1:
            raise InvalidRequest(f"{len(tensors)} tensors for a value of one tensor")
        return tensors[0]
    if len(tensors) != structure.size:
        raise InvalidRequest(f"{len(tensors)} tensors for a structure of {structure.size}")
    if structure.keys is None:
        return tuple(tensors)
    return dict(zip(structure.keys, tensors, strict=True))


def apply(value: Value, fn: Callable[[torch.Tensor], torch.Tensor]) -> Value:
    """``fn`` on every tensor of ``value``, same structure (``.to(device)``, ``.detach()``)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple):
        return tuple(fn(t) for t in value)
    return {k: fn(t) for k, t in value.items()}


def to_device(value: Value, device: torch.device) -> Value:
    """``value`` on ``device`` (a plain tensor takes the direct path)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    return apply(value, lambda t: t.to(device))


def detached(value: Value) -> Value:
    """``value`` without its graph."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    return apply(value, torch.Tensor.detach)


def single(value: Value, where: str) -> torch.Tensor:
    """The one tensor the loss takes: the last layer's output in training.

    Raises:
        ModelError: ``value`` is a tuple or dict (the message says what it holds).
    """
    if isinstance(value, torch.Tensor):
        return value
    raise ModelError(
        f"{where} a {type(value).__name__} of {len(value)} tensors; to train, the last layer "
        "must return one tensor (the loss's input)"
    )


def describe(value: Value) -> str:
    """Shapes and dtypes of a value, for error messages."""

    def one(t: torch.Tensor) -> str:
        return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')}"

    if isinstance(value, torch.Tensor):
        return f"shape {list(value.shape)} and dtype {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, tuple):
        return "(" + ", ".join(one(t) for t in value) + ")"
    return "{" + ", ".join(f"{k!r}: {one(t)}" for k, t in value.items()) + "}"


def signature(value: Value) -> tuple[Any, ...]:
    """A hashable key of a value's form: its keys (a dict), and each tensor's shape and
    dtype."""
    keys = tuple(value) if isinstance(value, dict) else ()
    return keys, tuple((tuple(t.shape), t.dtype) for t in tensors(value))


def tensors(value: Value) -> list[torch.Tensor]:
    """The tensors of a value already known to be well formed, in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple):
        return list(value)
    return list(value.values())


def nbytes(value: Value) -> int:
    """Bytes of every tensor of ``value`` together (a planner's activation size)."""
    return sum(t.numel() * t.element_size() for t in tensors(value))


def floating(values: Sequence[torch.Tensor]) -> list[int]:
    """Positions of the floating tensors: the ones that gradients go back for."""
    return [n for n, t in enumerate(values) if t.is_floating_point()]


def grads_value(grads: Sequence[torch.Tensor]) -> Value:
    """A gradient message: one tensor as itself (the fast path), else a tuple."""
    return grads[0] if len(grads) == 1 else tuple(grads)


def batch_size(value: object, where: str) -> int:
    """The batch dimension every tensor of ``value`` shares.

    Raises:
        InvalidRequest: a bad structure, a 0-d tensor, or tensors of different batch sizes.
    """
    parts, _ = flatten(value, f"the {where} are")
    if not parts:
        raise InvalidRequest(f"the {where} hold no tensor")
    sizes = [t.shape[0] if t.dim() else None for t in parts]
    if None in sizes or len(set(sizes)) != 1:
        shapes = [list(t.shape) for t in parts]
        raise InvalidRequest(f"the {where} must share a batch dimension (shapes: {shapes})")
    return int(parts[0].shape[0])


def split_batch(
    inputs: object, targets: object, micro_batches: int, device: torch.device
) -> tuple[list[Value], list[torch.Tensor], list[float]]:
    """Cuts a mini-batch into micro-batches (on ``device``), with each one's share.

    Args:
        inputs: a tensor, or a tuple or flat dict of tensors sharing a batch dimension.
        targets: a tensor of the same batch size, or None (inference).
        micro_batches: how many micro-batches at most (``schedule.split_sizes``).

    Raises:
        InvalidRequest: inputs or targets of the wrong kind or batch size (named).
    """
    if isinstance(inputs, torch.Tensor) and inputs.dim() == 0:
        raise InvalidRequest("inputs must be a tensor with a batch dimension")
    if not isinstance(inputs, (torch.Tensor, tuple, dict)):
        raise InvalidRequest(
            f"inputs must be a tensor, or a tuple or flat dict of tensors (got "
            f"{type(inputs).__name__})"
        )
    batch = batch_size(inputs, "inputs")
    sizes = split_sizes(batch, micro_batches)
    moved = apply(inputs, lambda t: t.detach().to(device))
    xs = split(moved, sizes)
    ys: list[torch.Tensor] = []
    if targets is not None:
        if not isinstance(targets, torch.Tensor) or targets.shape[:1] != (batch,):
            raise InvalidRequest(
                f"targets must have the batch size of the inputs ({batch}), got "
                f"{list(getattr(targets, 'shape', []))}"
            )
        ys = list(torch.split(targets.detach().to(device), sizes))
    return xs, ys, [n / batch for n in sizes]


def split(value: Value, sizes: Sequence[int]) -> list[Value]:
    """Cuts every tensor of ``value`` along its batch dimension into ``sizes`` pieces."""
    parts, structure = flatten(value, "inputs")
    pieces = [torch.split(t, list(sizes)) for t in parts]
    return [unflatten([p[n] for p in pieces], structure) for n in range(len(sizes))]


def cat(values: Sequence[Value]) -> Value:
    """Joins micro-batch outputs along the batch dimension (the inverse of ``split``)."""
    flat = [flatten(v, "outputs") for v in values]
    structure = flat[0][1]
    joined = [torch.cat([f[0][n] for f in flat]) for n in range(len(flat[0][0]))]
    return unflatten(joined, structure)


__all__ = [
    "MAX_PARTS",
    "Structure",
    "Value",
    "apply",
    "batch_size",
    "cat",
    "describe",
    "detached",
    "flatten",
    "floating",
    "grads_value",
    "nbytes",
    "single",
    "split",
    "split_batch",
    "tensors",
    "to_device",
    "unflatten",
]
