"""Stage processes bound to CPUs: ``elasticpipe stage --cpus`` binds every thread of a real
stage process, ``LocalCluster`` gives each stage its own CPU, and a bad list is refused."""

from __future__ import annotations

import os

import pytest
import torch

from elasticpipe.local.cluster import LocalCluster
from elasticpipe.stage_server.cpus import available, parse_cpus
from tests.support import cli, clusters, jobs

pytestmark = pytest.mark.skipif(available() is None, reason="binding to CPUs needs Linux")


def bound_to(pid: int) -> set[frozenset[int]]:
    """The CPU sets of every thread of process ``pid`` (``/proc``, as the kernel has them)."""
    sets = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as status:
                for line in status:
                    if line.startswith("Cpus_allowed_list:"):
                        sets.add(parse_cpus(line.split(":", 1)[1]))
        except FileNotFoundError:
            continue  # that thread ended meanwhile
    return sets


@pytest.mark.timeout(120)
def test_each_stage_of_a_local_cluster_runs_on_its_own_cpus() -> None:
    """Two stages: every thread of stage-0, those a training step started included, runs on
    the first half of the CPUs this process may use; stage-1, given ``--cpus`` of its own
    (the first CPU, where it would not be bound), keeps it; the coordinator is not bound."""
    cpus = sorted(available() or ())
    if len(cpus) < 2:
        pytest.skip("one CPU: every binding is the same")
    own = ["--cpus", str(cpus[0])]
    with clusters.quiet(2, per_stage_args=[[], own]) as cluster:
        with jobs.mlp(cluster.coordinator, sizes=[8, 16, 4], stages=2) as pipe:
            pipe.train_step(torch.randn(4, 8), torch.randint(0, 4, (4,)))
        half = frozenset(cpus[: len(cpus) // 2])
        assert bound_to(cluster.procs["stage-0"].pid) == {half}
        assert bound_to(cluster.procs["stage-1"].pid) == {frozenset({cpus[0]})}
        assert bound_to(cluster.procs["coordinator"].pid) == {frozenset(cpus)}


@pytest.mark.timeout(60)
def test_stages_that_cannot_be_spread_evenly_are_left_unbound() -> None:
    """One stage more than there are CPUs: one CPU would run two stages while another ran
    one; the kernel balances them instead."""
    cpus = available() or frozenset()
    with clusters.quiet(len(cpus) + 1) as cluster:
        for k in range(len(cpus) + 1):
            assert bound_to(cluster.procs[f"stage-{k}"].pid) == {cpus}, k


@pytest.mark.timeout(60)
def test_an_unbound_cluster_leaves_its_stages_on_every_cpu() -> None:
    with LocalCluster(stages=1, state=":memory:", bind_cpus=False) as cluster:
        assert bound_to(cluster.procs["stage-0"].pid) == {available()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("cpus", "code", "message"),
    [
        ("1-x", 2, "'1-x' in CPU list '1-x' is neither a CPU number nor a range"),
        ("4096", 1, "CPU 4096 is outside the CPUs this process may run on"),
    ],
)
def test_a_bad_cpu_list_is_refused_naming_it(cpus: str, code: int, message: str) -> None:
    done = cli.elasticpipe("stage", "--coordinator", "127.0.0.1:1", "--cpus", cpus, timeout=60)
    assert done.returncode == code, done.stderr
    assert message in done.stderr, done.stderr
