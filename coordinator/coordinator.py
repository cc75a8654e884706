"""The coordinator: membership, jobs, rebalancing and recovery over one shared cluster state.

Each responsibility lives in its own module -- ``jobs`` (setup, attach, leases, loads),
``rebalancing`` (planning, policy loop, admin levers), ``recovery`` (failure detection
and rollback), ``epochs`` (the two-phase epoch change) -- and works on one ``Cluster``.
This class wires them together, finishes an epoch change a previous run left in flight,
and runs the background loops. It is never on the data path: training goes on while it
is down.
"""

from __future__ import annotations

import threading
import time

from elasticpipe.coordinator import epochs
from elasticpipe.coordinator.estimates import Timing
from elasticpipe.coordinator.jobs import Jobs
from elasticpipe.coordinator.membership import Heard, Member, Membership
from elasticpipe.coordinator.policy import PolicyConfig
from elasticpipe.coordinator.rebalancing import MoveOutcome, Rebalancer, run_loop
from elasticpipe.coordinator.recovery import Recovery
from elasticpipe.coordinator.state import Cluster
from elasticpipe.coordinator.store import Store
from elasticpipe.errors import InvalidRequest, NotReady
from elasticpipe.logs import get_logger
from elasticpipe.structure import Value
from elasticpipe.tls import TLS
from elasticpipe.v1 import stage_pb2

log = get_logger(__name__)

PAUSE_POINTS = ("after_freeze", "before_commit_point", "after_commit_point")


