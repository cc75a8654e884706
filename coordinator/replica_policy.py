"""The rebalancing policy's levers for a job of several replicas (``Rebalancer`` mixes them
in), tried in this order: re-splitting the shares when the live speeds call for it (moves
no state), moving layers inside replicas (each re-partitioned over its own stages), and
forming a new replica from the spares when the planner predicts a gain. Each is decided as
a move is (threshold, payback, cool-down, confirmed by a later step's measurements) and
carried out as one epoch change (``replica_changes``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

from elasticpipe.coordinator import epochs, replica_changes, replica_options
from elasticpipe.coordinator.membership import Member
from elasticpipe.coordinator.planning import plan
from elasticpipe.coordinator.planning.cost import PlanError
from elasticpipe.coordinator.planning.policy import Decision, PolicyConfig, decide
from elasticpipe.coordinator.proposals import Pending, toward
from elasticpipe.coordinator.state import Cluster
from elasticpipe.layout import Layout

__all__ = ["ReplicaPolicy"]

Proposal = tuple[tuple[int, ...], tuple[str, ...]]


class _Rebalancer(Protocol):
    """What the levers use of the ``Rebalancer`` they are mixed into."""

    c: Cluster
    policy: PolicyConfig
    _pause: epochs.Pause
    _proposals: dict[str, Pending]

    def _measured(self, stage_ids: Sequence[str]) -> bool: ...

    def _confirmed(
        self,
        kind: str,
        decision: Decision,
        key: Proposal,
        stage_ids: Sequence[str],
        way: tuple[int, ...] | None = None,
    ) -> Decision: ...

    def _log_decision(self, decision: Decision, reason: str, in_seconds: bool = True) -> None: ...


def _measured_layout(policy: _Rebalancer) -> Layout | None:
    """The job's layout when the levers that price it on measurements may act: no
    change in progress, every stage's speed measured, and (with a profile) every
    replica's pipeline measured in this epoch; else None."""
    layout = policy.c.layout
    if layout is None or policy.c.store.get(epochs.CHANGE_KEY) is not None:
        return None
    if not all(policy._measured(p.stage_ids) for p in layout.replicas):
        return None
    if policy.c.in_seconds(layout.stage_ids) and (
        replica_options.measured_pipelines(policy.c, layout) is None
    ):
        return None
    return layout


