"""A job's client leases: who holds the job, fencing older clients, settling undecided runs.

A job is driven by one client at a time. The client holds a *lease* (renewed every few
seconds, released by ``close``) and a *generation* number that its requests carry; a new
client of the same job gets a higher generation and every stage fences the older one
out, so a client that lost its lease can never commit after its successor.

When a client attaches, or when a stage's commit lease runs out while no live client
holds the job, the coordinator settles the run left undecided with the classic rule: if
any stage committed it, the decision was commit, so it commits everywhere; if none did,
it is aborted everywhere.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from elasticpipe.coordinator import copies
from elasticpipe.coordinator.state import Cluster
from elasticpipe.errors import ElasticPipeError, Fenced, JobInUse, NotReady
from elasticpipe.layout import Layout
from elasticpipe.logs import get_logger
from elasticpipe.partition import Partition
from elasticpipe.security import bounds
from elasticpipe.training.job import JobConfig
from elasticpipe.v1 import stage_pb2

log = get_logger(__name__)

SETTLE_WAIT_S = 10.0
SAFE_STEP_TTL_S = 0.2
DEFAULT_LEASE_S = 15.0
SETTLED_KEPT = 1024  # decisions of settled runs kept to answer repeated questions


@dataclass
class Lease:
    """The client holding a job."""

    job_id: str
    client: int
    holder: str
    lease_s: float
    expires: float  # time.monotonic()
    request: str = ""  # the SetupJob request that was granted it ("": none named)
    created: bool = False  # that request started the job (it did not attach)


class Stages(NamedTuple):
    """Stages to settle: their epoch and addresses (the live part of a job)."""

    epoch: int
    addresses: tuple[str, ...]


class Leases:
    """The lease of the client holding the job, the client generations issued, the runs
    left undecided, and the newest safe snapshot step its renewals learn."""

    def __init__(self, cluster: Cluster):
        self.c = cluster
        self._lock = threading.Lock()
        self._safe_cache: tuple[float, int] | None = None
        self._settled: dict[int, str] = {}  # run -> decision, of runs settled here
        # The newest client generation this coordinator issued and to whom ("": nobody),
        # from before its lease exists: what ``grant`` tells a stage that asks meanwhile.
        self._issued: tuple[int, str] = (0, "")
        self.efficiency: tuple[int, float] = (0, 0.0)  # (step, pipeline efficiency) reported
        raw = cluster.store.get("lease")
        self._lease = (
            Lease(
                raw["job_id"],
                int(raw["client"]),
                str(raw["holder"]),
                float(raw["lease_s"]),
                time.monotonic() + float(raw["lease_s"]),  # a restart grants a grace period
                str(raw.get("request", "")),
                bool(raw.get("created", False)),
            )
            if raw
            else None
        )

    def lease(self) -> Lease | None:
        """The live lease, if a client holds the job."""
        with self._lock:
            lease = self._lease
        if lease is None or time.monotonic() >= lease.expires:
            return None
        return lease

    def replayed(self, request: str) -> Lease | None:
        """The live lease that SetupJob ``request`` was granted, if it is a resend (its
        reply was lost with the coordinator that sent it: the caller asks again)."""
        lease = self.lease()
        return lease if request and lease is not None and lease.request == request else None

    def _check_free(self, current: JobConfig | None, request: str = "") -> None:
        """Raises JobInUse while a live client holds the running job (unless ``request``
        is the one that was granted it)."""
        lease = self.lease()
        if current is not None and lease is not None and not self.replayed(request):
            raise JobInUse(
                f"job {current.job_id} ({current.model}) is held by client {lease.holder!r}: "
                "close that pipeline first, or wait until its lease runs out "
                f"({lease.lease_s:.0f}s after it stopped renewing it)"
            )

    def _issue(self, holder: str) -> int:
        """A fresh client generation (fencing every earlier client), issued to ``holder``."""
        with self._lock:
            client = self.c.store.next_client()
            self._issued = (client, holder)
        return client

    def _grant(
        self,
        job_id: str,
        lease_s: float,
        holder: str,
        client: int = 0,
        request: str = "",
        created: bool = False,
    ) -> int:
        client = client or self._issue(holder)
        with self._lock:
            expires = time.monotonic() + lease_s
            self._lease = Lease(job_id, client, holder, lease_s, expires, request, created)
            self.efficiency = (0, 0.0)  # the new holder reports its own
            record = {"job_id": job_id, "client": client, "holder": holder, "lease_s": lease_s}
            self.c.store.put("lease", {**record, "request": request, "created": created})
        return client

    def renew(
        self,
        job_id: str,
        client: int,
        release: bool,
        efficiency: tuple[int, float] = (0, 0.0),
        loop_pauses: Sequence[tuple[int, float]] = (),
    ) -> tuple[bool, int]:
        """Renews (or releases) a client's lease; keeps the pipeline efficiency of the
        client's last step (``efficiency``: step, figure; step 0 when none yet) and what
        epoch changes cost its training loop (``loop_pauses``: epoch, seconds) in their rows
        of the epoch history.

        Returns:
            Whether the client still holds the job, and the newest safe snapshot step.

        Raises:
            LayersLost: the job failed beyond recovery (``ReplicaDivergence`` among its
                kinds): a client whose stages still run learns it here.
        """
        if not release and self.c.failure and self.c.job and self.c.job.job_id == job_id:
            raise self.c.failure_kind(self.c.failure)
        with self._lock:
            lease = self._lease
            held = lease is not None and lease.job_id == job_id and lease.client == client
            if held and lease is not None:
                self._record_loop_pauses(job_id, loop_pauses)
                if release:
                    self._lease = None
                    self.c.store.delete("lease")
                    log.info("client_released", job=job_id, client=lease.holder)
                else:
                    lease.expires = time.monotonic() + lease.lease_s
                    if efficiency[0]:
                        self.efficiency = efficiency
                        self.c.metrics.efficiency_reported(*efficiency)
        return held, self.safe_step()

    def _record_loop_pauses(self, job_id: str, pauses: Sequence[tuple[int, float]]) -> None:
        """Writes the reported loop pauses into the history; a store that fails to take
        them costs the figures, never the lease."""
        for epoch, pause_s in pauses:
            try:
                if self.c.store.set_loop_pause(job_id, epoch, pause_s):
                    self.c.metrics.loop_paused(pause_s)
            except Exception as exc:  # sqlite3 errors: disk full, I/O
                log.warning("loop_pause_not_recorded", epoch=epoch, error=str(exc))

    def safe_step(self) -> int:
        """The newest step whose snapshot survives any single failure (0 if none).

        Only stages that took part in the last rollback count (their heartbeat's epoch is
        at least the partition's ``restore_epoch``): anything older may be of another
        history. Computed at most every ``SAFE_STEP_TTL_S`` (heartbeats ask for it).
        """
        now = time.monotonic()
        cached = self._safe_cache
        if cached is not None and now - cached[0] < SAFE_STEP_TTL_S:
            return cached[1]
        partition, job = self.c.partition, self.c.job
        found: int | None = 0
        if partition is not None and job is not None and job.snapshot_every:
            members = [
                m
                for m in self.c.members.members()
                if self.c.members.alive(m) and m.epoch >= partition.restore_epoch
            ]
            held = {m.row.stage_id: m.snapshots for m in members}
            need = 2 if partition.num_stages > 1 else 1
            layout = self.c.layout
            if layout is not None and any(p.num_stages > 1 for p in layout.replicas):
                # Replicas roll back only when every holder of a layer died: then only the
                # copies on their peers (which hold other layers) are left. (Replicas of
                # one stage each keep no such copies: then as one pipeline.)
                held = {sid: [h for h in hs if h.peer_copy] for sid, hs in held.items()}
                need = 1
            found = copies.newest_step(
                copies.copies_by_step(held, job.job_id), partition.num_layers, held, need
            )
        self._safe_cache = (now, found or 0)
        return found or 0

    # ---- settling undecided runs -----------------------------------------------------

    def live_stages(self) -> Stages:
        """The job's live stages (every replica's), to settle without the dead ones."""
        everyone = self.c.job_layout()
        if everyone is None:
            return Stages(0, ())
        alive = {m.row.stage_id for m in self.c.members.members() if self.c.members.alive(m)}
        pairs = zip(everyone.stage_ids, everyone.addresses, strict=True)
        return Stages(everyone.epoch, tuple(a for sid, a in pairs if sid in alive))

    def settle_without_client(self) -> None:
        """Before a recovery that rolls nothing back (a job of several replicas): the run
        in flight must be decided on every live stage before they freeze. A live client
        decides it within moments; while stages still await a decision and the client's
        lease still runs (a client that died with the stage), this waits for the lease to
        run out, then decides it on the live stages (a run committed on any is committed
        on all, else aborted), fencing the client that left."""
        with self.c.move_lock:
            probe = stage_pb2.StatsRequest()
            while (lease := self.lease()) is not None:
                live = self.live_stages()
                replies = self.c.pool.each([(a, probe) for a in live.addresses], "GetStats", 5.0)
                if not any(
                    not isinstance(r, ElasticPipeError) and r.state.phase == "awaiting_commit"
                    for r in replies
                ):
                    return  # nothing undecided (or the client decided it meanwhile)
                time.sleep(min(0.1, max(0.0, lease.expires - time.monotonic())))
            self.settle(self.live_stages(), self._issue(""))
            with self._lock:
                self._lease = None
                self.c.store.delete("lease")

    def settle(self, partition: Partition | Layout | Stages, client: int, holder: str = "") -> int:
        """Makes every stage (of every replica, given a layout) follow client generation
        ``client``, held by ``holder`` (the certificate name of the client granted the job;
        empty: nobody), fencing out older clients, and decides any undecided run.

        Returns:
            The step every stage has committed.

        Raises:
            StageUnavailable: a stage of the chain cannot be reached (recovery follows).
            NotReady: the stages disagree on the committed step.
        """
        fence = [
            (a, stage_pb2.FenceRequest(client=client, holder=holder)) for a in partition.addresses
        ]
        deadline = time.monotonic() + SETTLE_WAIT_S
        states = self.c.pool.all(fence, "Fence", 10.0)
        while any(s.phase == "running" for s in states) and time.monotonic() < deadline:
            time.sleep(0.05)  # a fenced run is being woken; it ends within a moment
            states = self.c.pool.all(fence, "Fence", 10.0)
        undecided = {(s.active_run, s.active_step) for s in states if s.phase == "awaiting_commit"}
        for run, step in undecided:
            committed = any(s.committed_run == run or s.committed_step >= step for s in states)
            if committed:
                # The clipping the committed stages applied (a run committed anywhere had
                # its decision, coefficient included, delivered there).
                clips = [s.committed_clip for s in states if s.committed_run == run]
                request = stage_pb2.CommitStepRequest(
                    epoch=partition.epoch,
                    run=run,
                    step=step,
                    client=client,
                    clip=clips[0] if clips else None,
                )
                targets = [
                    a
                    for a, s in zip(partition.addresses, states, strict=True)
                    if s.phase == "awaiting_commit" and s.active_run == run
                ]
                self.c.pool.all([(a, request) for a in targets], "CommitStep", 30.0)
            else:
                request_abort = stage_pb2.AbortStepRequest(
                    run=run, reason="settled: no stage committed it", client=client
                )
                self.c.pool.all(
                    [(a, request_abort) for a in partition.addresses], "AbortStep", 30.0
                )
            log.info("run_settled", run=run, step=step, decision="commit" if committed else "abort")
        if undecided:
            states = self.c.pool.all(fence, "Fence", 10.0)
        steps = sorted({int(s.committed_step) for s in states})
        if len(steps) != 1:
            raise NotReady(
                f"the stages of epoch {partition.epoch} committed different steps {steps}"
            )
        return steps[0]

    def resolve_run(self, stage_id: str, run: int, step: int) -> str:
        """A stage's commit lease ran out on ``run``: decide it unless a live client can.

        A run is settled once (fencing its client with a new generation); the decision is
        kept, and every later question about it -- each stage awaiting it asks, and asks
        again -- is answered from it without the lock. The lease is checked again under
        ``move_lock``: a client that attached or started a job meanwhile decides instead.

        Returns:
            "wait" (a live client holds the job), "commit" or "abort".
        """
        decided = self._settled.get(run)
        if decided is not None:
            return decided
        lease = self.lease()
        if lease is not None:
            # A live client decides; but a run committed anywhere is committed: that
            # decision can be delivered now without the client.
            return "commit" if self._deliver_commit(run, step, lease.client) else "wait"
        with self.c.move_lock:
            decided = self._settled.get(run)
            if decided is not None:
                return decided
            lease = self.lease()
            if lease is not None:  # a client attached or started a job meanwhile
                return "commit" if self._deliver_commit(run, step, lease.client) else "wait"
            self.c.require_job()
            issued = int(self.c.store.get("client_generation") or 0)
            if stage_id not in self.c.job_stage_ids() or bounds.generation(run) > issued:
                # Not a run of the running job's chain (a stage moved out, an old job's
                # run, a generation never issued): nothing to settle, the stage drops it.
                log.info("run_resolved", stage=self.c.name(stage_id), run=run, decision="abort")
                return "abort"
            client = self._issue("")  # fences whichever client ran it
            committed = self.settle(self.live_stages(), client)  # a dead stage settles nothing
            with self._lock:  # the fenced client's lease is over
                self._lease = None
                self.c.store.delete("lease")
            decision = "commit" if committed >= step else "abort"
            self._settled[run] = decision
            while len(self._settled) > SETTLED_KEPT:
                del self._settled[min(self._settled)]
        log.info("run_resolved", stage=self.c.name(stage_id), run=run, step=step, decision=decision)
        return decision

    def _deliver_commit(self, run: int, step: int, client: int) -> bool:
        """Commits ``run`` on the stages still awaiting it if some stage committed it."""
        partition = self.c.job_layout()  # every stage of every replica
        if partition is None:
            return False
        probe = stage_pb2.StatsRequest()
        results = self.c.pool.each([(a, probe) for a in partition.addresses], "GetStats", 5.0)
        states = [
            (a, r.state)
            for a, r in zip(partition.addresses, results, strict=True)
            if not isinstance(r, ElasticPipeError)
        ]
        clips = [st.committed_clip for _, st in states if st.committed_run == run]
        if not clips:
            return False
        request = stage_pb2.CommitStepRequest(
            epoch=partition.epoch, run=run, step=step, client=client, clip=clips[0]
        )
        waiting = [a for a, st in states if st.phase == "awaiting_commit" and st.active_run == run]
        self.c.pool.each([(a, request) for a in waiting], "CommitStep", 30.0)
        return True

    def grant(self) -> tuple[str, int, str]:
        """The running job, the newest client generation granted (which the stages
        follow) and its holder ("" when no client holds the job)."""
        job = self.c.job
        with self._lock:
            lease, (issued_to_gen, issued_to) = self._lease, self._issued
            issued = int(self.c.store.get("client_generation") or 0)
        if job is None:
            return "", 0, ""
        if lease is not None and lease.job_id == job.job_id and lease.client == issued:
            return job.job_id, lease.client, lease.holder
        # A generation issued but not yet leased (a client being attached or started: the
        # stages are being fenced to it) names its holder, so a stage that asks in between
        # does not lock that client out.
        return job.job_id, issued, issued_to if issued_to_gen == issued else ""

    def _check_holder(self, job_id: str, client: int) -> tuple[JobConfig, Partition]:
        job, partition = self.c.require_job()
        lease = self.lease()
        if job.job_id != job_id or lease is None or lease.client != client:
            raise Fenced(
                f"client generation {client} does not hold job {job_id} "
                f"(holder: {lease.holder if lease else 'nobody'})"
            )
        return job, partition
