"""A job's replicas at setup: what the client asked for (``Shape``) and the layout laid
over the chosen stages (``lay_out``).

``Pipeline(replicas=2, stages=(2, 3))`` asks for the shape ``(2, 3)``: the first two
chosen stages (in registration order) form replica 0 and the next three replica 1; each
replica is ordered and partitioned by the planner, and the step's micro-batches are
water-filled over the replicas' predicted step times, at least one each
(``planning.layouts.plan_fixed``). ``replicas="auto"`` lets the planner choose the
replica count and which stages form each (``planning.layouts.plan_layouts``); when one
pipeline is predicted fastest the job is one pipeline, as ``replicas=1`` is.

**Pins.** ``elasticpipe stage --replica NAME`` pins a stage: with fixed lengths, the stages
pinned to one name serve one replica (the names in sorted order take replicas 0, 1, ...;
unpinned stages fill the places left, in registration order). ``auto`` does not honour pins
yet and refuses them by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from elasticpipe.coordinator.membership import Member
from elasticpipe.coordinator.planning import PlanError, memory
from elasticpipe.coordinator.planning.layouts import LayoutPlan, plan_fixed, plan_layouts
from elasticpipe.coordinator.planning.shares import planned_step_times
from elasticpipe.coordinator.state import Cluster
from elasticpipe.errors import InvalidRequest
from elasticpipe.layout import Layout
from elasticpipe.partition import MAX_REPLICAS, Partition, StageRef
from elasticpipe.training.job import JobConfig

__all__ = ["ONE_PIPELINE", "Shape", "lay_out", "layout_record"]


@dataclass(frozen=True)
class Shape:
    """The replicas a job asks for.

    Attributes:
        sizes: each replica's stage count (empty, or one count: one pipeline).
        auto: the planner chooses the replicas from the stages given.
    """

    sizes: tuple[int, ...] = ()
    auto: bool = False

    @property
    def replicated(self) -> bool:
        """Whether the job may run more than one replica."""
        return self.auto or len(self.sizes) > 1

    @classmethod
    def parse(cls, sizes: Sequence[int], auto: bool, num_stages: int) -> Shape:
        """Checks a setup request's replica fields against its ``num_stages``.

        Raises:
            InvalidRequest: naming the bad value.
        """
        sizes = tuple(int(n) for n in sizes)
        if auto and sizes:
            raise InvalidRequest(
                "auto_replicas chooses the replicas: do not also give replica_stages "
                f"{list(sizes)[:8]}"
            )
        if len(sizes) > MAX_REPLICAS or any(n < 1 for n in sizes):
            raise InvalidRequest(
                f"replica_stages {list(sizes)[:8]} must be at most {MAX_REPLICAS} counts >= 1"
            )
        if sizes and num_stages and num_stages != sum(sizes):
            raise InvalidRequest(
                f"num_stages {num_stages} is not the sum of replica_stages {list(sizes)[:8]}"
            )
        return cls(sizes, auto)

    def stages_needed(self, num_stages: int) -> int:
        """How many live stages the job waits for (0: every live stage)."""
        return sum(self.sizes) if self.sizes else num_stages

    def matches(self, layout: Layout | None) -> bool:
        """Whether a running job is of this shape (a client resuming it): replicas of
        the lengths asked for, if asked for (anything else fits ``auto`` or one count)."""
        if len(self.sizes) < 2:
            return True
        running = tuple(p.num_stages for p in layout.replicas) if layout is not None else ()
        return running == self.sizes


ONE_PIPELINE = Shape()  # today's job


def pinned_order(chosen: Sequence[Member], sizes: Sequence[int]) -> list[Member]:
    """The stages in replica order for replicas of ``sizes``: each pin name's stages in the
    replica that name takes (sorted names take replicas 0, 1, ...), the unpinned stages in
    the places left, registration order kept within each.

    Raises:
        PlanError: more pin names than replicas, or more stages pinned to one name than
            its replica's length (named).
    """
    names = sorted({m.replica_pin for m in chosen if m.replica_pin})
    if len(names) > len(sizes):
        raise PlanError(
            f"stages are pinned to {len(names)} replicas {names[:8]}, the job has {len(sizes)}"
        )
    free = [m for m in chosen if not m.replica_pin]
    ordered: list[Member] = []
    for r, size in enumerate(sizes):
        mine = [m for m in chosen if names[r : r + 1] == [m.replica_pin]]
        if len(mine) > size:
            raise PlanError(
                f"{len(mine)} stages are pinned to replica {names[r]!r} "
                f"({[m.row.name for m in mine][:8]}), which has {size}"
            )
        ordered += mine + [free.pop(0) for _ in range(size - len(mine))]
    return ordered


def _order_of(ordered: Sequence[Member], original: Sequence[Member]) -> list[int]:
    """Where each of ``ordered`` was in ``original``."""
    index = {id(m): i for i, m in enumerate(original)}
    return [index[id(m)] for m in ordered]


def lay_out(
    cluster: Cluster,
    job: JobConfig,
    chosen: list[Member],
    costs: Sequence[float],
    speeds: Sequence[float],
    param_bytes: Sequence[int],
    epoch: int,
    shape: Shape,
    profiled: bool,
) -> tuple[Partition, Layout, list[Member]]:
    """The replicas of a new job over ``chosen`` (a shape of one replica is not laid out
    here: ``order_hosts`` alone does that).

    Returns:
        Replica 0's partition, the layout (of one replica when ``auto`` found one
        pipeline fastest), and the stages it runs on, in layout order (``auto`` leaves
        the stages of a replica with no share out: they stay spares).

    Raises:
        PlanError: the shape does not fit the stages, the micro-batches or the memory, or
            the pins (named).
    """
    original = list(chosen)
    if shape.auto:
        pinned = sorted(m.row.name for m in chosen if m.replica_pin)
        if pinned:
            raise PlanError(
                f"stages {pinned[:8]} are pinned to replicas (stage --replica): pins need "
                "replicas of given lengths (stages=(...)); replicas='auto' does not honour "
                "them yet"
            )
    else:
        chosen = pinned_order(chosen, shape.sizes)
        speeds = [speeds[i] for i in _order_of(chosen, original)]
    mem = memory.terms([m.memory_bytes for m in chosen], param_bytes, cluster.profile, job)
    bandwidth = cluster.reduce_bandwidth(in_seconds=profiled)
    reduce = (param_bytes, bandwidth) if bandwidth else (None, None)
    slot_s = cluster.slot_overhead(in_seconds=profiled)
    common = dict(
        slot_s=slot_s,
        per_step=cluster.per_step(in_seconds=profiled),
        schedule=job.schedule,
        param_bytes=reduce[0],
        reduce_bandwidth=reduce[1],
        layer_memory=mem.layer_memory,
        host_memory=mem.stage_memory,
    )
    try:
        best: LayoutPlan = (
            plan_layouts(costs, speeds, job.micro_batches, **common)[0]  # type: ignore[arg-type]
            if shape.auto
            else plan_fixed(costs, speeds, job.micro_batches, shape.sizes, **common)  # type: ignore[arg-type]
        )
    except PlanError as exc:
        raise PlanError(f"{exc}; {memory.offers([m.row.name for m in chosen], mem)}") from exc
    replicas = []
    kept = [r for r, share in enumerate(best.shares) if share]  # auto: none idle
    for hosts, plan, share in ((best.replicas[r], best.plans[r], best.shares[r]) for r in kept):
        replicas.append(
            Partition(
                epoch=epoch,
                job_id=job.job_id,
                boundaries=plan.boundaries,
                stages=tuple(
                    StageRef(chosen[h].row.stage_id, chosen[h].row.address) for h in hosts
                ),
                predicted_step_s=planned_step_times([plan], job.schedule, slot_s)[0](share)
                + best.reduce_s
                + best.per_step_s
                if profiled and share
                else None,
            )
        )
    layout = Layout(tuple(replicas), tuple(best.shares[r] for r in kept)).validate(
        cluster.num_layers or None, job.micro_batches
    )
    ordered = [chosen[h] for r in kept for h in best.replicas[r]]
    return replicas[0], layout, ordered


def layout_record(cluster: Cluster, layout: Layout) -> dict[str, Any]:
    """An epoch history row's record of a layout's replicas (the row's own chain is
    replica 0): each one's cuts and stage names, and the shares."""
    return {
        "replicas": [
            {"boundaries": list(p.boundaries), "stages": cluster.names(p.stage_ids)}
            for p in layout.replicas
        ],
        "shares": list(layout.shares),
    }
