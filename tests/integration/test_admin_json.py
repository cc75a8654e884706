"""Every admin command's ``--json`` output (and error) matches its schema on a live cluster;
``status --watch`` redraws, counts, prints JSON lines, and ends cleanly on Ctrl-C."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from elasticpipe.cli.schemas import COMMANDS, command_schema
from elasticpipe.client.pipeline import Pipeline
from elasticpipe.local.cluster import LocalCluster
from tests.support import cli

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """Four stages (a job uses three: one spare), quick death detection, no auto moves."""
    with LocalCluster(
        stages=4,
        state=":memory:",
        auto_rebalance=False,
        dead_after_s=1.5,
        heartbeat_s=0.3,
    ) as c:
        yield c


def _check(command: str, output: Any) -> Any:
    jsonschema.validate(output, command_schema(command))
    return output


def test_every_admin_command_prints_json_that_matches_its_schema(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """status, plan, rebalance --dry-run, set-partition, set-layout, trace, drain, undrain,
    slowdown, auto and forget (refused for a live stage, done for a dead one) all validate;
    so do errors."""
    seen: set[str] = set()

    def check(command: str, *args: str) -> Any:
        seen.add(command)
        return _check(command, cli.admin_json(cluster, command, *args))

    with Pipeline(
        coordinator=cluster.coordinator,
        model="mlp",
        model_kwargs={"sizes": [8, 16, 16, 4]},
        micro_batches=2,
        stages=3,
    ) as pipe:
        pipe.train_step(torch.randn(4, 8), torch.randint(0, 4, (4,)))
        deadline = time.monotonic() + 15
        status = check("status")
        while status["committed_step"] != 1 and time.monotonic() < deadline:
            time.sleep(0.2)  # the step reaches the status with the stages' next heartbeats
            status = check("status")
        assert status["committed_step"] == 1 and len(status["stages"]) == 4
        assert {s["state"] for s in status["stages"]} == {"chain", "spare"}
        assert check("plan")["current"]["boundaries"][-1] == status["num_layers"]
        assert "target" in check("rebalance", "--dry-run")
        moved = check("set-partition", "0:1,1:2,2:5")
        assert moved["changed"] and moved["partition"]["boundaries"] == [0, 1, 2, 5]
        laid = check("set-layout", "0:2,2:3,3:5")  # one replica: a move of the one pipeline
        assert laid["changed"] and laid["partition"]["boundaries"] == [0, 2, 3, 5]
        pipe.train_step(torch.randn(4, 8), torch.randint(0, 4, (4,)))
        trace = check("trace", "--steps", "1", "--out", str(tmp_path / "trace.json"))
        assert len(trace["stages"]) == 3 and trace["steps"], trace
        chain = sorted(
            (s for s in check("status")["stages"] if s["index"] >= 0), key=lambda s: s["index"]
        )
        middle = chain[1]["name"]
        assert check("drain", middle)["changed"]
        assert check("undrain", middle)["changed"]
        assert "2" in check("slowdown", middle, "2")["message"]
        assert check("auto", "off")["message"]
        spare = next(s["name"] for s in check("status")["stages"] if s["state"] == "spare")
        refused = check("forget", spare)  # alive: refused
        assert "alive" in refused["error"]["message"], refused
        cluster.kill(spare)
        deadline = time.monotonic() + 30
        while next(s for s in cluster.status().stages if s.name == spare).state != "dead":
            assert time.monotonic() < deadline, f"{spare} not declared dead"
            time.sleep(0.2)
        assert spare in check("forget", spare)["message"]
        bad = check("set-partition", "0:2,3:5")
        assert bad["error"]["code"] == "INVALID_ARGUMENT" and "'3:5'" in bad["error"]["message"]
    assert seen == set(COMMANDS)
    down = _check("status", cli.admin_json(cluster, "status", coordinator="127.0.0.1:1"))
    assert down["error"]["code"] == "UNAVAILABLE"


def _watch(cluster: LocalCluster, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        cli.as_at_a_terminal(
            [
                sys.executable,
                "-m",
                "elasticpipe",
                "admin",
                "--coordinator",
                cluster.coordinator,
                "status",
                "--watch",
                "--interval",
                "0.2",
                *args,
            ]
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_status_watch_redraws_count_frames_and_prints_json_lines(cluster: LocalCluster) -> None:
    """--count 3 prints three frames of the stage table; with --json, one valid status per
    line."""
    proc = _watch(cluster, "--count", "3")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.count("step rate") == 3
    assert all(s.name in out for s in cluster.status().stages)  # (one may be forgotten)
    proc = _watch(cluster, "--count", "2", "--json")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    lines = out.splitlines()
    assert len(lines) == 2
    for line in lines:
        _check("status", json.loads(line))


def test_status_watch_ends_cleanly_on_ctrl_c(cluster: LocalCluster) -> None:
    """SIGINT during the watch exits 0 with no traceback."""
    proc = _watch(cluster)
    assert proc.stdout is not None
    for line in proc.stdout:
        if "stages" in line:
            break
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "Traceback" not in err, err


def test_watch_rejects_a_bad_interval_naming_it(cluster: LocalCluster) -> None:
    """--interval 0 is an error naming the value, as JSON with --json."""
    out = cli.admin_json(cluster, "status", "--watch", "--interval", "0")
    assert out["error"]["code"] == "INVALID_ARGUMENT" and "0.0" in out["error"]["message"]


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["slowdown", "stage-0", "fast"], "'fast'"),
        (["set-partition"], "ranges"),
        (["auto", "maybe"], "'maybe'"),
    ],
)
def test_usage_errors_are_json_with_json(args: list[str], named: str) -> None:
    """A malformed command line with --json is the error object (exit 2), naming the value."""
    run = cli.elasticpipe("admin", *args, "--json", timeout=60)
    assert run.returncode == 2, run.stdout + run.stderr
    out = _check(args[0], json.loads(run.stdout))
    assert out["error"]["code"] == "INVALID_ARGUMENT" and named in out["error"]["message"]


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--timeout", "0", "status"], "--timeout must be positive, got 0.0"),
        (["trace", "--steps", "99", "--out", "t.json"], "--steps must be in [1, 16] (got 99)"),
        (["--coordinator", "nowhere", "--tls-cert", "x", "status"], "'nowhere'"),
    ],
    ids=["timeout", "trace-steps", "address-before-tls"],
)
def test_bad_values_are_refused_before_any_call_naming_the_flag(
    cluster: LocalCluster, args: list[str], named: str
) -> None:
    """A non-positive --timeout, a --steps out of range, or a malformed address (checked
    before the TLS flags) is INVALID_ARGUMENT naming the flag and the value, exit 2."""
    run = cli.elasticpipe("admin", "--json", "--coordinator", cluster.coordinator, *args)
    assert run.returncode == 2, run.stdout + run.stderr
    out = json.loads(run.stdout)
    assert out["error"]["code"] == "INVALID_ARGUMENT" and named in out["error"]["message"], out
