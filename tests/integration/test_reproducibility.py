"""Dropout is reproducible on any partition and across a migration (per-layer RNG seeding),
LocalPipeline is the single-process reference, and custom losses and optimizers go through
the stages' allow-list."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from elasticpipe import LocalPipeline, models
from elasticpipe.client.pipeline import Pipeline
from elasticpipe.errors import InvalidRequest, PermissionDenied
from elasticpipe.local.cluster import LocalCluster
from tests.support.clusters import failing, revive, set_partition
from tests.support.faults import FaultPlan
from tests.support.numerics import reference_step, stage_threads
from tests.support.reference import assert_exact

ALLOWED = "tests.support.custom_models"
DROPOUT = f"{ALLOWED}:dropout"
STEPS = 4
ADAM = {"lr": 1e-2}


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """Four stage processes (jobs use 2 or 3; the others are spares) that allow only the
    custom_models module and accept injected faults; moves on request."""
    with failing(4, allow_models=[ALLOWED]) as c:
        yield c


def _batches(n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        (torch.randn(9, 8, generator=g), torch.randint(0, 3, (9,), generator=g)) for _ in range(n)
    ]


def _local(seed: int = 5) -> tuple[list[float], dict[str, torch.Tensor]]:
    """LocalPipeline's losses and weights, trained under a stage's thread count."""
    with (
        stage_threads(),
        LocalPipeline(
            model=DROPOUT,
            seed=seed,
            optimizer="adam",
            optimizer_kwargs=ADAM,
            micro_batches=3,
            allow=[ALLOWED],
        ) as pipe,
    ):
        losses = [pipe.train_step(x, y) for x, y in _batches()]
        return losses, pipe.state_dict()


def _assert_same(
    got: tuple[list[float], dict[str, torch.Tensor]],
    want: tuple[list[float], dict[str, torch.Tensor]],
    what: str,
) -> None:
    torch.testing.assert_close(
        torch.tensor(got[0]), torch.tensor(want[0]), rtol=0, atol=0, msg=f"losses, {what}"
    )
    assert_exact(got[1], want[1], what)


@pytest.mark.numerics
@pytest.mark.timeout(240)
def test_dropout_trains_the_same_on_2_stages_on_3_with_a_migration_and_locally(
    cluster: LocalCluster,
) -> None:
    """A model with dropout 0.1: 2 stages, 3 stages with a live migration after step 2 (step
    3 retried on the new partition), and LocalPipeline give the same losses and weights, bit
    for bit; another seed gives other ones (dropout is really drawing)."""
    reference = _local()
    other_seed = _local(seed=6)
    assert other_seed[0][0] != reference[0][0]
    target: list[int] = []
    for stages in (2, 3):
        with Pipeline(
            coordinator=cluster.coordinator,
            model=DROPOUT,
            seed=5,
            optimizer="adam",
            optimizer_kwargs=ADAM,
            micro_batches=3,
            stages=stages,
        ) as pipe:
            losses = []
            for step, (x, y) in enumerate(_batches(), start=1):
                losses.append(pipe.train_step(x, y))
                if stages == 3 and step == 3:  # the first try ran on the old epoch
                    assert pipe.last_step.attempts > 1, pipe.last_step
                if stages == 3 and step == 2:  # a partition other than the planner's
                    before = list(pipe.partition.boundaries)
                    target = [0, 1, 5, 7] if before != [0, 1, 5, 7] else [0, 2, 4, 7]
                    assert set_partition(cluster, target).changed
            if stages == 3:
                assert list(pipe.partition.boundaries) == target
            _assert_same((losses, pipe.state_dict()), reference, f"{stages} stages")


@pytest.mark.timeout(180)
def test_rmsprop_by_torch_name_through_2_stages_equals_plain_pytorch(
    cluster: LocalCluster,
) -> None:
    """optimizer="RMSprop" (a torch.optim class by its own name) through 2 stage processes
    equals torch.optim.RMSprop over the whole local model."""
    kwargs = {"sizes": [12, 24, 24, 6]}
    rms = {"lr": 1e-2, "momentum": 0.5}
    reference = models.build("mlp", seed=4, **kwargs)
    optimizer = torch.optim.RMSprop(reference.parameters(), **rms)
    g = torch.Generator().manual_seed(2)
    with Pipeline(
        coordinator=cluster.coordinator,
        model="mlp",
        model_kwargs=kwargs,
        seed=4,
        optimizer="RMSprop",
        optimizer_kwargs=rms,
        micro_batches=1,
        stages=2,
    ) as pipe:
        for step in range(STEPS):
            x, y = torch.randn(8, 12, generator=g), torch.randint(0, 6, (8,), generator=g)
            got = pipe.train_step(x, y)
            want = reference_step(reference, optimizer, "cross_entropy", x, y)
            assert got == pytest.approx(want, rel=1e-6), f"step {step}"
        state = pipe.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-6, atol=1e-6, msg=key)


@pytest.mark.timeout(180)
def test_custom_loss_through_the_allow_list(cluster: LocalCluster) -> None:
    """A loss by path from an allowed module trains through 3 stages as locally; the same
    function from a module the stages do not allow, or re-exported by an allowed module, is
    refused with PERMISSION_DENIED naming it, and the cluster trains on afterwards."""
    loss = f"{ALLOWED}:half_mse"
    kwargs = {"sizes": [8, 16, 4]}
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(3)]
    with (
        stage_threads(),
        LocalPipeline(
            model="mlp", model_kwargs=kwargs, loss=loss, micro_batches=2, allow=[ALLOWED]
        ) as local,
    ):
        want = [local.train_step(x, y) for x, y in batches]
    with Pipeline(
        coordinator=cluster.coordinator,
        model="mlp",
        model_kwargs=kwargs,
        loss=loss,
        micro_batches=2,
        stages=3,
    ) as pipe:
        got = [pipe.train_step(x, y) for x, y in batches]
    assert got == pytest.approx(want, rel=1e-6)
    with stage_threads():
        plain = [
            0.5 * torch.nn.functional.mse_loss(models.build("mlp", seed=0, **kwargs)(x), y).item()
            for x, y in batches[:1]
        ]
    assert got[0] == pytest.approx(plain[0], rel=1e-6)  # the custom loss was the one used
    for refused, why in (
        ("tests.support.custom_losses:half_mse", "--allow-models tests"),
        (f"{ALLOWED}:reexported_loss", "tests.support.custom_losses"),
    ):
        with (
            Pipeline(
                coordinator=cluster.coordinator,
                model="mlp",
                model_kwargs=kwargs,
                loss=refused,
                stages=3,
            ) as bad,
            pytest.raises(PermissionDenied, match=refused) as info,
        ):
            bad.train_step(*batches[0])
        assert why in str(info.value)
    with Pipeline(
        coordinator=cluster.coordinator, model="mlp", model_kwargs=kwargs, loss=loss, stages=3
    ) as again:
        assert again.train_step(*batches[0]) == pytest.approx(plain[0], rel=1e-6)


@pytest.mark.timeout(120)
def test_optimizers_that_are_not_per_parameter_are_refused(cluster: LocalCluster) -> None:
    """LBFGS and unknown names fail on the client before anything is contacted; a custom
    optimizer that looks across parameters is refused by the stages at setup, naming it."""
    with pytest.raises(InvalidRequest, match="'LBFGS' is refused"):
        Pipeline(coordinator=cluster.coordinator, model="mlp", optimizer="LBFGS")
    with pytest.raises(InvalidRequest, match=r"'rmsprop'.*did you mean 'RMSprop'"):
        Pipeline(coordinator=cluster.coordinator, model="mlp", optimizer="rmsprop")
    with pytest.raises(InvalidRequest, match=r"'RMSprop' rejected .*'betas'"):
        Pipeline(
            coordinator=cluster.coordinator,
            model="mlp",
            optimizer="RMSprop",
            optimizer_kwargs={"betas": [0.9, 0.99]},
        )
    custom = f"{ALLOWED}:GlobalNormSGD"
    with (
        Pipeline(coordinator=cluster.coordinator, model="mlp", optimizer=custom, stages=2) as bad,
        pytest.raises(InvalidRequest, match=f"'{custom}' is not per-parameter"),
    ):
        bad.train_step(torch.randn(4, 32), torch.randint(0, 10, (4,)))


@pytest.mark.timeout(180)
def test_dropout_replayed_after_a_stage_is_killed_is_the_same(cluster: LocalCluster) -> None:
    """A stage SIGKILLed between RunStep and CommitStep of step 4: the spare takes over from
    the snapshot of step 2, the client replays steps 3 and 4 (same logical steps, so the
    same masks), and losses and weights equal LocalPipeline's bit for bit."""
    reference = _local()
    with Pipeline(
        coordinator=cluster.coordinator, model=DROPOUT, seed=5, optimizer="adam",
        optimizer_kwargs=ADAM, micro_batches=3, stages=3, snapshot_every=2, lease_s=3.0,
    ) as pipe:  # fmt: skip
        plan = FaultPlan().at(step=STEPS).pause(stage=1, point="awaiting_commit").then_kill()
        before = plan.hook(cluster, pipe)
        losses, replayed = [], 0
        for step, (x, y) in enumerate(_batches(), start=1):
            before(step)
            losses.append(pipe.train_step(x, y))
            replayed += pipe.last_step.replayed
        assert replayed >= 1, "nothing was replayed: the kill did not happen"
        assert plan.killed[0] not in {cluster.name_of(a) for a in pipe.partition.addresses}
        _assert_same((losses, pipe.state_dict()), reference, "after a replay")
    revive(cluster, *plan.killed)