class Coordinator:
    """The control plane of one cluster."""

    def __init__(
        self,
        store: Store,
        policy: PolicyConfig | None = None,
        dead_after_s: float = 5.0,
        heartbeat_interval_s: float = 1.0,
        link_bandwidth: float = 0.0,
        pause_at: str = "",
        freeze_lease_s: float = 60.0,
        tls: TLS | None = None,
    ):
        if pause_at and pause_at not in PAUSE_POINTS:
            raise InvalidRequest(
                f"unknown pause point {pause_at!r} (choose from {list(PAUSE_POINTS)})"
            )
        self.cluster = Cluster(
            store, dead_after_s, heartbeat_interval_s, link_bandwidth, freeze_lease_s, tls
        )
        self._pause_at = pause_at
        self._released = threading.Event()
        self.jobs = Jobs(self.cluster, self._pause)
        self.rebalancer = Rebalancer(self.cluster, policy or PolicyConfig(), self._pause)
        self.recovery = Recovery(self.cluster, self._pause, self.jobs.abandon_stale_load)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # ---- shortcuts -------------------------------------------------------------------

    @property
    def store(self) -> Store:
        """The durable state."""
        return self.cluster.store

    @property
    def members(self) -> Membership:
        """Membership (incarnations and liveness)."""
        return self.cluster.members

    @property
    def heartbeat_interval_s(self) -> float:
        """How often stages report."""
        return self.cluster.heartbeat_interval_s

    def _pause(self, point: str) -> None:
        """Blocks for good at a test's pause point (the test then kills the process)."""
        if point == self._pause_at:
            log.warning("paused_at", point=point)
            self._released.wait()

    # ---- membership ------------------------------------------------------------------

    def register(self, name: str, address: str, device: str, memory_bytes: int = 0) -> str:
        """Registers a new incarnation of a stage (older ones of the name are dead)."""
        if not name or not address:
            raise InvalidRequest(
                f"register needs a name and an address (got {name!r}, {address!r})"
            )
        previous = max(
            (m for m in self.cluster.members.members() if m.row.name == name),
            key=lambda m: m.row.incarnation,
            default=None,
        )
        stage_id, older = self.cluster.members.register(name, address, device, memory_bytes)
        state = "spare" if self.cluster.job is not None else "registered"
        log.info("stage_registered", stage_id=stage_id, name=name, address=address, state=state)
        if previous is not None:  # the same name again: a new incarnation, the old one dead
            log.warning(
                "stage_came_back",
                name=name,
                old=previous.row.stage_id,
                new=stage_id,
                old_state="alive, declared dead now" if older else "dead",
                state=state,
            )
        return stage_id

    def heartbeat(
        self,
        stage_id: str,
        epoch: int,
        timings: dict[int, Timing],
        committed_step: int,
        slowdown: float,
        state: stage_pb2.RunState | None = None,
        snapshots: list[stage_pb2.SnapshotHolding] | None = None,
    ) -> Heard:
        """Records a stage's report."""
        members = self.cluster.members
        member = members.by_id(stage_id)
        was_silent = member is not None and members.silent(member)
        heard = members.heartbeat(
            stage_id, epoch, timings, committed_step, slowdown, state, snapshots
        )
        if heard is Heard.OK:
            self.cluster.metrics.heard(committed_step)
        if was_silent and heard is Heard.OK and member is not None:
            log.info("stage_heard_again", stage=member.row.name)
        return heard

    def live_members(self) -> list[Member]:
        """Stages heard from recently and not drained, in registration order."""
        return self.cluster.live_members()

    def forget(self, key: str) -> str:
        """Removes a dead stage from membership.

        Raises:
            InvalidRequest: unknown stage, or one that is alive (drain it instead).
        """
        member = self.cluster.members.find(key)
        if member is None:
            raise InvalidRequest(f"unknown stage {key!r}")
        if self.cluster.members.alive(member):
            raise InvalidRequest(
                f"stage {member.row.name} is alive: drain it, stop it, then forget it"
            )
        partition = self.cluster.partition
        if partition is not None and member.row.stage_id in partition.stage_ids:
            raise InvalidRequest(
                f"stage {member.row.name} still holds layers of the partition: "
                "it will be replaced by recovery first"
            )
        self.cluster.members.forget(member.row.stage_id)
        log.info("stage_forgotten", stage=member.row.name, stage_id=member.row.stage_id)
        return f"forgot {member.row.name} ({member.row.stage_id})"

    def leave(self, stage_id: str, timeout: float) -> MoveOutcome:
        """A stage shutting down (SIGTERM): move its layers off, then it may exit."""
        member = self.cluster.members.by_id(stage_id)
        if member is None:
            raise NotReady(f"unknown stage id {stage_id!r}")
        self.cluster.members.mark_leaving(stage_id)
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.rebalancer.drain(stage_id, f"{member.row.name} is leaving")
            except NotReady:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.5)

    def profile_job(self, job_id: str, client: int, sample: Value) -> None:
        """Profiles a job set up without a sample, then moves to the partition the
        profile calls for if it is predicted faster (else the job keeps its epoch: no
        move, and no epoch in its history, for nothing)."""
        self.jobs.profile_later(job_id, client, sample)
        view = self.rebalancer.plan_view()
        moved = False
        if view.optimal_step_s < view.current_step_s:
            outcome = self.rebalancer.rebalance(dry_run=False, reason="profiled", force=True)
            moved = outcome.changed
        log.info(
            "job_profiled",
            job=job_id,
            moved=moved,
            predicted_step_s=round(view.current_step_s, 6),
            optimal_step_s=round(view.optimal_step_s, 6),
        )

    def slowdown(self, key: str, factor: float) -> str:
        """Changes a stage's emulated slowdown."""
        member = self.rebalancer._member(key)
        self.cluster.pool.call(
            member.row.address, "SetSlowdown", stage_pb2.SlowdownRequest(factor=factor), 10.0
        )
        log.info("slowdown_set", stage=member.row.name, factor=factor)
        return f"{member.row.name} slowdown set to {factor:g}"

    # ---- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        """Finishes an interrupted epoch change, then starts the background loops."""
        epochs.finish_pending(self.cluster)
        interval = self.rebalancer.policy.interval_s
        self._threads = [
            run_loop(self._stop, interval, self.rebalancer.tick, "policy"),
            threading.Thread(target=self._watch, name="recovery", daemon=True),
        ]
        self._threads[-1].start()

    def _watch(self) -> None:
        interval = max(0.05, self.cluster.heartbeat_interval_s / 2)
        while not self._stop.is_set():
            self.recovery.wait(interval)
            if self._stop.is_set():
                return
            try:
                self.recovery.check()
                self.jobs.expire_restore()
            except Exception as exc:  # the loop must outlive any one failed attempt
                log.warning("recovery_loop_failed", error=str(exc))

    def close(self) -> None:
        """Stops the loops and closes channels."""
        self._stop.set()
        self.recovery.wake()
        for thread in self._threads:
            thread.join(timeout=5)
        self.cluster.pool.close()
