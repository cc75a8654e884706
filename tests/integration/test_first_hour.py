"""What a new user meets in the first hour: predict in eval mode, their own errors reported
as theirs, clear messages for natural mistakes, quiet logs, and an admin CLI for people and
scripts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import pytest
import torch

from elasticpipe import models
from elasticpipe.client.pipeline import Pipeline, StepStats
from elasticpipe.errors import (
    CoordinatorUnavailable,
    ElasticPipeError,
    InvalidRequest,
    ModelError,
    PermissionDenied,
    StagesMissing,
    UserCodeError,
)
from elasticpipe.local.cluster import LocalCluster
from elasticpipe.training.objectives import make_optimizer
from elasticpipe.v1 import stage_pb2, stage_pb2_grpc
from tests.support import cli
from tests.support.numerics import reference_step, stage_threads

pytestmark = pytest.mark.timeout(240)

ALLOWED = "tests.support"
NORMED = "tests.support.custom_models:normed"
MLP = {"sizes": [8, 16, 16, 4]}
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """Three stages allowing the tests' factories; rebalancing only on request."""
    with LocalCluster(
        stages=3,
        allow_models=[ALLOWED],
        fault_injection=True,
        auto_rebalance=False,
        heartbeat_s=0.2,
    ) as c:
        yield c


# ---- bugs ----------------------------------------------------------------------------------


def test_predict_runs_in_eval_mode_and_changes_nothing(cluster: LocalCluster) -> None:
    """predict on a model with BatchNorm and Dropout: two calls give the same output, the
    running statistics and num_batches_tracked do not move, and the output equals the
    local model's eval() output on the same weights."""
    with Pipeline(coordinator=cluster.coordinator, model=NORMED, micro_batches=1, stages=3) as pipe:
        x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
        pipe.train_step(x, y)
        before = pipe.state_dict()
        first, second = pipe.predict(x), pipe.predict(x)
        after = pipe.state_dict()
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    assert after["1.num_batches_tracked"].item() == 1
    local = models.build(NORMED, seed=0, allow=(ALLOWED,))
    local.load_state_dict(after)
    local.eval()
    with stage_threads():
        torch.testing.assert_close(first, local(x))


def test_a_users_bad_targets_are_their_error_not_an_internal_one(cluster: LocalCluster) -> None:
    """A class index out of range comes back as INVALID_ARGUMENT with PyTorch's own words,
    the loss and the micro-batch; the job goes on."""
    with Pipeline(
        coordinator=cluster.coordinator, model="mlp", model_kwargs=MLP, micro_batches=2
    ) as pipe:
        with pytest.raises(UserCodeError) as info:
            pipe.train_step(torch.randn(4, 8), torch.tensor([0, 1, 14, 2]))
        message = str(info.value)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "Target 14 is out of bounds" in message
        assert "loss 'cross_entropy'" in message and "micro-batch 1" in message
        assert pipe.train_step(torch.randn(4, 8), torch.tensor([0, 1, 3, 2])) > 0


def test_load_before_the_first_step_still_profiles(cluster: LocalCluster, tmp_path: Path) -> None:
    """Loading a checkpoint before training (the natural order for a resume) sets the job
    up without a sample; the first step then profiles it, so speeds are measured ones."""
    path = tmp_path / "ckpt.msgpack"
    with Pipeline(coordinator=cluster.coordinator, model="mlp", model_kwargs=MLP) as pipe:
        pipe.train_step(torch.randn(8, 8), torch.randint(0, 4, (8,)))
        pipe.save(path)
    with Pipeline(coordinator=cluster.coordinator, model="mlp", model_kwargs=MLP) as pipe:
        pipe.load(path)
        assert pipe.step == 1
        pipe.train_step(torch.randn(8, 8), torch.randint(0, 4, (8,)))
        status = cluster.status()
        speeds = [s.speed for s in status.stages if s.state == "chain"]
        # Profiled speeds are relative to the profile, about 1; unit-less estimates from
        # parameter sizes were in the 1000s. A loaded host may slow one stage's timed layers
        # several times (0.195 seen in a CI run beside other work), so the bounds sit two
        # orders of magnitude apart from that failure, not at a few times 1.
        assert all(0.05 < speed < 20.0 for speed in speeds), speeds


