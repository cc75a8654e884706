"""Heterogeneous stages get the partition the planner computes from their own measurements."""

from __future__ import annotations

import ast
import itertools
import re
import statistics
import time

import pytest
import torch

from elasticpipe.client.admin import PlanReport
from elasticpipe.client.pipeline import Pipeline
from elasticpipe.coordinator.planning import plan
from elasticpipe.local.cluster import LocalCluster

SIZES = [512] * 9  # 8 equal Linear layers, 7 ReLUs: 15 layers


@pytest.mark.timeout(300)
def test_a_2x_slower_host_gets_the_planned_share_and_is_measured_2x_slower() -> None:
    """With --slowdown 2, 1 the job starts on the planner's partition for the profiled
    speeds (the slow stage holds less work), the live speeds the stages report are within
    25% of 0.5:1, and on those live reports the partition in force is within 25% of the
    step time of the best one the planner finds.

    Two stages, not three, and micro-batches of 128 rows: two cores run three stage
    processes unevenly (two of them shared a core for a whole run), and a tiny layer's CPU
    time is much of it reloading caches another process evicted; with three stages two
    equally fast ones measured up to 40% apart for a whole run. Unbound (``bind_cpus``):
    bound, each stage measures only its own core, and in one full-suite run the slow stage's
    reports halved midway while the fast one's did not (ratio 0.29); unbound, both sample
    both cores."""
    with (
        LocalCluster(
            stages=2,
            slowdowns=[2.0, 1.0],
            state=":memory:",
            auto_rebalance=False,
            heartbeat_s=0.3,
            bind_cpus=False,
        ) as cluster,
        Pipeline(
            coordinator=cluster.coordinator,
            model="mlp",
            model_kwargs={"sizes": SIZES},
            optimizer="sgd",
            optimizer_kwargs={"lr": 0.01},
            loss="mse",
            micro_batches=4,
        ) as pipe,
    ):
        g = torch.Generator().manual_seed(0)

        def train(steps: int) -> None:
            for _ in range(steps):
                pipe.train_step(
                    torch.randn(512, 512, generator=g), torch.randn(512, 512, generator=g)
                )

        train(4)
        speeds: dict[str, list[float]] = {}
        with cluster.admin() as admin:
            # The measured speed of a stage: the median of its reports over several heartbeats
            # (a step whose caches another process evicted skews a mean).
            for _ in range(8):
                train(2)
                time.sleep(0.4)  # at least one heartbeat with the latest timings
                status = admin.status()
                for stage in status.stages:
                    speeds.setdefault(stage.name, []).append(stage.speed)
            view = admin.plan()
        boundaries = pipe.partition.boundaries
    median = {name: statistics.median(values) for name, values in speeds.items()}
    ratio = median["stage-0"] / median["stage-1"]
    assert 0.375 <= ratio <= 0.625, f"slow/fast speed {ratio:.3f} (reports {speeds})"
    # The slow host holds about half the work of the fast one.
    costs = list(view.layer_costs)
    work = {s.name: sum(costs[s.layer_lo : s.layer_hi]) for s in status.stages}
    assert work["stage-0"] < 0.75 * work["stage-1"], work
    # The view describes the partition the client runs, and the planner fed the live
    # reports finds nothing more than 25% faster.
    assert tuple(view.current.boundaries) == tuple(boundaries), (view.current, boundaries)
    # Each stage's speed swung by its spread over its last heartbeats: shown, and small
    # enough on a quiet cluster to plan by.
    assert len(view.stage_speed_spreads) == 2, view
    assert all(0.0 <= s < 1.0 for s in view.stage_speed_spreads), view.stage_speed_spreads
    best = plan(costs, list(view.stage_speeds))
    assert view.current_step_s <= view.optimal_step_s * 1.25, (
        f"current {boundaries} {view.current_step_s:.4f}s vs optimal {best.boundaries} "
        f"{view.optimal_step_s:.4f}s"
    )


