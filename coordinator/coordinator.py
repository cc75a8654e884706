"""The coordinator's domain logic: jobs, the partition and its epochs, planning, rebalancing."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import structlog
import torch

from elasticpipe import codec
from elasticpipe.coordinator import estimates
from elasticpipe.coordinator.estimates import Profile, Timing
from elasticpipe.coordinator.membership import Member, Membership
from elasticpipe.coordinator.migration import Chain, MoveResult, StagePool, change_epoch, moves
from elasticpipe.coordinator.planner import Plan, PlanError, order_hosts, plan, predict_step_time
from elasticpipe.coordinator.policy import Decision, PolicyConfig, decide
from elasticpipe.coordinator.store import EpochRow, PartitionRow, Store
from elasticpipe.errors import InvalidRequest, NotReady
from elasticpipe.job import JobConfig
from elasticpipe.v1 import stage_pb2

log = structlog.get_logger()

PROFILE_REPEATS = 5
STAGE_CALL_TIMEOUT_S = 120.0


class LinkTerms(NamedTuple):
    """The planner's optional link inputs (both None: links are free)."""

    activation_bytes: list[int] | None = None
    link_bandwidths: list[float] | None = None


@dataclass(frozen=True)
class PlanView:
    """The current partition next to the optimal one (``admin plan``)."""

    current: PartitionRow
    optimal: Plan
    current_step_s: float
    optimal_step_s: float
    speeds: list[float]
    costs: tuple[float, ...]
    bytes_to_move: int


@dataclass(frozen=True)
class MoveOutcome:
    """What a rebalance request did."""

    changed: bool
    partition: PartitionRow | None
    decision: str
    gain: float = 0.0
    bytes_moved: int = 0
    pause_s: float = 0.0


