"""Changing a job of several replicas: re-splitting its shares (``reshare``), and recovering
it from dead stages without a rollback (``recover``).

**Shares.** Which micro-batches each replica runs moves no state: a re-split is an epoch
change of the layout with new shares and nothing to pull, the stages freezing at their
step boundary. The policy (``rebalancing``) proposes one when the live speeds predict a
faster split, under the same threshold, payback, cool-down and confirmation as moves.

**Recovery.**

Every replica holds every layer, and at a committed step every holder of a layer holds the
same bytes (the reduction gives each the same sums, and each applies the same optimizer
step). So a dead stage's layers are still alive in the other replicas, at the step the
survivors committed: nothing needs rolling back, and the client retries only the run that
was interrupted (``last_step.replayed == 0``). Each replica that lost stages is mended by
the option the predicted step favours (``replica_options``): a spare takes each dead
stage's place, the replica re-partitions over its survivors, it borrows a stage from
another replica, or it dissolves (its survivors become spares). Every stage pulls the
layers it lacks from a live holder in any replica.

All of it is one epoch change of the whole layout (``epochs.change_epoch`` with layouts):
every survivor freezes at its step boundary -- a live client decides the interrupted run
first, so that a step committed anywhere is committed everywhere -- and the shares are
water-filled again for the new replicas. When some layer has no live holder left in any
replica (its holders died together), every replica rolls back to the newest snapshot step
with a live copy of every layer, as one pipeline does, and the client replays the steps
after it; only when no such snapshot survives does the job fail with ``LayersLost``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from elasticpipe.coordinator import copies, epochs, replica_options
from elasticpipe.coordinator.epochs import Change
from elasticpipe.coordinator.membership import Member
from elasticpipe.coordinator.planning.cost import PlanError
from elasticpipe.coordinator.planning.hosts import order_hosts
from elasticpipe.coordinator.planning.layouts import LayoutPlan, plan_layouts
from elasticpipe.coordinator.planning.shares import assign_shares, planned_step_times, slowest
from elasticpipe.coordinator.replicas import layout_record
from elasticpipe.coordinator.state import Cluster
from elasticpipe.coordinator.store import EpochRow
from elasticpipe.errors import InvalidRequest, ReplicaDivergence
from elasticpipe.layout import Layout
from elasticpipe.logs import get_logger
from elasticpipe.partition import Partition, StageRef
from elasticpipe.v1 import stage_pb2

log = get_logger(__name__)

# The snapshots each live stage holds (``Recovery._holdings``): (live stage ids, the
# job's restore epoch) -> stage id -> its holdings.
Holdings = Callable[[set[str], int], dict[str, list[stage_pb2.SnapshotHolding]]]

__all__ = [
    "check_divergence",
    "layout_candidates",
    "new_replica",
    "planned_shares",
    "recover",
    "reshare",
    "set_layout",
]


def recover(
    cluster: Cluster, dead: Sequence[Member], pause: epochs.Pause, holdings: Holdings
) -> Partition | None:
    """Mends every replica that lost stages (``replica_options``: a spare, a re-partition
    over the survivors, a borrowed stage, or dissolving it, whichever the predicted step
    favours), at the survivors' committed step (no rollback) while every layer has a live
    holder; else rolls every replica back to the newest snapshot with a live copy of
    every layer.

    Args:
        holdings: the snapshots each live stage holds (``Recovery._holdings``).

    Returns:
        The new replica 0's partition, or None when the job failed (named).

    Raises:
        ElasticPipeError: the epoch change was abandoned (the old layout stays in force; the
            coordinator's loop tries again).
    """
    job, _ = cluster.require_job()
    layout = cluster.layout
    assert layout is not None
    dead_ids = {m.row.stage_id for m in dead}
    live = {m.row.stage_id for m in cluster.members.members() if cluster.members.alive(m)}
    live -= dead_ids
    spares = [m for m in cluster.spares() if m.row.stage_id not in dead_ids]
    mended = replica_options.mend(cluster, layout, dead_ids, live, spares)
    if isinstance(mended, str):
        cluster.fail_job(mended)
        return None
    replicas, said = mended
    kept = [p for p in replicas if p is not None]
    relaid = _relaid(cluster, kept)
    gone = frozenset(
        a for sid, a in zip(layout.stage_ids, layout.addresses, strict=True) if sid in dead_ids
    )
    died = f"stage {', '.join(cluster.names(sorted(dead_ids)))} died: {'; '.join(said)}"
    step: int | None = None
    holders: dict[int, str] = {}
    fresh = False
    try:
        sources = _sources(layout, relaid.replicas, live)
    except InvalidRequest:  # a layer with no live holder left: from the snapshots
        rolled = _rolled_back(cluster, layout, relaid, live, holdings, dead_ids)
        if rolled is None:
            return None
        (step, holders, fresh), sources = rolled, {}
        epoch = cluster.store.reserve_epoch()
        new_layout = Layout(
            tuple(
                p.evolve(epoch=epoch, restored_step=step, restore_epoch=epoch)
                for p in relaid.replicas
            ),
            relaid.shares,
        )
        back = "built anew: init_state not loaded yet" if fresh else f"rolled back to step {step}"
        reason = f"{died}; a layer had no live holder left: {back}"
    else:
        new_layout = _at_epoch(relaid, cluster.store.reserve_epoch())
        reason = f"{died}; no rollback, shares {list(new_layout.shares)}"
    change = Change(
        "recovery",
        reason,
        layout.replicas[0],
        new_layout.replicas[0],
        rollback_step=step,
        holders=holders,
        abort_running=step is not None,
        gone=gone,
        old_layout=layout,
        new_layout=new_layout,
        sources=sources,
        fresh=fresh,
    )
    started = time.perf_counter()
    detected = min((m.dead_at for m in dead if m.dead_at), default=0.0)
    extra = layout_record(cluster, new_layout)
    restored = change.rollback_step

    def history(result: epochs.MoveResult) -> EpochRow:
        lost = max([s - restored for s in result.cut_steps] + [0]) if restored is not None else 0
        return epochs.history_row(
            cluster,
            new_layout.replicas[0],
            "recovery",
            reason,
            moved=result,
            restored_step=restored or 0,
            lost_steps=lost,
            detected_at=detected,
            extra={**extra, "recover_s": time.perf_counter() - started},
        )

    result = epochs.change_epoch(cluster, job, change, pause, history)
    cluster.last_move = time.monotonic()
    for sid in new_layout.stage_ids:
        member = cluster.members.by_id(sid)
        if member is not None:
            member.remeasure()
    log.warning(
        "job_recovered",
        epoch=new_layout.epoch,
        how=said,
        replicas=[cluster.names(p.stage_ids) for p in new_layout.replicas],
        shares=list(new_layout.shares),
        committed_step=result.committed_step,
        restored_step=change.rollback_step,
        bytes_pulled=result.bytes_moved,
        seconds=round(time.perf_counter() - started, 3),
    )
    return new_layout.replicas[0]


def _rolled_back(
    cluster: Cluster,
    old: Layout,
    new: Layout,
    live: set[str],
    holdings: Holdings,
    dead: set[str],
) -> tuple[int, dict[int, str], bool] | None:
    """The newest snapshot step with a live copy of every layer (in any replica: every
    replica's copies of a step hold the same bytes), a live holder of each layer's copy
    (one of ``new``'s stages first), and False; or step 0, no holders and True for a job
    whose init_state never loaded (``epochs.unloaded``: its layers are built anew). None
    when some layer has no live copy (the job is failed, naming the layers)."""
    job = cluster.job
    assert job is not None
    found = copies.copies_by_step(holdings(live, old.replicas[0].restore_epoch), job.job_id)
    step = copies.newest_step(found, old.num_layers, live)
    if step is None and epochs.unloaded(cluster, job, old.stage_ids):
        return 0, {}, True
    if step is None:
        missing, why = copies.lost(
            found, old.num_layers, live, job.snapshot_every, range(old.num_layers)
        )
        cluster.fail_job(
            f"layers {missing} have no live holder in any replica and no live snapshot copy: "
            f"they were lost with {', '.join(cluster.names(sorted(dead)))}; {why}"
        )
        return None
    mine = set(new.stage_ids)
    addresses = {m.row.stage_id: m.row.address for m in cluster.members.members()}
    by_preference = sorted(live, key=lambda sid: (sid not in mine, sid))
    held = copies.holders_at(found, step, old.num_layers, by_preference)
    return step, {layer: addresses[sid] for layer, sid in held.items()}, False


def drain(
    cluster: Cluster, member: Member, reason: str, pause: epochs.Pause
) -> tuple[Layout, epochs.MoveResult | None]:
    """Takes a live stage out of a job of several replicas (``admin drain``, a stage
    leaving on SIGTERM): its replica is mended as if it had died (``replica_options``),
    then moved to with ``set_layout``: at a consistent cut of every stage, the stage itself
    still serving (and a source of its layers) until the change commits. Nothing is rolled
    back or retried. Call under ``move_lock``.

    Returns:
        The layout in force, and what the change did (None: the stage held nothing).

    Raises:
        InvalidRequest: no replica can go on without it (named); nothing changes.
        ElasticPipeError: the change was abandoned (the old layout stays in force).
    """
    layout = cluster.job_layout()
    sid = member.row.stage_id
    if layout is None or sid not in layout.stage_ids:  # (changed meanwhile)
        assert layout is not None
        return layout, None
    alive = {m.row.stage_id for m in cluster.members.members() if cluster.members.alive(m)}
    spares = [m for m in cluster.spares() if m.row.stage_id != sid]
    mended = replica_options.mend(cluster, layout, {sid}, alive - {sid}, spares)
    if isinstance(mended, str):
        raise InvalidRequest(f"{member.row.name} cannot leave the job: {mended}")
    replicas, said = mended
    specs = [(p.boundaries, p.stages) for p in replicas if p is not None]
    new, result = set_layout(cluster, specs, None, f"{reason}: {'; '.join(said)}", pause)
    log.info("replica_stage_drained", stage=member.row.name, how=said, epoch=new.epoch)
    return new, result


def reshare(
    cluster: Cluster, shares: Sequence[int], reason: str, pause: epochs.Pause
) -> epochs.MoveResult:
    """Moves the job to the same replicas with ``shares`` (one epoch change, no layer moves).

    Raises:
        InvalidRequest: shares that do not fit the layout (named).
        ElasticPipeError: the change was abandoned (the old shares stay in force).
    """
    job, _ = cluster.require_job()
    layout = cluster.layout
    assert layout is not None
    Layout(layout.replicas, tuple(shares)).validate(micro_batches=job.micro_batches)
    new_layout = _at_epoch(
        _relaid(cluster, list(layout.replicas), shares), cluster.store.reserve_epoch()
    )
    change = Change(
        "shares",
        reason,
        layout.replicas[0],
        new_layout.replicas[0],
        old_layout=layout,
        new_layout=new_layout,
    )
    extra = {"shares": list(new_layout.shares), "old_shares": list(layout.shares)}

    def history(result: epochs.MoveResult) -> EpochRow:
        return epochs.history_row(
            cluster, new_layout.replicas[0], "shares", reason, moved=result, extra=extra
        )

    result = epochs.change_epoch(cluster, job, change, pause, history)
    cluster.last_move, cluster.last_pause = time.monotonic(), result.pause_s
    log.info(
        "shares_changed",
        epoch=new_layout.epoch,
        old=list(layout.shares),
        new=list(new_layout.shares),
        pause_s=round(result.pause_s, 3),
    )
    return result


def set_layout(
    cluster: Cluster,
    specs: Sequence[tuple[tuple[int, ...], tuple[StageRef, ...]]],
    shares: Sequence[int] | None,
    reason: str,
    pause: epochs.Pause,
) -> tuple[Layout, epochs.MoveResult | None]:
    """Moves the job (one pipeline or several replicas) to the replicas ``specs`` (each
    one's cuts and chain) with ``shares`` (None: water-filled on the live speeds and what
    the chains measured earlier in the job, ``replica_options.with_known_shortfalls``), in one
    epoch change. A stage pulls each layer it does not hold yet from a live holder in the
    old layout (the same replica's first); a stage left out drops its layers (a spare).

    Returns:
        The layout in force, and what the change did (None: it was that layout already).

    Raises:
        InvalidRequest: cuts, stages or shares that do not fit (named); nothing changes.
        ElasticPipeError: the change was abandoned (the old layout stays in force).
    """
    job, _ = cluster.require_job()
    old = cluster.job_layout()
    assert old is not None
    epochs.check_no_change_in_progress(cluster)
    if len(specs) > job.micro_batches:
        raise InvalidRequest(
            f"{len(specs)} replicas need at least as many micro-batches (the job has "
            f"{job.micro_batches}): every replica runs at least one"
        )
    last = old.replicas[0]
    chains = []
    for r, (cuts, refs) in enumerate(specs):
        chain = last.evolve(boundaries=cuts, stages=refs, predicted_step_s=None)
        try:
            chains.append(chain.validate(cluster.num_layers or None))
        except InvalidRequest as exc:
            raise InvalidRequest(f"replica {r}: {exc}") from None
    Layout(tuple(chains), (1,) * len(chains)).validate(cluster.num_layers or None)
    if shares is not None:
        Layout(tuple(chains), tuple(shares)).validate(micro_batches=job.micro_batches)
        if 0 in shares:
            raise InvalidRequest(
                f"shares {list(shares)[:8]}: every replica runs at least one micro-batch"
            )
    unchanged = [(p.boundaries, p.stages) for p in chains] == [
        (p.boundaries, p.stages) for p in old.replicas
    ]
    if unchanged and (shares is None or tuple(shares) == old.shares):
        return old, None
    live = {m.row.stage_id for m in cluster.members.members() if cluster.members.alive(m)}
    sources = _sources(old, chains, live)
    new_layout = _at_epoch(_relaid(cluster, chains, shares), cluster.store.reserve_epoch())
    change = Change(
        "move",
        reason,
        old.replicas[0],
        new_layout.replicas[0],
        old_layout=old,
        new_layout=new_layout,
        sources=sources,
    )
    extra = layout_record(cluster, new_layout)

    def history(result: epochs.MoveResult) -> EpochRow:
        return epochs.history_row(
            cluster, new_layout.replicas[0], "move", reason, moved=result, extra=extra
        )

    result = epochs.change_epoch(cluster, job, change, pause, history)
    cluster.last_move, cluster.last_pause = time.monotonic(), result.pause_s
    for sid in sources:  # stages whose layers changed are measured afresh
        member = cluster.members.by_id(sid)
        if member is not None:
            member.remeasure()
    log.info(
        "layout_set",
        epoch=new_layout.epoch,
        replicas=[cluster.names(p.stage_ids) for p in new_layout.replicas],
        boundaries=[list(p.boundaries) for p in new_layout.replicas],
        shares=list(new_layout.shares),
        layers_pulled=result.layers_moved,
        pause_s=round(result.pause_s, 3),
    )
    return new_layout, result


def _sources(
    old: Layout, chains: Sequence[Partition], live: set[str]
) -> dict[str, list[tuple[int, str]]]:
    """What each stage of ``chains`` pulls: every layer of its range it does not hold in
    ``old``, from a live holder there (in the same replica if it can).

    Raises:
        InvalidRequest: a layer no live stage of ``old`` holds.
    """
    held = {
        ref.stage_id: set(p.layers_of(s)) for p in old.replicas for s, ref in enumerate(p.stages)
    }
    sources: dict[str, list[tuple[int, str]]] = {}
    for r, chain in enumerate(chains):
        for s, ref in enumerate(chain.stages):
            for layer in chain.layers_of(s):
                if layer in held.get(ref.stage_id, ()):
                    continue
                mine = old.replica_of_stage(ref.stage_id)  # its own old replica's first
                holder = _live_holder(old, layer, live, first=r if mine is None else mine)
                if holder is None:
                    raise InvalidRequest(f"layer {layer} has no live holder to be copied from")
                sources.setdefault(ref.stage_id, []).append((layer, holder.address))
    return sources


def check_divergence(cluster: Cluster) -> bool:
    """Compares the digest (BLAKE3) that every live holder of a layer reports for its own snapshot
    of the same step; holders that differ fail the job with ``ReplicaDivergence``, naming
    the layer, the step and the hosts on each side. Snapshots taken before the job's last
    rollback (its ``restore_epoch``) are of another history and left out.

    Returns:
        Whether the job was failed.
    """
    layout, job = cluster.layout, cluster.job
    if layout is None or job is None or cluster.failure:
        return False
    since = layout.replicas[0].restore_epoch
    seen: dict[tuple[int, int], dict[bytes, list[str]]] = {}
    for sid in layout.stage_ids:
        member = cluster.members.by_id(sid)
        if member is None or not cluster.members.alive(member):
            continue
        for held in member.snapshots:
            if held.job_id != job.job_id or held.peer_copy or held.taken_epoch < since:
                continue
            if len(held.digests) != len(held.layers):
                continue
            for layer, digest in zip(held.layers, held.digests, strict=True):
                names = seen.setdefault((held.step, layer), {}).setdefault(digest, [])
                names.append(member.row.name)
    for (step, layer), by_digest in sorted(seen.items()):
        if len(by_digest) > 1:
            sides = "; ".join(
                f"{', '.join(names)}: blake3 {digest.hex()[:16]}"
                for digest, names in by_digest.items()
            )
            cluster.fail_job(
                f"layer {layer} differs between replicas at step {step} ({sides}): the "
                "replicas no longer train one model (hosts computing different bits, or "
                "state a layer keeps outside its gradients)",
                ReplicaDivergence,
            )
            return True
    return False


def layout_candidates(cluster: Cluster) -> tuple[list[str], list[LayoutPlan]]:
    """What ``replicas="auto"`` would choose over the job's stages and the spares: those
    stages (the job's first, registration order), and the best layout per replica count,
    the fastest first (``planning.layouts``; hosts are indices into the stages)."""
    job, _ = cluster.require_job()
    stage_ids = [*cluster.job_stage_ids(), *(m.row.stage_id for m in cluster.spares())]
    mem = cluster.memory(stage_ids)
    in_seconds = cluster.in_seconds(stage_ids)
    bandwidth = cluster.reduce_bandwidth(in_seconds)
    try:
        return stage_ids, plan_layouts(
            cluster.costs(),
            cluster.speeds(stage_ids),
            job.micro_batches,
            job.schedule,
            param_bytes=cluster.param_bytes if bandwidth else None,
            reduce_bandwidth=bandwidth,
            layer_memory=mem.layer_memory,
            host_memory=mem.stage_memory,
            slot_s=cluster.slot_overhead(in_seconds),
            per_step=cluster.per_step(in_seconds),
        )
    except PlanError as exc:
        log.info("layouts_unplanned", why=str(exc))
        return stage_ids, []


def new_replica(
    cluster: Cluster, layout: Layout, spares: Sequence[Member]
) -> tuple[Partition, float, float] | None:
    """A replica of ``spares``, ordered and partitioned by the planner (under their memory),
    with the predicted step of ``layout`` now and with it added (the shares water-filled
    again); None when the spares cannot hold the model or the micro-batches are too few."""
    job = cluster.job
    assert job is not None
    if len(layout.replicas) + 1 > job.micro_batches:
        return None
    stage_ids = [m.row.stage_id for m in spares]
    speeds = cluster.speeds(stage_ids)
    try:
        order, plan = order_hosts(
            cluster.costs(), speeds, *cluster.links(len(speeds)), *cluster.memory(stage_ids)
        )
    except PlanError:
        return None
    refs = tuple(StageRef(spares[i].row.stage_id, spares[i].row.address) for i in order)
    chain = layout.replicas[0].evolve(boundaries=plan.boundaries, stages=refs)
    # Like for like: predictions on both sides (the new replica's pipeline is not
    # measured, so the others' measured shortfalls are left out too), the best shares each.
    now_s = replica_options.layout_step(cluster, layout.replicas)
    new_s = replica_options.layout_step(cluster, [*layout.replicas, chain])
    return chain, now_s, new_s


def planned_shares(cluster: Cluster, layout: Layout) -> tuple[float, float, tuple[int, ...]]:
    """The predicted step of ``layout``'s shares and of the best shares for the live
    speeds and the replicas' measured pipelines (``replica_options.measured_step_times``),
    and those shares."""
    job = cluster.job
    assert job is not None
    times = replica_options.measured_step_times(cluster, layout)
    best = assign_shares(times, job.micro_batches, 1)
    return slowest(times, layout.shares), slowest(times, best), best


def _live_holder(layout: Layout, layer: int, live: set[str], first: int) -> StageRef | None:
    """A live stage holding ``layer`` in ``layout``: replica ``first``'s if it is live, else
    the lowest other replica's."""
    order = [first, *(r for r in range(len(layout.replicas)) if r != first)]
    for r in order:
        if r < len(layout.replicas):
            holder = layout.replicas[r].owner_of(layer)
            if holder.stage_id in live:
                return holder
    return None


def _at_epoch(layout: Layout, epoch: int) -> Layout:
    """``layout`` in epoch ``epoch`` (reserved once it is known to be valid)."""
    return Layout(tuple(p.evolve(epoch=epoch) for p in layout.replicas), layout.shares)


def _relaid(
    cluster: Cluster,
    replicas: list[Partition],
    shares: Sequence[int] | None = None,
) -> Layout:
    """The replicas with ``shares`` (default: water-filled again on the planner's
    predictions for the live speeds, with what their chains measured earlier in the job,
    ``replica_options.with_known_shortfalls``; at least one each), each replica's step time
    predicted for its share; in the replicas' epoch (``_at_epoch`` gives the new one)."""
    job = cluster.job
    assert job is not None
    plans = replica_options.plans(cluster, replicas)
    if shares is None:
        times = planned_step_times(plans, job.schedule)
        times = replica_options.with_known_shortfalls(cluster, replicas, times)
        shares = assign_shares(times, job.micro_batches, 1)
    # Each replica predicted as a new layout's (``replicas.lay_out``): the model for its
    # share plus the learned overhead per slot, plus the reduction and the per-step part; with
    # ``--link-bandwidth`` this model counts the links (``replica_options.plans``), a new
    # layout's does not.
    timed = cluster.profile is not None
    predicted = planned_step_times(plans, job.schedule, cluster.slot_overhead(timed))
    once = cluster.once_per_step([p.boundaries for p in replicas], timed)
    return Layout(
        tuple(
            p.evolve(predicted_step_s=t(share) + once if timed else None)
            for p, t, share in zip(replicas, predicted, shares, strict=True)
        ),
        tuple(shares),
    ).validate(cluster.num_layers or None, job.micro_batches)
