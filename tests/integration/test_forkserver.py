"""The fork server the suite starts its clusters' processes from (``tests/conftest.py``):
a forked coordinator or stage is a process as real as a spawned one -- its own pid and
session, the environment and log it was given, signals and exit codes as ``Popen``'s --
and a cluster of forked processes trains to the same bits as one of spawned processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from elasticpipe.local import forkserver
from elasticpipe.local.cluster import LocalCluster
from tests.support import jobs

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def server() -> Iterator[forkserver.ForkServer]:
    """A fork server of the test's own (not the suite's shared one)."""
    started = forkserver.ForkServer()
    yield started
    started.close()


def test_a_forked_command_gets_its_environment_log_session_and_exit_code(
    server: forkserver.ForkServer, tmp_path: Path
) -> None:
    """A bad flag exits 2 with argparse's message in the child's log; a coordinator runs in
    a session of its own, in the directory and with the environment it was given (its
    log is JSON, as ``ELASTICPIPE_LOG_FORMAT`` asks), and SIGTERM ends it with 0, SIGKILL
    with -9. (``/proc/PID/environ`` shows the server's: the block the process was started
    with.)"""
    bad = server.spawn(
        ["stage", "--coordinator", "127.0.0.1:1", "--no-such-flag"],
        dict(os.environ),
        tmp_path / "bad.log",
    )
    assert bad.wait(timeout=30) == 2 and bad.poll() == 2
    assert "unrecognized arguments: --no-such-flag" in (tmp_path / "bad.log").read_text()

    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "ELASTICPIPE_LOG_FORMAT": "json"}
    ready = tmp_path / "coordinator.ready"
    argv = ["coordinator", "--listen", "127.0.0.1:0", "--state", ":memory:"]
    for sig, code in ((signal.SIGTERM, 0), (signal.SIGKILL, -signal.SIGKILL)):
        ready.unlink(missing_ok=True)
        log = tmp_path / f"coordinator-{sig}.log"
        child = server.spawn([*argv, "--ready-file", str(ready)], env, log, cwd=str(tmp_path))
        while not (ready.exists() and ready.stat().st_size):
            assert child.poll() is None, log.read_text()
            with pytest.raises(subprocess.TimeoutExpired):
                child.wait(timeout=0.05)
        assert child.pid not in (os.getpid(), server._proc.pid)
        assert os.getsid(child.pid) == child.pid  # a session of its own: killpg reaches it
        assert os.readlink(f"/proc/{child.pid}/cwd") == str(tmp_path)
        os.killpg(child.pid, sig)
        assert child.wait(timeout=30) == code and child.returncode == code
        child.kill()  # reaped by the server already: nothing to signal, and no error
        lines = log.read_text().splitlines()
        assert lines and all(isinstance(json.loads(line), dict) for line in lines), lines


def test_forked_and_spawned_clusters_train_the_same_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same job on a cluster of spawned processes and on one of forked processes: the
    same losses and weights, bit for bit."""
    results = []
    for fork in ("0", "1"):
        monkeypatch.setenv(forkserver.ENV, fork)
        torch.manual_seed(0)
        x, y = torch.randn(16, 16), torch.randint(0, 4, (16,))
        with (
            LocalCluster(stages=2, auto_rebalance=False) as cluster,
            jobs.mlp(cluster.coordinator, sizes=[16, 32, 32, 4], micro_batches=2) as pipe,
        ):
            spawned = isinstance(cluster.procs["stage-0"], subprocess.Popen)
            assert spawned == (fork == "0")
            losses = [pipe.train_step(x, y) for _ in range(3)]
            results.append((losses, pipe.state_dict()))
    (want_losses, want_state), (losses, state) = results
    assert losses == want_losses
    assert want_state.keys() == state.keys()
    for key, value in want_state.items():
        assert torch.equal(state[key], value), key
