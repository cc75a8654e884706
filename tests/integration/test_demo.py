"""The demo trains, samples and stops every process, on completion and on Ctrl-C."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

DEMO = [
    sys.executable,
    "-m",
    "elasticpipe",
    "demo",
    "--stages",
    "2",
    "--layers",
    "2",
    "--d-model",
    "32",
    "--batch-size",
    "8",
    "--seq-len",
    "32",
]


def _children_alive(pid: int) -> list[int]:
    out = subprocess.run(
        ["pgrep", "-f", "elasticpipe (stage|coordinator)"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return [int(p) for p in out.split() if int(p) != pid]


@pytest.mark.timeout(240)
def test_demo_trains_prints_progress_and_a_sample_then_stops_cleanly() -> None:
    """A short demo run prints step/loss/tokens-per-second lines, a text sample, and exits 0."""
    before = set(_children_alive(os.getpid()))
    run = subprocess.run(
        [*DEMO, "--steps", "12"], capture_output=True, text=True, timeout=200, check=False
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "step    10/12" in run.stdout and "tokens/s" in run.stdout
    assert "--- sample ---" in run.stdout and "cluster stopped cleanly" in run.stdout
    assert set(_children_alive(os.getpid())) <= before


@pytest.mark.timeout(240)
def test_ctrl_c_stops_the_demo_and_every_process_it_started() -> None:
    """SIGINT during training ends the demo with code 130 and leaves no server running."""
    before = set(_children_alive(os.getpid()))
    proc = subprocess.Popen(
        [*DEMO, "--steps", "100000"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 150
    for line in proc.stdout:
        if line.startswith("step "):
            break
        assert time.monotonic() < deadline
    proc.send_signal(signal.SIGINT)
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 130, output
    assert "interrupted" in output
    deadline = time.monotonic() + 10
    while set(_children_alive(os.getpid())) - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not set(_children_alive(os.getpid())) - before
