"""The coordinator: membership, jobs, rebalancing and recovery over one shared cluster state.

Each responsibility lives in its own module -- ``jobs`` (setup, attach, leases, loads),
``rebalancing`` (planning, policy loop, admin levers), ``recovery`` (failure detection
and rollback), ``epochs`` (the two-phase epoch change) -- and works on one ``Cluster``.
This class wires them together, finishes an epoch change a previous run left in flight,
and runs the background loops. It is never on the data path: training goes on while it
is down.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable

from elasticpipe.coordinator import epochs
from elasticpipe.coordinator.config import CoordinatorConfig
from elasticpipe.coordinator.jobs import Jobs
from elasticpipe.coordinator.loops import run_loop
from elasticpipe.coordinator.membership import Heard, Member, Membership, Probe, holder_alive
from elasticpipe.coordinator.planning.estimates import Timing
from elasticpipe.coordinator.rebalancing import MoveOutcome, Rebalancer
from elasticpipe.coordinator.recovery import Recovery
from elasticpipe.coordinator.state import Cluster
from elasticpipe.coordinator.store import Store
from elasticpipe.errors import (
    DeadlineExceeded,
    ElasticPipeError,
    InvalidRequest,
    NameInUse,
    NotLeader,
    NotReady,
    Unavailable,
)
from elasticpipe.logs import get_logger
from elasticpipe.v1 import stage_pb2
from elasticpipe.wire.structure import Value

log = get_logger(__name__)

PAUSE_POINTS = ("after_freeze", "before_commit_point", "after_commit_point")
HOLDER_PROBE_S = 2.0  # a registration waits this long at most for the name's holder


class Coordinator:
    """The control plane of one cluster."""

    def __init__(
        self,
        store: Store,
        config: CoordinatorConfig | None = None,
        term: Callable[[], int] | None = None,
        address: str = "",
    ):
        """``term`` and ``address``: see ``Cluster``."""
        config = config or CoordinatorConfig()
        if config.pause_at and config.pause_at not in PAUSE_POINTS:
            raise InvalidRequest(
                f"unknown pause point {config.pause_at!r} (choose from {list(PAUSE_POINTS)})"
            )
        self.cluster = Cluster(store, config, term, address)
        self._pause_at = config.pause_at
        self._released = threading.Event()
        self.jobs = Jobs(self.cluster, self._pause)
        self.rebalancer = Rebalancer(self.cluster, config.policy, self._pause)
        self.recovery = Recovery(
            self.cluster,
            self._pause,
            self.jobs.abandon_stale_load,
            self.jobs.settle_without_client,
        )
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
        """Registers a new incarnation of a stage (older ones of the name are dead).

        A name is one stage's. A registration while an incarnation of the name still
        heartbeats is either a second process under a name in use, or the restart of one
        that died within ``dead_after_s`` -- at another address or at the same one (an
        advertised address can be shared). A probe of the holder's address tells them apart
        (``_probe``, ``holder_alive``): the restart becomes the new incarnation at once; the
        second process is refused, and the holder is left alone.

        Raises:
            InvalidRequest: no name or no address.
            NameInUse: the name's live incarnation answered as itself: the newcomer should
                stop (the stage process exits with code 2).
            NotReady: the name's incarnation still heartbeats but its probe timed out: the
                newcomer retries until it answers (then it is refused) or is missed.
        """
        if not name or not address:
            raise InvalidRequest(
                f"register needs a name and an address (got {name!r}, {address!r})"
            )
        members = self.cluster.members
        holder = members.holder(name)
        probe = self._probe(holder) if holder is not None else Probe.UNREACHABLE
        if holder is not None and holder_alive(
            members.heard_ago(holder), members.dead_after_s, probe
        ):
            heard = holder.last_seen_unix
            ago = f"{time.time() - heard:.1f}s ago" if heard else "not yet"
            log.warning(
                "stage_name_held" if probe is Probe.TIMED_OUT else "stage_name_refused",
                name=name,
                address=address,
                holder=holder.row.stage_id,
                holder_address=holder.row.address,
                probe=probe.name,
            )
            held = (
                f"stage name {name!r} is in use: incarnation {holder.row.incarnation} "
                f"({holder.row.stage_id}) at {holder.row.address} is alive (last heartbeat "
                f"{ago})"
            )
            if probe is Probe.TIMED_OUT:
                raise NotReady(
                    f"{held} but did not answer within {HOLDER_PROBE_S:.0f}s; {address} "
                    f"waits: it is refused once the holder answers, and takes the name "
                    f"once the holder misses its heartbeats"
                )
            raise NameInUse(
                f"{held} and answers; {address} was refused. Give this stage another "
                f"--name, or stop the one at {holder.row.address} first"
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

    def _probe(self, holder: Member) -> Probe:
        """Asks the holder's address which incarnation answers there (``GetStats``,
        ``HOLDER_PROBE_S`` at most)."""
        try:
            reply = self.cluster.pool.call(
                holder.row.address, "GetStats", stage_pb2.StatsRequest(), HOLDER_PROBE_S
            )
        except DeadlineExceeded:
            probe = Probe.TIMED_OUT
        except Unavailable:
            probe = Probe.UNREACHABLE
        except ElasticPipeError:  # something else answers there now
            probe = Probe.ERROR
        else:
            probe = Probe.ITSELF if reply.stage_id == holder.row.stage_id else Probe.OTHER
        log.info(
            "stage_holder_probed",
            stage=holder.row.name,
            holder=holder.row.stage_id,
            address=holder.row.address,
            probe=probe.name,
        )
        return probe

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
        """Removes dead (or departed) incarnations from membership: the one of an id, or
        every one of a name or address that is no longer alive -- a replacement that now
        holds the name stays.

        Raises:
            InvalidRequest: unknown stage; only live incarnations match (drain them
                instead); or the dead ones still hold layers (recovery replaces them first).
        """
        members = self.cluster.members
        exact = members.by_id(key)
        matching = (
            [exact]
            if exact is not None
            else [m for m in members.members() if key in (m.row.name, m.row.address)]
        )
        if not matching:
            raise InvalidRequest(f"unknown stage {key!r}")
        gone = [m for m in matching if not members.alive(m)]
        if not gone:
            live = max(matching, key=lambda m: m.row.incarnation)
            raise InvalidRequest(
                f"stage {live.row.name} ({live.row.stage_id}) is alive: drain it, stop it, "
                "then forget it"
            )
        held = set(self.cluster.job_stage_ids())
        forgettable = [m for m in gone if m.row.stage_id not in held]
        if not forgettable:
            raise InvalidRequest(
                f"stage {gone[0].row.name} ({gone[0].row.stage_id}) still holds layers of the "
                "partition: it will be replaced by recovery first"
            )
        for m in forgettable:
            members.forget(m.row.stage_id)
            log.info("stage_forgotten", stage=m.row.name, stage_id=m.row.stage_id)
        ids = ", ".join(m.row.stage_id for m in forgettable)
        return f"forgot {forgettable[0].row.name} ({ids})"

    def leave(self, stage_id: str, timeout: float) -> MoveOutcome:
        """A stage shutting down (SIGTERM): move its layers off, then it may exit (and
        counts as ``left``, not dead, once it is silent)."""
        member = self.cluster.members.by_id(stage_id)
        if member is None:
            raise NotReady(f"unknown stage id {stage_id!r}")
        self.cluster.members.mark_leaving(stage_id)
        partition = self.cluster.partition
        if self.cluster.job is None or stage_id not in self.cluster.job_stage_ids():
            self.cluster.members.mark_left(stage_id)  # nothing of a job to move off
            log.info("stage_left", stage=member.row.name, stage_id=stage_id, moved=False)
            return MoveOutcome(False, partition, f"{member.row.name} holds no layers")
        deadline = time.monotonic() + timeout
        while True:
            try:
                outcome = self.rebalancer.drain(
                    stage_id, f"{member.row.name} is leaving", leave_by=deadline
                )
            except NotLeader:  # this coordinator was deposed: the stage asks the leader
                raise
            except NotReady:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.5)
                continue
            if stage_id not in self.cluster.job_stage_ids():  # the move went through
                self._stay_for_recovery(deadline)
                self.cluster.members.mark_left(stage_id)
                log.info("stage_left", stage=member.row.name, stage_id=stage_id, moved=True)
            return outcome

    def _stay_for_recovery(self, deadline: float) -> None:
        """Holds a leaving stage (its layers moved off) while a stage of the chain is dead,
        up to ``deadline``: until the new epoch's snapshots are copied, the leaving stage's
        copies of its old neighbour's snapshots may be the last ones, and recovery, which
        runs once the move released its lock, reads them from it while it lives."""
        while (
            not self.cluster.failure
            and self.recovery.dead_in_chain()
            and time.monotonic() < deadline
        ):
            time.sleep(0.1)

    def profile_job(self, job_id: str, client: int, sample: Value) -> None:
        """Profiles a job set up without a sample, then moves to the partition the
        profile calls for if it is predicted faster (else the job keeps its epoch: no
        move, and no epoch in its history, for nothing).

        Sent again (to a new leader, after the first died mid-call), it profiles nothing
        twice: the stored profile decides the move, which is then already made or made now.
        The move is planned with the speeds the profile measured, not live ones: those
        change once steps run, and would make a resend decide a second, different move.
        """
        profiled = self.jobs.profile_later(job_id, client, sample)
        if self.cluster.replicas > 1:  # replicas: the policy's levers re-plan them (no move here)
            log.info("job_profiled", job=job_id, again=not profiled, moved=False)
            return
        profile = self.cluster.profile
        if profile is None:  # (profile_later stored it, or found it stored)
            raise NotReady(f"job {job_id} has no profile yet: send ProfileJob again")
        speeds = profile.speeds  # by stage id: ordered on the partition the plan reads
        view = self.rebalancer.plan_view(speeds)
        moved = False
        if view.optimal_step_s < view.current_step_s:
            outcome = self.rebalancer.rebalance(
                dry_run=False, reason="profiled", force=True, speeds=speeds
            )
            moved = outcome.changed
        log.info(
            "job_profiled",
            job=job_id,
            again=not profiled,
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
            run_loop(self._stop, interval, self.cluster.store_learned, "learned"),
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

    def close(self, cancel: bool = False) -> None:
        """Stops the loops, wakes whoever waits for a newer partition, and closes the
        channels to the stages. ``cancel``: close them first, cutting calls in flight
        short (a leadership that ended: the next leader settles what they were doing).
        A clean stop first stores what the planner learned since the ``learned`` loop's
        last pass."""
        if not cancel:
            with contextlib.suppress(Exception):  # (the store may be gone with it)
                self.cluster.store_learned()
        self._stop.set()
        if cancel:
            self.cluster.pool.close()
        with self.cluster.cond:
            self.cluster.closed = True
            self.cluster.cond.notify_all()
        self.recovery.wake()
        for thread in self._threads:
            thread.join(timeout=5)
        self.jobs.rendezvous.close()
        self.cluster.pool.close()
