"""Dynamic loss scaling for ``precision="fp16"``, with ``torch.amp.GradScaler``'s semantics.

float16 gradients underflow to zero where float32 ones would not; GradScaler multiplies the
loss by a large scale before backward, divides the gradients by it afterwards, and adapts
the scale. Across stages it goes like this, step by step::

    last stage     loss * scale -> backward          (the user sees the unscaled loss)
    every stage    grads *= 1/scale, in place        (GradScaler.unscale_, before any norm)
                   reports the squared norm of the unscaled gradients
    client         any report not finite -> skip    (clipping.decide: inf/nan anywhere)
    every stage    commit: optimizer step unless skipped, then the scale updates:
                   skipped: scale *= backoff_factor, tracker = 0
                   else:    tracker += 1; at growth_interval: scale *= growth_factor, tracker = 0

The scale (and its growth tracker) lives in the job, next to each layer's scheduler state:
every layer holds a copy and updates it at each commit from the commit's skip decision,
so all layers agree; it moves with a migrated layer, and is in snapshots (recovery rolls
it back with the weights), exported layers and checkpoints. The arithmetic is PyTorch's
own (``torch._amp_foreach_non_finite_check_and_unscale_`` and ``torch._amp_update_scale_``,
what GradScaler calls), on float32 scalars as GradScaler keeps them.

A float16 gradient cannot hold more than 65504: with a scale too large for the model the
first steps overflow and are skipped while the scale backs off, as with GradScaler.

The overflow check is the global norm of the unscaled gradients (it rides on the clipping
protocol): it is not finite exactly when some gradient is inf or nan, as GradScaler's check
(float64 squares of float32 values cannot overflow). One corner differs: with a scale
below 1, unscaling multiplies by more than 1 and may turn a huge finite float32 gradient
into inf; GradScaler checks before multiplying and steps with the inf, here the step is
skipped.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from elasticpipe.errors import InvalidRequest

# GradScaler's defaults.
DEFAULTS: dict[str, float | int] = {
    "init_scale": 2.0**16,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 2000,
}
FLOAT32_MAX = float(torch.finfo(torch.float32).max)
MAX_GROWTH_INTERVAL = 1 << 30  # the tracker is an int32


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(f"grad_scaler_kwargs[{key!r}] must be a number (got {value!r})")
    try:
        return float(value)
    except OverflowError:  # an int beyond any float
        raise InvalidRequest(
            f"grad_scaler_kwargs[{key!r}] is too large (got an integer of {len(str(value))} digits)"
        ) from None


def check_kwargs(kwargs: Mapping[str, Any]) -> dict[str, float | int]:
    """GradScaler's arguments completed with its defaults, checked as GradScaler would.

    Raises:
        InvalidRequest: an unknown key, or a value GradScaler would refuse or that makes
            no scale (named with its key).
    """
    unknown = sorted(set(kwargs) - set(DEFAULTS))
    if unknown:
        raise InvalidRequest(
            f"unknown grad_scaler_kwargs key {unknown[0]!r} (choose from {list(DEFAULTS)})"
        )
    out = {**DEFAULTS}
    for key, value in kwargs.items():
        if key == "growth_interval":
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidRequest(
                    f"grad_scaler_kwargs['growth_interval'] must be an integer (got {value!r})"
                )
            if not 1 <= value <= MAX_GROWTH_INTERVAL:
                raise InvalidRequest(
                    f"grad_scaler_kwargs['growth_interval'] must be in [1, "
                    f"{MAX_GROWTH_INTERVAL}] (got {value})"
                )
            out[key] = value
            continue
        number = _number(key, value)
        if key == "init_scale" and not 0.0 < _float32(number) <= FLOAT32_MAX:
            raise InvalidRequest(
                f"grad_scaler_kwargs['init_scale'] must be > 0 and a finite float32 (got {value!r})"
            )
        if key == "growth_factor" and not 1.0 < number < math.inf:
            raise InvalidRequest(
                f"grad_scaler_kwargs['growth_factor'] must be a finite number > 1 (got {value!r})"
            )
        if key == "backoff_factor" and not 0.0 < number < 1.0:
            raise InvalidRequest(
                f"grad_scaler_kwargs['backoff_factor'] must be in (0, 1) (got {value!r})"
            )
        out[key] = number
    return out


def as_kwargs(value: Any) -> dict[str, Any]:
    """``grad_scaler_kwargs`` as given to a pipeline (None: GradScaler's defaults).

    Raises:
        InvalidRequest: not a dict.
    """
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidRequest(
            f"grad_scaler_kwargs must be a dict of GradScaler arguments (got {value!r})"
        )
    return dict(value)


def reported(reports: Sequence[Any]) -> float | None:
    """The loss scale a run used, from its stages' ``StepReport``s (every stage reports
    its layers' scale, the same everywhere; the last one multiplied the loss); None
    without fp16."""
    scales = [r.loss_scale for r in reports if r.loss_scale > 0]
    return scales[-1] if scales else None


def _float32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float64).float())


@dataclass
class LossScale:
    """One layer's copy of the job's loss scale (GradScaler's ``_scale`` and
    ``_growth_tracker``)."""

    scale: float
    growth_tracker: int = 0

    @classmethod
    def initial(cls, kwargs: Mapping[str, Any]) -> LossScale:
        """The scale a new job starts with (``init_scale``, as a float32)."""
        return cls(_float32(float(kwargs["init_scale"])))

    def update(self, found_inf: bool, kwargs: Mapping[str, Any]) -> None:
        """``GradScaler.update`` after a step: back off if it was skipped, else grow after
        ``growth_interval`` unskipped steps in a row (``torch._amp_update_scale_``)."""
        scale = torch.tensor(self.scale, dtype=torch.float32)
        tracker = torch.tensor(self.growth_tracker, dtype=torch.int32)
        torch._amp_update_scale_(
            scale,
            tracker,
            torch.tensor(1.0 if found_inf else 0.0),
            float(kwargs["growth_factor"]),
            float(kwargs["backoff_factor"]),
            int(kwargs["growth_interval"]),
        )
        self.scale, self.growth_tracker = float(scale), int(tracker)

    def to_state(self) -> dict[str, Any]:
        """The exported form (plain data: msgpack on the wire, JSON in checkpoints)."""
        return {"scale": self.scale, "growth_tracker": self.growth_tracker}

    @classmethod
    def from_state(cls, state: Any, layer: int) -> LossScale:
        """Parses an exported form, checked. A scale of 0 is accepted: backing off often
        enough underflows float32 (GradScaler's scale does too), and a job must always be
        able to load its own state.

        Raises:
            InvalidRequest: not a finite scale >= 0 and a tracker >= 0.
        """
        scale = state.get("scale") if isinstance(state, dict) else None
        tracker = state.get("growth_tracker") if isinstance(state, dict) else None
        if (
            isinstance(scale, bool)
            or not isinstance(scale, (int, float))
            or not 0.0 <= scale <= FLOAT32_MAX
            or isinstance(tracker, bool)
            or not isinstance(tracker, int)
            or not 0 <= tracker <= MAX_GROWTH_INTERVAL
        ):
            raise InvalidRequest(
                f"loss scale state of layer {layer} is unusable ({str(state)[:120]}): "
                "expected {'scale': a finite number >= 0, 'growth_tracker': an integer >= 0}"
            )
        return cls(_float32(float(scale)), tracker)


def unscale_(grads: Iterable[torch.Tensor], scale: float) -> None:
    """Multiplies the gradients by 1/scale in place, as ``GradScaler.unscale_`` does (the
    inverse computed in float64, then rounded to float32), by device and dtype."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    inv = torch.tensor(scale, dtype=torch.float32).double().reciprocal().float()
    for (device, _), tensors in groups.items():
        found_inf = torch.zeros(1, dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, inv.to(device))
