"""The control plane: membership, planner, epochs, rebalancing policy, admin."""

from coordinator.coordinator import Coordinator
from coordinator.planner import Plan, PlanError, order_hosts, plan, predict_step_time
from coordinator.policy import PolicyConfig
from coordinator.server import CoordinatorServer

__all__ = [
    "Coordinator",
    "CoordinatorServer",
    "Plan",
    "PlanError",
    "PolicyConfig",
    "order_hosts",
    "plan",
    "predict_step_time",
]
