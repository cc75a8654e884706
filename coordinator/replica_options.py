"""How a job of several replicas recovers from dead stages: the options for a replica that
lost stages, and the one the predicted step chooses.

For each replica that lost stages, in replica order, these are the options, each one
epoch change of the whole layout:

1. **a spare** takes each dead stage's place, with its layers (one that fits them in
   memory, pinned like the dead stage first);
2. the replica **re-partitions over its survivors**, the planner ordering and cutting them
   anew (under their memory);
3. it **borrows a stage** from another replica of at least two stages, none lost: the
   lender re-partitions over the rest, the borrower over its survivors and the borrowed
   stage (a replica with no survivor is gone: it borrows nothing);
4. it **dissolves**: its survivors become spares, the other replicas take its micro-batches.

Each option is priced by the predicted step of the layout it leaves (every healthy
replica's planned step at the live speeds, the shares water-filled again; replicas still
to be mended are left out of the price). The first option that can run is the default:
a spare is like for like, and a re-partition keeps the replica without touching another.
Another is taken only when it predicts a step shorter than the default's by more than the
policy's threshold (``--rebalance-threshold``, 10% by default), and then the fastest of
those: estimates that differ by noise must not pick a change that moves more layers (a
borrow moves the lender's too; dissolving moves none, but loses a replica). Options that
cannot run -- no spare that fits, survivors that cannot hold the model, no lender -- are
left out.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from elasticpipe.coordinator.membership import Member
from elasticpipe.coordinator.planning import estimates, memory
from elasticpipe.coordinator.planning.cost import Plan, PlanError
from elasticpipe.coordinator.planning.hosts import order_hosts
from elasticpipe.coordinator.planning.layouts import reduce_seconds
from elasticpipe.coordinator.planning.shares import (
    StepTime,
    assign_shares,
    pipeline_slots,
    planned_step_times,
    plus_slots,
    slowest,
)
from elasticpipe.coordinator.state import Cluster
from elasticpipe.layout import Layout
from elasticpipe.partition import Partition, StageRef

__all__ = [
    "Option",
    "choose",
    "layout_step",
    "measured_pipelines",
    "measured_step_times",
    "mend",
    "one_chain",
    "pick_spares",
    "plans",
]


@dataclass(frozen=True)
class Option:
    """One way to mend a replica that lost stages.

    Attributes:
        what: for the history ("re-partitioned over its survivors b, c", ...).
        replicas: every replica after it (None: a replica dissolved), in replica order.
        spares_taken: the spares it puts into the layout.
        step_s: the layout's predicted step (the planner's units).
    """

    what: str
    replicas: tuple[Partition | None, ...]
    spares_taken: tuple[Member, ...]
    step_s: float


def mend(
    cluster: Cluster,
    layout: Layout,
    dead: set[str],
    live: set[str],
    spares: Sequence[Member],
) -> tuple[tuple[Partition | None, ...], list[str]] | str:
    """Mends every replica of ``layout`` that lost a stage of ``dead``, in replica order,
    each by its ``choose``n option; a dissolved replica's survivors serve as spares for the
    replicas after it. If no replica can be kept, the survivors form one chain.

    Returns:
        The replicas after (None for a dissolved one) and what was done to each (for the
        history), or why nothing can go on (the job fails, or a drain is refused).
    """
    replicas: tuple[Partition | None, ...] = layout.replicas
    given, spares = list(spares), list(spares)
    said: list[str] = []
    for r, chain in enumerate(layout.replicas):
        lost = [sid for sid in chain.stage_ids if sid in dead]
        if not lost:
            continue
        option = choose(cluster, replicas, r, dead, live, spares)
        if option is None:  # the last replica standing, and it cannot be mended alone
            found = [*map(cluster.members.by_id, layout.stage_ids), *given]
            survivors = list(
                {
                    m.row.stage_id: StageRef(m.row.stage_id, m.row.address)
                    for m in found
                    if m is not None and m.row.stage_id in live
                }.values()
            )
            one = one_chain(cluster, chain, survivors)
            if one is None:
                names = cluster.names([s.stage_id for s in survivors])
                return (
                    f"every replica lost stages ({', '.join(cluster.names(sorted(dead)))}) "
                    f"and the survivors ({', '.join(names)}) cannot hold the model, even as "
                    "one chain"
                )
            return (one,), [*said, "every replica lost stages: one chain of the survivors"]
        replicas = option.replicas
        spares = [m for m in spares if m not in option.spares_taken]
        if option.replicas[r] is None:  # dissolved: its survivors serve later replicas
            spares += [
                m
                for m in map(cluster.members.by_id, chain.stage_ids)
                if m is not None and m.row.stage_id in live
            ]
        said.append(f"replica {r} lost {', '.join(cluster.names(lost))}: {option.what}")
    return replicas, said


def choose(
    cluster: Cluster,
    replicas: Sequence[Partition | None],
    r: int,
    dead: set[str],
    live: set[str],
    spares: Sequence[Member],
) -> Option | None:
    """The fastest option for replica ``r`` (which lost stages) of ``replicas`` (the layout
    so far: replicas already mended, None for one dissolved); None when no replica would be
    left at all."""
    options = [
        *_spare(cluster, replicas, r, dead, spares),
        *_repartition(cluster, replicas, r, live, dead),
        *_borrow(cluster, replicas, r, live, dead),
    ]
    dissolved = _with(replicas, r, None)
    if any(p is not None for p in dissolved):
        what = _dissolve_what(cluster, replicas[r], live)
        options.append(_option(cluster, what, dissolved, (), dead))
    if not options:
        return None
    default = options[0]
    bar = default.step_s * (1.0 - cluster.config.policy.threshold)
    return min([default, *(o for o in options[1:] if o.step_s < bar)], key=lambda o: o.step_s)


def _spare(
    cluster: Cluster,
    replicas: Sequence[Partition | None],
    r: int,
    dead: set[str],
    spares: Sequence[Member],
) -> list[Option]:
    chain = replicas[r]
    assert chain is not None
    lost = [s for s, ref in enumerate(chain.stages) if ref.stage_id in dead]
    picked = pick_spares(cluster, list(spares), chain, lost)
    if picked is None:
        return []
    stages = list(chain.stages)
    for s, spare in zip(lost, picked, strict=True):
        stages[s] = StageRef(spare.row.stage_id, spare.row.address)
    what = (
        f"{', '.join(m.row.name for m in picked)} took the place of "
        f"{', '.join(cluster.names([chain.stages[s].stage_id for s in lost]))}"
    )
    mended = chain.evolve(stages=tuple(stages))
    return [_option(cluster, what, _with(replicas, r, mended), tuple(picked), dead)]


def _repartition(
    cluster: Cluster,
    replicas: Sequence[Partition | None],
    r: int,
    live: set[str],
    dead: set[str],
) -> list[Option]:
    chain, survivors = _survivors(replicas, r, live)
    mended = _planned(cluster, chain, survivors)
    if mended is None:
        return []
    what = f"re-partitioned over its survivors {', '.join(cluster.names(mended.stage_ids))}"
    return [_option(cluster, what, _with(replicas, r, mended), (), dead)]


def _borrow(
    cluster: Cluster,
    replicas: Sequence[Partition | None],
    r: int,
    live: set[str],
    dead: set[str],
) -> list[Option]:
    chain, survivors = _survivors(replicas, r, live)
    if not survivors:  # a replica with no stage left is gone: no stage to lend it to
        return []
    out = []
    for d, lender in enumerate(replicas):
        if d == r or lender is None or lender.num_stages < 2:
            continue
        if any(ref.stage_id not in live for ref in lender.stages):
            continue  # a replica that lost stages too lends nothing
        for lent in lender.stages:
            rest = [ref for ref in lender.stages if ref != lent]
            borrower = _planned(cluster, chain, [*survivors, lent])
            kept = _planned(cluster, lender, rest)
            if borrower is None or kept is None:
                continue
            what = (
                f"borrowed {cluster.name(lent.stage_id)} from replica {d} and re-partitioned "
                f"over {', '.join(cluster.names(borrower.stage_ids))}"
            )
            mended = _with(_with(replicas, d, kept), r, borrower)
            out.append(_option(cluster, what, mended, (), dead))
    return out


def one_chain(
    cluster: Cluster, template: Partition, stages: Sequence[StageRef]
) -> Partition | None:
    """The last resort when no replica can be mended: one chain over ``stages`` (every
    survivor and spare, at most one per layer), ordered and cut by the planner."""
    return _planned(cluster, template, list(stages)[: template.num_layers])


def _survivors(
    replicas: Sequence[Partition | None], r: int, live: set[str]
) -> tuple[Partition, list[StageRef]]:
    """Replica ``r``'s chain and its live stages, in chain order."""
    chain = replicas[r]
    assert chain is not None
    return chain, [ref for ref in chain.stages if ref.stage_id in live]


