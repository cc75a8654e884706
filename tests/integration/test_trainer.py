"""LR schedules, global-norm clipping, recomputation and wire dtypes through real stages
equal the same features in plain PyTorch, across live migrations and lost commits."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler

from elasticpipe import models
from elasticpipe.client.pipeline import Pipeline
from elasticpipe.errors import InvalidRequest
from elasticpipe.local.cluster import LocalCluster
from elasticpipe.training.objectives import loss_fn, make_optimizer
from elasticpipe.v1 import stage_pb2
from elasticpipe.wire import compress
from tests.support.clusters import quiet, revive, set_partition
from tests.support.faults import FaultPlan
from tests.support.numerics import stage_threads
from tests.support.scenario import arm

KWARGS = {"sizes": [12, 24, 24, 24, 6]}  # 7 layers
GPT = {"vocab_size": 17, "d_model": 16, "n_heads": 2, "n_layers": 3, "max_seq_len": 8}
ADAM = {"lr": 2e-2}
MAX_NORM = 0.5
WARMUP = 3


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """Three stages that accept injected faults; layers move only when told."""
    with quiet(3, fault_injection=True, metrics=True) as c:
        yield c


def _batch(step: int, model: str = "mlp") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    if model == "gpt":
        tokens = torch.randint(0, 17, (6, 8), generator=g)
        return tokens, torch.roll(tokens, -1, dims=1)
    return torch.randn(10, 12, generator=g) * 3, torch.randint(0, 6, (10,), generator=g)


class Reference:
    """Plain PyTorch: one optimizer over the whole model, its scheduler, clip_grad_norm_."""

    def __init__(self, make_scheduler: Callable[[torch.optim.Optimizer], Any] | None) -> None:
        self.model = models.build("mlp", seed=4, **KWARGS)
        self.opt = make_optimizer("adam", self.model.parameters(), ADAM)
        self.sched = make_scheduler(self.opt) if make_scheduler else None

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, float]:
        """Returns (loss, norm before clipping, lr applied); runs under a stage's thread
        count."""
        with stage_threads():
            self.opt.zero_grad(set_to_none=True)
            loss = loss_fn("cross_entropy")(self.model(x), y)
            loss.backward()
            norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_NORM))
            lr = float(self.opt.param_groups[0]["lr"])
            self.opt.step()
        if self.sched is not None:
            self.sched.step()
        return float(loss.detach()), norm, lr


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
    }
    options.update(kwargs)
    return Pipeline(coordinator=cluster.coordinator, **options)


def _warmup_cosine(opt: torch.optim.Optimizer) -> Any:
    return lr_scheduler.SequentialLR(
        opt,
        [
            lr_scheduler.LinearLR(opt, start_factor=1 / WARMUP, total_iters=WARMUP - 1),
            lr_scheduler.CosineAnnealingLR(opt, T_max=6, eta_min=1e-3),
        ],
        milestones=[WARMUP],
    )


SCHEDULES: dict[str, tuple[dict[str, Any], Callable[[torch.optim.Optimizer], Any]]] = {
    "warmup+cosine": (
        {
            "scheduler": "CosineAnnealingLR",
            "scheduler_kwargs": {"T_max": 6, "eta_min": 1e-3},
            "warmup_steps": WARMUP,
        },
        _warmup_cosine,
    ),
    "onecycle": (
        {"scheduler": "OneCycleLR", "scheduler_kwargs": {"max_lr": 0.05, "total_steps": 12}},
        lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=12),
    ),
    "sequential-step": (
        {
            "scheduler": "SequentialLR",
            "scheduler_kwargs": {
                "schedulers": [
                    {"name": "LinearLR", "kwargs": {"start_factor": 0.2, "total_iters": 2}},
                    {"name": "StepLR", "kwargs": {"step_size": 2, "gamma": 0.5}},
                ],
                "milestones": [2],
            },
        },
        lambda opt: lr_scheduler.SequentialLR(
            opt,
            [
                lr_scheduler.LinearLR(opt, start_factor=0.2, total_iters=2),
                lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
            ],
            milestones=[2],
        ),
    ),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("name", "pipeline_schedule"),
    [(name, "1f1b") for name in sorted(SCHEDULES)] + [("warmup+cosine", "zb-h1")],
)
def test_schedule_and_clipping_equal_pytorch_across_migrations(
    cluster: LocalCluster, name: str, pipeline_schedule: str
) -> None:
    """Every step's lr on every stage is the scheduler's own, the reported norm is
    clip_grad_norm_'s, and the weights equal plain PyTorch after two live migrations; with
    ZB-H1 too, whose norm is reported after every W (a second reader's case)."""
    options, make = SCHEDULES[name]
    reference = Reference(make)
    clipped = 0
    with _pipeline(cluster, max_grad_norm=MAX_NORM, schedule=pipeline_schedule, **options) as pipe:
        for step in range(1, 9):
            x, y = _batch(step)
            got = pipe.train_step(x, y)
            want, norm, lr = reference.step(x, y)
            assert got == pytest.approx(want, rel=1e-5), f"loss of step {step}"
            assert pipe.last_step.grad_norm == pytest.approx(norm, rel=1e-5), f"step {step}"
            lrs = [s.lr for s in pipe.last_step.stages]
            assert lrs == pytest.approx([lr] * 3, rel=1e-12), f"lr of step {step}"
            clipped += norm > MAX_NORM
            if step == 2:  # every stage keeps a layer with parameters (a reported lr)
                set_partition(cluster, [0, 1, 3, 7])
            if step == 5:
                set_partition(cluster, [0, 3, 5, 7])
        assert list(pipe.partition.boundaries) == [0, 3, 5, 7]  # the layers did move
        state = pipe.state_dict()
    assert clipped >= 4, "the test must clip for real"
    for key, value in reference.model.state_dict().items():
        torch.testing.assert_close(state[key], value, msg=f"parameter {key}")


@pytest.mark.timeout(180)
def test_a_lost_commit_replays_the_same_clip(cluster: LocalCluster) -> None:
    """A stage that lost its CommitStep applies the decision carried by the next RunStep,
    clip coefficient included: the weights still equal clip_grad_norm_ training."""
    reference = Reference(None)
    with _pipeline(cluster, max_grad_norm=MAX_NORM) as pipe:
        for step in range(1, 6):
            if step == 3:
                arm(pipe.partition.addresses[1], stage_pb2.DROP_NEXT_COMMIT)
            x, y = _batch(step)
            pipe.train_step(x, y)
            _, norm, _ = reference.step(x, y)
            assert norm > MAX_NORM
        state = pipe.state_dict()
    for key, value in reference.model.state_dict().items():
        torch.testing.assert_close(state[key], value, msg=f"parameter {key}")


@pytest.mark.timeout(180)
def test_a_non_finite_norm_skips_the_step_everywhere(cluster: LocalCluster) -> None:
    """An inf input gives a nan gradient norm: no stage changes its weights, the step
    still counts, and the next step trains normally."""
    with _pipeline(cluster, max_grad_norm=MAX_NORM) as pipe:
        pipe.train_step(*_batch(1))
        before = pipe.state_dict()
        x, y = _batch(2)
        x[0, 0] = math.inf
        pipe.train_step(x, y)
        assert pipe.last_step.grad_norm is not None and not math.isfinite(pipe.last_step.grad_norm)
        assert pipe.step == 2
        after = pipe.state_dict()
        for key, value in before.items():
            assert torch.equal(after[key], value), key
        pipe.train_step(*_batch(3))
        assert math.isfinite(pipe.last_step.loss)
        assert not torch.equal(pipe.state_dict()["0.weight"], before["0.weight"])


@pytest.mark.timeout(180)
def test_a_checkpoint_resumes_the_schedule(cluster: LocalCluster, tmp_path: Path) -> None:
    """Loading a checkpoint restores each layer's scheduler: the steps after it use the
    learning rates they used the first time."""
    options, _ = SCHEDULES["onecycle"]
    with _pipeline(cluster, **options) as pipe:
        for step in range(1, 4):
            pipe.train_step(*_batch(step))
        pipe.save(tmp_path / "ckpt")
        first = []
        for step in range(4, 7):
            pipe.train_step(*_batch(step))
            first.append([s.lr for s in pipe.last_step.stages])
        pipe.load(tmp_path / "ckpt")
        again = []
        for step in range(4, 7):
            pipe.train_step(*_batch(step))
            again.append([s.lr for s in pipe.last_step.stages])
    assert again == first
    assert len({lr for lrs in first for lr in lrs}) == 3  # it did change


@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_recompute_is_exact_and_stashes_less(
    cluster: LocalCluster, model: str, schedule: str
) -> None:
    """recompute=True and recompute=[some layers] train to exactly the weights of
    recompute=False, and the peak stashed bytes drop, on the same partition."""
    kwargs = GPT if model == "gpt" else KWARGS
    results = {}
    for recompute in (False, True, [1, 2]):
        with _pipeline(
            cluster, model=model, model_kwargs=kwargs, schedule=schedule, recompute=recompute
        ) as pipe:
            for step in range(1, 4):
                pipe.train_step(*_batch(step, model))
                if step == 1:
                    # Pinned once the first step profiled the job (its plan follows measured
                    # speeds): what a stage stashes depends on where the cuts are.
                    set_partition(cluster, [0, 1, 3, pipe.partition.boundaries[-1]])
            assert list(pipe.partition.boundaries)[:3] == [0, 1, 3]
            stashed = sum(s.peak_stashed_bytes for s in pipe.last_step.stages)
            results[str(recompute)] = (pipe.state_dict(), stashed)
    plain, plain_bytes = results["False"]
    for key in ("True", "[1, 2]"):
        state, stashed = results[key]
        for name, value in plain.items():
            assert torch.equal(state[name], value), f"{name} with recompute={key}"
        assert stashed < plain_bytes, f"recompute={key}: {stashed} >= {plain_bytes}"
    if schedule != "zb-h1":  # there B rebuilds every recomputed graph, which W then needs
        assert results["True"][1] <= results["[1, 2]"][1]


def _with_cuts(model: nn.Sequential, boundaries: list[int], wire_dtype: str) -> nn.Module:
    """The local reference: the model with the wire's rounding at each cut."""

    class Cut(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return compress.cast(x, wire_dtype)

    layers: list[nn.Module] = []
    for i, layer in enumerate(model):
        if i in boundaries[1:-1]:
            layers.append(Cut())
        layers.append(layer)
    return nn.Sequential(*layers)


def _sent_bytes(cluster: LocalCluster) -> float:
    import urllib.request

    total = 0.0
    for name in [n for n in cluster.metrics_ports if n.startswith("stage")]:
        with urllib.request.urlopen(cluster.metrics_url(name), timeout=10) as reply:
            for line in reply.read().decode().splitlines():
                if line.startswith("elasticpipe_stage_sent_bytes_total{"):
                    total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.numerics
@pytest.mark.timeout(180)
@pytest.mark.parametrize("wire_dtype", ["bf16", "fp16"])
def test_wire_dtype_equals_the_same_cast_done_locally(
    cluster: LocalCluster, wire_dtype: str
) -> None:
    """Activations and gradients rounded to the wire dtype at the cuts: the weights equal
    a local model with that rounding at the same cut points, forward and backward, and
    half the bytes cross the wire."""
    with _pipeline(cluster, wire_dtype=wire_dtype) as pipe:
        sent = _sent_bytes(cluster)
        x, y = _batch(1)
        pipe.train_step(x, y)
        half = _sent_bytes(cluster) - sent
        boundaries = list(pipe.partition.boundaries)
        reference = _with_cuts(models.build("mlp", seed=4, **KWARGS), boundaries, wire_dtype)
        plain = models.build("mlp", seed=4, **KWARGS)
        opt = make_optimizer("adam", reference.parameters(), ADAM)
        plain_opt = make_optimizer("adam", plain.parameters(), ADAM)
        for step in range(1, 5):
            x, y = _batch(step)
            if step > 1:
                pipe.train_step(x, y)
            for m, o in ((reference, opt), (plain, plain_opt)):
                with stage_threads():
                    o.zero_grad()
                    loss_fn("cross_entropy")(m(x), y).backward()
                    o.step()
        state = pipe.state_dict()
    assert list(pipe.partition.boundaries) == boundaries
    want = {k: v for k, v in zip(plain.state_dict(), reference.state_dict().values(), strict=True)}
    for key, value in want.items():
        torch.testing.assert_close(state[key], value, msg=f"parameter {key}")
    assert any(not torch.equal(want[k], v) for k, v in plain.state_dict().items())
    with _pipeline(cluster) as full_pipe:
        sent = _sent_bytes(cluster)
        full_pipe.train_step(*_batch(1))
        full = _sent_bytes(cluster) - sent
    assert half == pytest.approx(full / 2, rel=0.01)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"scheduler": "LambdaLR"}, "unknown scheduler 'LambdaLR'"),
        ({"scheduler": "StepLR", "scheduler_kwargs": {"step": 2}}, "rejected {'step': 2}"),
        ({"scheduler_kwargs": {"T_max": 2}}, "without a scheduler"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"max_grad_norm": -1.0}, "max_grad_norm"),
        ({"recompute": "yes"}, "recompute must be"),
        ({"wire_dtype": "int8"}, "unknown wire_dtype 'int8'"),
    ],
)
def test_bad_options_are_refused_before_anything_starts(
    options: dict[str, Any], message: str
) -> None:
    """Each bad option is an InvalidRequest naming the value, raised by the constructor."""
    with pytest.raises(InvalidRequest, match=message.replace("[", r"\[").replace("{", r"\{")):
        Pipeline(coordinator="127.0.0.1:1", model="mlp", **options)


