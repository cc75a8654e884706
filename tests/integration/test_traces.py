"""``admin trace`` on a live 4-stage 1F1B job: every op traced, clocks aligned, a PNG."""

from __future__ import annotations

import contextlib
import itertools
import json
import struct
import subprocess
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest
import torch

from elasticpipe.client.pipeline import Pipeline, StepStats
from elasticpipe.local.cluster import LocalCluster
from elasticpipe.training.schedule import stage_ops as schedule_ops
from elasticpipe.v1 import stage_pb2, stage_pb2_grpc
from tests.support import cli

STAGES, MICRO_BATCHES = 4, 4
TOLERANCE_US = 2000.0  # clock-offset error: half a loopback round trip, generously


_NUMBER = {"type": "number"}
SUMMARY_SCHEMA = {
    "type": "object",
    "required": ["stages", "steps", "out", "png"],
    "properties": {
        "stages": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["index", "name", "address", "layers", "spans", "truncated"],
                "properties": {
                    "index": {"type": "integer", "minimum": 0},
                    "name": {"type": "string"},
                    "address": {"type": "string"},
                    "layers": {"type": "array", "items": {"type": "integer"}, "minItems": 2},
                    "spans": {"type": "integer", "minimum": 0},
                    "truncated": {"type": "boolean"},
                    "clock_offset_ms": _NUMBER,
                    "clock_rtt_ms": {"type": "number", "minimum": 0},
                },
            },
        },
        "steps": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["step", "ideal_s", "measured_s", "efficiency"],
                "properties": {
                    "step": {"type": "integer", "minimum": 1},
                    "ideal_s": {"type": "number", "exclusiveMinimum": 0},
                    "measured_s": {"type": "number", "exclusiveMinimum": 0},
                    "efficiency": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                },
            },
        },
        "out": {"type": "string"},
        "png": {"type": "string"},
    },
}


@contextlib.contextmanager
def _trained_and_traced(
    cluster: LocalCluster, stem: Path, sizes: list[int], **pipeline_kwargs: Any
) -> Iterator[tuple[StepStats, subprocess.CompletedProcess[str], Path, Path]]:
    """Two training steps of an MLP of ``sizes`` on ``cluster``, then ``admin trace`` of the
    last one into ``stem``.json and ``stem``.png; yields (the step's stats, the trace
    command, its JSON, its PNG) with the pipeline still open. The step's efficiency is
    checked to be in (0, 1] and the command to have succeeded."""
    with Pipeline(
        coordinator=cluster.coordinator,
        model="mlp",
        model_kwargs={"sizes": sizes},
        micro_batches=MICRO_BATCHES,
        **pipeline_kwargs,
    ) as pipe:
        g = torch.Generator().manual_seed(0)
        for _ in range(2):
            pipe.train_step(torch.randn(64, sizes[0], generator=g), torch.randint(0, 10, (64,)))
        stats = pipe.last_step
        assert 0 < stats.efficiency <= 1 and stats.ideal_s > 0
        out, png = stem.with_suffix(".json"), stem.with_suffix(".png")
        traced = cli.admin(cluster, "trace", "--steps", "1", "--out", str(out), "--png", str(png))
        assert traced.returncode == 0, traced.stderr
        yield stats, traced, out, png


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def _ops(events: list[dict[str, Any]]) -> dict[tuple[str, int, int], dict[str, Any]]:
    ops: dict[tuple[str, int, int], dict[str, Any]] = {}
    for e in events:
        if e.get("ph") == "X" and e["cat"] in ("F", "B"):
            key = (e["cat"], e["pid"], e["args"]["micro_batch"])
            assert key not in ops, f"{key} traced twice"
            ops[key] = e
    return ops


