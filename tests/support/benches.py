"""What the benches promise: every bench's JSON keys, shared by the test that runs each bench's
quick mode and the CPU dry run of ``bench/gpu.py``; and ``imported``, a bench module as the
benches import it, for the unit tests of bench code."""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


@contextlib.contextmanager
def imported(name: str) -> Iterator[ModuleType]:
    """The bench module ``name`` (``"fake_stage"``, ``"shared.steps"``) imported as the
    benches import it: with ``bench/`` on ``sys.path`` for the block."""
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


# Every bench's JSON keys (a subset: a bench may print more).
KEYS: dict[str, set[str]] = {
    "ab.py": {"a", "b", "workload", "slowdown", "ratio_b_over_a"},
    "anatomy.py": {"step_ms", "busiest_busy_ms", "bubble_ms", "overhead_ms", "commit_ms"},
    "faults.py": {
        "identical",
        "losses_identical",
        "max_abs_diff",
        "recoveries",
        "snapshot_overhead",
        "failure_free_steps_per_s",
        "with_failures_steps_per_s",
    },
    "failover.py": {
        "failover_s",
        "epoch_change_possible_s",
        "steps_per_s_before",
        "steps_per_s_during",
        "identical",
        "cpu_ms_per_heartbeat_etcd",
        "cpu_ms_per_heartbeat_sqlite",
    },
    "first_step.py": {
        "first_step_s",
        "setup_s",
        "profile_s",
        "init_state_s",
        "steady_step_s",
        "data_path_gbps",
        "init_state_vs_data_path",
        "stream_vs_data_path",
        "load_commit_s",
        "first_step_vs_goal",
        "load_over",
        "step_part_fault_gib",
        "step_part_kernel_s",
        "steady_kernel_s",
    },
    "gpu.py": {
        "transparent",
        "max_abs_diff",
        "overhead_ratio_1stage",
        "outside_ms_2stage",
        "hop_gbps_4mib",
        "hop_gbps_32mib",
        "pcie_gbps_4mib",
    },
    "memory.py": {
        "gpipe",
        "1f1b+recompute",
        "gpipe_recompute_stash_saving",
        "1f1b_recompute_stash_saving",
        "bf16_wire_ratio",
        "fp16_wire_ratio",
    },
    "memory_plan.py": {"fp32", "bf16", "cap", "step_s"},
    "order_hosts.py": {"8", "16"},
    "overhead.py": {
        "plain_steps_per_s",
        "one_stage_ratio",
        "two_stage_ratio",
        "zb_vs_1f1b",
        "two_stage_outside_compute_ms",
        "losses_agree",
        "mtls_overhead_median",
    },
    "planner.py": {"ours_worst_over_optimum", "over_optimum", "plan_ms"},
    "rng_overhead.py": {
        "forward_seed_us",
        "seeded_ms_per_step",
        "unseeded_ms_per_step",
        "overhead_ms_per_step",
    },
    "scale.py": {"max_stages", "plan_ms", "migration_s", "step_fanout_s", "exponents", "sizes"},
    "move_pause.py": {
        "data_path_gbps",
        "pause_ms_1",
        "goal_ms_1",
        "pause_ms_3",
        "goal_ms_3",
        "move_gbps",
        "move_vs_data_path",
        "worst_pause_vs_goal",
    },
    "copy_transport.py": {
        "bulk_wall_ms",
        "grpc_wall_ms",
        "bulk_cpu_ms",
        "grpc_cpu_ms",
        "grpc_over_bulk_wall",
        "grpc_over_bulk_cpu",
    },
    "snapshot_cost.py": {
        "crc+digest_1mib_total_ms",
        "digest-once_1mib_total_ms",
        "sha-256-once_1mib_total_ms",
        "blake3_vs_sha256_1mib_total",
    },
    "replicas.py": {
        "speedup_best",
        "auto_vs_best",
        "gloo_vs_data_channel",
        "straggler_vs_optimum",
        "reshare_steps",
        "min_vs_predicted",
        "max_cores_busy",
        "layouts",
    },
    "straggler.py": {
        "before_steps_per_s",
        "static_steps_per_s",
        "elastic_steps_per_s",
        "recovered_steps_per_s",
        "rebalance_steps",
        "elastic_vs_static",
        "loop_pause_s",
        "recovery_loop_pause_s",
    },
    "timeline.py": {"client_efficiency", "trace_efficiency", "trace_measured_ms", "png"},
    "transfer.py": {"gloo_ratio_4mib", "tcp_ratio_4mib", "table", "data_path_time_shares"},
    "vs_torch.py": {"ratios", "worst_ratio", "configs"},
}