@pytest.mark.timeout(120)
def test_stages_sharing_a_host_and_device_are_profiled_once_and_scaled_by_their_slowdown() -> None:
    """Three CPU stages on one host, the middle one --slowdown 3: the first profiles the
    model, the other two take its figures (the coordinator logs who shares whose), and the
    profiled speeds are exactly 3 : 1 : 3, where three profiles taken in turn would differ
    by whatever the host was doing meanwhile."""
    with (
        LocalCluster(stages=3, slowdowns=[1.0, 3.0, 1.0], auto_rebalance=False) as cluster,
        Pipeline(
            coordinator=cluster.coordinator,
            model="mlp",
            model_kwargs={"sizes": [64] * 5},
            optimizer="sgd",
            micro_batches=2,
        ) as pipe,
    ):
        pipe.train_step(torch.randn(8, 64), torch.randint(0, 64, (8,)))
        log = (cluster.log_dir / "coordinator.log").read_text(errors="replace")
    line = next(ln for ln in log.splitlines() if "stages_profiled" in ln)
    fields = dict(re.findall(r"(\w+)=(\{[^}]*\}|\S+)", line))
    assert fields["profiled"] == "1", line
    shared = ast.literal_eval(fields["shared"])  # the stages that took another's figures
    assert len(shared) == 2 and len(set(shared.values())) == 1, line
    assert ast.literal_eval(fields["speeds"]) == {"stage-0": 3.0, "stage-1": 1.0, "stage-2": 3.0}


@pytest.mark.timeout(120)
def test_the_planner_learns_what_a_step_pays_outside_its_pipelines() -> None:
    """Two stages train an MLP with Adam: their heartbeats bring the optimizer steps' rate
    and the wait between runs, and ``admin plan`` then shows the figure per step learned
    (the smallest wait less the optimizer steps: below the step itself) and the rate, and
    prices each candidate layout's part outside the pipelines as that figure plus its
    busiest stage's bytes at that rate. A second job, of a smaller model, is planned with
    the first job's figures (kept across jobs) and its own model's bytes."""
    sizes = [256] * 5  # 4 Linear layers of 256 x 256 (+ bias), 3 ReLUs
    layer_bytes = [(256 * 256 + 256) * 4 if i % 2 == 0 else 0 for i in range(7)]
    with LocalCluster(stages=2, state=":memory:", auto_rebalance=False, heartbeat_s=0.2) as cluster:
        job = {
            "coordinator": cluster.coordinator,
            "model": "mlp",
            "model_kwargs": {"sizes": sizes},
            "optimizer": "adam",
            "loss": "mse",
            "micro_batches": 2,
        }
        g = torch.Generator().manual_seed(0)
        with Pipeline(**job) as pipe, cluster.admin() as admin:  # type: ignore[arg-type]
            deadline = time.monotonic() + 60
            while True:  # steps back to back: the stages' waits are the median of their last 8
                steps = []
                for _ in range(10):
                    started = time.perf_counter()
                    pipe.train_step(
                        torch.randn(64, 256, generator=g), torch.randn(64, 256, generator=g)
                    )
                    steps.append(time.perf_counter() - started)
                time.sleep(0.3)  # (a heartbeat with the latest figures)
                view = admin.plan()
                if view.step_overhead_s and view.optimizer_bytes_per_s:
                    break
                assert time.monotonic() < deadline, view
        step_s = statistics.median(steps)
        assert 0 < view.step_overhead_s < step_s, (view.step_overhead_s, step_s)
        assert 1e6 < view.optimizer_bytes_per_s < 1e13, view.optimizer_bytes_per_s
        assert view.layouts, view
        _priced_per_step(view, layer_bytes)
        small = {**job, "model_kwargs": {"sizes": [128] * 5}}
        with Pipeline(**small) as second, cluster.admin() as admin:  # type: ignore[arg-type]
            second.train_step(torch.randn(64, 128, generator=g), torch.randn(64, 128, generator=g))
            now = admin.plan()  # (at once: before this job's waits could be learned)
        assert now.step_overhead_s == pytest.approx(view.step_overhead_s), (now, view)
        _priced_per_step(now, [(128 * 128 + 128) * 4 if i % 2 == 0 else 0 for i in range(7)])


def _priced_per_step(view: PlanReport, layer_bytes: list[int]) -> None:
    """Each candidate layout's part outside its pipelines: the learned figure per step plus
    its busiest stage's bytes (``layer_bytes`` per layer) at the learned optimizer rate."""
    for candidate in view.layouts:
        busiest = max(
            sum(layer_bytes[lo:hi])
            for replica in candidate.replicas
            for lo, hi in itertools.pairwise(replica.boundaries)
        )
        want = view.step_overhead_s + busiest / view.optimizer_bytes_per_s
        assert candidate.per_step_s == pytest.approx(want, rel=1e-6), candidate
