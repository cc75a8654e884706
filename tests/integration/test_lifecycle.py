"""A Pipeline's life as a script sees it: once closed it touches the job no more, and
``last_step`` says how many micro-batches a step ran."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from elasticpipe.client.pipeline import Pipeline
from elasticpipe.errors import PipelineClosed
from elasticpipe.local.cluster import LocalCluster

pytestmark = pytest.mark.timeout(180)

MLP = {"sizes": [8, 16, 16, 4]}


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """Two stages; rebalancing only on request."""
    with LocalCluster(stages=2, state=":memory:", auto_rebalance=False) as c:
        yield c


def _pipeline(cluster: LocalCluster, **kwargs: Any) -> Pipeline:
    return Pipeline(
        coordinator=cluster.coordinator, model="mlp", model_kwargs=MLP, lease_s=3.0, **kwargs
    )


def _batch(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rows)
    return torch.randn(rows, 8, generator=g), torch.randint(0, 4, (rows,), generator=g)


def test_a_closed_pipeline_refuses_every_call_that_would_touch_the_job(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """After its ``with`` block, train_step, predict, state_dict, save, load and stage_stats
    raise PipelineClosed and commit nothing (the job stays free at step 1, as a resuming
    pipeline finds it); step, partition and last_step still say what was last known."""
    with _pipeline(cluster) as pipe:
        pipe.train_step(*_batch(8))
        pipe.save(tmp_path / "ckpt")
        partition = pipe.partition
    assert cluster.status().client == ""  # the lease was released

    calls: dict[str, Callable[[], object]] = {
        "train_step": lambda: pipe.train_step(*_batch(8)),
        "predict": lambda: pipe.predict(_batch(8)[0]),
        "state_dict": pipe.state_dict,
        "save": lambda: pipe.save(tmp_path / "again"),
        "load": lambda: pipe.load(tmp_path / "ckpt"),
        "stage_stats": pipe.stage_stats,
    }
    for name, call in calls.items():
        with pytest.raises(PipelineClosed, match="this Pipeline is closed") as info:
            call()
        assert partition.job_id in str(info.value), name
    assert not (tmp_path / "again").exists()
    assert pipe.step == 1 and pipe.last_step.step == 1
    assert pipe.partition == partition
    pipe.close()  # a second close does nothing

    assert cluster.status().client == ""
    with _pipeline(cluster, resume=True) as resumed:
        assert resumed.step == 1  # nothing was committed after the close


def test_a_resuming_pipeline_closed_before_use_never_attaches(cluster: LocalCluster) -> None:
    """``step`` and ``partition`` of a ``resume=True`` pipeline closed before its first
    call would have to attach to the job: they raise PipelineClosed, and the job's lease
    stays free."""
    with _pipeline(cluster) as pipe:
        pipe.train_step(*_batch(8))
    resumed = _pipeline(cluster, resume=True)
    resumed.close()
    with pytest.raises(PipelineClosed, match="it never held a job"):
        _ = resumed.step
    with pytest.raises(PipelineClosed):
        _ = resumed.partition
    assert cluster.status().client == ""


@pytest.mark.parametrize(("rows", "ran"), [(8, 4), (6, 4), (3, 3), (1, 1)])
def test_last_step_says_how_many_micro_batches_ran(
    cluster: LocalCluster, rows: int, ran: int
) -> None:
    """A mini-batch of fewer samples than ``micro_batches`` (4) runs one micro-batch per
    sample, and ``last_step.micro_batches`` (and its one-line summary) says how many ran;
    each stage's report has as many forward times."""
    with _pipeline(cluster, micro_batches=4) as pipe:
        pipe.train_step(*_batch(rows))
        stats = pipe.last_step
    assert stats.micro_batches == ran
    assert [len(r.forward_s) for r in stats.reports] == [ran] * len(stats.reports)
    assert f", {ran} micro-batches" in str(stats)