def test_status_piped_into_head_ends_quietly(cluster: LocalCluster) -> None:
    """``admin status | head -3`` prints three lines and no BrokenPipeError traceback."""
    command = (
        f"{sys.executable} -m elasticpipe admin --coordinator {cluster.coordinator} status "
        "| head -3"
    )
    result = subprocess.run(
        ["bash", "-o", "pipefail", "-c", command],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr
    assert len(result.stdout.splitlines()) == 3


# ---- clear errors ----------------------------------------------------------------------------


def test_an_unreachable_coordinator_says_what_to_check() -> None:
    """No coordinator at the address: CoordinatorUnavailable naming the address."""
    with (
        Pipeline(coordinator="127.0.0.1:9", model="mlp", model_kwargs=MLP, setup_timeout=5) as pipe,
        pytest.raises(CoordinatorUnavailable, match=r"cannot reach the coordinator at 127.0.0.1:9"),
    ):
        pipe.train_step(torch.randn(4, 8), torch.randint(0, 4, (4,)))


def test_a_misspelt_model_fails_at_once_with_a_suggestion() -> None:
    """'mpl' fails in the constructor, before anything is contacted, suggesting 'mlp'."""
    with pytest.raises(ModelError, match="did you mean 'mlp'"):
        Pipeline(coordinator="127.0.0.1:9", model="mpl")


def test_a_factory_not_allowed_says_how_to_allow_it(cluster: LocalCluster) -> None:
    """A factory outside --allow-models: the message names the flag to start stages with,
    and the coordinator's log says that the job setup failed."""
    with (
        Pipeline(coordinator=cluster.coordinator, model="mycompany.models:big") as pipe,
        pytest.raises(PermissionDenied, match="--allow-models mycompany"),
    ):
        pipe.train_step(torch.randn(4, 8), torch.randint(0, 4, (4,)))
    assert "job_setup_failed" in (cluster.log_dir / "coordinator.log").read_text()


def test_too_few_stages_are_waited_for_then_named(cluster: LocalCluster) -> None:
    """stages=5 with 3 live: the client waits (logging), then fails naming the live stages
    and saying stages=3 would do."""
    with (
        Pipeline(
            coordinator=cluster.coordinator,
            model="mlp",
            model_kwargs=MLP,
            stages=5,
            setup_timeout=6,
        ) as pipe,
        pytest.raises(StagesMissing) as info,
    ):
        pipe.train_step(torch.randn(4, 8), torch.randint(0, 4, (4,)))
    message = str(info.value)
    assert "need 5 live stages, have 3" in message and "stages=3" in message
    for name in ("stage-0", "stage-1", "stage-2"):
        assert name in message
    log = (cluster.log_dir / "coordinator.log").read_text()
    assert "waiting for 2 more stages: 3 of 5 live" in log


def test_too_few_layers_say_which_stages_would_do(cluster: LocalCluster) -> None:
    """A model of 3 layers on 3+ stages asked for 4: refused, saying stages=3 would do."""
    three = {"sizes": [8, 16, 4]}  # Linear, ReLU, Linear
    with Pipeline(coordinator=cluster.coordinator, model="mlp", model_kwargs=three, stages=3) as ok:
        assert ok.train_step(torch.randn(4, 8), torch.randint(0, 4, (4,))) > 0
    cluster.add_stage("extra")
    try:
        with (
            Pipeline(
                coordinator=cluster.coordinator, model="mlp", model_kwargs=three, stages=4
            ) as pipe,
            pytest.raises(ElasticPipeError, match="too few layers") as info,
        ):
            pipe.train_step(torch.randn(4, 8), torch.randint(0, 4, (4,)))
        assert "stages=3 or fewer" in str(info.value)
        cluster.kill("extra")
        cluster.add_stage("extra")  # the same name again: a new incarnation
        log = (cluster.log_dir / "coordinator.log").read_text()
        came_back = [line for line in log.splitlines() if "stage_came_back" in line]
        assert came_back and "extra" in came_back[-1], came_back
    finally:
        cluster.kill("extra")


def test_stages_that_import_different_factory_code_are_refused(tmp_path: Path) -> None:
    """Two stages whose copies of the factory module differ: the job is refused, naming
    the stages, the file and the hashes, instead of training two different models."""
    for version, width in (("a", 4), ("b", 5)):
        folder = tmp_path / version
        folder.mkdir()
        (folder / "factorymod.py").write_text(
            "from torch import nn\n\n"
            f"def build():\n    return nn.Sequential(nn.Linear({width}, 4), nn.Linear(4, 2))\n"
        )
    with LocalCluster(stages=0, auto_rebalance=False) as cluster:
        for version in ("a", "b"):
            cluster.add_stage(
                f"host-{version}",
                ["--allow-models", "factorymod"],
                env={"PYTHONPATH": f"{tmp_path / version}{os.pathsep}{REPO}"},
            )
        with (
            Pipeline(coordinator=cluster.coordinator, model="factorymod:build", stages=2) as pipe,
            pytest.raises(ModelError, match="disagree") as info,
        ):
            pipe.train_step(torch.randn(2, 4), torch.randint(0, 2, (2,)))
        assert "host-a" in str(info.value) and "host-b" in str(info.value)
        assert "factorymod.py" in str(info.value)


# ---- quiet logs ------------------------------------------------------------------------------

QUIET_SCRIPT = """
import torch
from elasticpipe import LocalCluster, Pipeline
with LocalCluster(stages=2, auto_rebalance=False) as cluster:
    with Pipeline(coordinator=cluster.coordinator, model="mlp",
                  model_kwargs={"sizes": [4, 8, 2]}) as pipe:
        for _ in range(3):
            pipe.train_step(torch.randn(4, 4), torch.randint(0, 2, (4,)))
        pipe.predict(torch.randn(4, 4))
print("done")
"""


def test_a_training_script_prints_nothing_unless_it_configures_logging() -> None:
    """A script using Pipeline writes only its own output to stdout (and nothing to
    stderr at the default level); with logging configured, the library's events appear."""
    quiet = subprocess.run(
        [sys.executable, "-c", QUIET_SCRIPT],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    assert quiet.stdout == "done\n"
    assert quiet.stderr == ""
    loud = subprocess.run(
        [
            sys.executable,
            "-c",
            "import logging; logging.basicConfig(level=logging.INFO)\n" + QUIET_SCRIPT,
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    assert loud.stdout == "done\n"
    assert "pipeline_ready" in loud.stderr and "elasticpipe.client.pipeline" in loud.stderr


def test_an_idle_coordinator_logs_its_decision_once(tmp_path: Path) -> None:
    """Re-planning every 0.1 s with nothing to move logs 'already optimal' once, not every
    time; a server stopped by a signal says so."""
    with (
        LocalCluster(
            stages=2, coordinator_args=["--policy-interval", "0.1"], log_dir=tmp_path
        ) as cluster,
        Pipeline(coordinator=cluster.coordinator, model="mlp", model_kwargs=MLP) as pipe,
    ):
        for _ in range(3):
            pipe.train_step(torch.randn(4, 8), torch.randint(0, 4, (4,)))
        time.sleep(3)
        log = (tmp_path / "coordinator.log").read_text()
    assert log.count("rebalance_declined") <= 2, log  # ~30 re-plans, one decision
    assert "server_stopped" in (tmp_path / "coordinator.log").read_text()


# ---- the admin CLI ---------------------------------------------------------------------------

STATUS_SCHEMA = {
    "type": "object",
    "required": ["stages", "partition", "history", "job_model", "num_layers", "auto_rebalance"],
    "properties": {
        "stages": {
            "type": "array",
            "items": {
                "type": "object",
                "required": [
                    "name",
                    "state",
                    "incarnation",
                    "speed",
                    "alive",
                    "index",
                    "layer_lo",
                    "layer_hi",
                    "committed_step",
                ],
                "properties": {
                    "state": {"enum": ["chain", "spare", "drained", "dead", "left"]},
                    "incarnation": {"type": "integer"},
                    "committed_step": {"type": "integer"},
                    "layer_lo": {"type": "integer"},
                    "speed": {"type": "number"},
                },
            },
        },
        "partition": {
            "type": "object",
            "required": ["epoch", "boundaries", "stage_ids"],
            "properties": {
                "epoch": {"type": "integer"},
                "boundaries": {"type": "array", "items": {"type": "integer"}},
            },
        },
        "history": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["epoch", "kind", "reason", "bytes_moved", "pause_s"],
                "properties": {"epoch": {"type": "integer"}, "bytes_moved": {"type": "integer"}},
            },
        },
        "committed_step": {"type": "integer"},
    },
}
ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "message"],
            "properties": {"code": {"type": "string"}, "message": {"type": "string"}},
        }
    },
}