@pytest.mark.timeout(30)
def test_an_impossible_clip_coefficient_is_invalid_argument(cluster: LocalCluster) -> None:
    """A CommitStep whose clip coefficient no decision produces is refused, naming it,
    and the stage keeps serving."""
    import grpc

    from elasticpipe.v1 import stage_pb2_grpc

    address = cluster.status().stages[0].address
    stub = stage_pb2_grpc.StageServiceStub(grpc.insecure_channel(address))
    request = stage_pb2.CommitStepRequest(run=1, step=1, clip=stage_pb2.GradClip(coef=2.0))
    with pytest.raises(grpc.RpcError) as refused:
        stub.CommitStep(request, timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "2.0" in (refused.value.details() or "")
    assert stub.GetStats(stage_pb2.StatsRequest(), timeout=10).name


@pytest.mark.timeout(180)
def test_a_recovery_replays_the_same_clip(cluster: LocalCluster) -> None:
    """The middle stage dies inside its commit of a clipped step: the chain rolls back to
    the last snapshot, the client replays, and every replayed step clips exactly as
    clip_grad_norm_ does (this test kills a stage: it runs last and revives it)."""
    reference = Reference(None)
    plan = FaultPlan().at(step=5).pause(stage=1, point="commit").then_kill()
    recovered = 0
    with _pipeline(cluster, max_grad_norm=MAX_NORM) as pipe:
        before = plan.hook(cluster, pipe)
        for step in range(1, 7):
            before(step)
            x, y = _batch(step)
            pipe.train_step(x, y)
            _, norm, _ = reference.step(x, y)
            assert norm > MAX_NORM
            assert pipe.last_step.grad_norm == pytest.approx(norm, rel=1e-5)
            recovered += pipe.last_step.attempts > 1 or pipe.last_step.replayed > 0
        assert recovered, "a recovery must have replayed the step"
        assert pipe.last_step.step == 6
        state = pipe.state_dict()
    for key, value in reference.model.state_dict().items():
        torch.testing.assert_close(state[key], value, msg=f"parameter {key}")
    revive(cluster, *plan.killed)
