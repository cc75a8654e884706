"""Changing the partition at a consistent cut: the two-phase epoch change, made durable.

1. **Freeze** every stage of the old and new chains: each waits for its step boundary
   (a recovery aborts the run in flight instead) and then refuses new runs, under a lease.
   A move needs every stage of the old chain at the same committed step.
2. **Prepare**: each stage of the new chain gathers what it will own -- a move pulls the
   incoming layers' live state from their owners; a recovery builds every layer from the
   snapshot of the step it rolls back to; a checkpoint load takes what the client
   streamed -- checksummed, and holds it aside.
3. The new partition and a "committed" record are written to the store in one
   transaction -- **the commit point** -- and **CommitEpoch** makes every stage install
   what it holds.

The change is recorded in the store before it starts ("preparing"). Any failure before
the commit point sends **AbortEpoch** everywhere: nothing staged survives, nothing was
freed, the old epoch stays in force. A coordinator that dies mid-change finds the record
on restart (``finish_pending``) and rolls it back (before the commit point) or forward
(after it); a stage whose freeze lease runs out meanwhile asks ``outcome``.

Every row of the epoch history (a change, a job's start, an abandoned attempt) is made by
``history_row``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from elasticpipe.coordinator import copies
from elasticpipe.coordinator.state import Cluster
from elasticpipe.coordinator.store import EpochRow
from elasticpipe.errors import CommitOutcomeUnknown, ElasticPipeError, NotReady, TransferError
from elasticpipe.layout import Layout
from elasticpipe.logs import get_logger
from elasticpipe.partition import Partition
from elasticpipe.training.job import JobConfig
from elasticpipe.v1 import stage_pb2

log = get_logger(__name__)

COMMIT_ATTEMPTS = 4
FREEZE_TIMEOUT_S = 60.0
TRANSFER_TIMEOUT_S = 120.0
CHANGE_KEY = "epoch_change"
# A job's epochs read to find a load at step 0 (a few starts, moves and recoveries).
HISTORY_SCAN = 10_000

Pause = Callable[[str], None]  # a test hook: blocks at "before_commit_point" and the like


def _no_pause(point: str) -> None:
    return None


@dataclass(frozen=True)
class Change:
    """One epoch change to carry out.

    Attributes:
        kind: "move", "recovery" or "restore" (recorded in the history).
        reason: why (recorded in the history).
        old: the partition in force.
        new: the partition to move to (a fresh epoch).
        rollback_step: recovery and restore: the step the new epoch starts from.
        holders: recovery: layer -> address of a live stage holding its snapshot.
        restored_by_client: restore: the layers were streamed by the client.
        abort_running: recovery: end the run in flight instead of waiting for it.
        gone: addresses of stages that are dead (not contacted).
        old_layout, new_layout: a job of several replicas: every replica before and after
            (``old`` and ``new`` are their replica 0); None: a job of one pipeline.
        sources: with layouts, what each stage (by id) pulls: (layer, address of a live
            holder at the cut, in any replica).
        fresh: recovery of a job whose init_state never loaded: every layer is built anew
            (``unloaded``), from no snapshot.
    """

    kind: str
    reason: str
    old: Partition
    new: Partition
    rollback_step: int | None = None
    holders: dict[int, str] = field(default_factory=dict)
    restored_by_client: bool = False
    abort_running: bool = False
    gone: frozenset[str] = frozenset()
    old_layout: Layout | None = None
    new_layout: Layout | None = None
    sources: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    fresh: bool = False

    @property
    def old_addresses(self) -> tuple[str, ...]:
        """Every stage of the old epoch (every replica's)."""
        return self.old_layout.addresses if self.old_layout else self.old.addresses

    @property
    def involved(self) -> list[str]:
        """Every live stage of the old and new chains (every replica's), old first."""
        new = self.new_layout.addresses if self.new_layout else self.new.addresses
        both = dict.fromkeys(self.old_addresses + new)
        return [a for a in both if a not in self.gone]

    @property
    def replicated(self) -> Layout | None:
        """The new layout when it has several replicas (what the store keeps as such)."""
        layout = self.new_layout
        return layout if layout is not None and len(layout.replicas) > 1 else None

    def record(self, phase: str) -> dict[str, Any]:
        """The store's record of the change in progress."""
        return {
            "epoch": self.new.epoch,
            "phase": phase,
            "kind": self.kind,
            "reason": self.reason,
            "involved": self.involved,
            "old_epoch": self.old.epoch,
            "partition": self.new.to_json(),
            "layout": self.replicated.to_json() if self.replicated else None,
        }


@dataclass(frozen=True)
class MoveResult:
    """What an epoch change did.

    ``pause_s`` is how long training stood still: from the moment every stage was frozen at
    the cut to the moment the new epoch was committed everywhere. ``wait_s`` is how long the
    freeze waited for the step in flight to finish (training went on meanwhile).
    """

    layers_moved: int
    bytes_moved: int
    pause_s: float
    committed_step: int
    wait_s: float = 0.0
    transfer_s: float = 0.0
    cut_steps: tuple[int, ...] = ()  # each old-chain stage's committed step at the freeze


def history_row(
    cluster: Cluster,
    partition: Partition,
    kind: str,
    reason: str,
    *,
    names: Sequence[str] | None = None,
    moved: MoveResult | None = None,
    restored_step: int = 0,
    lost_steps: int = 0,
    detected_at: float = 0.0,
    extra: dict[str, Any] | None = None,
) -> EpochRow:
    """The epoch history's row for ``partition``, stamped now.

    Args:
        cluster: looks up the names of the partition's stages.
        partition: the partition the row is of (its epoch, cut and chain).
        kind: "start", "move", "recovery", "restore", "attach", "abandoned", ...
        reason: why the partition changed (or why the attempt was abandoned).
        names: the chain's stage names, when looked up before the change (default: now).
        moved: what the change did: its layers and bytes moved and its pause (none if None).
        restored_step, lost_steps, detected_at, extra: as ``EpochRow``'s.

    Returns:
        The row, for ``Store.add_epoch`` or the commit point's transaction.
    """
    return EpochRow(
        epoch=partition.epoch,
        at=time.time(),
        reason=reason,
        boundaries=partition.boundaries,
        stage_ids=partition.stage_ids,
        layers_moved=moved.layers_moved if moved is not None else 0,
        bytes_moved=moved.bytes_moved if moved is not None else 0,
        pause_s=moved.pause_s if moved is not None else 0.0,
        extra=extra if extra is not None else {},
        kind=kind,
        job_id=partition.job_id,
        stage_names=tuple(names if names is not None else cluster.names(partition.stage_ids)),
        restored_step=restored_step,
        lost_steps=lost_steps,
        detected_at=detected_at,
    )


def freeze(cluster: Cluster, change: Change, lease_s: float | None = None) -> list[int]:
    """Phase 1: holds every involved stage at its step boundary.

    Returns:
        The committed step of each involved stage, in ``change.involved`` order.
    """
    cluster.store.put(CHANGE_KEY, change.record("preparing"))
    request = stage_pb2.EpochRequest(
        epoch=change.new.epoch,
        lease_s=lease_s or cluster.freeze_lease_s,
        abort_running=change.abort_running,
    )
    replies = cluster.pool.all([(a, request) for a in change.involved], "Freeze", FREEZE_TIMEOUT_S)
    return [int(r.committed_step) for r in replies]


def awaits_weights(cluster: Cluster, job: JobConfig, step: int) -> bool:
    """Whether ``job``'s layers still wait for its ``init_state``: its weights are
    external, and neither a step nor a load (a ``restore`` epoch) ever committed."""
    return not step and _start_unloaded(cluster, job) is not None


def unloaded(cluster: Cluster, job: JobConfig, chain: Iterable[str]) -> bool:
    """Whether ``job``'s layers are still the empty ones its start built for the client's
    load: its history holds no load (``awaits_weights``), and no stage of its ``chain``,
    dead or alive, reported a committed step since the job's start (an older report, a
    heartbeat not yet sent since, is of another job). Assign snapshots none of those
    layers, so a recovery before the load finds no copy and builds them anew
    (``Change.fresh``); a trained job without copies fails as it always did."""
    start = _start_unloaded(cluster, job)
    if start is None:
        return False
    ids = set(chain)
    return not any(
        m.committed_step > 0 and m.epoch >= start
        for m in cluster.members.members()
        if m.row.stage_id in ids
    )


def _start_unloaded(cluster: Cluster, job: JobConfig) -> int | None:
    """The epoch ``job`` started at, if its weights are external and its history holds
    no load; else None (also when the rows read do not reach back to its start: a load
    may lie before them)."""
    if not job.external_weights:
        return None
    history = cluster.store.epochs(limit=HISTORY_SCAN, job_id=job.job_id)
    starts = [row.epoch for row in history if row.kind == "start"]
    if not starts or any(row.kind == "restore" for row in history):
        return None
    return min(starts)


def prepare(
    cluster: Cluster, job: JobConfig, change: Change, cut: int, lease_s: float | None = None
) -> int:
    """Phase 2: every stage of the new chain gathers and stages its layers.

    Returns:
        Bytes transferred.
    """
    spec = job.to_proto()
    rollback = change.rollback_step is not None
    requests = []
    names = cluster.names(change.new.stage_ids)  # a copy's source is checked by name
    # Everything per stage looked up in maps built once: linear in the chain's length.
    outside = change.new.assignment("", names).to_proto()  # an empty range
    stage_at: dict[str, str] = {}
    arriving: dict[str, list[stage_pb2.LayerSource]] = {}
    if change.new_layout is not None:  # every replica, each stage placed in its own chain
        wire = change.new_layout.assignments(cluster.names)
        for ref in (s for chain in change.new_layout.replicas for s in chain.stages):
            stage_at.setdefault(ref.address, ref.stage_id)
        for stage_id, pulls in change.sources.items():
            arriving[stage_id] = [stage_pb2.LayerSource(layer=i, address=a) for i, a in pulls]
    else:
        wire = change.new.assignments(names)
        for ref in change.new.stages:
            stage_at.setdefault(ref.address, ref.stage_id)
        owners = {s.stage_id: s.address for s in change.old.stages}
        for m in change.old.moves_to(change.new):
            arriving.setdefault(m.target, []).append(
                stage_pb2.LayerSource(layer=m.layer, address=owners[m.source])
            )
    for address in change.involved:
        stage_id = stage_at.get(address, "")
        assignment = wire.get(stage_id, outside)
        if rollback:
            incoming = [
                stage_pb2.LayerSource(layer=layer, address=change.holders.get(layer, ""))
                for layer in range(assignment.layer_lo, assignment.layer_hi)
            ]
        else:
            incoming = arriving.get(stage_id, [])
        requests.append(
            (
                address,
                stage_pb2.PrepareEpochRequest(
                    epoch=change.new.epoch,
                    assignment=assignment,
                    incoming=incoming,
                    timeout_s=TRANSFER_TIMEOUT_S,
                    job=spec,
                    committed_step=cut,
                    source_epoch=change.old.epoch,
                    rollback=rollback and not change.restored_by_client,
                    restored_by_client=change.restored_by_client,
                    lease_s=lease_s or cluster.freeze_lease_s,
                    fresh=change.fresh,
                ),
            )
        )
    replies = cluster.pool.all(requests, "PrepareEpoch", TRANSFER_TIMEOUT_S + 5.0)
    return sum(int(r.bytes_received) for r in replies)


def commit(cluster: Cluster, change: Change) -> list[str]:
    """Phase 3 (after the commit point): every stage installs the new epoch.

    CommitEpoch is idempotent, so a stage that missed it is asked again before giving up
    on it; a stage that still misses it asks for the outcome when its lease runs out.

    Returns:
        The stages that could not be told (logged).
    """
    request = stage_pb2.EpochRequest(epoch=change.new.epoch)
    pending = list(change.involved)
    failures: dict[str, str] = {}
    for attempt in range(COMMIT_ATTEMPTS):
        results = cluster.pool.each([(a, request) for a in pending], "CommitEpoch", 30.0)
        failures = {
            a: str(r)
            for a, r in zip(pending, results, strict=True)
            if isinstance(r, ElasticPipeError)
        }
        pending = list(failures)
        if not pending:
            break
        time.sleep(0.2 * (attempt + 1))
    cluster.store.delete(CHANGE_KEY)
    if failures:
        log.error("epoch_commit_incomplete", epoch=change.new.epoch, failures=failures)
    return list(failures)


def abort(cluster: Cluster, epoch: int, addresses: Iterable[str], reason: str) -> None:
    """Abandons ``epoch``'s change on every stage given (best effort) and in the store."""
    request = stage_pb2.EpochRequest(epoch=epoch, reason=reason[:500])
    for address, result in zip(
        addresses,
        cluster.pool.each([(a, request) for a in addresses], "AbortEpoch", 10.0),
        strict=False,
    ):
        if isinstance(result, ElasticPipeError):
            log.warning("abort_epoch_not_delivered", stage=address, epoch=epoch, error=str(result))
    cluster.store.delete(CHANGE_KEY)


History = Callable[["MoveResult"], EpochRow]  # a change's history row, from what it did


def change_epoch(
    cluster: Cluster,
    job: JobConfig,
    change: Change,
    pause: Pause = _no_pause,
    history: History | None = None,
) -> MoveResult:
    """Moves from ``change.old`` to ``change.new`` at a consistent cut, or leaves the old
    partition in force.

    ``history`` makes the change's row of the epoch history; it is written in the commit
    point's transaction (with the pause measured up to then), and written again with the
    whole pause once every stage is told.

    Raises:
        InvalidRequest: ``change.new`` is not a valid partition of the job's layers.
        ElasticPipeError: the change was abandoned (every stage is back on the old epoch).
    """
    started = time.perf_counter()
    involved = change.involved
    moved = (
        [layer for pulls in change.sources.values() for layer, _ in pulls]
        if change.new_layout is not None
        else change.old.moves_to(change.new)
    )
    try:
        change.new.validate(cluster.num_layers or None)
        if change.new_layout is not None:
            change.new_layout.validate(cluster.num_layers or None, job.micro_batches)
        steps = freeze(cluster, change)
        pause("after_freeze")
        old_chain = set(change.old_addresses)
        cut_steps = tuple(s for a, s in zip(involved, steps, strict=True) if a in old_chain)
        if change.fresh and any(cut_steps):
            raise TransferError(
                f"the layers were to be built anew (no load committed), but the stages of "
                f"epoch {change.old.epoch} committed steps {sorted(set(cut_steps))}"
            )
        if change.rollback_step is not None:
            cut = change.rollback_step
        else:
            if len(set(cut_steps)) != 1:
                raise TransferError(
                    f"no consistent cut: the stages of epoch {change.old.epoch} committed "
                    f"steps {sorted(set(cut_steps))}"
                )
            cut = cut_steps[0]
        frozen_at = time.perf_counter()
        received = prepare(cluster, job, change, cut)
        transferred_at = time.perf_counter()
        result = MoveResult(
            layers_moved=len(moved) if change.rollback_step is None else change.new.num_layers,
            bytes_moved=received,
            pause_s=transferred_at - frozen_at,
            committed_step=cut,
            wait_s=frozen_at - started,
            transfer_s=transferred_at - frozen_at,
            cut_steps=cut_steps,
        )
        pause("before_commit_point")
        cluster.store.commit_change(
            change.new, change.record("committed"), history(result) if history else None
        )
    except CommitOutcomeUnknown as exc:  # perhaps committed: undoing could split the stages
        # Neither committed nor aborted (no metric counts it): the leader that next reads
        # the store settles it, and records how in the epoch history.
        log.error("epoch_change_outcome_unknown", epoch=change.new.epoch, error=str(exc))
        raise
    except BaseException as exc:  # whatever went wrong, before the commit point: undo
        log.warning(
            "epoch_change_aborted", epoch=change.new.epoch, kept=change.old.epoch, error=str(exc)
        )
        abort(cluster, change.new.epoch, involved, str(exc))
        record_abandoned(cluster, change, str(exc) or repr(exc))
        cluster.metrics.epoch_change_aborted(change.kind)
        raise
    pause("after_commit_point")
    cluster.adopt(change.new, change.replicated)
    commit(cluster, change)
    result = replace(result, pause_s=time.perf_counter() - frozen_at)
    if history is not None:
        cluster.store.add_epoch(history(result))
    cluster.metrics.epoch_changed(change.kind, received, result.pause_s)
    return result


def record_abandoned(cluster: Cluster, change: Change, why: str) -> None:
    """Records an epoch reserved by a change that was abandoned (so that every epoch
    number in the history is explained)."""
    reason = f"{change.kind} abandoned, epoch {change.old.epoch} kept: {why[:300]}"
    cluster.store.add_epoch(history_row(cluster, change.new, "abandoned", reason))


def finish_pending(cluster: Cluster) -> None:
    """After a restart: rolls forward (past the commit point) or back an interrupted change."""
    record = cluster.store.get(CHANGE_KEY)
    if record is None:
        return
    epoch, involved = int(record["epoch"]), list(record.get("involved", []))
    new = Partition.from_json(record["partition"])
    if record.get("phase") == "committed":
        log.warning("epoch_change_rolled_forward", epoch=epoch, kind=record.get("kind"))
        cluster.adopt(new, Layout.from_json(record["layout"]) if record.get("layout") else None)
        request = stage_pb2.EpochRequest(epoch=epoch)
        cluster.pool.each([(a, request) for a in involved], "CommitEpoch", 30.0)
        cluster.store.delete(CHANGE_KEY)
        # The commit point wrote the change's row; it says now how the change ended.
        written = next((r for r in cluster.store.epochs(1000) if r.epoch == epoch), None)
        reason = f"{record.get('reason')} (finished after a coordinator restart)"
        cluster.store.add_epoch(
            replace(written, reason=f"{written.reason} (finished after a coordinator restart)")
            if written is not None
            else history_row(
                cluster,
                new,
                str(record.get("kind")),
                reason,
                restored_step=new.restored_step if new.restore_epoch == epoch else 0,
            )
        )
        return
    log.warning("epoch_change_rolled_back", epoch=epoch, kind=record.get("kind"))
    abort(cluster, epoch, involved, "the coordinator restarted before the commit point")
    reason = (
        f"{record.get('kind')} abandoned: the coordinator restarted mid-change "
        f"({record.get('reason')})"
    )
    cluster.store.add_epoch(history_row(cluster, new, "abandoned", reason))


def outcome(cluster: Cluster, epoch: int) -> str:
    """Whether ``epoch``'s change committed, was abandoned, or is still in progress."""
    record = cluster.store.get(CHANGE_KEY)
    if record is not None and int(record["epoch"]) == epoch:
        return "committed" if record.get("phase") == "committed" else "pending"
    current = cluster.partition
    if current is not None and current.epoch == epoch:
        return "committed"
    if any(r.epoch == epoch and r.kind != "abandoned" for r in cluster.store.epochs(1000)):
        return "committed"
    return "aborted"


COPIES_WAIT_S = 10.0
# A stage that left the chain (a leave, a drain) took its copies of its predecessor's
# snapshots along: it may exit only once the new epoch's first snapshot is copied, and a
# loaded host may take longer for that (the copies travel at the lowest CPU priority).
# A leaving stage's own deadline (its --drain-timeout) ends the wait sooner.
LEFT_COPIES_WAIT_S = 30.0


def wait_for_copies(
    cluster: Cluster,
    partition: Partition,
    job: JobConfig,
    step: int,
    timeout: float = COPIES_WAIT_S,
) -> bool:
    """Waits until the snapshot of ``step`` (taken when a job starts, at the first step of
    every epoch, or when a client attaches), or a later one, has its copies everywhere, so
    that a failure right after can recover. A stage of ``partition`` declared dead ends
    the wait: its copies will not come, and recovery (which waits for the move's lock)
    must not wait for them either (a leaving stage stays for it: ``Coordinator.leave``).

    Returns:
        Whether the copies arrived within ``timeout`` (else a warning is logged).
    """
    if not job.snapshot_every:
        return True
    need = 2 if partition.num_stages > 1 else 1
    probe = stage_pb2.StatsRequest()
    started = time.monotonic()
    deadline = started + timeout
    while True:
        poll_s = min(5.0, max(0.1, deadline - time.monotonic()))
        results = cluster.pool.each([(a, probe) for a in partition.addresses], "GetStats", poll_s)
        held = {
            sid: list(r.snapshots)
            for sid, r in zip(partition.stage_ids, results, strict=True)
            if not isinstance(r, ElasticPipeError)
        }
        found = copies.copies_by_step(held, job.job_id)
        newest = copies.newest_step(found, partition.num_layers, held, need)
        if newest is not None and newest >= step:
            return True
        dead = [
            sid
            for sid in partition.stage_ids
            if (m := cluster.members.by_id(sid)) is None or m.row.dead
        ]
        if dead or time.monotonic() > deadline:
            why = f"{cluster.names(dead)} declared dead" if dead else "late"
            waited = round(time.monotonic() - started, 3)
            log.warning("snapshot_copies_late", step=step, waited_s=waited, why=why)
            return False
        time.sleep(0.05)


def wait_if_one_left(
    cluster: Cluster,
    old: Partition,
    new: Partition,
    job: JobConfig,
    step: int,
    leave_by: float | None = None,
) -> None:
    """A stage that left the chain took its copies of its predecessor's snapshots along: it
    may exit only once the new epoch's first snapshot (``step``) is copied. Waits for that
    up to ``LEFT_COPIES_WAIT_S``, and no later than ``leave_by`` (a ``time.monotonic``
    deadline: a leaving stage's own); nothing to wait for when no stage left."""
    if not set(old.stage_ids) - set(new.stage_ids):
        return
    wait = LEFT_COPIES_WAIT_S
    if leave_by is not None:
        wait = max(0.0, min(wait, leave_by - time.monotonic()))
    wait_for_copies(cluster, new, job, step, wait)


def check_no_change_in_progress(cluster: Cluster) -> None:
    """Raises NotReady while an epoch change (a checkpoint load, say) is in progress."""
    record = cluster.store.get(CHANGE_KEY)
    if record is not None:
        raise NotReady(
            f"an epoch change to epoch {record['epoch']} ({record.get('kind')}) is in progress"
        )
