"""Observability: Prometheus metrics, traces, the timeline picture, pipeline efficiency.

* ``efficiency``: Pipeline efficiency: how close a step came to the fastest its own ops allowed.
* ``metrics``: Prometheus metrics of a stage and of the coordinator, and the HTTP endpoint
  serving them.
* ``timeline``: The classic pipeline diagram of a trace, as a PNG: stages as rows, time across.
* ``traces``: ``elasticpipe admin trace``: every stage's spans on one clock, as Chrome/Perfetto
  JSON.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elasticpipe.observe.efficiency import critical_path, ideal_step_time, step_efficiency
    from elasticpipe.observe.metrics import CoordinatorMetrics, MetricsEndpoint, StageMetrics

__all__ = [
    "CoordinatorMetrics",
    "MetricsEndpoint",
    "StageMetrics",
    "critical_path",
    "ideal_step_time",
    "step_efficiency",
]

# Imported on first use, so that ``elasticpipe admin`` (which needs only ``traces``) starts
# without importing torch.
_HOMES = {name: "efficiency" for name in ("critical_path", "ideal_step_time", "step_efficiency")}
_HOMES |= {name: "metrics" for name in ("CoordinatorMetrics", "MetricsEndpoint", "StageMetrics")}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
