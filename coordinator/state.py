"""What every part of the coordinator shares: the store, membership, the job and its partition.

``jobs``, ``rebalancing``, ``recovery`` and ``epochs`` each own one responsibility and work
on this one ``Cluster``. Its ``move_lock`` lets one epoch change (or job setup) run at a
time; its condition wakes whoever waits for a newer partition.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from elasticpipe.coordinator.config import CoordinatorConfig
from elasticpipe.coordinator.learned import Learned
from elasticpipe.coordinator.membership import STATES, Member, Membership
from elasticpipe.coordinator.planning import estimates, memory
from elasticpipe.coordinator.planning.cost import Plan, predict_step_time
from elasticpipe.coordinator.planning.estimates import Profile, Timing
from elasticpipe.coordinator.planning.layouts import PerStep, reduce_seconds
from elasticpipe.coordinator.planning.memory import MemoryTerms
from elasticpipe.coordinator.planning.shares import pipeline_slots
from elasticpipe.coordinator.store import EpochRow, Store
from elasticpipe.errors import (
    CONTINUE_FROM_SAVE,
    InvalidRequest,
    LayersLost,
    NotLeader,
    NotReady,
    ReplicaDivergence,
    StandingBy,
)
from elasticpipe.layout import Layout
from elasticpipe.logs import get_logger
from elasticpipe.observe.metrics import CoordinatorMetrics, CoordinatorView
from elasticpipe.partition import Partition
from elasticpipe.training.job import JobConfig
from elasticpipe.transport import rpc
from elasticpipe.transport.terms import TermStamp

log = get_logger(__name__)

SLOTS_KEY = "slot_overheads"  # the store's copy of Cluster.slots
STEPS_KEY = "step_overheads"  # the store's copy of Cluster.steps


class LinkTerms(NamedTuple):
    """The planner's optional link inputs (both None: links are free)."""

    activation_bytes: list[int] | None = None
    link_bandwidths: list[float] | None = None


