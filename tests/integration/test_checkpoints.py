"""Weights in (``init_state``) and standard checkpoints out (``save``/``load`` directories),
through real stage processes, compared with single-process PyTorch training."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from elasticpipe import Admin, LocalPipeline, models
from elasticpipe.client.pipeline import Pipeline
from elasticpipe.coordinator.config import CoordinatorConfig
from elasticpipe.coordinator.planning.policy import PolicyConfig
from elasticpipe.coordinator.server import CoordinatorServer
from elasticpipe.errors import InvalidRequest, ModelError
from elasticpipe.local.cluster import LocalCluster
from elasticpipe.stage_server.stage import StageConfig
from elasticpipe.training import objectives
from elasticpipe.training.objectives import make_optimizer
from tests.support import jobs
from tests.support.numerics import assert_losses_close, stage_threads
from tests.support.reference import assert_exact
from tests.support.servers import stage_servers

MLP = {"sizes": [6, 12, 12, 3]}
ADAM = {"lr": 1e-2}
NO_RESET = "tests.support.custom_models:no_reset"


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """Three stages allowing the tests' factories; rebalancing only on request."""
    with LocalCluster(
        stages=3,
        stage_args=["--allow-models", "tests.support"],
        auto_rebalance=False,
        heartbeat_s=0.2,
    ) as c:
        yield c


def _batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)
    ]


