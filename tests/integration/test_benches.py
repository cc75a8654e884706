"""No bench can rot: every script in bench/ runs end to end in its ``--quick`` mode, as a real
subprocess, and ends with its one JSON line carrying the figures it promises.

The benches are found by glob, so a new bench without a ``--quick`` mode, or without its
entry in ``KEYS`` below, fails here. ``bench/gpu.py`` needs CUDA: without it, its quick mode
exits 2 with a JSON line saying why, and its case is skipped with that reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
# modules the benches import, not benches
HELPERS = {"datapaths.py", "fake_epochs.py", "fake_stage.py", "scale_parts.py"}
# Every bench's JSON keys (a subset: a bench may print more).
KEYS: dict[str, set[str]] = {
    "ab.py": {"a", "b", "ratio_b_over_a"},
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
    "snapshot_cost.py": {"crc+sha_1mib_total_ms", "sha-once_1mib_total_ms"},
    "straggler.py": {
        "before_steps_per_s",
        "static_steps_per_s",
        "elastic_steps_per_s",
        "recovered_steps_per_s",
        "rebalance_steps",
        "elastic_vs_static",
    },
    "timeline.py": {"client_efficiency", "trace_efficiency", "trace_measured_ms", "png"},
    "transfer.py": {"gloo_ratio_4mib", "tcp_ratio_4mib", "table", "data_path_time_shares"},
}
# Figures that are facts, not measurements: the quick run must get them exactly.
EXACT: dict[str, dict[str, Any]] = {
    # the run with three kills ends with the failure-free run's weights, bit for bit
    "faults.py": {"identical": True, "losses_identical": True},
    # every chain size ran (scale.py reports a size that failed and carries on)
    "scale.py": {"failed": [], "max_stages": 8},
}
BENCHES = sorted(p.name for p in BENCH.glob("*.py") if p.name not in HELPERS)
TIMEOUT_S = 240  # a bench's quick run on a loaded 2-core machine; seconds on a quiet one


def test_every_bench_has_its_expected_keys() -> None:
    """The key list names exactly the benches in bench/ (none missing, none stale)."""
    assert set(KEYS) == set(BENCHES)
    assert set(EXACT) <= set(KEYS)


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("name", BENCHES)
def test_quick_mode_runs_end_to_end_and_ends_with_its_json_line(name: str, tmp_path: Path) -> None:
    """``python bench/NAME --quick`` exits 0 and its last stdout line is JSON with the
    bench's figures (what it writes lands in a temporary folder)."""
    assert name in KEYS, f"bench/{name} has no entry in KEYS of {Path(__file__).name}"
    assert "--quick" in (BENCH / name).read_text(), f"bench/{name} has no --quick mode"
    done = subprocess.run(
        [sys.executable, str(BENCH / name), "--quick"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    tail = f"exit {done.returncode}; stderr ends:\n{done.stderr[-3000:]}"
    lines = done.stdout.strip().splitlines()
    assert lines, f"bench/{name} --quick printed nothing; {tail}"
    try:
        figures = json.loads(lines[-1])
    except json.JSONDecodeError:
        pytest.fail(f"bench/{name} --quick: the last line is not JSON: {lines[-1]!r}; {tail}")
    assert isinstance(figures, dict), lines[-1]
    if name == "gpu.py" and done.returncode == 2 and figures.get("cuda") is False:
        pytest.skip(f"bench/gpu.py --quick: {figures['skipped']}")
    assert done.returncode == 0, tail
    missing = KEYS[name] - set(figures)
    assert not missing, f"bench/{name} --quick: JSON line lacks {sorted(missing)}: {lines[-1]}"
    for key, want in EXACT.get(name, {}).items():
        assert figures[key] == want, f"bench/{name} --quick: {key} {figures[key]!r}, not {want!r}"
    if name == "timeline.py":
        assert (tmp_path / figures["png"]).stat().st_size > 0
