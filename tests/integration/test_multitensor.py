"""Layers that take and return several tensors ((hidden, mask) tuples, flat dicts) train
through real stage processes exactly as in one process, across a live migration, and a
bad structure is a clear error naming the layer."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch

from elasticpipe import LocalPipeline, models
from elasticpipe.client.pipeline import Pipeline
from elasticpipe.coordinator.server import CoordinatorServer
from elasticpipe.errors import InvalidRequest
from elasticpipe.local.cluster import LocalCluster
from elasticpipe.stage_server.server import StageServer
from elasticpipe.v1 import stage_pb2, stage_pb2_grpc
from elasticpipe.wire import bundle, codec, compress, structure
from tests.support.clusters import fast, set_partition
from tests.support.numerics import reference_step, stage_threads
from tests.support.reference import assert_exact

ALLOWED = "tests.support.custom_models"
MASKED = f"{ALLOWED}:masked"  # 6 layers: embedding, (attention, mlp) x 2, head
SGD = {"lr": 0.1, "momentum": 0.9}
STEPS = 4

STRANGER = bytes(16)  # a 16-byte run secret, not the run's (every data header carries one)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """Three stage processes that allow the custom_models module; moves on request only."""
    with fast(3, allow_models=[ALLOWED]) as c:
        yield c


def _batches(n: int = STEPS, as_dict: bool = False) -> list[tuple[Any, torch.Tensor]]:
    """(ids int64, mask bool) (or {"ids", "mask"}) of 9 sequences of 5 tokens, and labels."""
    g = torch.Generator().manual_seed(3)
    out: list[tuple[Any, torch.Tensor]] = []
    for _ in range(n):
        ids = torch.randint(0, 13, (9, 5), generator=g)
        mask = torch.rand(9, 5, generator=g) > 0.3
        mask[:, 0] = True
        y = torch.randint(0, 3, (9,), generator=g)
        out.append(({"ids": ids, "mask": mask} if as_dict else (ids, mask), y))
    return out


def _job(kwargs: dict[str, Any], schedule: str) -> dict[str, Any]:
    """What the pipeline and its LocalPipeline share."""
    options = {"model": MASKED, "model_kwargs": kwargs, "seed": 2, "optimizer": "sgd"}
    return {**options, "optimizer_kwargs": SGD, "micro_batches": 3, "schedule": schedule}


def _local(kwargs: dict[str, Any], schedule: str = "1f1b") -> LocalPipeline:
    return LocalPipeline(**_job(kwargs, schedule), allow=[ALLOWED])


def _pipeline(
    cluster: LocalCluster, kwargs: dict[str, Any], schedule: str = "1f1b", **extra: Any
) -> Pipeline:
    return Pipeline(coordinator=cluster.coordinator, **_job(kwargs, schedule), stages=3, **extra)


def _train_with_a_migration(pipe: Pipeline, cluster: LocalCluster, as_dict: bool) -> list[float]:
    """Trains STEPS steps, moving layers after step 2 to another partition."""
    losses = []
    for step, (x, y) in enumerate(_batches(as_dict=as_dict), start=1):
        losses.append(pipe.train_step(x, y))
        if step == 2:
            before = list(pipe.partition.boundaries)
            target = [0, 1, 4, 6] if before != [0, 1, 4, 6] else [0, 3, 5, 6]
            assert set_partition(cluster, target).changed
    assert list(pipe.partition.boundaries) == target
    return losses


@pytest.mark.numerics
@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
def test_hidden_and_mask_train_through_3_stages_like_pytorch_across_a_migration(
    cluster: LocalCluster, schedule: str
) -> None:
    """Blocks passing (hidden float, mask bool) through 3 stage processes, with a live
    migration after step 2: losses and weights equal LocalPipeline's bit for bit and plain
    PyTorch's (nn.Sequential, one optimizer); predict equals the local model in eval mode."""
    reference = models.build(MASKED, seed=2, allow=[ALLOWED])
    optimizer = torch.optim.SGD(reference.parameters(), **SGD)
    want = [reference_step(reference, optimizer, "cross_entropy", x, y) for x, y in _batches()]
    with stage_threads(), _local({}, schedule) as local:
        local_losses = [local.train_step(x, y) for x, y in _batches()]
        local_state = local.state_dict()
    torch.testing.assert_close(torch.tensor(local_losses), torch.tensor(want))
    with _pipeline(cluster, {}, schedule) as pipe:
        losses = _train_with_a_migration(pipe, cluster, as_dict=False)
        state = pipe.state_dict()
        first = pipe.stage_stats()[0]
        embedding = next(t for t in first.timings if t.layer == 0)
        # A micro-batch of 3 sequences of 5: hidden 3*5*8 float32 plus mask 3*5 bool.
        assert embedding.output_bytes == 3 * 5 * 8 * 4 + 3 * 5
        x, _ = _batches(1)[0]
        predicted = pipe.predict(x)
    assert losses == local_losses
    assert_exact(state, local_state, f"{schedule}, 3 stages")
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, msg=key)
    reference.eval()
    with torch.no_grad(), stage_threads():
        torch.testing.assert_close(predicted, reference(x))