class ReplicaPolicy:
    """``retune_shares``, ``retune_layers`` and ``grow_replicas``, for ``Rebalancer.tick``."""

    def retune_shares(self: _Rebalancer) -> bool:
        """Re-splits a job of several replicas' micro-batches when the live speeds predict a
        faster split that the policy accepts. Returns whether the shares changed."""
        layout = _measured_layout(self)
        if layout is None:
            return False
        now_s, best_s, best = replica_changes.planned_shares(self.c, layout)
        moved = sum(abs(a - b) for a, b in zip(best, layout.shares, strict=True)) // 2
        decision = decide(
            self.policy,
            now_s,
            best_s,
            0,
            time.monotonic() - self.c.last_move,
            self.c.last_pause,
            layers_to_move=moved,
        )
        if decision.move:
            way = toward(layout.shares, best)
            decision = self._confirmed("shares", decision, (best, ()), layout.stage_ids, way)
        else:
            self._proposals.pop("shares", None)
        self._log_decision(decision, "auto shares", self.c.in_seconds(layout.stage_ids))
        if not decision.move:
            return False
        self._proposals.pop("shares", None)
        with self.c.move_lock:
            if self.c.layout is not layout or not all(
                self._measured(p.stage_ids) for p in layout.replicas
            ):  # changed, or a stage died, meanwhile: decide again next time
                return False
            reason = (
                f"auto: shares {list(layout.shares)} -> {list(best)} (predicted step "
                f"{now_s:.4g}s -> {best_s:.4g}s)"
            )
            replica_changes.reshare(self.c, best, reason, self._pause)
        return True

    def retune_layers(self: _Rebalancer) -> bool:
        """Moves layers inside replicas when the live speeds call for it: each replica
        re-partitioned over its own stages (their order kept), the shares water-filled
        again. Priced against the current partitions with their best shares (re-splitting
        comes first), both from the predictions alone: the new cuts are not measured yet.
        Returns whether layers moved."""
        layout = _measured_layout(self)  # (the shares get their chance first)
        if layout is None:
            return False
        costs, chains = self.c.costs(), []
        for p in layout.replicas:
            ids = list(p.stage_ids)
            try:
                best = plan(
                    costs,
                    self.c.speeds(ids),
                    *self.c.links(len(ids)),
                    *self.c.memory(ids),
                    current=p.boundaries,
                )
            except PlanError:
                return False
            chains.append(p.evolve(boundaries=best.boundaries))
        moves = [(old, new) for old, new in zip(layout.replicas, chains, strict=True) if old != new]
        if not moves:
            self._proposals.pop("layers", None)
            return False
        now_s = replica_options.layout_step(self.c, layout.replicas)
        new_s = replica_options.layout_step(self.c, chains)
        decision = decide(
            self.policy,
            now_s,
            new_s,
            sum(self.c.bytes_to_move(old, new) for old, new in moves),
            time.monotonic() - self.c.last_move,
            self.c.last_pause,
            layers_to_move=sum(len(old.moves_to(new)) for old, new in moves),
        )
        key = (tuple(b for p in chains for b in p.boundaries), layout.stage_ids)
        if decision.move:
            way = toward([b for p in layout.replicas for b in p.boundaries], key[0])
            decision = self._confirmed("layers", decision, key, layout.stage_ids, way)
        else:
            self._proposals.pop("layers", None)
        self._log_decision(decision, "auto layers", self.c.in_seconds(layout.stage_ids))
        if not decision.move:
            return False
        self._proposals.pop("layers", None)
        with self.c.move_lock:
            if self.c.layout is not layout:  # changed meanwhile: decide again next time
                return False
            cuts = "; ".join(
                f"replica {layout.replicas.index(old)} {list(old.boundaries)} -> "
                f"{list(new.boundaries)}"
                for old, new in moves
            )
            reason = f"auto: layers {cuts} (predicted step {now_s:.4g}s -> {new_s:.4g}s)"
            specs = [(p.boundaries, p.stages) for p in chains]
            replica_changes.set_layout(self.c, specs, None, reason, self._pause)
        return True

    def grow_replicas(self: _Rebalancer) -> bool:
        """Forms a new replica from the spares (beyond the ``reserve_spares`` kept to
        replace dead stages) when the planner predicts the step faster with it, counting
        the pause of pulling every layer. Returns whether a replica was formed."""
        layout, job = self.c.layout, self.c.job
        spares: list[Member] = self.c.spares()[self.policy.reserve_spares :]
        if layout is None or job is None or not spares:
            return False
        if self.c.store.get(epochs.CHANGE_KEY) is not None:
            return False
        if not all(self._measured(p.stage_ids) for p in layout.replicas):
            return False
        proposal = replica_changes.new_replica(self.c, layout, spares)
        if proposal is None:
            return False
        chain, now_s, new_s = proposal
        decision = decide(
            self.policy,
            now_s,
            new_s,
            sum(self.c.layer_state_bytes(i) for i in range(self.c.num_layers)),
            time.monotonic() - self.c.last_move,
            self.c.last_pause,
            layers_to_move=self.c.num_layers,
        )
        key = (chain.boundaries, chain.stage_ids)
        if decision.move:
            decision = self._confirmed("replica", decision, key, layout.stage_ids)
        else:
            self._proposals.pop("replica", None)
        names = ", ".join(self.c.names(chain.stage_ids))
        self._log_decision(
            decision, f"a new replica of {names}", self.c.in_seconds(chain.stage_ids)
        )
        if not decision.move:
            return False
        self._proposals.pop("replica", None)
        with self.c.move_lock:
            if self.c.layout is not layout:  # changed meanwhile: decide again next time
                return False
            specs = [(p.boundaries, p.stages) for p in layout.replicas]
            specs.append((chain.boundaries, chain.stages))
            reason = f"auto: a new replica of {names} (predicted step {now_s:.4g}s -> {new_s:.4g}s)"
            replica_changes.set_layout(self.c, specs, None, reason, self._pause)
        return True
