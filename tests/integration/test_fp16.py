"""precision="fp16" through real stage processes equals plain PyTorch autocast + GradScaler
on the whole model: same skipped steps, same loss scale at every step, close losses and
weights, across live migrations, lost commits and a checkpoint round trip."""

from __future__ import annotations

import itertools
import json
import math
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from elasticpipe.client.pipeline import Pipeline
from elasticpipe.errors import InvalidRequest
from elasticpipe.local.cluster import LocalCluster
from elasticpipe.v1 import stage_pb2
from tests.support.clusters import quiet, revive, set_partition
from tests.support.faults import FaultPlan
from tests.support.fp16_reference import Fp16Reference
from tests.support.scenario import arm

KWARGS = {"sizes": [12, 24, 24, 24, 6]}  # 7 layers
ADAM = {"lr": 2e-2}
# 2**40 overflows float16 gradients: the first steps are skipped while the scale backs off
# by 2**-8; then it grows x16 every 3 clean steps, until it overflows again (step 7).
SCALER = {
    "init_scale": 2.0**40,
    "backoff_factor": 2.0**-8,
    "growth_factor": 16.0,
    "growth_interval": 3,
}
# The stages run the same ops in the same order as the whole model, and the reference runs
# under a stage's thread count with the same kernels (tests.support.numerics; measured: every loss
# bit-identical). The tolerance admits a few float32 units in the last place (1.2e-7
# relative each), should a kernel still add in another order. The reported norm sums in float64,
# clip_grad_norm_ in float32 (measured ~3e-8 relative). Scales and skips are compared
# exactly; weights at float32's default tolerance.
RTOL = 1e-6


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """Three stages that accept injected faults; layers move only when told."""
    with quiet(3, fault_injection=True) as c:
        yield c


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(10, 12, generator=g) * 3, torch.randint(0, 6, (10,), generator=g)


def _pipeline(cluster: LocalCluster, **kwargs: Any) -> Pipeline:
    options: dict[str, Any] = {
        "model": "mlp",
        "model_kwargs": KWARGS,
        "seed": 4,
        "optimizer": "adam",
        "optimizer_kwargs": ADAM,
        "micro_batches": 3,
        "stages": 3,
        "snapshot_every": 2,
        "precision": "fp16",
        "grad_scaler_kwargs": SCALER,
    }
    options.update(kwargs)
    return Pipeline(coordinator=cluster.coordinator, **options)


def _skipped(pipe: Pipeline) -> bool:
    norm = pipe.last_step.grad_norm
    assert norm is not None, "fp16 always reports the global norm"
    return not math.isfinite(norm)


@pytest.mark.numerics
@pytest.mark.timeout(240)
@pytest.mark.parametrize("max_norm", [None, 0.5])
def test_fp16_equals_grad_scaler_across_migrations(
    cluster: LocalCluster, max_norm: float | None
) -> None:
    """Every step: the same scale as GradScaler on every stage, the same skip, the loss
    close; two live migrations move layers (and their copies of the scale) mid-training;
    a lost commit of a skipped step still backs the scale off on its stage. With
    ``max_grad_norm`` the reported norm is clip_grad_norm_'s of the unscaled gradients."""
    reference = Fp16Reference("mlp", KWARGS, 4, ADAM, 3, SCALER, max_norm)
    skipped, scales = [], []
    with _pipeline(cluster, max_grad_norm=max_norm or 0.0) as pipe:
        for step in range(1, 12):
            if step in (1, 4):  # a skipped step's commit, then a clean one's, lost
                arm(pipe.partition.addresses[1], stage_pb2.DROP_NEXT_COMMIT)
            x, y = _batch(step)
            got = pipe.train_step(x, y)
            want, scale, skip, norm = reference.step(x, y)
            assert got == pytest.approx(want, rel=RTOL), f"loss of step {step}"
            assert pipe.last_step.loss_scale == scale, f"scale of step {step}"
            assert [r.loss_scale for r in pipe.last_step.reports] == [scale] * 3, step
            assert _skipped(pipe) == skip, f"skip of step {step}"
            if norm is not None and not skip:
                assert pipe.last_step.grad_norm == pytest.approx(norm, rel=RTOL), step
            skipped.append(skip)
            scales.append(scale)
            if step == 2:
                set_partition(cluster, [0, 1, 3, 7])
            if step == 5:
                set_partition(cluster, [0, 3, 5, 7])
        assert list(pipe.partition.boundaries) == [0, 3, 5, 7]  # the layers did move
        state = pipe.state_dict()
    assert skipped[:3] == [True] * 3 and any(skipped[3:]) and not all(skipped[3:])
    assert any(b > a for a, b in itertools.pairwise(scales)), "it must grow too"
    for key, value in reference.model.state_dict().items():
        torch.testing.assert_close(state[key], value, msg=key)  # float32 tolerance


