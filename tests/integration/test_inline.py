"""Small inputs and targets travel in the RunSteps (``RunStepRequest.inline``): no data
message from the client, the same training bit for bit as on the data path, and a RunStep
whose inline data is not its run's is refused without harming the stage."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch

from elasticpipe.client import driver
from elasticpipe.local.cluster import LocalCluster
from elasticpipe.transport import rpc
from elasticpipe.transport.sending import Outgoing, data_message
from elasticpipe.v1 import stage_pb2, stage_pb2_grpc
from tests.support import clusters, jobs

pytestmark = pytest.mark.timeout(120)

KWARGS = {"sizes": [8, 12, 12, 4]}
STEPS = 3
MICRO_BATCHES = 2
INPUT_BYTES = 8 * 8 * 4  # a step's inputs: 8 samples of 8 float32
TARGET_BYTES = 8 * 8  # its targets: 8 int64


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with clusters.quiet(2) as c:
        yield c


def _train(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch, inline_bytes: int, stages: int = 2
) -> tuple[list[float], dict[str, torch.Tensor], torch.Tensor, list[str]]:
    """Trains a fresh job with ``driver.INLINE_BYTES`` at ``inline_bytes``; the losses, the
    weights, a prediction, and the method of every data message the client sent."""
    sent: list[str] = []
    send = driver.StageClients.send

    def counted(self: driver.StageClients, address: str, msg: Outgoing, timeout: float) -> Any:
        sent.append(msg.method)
        return send(self, address, msg, timeout)

    with monkeypatch.context() as patch:
        patch.setattr(driver, "INLINE_BYTES", inline_bytes)
        patch.setattr(driver.StageClients, "send", counted)
        with jobs.mlp(
            cluster.coordinator,
            **KWARGS,
            optimizer_kwargs={"lr": 0.05},
            micro_batches=MICRO_BATCHES,
            stages=stages,
        ) as pipe:
            losses = [pipe.train_step(x, y) for x, y in jobs.mlp_batches(STEPS)]
            predicted = pipe.predict(jobs.mlp_batches(STEPS)[0][0])
            return losses, pipe.state_dict(), predicted, sent


def test_small_data_rides_in_the_run_steps_and_trains_bit_for_bit_alike(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All inline, targets only, none: the same losses, weights and predictions; the
    client sends a data message exactly for what did not ride in a RunStep."""
    inline = _train(cluster, monkeypatch, driver.INLINE_BYTES)
    targets_only = _train(cluster, monkeypatch, TARGET_BYTES)
    none = _train(cluster, monkeypatch, 0)
    assert inline[3] == [], "small inputs and targets travel in the RunSteps"
    per_step = ["Forward", "Targets"] * MICRO_BATCHES
    assert targets_only[3] == ["Forward"] * (MICRO_BATCHES * STEPS + MICRO_BATCHES)
    assert none[3] == per_step * STEPS + ["Forward"] * MICRO_BATCHES  # (predict: inputs)
    for other in (targets_only, none):
        assert other[0] == inline[0]
        assert other[1].keys() == inline[1].keys()
        assert all(torch.equal(other[1][k], inline[1][k]) for k in inline[1])
        assert torch.equal(other[2], inline[2])
    assert INPUT_BYTES + TARGET_BYTES <= driver.INLINE_BYTES


def test_a_one_stage_chain_takes_inputs_and_targets_in_one_run_step(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first stage is the last: its RunSteps carry both, and train as the data path."""
    inline = _train(cluster, monkeypatch, driver.INLINE_BYTES, stages=1)
    none = _train(cluster, monkeypatch, 0, stages=1)
    assert inline[3] == [] and len(none[3]) == 2 * MICRO_BATCHES * STEPS + MICRO_BATCHES
    assert none[0] == inline[0] and torch.equal(none[2], inline[2])
    assert all(torch.equal(none[1][k], v) for k, v in inline[1].items())


def _run_step(address: str, request: stage_pb2.RunStepRequest) -> grpc.RpcError:
    with rpc.channel(address) as channel:
        stub = stage_pb2_grpc.StageServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.RunStep(request, timeout=10)
    return info.value


def test_inline_data_of_another_run_is_refused_and_training_goes_on(
    cluster: LocalCluster,
) -> None:
    """A RunStep carrying data under another secret, or a gradient, is refused as invalid
    (naming what is wrong) before any run begins, and the stages then train as before; one
    whose target's loss scale is out of range fails its run, naming the scale."""
    with jobs.mlp(cluster.coordinator, **KWARGS, micro_batches=MICRO_BATCHES, stages=2) as pipe:
        x, y = jobs.mlp_batches(STEPS)[0]
        pipe.train_step(x, y)
        address = pipe.partition.addresses[0]
        epoch, secret = pipe.partition.epoch, bytes(range(16))
        run = (pipe._client << 40) + 10**6
        stranger = data_message(Outgoing("Forward", epoch, run, 2, 0, x[:4], secret=bytes(16)))
        gradient = data_message(Outgoing("Backward", epoch, run, 2, 0, x[:4], secret=secret))
        for message, named in ((stranger, "another secret"), (gradient, "only INPUT and TARGET")):
            request = stage_pb2.RunStepRequest(
                epoch=epoch,
                run=run,
                step=2,
                micro_batches=MICRO_BATCHES,
                mode=stage_pb2.TRAIN,
                schedule=stage_pb2.ONE_F_ONE_B,
                timeout_s=5,
                client=pipe._client,
                secret=secret,
                inline=[message],
            )
            error = _run_step(address, request)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
            assert named in str(error.details()), error.details()
        before = pipe.state_dict()
        loss = pipe.train_step(x, y)
        assert math.isfinite(loss) and any(  # a real step: the weights moved
            not torch.equal(before[k], v) for k, v in pipe.state_dict().items()
        )
        # checked once the run has begun, as data is: a target's loss scale in (0, 1] (the
        # run, far ahead of the client's, begins and fails: the last thing this job does)
        last = pipe.partition.addresses[-1]
        target = data_message(Outgoing("Targets", epoch, run, 3, 0, y[:4], 1.5, secret))
        request.step = 3
        del request.inline[:]
        request.inline.append(target)
        error = _run_step(last, request)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert "loss_scale in (0, 1] (got 1.5)" in str(error.details()), error.details()