@pytest.mark.numerics
@pytest.mark.timeout(120)
def test_dict_layers_train_through_3_stages_like_locally(cluster: LocalCluster) -> None:
    """Layers passing a flat dict ({"hidden", "keep"}: a float mask that needs no gradient)
    train through 3 stages with a migration exactly as LocalPipeline does, from dict inputs
    ({"ids", "mask"})."""
    kwargs = {"as_dict": True}
    with stage_threads(), _local(kwargs) as local:
        local_losses = [local.train_step(x, y) for x, y in _batches(as_dict=True)]
        local_state = local.state_dict()
    with _pipeline(cluster, kwargs) as pipe:
        losses = _train_with_a_migration(pipe, cluster, as_dict=True)
        assert_exact(pipe.state_dict(), local_state, "dict, 3 stages")
    assert losses == local_losses


@pytest.mark.timeout(90)
def test_a_cut_carrying_only_integers_sends_an_empty_gradient(cluster: LocalCluster) -> None:
    """A first stage whose output is (ids, mask), integers only: the second stage sends back
    a gradient of no tensors (an empty tuple), the first stage's backward completes, and
    training equals LocalPipeline's bit for bit."""
    kwargs = {"clamp": True}
    with stage_threads(), _local(kwargs) as local:
        local_losses = [local.train_step(x, y) for x, y in _batches(3)]
        local_state = local.state_dict()
    with _pipeline(cluster, kwargs) as pipe:
        losses = []
        for step, (x, y) in enumerate(_batches(3), start=1):
            losses.append(pipe.train_step(x, y))
            if step == 1 and list(pipe.partition.boundaries) != [0, 1, 4, 7]:
                # after the profile's own partition
                assert set_partition(cluster, [0, 1, 4, 7]).changed
        assert list(pipe.partition.boundaries) == [0, 1, 4, 7]
        assert_exact(pipe.state_dict(), local_state, "integers at the first cut")
    assert losses == local_losses


