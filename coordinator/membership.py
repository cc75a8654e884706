"""Who is in the cluster: stage incarnations, their heartbeats, liveness and measurements.

Every start of a stage process is a new *incarnation* with a new id, even under the same
name and address: the coordinator never confuses a restarted stage with the one that
died (that one's layers, runs and snapshots are gone). Registering a name again declares
its older incarnations dead -- unless one of them is a live ``holder``: a name is one
host's, so a second process under a name in use is refused while its holder still
answers as itself (``Coordinator.register`` probes it; ``holder_alive`` is the rule). An
incarnation is alive while it
heartbeats; one that misses heartbeats for ``dead_after_s``, or that a failure report
and a probe find unreachable, is declared dead for good: if it comes back it is told so
and registers anew, as a spare. One that shut down on purpose (SIGTERM, its layers moved
off first) has ``left``: it is gone as a dead one is, but nothing failed.
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import Enum

from elasticpipe.coordinator.planning.estimates import Timing
from elasticpipe.coordinator.store import StageRow, Store
from elasticpipe.v1 import stage_pb2

SPEED_WINDOW = 9  # live speed estimates a member keeps (``Member.speed_spread``)

RESTART_GRACE_S = 10.0
LEFT_REASON = "left: shut down on purpose, after its layers moved off"

# What ``Membership.state`` calls an incarnation (admin status, metrics).
STATES = ("chain", "spare", "drained", "dead", "left")


class Probe(Enum):
    """What a quick ``GetStats`` to a name's holder found at the holder's address."""

    ITSELF = "answered as the holder"
    OTHER = "answered as another incarnation, or as none"
    TIMED_OUT = "did not answer in time"
    UNREACHABLE = "refused the connection, or could not be reached"
    ERROR = "answered with an error"


def holder_alive(heard_ago_s: float, dead_after_s: float, probe: Probe) -> bool:
    """Whether a name's holder still runs, so that a registration of the name is refused.

    Only while its last heartbeat is fresh (within ``dead_after_s``), and only if the probe
    reached that very incarnation (its reply carries the holder's id) or timed out (a slow
    holder that still heartbeats is not displaced). A refused connection, a reply from
    another incarnation or from none (a restart on the holder's port), or any error reply
    (something else now answers there) mean it is gone: the registration is its restart.

    Args:
        heard_ago_s: seconds since the holder's last heartbeat.
        dead_after_s: the silence after which an incarnation counts as dead.
        probe: what the probe of the holder's address found.
    """
    return heard_ago_s < dead_after_s and probe in (Probe.ITSELF, Probe.TIMED_OUT)


class Heard(Enum):
    """What a heartbeat told the coordinator."""

    OK = "ok"
    UNKNOWN = "unknown"  # no such incarnation: re-register
    DEAD = "dead"  # declared dead: drop the job, re-register


_SPEEDS = threading.Lock()  # every member's ``recent_speeds`` (a few appends a second)


@dataclass
class Member:
    """A registered stage incarnation and what its last heartbeat said."""

    row: StageRow
    last_seen: float | None = None  # monotonic time of the last heartbeat; None: not yet
    last_seen_unix: float = 0.0
    timings: dict[int, Timing] = field(default_factory=dict)
    epoch: int = 0
    committed_step: int = 0
    slowdown: float = 1.0
    speed: float | None = None  # last live estimate
    beats: int = 0  # heartbeats heard from this incarnation
    # The live speeds estimated from its last heartbeats (one per heartbeat, since its
    # layers last changed): their spread is how far the planner's input swings.
    recent_speeds: deque[float] = field(default_factory=lambda: deque(maxlen=SPEED_WINDOW))
    speed_beat: int = -1  # the heartbeat the newest of them came from
    state: stage_pb2.RunState = field(default_factory=stage_pb2.RunState)
    snapshots: list[stage_pb2.SnapshotHolding] = field(default_factory=list)
    dead_reason: str = ""
    dead_at: float = 0.0  # unix time it was declared dead
    memory_bytes: int = 0  # what it offers its job (registration, heartbeats); 0: unknown
    replica_pin: str = ""  # the replica it is pinned to (registration, heartbeats); "": any
    pipeline_s: tuple[int, float] | None = None  # (epoch, its chain's pipeline's seconds)
    reduce_rate: float = 0.0  # replicas: bytes/s its reductions went at (0: not measured)
    optimizer_rate: float = 0.0  # parameter bytes/s its optimizer steps went at (0: same)
    between_runs: tuple[int, float] | None = None  # (epoch, seconds from a run's end to the next)

    def remeasure(self) -> None:
        """Forgets its layer timings and the speeds estimated from them: its layers
        changed, so both are measured again from now."""
        self.timings = {}
        self.forget_speeds()

    def forget_speeds(self) -> None:
        """Forgets the speeds estimated so far (their unit of work changed: a profile)."""
        with _SPEEDS:
            self.recent_speeds.clear()

    def observe_speed(self, speed: float) -> None:
        """Notes the live speed estimated from its latest heartbeat (once per heartbeat,
        whichever of the threads that estimate speeds comes first)."""
        with _SPEEDS:
            if self.speed_beat != self.beats:
                self.speed_beat = self.beats
                self.recent_speeds.append(speed)

    def speed_spread(self) -> float:
        """How far its recent live speeds swing: (max - min) / median, 0 with fewer than
        two of them."""
        with _SPEEDS:
            speeds = list(self.recent_speeds)
        if len(speeds) < 2:
            return 0.0
        middle = statistics.median(speeds)
        return (max(speeds) - min(speeds)) / middle if middle else 0.0


class Membership:
    """Registered incarnations (persisted) and their liveness (in memory)."""

    def __init__(
        self, store: Store, dead_after_s: float = 5.0, clock: Callable[[], float] = time.monotonic
    ):
        self._store = store
        self._dead_after = dead_after_s
        self._clock = clock
        self._lock = threading.Lock()
        self._members = {row.stage_id: Member(row) for row in store.stages()}
        # A restarted coordinator gives every known incarnation a grace period to find it
        # again (their retries back off to a few seconds) before silence counts.
        grace = clock() + max(0.0, RESTART_GRACE_S - dead_after_s)
        for member in self._members.values():
            if not member.row.dead:
                member.last_seen = grace

    def register(
        self, name: str, address: str, device: str, memory_bytes: int = 0
    ) -> tuple[str, list[Member]]:
        """Adds a new incarnation of ``name``.

        Returns:
            Its id, and the older incarnations of the name that this declared dead.
        """
        with self._lock:
            same_name = [m for m in self._members.values() if m.row.name == name]
            older = [m for m in same_name if not m.row.dead]
            # An operator's drain outlives the process, even one that died; a stage's own
            # leave (SIGTERM on a rolling restart) does not: its next incarnation rejoins.
            latest = max(same_name, key=lambda m: m.row.incarnation, default=None)
            drained = latest is not None and latest.row.drained and not latest.row.leaving
            row = StageRow(
                stage_id=f"st-{uuid.uuid4().hex[:8]}",
                name=name,
                address=address,
                device=device,
                registered_at=time.time(),
                drained=drained,
                incarnation=self._store.max_incarnation(name) + 1,
            )
            self._store.add_stage(row)
            member = Member(row, memory_bytes=memory_bytes)
            member.last_seen, member.last_seen_unix = self._clock(), time.time()
            self._members[row.stage_id] = member
        for old in older:
            self.declare_dead(old.row.stage_id, f"replaced by incarnation {row.incarnation}")
        return row.stage_id, older

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
        """Records a heartbeat."""
        with self._lock:
            member = self._members.get(stage_id)
            if member is None:
                return Heard.UNKNOWN
            if member.row.dead:
                return Heard.DEAD
            member.last_seen, member.last_seen_unix = self._clock(), time.time()
            member.epoch, member.committed_step, member.slowdown = epoch, committed_step, slowdown
            member.timings = timings
            member.beats += 1
            if state is not None:
                member.state = state
            if snapshots is not None:
                member.snapshots = snapshots
            return Heard.OK

    def holder(self, name: str) -> Member | None:
        """The newest live incarnation of ``name`` (one that has not left): the process a
        registration of the name would displace. It may be at the registering address too:
        an advertised address (``--advertise``, NAT, a copied unit file) can be shared, so
        only a probe tells a restart there from a second process (``holder_alive``)."""
        with self._lock:
            same_name = [m for m in self._members.values() if m.row.name == name]
        live = [m for m in same_name if not m.row.left and self.alive(m)]
        return max(live, key=lambda m: m.row.incarnation, default=None)

    def heard_ago(self, member: Member) -> float:
        """Seconds since the incarnation's last heartbeat (infinite: never heard)."""
        if member.last_seen is None:
            return float("inf")
        return self._clock() - member.last_seen

    @property
    def dead_after_s(self) -> float:
        """The silence after which an incarnation counts as dead."""
        return self._dead_after

    def state(self, member: Member, in_chain: bool) -> str:
        """What an incarnation is (one of ``STATES``): ``left`` once its shutdown finished,
        ``dead`` when declared dead or silent, else ``chain`` (it holds layers of the
        partition), ``drained`` (kept out) or ``spare``."""
        if member.row.left:
            return "left"
        if not self.alive(member):
            return "dead"
        if in_chain:
            return "chain"
        return "drained" if member.row.drained else "spare"

    def alive(self, member: Member) -> bool:
        """Whether the incarnation is not declared dead and was heard from recently."""
        return (
            not member.row.dead
            and member.last_seen is not None
            and self._clock() - member.last_seen < self._dead_after
        )

    def silent(self, member: Member) -> bool:
        """Whether a live-declared incarnation has missed its heartbeats."""
        return not member.row.dead and not self.alive(member)

    def declare_dead(self, stage_id: str, reason: str) -> bool:
        """Declares an incarnation dead for good; False if it already was."""
        with self._lock:
            member = self._members.get(stage_id)
            if member is None or member.row.dead:
                return False
            member.row = replace(member.row, dead=True)
            member.dead_reason, member.dead_at = reason, time.time()
            self._store.set_stage(stage_id, dead=True)
            return True

    def members(self) -> list[Member]:
        """Every incarnation not forgotten, in registration order."""
        with self._lock:
            return sorted(self._members.values(), key=lambda m: (m.row.registered_at, m.row.name))

    def find(self, key: str) -> Member | None:
        """An incarnation by id or address, or the newest one of a name."""
        with self._lock:
            if key in self._members:
                return self._members[key]
            by_name = [m for m in self._members.values() if key in (m.row.name, m.row.address)]
        return max(by_name, key=lambda m: m.row.incarnation, default=None)

    def by_id(self, stage_id: str) -> Member | None:
        """An incarnation by id."""
        with self._lock:
            return self._members.get(stage_id)

    def set_drained(self, stage_id: str, drained: bool) -> None:
        """Keeps an incarnation out of (or lets it back into) future partitions."""
        with self._lock:
            member = self._members[stage_id]
            member.row = replace(member.row, drained=drained)
            self._store.set_stage(stage_id, drained=drained)

    def mark_leaving(self, stage_id: str) -> None:
        """Notes that an incarnation drains itself to shut down, so that its successor
        does not inherit the drain. An operator's earlier drain stays an operator's."""
        with self._lock:
            member = self._members.get(stage_id)
            if member is not None and not member.row.drained:
                member.row = replace(member.row, leaving=True)
                self._store.set_stage(stage_id, leaving=True)

    def mark_left(self, stage_id: str) -> None:
        """Notes that an incarnation's shutdown finished (nothing of the job is left on it,
        and it exits now): its silence is a departure, not a failure. Kept out of future
        partitions meanwhile."""
        with self._lock:
            member = self._members.get(stage_id)
            if member is not None:
                member.row = replace(member.row, left=True, drained=True)
                self._store.set_stage(stage_id, left=True, drained=True)

    def forget(self, stage_id: str) -> None:
        """Removes a dead incarnation from membership (and from status)."""
        with self._lock:
            self._members.pop(stage_id, None)
            self._store.set_stage(stage_id, forgotten=True)
