"""The control plane: membership, planner, epochs, rebalancing policy, admin."""