def _planned(cluster: Cluster, chain: Partition, stages: Sequence[StageRef]) -> Partition | None:
    """A chain of ``stages``, ordered and cut by the planner under their memory; None if
    they cannot hold the model (or there are none)."""
    if not stages or len(stages) > chain.num_layers:
        return None
    ids = [ref.stage_id for ref in stages]
    try:
        order, plan = order_hosts(
            cluster.costs(), cluster.speeds(ids), *cluster.links(len(ids)), *cluster.memory(ids)
        )
    except PlanError:
        return None
    return chain.evolve(
        boundaries=plan.boundaries, stages=tuple(stages[i] for i in order), predicted_step_s=None
    )


def _option(
    cluster: Cluster,
    what: str,
    replicas: tuple[Partition | None, ...],
    spares: tuple[Member, ...],
    dead: set[str],
) -> Option:
    """An option priced on the replicas it leaves healthy (those still to be mended, with
    dead stages, are left out of the pipelines' price, but reduce with the others: they
    are likely mended too; none healthy: an infinite step)."""
    kept = [p for p in replicas if p is not None]
    healthy = [p for p in kept if not dead & set(p.stage_ids)]
    step_s = layout_step(cluster, healthy, kept) if healthy else float("inf")
    return Option(what, replicas, spares, step_s)


