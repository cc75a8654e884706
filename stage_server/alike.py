"""Which layers compute alike: ``alike_key``, shared by the profile (a layer alike to one
already measured on an input of the same form is not run again, ``profiling``) and a
fastest-run device-time model (alike layers on the same input are one op, ``devicetime``).

Two layers are alike when their module trees match in everything that can change what
they compute: each module's class, its parameters' and buffers' shapes and dtypes, and its
other attributes (plain values compared by value, anything else, a function or a config
object, by identity: only the same object matches). ``layer_idx``, the index Hugging
Face's layers keep for their key-value cache, is left out.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
from torch import nn

__all__ = ["alike_key"]

# a module's own tensors and children, keyed apart; and its mode, which the profile sets
_TREE = frozenset(
    {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training"}
)
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
# Hugging Face's index of a layer into the key-value cache (see the module's docstring)
_INDEX = frozenset({"layer_idx"})


def _value_key(value: object) -> Hashable:
    """A module attribute's part of ``alike_key``: plain values and containers of them by
    value, anything else by identity (only the same object matches it)."""
    if isinstance(value, _PLAIN):
        return type(value), value
    if isinstance(value, (tuple, list)):
        return type(value), tuple(_value_key(v) for v in value)
    if isinstance(value, dict):
        return type(value), tuple((_value_key(k), _value_key(v)) for k, v in value.items())
    return "object", id(value)


def alike_key(layer: nn.Module) -> tuple[Any, ...]:
    """What ``layer`` computes, as far as its module tree shows (a skeleton's meta layer
    will do): equal for layers that cost the same on inputs of one form. Holds ids of the
    layer's non-plain attributes: compare keys while the layers are alive."""
    parts = []
    for name, module in layer.named_modules(remove_duplicate=False):
        params = tuple(
            (n, None if p is None else (tuple(p.shape), p.dtype, p.requires_grad))
            for n, p in module._parameters.items()
        )
        buffers = tuple(
            (n, None if b is None else (tuple(b.shape), b.dtype))
            for n, b in module._buffers.items()
        )
        attributes = tuple(
            (k, _value_key(v))
            for k, v in sorted(vars(module).items())
            if k not in _TREE and k not in _INDEX
        )
        unsaved = tuple(sorted(module._non_persistent_buffers_set))
        parts.append((name, type(module), params, buffers, unsaved, attributes))
    return tuple(parts)
