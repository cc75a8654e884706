"""Losses and optimizers by name: the pieces a stage and the reference both need.

Names:

* a loss is ``"cross_entropy"``, ``"mse"``, or ``"package.module:function"`` taking
  ``(output, target)`` and returning the mean loss of the micro-batch as a scalar tensor;
* an optimizer is ``"sgd"``, ``"adam"``, ``"adamw"``, any ``torch.optim`` class by its own
  name (``"RMSprop"``, ``"Adagrad"``, ``"NAdam"`` ...), or ``"package.module:name"`` of a
  class (or function) that takes ``(params, **kwargs)`` and returns a ``torch.optim.Optimizer``.

Paths are allowed by the stages' operator allow-list (``--allow-models``), as model
factories are (``elasticpipe.security.allowlist``).

The per-parameter rule: stages keep one optimizer per layer, so an optimizer must update
each parameter from that parameter, its gradient and its own state only. Then per-layer
optimizers step exactly as one optimizer over the whole model would, and a layer's optimizer
state can move with the layer. Every ``torch.optim`` class but ``LBFGS`` (a line search over
all parameters together, driven by a closure) is per-parameter; an optimizer that looks
across parameters (a global gradient norm, ZeRO-style sharding) is not. Before a job starts,
each named optimizer is probed: two parameters stepped together must end equal to the same
two stepped by separate instances, or the job is refused naming the optimizer.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from elasticpipe.errors import ElasticPipeError, InvalidRequest, UserCodeError
from elasticpipe.security import allowlist

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
OptimizerFactory = Callable[..., Any]


def _cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # Sequence models produce (B, T, V) logits for (B, T) targets: every token counts once.
    if output.dim() > 2:
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
    return F.cross_entropy(output, target)


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


LOSSES: dict[str, LossFn] = {"cross_entropy": _cross_entropy, "mse": _mse}

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
}

# torch.optim classes that are not per-parameter, with the reason given to the user.
REFUSED_OPTIMIZERS = {
    "LBFGS": "it runs a line search over all parameters together and needs a closure",
}

# Relative tolerance of the per-parameter probe: separate instances may round differently
# (foreach kernels), but an optimizer looking across parameters differs by far more.
_PROBE_RTOL = 1e-5
_PROBE_STEPS = 3


def torch_optimizers() -> dict[str, type[torch.optim.Optimizer]]:
    """The ``torch.optim`` optimizer classes by their own names (``"RMSprop"``, ...)."""
    found: dict[str, type[torch.optim.Optimizer]] = {}
    for name in dir(torch.optim):
        obj = getattr(torch.optim, name)
        is_optimizer = isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer)
        if is_optimizer and obj is not torch.optim.Optimizer:
            found[name] = obj
    return found


def _unknown(what: str, name: str, known: Sequence[str]) -> InvalidRequest:
    # Case slips first ("rmsprop" for "RMSprop"), then typos.
    close = [k for k in known if k.lower() == name.lower()][:1]
    close = close or difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return InvalidRequest(
        f"unknown {what} {name!r}: {hint}choose from {sorted(known)} or give 'package.module:name'"
    )


# ---- losses -----------------------------------------------------------------------------


def check_loss_name(name: str) -> None:
    """Fails for a loss that is neither a built-in nor a well-formed path.

    Raises:
        InvalidRequest: naming ``name``.
    """
    if name in LOSSES:
        return
    if not allowlist.is_path(name):
        raise _unknown("loss", name, list(LOSSES))
    allowlist.parse(name, "loss")


def loss_fn(name: str, allow: allowlist.Allow = ()) -> LossFn:
    """The mean-reduced loss called ``name``.

    Raises:
        InvalidRequest: unknown or malformed name, or a module that fails to import.
        PermissionDenied: a path outside ``allow``.
    """
    builtin = LOSSES.get(name)
    if builtin is not None:
        return builtin
    check_loss_name(name)
    return allowlist.resolve(name, allow, "loss")


def scaled_loss(
    name: str,
    fn: LossFn,
    output: torch.Tensor,
    target: torch.Tensor,
    scale: float,
    where: str,
    loss_scale: float = 1.0,
) -> tuple[torch.Tensor, float]:
    """``scaled_loss_tensor`` with the loss read as a float (a synchronisation on a GPU)."""
    grad, loss = scaled_loss_tensor(name, fn, output, target, scale, where, loss_scale)
    return grad, float(loss)


def scaled_loss_tensor(
    name: str,
    fn: LossFn,
    output: torch.Tensor,
    target: torch.Tensor,
    scale: float,
    where: str,
    loss_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch's loss times ``scale`` (its share of the mini-batch), backpropagated
    to a detached copy of ``output`` (in float32 when ``output`` is bfloat16 or float16, as
    autocast computes losses; the gradient comes back in ``output``'s dtype).

    Args:
        loss_scale: fp16's dynamic loss scale: backward starts from the loss times it (as
            ``GradScaler.scale(loss).backward()``); the loss returned is not multiplied.

    Returns:
        The gradient of ``output`` and the scaled loss (a detached scalar tensor on
        ``output``'s device: reading it is left to the caller, once a step).

    Raises:
        UserCodeError: the loss raised or returned something other than a scalar tensor.
    """
    out = output.detach()
    if out.dtype in (torch.bfloat16, torch.float16):  # mixed precision: the loss in float32
        out = out.float()
    out.requires_grad_(True)
    try:
        loss = fn(out, target)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise TypeError(f"the loss returned {shape}, not a scalar tensor")
        loss = loss.reshape(()) * scale
        torch.autograd.backward(loss * loss_scale if loss_scale != 1.0 else loss)
    except ElasticPipeError:
        raise
    except Exception as exc:  # the user's targets (or loss) may fail in any way
        raise UserCodeError(
            f"loss {name!r} failed {where} with output {list(output.shape)} and target "
            f"{list(target.shape)} ({str(target.dtype).removeprefix('torch.')}): "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if out.grad is None:
        raise UserCodeError(f"loss {name!r} does not depend on the model's output ({where})")
    return out.grad.to(output.dtype), loss.detach()


# ---- optimizers -------------------------------------------------------------------------


def check_optimizer_name(name: str) -> None:
    """Fails for an optimizer that is neither known nor a well-formed path.

    Raises:
        InvalidRequest: naming ``name`` (and why, for a refused ``torch.optim`` class).
    """
    if name in OPTIMIZERS:
        return
    if name in REFUSED_OPTIMIZERS:
        raise InvalidRequest(
            f"optimizer {name!r} is refused: {REFUSED_OPTIMIZERS[name]}; a stage keeps one "
            "optimizer per layer, so only per-parameter optimizers are exact"
        )
    if name in torch_optimizers():
        return
    if not allowlist.is_path(name):
        usable = [n for n in torch_optimizers() if n not in REFUSED_OPTIMIZERS]
        raise _unknown("optimizer", name, [*OPTIMIZERS, *usable])
    allowlist.parse(name, "optimizer")


def optimizer_factory(name: str, allow: allowlist.Allow = ()) -> OptimizerFactory:
    """The class (or function) that builds optimizer ``name``.

    Raises:
        InvalidRequest: unknown, refused or malformed name; a module that fails to import.
        PermissionDenied: a path outside ``allow``.
    """
    check_optimizer_name(name)
    known = OPTIMIZERS.get(name) or torch_optimizers().get(name)
    if known is not None:
        return known
    return allowlist.resolve(name, allow, "optimizer")


def make_optimizer(
    name: str,
    params: Iterable[torch.nn.Parameter],
    kwargs: Mapping[str, Any],
    allow: allowlist.Allow = (),
) -> torch.optim.Optimizer:
    """Builds optimizer ``name`` over ``params``.

    Raises:
        InvalidRequest: unknown optimizer, arguments it rejects, or a factory that does not
            return a ``torch.optim.Optimizer``.
        PermissionDenied: a path outside ``allow``.
    """
    factory = optimizer_factory(name, allow)
    try:
        optimizer = factory(list(params), **dict(kwargs))
    except ElasticPipeError:
        raise
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"optimizer {name!r} rejected {dict(kwargs)}: {exc}") from exc
    except Exception as exc:  # a user's optimizer may fail in any way
        raise InvalidRequest(
            f"optimizer {name!r} failed with {dict(kwargs)}: {type(exc).__name__}: {exc}"
        ) from exc
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InvalidRequest(
            f"optimizer {name!r} returned a {type(optimizer).__name__}, not a torch.optim.Optimizer"
        )
    return optimizer


