"""No bench can rot: every script in bench/ runs end to end in its ``--quick`` mode, as a real
subprocess, and ends with its one JSON line carrying the figures it promises.

The benches are found by glob, so a new bench without a ``--quick`` mode, or without its
entry in ``KEYS`` (in ``tests/support/benches.py``), fails here. ``bench/gpu.py`` needs
CUDA: without it, its quick mode exits 2 with a JSON line saying why, and its case is
skipped with that reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.benches import KEYS

BENCH = Path(__file__).resolve().parents[2] / "bench"
# modules the benches import, not benches
HELPERS = {"datapaths.py", "fake_epochs.py", "fake_stage.py", "scale_parts.py"}
# Figures that are facts, not measurements: the quick run must get them exactly.
EXACT: dict[str, dict[str, Any]] = {
    # the run with three kills ends with the failure-free run's weights, bit for bit
    "faults.py": {"identical": True, "losses_identical": True},
    # the run whose leader was killed (and which moved layers after) ends bit for bit equal
    "failover.py": {"identical": True, "losses_identical": True},
    # every chain size ran (scale.py reports a size that failed and carries on)
    "scale.py": {"failed": [], "max_stages": 8},
}
BENCHES = sorted(p.name for p in BENCH.glob("*.py") if p.name not in HELPERS)
TIMEOUT_S = 240  # a bench's quick run on a loaded 2-core machine; seconds on a quiet one


def _quick(name: str, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python bench/NAME --quick ARGS`` run in ``cwd`` (what it writes lands there)."""
    return subprocess.run(
        [sys.executable, str(BENCH / name), "--quick", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


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
    assert name in KEYS, f"bench/{name} has no entry in KEYS of tests/support/benches.py"
    assert "--quick" in (BENCH / name).read_text(), f"bench/{name} has no --quick mode"
    done = _quick(name, tmp_path)
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


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 30)
def test_the_ab_bench_runs_its_gpt_workload_on_emulated_devices(tmp_path: Path) -> None:
    """``bench/ab.py``'s other workload and its emulated devices, which the quick run
    above leaves out."""
    done = _quick("ab.py", tmp_path, "--workload", "gpt", "--slowdown", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["workload"] == "gpt" and figures["slowdown"] == 2.0
    assert figures["ratio_b_over_a"] > 0
