"""What a new job reports about itself: its predicted step time, and its epoch history
(start, init_state's load, a resume), in the client's log, the partition and admin views."""

from __future__ import annotations

import itertools
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest
import torch

from elasticpipe import models
from elasticpipe.cli.admin import format_plan, format_status
from elasticpipe.cli.schemas import command_schema
from elasticpipe.client import streaming
from elasticpipe.client.admin import Admin, PlanReport, Status, document
from elasticpipe.client.pipeline import Pipeline
from elasticpipe.coordinator import loads
from elasticpipe.coordinator.server import CoordinatorServer
from elasticpipe.errors import DeadlineExceeded
from elasticpipe.stage_server.server import StageServer
from elasticpipe.v1 import coordinator_pb2, coordinator_pb2_grpc
from elasticpipe.wire import bundle

pytestmark = pytest.mark.timeout(120)
KWARGS = {"sizes": [16, 64, 64, 4]}


def _pipeline(coordinator: str, **extra: Any) -> Pipeline:
    return Pipeline(
        coordinator=coordinator,
        model="mlp",
        model_kwargs=KWARGS,
        micro_batches=2,
        stages=2,
        snapshot_every=1,
        **extra,
    )


def _plan(coordinator: str) -> PlanReport:
    with Admin(coordinator) as admin:
        return admin.plan()


def _status(coordinator: str) -> Status:
    with Admin(coordinator) as admin:
        return admin.status()


def _events(caplog: pytest.LogCaptureFixture, name: str) -> list[dict[str, Any]]:
    fields = [getattr(r, "elasticpipe", None) for r in caplog.records]
    return [f for f in fields if isinstance(f, dict) and f.get("event") == name]


def _init_state() -> dict[str, torch.Tensor]:
    return dict(models.build("mlp", seed=7, **KWARGS).state_dict())


def test_the_step_time_is_unknown_until_profiled_then_in_seconds(
    coordinator_server: CoordinatorServer, stage_servers: list[StageServer]
) -> None:
    """A job set up before its first step (here from init_state) has no profile: its
    predicted step time is None on the partition, null in `admin plan --json` (valid for
    the schema) and "unknown" in the table, not a unit-less cost; after the first step
    profiles the stages it is seconds, of the order of the steps measured."""
    address = coordinator_server.address
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    with _pipeline(address, init_state=_init_state()) as pipe:
        assert pipe.partition.predicted_step_s is None
        plan = _plan(address)
        printed = document(plan)
        assert printed["current_step_s"] is None and printed["optimal_step_s"] is None
        assert printed["current"]["predicted_step_s"] is None
        jsonschema.validate(printed, command_schema("plan"))
        assert "predicted step: unknown" in format_plan(plan)
        started = time.perf_counter()
        pipe.train_step(x, y)  # profiles the stages first
        pipe.train_step(x, y)
        measured = (time.perf_counter() - started) / 2
        predicted = pipe.partition.predicted_step_s
        assert predicted is not None and predicted > 0
        # The planner leaves out RPC and Python overheads, so it predicts less than a
        # step takes; a unit-less cost was off by two orders of magnitude (11.3 for 0.1 s).
        assert predicted < 10 * measured, (predicted, measured)
        plan = _plan(address)
        assert plan.current_step_s is not None and plan.current_step_s > 0
        assert "predicted step: current" in format_plan(plan)
        jsonschema.validate(document(plan), command_schema("plan"))


