"""The process-group engine's pieces of the reduction (``collectives="gloo"``/``"nccl"``):
a piece packed into bytes comes back bit for bit, whatever its dtypes; a piece of the wrong
size is refused by name; a generation given up on is not opened again; and the refusals of
the coordinator's rendezvous (TLS, standby coordinators) and of NCCL without CUDA."""

from __future__ import annotations

import socket
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from elasticpipe.coordinator.rendezvous import Rendezvous
from elasticpipe.errors import InvalidRequest, StepAborted
from elasticpipe.stage_server.collectives import ProcessGroups, check_engine
from elasticpipe.stage_server.reducing import _packed, piece
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


def test_a_piece_of_the_wrong_size_is_refused_by_name() -> None:
    reduction, like = _reduction()
    data = _packed(Send(0, Piece(0, 0, 1, None, tuple(cut(like, 0, 6)), (True, True))))
    with pytest.raises(
        InvalidRequest, match=r"from replica 1: 23 torch.uint8 elements, expected 24 bytes"
    ):
        piece(data[:-1], reduction, 0, 1, None)


def test_a_generation_given_up_on_is_not_opened_again() -> None:
    groups = ProcessGroups()
    groups.use("job", 3, 7)
    groups.drop()  # a run failed on them
    with pytest.raises(StepAborted, match=r"generation 7 \(epoch 3\) were given up here"):
        groups.use("job", 3, 7)
    groups.use("job", 3, 9)  # the client's next generation


def test_nccl_without_cuda_is_refused_naming_the_stage() -> None:
    with pytest.raises(InvalidRequest, match="stage s1 computes on cpu"):
        check_engine("nccl", torch.device("cpu"), "s1")
    check_engine("gloo", torch.device("cpu"), "s1")


def _cluster(**fields: Any) -> Any:
    config = SimpleNamespace(tls=fields.pop("tls", None))
    return SimpleNamespace(
        config=config, **{"elected": False, "address": "127.0.0.1:7100", **fields}
    )


def test_the_rendezvous_is_refused_with_tls_or_standby_coordinators() -> None:
    job = JobConfig(model="mlp", collectives="gloo")
    with pytest.raises(InvalidRequest, match="requires mutual TLS"):
        Rendezvous(_cluster(tls=object())).for_job(job)
    with pytest.raises(InvalidRequest, match="with standby coordinators is not built"):
        Rendezvous(_cluster(elected=True)).for_job(job)
    plain = JobConfig(model="mlp", rendezvous="10.0.0.1:1")  # a client's is ignored
    assert Rendezvous(_cluster()).for_job(plain).rendezvous == ""


def test_a_restarted_coordinator_serves_the_rendezvous_on_the_same_port() -> None:
    with socket.socket() as probe:  # a free port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    job = JobConfig(model="mlp", collectives="gloo", rendezvous=f"127.0.0.1:{port}")
    assert Rendezvous(_cluster()).restored(job).rendezvous == f"127.0.0.1:{port}"
    served = Rendezvous(_cluster()).for_job(JobConfig(model="mlp", collectives="gloo"))
    assert served.rendezvous.startswith("127.0.0.1:") and not served.rendezvous.endswith(":0")
