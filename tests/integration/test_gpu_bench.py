"""bench/gpu.py stays runnable without a GPU: it refuses clearly without CUDA, and its dry
run on CPU stages goes through every part and ends with its JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support import benches

BENCH = Path(__file__).resolve().parents[2] / "bench" / "gpu.py"
KEYS = benches.KEYS["gpu.py"]


def _run(*args: str, timeout: float) -> tuple[int, dict[str, object], str]:
    done = subprocess.run(
        [sys.executable, str(BENCH), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    last = done.stdout.strip().splitlines()[-1]
    return done.returncode, json.loads(last), done.stderr


@pytest.mark.timeout(60)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit")
def test_without_cuda_it_says_why_and_exits_2() -> None:
    """No GPU: exit status 2, a message naming the torch build, and a JSON line saying so."""
    code, figures, stderr = _run(timeout=50)
    assert code == 2
    assert figures["cuda"] is False and "no CUDA device" in str(figures["skipped"])
    assert torch.__version__ in stderr


@pytest.mark.timeout(240)
def test_the_cpu_dry_run_goes_through_every_part() -> None:
    """Transparency holds on CPU stages and every figure of the JSON line is there."""
    code, figures, _ = _run("--dry-run-cpu", "--quick", timeout=220)
    assert code == 0
    assert set(figures) >= KEYS
    assert figures["transparent"] is True
    assert isinstance(figures["hop_ms_4mib"], float) and figures["one_stage_ms"] > 0  # type: ignore[operator]
