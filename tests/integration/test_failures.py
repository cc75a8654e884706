"""Failures are visible and bounded: unreachable coordinators, dead stages, restarts."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from elasticpipe.client.pipeline import Pipeline
from elasticpipe.coordinator.config import CoordinatorConfig
from elasticpipe.coordinator.server import CoordinatorServer
from elasticpipe.errors import LayersLost
from elasticpipe.local.cluster import LocalCluster
from elasticpipe.stage_server.server import StageServer
from elasticpipe.stage_server.stage import StageConfig
from tests.support.servers import free_port


@pytest.mark.timeout(120)
def test_stage_retries_an_unreachable_coordinator_with_backoff(tmp_path: Path) -> None:
    """A stage whose coordinator is down logs each retry with a growing delay, then registers
    as soon as the coordinator comes up."""
    port = free_port()
    log = tmp_path / "stage.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "elasticpipe",
                "--log-format",
                "json",
                "stage",
                "--coordinator",
                f"127.0.0.1:{port}",
                "--name",
                "lonely",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while log.read_text().count("coordinator_unreachable") < 4:
            assert time.monotonic() < deadline, log.read_text()
            assert proc.poll() is None, log.read_text()
            time.sleep(0.2)
        import json

        retries = [
            json.loads(line)
            for line in log.read_text().splitlines()
            if "coordinator_unreachable" in line
        ]
        assert [r["attempt"] for r in retries[:4]] == [1, 2, 3, 4]
        assert retries[3]["retry_in_s"] > retries[0]["retry_in_s"]
        assert f"127.0.0.1:{port}" in retries[0]["coordinator"]
        with CoordinatorServer(CoordinatorConfig(listen=f"127.0.0.1:{port}")) as coordinator:
            assert coordinator.coordinator is not None
            deadline = time.monotonic() + 30
            while not any(
                m.row.name == "lonely" for m in coordinator.coordinator.members.members()
            ):
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.timeout(180)
def test_a_job_without_snapshots_fails_clearly_when_a_stage_dies_mid_step() -> None:
    """With snapshots off, killing a stage during a step ends train_step quickly (long
    before the step deadline) with LayersLost naming the lost layers and the dead host,
    and nothing hangs."""
    with LocalCluster(
        stages=2,
        state=":memory:",
        auto_rebalance=False,
    ) as cluster:
        kwargs = {"sizes": [64, 256, 256, 256, 8]}
        with Pipeline(
            coordinator=cluster.coordinator,
            model="mlp",
            model_kwargs=kwargs,
            micro_batches=8,
            stages=2,
            step_timeout=60,
            snapshot_every=0,
        ) as pipe:
            x, y = torch.randn(64, 64), torch.randint(0, 8, (64,))
            pipe.train_step(x, y)
            victim = pipe.partition.addresses[1]
            lost = list(pipe.partition.layers_of(1))
            name = f"stage-{cluster.stage_addresses.index(victim)}"
            errors: list[BaseException] = []
            with cluster.admin() as admin:  # long steps: the kill lands in one
                admin.slowdown(name, 1000.0)

            def train() -> None:
                try:
                    pipe.train_step(x, y)
                except BaseException as exc:
                    errors.append(exc)

            worker = threading.Thread(target=train)
            worker.start()
            time.sleep(0.5)
            killed_at = time.monotonic()
            cluster.kill(name)
            worker.join(timeout=30)
            assert not worker.is_alive(), "train_step hung after the stage died"
            elapsed = time.monotonic() - killed_at
            assert elapsed < 20, f"error took {elapsed:.1f}s (step deadline is 60s)"
            assert len(errors) == 1
            assert isinstance(errors[0], LayersLost), repr(errors[0])
            assert str(lost) in str(errors[0]) and name in str(errors[0])


@pytest.mark.timeout(120)
def test_restarted_coordinator_remembers_stages_job_and_partition(tmp_path: Path) -> None:
    """A coordinator restarted on the same state file knows the stages, the job, the
    partition with its epoch, and the epoch history."""
    state = str(tmp_path / "coordinator.sqlite")
    with CoordinatorServer(CoordinatorConfig(state=state, heartbeat_interval_s=0.2)) as first:
        stages = [
            StageServer(StageConfig(name=f"host-{i}"), first.address).start() for i in range(2)
        ]
        try:
            for s in stages:
                assert s.registered.wait(10)
            with Pipeline(
                coordinator=first.address, model="mlp", model_kwargs={"sizes": [4, 8, 2]}, stages=2
            ) as pipe:
                pipe.train_step(torch.randn(4, 4), torch.randint(0, 2, (4,)))
                partition = pipe.partition
        finally:
            for s in stages:
                s.stop()
    with CoordinatorServer(CoordinatorConfig(state=state)) as second:
        assert second.coordinator is not None
        c = second.coordinator.cluster
        assert sorted(m.row.name for m in c.members.members()) == ["host-0", "host-1"]
        assert c.job is not None and c.job.model == "mlp"
        assert c.partition is not None
        assert c.partition.epoch == partition.epoch
        assert c.partition.boundaries == partition.boundaries
        assert c.partition.addresses == partition.addresses
        assert [r.epoch for r in c.store.epochs()] == [partition.epoch]
