"""Beyond the role table (mutual TLS): only the client the coordinator granted the job
drives it, a snapshot copy comes only from its source stage, exports, restores and copies
are checked before a byte of a layer is assembled, and a family certificate cannot take
over a name held by an individual one. Real coordinator and stage processes."""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import torch

from elasticpipe.local.cluster import LocalCluster
from elasticpipe.security import tls
from elasticpipe.stage_server.protocol import ABORT_WINDOW
from elasticpipe.transport import rpc
from elasticpipe.v1 import (
    coordinator_pb2,
    coordinator_pb2_grpc,
    stage_pb2,
    stage_pb2_grpc,
    tensor_pb2,
)
from elasticpipe.wire import codec, layer_state
from tests.support.clusters import fast
from tests.support.scenario import STEPS, Trainer, batch, check, history, pipeline

pytestmark = pytest.mark.timeout(180)

STRANGER = bytes(16)  # a 16-byte run secret, not the run's (every data header carries one)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """Three chain stages and a spare, on mutual TLS."""
    with fast(4, tls=True) as c:
        yield c


def _stage(address: str, who: tls.TLS | None) -> stage_pb2_grpc.StageServiceStub:
    return stage_pb2_grpc.StageServiceStub(rpc.channel(address, who))


def _refused(call: Callable[[], object], code: grpc.StatusCode, text: str) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()
    error = info.value
    assert error.code() == code, error.details()
    assert text in error.details(), error.details()
    return str(error.details())


def _data(epoch: int, run: int) -> stage_pb2.DataMessage:
    meta, chunks = codec.tensor_chunks(torch.zeros(4, 12))
    header = stage_pb2.DataHeader(
        secret=STRANGER, epoch=epoch, run=run, step=2, micro_batch=0, meta=meta
    )
    return stage_pb2.DataMessage(slot=stage_pb2.INPUT, header=header, data=b"".join(chunks))


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _pieces(
    layer: int, data: bytes, total: int = 0, last: bool = True
) -> list[stage_pb2.LayerChunk]:
    """A layer of one uint8 tensor declared as ``total`` bytes, of which ``data`` is sent."""
    state = layer_state.pack({"t": torch.zeros(0, dtype=torch.uint8)}).state
    meta = tensor_pb2.TensorMeta(dtype=tensor_pb2.UINT8, shape=[total or len(data)])
    meta.nbytes = total or len(data)
    pieces = [
        stage_pb2.LayerChunk(
            layer=layer, header=stage_pb2.LayerHeader(state=state, tensors=[meta])
        ),
        stage_pb2.LayerChunk(layer=layer, tensor=0, data=data, crc32=zlib.crc32(data)),
    ]
    if last:
        digest = layer_state.new_hasher(state + data).digest()
        pieces.append(stage_pb2.LayerChunk(layer=layer, digest=digest))
    return pieces


def test_a_second_client_certificate_can_neither_stall_nor_fence_the_job(
    cluster: LocalCluster,
) -> None:
    """Another client certificate ("mallory") reads the fence and sends the attack: an
    AbortStep of far-future runs with a huge generation, RunStep/CommitStep/FetchOutput
    and data of the running job. Every one is refused naming the holder; the real
    client's own far-future abort is refused by the window; the fence does not move, and
    the job's losses and weights are exactly those of an undisturbed run."""
    mallory = cluster.tls_of("mallory", "client")
    losses: dict[int, float] = {}
    with pipeline(cluster, tls=cluster.client_tls) as pipe:
        losses[1] = pipe.train_step(*batch(1))
        epoch = pipe.partition.epoch
        for address in pipe.partition.addresses:
            stub = _stage(address, mallory)
            fence = stub.GetStats(stage_pb2.StatsRequest(), timeout=5).state.fence
            assert fence > 0
            run = (fence << 40) + 2
            attacks: list[Callable[[], object]] = [
                lambda stub=stub, fence=fence: stub.AbortStep(
                    stage_pb2.AbortStepRequest(
                        run=((fence + 17) << 40) - 1, client=2**62, reason="x"
                    ),
                    timeout=10,
                ),
                lambda stub=stub, run=run, fence=fence: stub.AbortStep(
                    stage_pb2.AbortStepRequest(run=run, client=fence), timeout=10
                ),
                lambda stub=stub, fence=fence: stub.RunStep(
                    stage_pb2.RunStepRequest(
                        epoch=epoch,
                        run=((fence + 16) << 40) + 1,
                        step=2,
                        micro_batches=1,
                        mode=stage_pb2.TRAIN,
                        schedule=stage_pb2.GPIPE,
                        timeout_s=5,
                        client=fence + 16,
                    ),
                    timeout=10,
                ),
                lambda stub=stub, run=run, fence=fence: stub.CommitStep(
                    stage_pb2.CommitStepRequest(epoch=epoch, run=run, step=2, client=fence),
                    timeout=10,
                ),
                lambda stub=stub, run=run: list(
                    stub.FetchOutput(stage_pb2.FetchOutputRequest(run=run), timeout=10)
                ),
                lambda stub=stub, run=run: stub.Deliver(_data(epoch, run), timeout=10),
                lambda stub=stub: list(
                    stub.ExportLayers(stage_pb2.ExportLayersRequest(layers=[]), timeout=10)
                ),
            ]
            for attack in attacks:
                details = _refused(attack, grpc.StatusCode.PERMISSION_DENIED, "'mallory'")
                assert "'client'" in details  # names the holder
            # The holder itself cannot void future runs either: at most a window ahead.
            own = _stage(address, cluster.client_tls)
            _refused(
                lambda own=own, fence=fence: own.AbortStep(
                    stage_pb2.AbortStepRequest(run=(fence << 40) + 10 * ABORT_WINDOW, client=fence),
                    timeout=10,
                ),
                grpc.StatusCode.INVALID_ARGUMENT,
                f"at most {ABORT_WINDOW} past",
            )
            assert stub.GetStats(stage_pb2.StatsRequest(), timeout=5).state.fence == fence
        for step in range(2, STEPS + 1):
            started = time.monotonic()
            losses[step] = pipe.train_step(*batch(step))
            assert time.monotonic() - started < 20, f"step {step} stalled"
        check(losses, pipe.state_dict())