@pytest.mark.numerics
@pytest.mark.timeout(180)
@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_fp16_gpt_on_two_stages_equals_grad_scaler(cluster: LocalCluster, schedule: str) -> None:
    """A small GPT (embeddings, layer norms, attention under float16 autocast) on 2 stages
    with GPipe and ZB-H1 (weight gradients after the input's): the same skips and scales as
    GradScaler, losses equal, weights within float32 tolerance (the embedding's gradient may
    add in another order)."""
    gpt = {"vocab_size": 17, "d_model": 16, "n_heads": 2, "n_layers": 3, "max_seq_len": 8}
    reference = Fp16Reference("gpt", gpt, 4, ADAM, 3, SCALER)
    g = torch.Generator().manual_seed(3)
    skipped = []
    with _pipeline(cluster, model="gpt", model_kwargs=gpt, stages=2, schedule=schedule) as pipe:
        for step in range(1, 10):
            x = torch.randint(0, 17, (7, 8), generator=g)
            y = torch.roll(x, -1, dims=1)
            got = pipe.train_step(x, y)
            want, scale, skip, _ = reference.step(x, y)
            assert got == pytest.approx(want, rel=RTOL), f"loss of step {step}"
            assert (pipe.last_step.loss_scale, _skipped(pipe)) == (scale, skip), step
            skipped.append(skip)
        assert len(pipe.partition.addresses) == 2
        state = pipe.state_dict()
    assert any(skipped) and not all(skipped)
    for key, value in reference.model.state_dict().items():
        torch.testing.assert_close(state[key], value, msg=key)


@pytest.mark.timeout(180)
def test_a_checkpoint_restores_the_scale(cluster: LocalCluster, tmp_path: Path) -> None:
    """Saved mid-way through a growth interval, loaded later: the steps after it use the
    scales (and skip the steps) they did the first time; the manifest holds the scale."""
    with _pipeline(cluster) as pipe:
        for step in range(1, 6):
            pipe.train_step(*_batch(step))
        pipe.save(tmp_path / "ckpt")
        first = []
        for step in range(6, 10):
            loss = pipe.train_step(*_batch(step))
            first.append((loss, pipe.last_step.loss_scale, _skipped(pipe)))
        pipe.load(tmp_path / "ckpt")
        again = []
        for step in range(6, 10):
            loss = pipe.train_step(*_batch(step))
            again.append((loss, pipe.last_step.loss_scale, _skipped(pipe)))
        # A manifest whose layers disagree on the scale is refused, naming it; nothing lost.
        shutil.copytree(tmp_path / "ckpt", tmp_path / "bad")
        manifest = json.loads((tmp_path / "bad" / "manifest.json").read_text())
        manifest["loss_scales"]["3"]["scale"] = 8.0
        (tmp_path / "bad" / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(InvalidRequest, match="loss scales differ"):
            pipe.load(tmp_path / "bad")
        assert pipe.step == 9
        pipe.train_step(*_batch(10))
    assert again == first
    assert len({scale for _, scale, _ in first}) > 1  # it did change after the save
    manifest = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())
    assert set(manifest["loss_scales"]) == {str(i) for i in range(7)}
    assert manifest["loss_scales"]["0"] == {"scale": 65536.0, "growth_tracker": 2}