@pytest.mark.timeout(180)
def test_trace_of_a_1f1b_step_has_every_op_in_dependency_order(
    cluster4: LocalCluster, tmp_path: Path
) -> None:
    """Every (stage, micro-batch) has an F and a B event, a stage's ops never overlap,
    F(s, m) starts after F(s-1, m) ends and B(s, m) after B(s+1, m) once the clocks are
    corrected; the PNG is a real picture; efficiency is in (0, 1] everywhere it shows."""
    with _trained_and_traced(
        cluster4,
        tmp_path / "t",
        sizes=[32, 128, 128, 128, 128, 128, 128, 128, 10],
        schedule="1f1b",
        stages=STAGES,
        lease_s=1.5,  # renews (and reports the efficiency) every 0.5 s
    ) as (stats, traced, out, png):
        assert "pipeline efficiency" in str(stats)
        assert "pipeline efficiency" in traced.stdout

        deadline = time.monotonic() + 10
        while cluster4.status().efficiency_step != 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        status = cluster4.status()
        assert status.efficiency_step == 2 and 0 < status.efficiency <= 1
        table = cli.admin(cluster4, "status")
        assert "efficiency: " in table.stdout and "(step 2)" in table.stdout

    trace = json.loads(out.read_text())
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert sorted(names) == list(range(STAGES))
    assert all(name.startswith(f"stage {pid}: ") for pid, name in names.items())
    ops = _ops(events)
    assert set(ops) == {
        (kind, s, m) for kind in "FB" for s in range(STAGES) for m in range(MICRO_BATCHES)
    }
    assert {e["args"]["step"] for e in ops.values()} == {2}

    per_stage: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in ops.values():
        per_stage[e["pid"]].append(e)
    for s, stage_ops in per_stage.items():
        stage_ops.sort(key=lambda e: e["ts"])
        for a, b in itertools.pairwise(stage_ops):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, (
                f"stage {s}: {a['name']} overlaps {b['name']}"
            )
        order = [e["name"] for e in stage_ops]
        warmup = STAGES - s - 1  # 1F1B: the schedule the stage ran
        assert order[: warmup + 1] == [f"F{m}" for m in range(warmup + 1)], order
    for m in range(MICRO_BATCHES):
        for s in range(1, STAGES):
            prev, this = ops[("F", s - 1, m)], ops[("F", s, m)]
            assert this["ts"] >= prev["ts"] + prev["dur"] - TOLERANCE_US, (s, m)
            later, this = ops[("B", s, m)], ops[("B", s - 1, m)]
            assert this["ts"] >= later["ts"] + later["dur"] - TOLERANCE_US, (s, m)
    sends = [e for e in events if e.get("cat") == "send"]
    assert len(sends) == 2 * MICRO_BATCHES * (STAGES - 1)  # activations and gradients

    width, height = _png_size(png)
    assert (width, height) == (1200, 150 + 70 * STAGES)
    assert png.stat().st_size > 10_000

    summary = cli.admin(
        cluster4, "--json", "trace", "--steps", "1", "--out", str(tmp_path / "again.json")
    )
    assert summary.returncode == 0, summary.stderr
    doc = json.loads(summary.stdout)
    jsonschema.validate(doc, SUMMARY_SCHEMA)
    assert [s["index"] for s in doc["stages"]] == list(range(STAGES))
    assert [f["step"] for f in doc["steps"]] == [2]
    assert 0 < doc["steps"][0]["efficiency"] <= 1


@pytest.mark.timeout(180)
def test_a_zero_bubble_step_traces_b_and_w_in_the_schedule_order(
    cluster4: LocalCluster, tmp_path: Path
) -> None:
    """ZB-H1 on 3 stages: every stage traces F, B and W of every micro-batch in exactly its
    schedule's order, each W after its B; the reports carry W durations and the efficiency
    walks the split schedule; the timeline draws."""
    stages = 3
    with _trained_and_traced(
        cluster4,
        tmp_path / "zb",
        sizes=[32, 128, 128, 128, 128, 10],
        schedule="zb-h1",
        stages=stages,
    ) as (stats, _, out, png):
        for report in stats.reports:
            assert len(report.weight_s) == len(report.backward_s) == MICRO_BATCHES
            assert min(report.weight_s) > 0
        assert [r.peak_stashed for r in stats.reports] == [stages] * stages
    events = json.loads(out.read_text())["traceEvents"]
    ops = [e for e in events if e.get("ph") == "X" and e["cat"] in ("F", "B", "W")]
    by_stage: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in sorted(ops, key=lambda e: e["ts"]):
        by_stage[e["pid"]].append(e)
    for s in range(stages):
        want = [str(op) for op in schedule_ops("zb-h1", stages, s, MICRO_BATCHES)]
        assert [e["name"] for e in by_stage[s]] == want
    assert _png_size(png)[0] == 1200