class Coordinator:
    """Membership, job, partition, planner and rebalancing policy, behind one lock."""

    def __init__(
        self,
        store: Store,
        policy: PolicyConfig | None = None,
        dead_after_s: float = 5.0,
        heartbeat_interval_s: float = 1.0,
        link_bandwidth: float = 0.0,
    ):
        self.store = store
        self.link_bandwidth = link_bandwidth
        self.policy = policy or PolicyConfig()
        self.heartbeat_interval_s = heartbeat_interval_s
        self.members = Membership(store, dead_after_s)
        self.pool = StagePool()
        self._cond = threading.Condition()
        self._move_lock = threading.Lock()  # one epoch change (or job setup) at a time
        self.partition = store.partition()
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
            )
            if raw_profile
            else None
        )
        self._last_move = time.monotonic()
        self._last_pause: float | None = None
        self._last_decision = ""
        # An automatic move must be proposed twice, from measurements of two different
        # committed steps: a speed change seen halfway through a step is only half-measured.
        self._proposal: tuple[tuple[int, ...], int] | None = None
        self._stop = threading.Event()
        self._policy_thread: threading.Thread | None = None

    # ---- membership ------------------------------------------------------------------

    def register(self, name: str, address: str, device: str) -> str:
        """Registers a stage (same name = same host, same id)."""
        if not name or not address:
            raise InvalidRequest(
                f"register needs a name and an address (got {name!r}, {address!r})"
            )
        stage_id = self.members.register(name, address, device)
        log.info("stage_registered", stage_id=stage_id, name=name, address=address)
        return stage_id

    def heartbeat(
        self,
        stage_id: str,
        epoch: int,
        timings: dict[int, Timing],
        committed_step: int,
        slowdown: float,
    ) -> bool:
        """Records a stage's measurements; False asks it to re-register."""
        return self.members.heartbeat(stage_id, epoch, timings, committed_step, slowdown)

    def live_members(self) -> list[Member]:
        """Stages heard from recently and not drained, in registration order."""
        return [m for m in self.members.members() if self.members.alive(m) and not m.row.drained]

    # ---- job setup -------------------------------------------------------------------

    def setup_job(
        self, job: JobConfig, sample: torch.Tensor | None, num_stages: int, wait_s: float
    ) -> PartitionRow:
        """Starts a job: picks stages, profiles them, plans, and assigns layers.

        Raises:
            NotReady: not enough live stages within ``wait_s``.
            PermissionDenied / ModelError: the stages refuse the model.
            PlanError: the model has fewer layers than stages.
        """
        deadline = time.monotonic() + wait_s
        while True:
            live = self.live_members()
            if len(live) >= max(num_stages, 1):
                break
            if time.monotonic() >= deadline:
                raise NotReady(
                    f"need {max(num_stages, 1)} live stages, have {len(live)} "
                    f"({[m.row.name for m in live]}) after waiting {wait_s:.0f}s"
                )
            time.sleep(0.1)
        chosen = live[:num_stages] if num_stages else live
        job = job.with_id()
        with self._move_lock:
            spec = job.to_proto()
            described = self.pool.call(
                chosen[0].row.address,
                "Describe",
                stage_pb2.DescribeRequest(job=spec),
                STAGE_CALL_TIMEOUT_S,
            )
            num_layers, param_bytes = described.num_layers, list(described.param_bytes)
            if num_layers < len(chosen):
                raise PlanError(
                    f"too few layers for the stages (layers: {num_layers}, stages: {len(chosen)})"
                )
            profile = None
            if sample is not None:
                profile = self._profile(job, sample, chosen)
            costs = profile.costs if profile else estimates.fallback_costs(param_bytes)
            speeds = [profile.speeds[m.row.stage_id] if profile else 1.0 for m in chosen]
            links = self._links(len(speeds), profile)
            order, best = order_hosts(costs, speeds, links.activation_bytes, links.link_bandwidths)
            ordered = [chosen[i] for i in order]
            epoch = self.store.reserve_epoch()
            partition = PartitionRow(
                epoch=epoch,
                job_id=job.job_id,
                boundaries=best.boundaries,
                stage_ids=tuple(m.row.stage_id for m in ordered),
                addresses=tuple(m.row.address for m in ordered),
                predicted_step_s=predict_step_time(best, job.micro_batches, job.schedule),
            )
            chain = Chain(epoch, partition.addresses, partition.boundaries)
            self.pool.each(
                lambda a: self.pool.call(
                    a,
                    "Assign",
                    stage_pb2.AssignRequest(job=spec, assignment=chain.assignment(a)),
                    STAGE_CALL_TIMEOUT_S,
                ),
                list(partition.addresses),
            )
            self.store.put("job", {k: v for k, v in vars(job).items()})
            self.store.put("num_layers", num_layers)
            self.store.put("param_bytes", param_bytes)
            if profile:
                self.store.put(
                    "profile",
                    {
                        "costs": list(profile.costs),
                        "speeds": profile.speeds,
                        "activation_bytes": list(profile.activation_bytes),
                    },
                )
            self._install(
                partition,
                EpochRow(
                    epoch=epoch,
                    at=time.time(),
                    reason=f"job {job.job_id} started",
                    boundaries=partition.boundaries,
                    stage_ids=partition.stage_ids,
                ),
            )
            self.job, self.num_layers, self.param_bytes = job, num_layers, param_bytes
            self.profile = profile
            for member in chosen:
                member.timings, member.speed = {}, None
            self._last_move = time.monotonic()
        log.info(
            "job_started",
            job=job.job_id,
            model=job.model,
            layers=num_layers,
            boundaries=list(partition.boundaries),
            stages=[m.row.name for m in ordered],
            epoch=epoch,
        )
        return partition

    def _profile(self, job: JobConfig, sample: torch.Tensor, chosen: Sequence[Member]) -> Profile:
        spec = job.to_proto()
        spec.sample_input.CopyFrom(codec.to_proto(sample))
        profiles: dict[str, list[Timing]] = {}
        # One stage at a time: stages sharing a host would otherwise slow each other down.
        for member in chosen:
            reply = self.pool.call(
                member.row.address,
                "Profile",
                stage_pb2.ProfileRequest(job=spec, repeats=PROFILE_REPEATS),
                STAGE_CALL_TIMEOUT_S,
            )
            profiles[member.row.stage_id] = [
                (t.forward_s, t.backward_s, t.output_bytes, t.samples) for t in reply.timings
            ]
        profile = estimates.from_profiles(profiles)
        log.info(
            "stages_profiled",
            speeds={self._name(s): round(v, 3) for s, v in profile.speeds.items()},
        )
        return profile

    def _links(self, num_stages: int, profile: Profile | None) -> LinkTerms:
        """The planner's link terms, when the operator gave a link bandwidth."""
        bandwidth = self.link_bandwidth
        if not bandwidth or profile is None or not profile.activation_bytes or num_stages < 2:
            return LinkTerms()
        return LinkTerms(list(profile.activation_bytes), [bandwidth] * (num_stages - 1))

    def _name(self, stage_id: str) -> str:
        member = self.members.by_id(stage_id)
        return member.row.name if member else stage_id

    def _install(self, partition: PartitionRow, record: EpochRow) -> None:
        self.store.put_partition(partition)
        self.store.add_epoch(record)
        with self._cond:
            self.partition = partition
            self._cond.notify_all()

    # ---- partition -------------------------------------------------------------------

    def get_partition(self, newer_than: int, timeout: float) -> PartitionRow:
        """The current partition, waiting up to ``timeout`` for one newer than ``newer_than``.

        Raises:
            NotReady: no job has been set up.
        """
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            while self.partition is None or self.partition.epoch <= newer_than:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            if self.partition is None:
                raise NotReady("no job has been set up yet")
            return self.partition

    # ---- planning --------------------------------------------------------------------

    def _require_job(self) -> tuple[JobConfig, PartitionRow]:
        if self.job is None or self.partition is None:
            raise NotReady("no job has been set up yet")
        return self.job, self.partition

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
        if self.partition is not None and member.row.stage_id in self.partition.stage_ids:
            s = self.partition.stage_ids.index(member.row.stage_id)
            lo, hi = self.partition.boundaries[s], self.partition.boundaries[s + 1]
            owned = {i: t for i, t in member.timings.items() if lo <= i < hi and t[3] > 0}
            if len(owned) < hi - lo:
                owned = {}
        live = estimates.live_speed(costs, owned)
        if live is not None:
            member.speed = live
            return live
        if member.speed is not None:
            return member.speed
        if self.profile is not None:
            return self.profile.speeds.get(member.row.stage_id)
        return None

    def _speeds(self, stage_ids: Sequence[str]) -> list[float]:
        known = []
        for sid in stage_ids:
            member = self.members.by_id(sid)
            known.append(self.speed_of(member) if member else None)
        return estimates.fill_speeds(known)

    def _bytes_to_move(self, old: Chain, new: Chain) -> int:
        # Weights, gradients-free optimizer state (Adam keeps two moments: ~3x the weights).
        factor = 1 if self.job is not None and self.job.optimizer == "sgd" else 3
        sizes = self.param_bytes or [0] * self.num_layers
        return sum(sizes[layer] * factor for layer, _, _ in moves(old, new))

    def plan_view(self) -> PlanView:
        """The current partition and the optimal one for the live speeds (changes nothing)."""
        job, current = self._require_job()
        costs = self.costs()
        speeds = self._speeds(current.stage_ids)
        links = self._links(len(speeds), self.profile)
        now = estimates.evaluate(current.boundaries, costs, speeds, *links)
        best = plan(costs, speeds, *links, current=current.boundaries)
        old = Chain(current.epoch, current.addresses, current.boundaries)
        new = Chain(current.epoch + 1, current.addresses, best.boundaries)
        return PlanView(
            current=current,
            optimal=best,
            current_step_s=predict_step_time(now, job.micro_batches, job.schedule),
            optimal_step_s=predict_step_time(best, job.micro_batches, job.schedule),
            speeds=speeds,
            costs=costs,
            bytes_to_move=self._bytes_to_move(old, new),
        )

    # ---- rebalancing -----------------------------------------------------------------

    def rebalance(self, dry_run: bool, reason: str, force: bool = True) -> MoveOutcome:
        """Moves to the optimal partition for the live speeds.

        Args:
            dry_run: only say what would happen.
            reason: recorded in the epoch history.
            force: skip the policy's threshold/payback/cool-down (an operator asked).
        """
        view = self.plan_view()
        decision = decide(
            self.policy,
            view.current_step_s,
            view.optimal_step_s,
            view.bytes_to_move,
            time.monotonic() - self._last_move,
            self._last_pause,
        )
        if force:
            # The operator asked for the planner's optimum (the smallest bottleneck): move
            # whenever it differs, whatever the policy's thresholds would say.
            differs = view.optimal.boundaries != view.current.boundaries
            decision = replace(
                decision,
                move=differs,
                reason="moving to the optimal partition on request"
                if differs
                else "the current partition is already optimal",
            )
        if not decision.move:
            self._proposal = None
        elif not force:
            decision = self._confirmed(decision, view)
        self._log_decision(decision, reason)
        if not decision.move or dry_run:
            return MoveOutcome(
                False, view.current, decision.reason, decision.gain, view.bytes_to_move
            )
        self._proposal = None
        return self._move(view.current.stage_ids, view.optimal.boundaries, reason, decision.gain)

    def _confirmed(self, decision: Decision, view: PlanView) -> Decision:
        """Holds a move back until a later step's measurements propose the same partition."""
        steps = [
            m.committed_step
            for sid in view.current.stage_ids
            if (m := self.members.by_id(sid)) is not None
        ]
        step = min(steps, default=0)
        proposal = self._proposal
        if proposal is not None and proposal[0] == view.optimal.boundaries and step > proposal[1]:
            return decision
        if proposal is None or proposal[0] != view.optimal.boundaries:
            self._proposal = (view.optimal.boundaries, step)
        return replace(
            decision, move=False, reason=f"{decision.reason}; confirming at step {step + 1}"
        )

    def _log_decision(self, decision: Decision, reason: str) -> None:
        event = "rebalance_decided" if decision.move else "rebalance_declined"
        if decision.bytes_to_move == 0 and decision.reason == self._last_decision:
            return  # "already optimal" every second is noise; log it once per change
        self._last_decision = decision.reason
        log.info(
            event,
            reason=reason,
            why=decision.reason,
            gain=round(decision.gain, 4),
            current_step_s=round(decision.current_step_s, 4),
            proposed_step_s=round(decision.proposed_step_s, 4),
            bytes_to_move=decision.bytes_to_move,
            pause_s=round(decision.pause_s, 3),
        )

    def set_partition(
        self, boundaries: Sequence[int], stages: Sequence[str], reason: str
    ) -> MoveOutcome:
        """Moves to an operator-given partition (and optionally chain order)."""
        _, current = self._require_job()
        stage_ids = current.stage_ids
        if stages:
            found = [self.members.find(s) for s in stages]
            missing = [s for s, m in zip(stages, found, strict=True) if m is None]
            if missing:
                raise InvalidRequest(f"unknown stages {missing}")
            stage_ids = tuple(m.row.stage_id for m in found if m is not None)
        self._check_boundaries(boundaries, len(stage_ids))
        return self._move(stage_ids, tuple(boundaries), reason, 0.0)

    def _check_boundaries(self, boundaries: Sequence[int], num_stages: int) -> None:
        b = list(boundaries)
        if (
            len(b) != num_stages + 1
            or b[0] != 0
            or b[-1] != self.num_layers
            or any(x >= y for x, y in itertools.pairwise(b))
        ):
            raise InvalidRequest(
                f"boundaries {b} must be {num_stages + 1} increasing values from 0 to "
                f"{self.num_layers} (every stage owns at least one layer)"
            )

    def drain(self, key: str) -> MoveOutcome:
        """Moves every layer off a stage and keeps it out of the chain."""
        member = self._member(key)
        _, current = self._require_job()
        if member.row.stage_id not in current.stage_ids:
            self.members.set_drained(member.row.stage_id, True)
            return MoveOutcome(False, current, f"{member.row.name} holds no layers")
        stage_ids = tuple(s for s in current.stage_ids if s != member.row.stage_id)
        if not stage_ids:
            raise InvalidRequest(f"cannot drain {member.row.name}: it is the only stage")
        outcome = self._replan(stage_ids, f"drain {member.row.name}")
        self.members.set_drained(member.row.stage_id, True)
        return outcome

    def undrain(self, key: str) -> MoveOutcome:
        """Lets a drained stage back into the chain, at its registration-order place."""
        member = self._member(key)
        _, current = self._require_job()
        self.members.set_drained(member.row.stage_id, False)
        if member.row.stage_id in current.stage_ids:
            return MoveOutcome(False, current, f"{member.row.name} is already in the chain")
        order = [m.row.stage_id for m in self.members.members()]
        stage_ids = tuple(s for s in order if s in current.stage_ids or s == member.row.stage_id)
        return self._replan(stage_ids, f"undrain {member.row.name}")

    def _replan(self, stage_ids: tuple[str, ...], reason: str) -> MoveOutcome:
        speeds = self._speeds(stage_ids)
        best = plan(self.costs(), speeds, *self._links(len(speeds), self.profile))
        return self._move(stage_ids, best.boundaries, reason, 0.0)

    def _member(self, key: str) -> Member:
        member = self.members.find(key)
        if member is None:
            names = [m.row.name for m in self.members.members()]
            raise InvalidRequest(f"unknown stage {key!r} (stages: {names})")
        return member

    def _move(
        self, stage_ids: Sequence[str], boundaries: Sequence[int], reason: str, gain: float
    ) -> MoveOutcome:
        job, current = self._require_job()
        addresses = []
        for sid in stage_ids:
            member = self.members.by_id(sid)
            if member is None:
                raise InvalidRequest(f"unknown stage id {sid!r}")
            addresses.append(member.row.address)
        with self._move_lock:
            current = self.partition or current
            if tuple(boundaries) == current.boundaries and tuple(stage_ids) == current.stage_ids:
                return MoveOutcome(False, current, "the partition is already that one", gain)
            epoch = self.store.reserve_epoch()
            old = Chain(current.epoch, current.addresses, current.boundaries)
            new = Chain(epoch, tuple(addresses), tuple(boundaries))
            speeds = self._speeds(stage_ids)
            predicted = predict_step_time(
                estimates.evaluate(
                    boundaries, self.costs(), speeds, *self._links(len(speeds), self.profile)
                ),
                job.micro_batches,
                job.schedule,
            )
            partition = PartitionRow(
                epoch=epoch,
                job_id=job.job_id,
                boundaries=tuple(boundaries),
                stage_ids=tuple(stage_ids),
                addresses=tuple(addresses),
                predicted_step_s=predicted,
            )
            result: MoveResult = change_epoch(
                self.pool, job, old, new, commit_point=lambda: self.store.put_partition(partition)
            )
            self._install(
                partition,
                EpochRow(
                    epoch=epoch,
                    at=time.time(),
                    reason=reason,
                    boundaries=partition.boundaries,
                    stage_ids=partition.stage_ids,
                    layers_moved=result.layers_moved,
                    bytes_moved=result.bytes_moved,
                    pause_s=result.pause_s,
                    extra={
                        "committed_step": result.committed_step,
                        "wait_s": result.wait_s,
                        "transfer_s": result.transfer_s,
                    },
                ),
            )
            self._last_move, self._last_pause = time.monotonic(), result.pause_s
            for sid in stage_ids:  # speeds of moved-into stages are re-measured from now
                member = self.members.by_id(sid)
                if member is not None:
                    member.timings = {}
        log.info(
            "layers_migrated",
            epoch=epoch,
            reason=reason,
            boundaries=list(boundaries),
            stages=[self._name(s) for s in stage_ids],
            layers_moved=result.layers_moved,
            bytes_moved=result.bytes_moved,
            pause_s=round(result.pause_s, 3),
            step=result.committed_step,
        )
        return MoveOutcome(True, partition, reason, gain, result.bytes_moved, result.pause_s)

    # ---- admin -----------------------------------------------------------------------

    def slowdown(self, key: str, factor: float) -> str:
        """Changes a stage's emulated slowdown."""
        member = self._member(key)
        self.pool.call(
            member.row.address, "SetSlowdown", stage_pb2.SlowdownRequest(factor=factor), 10.0
        )
        log.info("slowdown_set", stage=member.row.name, factor=factor)
        return f"{member.row.name} slowdown set to {factor:g}"

    def set_auto(self, enabled: bool) -> str:
        """Turns automatic rebalancing on or off."""
        self.policy = replace(self.policy, enabled=enabled)
        log.info("auto_rebalance_set", enabled=enabled)
        return f"auto-rebalance {'on' if enabled else 'off'}"

    # ---- policy loop -----------------------------------------------------------------

    def start_policy(self) -> None:
        """Starts re-planning continually in the background."""
        self._policy_thread = threading.Thread(target=self._policy_loop, name="policy", daemon=True)
        self._policy_thread.start()

    def _policy_loop(self) -> None:
        while not self._stop.wait(self.policy.interval_s):
            if not self.policy.enabled or self.job is None or self.partition is None:
                continue
            if not self._measured(self.partition.stage_ids):
                continue
            try:
                self.rebalance(dry_run=False, reason="auto", force=False)
            except Exception as exc:  # the loop must outlive any one failed attempt
                log.warning("auto_rebalance_failed", error=str(exc))

    def _measured(self, stage_ids: Sequence[str]) -> bool:
        """Whether every stage of the chain has reported timings since the last move."""
        for sid in stage_ids:
            member = self.members.by_id(sid)
            if member is None or not any(t[3] > 0 for t in member.timings.values()):
                return False
        return True

    def close(self) -> None:
        """Stops the policy loop and closes channels."""
        self._stop.set()
        if self._policy_thread is not None:
            self._policy_thread.join(timeout=5)
        self.pool.close()