def test_a_stage_joining_by_recovery_learns_the_client_from_the_coordinator(
    cluster: LocalCluster,
) -> None:
    """A chain stage is killed mid-training: the spare joins by recovery without having
    seen the coordinator's Fence, asks it once which client holds the job, and takes that
    client's steps; training ends exactly as the failure-free run."""
    with pipeline(cluster, tls=cluster.client_tls) as pipe:
        victim: list[str] = []
        chain: set[str] = set()  # before the kill (earlier tests may have renamed it)

        def before(step: int) -> None:
            if step == 5:
                chain.update(cluster.name_of(a) for a in pipe.partition.addresses)
                victim.append(cluster.name_of(pipe.partition.addresses[1]))
                cluster.kill(victim[0])

        trainer = Trainer(pipe, before).start()
        state = trainer.finish()
        check(trainer.losses, state)
        assert history(cluster)[-1].kind == "recovery"
        joined = [cluster.name_of(a) for a in pipe.partition.addresses]
        spare = next(n for n in joined if n not in chain)
        assert "job_client_learned" in (cluster.log_dir / f"{spare}.log").read_text()
    cluster.add_stage(victim[0])


def test_snapshot_copies_are_checked_before_a_layer_is_assembled(cluster: LocalCluster) -> None:
    """A PushSnapshot from an unregistered stage certificate with a wrong job is refused
    at its first message (the stage's memory stays flat while 320 MB are offered); a chain
    stage cannot push under another stage's id; the source's own pushes may hold only its
    layers, each once. The chain's own copies still arrive."""
    with pipeline(cluster, tls=cluster.client_tls, snapshot_every=1) as pipe:
        for step in (1, 2):
            pipe.train_step(*batch(step))
        partition = pipe.partition
        refs, bounds = list(partition.stages), list(partition.boundaries)
        target = refs[1]
        target_name = cluster.name_of(target.address)
        # the copies are pushed after the commit, in the background: they arrive within
        # seconds (one full-suite run on a loaded machine read the stats before they had)
        stats = _stage(target.address, cluster.admin_tls)
        deadline = time.monotonic() + 10
        while not any(
            h.peer_copy for h in stats.GetStats(stage_pb2.StatsRequest(), timeout=5).snapshots
        ):
            assert time.monotonic() < deadline, "the chain's copies must arrive"
            time.sleep(0.05)

        evil = _stage(target.address, cluster.tls_of("evil", "stage"))
        blob = b"\x01" * (8 << 20)

        def flood() -> Iterator[stage_pb2.SnapshotChunk]:
            yield stage_pb2.SnapshotChunk(job_id="not-the-job", step=1, source="nobody")
            for layer in range(40):
                for piece in _pieces(layer, blob[: 4 << 20], len(blob), last=False):
                    yield stage_pb2.SnapshotChunk(chunk=piece)

        pid = cluster.procs[target_name].pid
        before = _rss_mb(pid)
        started = time.monotonic()
        _refused(
            lambda: evil.PushSnapshot(flood(), timeout=60),
            grpc.StatusCode.FAILED_PRECONDITION,
            "not-the-job",
        )
        assert time.monotonic() - started < 10
        assert _rss_mb(pid) - before < 64, "the stage buffered a refused copy"

        job = partition.job_id
        # stage 2's certificate pushing to stage 1 as if it were stage 0
        impostor = _stage(target.address, cluster.tls_of(cluster.name_of(refs[2].address)))
        header = stage_pb2.SnapshotChunk(job_id=job, step=2, source=refs[0].stage_id)
        _refused(
            lambda: impostor.PushSnapshot(iter([header, header]), timeout=10),
            grpc.StatusCode.PERMISSION_DENIED,
            "certificate names",
        )
        source = _stage(target.address, cluster.tls_of(cluster.name_of(refs[0].address)))
        outside = bounds[1]  # stage 1's first layer: not stage 0's
        _refused(
            lambda: source.PushSnapshot(
                iter(
                    [header]
                    + [stage_pb2.SnapshotChunk(chunk=p) for p in _pieces(outside, b"x", 1 << 30)]
                ),
                timeout=10,
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            f"holds layer {outside}, outside the layers it owns [0, {bounds[1]})",
        )
        twice = [header] + [stage_pb2.SnapshotChunk(chunk=p) for p in 2 * _pieces(0, b"layer")]
        _refused(
            lambda: source.PushSnapshot(iter(twice), timeout=10),
            grpc.StatusCode.INVALID_ARGUMENT,
            "layer 0 sent twice",
        )
        for step in range(3, 5):  # the job goes on
            pipe.train_step(*batch(step))


def test_exports_and_restores_refuse_bad_layers_first(cluster: LocalCluster) -> None:
    """ExportLayers refuses a layer asked for twice; a checkpoint stream's layer that the
    stage does not own is refused at its first chunk (not once a 1 GiB blob would have
    been assembled). The job goes on unchanged."""
    with pipeline(cluster, tls=cluster.client_tls) as pipe:
        losses = {1: pipe.train_step(*batch(1))}
        partition = pipe.partition
        first = _stage(partition.addresses[0], cluster.client_tls)
        _refused(
            lambda: list(
                first.ExportLayers(stage_pb2.ExportLayersRequest(layers=[0, 1, 0]), timeout=10)
            ),
            grpc.StatusCode.INVALID_ARGUMENT,
            "layers [0] asked for more than once",
        )
        exported = list(first.ExportLayers(stage_pb2.ExportLayersRequest(layers=[0]), timeout=10))
        # no CRC-32 per chunk: the layer's digest is the one checksum, and it holds
        assert exported[0].header.unchecked_chunks
        assert exported[-1].digest and not any(c.crc32 for c in exported if c.data)
        (got,) = layer_state.receive(iter(exported), 1 << 30, 1 << 30)
        assert got.layer == 0 and got.packed.tensors

        coordinator = coordinator_pb2_grpc.CoordinatorServiceStub(
            rpc.channel(cluster.coordinator, cluster.client_tls)
        )
        begun = coordinator.BeginRestore(
            coordinator_pb2.RestoreBeginRequest(job_id=partition.job_id, client=pipe._client),
            timeout=60,
        )
        try:
            foreign = partition.boundaries[1]  # the second stage's first layer
            stream = [
                stage_pb2.RestoreChunk(epoch=begun.epoch, chunk=piece)
                for piece in _pieces(foreign, b"x" * 1000, 1 << 30, last=False)
            ]
            _refused(
                lambda: first.RestoreLayers(iter(stream), timeout=10),
                grpc.StatusCode.FAILED_PRECONDITION,
                f"does not own layer {foreign}",
            )
        finally:
            coordinator.EndRestore(
                coordinator_pb2.RestoreEndRequest(
                    job_id=partition.job_id, epoch=begun.epoch, commit=False
                ),
                timeout=60,
            )
        for step in range(2, 4):
            losses[step] = pipe.train_step(*batch(step))
        check(losses, pipe.state_dict(), upto=3)


def test_a_family_certificate_cannot_take_over_an_individual_name(cluster: LocalCluster) -> None:
    """``stage-*`` covers ``stage-0``, but stage-0 registered with its own certificate:
    the family's Register of that name is refused; a name nobody holds is fine."""
    assert cluster.certs is not None
    tls.issue(cluster.certs, "stage-*", "stage", file_name="stage-family")
    family = tls.TLS(
        str(cluster.certs / "stage-family.pem"),
        str(cluster.certs / "stage-family.key"),
        str(cluster.certs / "ca.pem"),
    )
    stub = coordinator_pb2_grpc.CoordinatorServiceStub(rpc.channel(cluster.coordinator, family))
    alive = {s.name for s in cluster.status().stages if s.alive}
    held = sorted(n for n in alive if n.startswith("stage-"))[0]
    _refused(
        lambda: stub.Register(
            coordinator_pb2.RegisterRequest(name=held, address="127.0.0.1:1"), timeout=10
        ),
        grpc.StatusCode.PERMISSION_DENIED,
        f"cannot register as {held!r}",
    )
    assert {s.name for s in cluster.status().stages if s.alive} >= alive
    reply = stub.Register(
        coordinator_pb2.RegisterRequest(name="stage-family-0", address="127.0.0.1:1"),
        timeout=10,
    )
    assert reply.stage_id