def _probe_params() -> list[torch.nn.Parameter]:
    return [
        torch.nn.Parameter(torch.linspace(-1.0, 1.0, 12).reshape(3, 4)),
        torch.nn.Parameter(torch.linspace(0.5, -0.5, 12).reshape(4, 3)),
    ]


def check_per_parameter(name: str, kwargs: Mapping[str, Any], allow: allowlist.Allow = ()) -> None:
    """Probes the per-parameter rule: two parameters (with gradients 100x apart) stepped by
    one instance must end as when each is stepped by its own instance.

    Raises:
        InvalidRequest: the optimizer is unknown, rejects ``kwargs``, fails a step, or is
            not per-parameter.
        PermissionDenied: a path outside ``allow``.
    """
    together, alone = _probe_params(), _probe_params()
    joint = make_optimizer(name, together, kwargs, allow)
    separate = [make_optimizer(name, [p], kwargs, allow) for p in alone]
    try:
        for step in range(_PROBE_STEPS):
            for k, (a, b) in enumerate(zip(together, alone, strict=True)):
                grad = torch.linspace(-1.0, step + 1.0, a.numel()).reshape(a.shape) * 100.0**k
                a.grad, b.grad = grad.clone(), grad.clone()
            joint.step()
            for optimizer in separate:
                optimizer.step()
    except Exception as exc:  # a user's optimizer may fail in any way
        raise InvalidRequest(
            f"optimizer {name!r} failed a probe step with {dict(kwargs)}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    for a, b in zip(together, alone, strict=True):
        if not torch.allclose(a.detach(), b.detach(), rtol=_PROBE_RTOL, atol=1e-7):
            raise InvalidRequest(
                f"optimizer {name!r} is not per-parameter: stepping two parameters together "
                "differs from stepping each alone (it looks across parameters, e.g. a global "
                "gradient norm); a stage keeps one optimizer per layer, so it would not train "
                "as one optimizer over the whole model"
            )


def check_optimizer(name: str, kwargs: Mapping[str, Any]) -> None:
    """Fails early, on the client, for an optimizer a stage would refuse.

    Built-in and ``torch.optim`` names are built and probed here; a path is only checked for
    its form (the stages import it, if their allow-list lets them, and probe it there).
    """
    check_optimizer_name(name)
    if not allowlist.is_path(name):
        check_per_parameter(name, kwargs)


def check_job(
    loss: str, optimizer: str, optimizer_kwargs: Mapping[str, Any], allow: allowlist.Allow
) -> None:
    """What a stage checks before it accepts a job: the loss resolves and the optimizer
    resolves, takes its arguments and is per-parameter.

    Raises:
        InvalidRequest / PermissionDenied: naming the loss or optimizer.
    """
    loss_fn(loss, allow)
    check_per_parameter(optimizer, optimizer_kwargs, allow)


def reference_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_name: str,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    allow: allowlist.Allow = (),
) -> float:
    """One ordinary single-process training step: the behaviour a pipeline must reproduce."""
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(loss_name, allow)(model(inputs), targets)
    torch.autograd.backward(loss)
    optimizer.step()
    return float(loss.detach())