@pytest.mark.timeout(60)
def test_get_trace_is_bounded_and_refuses_more_steps_than_kept(cluster4: LocalCluster) -> None:
    """Asking for more steps than a stage keeps is INVALID_ARGUMENT naming the bound; the
    clock-only request returns no spans."""
    address = cluster4.status().stages[0].address
    with grpc.insecure_channel(address) as channel:
        stub = stage_pb2_grpc.StageServiceStub(channel)
        clock = stub.GetTrace(stage_pb2.TraceRequest(steps=0), timeout=10)
        assert clock.now_ns > 0 and not clock.spans and clock.steps_kept >= 1
        with pytest.raises(grpc.RpcError) as info:
            stub.GetTrace(stage_pb2.TraceRequest(steps=clock.steps_kept + 1), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"steps must be in [0, {clock.steps_kept}]" in (info.value.details() or "")


@pytest.mark.timeout(60)
def test_trace_without_a_job_says_so(tmp_path: Path) -> None:
    """With no job running, ``admin trace`` exits 2 saying there is nothing to trace."""
    with LocalCluster(stages=1, coordinator_args=["--state", ":memory:"]) as cluster:
        result = cli.admin(cluster, "trace", "--out", str(tmp_path / "t.json"))
    assert result.returncode == 2
    assert "start a job before tracing it" in result.stderr
    assert not (tmp_path / "t.json").exists()


@pytest.mark.timeout(180)
def test_a_migration_shows_as_freeze_prepare_and_commit_on_every_stage(
    cluster4: LocalCluster, tmp_path: Path
) -> None:
    """After a set-partition between two steps, every stage's trace holds the optimizer
    steps of the commits and the freeze, prepare and commit of the new epoch, on its
    control track."""
    with Pipeline(
        coordinator=cluster4.coordinator,
        model="mlp",
        model_kwargs={"sizes": [16, 32, 32, 32, 32, 32, 32, 32, 4]},
        micro_batches=2,
        stages=STAGES,
    ) as pipe:
        pipe.train_step(torch.randn(8, 16), torch.randint(0, 4, (8,)))
        epoch = pipe.partition.epoch
        moved = cli.admin(cluster4, "set-partition", "0:1,1:2,2:3,3:15")
        assert moved.returncode == 0, moved.stderr
        pipe.train_step(torch.randn(8, 16), torch.randint(0, 4, (8,)))
        assert pipe.partition.epoch == epoch + 1
        out = tmp_path / "t.json"
        traced = cli.admin(cluster4, "trace", "--steps", "2", "--out", str(out))
        assert traced.returncode == 0, traced.stderr
    events = json.loads(out.read_text())["traceEvents"]
    for pid in range(STAGES):
        control = [e for e in events if e.get("ph") == "X" and e["pid"] == pid and e["tid"] == 2]
        names = [e["name"] for e in sorted(control, key=lambda e: e["ts"])]
        assert names == ["commit", "freeze", "prepare epoch", "commit epoch", "commit"], (
            pid,
            names,
        )
        assert {e["args"]["epoch"] for e in control if e["name"] != "commit"} == {epoch + 1}
        layers = {e["args"]["layers"] for e in events if e.get("cat") == "F" and e["pid"] == pid}
        assert len(layers) == 2, layers  # each stage's slice changed between the steps


@pytest.mark.timeout(180)
def test_a_predict_after_the_last_step_does_not_hide_it(
    cluster4: LocalCluster, tmp_path: Path
) -> None:
    """Two steps, then a predict (which runs under the last step's number): ``admin trace``
    still measures step 2 from its training run, lists the predict as an inference run
    after step 2, and its F/B events and PNG boxes are step 2's training ops only."""
    stages = 3
    with Pipeline(
        coordinator=cluster4.coordinator,
        model="mlp",
        model_kwargs={"sizes": [32, 64, 64, 64, 64, 10]},
        micro_batches=MICRO_BATCHES,
        stages=stages,
    ) as pipe:
        g = torch.Generator().manual_seed(0)
        for _ in range(2):
            pipe.train_step(torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,)))
        pipe.predict(torch.randn(16, 32, generator=g))
        out, png = tmp_path / "t.json", tmp_path / "t.png"
        traced = cli.admin(
            cluster4, "--json", "trace", "--steps", "1", "--out", str(out), "--png", str(png)
        )
    assert traced.returncode == 0, traced.stderr
    doc = json.loads(traced.stdout)
    jsonschema.validate(doc, SUMMARY_SCHEMA)
    assert [f["step"] for f in doc["steps"]] == [2]
    assert [r["after_step"] for r in doc["inference_runs"]] == [2]

    events = json.loads(out.read_text())["traceEvents"]
    ops = _ops(events)  # F/B of training runs: each (kind, stage, micro-batch) once
    assert set(ops) == {
        (kind, s, m) for kind in "FB" for s in range(stages) for m in range(MICRO_BATCHES)
    }
    assert {e["args"]["run"] for e in ops.values()} == {ops[("F", 0, 0)]["args"]["run"]}
    predicted = [e for e in events if e.get("ph") == "X" and e["cat"] == "inference"]
    forwards = {
        (e["pid"], e["args"]["micro_batch"]) for e in predicted if e["name"].startswith("predict F")
    }
    assert forwards == {(s, m) for s in range(stages) for m in range(MICRO_BATCHES)}
    assert {e["args"]["run"] for e in predicted} == {doc["inference_runs"][0]["run"]}
    assert {e["args"]["step"] for e in predicted} == {2}
    assert _png_size(png)[0] == 1200
