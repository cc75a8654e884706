"""Planning, pure: which layers each stage holds, and whether moving them pays.

No sockets, threads or clocks: every input is a value (time since the last move included),
so each module is tested on numbers alone.

* ``cost``: the cost model: what a slice of layers costs on a stage (time, link, memory),
  a partition with its times (``Plan``), and its step time under a schedule
  (``predict_step_time``).
* ``solver``: the exact min-bottleneck contiguous partition (``plan``), by bisection on the
  bottleneck with exact probes; its worked example is drawn in the code.
* ``hosts``: the chain order of the hosts (``order_hosts``) and where a spare could join
  (``spare_positions``).
* ``estimates``: what the stages measure turned into the planner's inputs: per-layer unit
  costs and stage speeds (``Profile``).
* ``memory``: what each layer needs where it lives and what each stage offers: the planner's
  memory terms.
* ``layouts``: replicas="auto": how many replicas, which hosts form each, their partitions
  and shares, with the reduction's time (``plan_layouts``).
* ``shares``: how many micro-batches each replica runs (``assign_shares``, water-filling:
  the slowest replica as fast as it can be).
* ``policy``: when to rebalance: a decision with hysteresis, payback and cool-down.
"""

from elasticpipe.coordinator.planning.cost import Plan, PlanError, moved_layers, predict_step_time
from elasticpipe.coordinator.planning.estimates import Profile
from elasticpipe.coordinator.planning.hosts import order_hosts, spare_positions
from elasticpipe.coordinator.planning.memory import MemoryTerms
from elasticpipe.coordinator.planning.policy import Decision, PolicyConfig, decide
from elasticpipe.coordinator.planning.solver import plan

__all__ = [
    "Decision",
    "MemoryTerms",
    "Plan",
    "PlanError",
    "PolicyConfig",
    "Profile",
    "decide",
    "moved_layers",
    "order_hosts",
    "plan",
    "predict_step_time",
    "spare_positions",
]
