"""Recovering from a dead stage: detect, pick the new chain, roll back to a snapshot.

A stage of the chain is declared dead when it misses its heartbeats for ``dead_after_s``,
or at once when a client reports a failure and a probe finds it unreachable. Then:

1. The new chain keeps every survivor in place; each dead stage's place goes to a spare
   (a live stage outside the chain) if there is one, else the chain shrinks.
2. The newest snapshot step with a live copy of every layer is chosen (``copies``).
3. The planner partitions the layers over the new chain.
4. An epoch change with rollback (``epochs``) aborts the run in flight on the survivors,
   builds every layer of the new partition from that snapshot -- each stage from its own
   copy where it has one, else from a live holder -- and commits it. The client sees the
   new partition's ``restore_epoch`` and replays the mini-batches after the step restored.

If some layer has no live copy left, the job fails with ``LayersLost`` naming the layers
and the hosts lost with them; every waiting client gets that error, nothing hangs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from elasticpipe.coordinator import copies, epochs, replica_changes
from elasticpipe.coordinator.epochs import Change
from elasticpipe.coordinator.membership import LEFT_REASON, Member
from elasticpipe.coordinator.planning import plan
from elasticpipe.coordinator.state import Cluster
from elasticpipe.coordinator.store import EpochRow
from elasticpipe.errors import DeadlineExceeded, ElasticPipeError, StageUnavailable
from elasticpipe.logs import get_logger
from elasticpipe.partition import Partition, StageRef
from elasticpipe.v1 import stage_pb2

log = get_logger(__name__)

PROBE_TIMEOUT_S = 2.0


class Recovery:
    """Failure detection and recovery of the running job."""

    def __init__(
        self,
        cluster: Cluster,
        pause: epochs.Pause = epochs._no_pause,
        abandon_stale_load: Callable[[], bool] = lambda: False,
        settle_without_client: Callable[[], None] = lambda: None,
    ):
        self.c = cluster
        self._pause = pause
        self._abandon_stale_load = abandon_stale_load
        self._settle_without_client = settle_without_client
        self._wake = threading.Event()
        self.recoveries = 0

    # ---- detection -------------------------------------------------------------------

    def dead_in_chain(self) -> list[Member]:
        """Chain stages declared dead or silent for too long."""
        out = []
        for sid in self.c.job_stage_ids():  # of every replica
            member = self.c.members.by_id(sid)
            if member is not None and (member.row.dead or self.c.members.silent(member)):
                out.append(member)
        return out

    def report(self, suspects: Sequence[str], error: str) -> list[str]:
        """A client saw a failure: probe the chain and declare the unreachable stages dead.

        Returns:
            The names declared dead (recovery then runs in the background).
        """
        everyone = self.c.job_layout()  # every replica's stages
        if everyone is None:
            return []
        probe = stage_pb2.StatsRequest()
        results = self.c.pool.each(
            [(a, probe) for a in everyone.addresses], "GetStats", PROBE_TIMEOUT_S
        )
        dead = []
        stages = [
            StageRef(i, a) for i, a in zip(everyone.stage_ids, everyone.addresses, strict=True)
        ]
        for ref, result in zip(stages, results, strict=True):
            if isinstance(result, StageUnavailable | DeadlineExceeded):
                reason = f"unreachable after a client's report ({error[:200]})"
                if self.c.members.declare_dead(ref.stage_id, reason):
                    log.warning("stage_declared_dead", stage=self.c.name(ref.stage_id), why=reason)
                dead.append(self.c.name(ref.stage_id))
        if dead:
            self._wake.set()
        else:
            log.info("failure_report_unconfirmed", suspects=list(suspects), error=error[:200])
        return dead

    def wake(self) -> None:
        """Wakes the loop now."""
        self._wake.set()

    def wait(self, timeout: float) -> None:
        """Sleeps until a report wakes the loop or ``timeout`` passes."""
        self._wake.wait(timeout)
        self._wake.clear()

    # ---- recovery --------------------------------------------------------------------

    def check(self) -> None:
        """Declares silent stages dead, and recovers if one of the chain is (called by the
        coordinator's loop)."""
        for member in self.c.members.members():
            if not self.c.members.silent(member):
                continue
            if member.row.left:  # its shutdown finished: gone, but nothing failed
                if self.c.members.declare_dead(member.row.stage_id, LEFT_REASON):
                    log.info("stage_gone", stage=member.row.name, why=LEFT_REASON)
            elif self.c.members.declare_dead(member.row.stage_id, "missed its heartbeats"):
                log.warning(
                    "stage_declared_dead", stage=member.row.name, why="missed its heartbeats"
                )
        if self.c.job is None or self.c.partition is None or self.c.failure:
            return
        if self.c.replicas > 1 and replica_changes.check_divergence(self.c):
            return
        dead = self.dead_in_chain()
        if not dead:
            return
        for member in dead:
            if self.c.members.declare_dead(member.row.stage_id, "missed its heartbeats"):
                log.warning(
                    "stage_declared_dead", stage=member.row.name, why="missed its heartbeats"
                )
        with self.c.move_lock:
            # A change in flight is a checkpoint load (moves hold move_lock to the end): a
            # live client's load fails on the dead stage and aborts; a dead client's is
            # abandoned here so that recovery can go on.
            if self.c.store.get(epochs.CHANGE_KEY) is not None and not self._abandon_stale_load():
                return
            try:
                if self.c.replicas > 1:  # the layers live on in the other replicas
                    self._settle_without_client()  # no rollback: decide the run in flight
                    if (
                        replica_changes.recover(self.c, dead, self._pause, self._holdings)
                        is not None
                    ):
                        self.recoveries += 1
                    return
                self.recover(dead)
            except ElasticPipeError as exc:
                log.error("recovery_failed", error=str(exc))

    def _holdings(
        self, live: set[str], since_epoch: int
    ) -> dict[str, list[stage_pb2.SnapshotHolding]]:
        """What snapshots each live stage holds: asked now (heartbeats may lag by an
        interval), falling back to the last heartbeat's report. Only stages at
        ``since_epoch`` or later count (the last rollback's: older ones may hold snapshots
        of another history)."""
        members = [m for m in self.c.members.members() if m.row.stage_id in live]
        probe = stage_pb2.StatsRequest()
        results = self.c.pool.each(
            [(m.row.address, probe) for m in members], "GetStats", PROBE_TIMEOUT_S
        )
        out = {}
        for m, r in zip(members, results, strict=True):
            if isinstance(r, ElasticPipeError):
                epoch, held = m.epoch, m.snapshots
            else:
                epoch, held = r.epoch, r.snapshots
            if epoch >= since_epoch:
                out[m.row.stage_id] = list(held)
        return out

    def _former_holders(self, layers: Sequence[int], live: set[str], job_id: str) -> list[str]:
        """Stages no longer alive that last reported a snapshot (own or copy) of one of
        ``layers`` of the job: the hosts those layers' copies were lost with."""
        wanted = set(layers)
        return [
            m.row.name
            for m in self.c.members.members()
            if m.row.stage_id not in live
            and any(h.job_id == job_id and wanted & set(h.layers) for h in m.snapshots)
        ]

    def recover(self, dead: Sequence[Member]) -> Partition | None:
        """Replaces or drops the dead stages and rolls every survivor back to a snapshot."""
        job, old = self.c.require_job()
        dead_ids = {m.row.stage_id for m in dead}
        spares = [m for m in self.c.spares() if m.row.stage_id not in dead_ids]
        chain: list[StageRef] = []
        replaced: list[str] = []
        for ref in old.stages:
            if ref.stage_id not in dead_ids:
                chain.append(ref)
            elif spares:
                spare = spares.pop(0)
                chain.append(StageRef(spare.row.stage_id, spare.row.address))
                replaced.append(f"{self.c.name(ref.stage_id)} by {spare.row.name}")
        lost_names = [self.c.name(s) for s in old.stage_ids if s in dead_ids]
        if not chain:
            self.c.fail_job(f"every stage of the chain died ({lost_names}); no spare is left")
            return None
        live = {m.row.stage_id for m in self.c.members.members() if self.c.members.alive(m)}
        found = copies.copies_by_step(self._holdings(live, old.restore_epoch), job.job_id)
        step = copies.newest_step(found, old.num_layers, live)
        fresh = step is None and epochs.unloaded(self.c, job, old.stage_ids)
        if fresh:  # empty layers awaiting the client's init_state: no copies are kept
            step = 0
        if step is None:
            missing, why = copies.lost(
                found,
                old.num_layers,
                live,
                job.snapshot_every,
                [i for i in range(old.num_layers) if old.owner_of(i).stage_id in dead_ids],
            )
            hosts = lost_names + [
                n for n in self._former_holders(missing, live, job.job_id) if n not in lost_names
            ]
            self.c.fail_job(
                f"layers {missing} have no live copy: they were lost with {hosts}; {why}"
            )
            return None
        # A layer comes from a stage of the new chain where possible (most often it holds
        # the copy itself), else from any live holder.
        in_chain = {r.stage_id for r in chain}
        by_preference = sorted(
            (m for m in self.c.members.members() if m.row.stage_id in live),
            key=lambda m: m.row.stage_id not in in_chain,
        )
        addresses = {m.row.stage_id: m.row.address for m in by_preference}
        held = {} if fresh else copies.holders_at(found, step, old.num_layers, addresses)
        holders = {layer: addresses[sid] for layer, sid in held.items()}
        speeds = self.c.speeds([r.stage_id for r in chain])
        if len(chain) > old.num_layers:
            chain = chain[: old.num_layers]
            speeds = speeds[: old.num_layers]
        memory = self.c.memory([r.stage_id for r in chain])
        best = plan(self.c.costs(), speeds, *self.c.links(len(chain)), *memory)
        epoch = self.c.store.reserve_epoch()
        new = Partition(
            epoch=epoch,
            job_id=old.job_id,
            boundaries=best.boundaries,
            stages=tuple(chain),
            predicted_step_s=self.c.chain_step_s(best, job)
            if self.c.in_seconds([r.stage_id for r in chain])
            else None,
            restored_step=step,
            restore_epoch=epoch,
        ).validate(old.num_layers)
        how = f"replaced {', '.join(replaced)}" if replaced else f"shrank to {len(chain)} stages"
        back = (
            "layers built anew: init_state not loaded yet"
            if fresh
            else f"rolled back to step {step}"
        )
        reason = f"stage {', '.join(lost_names)} died; {how}; {back}"
        change = Change(
            "recovery",
            reason,
            old,
            new,
            rollback_step=step,
            holders=holders,
            abort_running=True,
            gone=frozenset(r.address for r in old.stages if r.stage_id in dead_ids),
            fresh=fresh,
        )
        started = time.perf_counter()
        detected = min((m.dead_at for m in dead if m.dead_at), default=0.0)
        names = tuple(self.c.names(new.stage_ids))

        def history(result: epochs.MoveResult) -> EpochRow:
            lost = max((s - step for s in result.cut_steps), default=0)
            return epochs.history_row(
                self.c,
                new,
                "recovery",
                reason,
                names=names,
                moved=result,
                restored_step=step,
                lost_steps=max(lost, 0),
                detected_at=detected,
                extra={"recover_s": time.perf_counter() - started},
            )

        result = epochs.change_epoch(self.c, job, change, self._pause, history)
        self.recoveries += 1
        self.c.last_move = time.monotonic()
        for ref in new.stages:
            member = self.c.members.by_id(ref.stage_id)
            if member is not None:
                member.remeasure()
        log.warning(
            "job_recovered",
            epoch=epoch,
            lost=lost_names,
            stages=self.c.names(new.stage_ids),
            boundaries=list(new.boundaries),
            restored_step=step,
            bytes_restored=result.bytes_moved,
            seconds=round(time.perf_counter() - started, 3),
        )
        return new
