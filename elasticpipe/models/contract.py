"""The model contract: resolve an allowed factory, and build or seed any layer of it alone."""

from __future__ import annotations

import copy
import difflib
import functools
import hashlib
import importlib
import inspect
import itertools
import math
import reprlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from elasticpipe.errors import ElasticPipeError, InvalidRequest, ModelError, PermissionDenied
from elasticpipe.models.zoo import BUILTIN_MODELS
from elasticpipe.security import allowlist
from elasticpipe.training import rng

__all__ = [
    "PACKAGED_FACTORIES",
    "build",
    "build_layers",
    "build_skeleton",
    "check_name",
    "describe",
    "factory_source",
    "init_layer",
    "layer_bytes",
    "layer_seed",
    "materialize_layer",
    "prepare_layer",
    "resolve_factory",
]

_SEED_MULTIPLIER = 1_000_003
_SEED_MODULUS = 2**63

# reset_parameters() draws from the global CPU generator; two threads seeding and drawing
# from it at once would interleave and break "layer i depends only on (seed, i)". The same
# lock guards the seeded forwards of elasticpipe.training.rng.
_INIT_LOCK = rng.LOCK

# Factory arguments may come from the wire: keep their echo in error messages short.
_ARG_REPR = reprlib.Repr()
_ARG_REPR.maxstring = 80
_ARG_REPR.maxother = 80


def layer_seed(seed: int, index: int) -> int:
    """Derives the RNG seed of one layer from the model seed and the layer's index.

    Args:
        seed: The model seed.
        index: The layer's index in the model.

    Returns:
        A seed in ``[0, 2**63)`` that depends only on ``(seed, index)``.
    """
    return (seed * _SEED_MULTIPLIER + index) % _SEED_MODULUS


# --------------------------------------------------------------------------- factories