def _with(
    replicas: Sequence[Partition | None], r: int, chain: Partition | None
) -> tuple[Partition | None, ...]:
    out = list(replicas)
    out[r] = chain
    return tuple(out)


def _dissolve_what(cluster: Cluster, chain: Partition | None, live: set[str]) -> str:
    assert chain is not None
    survivors = [sid for sid in chain.stage_ids if sid in live]
    return "dissolved" + (
        f"; {', '.join(cluster.names(survivors))} are spares now" if survivors else ""
    )


def pick_spares(
    cluster: Cluster, spares: list[Member], chain: Partition, lost: list[int]
) -> list[Member] | None:
    """A spare for each lost place of ``chain`` that can hold its layers (memory), those
    pinned like the stage they replace first, else registration order; None if some place
    has none."""
    left, picked = list(spares), []
    stage_ids = list(chain.stage_ids)
    for s in lost:
        gone = cluster.members.by_id(chain.stages[s].stage_id)
        pin = gone.replica_pin if gone is not None else ""
        for spare in sorted(left, key=lambda m: m.replica_pin != pin):
            stage_ids[s] = spare.row.stage_id
            try:
                memory.check_fits(
                    chain.boundaries,
                    cluster.memory(stage_ids),
                    cluster.names(stage_ids),
                    "recovery",
                )
            except PlanError:
                continue
            left.remove(spare)
            picked.append(spare)
            break
        else:
            return None
    return picked


def plans(cluster: Cluster, replicas: Sequence[Partition]) -> list[Plan]:
    """Each replica's partition evaluated at its stages' live speeds."""
    costs = cluster.costs()
    return [
        estimates.evaluate(
            p.boundaries, costs, cluster.speeds(p.stage_ids), *cluster.links(p.num_stages)
        )
        for p in replicas
    ]