@pytest.mark.numerics
@pytest.mark.timeout(90)
@pytest.mark.parametrize("as_dict", [False, True])
def test_predict_returns_the_structure_the_last_layer_returns(
    cluster: LocalCluster, as_dict: bool
) -> None:
    """A model ending on a block: predict through 3 stages returns its (hidden, mask) tuple
    or {"hidden", "keep"} dict, equal to the local model's; training it is refused, naming
    the last layer (the loss takes one tensor)."""
    kwargs = {"as_dict": as_dict, "head": False}
    reference = models.build(MASKED, seed=2, allow=[ALLOWED], **kwargs).eval()
    x, y = _batches(1, as_dict=as_dict)[0]
    with _pipeline(cluster, kwargs) as pipe:
        got = pipe.predict(x)
        with pytest.raises(InvalidRequest, match=r"layer 4 returned a (tuple|dict) of 2 tensors"):
            pipe.train_step(x, y)
    with torch.no_grad(), stage_threads():
        want = reference(x)
    assert type(got) is type(want)
    if as_dict:
        assert list(got) == ["hidden", "keep"]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with stage_threads(), _local(kwargs) as local:
        torch.testing.assert_close(local.predict(x), want, rtol=0, atol=0)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("nested", "layer 1 (BadStructure) returned a tuple whose element 1 is a nested tuple"),
        ("non_tensor", "layer 1 (BadStructure) returned a dict whose element 'scale' is a float"),
    ],
)
def test_bad_structures_are_errors_naming_the_layer(
    cluster: LocalCluster, kind: str, message: str
) -> None:
    """A layer returning a nested tuple or a dict holding a float fails the step with an
    error naming the layer and the element, on a stage as locally; the job still trains
    nothing wrong (the next good job runs)."""
    kwargs, message = {"kind": kind}, re.escape(message)
    x, y = torch.randn(4, 8), torch.randint(0, 3, (4,))
    with (
        LocalPipeline(
            model=f"{ALLOWED}:bad_structure", model_kwargs=kwargs, micro_batches=2, allow=[ALLOWED]
        ) as local,
        pytest.raises(InvalidRequest, match=message),
    ):
        local.train_step(x, y)
    with Pipeline(
        coordinator=cluster.coordinator,
        model=f"{ALLOWED}:bad_structure",
        model_kwargs=kwargs,
        micro_batches=2,
        stages=2,
    ) as pipe:
        with pytest.raises(InvalidRequest, match=message):
            pipe.train_step(x, y)
        with pytest.raises(InvalidRequest, match=message):
            pipe.predict(x)
        assert pipe.step == 0


@pytest.mark.timeout(60)
def test_bad_inputs_are_refused_before_anything_is_sent() -> None:
    """Nested or non-tensor inputs, and inputs of different batch sizes, are errors naming
    what is wrong, before any stage is involved (LocalPipeline shares the check)."""
    ids, mask = torch.zeros(4, 5, dtype=torch.long), torch.ones(4, 5, dtype=torch.bool)
    y = torch.zeros(4, dtype=torch.long)
    with _local({}) as local:
        with pytest.raises(InvalidRequest, match="element 1 is a nested tuple"):
            local.train_step((ids, (mask, mask)), y)
        with pytest.raises(InvalidRequest, match="element 'mask' is a list"):
            local.train_step({"ids": ids, "mask": [1, 2]}, y)
        with pytest.raises(InvalidRequest, match="share a batch dimension"):
            local.train_step((ids, mask[:3]), y)
        with pytest.raises(InvalidRequest, match="batch size of the inputs \\(4\\)"):
            local.train_step((ids, mask), y[:3])
        assert local.step == 0