def resolve_factory(name_or_path: str, allow: allowlist.Allow = ()) -> Callable[..., Any]:
    """Finds a model factory by built-in name or by ``"package.module:function"`` path.

    The module is imported only after the path passed the allow-list, and the callable
    found must itself be defined under an allowed prefix (so an allowed module cannot
    hand out, say, ``os.system`` that it happens to import).

    Args:
        name_or_path: A key of ``BUILTIN_MODELS``, or ``"package.module:function"``.
        allow: Module prefixes the operator allowed; ``"myorg"`` allows ``"myorg"`` and
            ``"myorg.<anything>"`` but not ``"myorgevil"`` (an ``allowlist.AllowList``:
            and how to allow more, or any module).

    Returns:
        The factory callable.

    Raises:
        PermissionDenied: The path is under none of the allowed prefixes.
        ModelError: The path is malformed, cannot be imported, or names no callable.
    """
    builtin = BUILTIN_MODELS.get(name_or_path)
    if builtin is not None:
        return builtin
    name_or_path = allowlist.current_path(name_or_path)
    allowed = allowlist.of(allow)
    if name_or_path in PACKAGED_FACTORIES:
        # Shipped with ElasticPipe (optional dependencies): allowed like the built-ins.
        allowed = allowed.plus(name_or_path.partition(":")[0])
    module_path, attr = _parse_path(name_or_path)
    if not allowed.allows(module_path):
        refusal = allowed.refusal("model factory", name_or_path, module_path)
        raise PermissionDenied(f"{refusal} (built-ins: {sorted(BUILTIN_MODELS)})")
    try:
        module = importlib.import_module(module_path)
    except Exception as exc:  # an allowed module's import may fail in any way
        raise ModelError(
            f"cannot import module {module_path!r} of model factory {name_or_path!r}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    factory = getattr(module, attr, None)
    if factory is None:
        raise ModelError(f"module {module_path!r} has no attribute {attr!r} ({name_or_path!r})")
    if not callable(factory):
        raise ModelError(
            f"model factory {name_or_path!r} is a {type(factory).__name__}, not a callable"
        )
    defined_in = _defining_module(factory)
    if defined_in is not None and not allowed.allows(defined_in):
        raise PermissionDenied(
            f"model factory {name_or_path!r} is defined in module {defined_in!r}, which is "
            f"under none of the allowed prefixes {list(allowed.prefixes or ())!r}"
        )
    return factory  # type: ignore[no-any-return]


def check_name(name_or_path: str) -> None:
    """Fails early (on the client) for a model that is neither a built-in nor a path.

    Raises:
        ModelError: naming the closest built-in when the name looks like a typo.
    """
    if name_or_path in BUILTIN_MODELS:
        return
    _parse_path(name_or_path)


def _parse_path(path: str) -> tuple[str, str]:
    if ":" not in path:
        close = difflib.get_close_matches(path, BUILTIN_MODELS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ModelError(
            f"unknown model {path!r}: {hint}choose a built-in {sorted(BUILTIN_MODELS)} or "
            "give a factory as 'package.module:function'"
        )
    module_path, sep, attr = path.partition(":")
    parts = module_path.split(".")
    if (
        not sep
        or not all(part.isidentifier() for part in parts)
        or not attr.isidentifier()
        or attr.startswith("__")
    ):
        raise ModelError(
            f"malformed model {path!r}: expected a built-in name {sorted(BUILTIN_MODELS)} "
            "or 'package.module:function'"
        )
    return module_path, attr


def _defining_module(obj: object) -> str | None:
    """Names the module that defined a callable; None for the built-in factories."""
    while isinstance(obj, functools.partial):
        obj = obj.func
    if any(obj is factory for factory in BUILTIN_MODELS.values()):
        return None
    module = getattr(obj, "__module__", None)
    return module if isinstance(module, str) else "<unknown>"


def _call_factory(
    name: str, factory: Callable[..., Any], kwargs: Mapping[str, Any]
) -> list[nn.Module]:
    """Calls a factory on the meta device and checks that it returned usable layers."""
    args = dict(kwargs)
    try:
        signature: inspect.Signature | None = inspect.signature(factory)
    except (TypeError, ValueError):  # some C callables have no signature
        signature = None
    if signature is not None:
        try:
            signature.bind(**args)
        except TypeError as exc:
            raise _rejected(name, args, exc) from exc
    try:
        with torch.device("meta"):
            produced = factory(**args)
    except ElasticPipeError:
        raise
    except TypeError as exc:
        if signature is None:
            raise _rejected(name, args, exc) from exc
        raise _failed(name, args, exc) from exc
    except Exception as exc:  # a user factory may fail in any way; report it as data
        raise _failed(name, args, exc) from exc
    return _as_layers(name, produced)


def _rejected(name: str, args: dict[str, Any], exc: Exception) -> ModelError:
    return ModelError(f"model {name!r} rejected its arguments {_ARG_REPR.repr(args)}: {exc}")


def _failed(name: str, args: dict[str, Any], exc: Exception) -> ModelError:
    return ModelError(
        f"model {name!r} failed with arguments {_ARG_REPR.repr(args)}: {type(exc).__name__}: {exc}"
    )


def _as_layers(name: str, produced: object) -> list[nn.Module]:
    if isinstance(produced, nn.Sequential):
        layers = list(produced)
    elif isinstance(produced, list):
        layers = produced
    else:
        raise ModelError(
            f"model {name!r} returned a {type(produced).__name__}; "
            "expected an nn.Sequential or a list of nn.Module"
        )
    if not layers:
        raise ModelError(f"model {name!r} returned no layers")
    for index, layer in enumerate(layers):
        if not isinstance(layer, nn.Module):
            raise ModelError(
                f"model {name!r}: layer {index} is a {type(layer).__name__}, not an nn.Module"
            )
    _check_layers_disjoint(name, layers)
    return layers


def _check_layers_disjoint(name: str, layers: list[nn.Module]) -> None:
    """Rejects tensors shared by two layers (they could not live on two stages)."""
    owner: dict[int, int] = {}
    for index, layer in enumerate(layers):
        for _, tensor_name, tensor in _named_tensors(layer):
            first = owner.setdefault(id(tensor), index)
            if first != index:
                raise ModelError(
                    f"model {name!r}: layers {first} and {index} share tensor {tensor_name!r}; "
                    "every layer must own its tensors (no weight tying across layers)"
                )
        for tensor_name, param in layer.named_parameters():
            if isinstance(param, nn.parameter.UninitializedParameter):
                raise ModelError(
                    f"model {name!r}: layer {index} ({type(layer).__name__}) has lazy parameter "
                    f"{tensor_name!r}; lazy modules are not supported"
                )


# --------------------------------------------------------------------------- building


def build_skeleton(
    name_or_path: str, kwargs: Mapping[str, Any], allow: allowlist.Allow = ()
) -> list[nn.Module]:
    """Builds every layer of a model on the meta device, allocating no memory.

    Args:
        name_or_path: A built-in name or an allowed ``"package.module:function"``.
        kwargs: The factory's keyword arguments.
        allow: Allowed module prefixes (see ``resolve_factory``).

    Returns:
        The layers, in order, with meta tensors.

    Raises:
        PermissionDenied: The factory is not allowed.
        ModelError: The factory cannot be resolved, rejects ``kwargs``, fails, or returns
            something other than a non-empty sequence of disjoint modules.
    """
    factory = resolve_factory(name_or_path, allow)
    return _call_factory(name_or_path, factory, kwargs)


def materialize_layer(skeleton_layer: nn.Module, device: str | torch.device) -> nn.Module:
    """Allocates a copy of a skeleton layer on a device, leaving its values uninitialised.

    The caller either loads a state dict into the result or calls ``init_layer`` on it.
    Non-persistent buffers are not part of a state dict: only ``init_layer`` sets them.

    Args:
        skeleton_layer: A layer from ``build_skeleton``; it is left unchanged.
        device: Where to allocate the parameters and buffers.

    Returns:
        A new module with uninitialised tensors on ``device``.

    Raises:
        InvalidRequest: ``device`` is not a valid device.
    """
    return copy.deepcopy(skeleton_layer).to_empty(device=_as_device(device))


def init_layer(layer: nn.Module, seed: int, index: int) -> None:
    """(Re)initialises every parameter and buffer of one layer from ``layer_seed(seed, index)``.

    The layer's own ``reset_parameters()`` is called if it has one; otherwise that of each
    outermost submodule that has one (torch's private ``_reset_parameters``, as in
    ``nn.MultiheadAttention``, is honoured for torch's own modules), and
    ``reset_running_stats()`` where a module has no ``reset_parameters``. Values are drawn
    on the CPU and copied to the layer's device, so they are identical on every device.
    The global RNG state is left as it was.

    Args:
        layer: The layer, on one non-meta device; modified in place.
        seed: The model seed.
        index: The layer's index in the model.

    Raises:
        ModelError: The layer is on the meta device or several devices, or some parameter
            or buffer is set by no reset method (it would hold garbage after
            ``materialize_layer``).
    """
    devices = {tensor.device for _, _, tensor in _named_tensors(layer)}
    where = f"layer {index} ({type(layer).__name__})"
    if len(devices) > 1:
        raise ModelError(f"{where} has tensors on several devices {sorted(map(str, devices))}")
    device = devices.pop() if devices else torch.device("cpu")
    if device.type == "meta":
        raise ModelError(f"{where} is on the meta device; materialize_layer() it first")
    on_cpu = device.type == "cpu"
    try:
        if not on_cpu:
            layer.to("cpu")
        with _INIT_LOCK, torch.no_grad(), torch.random.fork_rng(devices=[]):
            # default_generator, not torch.manual_seed: that would also reseed CUDA.
            torch.default_generator.manual_seed(layer_seed(seed, index))
            for _, _, tensor in _named_tensors(layer):
                if tensor.is_floating_point() or tensor.is_complex():
                    tensor.fill_(math.nan)  # so that values no reset wrote show up below
            claimed: set[int] = set()
            _reset(layer, claimed)
        _check_initialised(layer, where, claimed)
    finally:
        if not on_cpu:
            layer.to(device)


def prepare_layer(
    layer: nn.Module, seed: int, index: int, external: bool, draw: bool = True
) -> None:
    """Gives a materialized layer defined values before its state dict is loaded into it.

    Without ``external`` weights this is ``init_layer``. With them (``init_state``), the
    state dict overwrites every parameter and persistent buffer, so a layer without
    ``reset_parameters()`` is filled with zeros instead; only non-persistent buffers
    (not in any state dict) must still be set by a reset method. Without ``draw``, a layer
    with no non-persistent buffers is zero-filled at once (a job's layers built for its
    ``init_state``: random numbers only to be overwritten took 1.7 s of a GPT-2 small's
    set-up; the profile, which runs the layers, keeps drawing them).

    Raises:
        ModelError: as ``init_layer`` without ``external``; with it, a non-persistent
            buffer that no reset method sets.
    """
    if not external:
        init_layer(layer, seed, index)
        return
    if not draw and not unsaved_buffers(layer):
        with torch.no_grad():
            for _, _, tensor in _named_tensors(layer):
                tensor.zero_()
        return
    try:
        init_layer(layer, seed, index)
        return
    except ModelError:
        pass
    with torch.no_grad():
        for _, _, tensor in _named_tensors(layer):
            tensor.zero_()
    unsaved = unsaved_buffers(layer)
    if unsaved:
        raise ModelError(
            f"layer {index} ({type(layer).__name__}): buffer {unsaved[0]!r} is in no state "
            "dict (non-persistent), so init_state cannot set it; set it in a "
            "reset_parameters() or compute it in forward()"
        )


def unsaved_buffers(layer: nn.Module) -> list[str]:
    """The names of the layer's non-persistent buffers (a causal mask): in no state dict,
    so a load leaves them as they are; every other tensor a strict load overwrites."""
    persistent = set(layer.state_dict(keep_vars=True))
    return [name for name, _ in layer.named_buffers() if name not in persistent]


def _reset(module: nn.Module, claimed: set[int]) -> None:
    """Calls the outermost reset methods under ``module``; records the tensors they own."""
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()
        claimed.update(id(t) for _, _, t in _named_tensors(module))
        return
    for child in module.children():
        _reset(child, claimed)
    private = getattr(module, "_reset_parameters", None)
    if callable(private) and type(module).__module__.startswith("torch.nn"):
        private()  # after the children, as in the module's own constructor
        claimed.update(id(p) for p in module.parameters(recurse=False))
    stats = getattr(module, "reset_running_stats", None)
    if callable(stats):
        stats()
        claimed.update(id(b) for b in module.buffers(recurse=False))


def _check_initialised(layer: nn.Module, where: str, claimed: set[int]) -> None:
    for kind, name, tensor in _named_tensors(layer):
        owner_name = name.rpartition(".")[0]
        owner = type(layer.get_submodule(owner_name)).__name__
        if id(tensor) not in claimed:
            raise ModelError(
                f"{where}: {kind} {name!r} of {owner} is set by no reset_parameters(); "
                f"define {owner}.reset_parameters() so that any stage can initialise it, or "
                "pass the initial weights as Pipeline(..., init_state=...)"
            )
        if (tensor.is_floating_point() or tensor.is_complex()) and bool(tensor.isnan().any()):
            raise ModelError(
                f"{where}: {kind} {name!r} of {owner} is not (fully) written by "
                "reset_parameters(); every value must be set there, not in __init__"
            )


def _named_tensors(module: nn.Module) -> Iterator[tuple[str, str, torch.Tensor]]:
    """Yields ``(kind, name, tensor)`` for each distinct parameter and buffer."""
    seen: set[int] = set()
    named = itertools.chain(
        (("parameter", n, t) for n, t in module.named_parameters()),
        (("buffer", n, t) for n, t in module.named_buffers()),
    )
    for kind, name, tensor in named:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            yield kind, name, tensor


def _as_device(device: str | torch.device) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidRequest(f"invalid device {device!r}: {exc}") from exc


def build_layers(
    name_or_path: str,
    seed: int,
    kwargs: Mapping[str, Any],
    lo: int,
    hi: int,
    device: str | torch.device = "cpu",
    allow: allowlist.Allow = (),
    external: bool = False,
    draw: bool = True,
) -> list[nn.Module]:
    """Builds and initialises only layers ``[lo, hi)`` of a model.

    The result is bitwise equal to ``build(name_or_path, seed, **kwargs)[lo:hi]`` on any
    device; the other layers are never allocated.

    Args:
        name_or_path: A built-in name or an allowed ``"package.module:function"``.
        seed: The model seed.
        kwargs: The factory's keyword arguments.
        lo: First layer index (inclusive).
        hi: Last layer index (exclusive).
        device: Where the layers live.
        allow: Allowed module prefixes (see ``resolve_factory``).
        external: the weights will be loaded afterwards (see ``prepare_layer``).
        draw: with ``external``, whether to draw random weights anyway (``prepare_layer``).

    Returns:
        The initialised layers ``lo`` to ``hi - 1``.

    Raises:
        InvalidRequest: The range is outside the model or the device is invalid.
        PermissionDenied: The factory is not allowed.
        ModelError: The factory is unusable (see ``build_skeleton`` and ``init_layer``).
    """
    target = _as_device(device)
    skeleton = build_skeleton(name_or_path, kwargs, allow)
    count = len(skeleton)
    if not (isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi <= count):
        raise InvalidRequest(
            f"layer range [{lo!r}, {hi!r}) is not within the {count} layers of {name_or_path!r}"
        )
    return [_build_layer(skeleton[i], seed, i, external, draw).to(target) for i in range(lo, hi)]


def _build_layer(
    skeleton_layer: nn.Module, seed: int, index: int, external: bool = False, draw: bool = True
) -> nn.Module:
    # Initialise on the CPU whatever the target, so every device gets the same values.
    layer = materialize_layer(skeleton_layer, "cpu")
    prepare_layer(layer, seed, index, external, draw)
    return layer


def build(
    name_or_path: str,
    seed: int = 0,
    allow: allowlist.Allow = (),
    external: bool = False,
    **kwargs: Any,
) -> nn.Sequential:
    """Builds the whole model on the CPU, as the single-process reference.

    Args:
        name_or_path: A built-in name or an allowed ``"package.module:function"``.
        seed: The model seed.
        allow: Allowed module prefixes (see ``resolve_factory``).
        **kwargs: The factory's keyword arguments.

    Returns:
        All layers in an ``nn.Sequential``; layer ``i`` is ``init_layer(layer, seed, i)``.

    Raises:
        PermissionDenied: The factory is not allowed.
        ModelError: The factory is unusable (see ``build_skeleton`` and ``init_layer``).
    """
    skeleton = build_skeleton(name_or_path, kwargs, allow)
    return nn.Sequential(
        *(_build_layer(layer, seed, i, external) for i, layer in enumerate(skeleton))
    )


def factory_source(name_or_path: str, allow: allowlist.Allow = ()) -> tuple[str, str]:
    """The module file a factory comes from and the SHA-256 of its bytes.

    A stage keeps the first version of a module it imported: comparing these between
    stages catches a factory changed on disk but not reloaded everywhere.

    Raises:
        PermissionDenied / ModelError: as ``resolve_factory``.
    """
    factory = resolve_factory(name_or_path, allow)
    while isinstance(factory, functools.partial):
        factory = factory.func
    module = inspect.getmodule(factory)
    path = getattr(module, "__file__", None) or ""
    if not path:
        return "", ""
    try:
        digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return path, ""
    return path, digest


def describe(
    name_or_path: str, kwargs: Mapping[str, Any], allow: allowlist.Allow = ()
) -> tuple[int, list[int]]:
    """Counts a model's layers and the bytes of each, without allocating it.

    Args:
        name_or_path: A built-in name or an allowed ``"package.module:function"``.
        kwargs: The factory's keyword arguments.
        allow: Allowed module prefixes (see ``resolve_factory``).

    Returns:
        ``(num_layers, bytes_per_layer)``, counting parameters and buffers.

    Raises:
        PermissionDenied: The factory is not allowed.
        ModelError: The factory is unusable (see ``build_skeleton``).
    """
    layers = build_skeleton(name_or_path, kwargs, allow)
    return len(layers), [layer_bytes(layer) for layer in layers]


def layer_bytes(layer: nn.Module) -> int:
    """Bytes of a layer's distinct parameters and buffers: what the planner counts as the
    layer's size (``describe``)."""
    return sum(t.numel() * t.element_size() for _, _, t in _named_tensors(layer))


# Factories shipped in this package whose dependencies are optional extras: allowed on
# every stage without --allow-models, imported only when named.
PACKAGED_FACTORIES = ("elasticpipe.models.hf:causal_lm",)