def layout_step(
    cluster: Cluster,
    replicas: Sequence[Partition],
    reducing: Sequence[Partition] | None = None,
) -> float:
    """The predicted step of ``replicas`` with the shares water-filled on their plans, plus
    their optimizer steps (``Cluster.per_step``; a replica of one stage steps the whole
    model) and their reduction (``Cluster.reduce_bandwidth``; none for one replica): what
    the policy prices its replica changes with, so that a replica whose reduction costs
    more than its share saves is not formed, nor kept through a recovery. The part of a
    step the same for every option (the round trips: ``PerStep.fixed_s``) is left out, so
    that a gain is relative to the pipelines, as a move of one chain's is. ``reducing``:
    the replicas that reduce, where more than ``replicas`` (a recovery's option prices the
    pipelines of the replicas it leaves healthy, and the reduction of all it keeps)."""
    job = cluster.job
    assert job is not None
    times = planned_step_times(plans(cluster, replicas), job.schedule)
    in_seconds = cluster.in_seconds([sid for p in replicas for sid in p.stage_ids])
    once = cluster.per_step(in_seconds).optimizer_seconds([p.boundaries for p in replicas])
    bandwidth = cluster.reduce_bandwidth(in_seconds)
    if bandwidth and cluster.param_bytes:
        cuts = [p.boundaries for p in (replicas if reducing is None else reducing)]
        once += reduce_seconds(cuts, cluster.param_bytes, bandwidth)
    return slowest(times, assign_shares(times, job.micro_batches, 1)) + once


def measured_step_times(cluster: Cluster, layout: Layout) -> list[StepTime]:
    """Each replica's step time for a share of ``m``: the planner's prediction at the live
    speeds, plus what it missed in the replica's measured pipeline (its slowest stage's
    ``pipeline_s`` in this epoch, at its share): link latency, overheads. The shortfall is
    spread over the pipeline's ``m + S - 1`` slots (a hop's latency is paid per slot), so
    it shrinks with a smaller share. Until every replica is measured in this epoch
    (``measured_pipelines``), or without a unit (no profile), the predictions alone: one
    replica corrected beside another not would skew the split.

    A chain's shortfall per slot is the one measured at the largest share it ran since its
    stages last changed (``Cluster.slot_shortfalls``), or at this epoch's if that share is
    as large. Measured at a share of 1 (two slots), a slow link's cost came out far below
    what three micro-batches showed, and the shares went back and forth between (7, 1) and
    (5, 3) (``tests/integration/test_replica_latency.py``).
    """
    job = cluster.job
    assert job is not None
    replicas = list(layout.replicas)
    times = planned_step_times(plans(cluster, replicas), job.schedule)
    pipelines = measured_pipelines(cluster, layout)
    if pipelines is None:  # (some replica not measured in this epoch yet)
        return with_known_shortfalls(cluster, replicas, times)
    out: list[StepTime] = []
    for chain, predicted, share, measured in zip(
        replicas, times, layout.shares, pipelines, strict=True
    ):
        stages = chain.num_stages
        per_slot = max(0.0, measured - predicted(share)) / pipeline_slots(stages, share)
        known = cluster.slot_shortfalls.get((chain.job_id, chain.stage_ids))
        if known is None or share >= known[0]:
            cluster.slot_shortfalls[(chain.job_id, chain.stage_ids)] = (share, per_slot)
        else:
            per_slot = known[1]
        out.append(functools.partial(plus_slots, predicted, per_slot, stages))
    return out


def with_known_shortfalls(
    cluster: Cluster, replicas: Sequence[Partition], times: list[StepTime]
) -> list[StepTime]:
    """The planner's predictions ``times`` for ``replicas``, each plus the shortfall per
    slot its chain measured earlier in this job (``Cluster.slot_shortfalls``: the same
    stages, in an epoch before a move of layers or a re-split), when every chain has one;
    else the predictions alone (one replica corrected beside another not would skew the
    split). Without it, a move of layers inside replicas split the shares on the
    predictions alone until the new epoch was measured, and undid a split away from a
    slow link."""
    if not cluster.in_seconds([s for chain in replicas for s in chain.stage_ids]):
        return times
    out: list[StepTime] = []
    for chain, predicted in zip(replicas, times, strict=True):
        seen = cluster.slot_shortfalls.get((chain.job_id, chain.stage_ids))
        if seen is None:
            return times
        out.append(functools.partial(plus_slots, predicted, seen[1], chain.num_stages))
    return out