@pytest.mark.timeout(90)
def test_malformed_multi_tensor_messages_get_precise_statuses(
    coordinator_server: CoordinatorServer, stage_servers: list[StageServer]
) -> None:
    """A stage refuses a structure that disagrees with its declared tensors, a descriptor that
    is not one, a part whose bytes disagree with its shape (INVALID_ARGUMENT) and parts over
    its limit together (RESOURCE_EXHAUSTED), by Deliver and by stream, and keeps serving."""
    with Pipeline(
        coordinator=coordinator_server.address,
        model="mlp",
        model_kwargs={"sizes": [12, 16, 6]},
        micro_batches=2,
        stages=2,
    ) as pipe:
        pipe.train_step(torch.randn(4, 12), torch.randint(0, 6, (4,)))
        first = next(s for s in stage_servers if s.address == pipe.partition.addresses[0])
        stub = stage_pb2_grpc.StageServiceStub(grpc.insecure_channel(first.address))
        value = (torch.ones(2, 3), torch.ones(2, dtype=torch.bool))
        raw = bundle.data(value)

        def head(**changes: Any) -> stage_pb2.DataHeader:
            h = stage_pb2.DataHeader(secret=STRANGER, epoch=pipe.partition.epoch, run=1)
            bundle.describe(h, value)
            for name, change in changes.items():
                setattr(h, name, change)
            return h

        def refused(h: stage_pb2.DataHeader, data: bytes = raw) -> grpc.RpcError:
            message = stage_pb2.DataMessage(slot=stage_pb2.INPUT, header=h, data=data)
            with pytest.raises(grpc.RpcError) as unary:
                stub.Deliver(message, timeout=5)
            chunks = [stage_pb2.DataChunk(header=h), stage_pb2.DataChunk(data=data)]
            with pytest.raises(grpc.RpcError) as stream:
                stub.Forward(iter(chunks), timeout=5)
            assert unary.value.code() == stream.value.code()
            return unary.value

        err = refused(head(structure='{"tuple":3}'))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "holds 3 tensors but 2 were declared" in err.details()
        err = refused(head(structure='{"dict":["a","a"]}'))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "repeats a key" in err.details()
        err = refused(head(structure="[2]"))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "'[2]'" in err.details()
        bad = head()
        bad.parts[0].nbytes = 23
        err = refused(bad, raw[:-1])
        assert (
            err.code() == grpc.StatusCode.INVALID_ARGUMENT and "23 were declared" in err.details()
        )
        err = refused(head(), raw + b"\0")
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "26" in err.details()
        big = head()
        for meta in big.parts:  # each part under the stage's 1 MiB limit, together over it
            meta.CopyFrom(codec.tensor_meta(torch.empty(192 * 1024, dtype=torch.float32)))
        err = refused(big, b"")
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and str(1 << 20) in err.details()
        assert pipe.train_step(torch.randn(4, 12), torch.randint(0, 6, (4,))) > 0


def _with_cuts(model: torch.nn.Sequential, boundaries: list[int]) -> torch.nn.Module:
    """The local reference of a bf16 wire: each float32 tensor of the (hidden, mask) tuple
    or dict rounded at each cut, forward and backward; integers and bools untouched."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        return compress.cast(t, "bf16") if t.dtype == torch.float32 else t

    class Cut(torch.nn.Module):
        def forward(self, x: Any) -> Any:
            return structure.apply(x, cast)

    layers: list[torch.nn.Module] = []
    for i, layer in enumerate(model):
        if i in boundaries[1:-1]:
            layers.append(Cut())
        layers.append(layer)
    return torch.nn.Sequential(*layers)


@pytest.mark.numerics
@pytest.mark.timeout(120)
@pytest.mark.parametrize("as_dict", [False, True])
def test_bf16_wire_and_recompute_with_several_tensors_equal_the_local_cast(
    cluster: LocalCluster, as_dict: bool
) -> None:
    """wire_dtype="bf16" with every layer recomputed: each floating tensor of a tuple or
    dict is rounded at the cuts (the bool mask and the ids travel as they are), and the
    weights equal a local model rounding at the same cuts."""
    kwargs = {"as_dict": as_dict}
    batches = _batches(3, as_dict=as_dict)
    with _pipeline(cluster, kwargs, wire_dtype="bf16", recompute=True) as pipe:
        pipe.train_step(*batches[0])
        boundaries = list(pipe.partition.boundaries)
        for x, y in batches[1:]:
            pipe.train_step(x, y)
        state = pipe.state_dict()
    assert list(pipe.partition.boundaries) == boundaries and len(boundaries) == 4
    reference = _with_cuts(models.build(MASKED, seed=2, allow=[ALLOWED], **kwargs), boundaries)
    plain = models.build(MASKED, seed=2, allow=[ALLOWED], **kwargs)
    for model in (reference, plain):
        optimizer = torch.optim.SGD(model.parameters(), **SGD)
        for x, y in batches:
            reference_step(model, optimizer, "cross_entropy", x, y)
    want = dict(zip(plain.state_dict(), reference.state_dict().values(), strict=True))
    for key, value in want.items():
        torch.testing.assert_close(state[key], value, msg=key)
    assert any(not torch.equal(want[k], v) for k, v in plain.state_dict().items())