def test_admin_json_is_for_scripts(cluster: LocalCluster) -> None:
    """--json after the command: every field (zeros too), integers as numbers, checked
    against a schema; an error is JSON too, with exit code 2."""
    with Pipeline(coordinator=cluster.coordinator, model="mlp", model_kwargs=MLP) as pipe:
        pipe.train_step(torch.randn(4, 8), torch.randint(0, 4, (4,)))
        result = cli.admin(cluster, "status", "--json", after=True)
        assert result.returncode == 0, result.stderr
        status = json.loads(result.stdout)
        jsonschema.validate(status, STATUS_SCHEMA)
        assert status["partition"]["epoch"] >= 1 and isinstance(status["committed_step"], int)
        assert all("slowdown" in s and "speed" in s for s in status["stages"])
        error = cli.admin(cluster, "drain", "nobody", "--json", after=True)
        assert error.returncode == 2
        jsonschema.validate(json.loads(error.stdout), ERROR_SCHEMA)
        assert "unknown stage 'nobody'" in json.loads(error.stdout)["error"]["message"]


def test_admin_options_go_before_or_after_the_command(cluster: LocalCluster) -> None:
    """--coordinator and --json work before and after the subcommand alike."""
    before = cli.elasticpipe(
        "admin", "--coordinator", cluster.coordinator, "--json", "status", timeout=60, check=True
    )
    after = cli.admin(cluster, "status", "--json", after=True)
    assert json.loads(before.stdout)["num_layers"] == json.loads(after.stdout)["num_layers"]


