"""Rebalancing: the optimal partition for live speeds, the policy loop, and the admin levers.

The policy loop re-plans every ``interval_s`` from the stages' measurements and moves
layers when ``policy.decide`` says the gain is worth it (hysteresis, payback, cool-down)
and a later committed step's measurements call for it again (``proposals``). The levers
an operator pulls (``rebalance``, ``set_partition``, ``drain``/``undrain``, a stage's
``leave`` on SIGTERM) validate everything before anything changes, and move through the same
two-phase epoch change.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from elasticpipe.coordinator import epochs, replica_changes
from elasticpipe.coordinator.epochs import Change, MoveResult
from elasticpipe.coordinator.membership import Member
from elasticpipe.coordinator.planning import (
    Plan,
    PlanError,
    estimates,
    memory,
    plan,
    predict_step_time,
    spare_positions,
)
from elasticpipe.coordinator.planning.policy import Decision, PolicyConfig, decide
from elasticpipe.coordinator.proposals import Pending, confirmed, toward
from elasticpipe.coordinator.replica_policy import ReplicaPolicy
from elasticpipe.coordinator.state import Cluster
from elasticpipe.coordinator.store import EpochRow
from elasticpipe.errors import InvalidRequest
from elasticpipe.layout import Layout
from elasticpipe.logs import get_logger
from elasticpipe.partition import Partition, StageRef

log = get_logger(__name__)

Proposal = tuple[tuple[int, ...], tuple[str, ...]]  # a move's boundaries and chain


@dataclass(frozen=True)
class PlanView:
    """The current partition next to the optimal one (``admin plan``).

    ``current_step_s`` and ``optimal_step_s`` are seconds only when ``in_seconds``; before
    the stages are profiled or measured they are in the unit-less costs of parameter sizes
    (their ratio, the gain, is still meaningful).
    """

    current: Partition
    optimal: Plan
    current_step_s: float
    optimal_step_s: float
    speeds: list[float]
    costs: tuple[float, ...]
    bytes_to_move: int
    layers_to_move: int
    in_seconds: bool = True
    speed_spreads: tuple[float, ...] = ()  # per stage: (max - min) / median, recent speeds


@dataclass(frozen=True)
class MoveOutcome:
    """What a rebalance request did (or, dry, would do)."""

    changed: bool
    partition: Partition | Layout | None  # a layout: a job of several replicas
    decision: str
    gain: float = 0.0
    bytes_moved: int = 0
    pause_s: float = 0.0
    target: Partition | Layout | None = None  # moved (or, dry, that would move) to


class Rebalancer(ReplicaPolicy):
    """The planner's view, the rebalancing policy and the operator's levers."""

    def __init__(
        self, cluster: Cluster, policy: PolicyConfig, pause: epochs.Pause = epochs._no_pause
    ):
        self.c = cluster
        stored = cluster.store.get("auto_rebalance")
        self.policy = policy if stored is None else replace(policy, enabled=bool(stored))
        if stored is not None and bool(stored) != policy.enabled:
            log.warning(
                "auto_rebalance_from_state",
                enabled=bool(stored),
                flag=policy.enabled,
                why="set by `admin auto` before a restart; the stored switch wins",
            )
        self._pause = pause
        self._last_decision = ""
        # An automatic move must be called for twice, the second time at a later committed
        # step than the first (``proposals``)
        self._proposals: dict[str, Pending] = {}  # per kind: "move", "shares", "replica", ...

    # ---- planning --------------------------------------------------------------------

    def plan_view(self, speeds: Mapping[str, float] | None = None) -> PlanView:
        """The current partition and the optimal one (changes nothing): for the live
        speeds, or for ``speeds`` by stage id where given (one pipeline; a stage missing
        from it gets ``estimates.fill_speeds``' fill).

        A job of several replicas: replica 0's partition, kept (layers of replicas are not
        re-planned yet), and the step predicted with the current shares against the best
        shares for the live speeds (what the policy re-splits to).
        """
        job, current = self.c.require_job()
        costs = self.c.costs()
        layout = self.c.layout
        if layout is not None:
            now_s, best_s, _ = replica_changes.planned_shares(self.c, layout)
            live = self.c.speeds(current.stage_ids)
            return PlanView(
                current=current,
                optimal=estimates.evaluate(current.boundaries, costs, live),
                current_step_s=now_s,
                optimal_step_s=best_s,
                speeds=live,
                costs=costs,
                bytes_to_move=0,
                layers_to_move=0,
                in_seconds=self.c.in_seconds(layout.stage_ids),
                speed_spreads=tuple(self.c.speed_spreads(current.stage_ids)),
            )
        if speeds is None:
            chain = self.c.speeds(current.stage_ids)
        else:  # ordered here, on the partition this view reads
            chain = estimates.fill_speeds([speeds.get(sid) for sid in current.stage_ids])
        links = self.c.links(len(chain))
        now = estimates.evaluate(current.boundaries, costs, chain, *links)
        best = plan(
            costs, chain, *links, *self.c.memory(current.stage_ids), current=current.boundaries
        )
        target = current.evolve(epoch=current.epoch + 1, boundaries=best.boundaries)
        now_s = predict_step_time(now, job.micro_batches, job.schedule)
        return PlanView(
            current=current,
            optimal=best,
            current_step_s=now_s,
            optimal_step_s=predict_step_time(best, job.micro_batches, job.schedule),
            speeds=chain,
            costs=costs,
            bytes_to_move=self.c.bytes_to_move(current, target),
            layers_to_move=len(current.moves_to(target)),
            in_seconds=self.c.in_seconds(current.stage_ids),
            speed_spreads=tuple(self.c.speed_spreads(current.stage_ids)),
        )

    def rebalance(
        self,
        dry_run: bool,
        reason: str,
        force: bool = True,
        speeds: Mapping[str, float] | None = None,
    ) -> MoveOutcome:
        """Moves to the optimal partition for the live speeds, or for ``speeds``.

        Args:
            dry_run: only say what would happen (not logged as a move).
            reason: recorded in the epoch history.
            force: skip the policy's threshold/payback/cool-down (an operator asked).
            speeds: the stages' speeds to plan with, by stage id (default: live).

        Raises:
            InvalidRequest: the job runs several replicas (``set-layout`` moves them).
        """
        self.c.refuse_replicated("rebalancing (admin set-layout moves replicas)")
        view = self.plan_view(speeds)
        decision = decide(
            self.policy,
            view.current_step_s,
            view.optimal_step_s,
            view.bytes_to_move,
            time.monotonic() - self.c.last_move,
            self.c.last_pause,
            layers_to_move=view.layers_to_move,
            forced=force,
        )
        target = view.current.evolve(
            epoch=view.current.epoch + 1, boundaries=view.optimal.boundaries
        )
        if not decision.move:
            self._proposals.pop("move", None)
        elif not force and not dry_run:
            key = (view.optimal.boundaries, view.current.stage_ids)
            way = toward(view.current.boundaries, view.optimal.boundaries)
            decision = self._confirmed("move", decision, key, view.current.stage_ids, way)
        if not dry_run:
            self._log_decision(decision, reason, view.in_seconds)
        if not decision.move or dry_run:
            return MoveOutcome(
                False, view.current, decision.reason, decision.gain, view.bytes_to_move, 0.0, target
            )
        self._proposals.pop("move", None)
        return self.move(view.current.stages, view.optimal.boundaries, reason, decision.gain)

    def confirming(self, committed_step: int) -> bool:
        """Whether a proposal waits for the measurements of a step later than
        ``committed_step`` (a stage's, just reported): that stage then reports as soon as
        its next step commits."""
        p = self.c.partition
        if not self.policy.enabled or self.c.job is None or p is None:
            return False  # (below: another job's or epoch's proposal counts as none)
        pending = list(self._proposals.values())
        return any(x.stamp == (p.job_id, p.epoch) and committed_step <= x.step for x in pending)

    def _confirmed(
        self,
        kind: str,
        decision: Decision,
        key: Proposal,
        stage_ids: Sequence[str],
        way: tuple[int, ...] | None = None,
    ) -> Decision:
        """Holds a move of ``kind`` to ``key`` (moving ``way``) back until a later step's
        measurements call for it again (``proposals.confirm``)."""
        steps = [
            m.committed_step for sid in stage_ids if (m := self.c.members.by_id(sid)) is not None
        ]
        p = self.c.partition
        stamp = (p.job_id, p.epoch) if p is not None else ("", 0)
        return confirmed(self._proposals, kind, decision, key, min(steps, default=0), stamp, way)

    def _log_decision(self, decision: Decision, reason: str, in_seconds: bool = True) -> None:
        """Logs a decision when it changes; the steady state goes to debug. Step times
        not in seconds (``in_seconds`` false: nothing profiled or measured yet) are logged
        and exported as unknown (None); one chain's plus ``Cluster.plus_overheads``."""
        current = round(decision.current_step_s, 4) if in_seconds else None
        fields = {
            "reason": reason,
            "why": decision.reason,
            "gain": round(decision.gain, 4),
            "current_step_s": current,
            "proposed_step_s": round(decision.proposed_step_s, 4) if in_seconds else None,
            "bytes_to_move": decision.bytes_to_move,
        }
        predicted, job, chain = decision.current_step_s, self.c.job, self.c.partition
        if in_seconds and self.c.replicas == 1 and job is not None and chain is not None:
            predicted = self.c.plus_overheads(predicted, chain.boundaries, job.micro_batches)
        self.c.metrics.decided(decision.outcome, predicted if in_seconds else None)
        # The same kind of decision (its numbers aside) once at info, then at debug.
        kind = re.sub(r"[0-9.]+", "#", decision.reason)
        if decision.move:
            log.info("rebalance_decided", **fields)
        elif kind != self._last_decision:
            deferred = "waiting to confirm" in decision.reason
            log.info("rebalance_deferred" if deferred else "rebalance_declined", **fields)
        else:
            log.debug("rebalance_declined", **fields)
        self._last_decision = kind

    # ---- moves -----------------------------------------------------------------------

    def move(
        self,
        stages: Sequence[StageRef],
        boundaries: Sequence[int],
        reason: str,
        gain: float,
        kind: str = "move",
        leave_by: float | None = None,
    ) -> MoveOutcome:
        """Moves to ``boundaries`` over ``stages`` through a two-phase epoch change; one
        taken out of the chain may exit once it returns (``epochs.wait_if_one_left``).

        Raises:
            InvalidRequest: the target partition loses a layer, repeats a stage, or names a
                stage that is not alive (nothing changed).
            ElasticPipeError: the change was abandoned (the old epoch stays in force).
        """
        job, current = self.c.require_job()
        with self.c.move_lock:
            current = self.c.partition or current
            # under the lock: a job of replicas set up meanwhile is not moved either
            self.c.refuse_replicated("moving layers")
            # evolve: the last rollback (restore_epoch, restored_step) stays on record.
            target = current.evolve(
                epoch=current.epoch + 1, boundaries=tuple(boundaries), stages=tuple(stages)
            ).validate(self.c.num_layers)
            self._check_alive(target.stage_ids)
            memory.check_fits(
                target.boundaries,
                self.c.memory(target.stage_ids),
                self.c.names(target.stage_ids),
                kind,
            )
            if target.boundaries == current.boundaries and target.stages == current.stages:
                return MoveOutcome(False, current, "the partition is already that one", gain)
            epochs.check_no_change_in_progress(self.c)
            speeds = self.c.speeds(target.stage_ids)
            predicted = self.c.chain_step_s(
                estimates.evaluate(
                    target.boundaries, self.c.costs(), speeds, *self.c.links(len(speeds))
                ),
                job,
            )
            new = target.evolve(
                epoch=self.c.store.reserve_epoch(),
                predicted_step_s=predicted if self.c.in_seconds(target.stage_ids) else None,
            )
            names = tuple(self.c.names(new.stage_ids))

            def history(result: MoveResult) -> EpochRow:
                return epochs.history_row(
                    self.c,
                    new,
                    kind,
                    reason,
                    names=names,
                    moved=result,
                    extra={
                        "committed_step": result.committed_step,
                        "wait_s": result.wait_s,
                        "transfer_s": result.transfer_s,
                    },
                )

            result: MoveResult = epochs.change_epoch(
                self.c, job, Change(kind, reason, current, new), self._pause, history
            )
            epochs.wait_if_one_left(self.c, current, new, job, result.committed_step, leave_by)
            self.c.last_move, self.c.last_pause = time.monotonic(), result.pause_s
            for sid in new.stage_ids:  # speeds of moved-into stages are re-measured from now
                member = self.c.members.by_id(sid)
                if member is not None:
                    member.remeasure()
        log.info(
            "layers_migrated",
            epoch=new.epoch,
            reason=reason,
            boundaries=list(new.boundaries),
            stages=self.c.names(new.stage_ids),
            layers_moved=result.layers_moved,
            bytes_moved=result.bytes_moved,
            pause_s=round(result.pause_s, 3),
            step=result.committed_step,
        )
        return MoveOutcome(True, new, reason, gain, result.bytes_moved, result.pause_s, new)

    def _check_alive(self, stage_ids: Sequence[str]) -> None:
        for sid in stage_ids:
            member = self.c.members.by_id(sid)
            if member is None or not self.c.members.alive(member):
                name = member.row.name if member else sid
                raise InvalidRequest(f"stage {name!r} is not alive: it cannot own layers")

    def _member(self, key: str) -> Member:
        member = self.c.members.find(key)
        if member is None:
            names = sorted({m.row.name for m in self.c.members.members()})
            raise InvalidRequest(f"unknown stage {key!r} (stages: {names})")
        return member

    def _ref(self, member: Member) -> StageRef:
        return StageRef(member.row.stage_id, member.row.address)

    def set_partition(
        self, boundaries: Sequence[int], stages: Sequence[str], reason: str
    ) -> MoveOutcome:
        """Moves to an operator-given partition (and optionally chain order).

        Raises:
            InvalidRequest: unknown, repeated or dead stages, or ranges that do not cover
                every layer exactly once (checked before anything changes).
        """
        _, current = self.c.require_job()
        refs = current.stages
        if stages:
            repeated = sorted({s for s in stages if list(stages).count(s) > 1})
            if repeated:
                raise InvalidRequest(
                    f"stage {repeated[0]!r} is listed twice in {list(stages)}: each stage can "
                    "hold one range"
                )
            refs = tuple(self._ref(self._member(s)) for s in stages)
        return self.move(refs, boundaries, reason, 0.0)

    def set_layout(
        self,
        chains: Sequence[tuple[Sequence[int], Sequence[str]]],
        shares: Sequence[int],
        reason: str,
    ) -> MoveOutcome:
        """Moves the job to your own replicas: each one's cuts and stages (names or ids;
        none: the stages of that replica now), and the shares (none: planned).

        Raises:
            InvalidRequest: no replica, a stage unknown, dead or listed twice, a replica
                without stages, cuts that do not fit (named); nothing changes.
        """
        self.c.require_job()
        if not chains:
            raise InvalidRequest("set-layout needs at least one replica")
        with self.c.move_lock:
            current = self.c.job_layout()
            assert current is not None
            specs = []
            for r, (cuts, keys) in enumerate(chains):
                if keys:
                    refs = tuple(self._ref(self._member(k)) for k in keys)
                elif r < len(current.replicas):
                    refs = current.replicas[r].stages
                else:
                    raise InvalidRequest(
                        f"replica {r} is new: name its stages (the job runs "
                        f"{len(current.replicas)} replicas)"
                    )
                specs.append((tuple(int(b) for b in cuts), refs))
            self._check_alive([ref.stage_id for _, refs in specs for ref in refs])
            for cuts, refs in specs:
                stage_ids = [ref.stage_id for ref in refs]
                if len(cuts) == len(refs) + 1:
                    memory.check_fits(
                        cuts, self.c.memory(stage_ids), self.c.names(stage_ids), "set-layout"
                    )
            new, result = replica_changes.set_layout(
                self.c, specs, tuple(shares) or None, reason, self._pause
            )
        if result is None:
            return MoveOutcome(False, current, "the layout is already that one")
        return MoveOutcome(True, new, reason, 0.0, result.bytes_moved, result.pause_s, new)

    def drain(self, key: str, reason: str = "", leave_by: float | None = None) -> MoveOutcome:
        """Moves every layer off a stage and keeps it out of the chain (a job of several
        replicas: its replica is mended without it, ``replica_changes.drain``); a leaving
        stage's deadline is ``leave_by`` (``move``)."""
        member = self._member(key)
        _, current = self.c.require_job()
        with self.c.move_lock:  # (whether it runs replicas is asked under the lock)
            if self.c.replicas > 1 and member.row.stage_id in self.c.job_stage_ids():
                why = reason or f"drain {member.row.name}"
                new, result = replica_changes.drain(self.c, member, why, self._pause)
                self.c.members.set_drained(member.row.stage_id, True)
                if result is None:
                    return MoveOutcome(False, new, f"{member.row.name} holds no layers")
                return MoveOutcome(True, new, why, 0.0, result.bytes_moved, result.pause_s, new)
            _, current = self.c.require_job()
        if member.row.stage_id not in self.c.job_stage_ids():
            self.c.members.set_drained(member.row.stage_id, True)
            return MoveOutcome(False, current, f"{member.row.name} holds no layers")
        stages = tuple(s for s in current.stages if s.stage_id != member.row.stage_id)
        if not stages:
            raise InvalidRequest(f"cannot drain {member.row.name}: it is the only stage")
        outcome = self.replan(stages, reason or f"drain {member.row.name}", leave_by)
        self.c.members.set_drained(member.row.stage_id, True)
        return outcome

    def undrain(self, key: str) -> MoveOutcome:
        """Lets a drained stage back into the chain, at its registration-order place."""
        member = self._member(key)
        _, current = self.c.require_job()
        self.c.members.set_drained(member.row.stage_id, False)
        if member.row.stage_id in self.c.job_stage_ids():
            return MoveOutcome(False, current, f"{member.row.name} is already in the chain")
        if self.c.replicas > 1:  # a spare again: a new replica's, or set-layout's, to use
            return MoveOutcome(
                False,
                self.c.layout,
                f"{member.row.name} is a spare again: the policy forms a replica of spares "
                "when it predicts a gain, and admin set-layout places it now",
            )
        order = [m.row.stage_id for m in self.c.members.members()]
        chain_ids = set(current.stage_ids) | {member.row.stage_id}
        refs = {s.stage_id: s for s in current.stages} | {member.row.stage_id: self._ref(member)}
        stages = tuple(refs[s] for s in order if s in chain_ids)
        return self.replan(stages, f"undrain {member.row.name}")

    def replan(
        self, stages: Sequence[StageRef], reason: str, leave_by: float | None = None
    ) -> MoveOutcome:
        """Moves to the optimal partition over ``stages`` (``leave_by``: ``move``)."""
        speeds = self.c.speeds([s.stage_id for s in stages])
        stage_ids = [s.stage_id for s in stages]
        best = plan(self.c.costs(), speeds, *self.c.links(len(speeds)), *self.c.memory(stage_ids))
        return self.move(stages, best.boundaries, reason, 0.0, leave_by=leave_by)

    def set_auto(self, enabled: bool) -> str:
        """Turns automatic rebalancing on or off (persisted)."""
        self.policy = replace(self.policy, enabled=enabled)
        if not enabled:
            self._proposals.clear()
        self.c.store.put("auto_rebalance", enabled)
        log.info("auto_rebalance_set", enabled=enabled)
        return f"auto-rebalance {'on' if enabled else 'off'}"

    # ---- the policy loop -------------------------------------------------------------

    def tick(self) -> None:
        """One pass of the policy loop."""
        partition = self.c.partition
        if not self.policy.enabled or self.c.job is None or partition is None or self.c.failure:
            return
        if self.c.replicas > 1:  # shares first, then layers, then a replica of spares
            # (a lever waiting to confirm its proposal keeps the later ones waiting too)
            if self.retune_shares() or "shares" in self._proposals:
                return
            if not self.retune_layers() and "layers" not in self._proposals:
                self.grow_replicas()
            return
        if not self._measured(partition.stage_ids):
            return
        if self.c.store.get(epochs.CHANGE_KEY) is not None:
            return
        outcome = self.rebalance(dry_run=False, reason="auto", force=False)
        if not outcome.changed:
            self.scale_out()

    def scale_out(self) -> MoveOutcome | None:
        """Adds a spare to the chain when the planner predicts a gain the policy accepts.

        The first ``reserve_spares`` spares (in registration order) stay out, ready to
        replace a stage that dies. The spare goes where it helps most.
        """
        job, current = self.c.require_job()
        spares = self.c.spares()[self.policy.reserve_spares :]
        if not spares or current.num_stages >= current.num_layers:
            return None
        spare = spares[0]
        costs = self.c.costs()
        speeds = self.c.speeds(current.stage_ids)
        now = estimates.evaluate(current.boundaries, costs, speeds, *self.c.links(len(speeds)))
        best: tuple[tuple[StageRef, ...], Plan] | None = None
        for position in spare_positions(now.stage_times):
            refs = list(current.stages)
            refs.insert(position, self._ref(spare))
            with_spare = self.c.speeds([r.stage_id for r in refs])
            try:
                candidate = plan(
                    costs,
                    with_spare,
                    *self.c.links(len(refs)),
                    *self.c.memory([r.stage_id for r in refs]),
                )
            except PlanError:
                continue  # the layers do not fit memory with the spare here
            if best is None or candidate.bottleneck < best[1].bottleneck:
                best = (tuple(refs), candidate)
        if best is None:
            return None
        chain, optimum = best
        target = Partition(current.epoch + 1, current.job_id, optimum.boundaries, chain)
        decision = decide(
            self.policy,
            predict_step_time(now, job.micro_batches, job.schedule),
            predict_step_time(optimum, job.micro_batches, job.schedule),
            self.c.bytes_to_move(current, target),
            time.monotonic() - self.c.last_move,
            self.c.last_pause,
            layers_to_move=len(current.moves_to(target)),
        )
        if decision.move:
            key = (optimum.boundaries, tuple(r.stage_id for r in chain))
            decision = self._confirmed("scale-out", decision, key, current.stage_ids)
        else:
            self._proposals.pop("scale-out", None)
        self._log_decision(
            decision, f"scale out with {spare.row.name}", self.c.in_seconds(current.stage_ids)
        )
        if not decision.move:
            return None
        self._proposals.pop("scale-out", None)
        return self.move(
            chain,
            optimum.boundaries,
            f"scale out: {spare.row.name} joins",
            decision.gain,
            kind="scale-out",
        )

    def _measured(self, stage_ids: Sequence[str]) -> bool:
        """Whether every stage of the chain is alive and has reported timings since the
        last move."""
        for sid in stage_ids:
            member = self.c.members.by_id(sid)
            if member is None or not self.c.members.alive(member):
                return False
            if not any(t[3] > 0 for t in member.timings.values()):
                return False
        return True