def _reference(
    weights: dict[str, torch.Tensor], batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """LocalPipeline's losses and final weights for ``_pipe``'s job from ``weights``."""
    job = {"optimizer": "adam", "optimizer_kwargs": ADAM, "micro_batches": 2}
    with stage_threads(), jobs.local_mlp(**MLP, **job, init_state=weights) as local:
        return [local.train_step(x, y) for x, y in batches], local.state_dict()


def _pipe(cluster: LocalCluster, stages: int, **kwargs: object) -> Pipeline:
    return Pipeline(
        coordinator=cluster.coordinator,
        model=str(kwargs.pop("model", "mlp")),
        model_kwargs=kwargs.pop("model_kwargs", MLP),  # type: ignore[arg-type]
        optimizer="adam",
        optimizer_kwargs=ADAM,
        micro_batches=2,
        stages=stages,
        **kwargs,  # type: ignore[arg-type]
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("form", ["mapping", "file", "directory"])
def test_init_state_starts_training_from_the_users_weights(
    cluster: LocalCluster, tmp_path: Path, form: str
) -> None:
    """Training from init_state equals PyTorch training from the same weights (any form)."""
    weights = models.build("mlp", seed=42, **MLP).state_dict()
    source: object = weights
    if form == "file":
        source = tmp_path / "w.safetensors"
        save_file(weights, str(source))
    elif form == "directory":
        save_file(
            {k: v for k, v in weights.items() if k.startswith("0.")},
            str(tmp_path / "a.safetensors"),
        )
        save_file(
            {k: v for k, v in weights.items() if not k.startswith("0.")},
            str(tmp_path / "b.safetensors"),
        )
        source = tmp_path
    batches = _batches(3)
    expected_losses, expected_state = _reference(weights, batches)
    with _pipe(cluster, 3, init_state=source) as pipe:
        assert pipe.state_dict().keys() == weights.keys()
        torch.testing.assert_close(pipe.state_dict(), weights)
        losses = [pipe.train_step(x, y) for x, y in batches]
        assert losses == expected_losses
        assert_exact(pipe.state_dict(), expected_state, "from init_state")


@pytest.mark.timeout(60)
def test_bad_init_state_is_refused_before_anything_changes() -> None:
    """Missing, unexpected and misshapen keys are named, before any server is contacted."""
    good = models.build("mlp", seed=1, **MLP).state_dict()
    nowhere = "127.0.0.1:1"  # nothing listens: the check must come first
    missing = {k: v for k, v in good.items() if k != "2.bias"}
    with pytest.raises(InvalidRequest, match=r"missing keys \['2.bias'\]"):
        Pipeline(coordinator=nowhere, model="mlp", model_kwargs=MLP, init_state=missing)
    extra = {**good, "9.weight": torch.zeros(1)}
    with pytest.raises(InvalidRequest, match=r"unexpected keys \['9.weight'\]"):
        Pipeline(coordinator=nowhere, model="mlp", model_kwargs=MLP, init_state=extra)
    wrong = {**good, "2.weight": torch.zeros(5, 12)}
    with pytest.raises(InvalidRequest, match=r"'2.weight' has shape \[5, 12\].*\[12, 12\]"):
        Pipeline(coordinator=nowhere, model="mlp", model_kwargs=MLP, init_state=wrong)
    with pytest.raises(InvalidRequest, match="neither a file nor a directory"):
        Pipeline(coordinator=nowhere, model="mlp", model_kwargs=MLP, init_state="/no/such/dir")
    with pytest.raises(InvalidRequest, match="maps to a str"):
        Pipeline(coordinator=nowhere, model="mlp", model_kwargs=MLP, init_state={"0.weight": "x"})


@pytest.mark.timeout(120)
def test_layers_without_reset_parameters_train_from_init_state(cluster: LocalCluster) -> None:
    """A layer no seed can initialise is refused with a hint, and trains with init_state."""
    with pytest.raises(ModelError, match="init_state"):
        models.build(NO_RESET, seed=0, allow=["tests"])
    reference = models.build(NO_RESET, seed=0, allow=["tests"], external=True)
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(torch.randn_like(p))
    weights = {k: v.clone() for k, v in reference.state_dict().items()}
    batches = _batches(2)
    job = {"optimizer": "adam", "optimizer_kwargs": ADAM, "micro_batches": 2}
    with (
        stage_threads(),
        LocalPipeline(model=NO_RESET, **job, init_state=weights, allow=["tests"]) as local,
    ):
        expected = [local.train_step(x, y) for x, y in batches]
        want = local.state_dict()
    with _pipe(cluster, 2, model=NO_RESET, model_kwargs={}, init_state=weights) as pipe:
        losses = [pipe.train_step(x, y) for x, y in batches]
        assert losses == expected
        assert_exact(pipe.state_dict(), want, "from init_state")


@pytest.mark.timeout(180)
def test_a_checkpoint_moves_from_two_stages_to_three_and_resumes_exactly(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """3 steps on 2 stages, save, load on 3 stages, 2 more steps == 5 uninterrupted steps."""
    batches = _batches(5, seed=7)
    start = models.build("mlp", seed=0, **MLP).state_dict()
    expected_losses, expected_state = _reference(start, batches)
    ckpt = tmp_path / "ckpt"
    with _pipe(cluster, 2) as pipe:
        losses = [pipe.train_step(x, y) for x, y in batches[:3]]
        pipe.save(ckpt)
        saved_state = pipe.state_dict()
    merged: dict[str, torch.Tensor] = {}
    for shard in sorted(ckpt.glob("weights-*.safetensors")):
        merged.update(load_file(str(shard)))
    assert merged.keys() == saved_state.keys()
    torch.testing.assert_close(merged, saved_state, rtol=0, atol=0)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert manifest["step"] == 3
    assert manifest["optimizer"]["name"] == "adam"
    assert manifest["job"]["model_kwargs"] == MLP
    assert "rng_protocol" in manifest
    optimizer = {}
    for shard in sorted(ckpt.glob("optimizer-*.safetensors")):
        optimizer.update(load_file(str(shard)))
    assert {"0.weight.exp_avg", "0.weight.exp_avg_sq", "2.bias.step"} <= optimizer.keys()
    assert not optimizer.keys() & merged.keys()

    with _pipe(cluster, 3) as pipe:
        pipe.load(ckpt)
        assert pipe.step == 3
        assert pipe.partition.num_stages == 3
        losses += [pipe.train_step(x, y) for x, y in batches[3:]]
        assert losses == expected_losses
        assert_exact(pipe.state_dict(), expected_state, "saved on two stages, loaded on three")

    # init_state=DIR of a checkpoint: its weights, a fresh optimizer, step 0.
    fresh_losses, fresh_state = _reference(saved_state, batches[3:])
    with _pipe(cluster, 3, init_state=ckpt) as pipe:
        assert pipe.step == 0
        got = [pipe.train_step(x, y) for x, y in batches[3:]]
        assert got == fresh_losses
        assert_exact(pipe.state_dict(), fresh_state, "resumed on three stages")


@pytest.mark.timeout(120)
def test_saving_over_a_checkpoint_replaces_it_and_refuses_other_directories(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """A second save replaces the first; a directory that holds other files is left alone."""
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    x, y = _batches(1)[0]
    with _pipe(cluster, 2) as pipe:
        pipe.train_step(x, y)
        with pytest.raises(InvalidRequest, match="not a checkpoint directory"):
            pipe.save(other)
        assert (other / "keep.txt").read_text() == "mine"
        pipe.save(tmp_path / "c")
        pipe.train_step(x, y)
        pipe.save(tmp_path / "c")
    assert json.loads((tmp_path / "c" / "manifest.json").read_text())["step"] == 2
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.timeout(120)
def test_a_layer_larger_than_the_tensor_limit_saves_loads_and_migrates(tmp_path: Path) -> None:
    """The limit applies per tensor: a layer whose state (weights + Adam moments) is over
    it, each tensor under it, is saved, loaded and moved between stages exactly."""
    limit = 1 << 20
    wide = {"sizes": [4, 512, 256, 4]}  # layer 2: a 512 KiB weight, 1.5 MiB with Adam
    reference = models.build("mlp", seed=0, **wide)
    opt = make_optimizer("adam", reference.parameters(), ADAM)
    g = torch.Generator().manual_seed(3)
    batches = [
        (torch.randn(4, 4, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(3)
    ]
    # The stages are in this process, at its thread count: so is this reference.
    expected = [
        objectives.reference_step(reference, opt, "cross_entropy", x, y) for x, y in batches
    ]
    with CoordinatorServer(
        CoordinatorConfig(policy=PolicyConfig(enabled=False), heartbeat_interval_s=0.2)
    ) as c:
        configs = [StageConfig(name=f"s{i}", max_tensor_bytes=limit) for i in range(2)]
        with (
            stage_servers(c.address, configs),
            jobs.mlp(c.address, **wide, optimizer_kwargs=ADAM, micro_batches=1, stages=2) as pipe,
        ):
            losses = [pipe.train_step(*batches[0])]
            pipe.save(tmp_path / "big")
            layer2 = load_file(str(tmp_path / "big" / "optimizer-00002.safetensors"))
            assert sum(t.numel() * t.element_size() for t in layer2.values()) > limit
            pipe.load(tmp_path / "big")
            losses.append(pipe.train_step(*batches[1]))
            before = pipe.partition.boundaries
            target = [0, 3, 5] if before[1] == 2 else [0, 2, 5]
            with Admin(c.address, timeout=60) as admin:
                assert admin.set_partition(target).changed
            losses.append(pipe.train_step(*batches[2]))
            assert list(pipe.partition.boundaries) == target
            assert_losses_close(losses, expected)
            torch.testing.assert_close(pipe.state_dict(), reference.state_dict())


@pytest.mark.timeout(180)
def test_recovery_after_a_crash_rolls_back_to_the_users_weights_not_the_seeds() -> None:
    """The step-0 snapshot holds init_state: a stage killed before the first snapshot after
    it is rebuilt from those weights, and the replayed result equals PyTorch's."""
    weights = models.build("mlp", seed=42, **MLP).state_dict()
    batches = _batches(4, seed=9)
    expected_losses, expected_state = _reference(weights, batches)
    with (
        LocalCluster(stages=3, auto_rebalance=False, heartbeat_s=0.2) as cluster,
        _pipe(cluster, 2, init_state=weights, snapshot_every=10) as pipe,
    ):
        losses = [pipe.train_step(x, y) for x, y in batches[:2]]
        victim = cluster.name_of(pipe.partition.addresses[-1])
        cluster.kill(victim)
        losses += [pipe.train_step(x, y) for x, y in batches[2:]]
        dead = {s.name for s in cluster.status().stages if s.state == "dead"}
        assert victim in dead  # recovered: rolled back to step 0 and replayed
        assert losses == expected_losses
        assert_exact(pipe.state_dict(), expected_state, "recovered from a crash")
