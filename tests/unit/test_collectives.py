"""The process-group engine's pieces of the reduction (``collectives="gloo"``): a piece
packed into bytes comes back bit for bit, whatever its dtypes; a piece of the wrong size,
a short one (a receive leaves the rest of its zeroed buffer) and a garbled one are refused
by name; a generation given up on is not opened again, nor by a run left behind; the
coordinator's rendezvous listens on its listen host only, is refused with TLS, and is
served again by a coordinator that takes the job over (restarted, or a standby that now
leads) on its own host; NCCL is refused until it has run on GPUs."""

from __future__ import annotations

import socket
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from elasticpipe.coordinator.rendezvous import REFUSED, Rendezvous
from elasticpipe.errors import InvalidRequest, StepAborted
from elasticpipe.stage_server.collectives import ProcessGroups
from elasticpipe.stage_server.reducing import TRAILER, _packed, piece
from elasticpipe.stage_server.reduction import GroupReduction, Piece, Send, chunk_bounds, cut
from elasticpipe.training.job import JobConfig

pytestmark = pytest.mark.timeout(30)


def _reduction() -> tuple[GroupReduction, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    like = [  # a bf16 run of odd length between float32 ones: the runs are not aligned
        torch.randn(5, generator=g),
        torch.randn(3, generator=g).to(torch.bfloat16),
        torch.randn(4, generator=g),
    ]
    return GroupReduction(0, 0, [range(0, 1), range(1, 2)], 2, like), like


@pytest.mark.parametrize("chunk", [0, 1])
def test_a_packed_piece_comes_back_bit_for_bit(chunk: int) -> None:
    reduction, like = _reduction()
    lo, hi = chunk_bounds(12, 2)[chunk]
    tensors = tuple(cut(like, lo, hi))
    present = tuple(i % 2 == 0 for i in range(len(tensors)))
    sent = Piece(0, chunk, 1, None, tensors, present)
    got = piece(_packed(Send(0, sent)), reduction, chunk, 1, None)
    assert got.present == present and (got.chunk, got.sender) == (chunk, 1)
    assert [t.dtype for t in got.tensors] == [t.dtype for t in tensors]
    assert all(torch.equal(a, b) for a, b in zip(got.tensors, tensors, strict=True))


def test_a_piece_of_the_wrong_size_a_short_or_a_garbled_one_is_refused_by_name() -> None:
    reduction, like = _reduction()
    data = _packed(Send(0, Piece(0, 0, 1, None, tuple(cut(like, 0, 6)), (True, True))))
    assert data.numel() == 24 + TRAILER.size
    with pytest.raises(InvalidRequest, match=r"replica 1: 35 torch.uint8 elements, expected 36"):
        piece(data[:-1], reduction, 0, 1, None)
    short = torch.zeros_like(data)  # what a receive leaves of a piece 10 bytes short
    short[:10] = data[:10]
    with pytest.raises(InvalidRequest, match=r"trailer says 0 bytes .*\(a short or garbled"):
        piece(short, reduction, 0, 1, None)
    garbled = data.clone()
    garbled[3] ^= 1
    with pytest.raises(InvalidRequest, match="the payload is 24 bytes with CRC-32"):
        piece(garbled, reduction, 0, 1, None)


def test_a_generation_given_up_on_is_not_opened_again() -> None:
    groups = ProcessGroups()
    groups.use("job", 3, 7)
    old = groups.current()
    groups.drop()  # a run failed on them
    with pytest.raises(StepAborted, match=r"generation 7 \(epoch 3\) were given up here"):
        groups.use("job", 3, 7)
    groups.use("job", 3, 9)  # the client's next generation
    # the failed run's engine, still running, cannot open (or take) the new one's groups
    with pytest.raises(StepAborted, match="generation 7 are given up"):
        groups.group(old, "127.0.0.1:1", "127.0.0.1", 0, 0, 2, 1.0)
    # nor give the new one up when it fails at last
    groups.drop(old)
    assert groups.current() == ("job", 3, 9)
    groups.use("job", 3, 9)


def test_nccl_is_refused_until_it_has_run_on_gpus() -> None:
    with pytest.raises(InvalidRequest, match="collectives='nccl' is not built yet"):
        JobConfig(model="mlp", collectives="nccl")
    assert JobConfig(model="mlp", collectives="gloo").collectives == "gloo"


def _cluster(**fields: Any) -> Any:
    config = SimpleNamespace(tls=fields.pop("tls", None), listen="127.0.0.1:0")
    return SimpleNamespace(
        config=config, **{"elected": False, "address": "127.0.0.1:7100", **fields}
    )


def test_the_rendezvous_is_refused_with_tls() -> None:
    job = JobConfig(model="mlp", collectives="gloo")
    with pytest.raises(InvalidRequest, match="requires mutual TLS"):
        Rendezvous(_cluster(tls=object())).for_job(job)
    restored = Rendezvous(_cluster(tls=object())).restored(replace(job, rendezvous="a:1"))
    assert restored.rendezvous == REFUSED
    plain = JobConfig(model="mlp", rendezvous="10.0.0.1:1")  # a client's is ignored
    assert Rendezvous(_cluster()).for_job(plain).rendezvous == ""


def test_a_restarted_coordinator_serves_the_rendezvous_on_the_same_port() -> None:
    with socket.socket() as probe:  # a free port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    job = JobConfig(model="mlp", collectives="gloo", rendezvous=f"127.0.0.1:{port}")
    assert Rendezvous(_cluster()).restored(job).rendezvous == f"127.0.0.1:{port}"
    rendezvous = Rendezvous(_cluster())  # (its store lives as long as it does)
    served = rendezvous.for_job(JobConfig(model="mlp", collectives="gloo"))
    assert served.rendezvous.startswith("127.0.0.1:") and not served.rendezvous.endswith(":0")
    port = int(served.rendezvous.rpartition(":")[2])
    socket.create_connection(("127.0.0.1", port), timeout=5).close()
    # bound to the listen host only: another loopback address (every interface's
    # listener would take it) is refused
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", port), timeout=5)


def test_a_leader_that_takes_over_serves_the_rendezvous_on_its_own_host() -> None:
    """The job's rendezvous was the old leader's, on another host: the new leader serves
    one on its own (the stages learn it from their heartbeats), and stops serving it when
    its leadership ends."""
    job = JobConfig(model="mlp", collectives="gloo", rendezvous="10.0.0.9:4000")
    rendezvous = Rendezvous(_cluster(elected=True))
    served = rendezvous.restored(job).rendezvous
    host, _, port = served.rpartition(":")
    assert host == "127.0.0.1" and int(port) > 0, served
    socket.create_connection(("127.0.0.1", int(port)), timeout=5).close()
    rendezvous.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", int(port)), timeout=5)