def test_dry_run_shows_the_target_and_moves_nothing(cluster: LocalCluster) -> None:
    """rebalance --dry-run prints the target partition, the gain and the bytes it would
    move, and changes nothing; plan names the stages."""
    with Pipeline(coordinator=cluster.coordinator, model="mlp", model_kwargs=MLP, stages=3) as pipe:
        pipe.train_step(torch.randn(4, 8), torch.randint(0, 4, (4,)))
        epoch = pipe.partition.epoch
        assert cli.admin(cluster, "set-partition", "0:1,1:2,2:5", after=True).returncode == 0
        dry = cli.admin(cluster, "rebalance", "--dry-run", after=True)
        assert dry.returncode == 0, dry.stderr
        assert dry.stdout.startswith("dry run: would move to 0:") and "bytes to move" in dry.stdout
        assert "gain" in dry.stdout
        assert cluster.status().partition.epoch == epoch + 1  # the set-partition only
        plan = cli.admin(cluster, "plan", after=True)
        names = [s.name for s in cluster.status().stages if s.state == "chain"]
        assert all(name in plan.stdout for name in names)


def test_set_partition_with_a_stage_twice_is_refused_and_loses_nothing(
    cluster: LocalCluster,
) -> None:
    """The data-losing command of the first hour: a stage listed twice exits 2 naming it,
    and the partition, the layers and training are untouched."""
    with Pipeline(coordinator=cluster.coordinator, model="mlp", model_kwargs=MLP, stages=3) as pipe:
        pipe.train_step(torch.randn(4, 8), torch.randint(0, 4, (4,)))
        before = pipe.partition
        names = [cluster.name_of(a) for a in before.addresses]
        bad = cli.admin(
            cluster,
            "set-partition",
            "0:1,1:3,3:5",
            "--stages",
            names[0],
            names[0],
            names[1],
            after=True,
        )
        assert bad.returncode == 2 and f"stage {names[0]!r} is listed twice" in bad.stderr
        assert cluster.status().partition.epoch == before.epoch
        assert pipe.train_step(torch.randn(4, 8), torch.randint(0, 4, (4,))) > 0
        assert len(pipe.state_dict()) == 6