class Cluster:
    """The coordinator's shared state (loaded from the store at start)."""

    def __init__(
        self,
        store: Store,
        config: CoordinatorConfig | None = None,
        term: Callable[[], int] | None = None,
        address: str = "",
    ):
        """``term``: the elected leader's term, stamped on every command to a stage
        (``transport.terms``); it raises NotLeader once this coordinator no longer leads.
        ``address``: where this coordinator serves (what Status reports as the leader)."""
        config = config or CoordinatorConfig()
        self.store = store
        self.address = address
        self._term = term
        self.config = config
        self.freeze_lease_s = config.freeze_lease_s  # how long a frozen stage waits for news
        self.members = Membership(store, config.dead_after_s)
        stamp = [TermStamp(term)] if term is not None else []
        self.pool = rpc.StagePool(tls=config.tls, interceptors=stamp)
        self.heartbeat_interval_s = config.heartbeat_interval_s
        self.link_bandwidth = config.link_bandwidth
        self.cond = threading.Condition()
        self.closed = False  # this coordinator stopped leading: waits end
        self.move_lock = threading.RLock()
        self.partition = store.partition()
        raw_layout = store.get("layout")
        # A job of several replicas: all of them (``partition`` is replica 0). One written
        # for another epoch than the partition's is a change that did not finish: none.
        self.layout: Layout | None = Layout.from_json(raw_layout) if raw_layout else None
        if self.layout is not None and (
            self.partition is None or self.layout.epoch != self.partition.epoch
        ):
            self.layout = None
        raw_job = store.get("job")
        self.job = JobConfig(**raw_job) if raw_job else None
        self.num_layers: int = store.get("num_layers") or 0
        self.param_bytes: list[int] = store.get("param_bytes") or []
        raw_profile = store.get("profile")
        self.profile = (
            Profile(
                tuple(raw_profile["costs"]),
                raw_profile["speeds"],
                tuple(raw_profile.get("activation_bytes", ())),
                tuple(raw_profile.get("stash_bytes", ())),
                tuple(raw_profile.get("state_bytes", ())),
            )
            if raw_profile
            else None
        )
        self.failure: str = store.get("job_failure") or ""
        self.failure_kind: type[LayersLost] = (  # what clients get: LayersLost or a kind of it
            ReplicaDivergence
            if store.get("job_failure_kind") == ReplicaDivergence.reason()
            else LayersLost
        )
        self.last_move = time.monotonic()
        self.last_pause: float | None = None
        # Each replica chain's shortfall per pipeline slot, and the share it was measured
        # at (``replica_options.measured_step_times``): the one from the largest share;
        # by (job id, the chain's stage ids): never one job's for another's
        self.slot_shortfalls: dict[tuple[str, tuple[str, ...]], tuple[int, float]] = {}
        # What each job measured beyond the model, per pipeline slot (``slot_overhead``) and
        # per step (``per_step``), kept across jobs and in the store (``learned``)
        self.slots = Learned(store, SLOTS_KEY)
        self.steps = Learned(store, STEPS_KEY)
        self.metrics = CoordinatorMetrics(self._metrics_view)

    @property
    def elected(self) -> bool:
        """Whether this coordinator leads by election (standby coordinators on etcd)."""
        return self._term is not None

    def term(self) -> int:
        """This leader's term (0: no election, or no longer leading)."""
        if self._term is None:
            return 0
        try:
            return self._term()
        except NotLeader:
            return 0

    # ---- the job and its partition ---------------------------------------------------

    def require_job(self) -> tuple[JobConfig, Partition]:
        """The running job and its partition.

        Raises:
            NotReady: no job has been set up.
            LayersLost: the job failed beyond recovery.
        """
        if self.job is None or self.partition is None:
            raise NotReady("no job has been set up yet")
        if self.failure:
            raise self.failure_kind(self.failure)
        return self.job, self.partition

    def install(self, partition: Partition, record: EpochRow, layout: Layout | None = None) -> None:
        """Makes ``partition`` current (persisted) and records how it came to be; with
        ``layout`` (a job of several replicas, ``partition`` its replica 0) that too."""
        if layout is not None:
            self.store.put("layout", layout.to_json())
        else:
            self.store.delete("layout")
        self.store.put_partition(partition)
        self.store.add_epoch(record)
        with self.cond:
            self.partition, self.layout = partition, layout
            self.cond.notify_all()

    def adopt(self, partition: Partition, layout: Layout | None = None) -> None:
        """Makes an already persisted ``partition`` current in memory, with ``layout`` (a
        job of several replicas, ``partition`` its replica 0). The same epoch again (a
        step time learned) keeps the layout in force."""
        with self.cond:
            if layout is not None or partition.epoch != getattr(self.partition, "epoch", None):
                self.layout = layout
            self.partition = partition
            self.cond.notify_all()

    @property
    def replicas(self) -> int:
        """How many replicas the job runs (1: one pipeline)."""
        return len(self.layout.replicas) if self.layout is not None else 1

    def job_stage_ids(self) -> tuple[str, ...]:
        """Every stage the job runs on: every replica's."""
        if self.layout is not None:
            return self.layout.stage_ids
        return self.partition.stage_ids if self.partition is not None else ()

    def job_layout(self) -> Layout | None:
        """The job's layout: its replicas, or its one partition as a layout of one (None
        without a job)."""
        if self.layout is not None:
            return self.layout
        if self.partition is None:
            return None
        return Layout.single(self.partition, self.job.micro_batches if self.job else 1)

    def refuse_replicated(self, what: str) -> None:
        """Raises InvalidRequest, naming ``what``, while the job runs several replicas:
        the levers of one chain (set-partition, rebalance) do not apply to them."""
        if self.replicas > 1:
            raise InvalidRequest(
                f"{what}: job {self.partition.job_id if self.partition else '-'} runs "
                f"{self.replicas} replicas; move them with admin set-layout (or drain a "
                "stage): set-partition and rebalance act on one pipeline"
            )

    def fail_job(self, message: str, kind: type[LayersLost] = LayersLost) -> None:
        """Marks the job as failed beyond recovery (clients waiting get the message as a
        ``kind``, and how to continue from a checkpoint)."""
        message = f"{message}; {CONTINUE_FROM_SAVE}"
        self.failure, self.failure_kind = message, kind
        self.store.put("job_failure_kind", kind.reason())
        self.store.put("job_failure", message)
        log.error("job_failed", error=message)
        with self.cond:
            self.cond.notify_all()

    def get_partition(self, newer_than: int, timeout: float) -> Partition:
        """The current partition, waiting up to ``timeout`` for one newer than ``newer_than``.

        Raises:
            NotReady: no job has been set up.
            LayersLost: the job failed beyond recovery.
            StandingBy: this coordinator stopped leading meanwhile (ask the leader).
        """
        deadline = time.monotonic() + max(0.0, timeout)
        with self.cond:
            while (
                self.partition is None or self.partition.epoch <= newer_than
            ) and not self.failure:
                if self.closed:
                    what = "stopped leading" if self._term is not None else "is stopping"
                    raise StandingBy(f"coordinator {self.address or '-'} {what}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self.cond.wait(remaining)
        return self.require_job()[1]

    def _metrics_view(self) -> CoordinatorView:
        """What a scrape of the metrics reports: members by state, the partition."""
        partition = self.partition
        chain = set(self.job_stage_ids())
        members = dict.fromkeys(STATES, 0)
        for m in self.members.members():
            members[self.members.state(m, m.row.stage_id in chain)] += 1
        return CoordinatorView(
            members=members,
            epoch=partition.epoch if partition else None,
            chain_length=len(chain),
            predicted_step_s=partition.predicted_step_s if partition else None,
        )

    # ---- stages ----------------------------------------------------------------------

    def name(self, stage_id: str) -> str:
        """A stage's name, for logs and messages."""
        member = self.members.by_id(stage_id)
        return member.row.name if member else stage_id

    def names(self, stage_ids: Sequence[str]) -> list[str]:
        """Names of several stages."""
        return [self.name(s) for s in stage_ids]

    def live_members(self) -> list[Member]:
        """Incarnations alive and not drained, in registration order."""
        return [m for m in self.members.members() if self.members.alive(m) and not m.row.drained]

    def spares(self) -> list[Member]:
        """Live, undrained stages outside the chain, not leaving (on SIGTERM)."""
        chain = set(self.job_stage_ids())
        return [m for m in self.live_members() if m.row.stage_id not in chain and not m.row.leaving]

    # ---- estimates -------------------------------------------------------------------

    def costs(self) -> tuple[float, ...]:
        """Unit costs of every layer (profiled, else from parameter sizes)."""
        if self.profile is not None:
            return self.profile.costs
        return estimates.fallback_costs(self.param_bytes or [1] * self.num_layers)

    def speed_of(self, member: Member) -> float | None:
        """A stage's current speed: live if measured, else last known, else profiled.

        A live estimate needs a measurement of every layer the stage owns: right after a
        move, a speed from only the layers it kept would rest on whichever layers happen to
        be cheap or expensive, and could make a lopsided partition look optimal.
        """
        costs = self.costs()
        owned: dict[int, Timing] = {}
        layout = self.job_layout()  # the stage's own replica's chain
        r = layout.replica_of_stage(member.row.stage_id) if layout is not None else None
        chain = layout.replicas[r] if layout is not None and r is not None else None
        s = chain.index_of(member.row.stage_id) if chain is not None else None
        if chain is not None and s is not None:
            layers = chain.layers_of(s)
            owned = {i: t for i, t in member.timings.items() if i in layers and t[3] > 0}
            if len(owned) < len(layers):
                owned = {}
        live = estimates.live_speed(costs, owned)
        if live is not None:
            member.speed = live
            member.observe_speed(live)
            return live
        if member.speed is not None:
            return member.speed
        if self.profile is not None:
            return self.profile.speeds.get(member.row.stage_id)
        return None

    def in_seconds(self, stage_ids: Sequence[str]) -> bool:
        """Whether step times predicted for a chain of these stages are seconds: the layer
        costs were profiled, or a stage of the chain measured its layers against them (its
        speed then converts them to seconds). Before either, the costs come from parameter
        sizes and a "step time" from them has no unit."""
        if self.profile is not None:
            return True
        members = [self.members.by_id(sid) for sid in stage_ids]
        return any(m is not None and self.speed_of(m) is not None for m in members)

    def speed_spreads(self, stage_ids: Sequence[str]) -> list[float]:
        """How far each stage's live speed swung over its last heartbeats
        (``Member.speed_spread``; 0 for an unknown stage)."""
        members = [self.members.by_id(sid) for sid in stage_ids]
        return [m.speed_spread() if m is not None else 0.0 for m in members]

    def speeds(self, stage_ids: Sequence[str]) -> list[float]:
        """Current speeds of stages, unknown ones filled in."""
        known = []
        for sid in stage_ids:
            member = self.members.by_id(sid)
            known.append(self.speed_of(member) if member else None)
        return estimates.fill_speeds(known)

    def reduce_bandwidth(self, in_seconds: bool = True) -> float | None:
        """The bandwidth the planner times replicas' gradient reductions at, bytes/s: the
        operator's ``--link-bandwidth``, else the median of the rates the live stages
        measured (``Member.reduce_rate``: kept across jobs, a figure of the hosts and their
        network); None when neither is known, or while the step times a reduction's
        seconds would be added to have no unit (``in_seconds``): reductions count as free."""
        if not in_seconds:
            return None
        if self.link_bandwidth:
            return self.link_bandwidth
        live = (m for m in self.members.members() if self.members.alive(m))
        rates = [m.reduce_rate for m in live if m.reduce_rate > 0]
        return statistics.median(rates) if rates else None

    def note_slot_overhead(self, job_id: str, per_slot: float) -> None:
        """Keeps what a job's chains measured per pipeline slot beyond the planner's
        prediction (``replica_options.note_overheads``), for ``slot_overhead``."""
        self.slots.note(job_id, per_slot)

    def note_step_overhead(self, job_id: str, per_step: float) -> None:
        """Keeps what a job's stages waited between runs beyond its optimizer steps
        (``replica_options.note_overheads``), for ``per_step``."""
        self.steps.note(job_id, per_step)

    @property
    def slot_overheads(self) -> dict[str, float]:
        """The figures per slot kept, by job, oldest first."""
        return self.slots.figures()

    def store_learned(self) -> bool:
        """Stores the learned figures that differ from the stored ones (``Learned``: the
        coordinator's ``learned`` loop calls this, never a heartbeat). Returns whether it
        wrote.

        Raises:
            ElasticPipeError: the store refused; a later call tries again.
        """
        wrote = self.slots.store_changed()
        return self.steps.store_changed() or wrote

    def slot_overhead(self, in_seconds: bool = True) -> float:
        """Seconds the planner adds per pipeline slot to a new layout's predicted step: the
        median over this job and earlier ones of what their chains measured beyond its
        predictions per slot (hop latencies, per-op overheads; ``note_slot_overhead``: a
        figure of the hosts, like the reduction's rate); 0 before any job was measured,
        or while the step times it is added to have no unit."""
        return self.slots.median() if in_seconds else 0.0

    def per_step(self, in_seconds: bool = True) -> PerStep:
        """What the planner adds once per step to a new layout's prediction (``PerStep``):
        the median of what jobs' stages waited between runs beyond their optimizer steps
        (``note_step_overhead``), and the optimizer steps at the median rate the live
        stages measured (``Member.optimizer_rate``); nothing of either before it is
        measured, or while the step times have no unit."""
        if not in_seconds:
            return PerStep()
        live = (m for m in self.members.members() if self.members.alive(m))
        rates = [m.optimizer_rate for m in live if m.optimizer_rate > 0]
        rate = statistics.median(rates) if rates and self.param_bytes else None
        return PerStep(self.steps.median(), self.param_bytes if rate else None, rate)

    def once_per_step(self, boundaries: Sequence[Sequence[int]], in_seconds: bool) -> float:
        """What a layout whose running replicas are cut at ``boundaries`` pays once per
        step, beyond its slowest pipeline: the reduction (``reduce_bandwidth``) and
        ``per_step``; 0 while the step times have no unit."""
        bandwidth = self.reduce_bandwidth(in_seconds)
        reduce_s = (
            reduce_seconds(boundaries, self.param_bytes, bandwidth)
            if bandwidth and self.param_bytes
            else 0.0
        )
        return reduce_s + self.per_step(in_seconds).seconds(boundaries)

    def chain_step_s(self, plan: Plan, job: JobConfig) -> float:
        """The predicted step of one pipeline partitioned as ``plan`` (a job of one chain):
        the planner's model for ``job``'s micro-batches and schedule, plus the overheads
        per pipeline slot and per step measured beyond it (``plus_overheads``), as a layout
        of replicas is predicted. The policy compares partitions on the model alone (a scale-out's
        one slot more is not counted)."""
        model_s = predict_step_time(plan, job.micro_batches, job.schedule)
        return self.plus_overheads(model_s, plan.boundaries, job.micro_batches)

    def plus_overheads(
        self, model_s: float, boundaries: Sequence[int], micro_batches: int
    ) -> float:
        """``model_s`` (one chain cut at ``boundaries`` running ``micro_batches``) plus
        ``slot_overhead`` for each of its slots (``pipeline_slots``) and ``per_step``."""
        slots = pipeline_slots(len(boundaries) - 1, micro_batches)
        return model_s + self.slot_overhead() * slots + self.once_per_step([boundaries], True)

    def links(self, num_stages: int) -> LinkTerms:
        """The planner's link terms, when the operator gave a link bandwidth."""
        profile = self.profile
        if not self.link_bandwidth or profile is None or not profile.activation_bytes:
            return LinkTerms()
        if num_stages < 2:
            return LinkTerms()
        return LinkTerms(list(profile.activation_bytes), [self.link_bandwidth] * (num_stages - 1))

    def memory(self, stage_ids: Sequence[str]) -> MemoryTerms:
        """The planner's memory terms for a chain of these stages (what each offers)."""
        if self.job is None:
            return MemoryTerms()
        members = [self.members.by_id(sid) for sid in stage_ids]
        caps = [m.memory_bytes if m is not None else 0 for m in members]
        sizes = self.param_bytes or [0] * self.num_layers
        return memory.terms(caps, sizes, self.profile, self.job)

    def layer_state_bytes(self, layer: int) -> int:
        """Bytes a layer's full state moves: weights, plus optimizer state (Adam keeps two
        moments, about twice the weights)."""
        factor = 1 if self.job is not None and self.job.optimizer == "sgd" else 3
        sizes = self.param_bytes or [0] * self.num_layers
        return sizes[layer] * factor if 0 <= layer < len(sizes) else 0

    def bytes_to_move(self, old: Partition, new: Partition) -> int:
        """Predicted bytes of a move from ``old`` to ``new``."""
        return sum(self.layer_state_bytes(m.layer) for m in old.moves_to(new))
