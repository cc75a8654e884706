"""The demo trains, samples and stops every process, on completion and on Ctrl-C. It runs
as a user runs it: every process spawned, none forked from the suite's fork server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elasticpipe.local import forkserver
from tests.support.cli import as_at_a_terminal

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
    "--no-events",
]
AS_A_USER = {k: v for k, v in os.environ.items() if k != forkserver.ENV}  # every process spawned


def _children_alive(pid: int) -> list[int]:
    out = subprocess.run(
        ["pgrep", "-f", "elasticpipe (stage|coordinator)"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    # Only ours: other checkouts on the same host may run clusters of their own.
    here = os.getcwd()
    return [int(p) for p in out.split() if int(p) != pid and _cwd(int(p)) == here]


def _cwd(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/cwd")
    except OSError:  # gone already, or not ours to read
        return ""


@pytest.mark.timeout(240)
def test_demo_trains_prints_progress_and_a_sample_then_stops_cleanly() -> None:
    """A short demo run prints step/loss/tokens-per-second lines, a text sample, and exits 0."""
    before = set(_children_alive(os.getpid()))
    run = subprocess.run(
        [*DEMO, "--steps", "12"],
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
        env=AS_A_USER,
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
        as_at_a_terminal([*DEMO, "--steps", "100000"]),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=AS_A_USER,
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


def _png_size(data: bytes) -> tuple[int, int]:
    """Width and height from a PNG's signature and IHDR chunk."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", data[:8]
    assert data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


@pytest.mark.timeout(200)
def test_demo_events_slow_down_recover_and_kill_a_stage_and_draw_them(tmp_path: Path) -> None:
    """The slowdown moves layers off the slowed stage, training survives the kill, the
    summary lists the events in order, and the PNG has the documented size."""
    png = tmp_path / "demo.png"
    run = subprocess.run(
        [
            *DEMO[:5],
            "4",
            *DEMO[6:],
            # the demo's width: a move off the slow stage must repay its pause within the
            # policy's horizon (a tinier model's savings do not)
            *("--events", "--layers", "8", "--d-model", "128", "--batch-size", "16"),
            # the policy confirms a move over a few of its passes (seconds): steps of a
            # fraction of a second need this many of them between slowdown and recovery
            *("--steps", "80", "--slow-at", "6", "--recover-at", "64", "--kill-at", "72"),
            *("--png", str(png), "--log-dir", str(tmp_path / "logs"), "--sample-chars", "20"),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env=AS_A_USER,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    record = json.loads(png.with_suffix(".json").read_text())
    events = record["events"]
    caused = [e["kind"] for e in events if e["kind"] in ("slowdown", "recovered", "kill")]
    assert caused == ["slowdown", "recovered", "kill"]
    assert [e["step"] for e in events] == sorted(e["step"] for e in events)
    slow = next(e["stage"] for e in events if e["kind"] == "slowdown")
    killed = next(e["stage"] for e in events if e["kind"] == "kill")
    layers = {s["step"]: s["layers"] for s in record["samples"]}
    assert layers[6][slow] > layers[64][slow], f"no layers moved off {slow}: {layers}"
    assert any(e["kind"] == "move" and 6 <= e["step"] <= 64 for e in events), events
    assert any(e["kind"] == "recovery" and e["step"] > 72 for e in events), events
    assert killed not in layers[80] and len(layers[80]) == 3  # the chain shrank
    assert max(layers) == 80 and all(s["loss"] > 0 for s in record["samples"])
    summary = run.stdout[run.stdout.index("--- summary ---") :]
    assert (
        summary.index("3x slower")
        < summary.index("back to full speed")
        < summary.index("killed (SIGKILL)")
    )
    assert "steps/s" in summary and "final loss" in summary
    data = png.read_bytes()
    assert _png_size(data) == (1100, 650) and len(data) > 20_000