def test_status_history_explains_every_epoch_and_forget_removes_the_dead(
    cluster: LocalCluster,
) -> None:
    """An abandoned move shows in the history as such (no unexplained gap in epochs);
    status shows the current job by default and every job with --all; forget removes a
    dead stage."""
    with Pipeline(coordinator=cluster.coordinator, model="mlp", model_kwargs=MLP, stages=2) as pipe:
        pipe.train_step(torch.randn(4, 8), torch.randint(0, 4, (4,)))
        status = cluster.status()
        assert status.factory_file.endswith("elasticpipe/models/zoo.py")  # where mlp is defined
        assert len(status.factory_sha256) == 64
        shown = cli.admin(cluster, "status", after=True)
        assert status.factory_file in shown.stdout and status.factory_sha256[:12] in shown.stdout
        # A move whose transfer fails its checksum: abandoned, and recorded as such.
        lo, mid, hi = pipe.partition.boundaries
        receiver = pipe.partition.addresses[0 if mid + 1 < hi else 1]
        target = mid + 1 if mid + 1 < hi else mid - 1
        with grpc.insecure_channel(receiver) as channel:
            stage_pb2_grpc.StageServiceStub(channel).InjectFault(
                stage_pb2.FaultRequest(fault=stage_pb2.CORRUPT_NEXT_IMPORT), timeout=10
            )
        failed = cli.admin(cluster, "set-partition", f"{lo}:{target},{target}:{hi}", after=True)
        checksum = "CRC-32" in failed.stderr or "digest mismatch" in failed.stderr
        assert failed.returncode != 0 and checksum, failed.stderr
        abandoned = cluster.status().history[-1]
        assert abandoned.kind == "abandoned" and "move abandoned" in abandoned.reason
        assert pipe.train_step(torch.randn(4, 8), torch.randint(0, 4, (4,))) > 0
        spare = next(s.name for s in cluster.status().stages if s.state == "spare")
        cluster.kill(spare)
        deadline = time.monotonic() + 30
        while not any(s.name == spare and s.state == "dead" for s in cluster.status().stages):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        log = (cluster.log_dir / "coordinator.log").read_text()
        assert "stage_declared_dead" in log and spare in log
        bad = cli.admin(
            cluster,
            "set-partition",
            "0:2,2:5",
            "--stages",
            spare,
            cluster.name_of(pipe.partition.addresses[0]),
            after=True,
        )
        assert bad.returncode == 2 and "is not alive" in bad.stderr
        forgot = cli.admin(cluster, "forget", spare, after=True)
        assert forgot.returncode == 0 and spare in forgot.stdout
        assert spare not in [s.name for s in cluster.status().stages]
        mine = json.loads(cli.admin(cluster, "status", "--json", after=True).stdout)["history"]
        every = json.loads(cli.admin(cluster, "status", "--json", "--all", after=True).stdout)[
            "history"
        ]
        assert {r["job_id"] for r in mine} == {pipe.partition.job_id}
        assert len(every) > len(mine)
        assert "abandoned" in [r["kind"] for r in mine]
        numbers = sorted(r["epoch"] for r in every)
        assert numbers == list(range(numbers[0], numbers[-1] + 1)), numbers  # no gap
    cluster.add_stage(spare)