def note_overheads(cluster: Cluster) -> bool:
    """What the running job's chains (its replicas, or its one pipeline) measured beyond
    the planner's model at the live speeds, per pipeline slot, pooled over the chains
    (their shortfalls summed over their slots summed: six one-stage replicas count as one
    job, not six figures), for ``Cluster.slot_overhead``. Called as heartbeats bring new
    pipeline times; nothing until every stage of every chain measured this epoch. Returns
    whether it noted a figure."""
    job, layout, partition = cluster.job, cluster.layout, cluster.partition
    if job is None or partition is None or partition.job_id != job.job_id:
        return False
    chains = list(layout.replicas) if layout is not None else [partition]
    shares = list(layout.shares) if layout is not None else [job.micro_batches]
    if not cluster.in_seconds([sid for chain in chains for sid in chain.stage_ids]):
        return False
    running = [(chain, share) for chain, share in zip(chains, shares, strict=True) if share]
    measured = []
    for chain, _ in running:
        pipeline = chain_pipeline(cluster, chain)
        if pipeline is None:
            return False
        measured.append(pipeline)
    times = planned_step_times(plans(cluster, [chain for chain, _ in running]), job.schedule)
    short = slots = 0.0
    for (chain, share), pipeline, predicted in zip(running, measured, times, strict=True):
        short += max(0.0, pipeline - predicted(share))
        slots += pipeline_slots(chain.num_stages, share)
    if not slots:
        return False
    cluster.note_slot_overhead(job.job_id, short / slots)
    note_step_overhead(cluster, [chain for chain, _ in running], chains)
    return True


def note_step_overhead(
    cluster: Cluster, running: Sequence[Partition], chains: Sequence[Partition]
) -> None:
    """What the job's stages waited between runs beyond its optimizer steps, for
    ``Cluster.per_step``: the smallest wait any stage of the ``running`` chains measured
    in this epoch (the slowest stage's: the others also wait for its report), less the
    optimizer steps predicted for all the job's ``chains`` (each stage's next run waits for
    its own, which runs between its runs; the commit reaches every stage, an idle
    replica's too). A wait shorter than the optimizer steps (the step hidden behind the
    round trips) counts as no overhead. Nothing until every running stage measured one."""
    job = cluster.job
    assert job is not None
    waits = []
    for chain in running:
        for member in map(cluster.members.by_id, chain.stage_ids):
            heard = member.between_runs if member is not None else None
            if heard is None or heard[0] != chain.epoch:
                return
            waits.append(heard[1])
    optimizer_s = cluster.per_step().optimizer_seconds([c.boundaries for c in chains])
    cluster.note_step_overhead(job.job_id, max(0.0, min(waits) - optimizer_s))


def chain_pipeline(cluster: Cluster, chain: Partition) -> float | None:
    """A chain's measured pipeline in its epoch (its slowest stage's ``pipeline_s``); None
    until every stage reported one."""
    heard = [m.pipeline_s if m else None for m in map(cluster.members.by_id, chain.stage_ids)]
    measured = [h[1] for h in heard if h is not None and h[0] == chain.epoch]
    return max(measured) if len(measured) == chain.num_stages else None


def measured_pipelines(cluster: Cluster, layout: Layout) -> list[float] | None:
    """Each replica's measured pipeline in ``layout``'s epoch (its slowest stage's
    ``pipeline_s``); None until every stage of every replica reported one (every replica
    has a share of at least one), or while step times have no unit (no profile)."""
    if not cluster.in_seconds(layout.stage_ids):
        return None
    out = []
    for chain, share in zip(layout.replicas, layout.shares, strict=True):
        measured = chain_pipeline(cluster, chain)
        if share < 1 or measured is None:
            return None
        out.append(measured)
    return out