@pytest.mark.timeout(180)
def test_a_resumed_client_finds_the_scale(cluster: LocalCluster) -> None:
    """The scale lives on the stages, not in the client: a new client that resumes the job
    in the middle of a growth interval goes on with GradScaler's scales and skips."""
    reference = Fp16Reference("mlp", KWARGS, 4, ADAM, 3, SCALER)
    with _pipeline(cluster) as pipe:
        for step in range(1, 6):
            pipe.train_step(*_batch(step))
            reference.step(*_batch(step))
    with _pipeline(cluster, resume=True) as pipe:
        assert pipe.step == 5
        for step in range(6, 10):
            got = pipe.train_step(*_batch(step))
            want, scale, skip, _ = reference.step(*_batch(step))
            assert got == pytest.approx(want, rel=RTOL), f"loss of step {step}"
            assert (pipe.last_step.loss_scale, _skipped(pipe)) == (scale, skip), step


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"grad_scaler_kwargs": {"growth_intervl": 3}}, "unknown grad_scaler_kwargs key"),
        ({"grad_scaler_kwargs": {"backoff_factor": 0.0}}, r"\['backoff_factor'\]"),
        ({"grad_scaler_kwargs": {"init_scale": 8.0}, "precision": "bf16"}, "need precision"),
        ({"grad_scaler_kwargs": "2**16"}, "must be a dict"),
    ],
)
def test_bad_grad_scaler_kwargs_are_refused_before_anything_starts(
    options: dict[str, Any], message: str
) -> None:
    """Each bad value is an InvalidRequest naming it, raised by the constructor."""
    with pytest.raises(InvalidRequest, match=message):
        Pipeline(coordinator="127.0.0.1:1", model="mlp", **{"precision": "fp16", **options})


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("precision", "kwargs_json", "named"),
    [
        ("fp16", '{"growth_factor": 0.5}', "growth_factor"),
        ("fp16", '{"init_scale": "big"}', "init_scale"),
        ("fp16", "[1, 2]", "grad_scaler_kwargs must be a JSON object"),
        ("bf16", '{"init_scale": 8}', "need precision='fp16'"),
    ],
)
def test_a_stage_refuses_bad_grad_scaler_kwargs_on_the_wire(
    cluster: LocalCluster, precision: str, kwargs_json: str, named: str
) -> None:
    """A job description whose GradScaler arguments no client would send gets
    INVALID_ARGUMENT naming the value, and the stage keeps serving."""
    import grpc

    from elasticpipe.training.job import JobConfig
    from elasticpipe.v1 import stage_pb2_grpc

    address = cluster.status().stages[0].address
    stub = stage_pb2_grpc.StageServiceStub(grpc.insecure_channel(address))
    spec = JobConfig(model="mlp", model_kwargs=KWARGS).to_proto()
    spec.precision = precision
    spec.grad_scaler_kwargs_json = kwargs_json
    with pytest.raises(grpc.RpcError) as refused:
        stub.Describe(stage_pb2.DescribeRequest(job=spec), timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in (refused.value.details() or "")
    assert stub.GetStats(stage_pb2.StatsRequest(), timeout=10).name


@pytest.mark.timeout(180)
def test_a_recovery_rolls_the_scale_back_and_replays_it(cluster: LocalCluster) -> None:
    """The middle stage dies inside its commit of the step that overflows after growing:
    the chain rolls back to the last snapshot (scale included), the client replays, and
    every step still skips and scales as GradScaler does (this test kills a stage: it
    runs last and revives it)."""
    reference = Fp16Reference("mlp", KWARGS, 4, ADAM, 3, SCALER)
    plan = FaultPlan().at(step=7).pause(stage=1, point="commit").then_kill()
    recovered = 0
    with _pipeline(cluster) as pipe:
        before = plan.hook(cluster, pipe)
        for step in range(1, 10):
            before(step)
            x, y = _batch(step)
            got = pipe.train_step(x, y)
            want, scale, skip, _ = reference.step(x, y)
            assert got == pytest.approx(want, rel=RTOL), f"loss of step {step}"
            assert pipe.last_step.loss_scale == scale, f"scale of step {step}"
            assert _skipped(pipe) == skip, f"skip of step {step}"
            recovered += pipe.last_step.attempts > 1 or pipe.last_step.replayed > 0
        assert recovered, "a recovery must have replayed the step"
        state = pipe.state_dict()
    for key, value in reference.model.state_dict().items():
        torch.testing.assert_close(state[key], value, msg=key)
    revive(cluster, *plan.killed)