def test_help_explains_every_option_and_the_log_level_is_checked() -> None:
    """Every subcommand and option has help text; defaults show; a bad log level exits 2."""
    from elasticpipe.cli.entry import build_parser

    parser = build_parser()

    def walk(p: object) -> Iterator[object]:
        yield p
        for action in p._actions:  # type: ignore[attr-defined]
            for child in (
                (getattr(action, "choices", None) or {}).values()
                if isinstance(getattr(action, "choices", None), dict)
                else []
            ):
                yield from walk(child)

    for p in walk(parser):
        for action in p._actions:  # type: ignore[attr-defined]
            assert action.help, f"{p.prog}: {action.dest} has no help"  # type: ignore[attr-defined]
    text = cli.elasticpipe("coordinator", "--help", timeout=60, check=True).stdout
    assert "(default: 0.1)" in text and "(default: 127.0.0.1:7100)" in text
    bad = cli.elasticpipe("--log-level", "loud", "admin", "status", timeout=60)
    assert bad.returncode == 2 and "loud" in bad.stderr


# ---- the training script ------------------------------------------------------------------


def test_last_step_is_a_documented_dataclass(cluster: LocalCluster) -> None:
    """pipe.last_step has per-stage compute and waiting times, peaks, loss and attempts,
    and prints as one readable line."""
    with Pipeline(coordinator=cluster.coordinator, model="mlp", model_kwargs=MLP, stages=3) as pipe:
        loss = pipe.train_step(torch.randn(8, 8), torch.randint(0, 4, (8,)))
        last = pipe.last_step
    assert isinstance(last, StepStats)
    assert (last.step, last.loss, last.attempts) == (1, loss, 1)
    assert len(last.stages) == 3 and all(s.compute_s > 0 for s in last.stages)
    assert all(s.peak_stashed >= 1 and s.peak_stashed_bytes > 0 for s in last.stages)
    text = str(last)
    assert text.startswith(f"step 1: loss {loss:.4f}") and "per stage" in text


def test_load_can_override_the_learning_rate(cluster: LocalCluster, tmp_path: Path) -> None:
    """load(DIR, optimizer_kwargs={"lr": ...}) loads the optimizer state, then sets the
    learning rate, as plain PyTorch would; training then matches that reference."""
    path = tmp_path / "ckpt.msgpack"
    reference = models.build("mlp", seed=0, **MLP)
    opt = make_optimizer("adam", reference.parameters(), {"lr": 1e-2})
    g = torch.Generator().manual_seed(4)
    data = [
        (torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(4)
    ]
    # The same job twice: the second loads what the first saved.
    job: dict[str, Any] = {
        "coordinator": cluster.coordinator,
        "model": "mlp",
        "model_kwargs": MLP,
        "optimizer_kwargs": {"lr": 1e-2},
    }
    with Pipeline(**job) as pipe:
        for x, y in data[:2]:
            pipe.train_step(x, y)
            reference_step(reference, opt, "cross_entropy", x, y)
        pipe.save(path)
    for group in opt.param_groups:
        group["lr"] = 1e-4
    with Pipeline(**job) as pipe:
        pipe.load(path, optimizer_kwargs={"lr": 1e-4})
        for x, y in data[2:]:
            got = pipe.train_step(x, y)
            want = reference_step(reference, opt, "cross_entropy", x, y)
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want))
        state = pipe.state_dict()
        with pytest.raises(InvalidRequest, match="momentum_of_doom"):
            pipe.load(path, optimizer_kwargs={"momentum_of_doom": 1.0})
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value)