def test_a_profile_request_sent_again_profiles_nothing(
    coordinator_server: CoordinatorServer,
    stage_servers: list[StageServer],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``ProfileJob`` sent again for a job its first request profiled -- as a caller sends
    it to a new leader when the old one died mid-call -- profiles no stage twice: the
    stored profile stands, and the partition it chose stays in force, even where the
    live speeds measured since call for another (moving for them is the policy's call,
    with its threshold, not a resend's)."""
    address = coordinator_server.address
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    with (
        caplog.at_level(logging.INFO, logger="elasticpipe"),
        _pipeline(address, init_state=_init_state()) as pipe,
        Admin(address) as admin,
    ):
        pipe.train_step(x, y)  # profiles the stages first
        assert len(_events(caplog, "stages_profiled")) == 1
        epoch = pipe.partition.epoch
        # The live speeds now call for another partition: the stage of the most layers
        # slowed (one of a single layer would have none to give away).
        bounds = pipe.partition.boundaries
        sizes = [hi - lo for lo, hi in itertools.pairwise(bounds)]
        admin.slowdown(pipe.partition.stage_ids[sizes.index(max(sizes))], 8.0)
        deadline = time.monotonic() + 30  # heartbeats every 0.2 s; a loaded host may delay some
        while not ((gain := admin.plan().gain) and gain > 0.05):
            assert time.monotonic() < deadline, admin.plan()
            pipe.train_step(x, y)
            time.sleep(0.2)
        caplog.clear()
        request = coordinator_pb2.ProfileJobRequest(
            job_id=pipe.partition.job_id,
            client=pipe._client,  # the holder's own resend
        )
        bundle.set_sample(request, x[:4])
        with grpc.insecure_channel(address) as channel:
            reply = coordinator_pb2_grpc.CoordinatorServiceStub(channel).ProfileJob(
                request, timeout=30
            )
        assert reply.epoch == epoch
        assert not _events(caplog, "stages_profiled")
        assert [e["again"] for e in _events(caplog, "job_profiled")] == [True]
        assert pipe.train_step(x, y) > 0


def test_a_job_from_init_state_tells_its_two_epochs_truthfully(
    coordinator_server: CoordinatorServer,
    stage_servers: list[StageServer],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A job started from init_state has a start epoch, then the restore that streamed
    the weights: the history says so, counts the bytes streamed, and the client's
    pipeline_ready line names the epoch in force, the one pipe.partition reports."""
    address = coordinator_server.address
    weights = _init_state()
    tensor_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    with (
        caplog.at_level(logging.INFO, logger="elasticpipe"),
        _pipeline(address, init_state=weights) as pipe,
    ):
        pipe.train_step(torch.randn(8, 16), torch.randint(0, 4, (8,)))
        epoch, job_id = pipe.partition.epoch, pipe.partition.job_id
    status = _status(address)
    rows = [r for r in status.history if r.job_id == job_id]
    assert [r.kind for r in rows] == ["start", "restore"], format_status(status)
    start, load = rows
    assert "init_state" in start.reason and start.bytes_moved == 0
    assert "initial weights (init_state) loaded" in load.reason, load.reason
    # Every tensor of every layer, plus each layer's small msgpack header.
    overhead = 4096 * pipe.num_layers
    assert tensor_bytes <= load.bytes_moved <= tensor_bytes + overhead, load.bytes_moved
    assert load.layers_moved == pipe.num_layers
    assert str(load.bytes_moved) in load.reason
    ready = _events(caplog, "pipeline_ready")
    assert len(ready) == 1
    assert ready[0]["epoch"] == epoch == load.epoch, (ready, epoch, load.epoch)
    assert ready[0]["weights"] == "init_state"
    loaded = _events(caplog, "initial_weights_loaded")
    assert [e["bytes"] for e in loaded] == [load.bytes_moved]


def test_a_resume_starts_the_partitions_rollback_record_afresh(
    coordinator_server: CoordinatorServer, stage_servers: list[StageServer]
) -> None:
    """After a client resumes at step 3, the partition's restored_step and restore_epoch
    are that step and the attach's epoch (not the init_state load of step 0 before it),
    and `admin status --json`, with its attach row, is valid for the schema."""
    address = coordinator_server.address
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    with _pipeline(address, init_state=_init_state()) as first:
        for _ in range(3):
            first.train_step(x, y)
        loaded = first.partition
    assert (loaded.restored_step, loaded.restore_epoch) == (0, loaded.epoch)
    with _pipeline(address, resume=True) as second:
        assert second.step == 3
        attached = second.partition
        assert attached.epoch > loaded.epoch
        assert (attached.restored_step, attached.restore_epoch) == (3, attached.epoch)
        second.train_step(x, y)
        assert second.step == 4
    status = _status(address)
    assert status.history[-1].kind == "attach"
    assert status.history[-1].restored_step == 3
    assert (status.partition.restored_step, status.partition.restore_epoch) == (3, attached.epoch)
    jsonschema.validate(document(status), command_schema("status"))


CLIENT = """
import sys, time, torch
from elasticpipe.client.pipeline import Pipeline
pipe = Pipeline(coordinator=sys.argv[1], model="mlp", model_kwargs={kwargs!r}, micro_batches=2,
                stages=2, snapshot_every=1, lease_s=6.0)
pipe.train_step(torch.randn(8, 16), torch.randint(0, 4, (8,)))
print("trained", flush=True)
time.sleep(600)
"""


def test_a_resume_waiting_for_a_dead_clients_lease_says_so_once(
    coordinator_server: CoordinatorServer,
    stage_servers: list[StageServer],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A script SIGKILLed while holding the job's lease (6 s): its successor's
    Pipeline(resume=True) retries every second until the lease runs out, and logs
    waiting_for_lease once (then only every 10 s), not once per retry; then it attaches."""
    address = coordinator_server.address
    code = CLIENT.format(kwargs=KWARGS)
    with subprocess.Popen(
        [sys.executable, "-c", code, address], stdout=subprocess.PIPE, text=True
    ) as holder:
        try:
            assert holder.stdout is not None
            assert holder.stdout.readline().strip() == "trained"
        finally:
            holder.kill()
    started = time.monotonic()
    with (
        caplog.at_level(logging.INFO, logger="elasticpipe"),
        _pipeline(address, resume=True) as pipe,
    ):
        assert pipe.step == 1
    waited = time.monotonic() - started
    lines = _events(caplog, "waiting_for_lease")
    assert 2 < waited < 10, waited  # several retries, all within the first ten seconds
    assert len(lines) == 1, lines
    assert "held by client" in lines[0]["reason"]


class _Interrupted(KeyboardInterrupt):
    """A Ctrl-C in the training script while it streams a checkpoint."""


@pytest.mark.parametrize("where", ["interrupt", "unreadable"])
def test_a_load_cut_short_in_the_client_is_abandoned_at_once(
    coordinator_server: CoordinatorServer,
    stage_servers: list[StageServer],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    where: str,
) -> None:
    """A load cut short by the client's own side -- an interrupt while it streams, or the
    checkpoint failing to read -- is abandoned at once: the caller gets that error (not
    gRPC's "Exception iterating requests!"), no stage is left frozen, and the next step
    runs at once, from the weights the load did not replace."""
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    with _pipeline(coordinator_server.address) as pipe:
        pipe.train_step(x, y)
        pipe.save(tmp_path / "ckpt")
        before = pipe.state_dict()
        if where == "interrupt":

            def send_layers(*args: Any, **kwargs: Any) -> Any:
                raise _Interrupted()  # as the stream to one stage begins

            monkeypatch.setattr(streaming.bulk_layers, "send_layers", send_layers)
            expected: type[BaseException] = _Interrupted
        else:

            def pack(state: Any) -> Any:
                raise OSError(f"the checkpoint's disk is gone (reading {len(state)} keys)")

            monkeypatch.setattr(streaming.layer_state, "pack", pack)
            expected = OSError
        with pytest.raises(expected) as raised:
            pipe.load(tmp_path / "ckpt")
        if where == "unreadable":
            assert "disk is gone" in str(raised.value)
        monkeypatch.undo()
        assert _status(coordinator_server.address).history[-1].kind == "abandoned"
        started = time.monotonic()
        assert pipe.train_step(x, y) > 0
        assert time.monotonic() - started < 10.0  # not a freeze's lease (600 s) later
        assert pipe.step == 2 and before.keys() == pipe.state_dict().keys()


def test_a_load_that_ran_past_its_lease_says_so(
    coordinator_server: CoordinatorServer,
    stage_servers: list[StageServer],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """A load whose commit comes after its lease ran out was abandoned by the coordinator:
    ``load`` raises DeadlineExceeded saying so, instead of streaming it again, and
    training goes on."""
    monkeypatch.setattr(loads, "RESTORE_LEASE_S", 1.0)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    with _pipeline(coordinator_server.address) as pipe:
        pipe.train_step(x, y)
        pipe.save(tmp_path / "ckpt")
        real_end = pipe._end_restore

        def slow_end(job_id: str, epoch: int, step: int, commit: bool) -> Any:
            if commit:
                time.sleep(2.5)  # past the lease: the coordinator abandons the load
            return real_end(job_id, epoch, step, commit)

        monkeypatch.setattr(pipe, "_end_restore", slow_end)
        with pytest.raises(DeadlineExceeded, match=r"abandoned: it ran past its 1 s lease"):
            pipe.load(tmp_path / "ckpt")
        kinds = [r.kind for r in _status(coordinator_server.address).history]
        assert kinds.count("abandoned") == 1 and "restore" not in kinds
        assert pipe.train_step(x, y) > 0
