"""The control plane: membership, planner, epochs, rebalancing policy, admin."""

from elasticpipe.coordinator.config import CoordinatorConfig
from elasticpipe.coordinator.coordinator import Coordinator
from elasticpipe.coordinator.planning import Plan, PlanError, order_hosts, plan, predict_step_time
from elasticpipe.coordinator.planning.policy import PolicyConfig
from elasticpipe.coordinator.server import CoordinatorServer

__all__ = [
    "Coordinator",
    "CoordinatorConfig",
    "CoordinatorServer",
    "Plan",
    "PlanError",
    "PolicyConfig",
    "order_hosts",
    "plan",
    "predict_step_time",
]
