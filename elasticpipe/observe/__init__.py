"""Observability: Prometheus metrics, traces, the timeline picture, pipeline efficiency.

* ``efficiency``: Pipeline efficiency: how close a step came to the fastest its own ops allowed.
* ``metrics``: Prometheus metrics of a stage and of the coordinator, and the HTTP endpoint
  serving them.
* ``timeline``: The classic pipeline diagram of a trace, as a PNG: stages as rows, time across.
* ``traces``: ``elasticpipe admin trace``: every stage's spans on one clock, as Chrome/Perfetto
  JSON.
"""

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
