"""Authorised but hostile callers cannot starve a server: per-peer caps, stream timeouts
that give back mailbox room, long waits in a capped pool, and heartbeats and admins that
still answer in time (real TLS cluster, caps lowered through the environment)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import torch

from elasticpipe.client.pipeline import Pipeline
from elasticpipe.local.cluster import LocalCluster
from elasticpipe.security import admission
from elasticpipe.transport import rpc
from elasticpipe.v1 import (
    coordinator_pb2,
    coordinator_pb2_grpc,
    job_pb2,
    stage_pb2,
    stage_pb2_grpc,
    tensor_pb2,
)

pytestmark = pytest.mark.timeout(150)
PER_PEER = 10
STREAM_S = 1.5
WATCH_S = 2.0
KWARGS = {"sizes": [8, 16, 4]}

STRANGER = bytes(16)  # a 16-byte run secret, not the run's (every data header carries one)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """Two TLS stages and a coordinator with low caps, after one training step."""
    env = {
        admission.ENV_PER_PEER: str(PER_PEER),
        admission.ENV_FIRST_MESSAGE_S: str(STREAM_S),
        admission.ENV_IDLE_S: str(STREAM_S),
        admission.ENV_WATCH_S: str(WATCH_S),
    }
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)  # the processes of the cluster inherit them
        with LocalCluster(stages=2, tls=True, auto_rebalance=False, dead_after_s=3) as c:
            with Pipeline(
                coordinator=c.coordinator, model="mlp", model_kwargs=KWARGS, tls=c.client_tls
            ) as pipe:
                pipe.train_step(torch.randn(4, 8), torch.randint(0, 4, (4,)))
            yield c


def _never(hold: threading.Event) -> Iterator[stage_pb2.DataChunk]:
    hold.wait()
    yield from ()


def _header_then_nothing(
    header: stage_pb2.DataHeader, hold: threading.Event
) -> Iterator[stage_pb2.DataChunk]:
    yield stage_pb2.DataChunk(header=header)
    hold.wait()


def _wait_done(futures: list[grpc.Future], n: int, within: float) -> list[grpc.Future]:  # type: ignore[type-arg]
    """The futures done once ``n`` are (or ``within`` seconds passed)."""
    deadline = time.monotonic() + within
    while sum(f.done() for f in futures) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    return [f for f in futures if f.done()]


def _code(future: grpc.Future) -> grpc.StatusCode:  # type: ignore[type-arg]
    try:
        future.result()
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def test_silent_streams_are_capped_per_peer_then_cut(cluster: LocalCluster) -> None:
    """A stage certificate opening more Forward streams than its cap gets
    RESOURCE_EXHAUSTED naming the cap; an admin's GetStats still answers at once; the
    streams it holds are cancelled once their first message is overdue, which frees its
    places again."""
    address = cluster.stage_addresses[0]
    evil = stage_pb2_grpc.StageServiceStub(rpc.channel(address, cluster.tls_of("evil")))
    admin = stage_pb2_grpc.StageServiceStub(rpc.channel(address, cluster.admin_tls))
    hold = threading.Event()
    try:
        started = time.monotonic()
        futures = [evil.Forward.future(_never(hold), timeout=60) for _ in range(PER_PEER + 6)]
        refused = _wait_done(futures, 6, STREAM_S)
        t = time.monotonic()
        admin.GetStats(stage_pb2.StatsRequest(), timeout=2)
        assert time.monotonic() - t < 1.0
        assert len(refused) == 6
        for f in refused:
            assert f.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"at most {PER_PEER} per peer" in f.details()
        codes = [_code(f) for f in futures if f not in refused]
        assert time.monotonic() - started < STREAM_S + 3.0  # cut, not waited out
        assert set(codes) == {grpc.StatusCode.CANCELLED}, codes
        # Their places are free again: a new stream is admitted (and cut in turn).
        again = evil.Forward.future(_never(hold), timeout=60)
        assert _code(again) == grpc.StatusCode.CANCELLED
    finally:
        hold.set()


def test_an_idle_stream_gives_its_mailbox_room_back(cluster: LocalCluster) -> None:
    """Headers declaring two big tensors hold their mailbox room while their streams are
    open (a third is refused: mailbox full); once the idle streams are cut, the room is
    free again."""
    address = cluster.stage_addresses[0]
    evil = stage_pb2_grpc.StageServiceStub(rpc.channel(address, cluster.tls_of("evil")))
    admin = stage_pb2_grpc.StageServiceStub(rpc.channel(address, cluster.admin_tls))
    stats = admin.GetStats(stage_pb2.StatsRequest(), timeout=10)
    elements = ((1 << 31) - 1024) // 4  # two fit in the 4 GiB mailbox, three do not
    header = stage_pb2.DataHeader(
        secret=STRANGER,
        epoch=stats.epoch,
        run=(stats.state.fence + 1) << 40,
        micro_batch=0,
        meta=tensor_pb2.TensorMeta(dtype=tensor_pb2.FLOAT32, shape=[elements], nbytes=elements * 4),
    )
    hold = threading.Event()
    try:
        holders = [evil.Forward.future(_header_then_nothing(header, hold)) for _ in range(2)]
        time.sleep(0.5)
        third = evil.Forward.future(_header_then_nothing(header, hold), timeout=30)
        assert _code(third) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "mailbox full" in third.details()
        assert [_code(f) for f in holders] == [grpc.StatusCode.CANCELLED] * 2
        fourth = evil.Forward.future(_header_then_nothing(header, hold), timeout=30)
        assert _code(fourth) == grpc.StatusCode.CANCELLED  # admitted, then cut when idle
    finally:
        hold.set()


def test_long_waits_share_a_capped_pool_and_heartbeats_go_on(cluster: LocalCluster) -> None:
    """SetupJob calls that wait for 4096 stages take at most the long-poll pool's places
    (the rest are refused at once); an admin's Status answers in time and no stage is
    declared dead for missed heartbeats; WatchPartition ends by itself."""
    client = coordinator_pb2_grpc.CoordinatorServiceStub(
        rpc.channel(cluster.coordinator, cluster.client_tls)
    )
    admin = coordinator_pb2_grpc.CoordinatorServiceStub(
        rpc.channel(cluster.coordinator, cluster.admin_tls)
    )
    job = job_pb2.JobSpec(model="mlp", model_kwargs_json='{"sizes":[8,4]}', micro_batches=1)
    request = coordinator_pb2.SetupJobRequest(job=job, num_stages=4096, wait_s=30)
    futures = [client.SetupJob.future(request, timeout=40) for _ in range(PER_PEER)]
    try:
        refused = _wait_done(futures, PER_PEER - 8, 5.0)
        time.sleep(0.5)  # no more are refused
        assert refused == [f for f in futures if f.done()]
        assert len(refused) == PER_PEER - 8  # MAX_LONG_POLLS
        for f in refused:
            assert f.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "SetupJob refused" in f.details()
        deadline = time.monotonic() + 4.5  # past --dead-after
        while time.monotonic() < deadline:
            t = time.monotonic()
            status = admin.Status(coordinator_pb2.StatusRequest(), timeout=2)
            assert time.monotonic() - t < 1.0
            assert all(s.alive for s in status.stages), status.stages
            time.sleep(0.5)
    finally:
        for f in futures:
            f.cancel()
    time.sleep(0.5)
    started = time.monotonic()
    watched = list(
        client.WatchPartition(coordinator_pb2.GetPartitionRequest(newer_than=0), timeout=30)
    )
    assert len(watched) == 1  # the current partition, then the stream ends
    assert time.monotonic() - started < WATCH_S + 2.0
