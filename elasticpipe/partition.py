"""The partition: in one epoch, which stages, in chain order, own which contiguous layers.

One frozen type serves every party: the coordinator plans, stores and changes it; a
stage reads its own ``Placement`` from it; the client routes a step through it. Worked
example, 7 layers over 3 stages::

    Partition(epoch=4, boundaries=(0, 2, 5, 7), stages=(a, b, c))
    a owns layers 0-1, b owns 2-4, c owns 5-6;  owner_of(3) is b
    moves_to(boundaries (0, 3, 4, 7), same stages) -> [Move(2, a <- b), Move(4, c <- b)]

``validate`` is the one check that a partition loses no layer: every layer owned by
exactly one stage, every stage distinct and owning at least one layer.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from elasticpipe.errors import InvalidRequest
from elasticpipe.v1 import coordinator_pb2, stage_pb2

MAX_REPLICAS = 4096  # as many as stages (``security.bounds.MAX_STAGES``)


@dataclass(frozen=True)
class StageRef:
    """A stage incarnation as the data path knows it: its id and where it listens."""

    stage_id: str
    address: str


@dataclass(frozen=True)
class Group:
    """Layers ``[lo, hi)`` that the same stages hold in every replica: they reduce together
    (``elasticpipe.layout``).

    Attributes:
        index: the group's place among the layout's groups (in layer order).
        holders: the stage holding these layers in each replica, in replica order.
    """

    index: int
    lo: int
    hi: int
    holders: tuple[StageRef, ...]

    @property
    def layers(self) -> range:
        """The group's layers."""
        return range(self.lo, self.hi)

    def to_proto(self) -> stage_pb2.ReduceGroup:
        """The wire form (in ``Assignment.groups``)."""
        return stage_pb2.ReduceGroup(
            index=self.index,
            layer_lo=self.lo,
            layer_hi=self.hi,
            holders=[stage_pb2.Peer(stage_id=h.stage_id, address=h.address) for h in self.holders],
        )

    @classmethod
    def from_proto(cls, g: stage_pb2.ReduceGroup, replicas: int) -> Group:
        """Parses a group of a layout of ``replicas`` replicas.

        Raises:
            InvalidRequest: an empty range, or not one holder per replica.
        """
        if g.layer_hi <= g.layer_lo or len(g.holders) != replicas:
            raise InvalidRequest(
                f"bad reduction group {g.index}: layers [{g.layer_lo}, {g.layer_hi}), "
                f"{len(g.holders)} holders for {replicas} replicas"
            )
        holders = tuple(StageRef(h.stage_id, h.address) for h in g.holders)
        return cls(g.index, g.layer_lo, g.layer_hi, holders)


@dataclass(frozen=True)
class Placement:
    """One stage's place in one partition epoch (what the stage needs to run its layers).

    With data parallelism (``num_replicas`` > 1) the chain is this stage's replica's, and
    ``groups`` are the reduction groups it holds layers of.
    """

    epoch: int
    index: int
    num_stages: int
    lo: int
    hi: int
    prev: str = ""
    next: str = ""
    chain: tuple[StageRef, ...] = ()
    names: tuple[str, ...] = ()  # the chain's registered names (empty if not given)
    ranges: tuple[tuple[int, int], ...] = ()  # the layers each stage of the chain owns
    replica: int = 0
    num_replicas: int = 1
    groups: tuple[Group, ...] = ()

    @property
    def layers(self) -> range:
        """The layers this placement owns."""
        return range(self.lo, self.hi)

    @property
    def in_chain(self) -> bool:
        """Whether the stage owns layers in this epoch."""
        return self.hi > self.lo

    @property
    def snapshot_peer(self) -> str:
        """Where this stage keeps the copy of its snapshots: the next stage, wrapping
        around (empty when the chain has one stage)."""
        if self.num_stages < 2 or not self.chain:
            return ""
        return self.chain[(self.index + 1) % self.num_stages].address

    def to_proto(self) -> stage_pb2.Assignment:
        """The wire form (``Assign`` and ``PrepareEpoch`` carry it)."""
        return stage_pb2.Assignment(
            epoch=self.epoch,
            index=self.index,
            num_stages=self.num_stages,
            layer_lo=self.lo,
            layer_hi=self.hi,
            prev=stage_pb2.Peer(address=self.prev),
            next=stage_pb2.Peer(address=self.next),
            chain=[
                stage_pb2.Peer(
                    stage_id=s.stage_id,
                    address=s.address,
                    name=self.names[i] if i < len(self.names) else "",
                    layer_lo=self.ranges[i][0] if i < len(self.ranges) else 0,
                    layer_hi=self.ranges[i][1] if i < len(self.ranges) else 0,
                )
                for i, s in enumerate(self.chain)
            ],
            replica=self.replica,
            num_replicas=self.num_replicas if self.num_replicas > 1 else 0,
            groups=[g.to_proto() for g in self.groups],
        )

    @classmethod
    def from_proto(cls, a: stage_pb2.Assignment) -> Placement:
        """Parses an assignment, checking its layer range and chain position.

        Raises:
            InvalidRequest: an empty or inverted range, or a position outside the chain.
        """
        chain = tuple(StageRef(p.stage_id, p.address) for p in a.chain)
        if a.layer_hi < a.layer_lo or (a.num_stages and a.index >= a.num_stages):
            raise InvalidRequest(
                f"bad assignment: layers [{a.layer_lo}, {a.layer_hi}), index {a.index} of "
                f"{a.num_stages} stages"
            )
        if chain and len(chain) != a.num_stages:
            raise InvalidRequest(
                f"bad assignment: a chain of {len(chain)} stages for num_stages {a.num_stages}"
            )
        replicas = max(1, a.num_replicas)
        if (
            replicas > MAX_REPLICAS
            or a.replica >= replicas
            or (replicas == 1 and a.groups)
            or len(a.groups) > a.layer_hi - a.layer_lo  # at most a group per layer held
        ):
            raise InvalidRequest(
                f"bad assignment: replica {a.replica} of {replicas}, {len(a.groups)} groups "
                f"for layers [{a.layer_lo}, {a.layer_hi})"
            )
        groups = tuple(Group.from_proto(g, replicas) for g in a.groups)
        _check_groups(groups, a, chain)
        return cls(
            epoch=a.epoch,
            index=a.index,
            num_stages=a.num_stages,
            lo=a.layer_lo,
            hi=a.layer_hi,
            replica=a.replica,
            num_replicas=replicas,
            groups=groups,
            prev=a.prev.address,
            next=a.next.address,
            chain=chain,
            names=tuple(p.name for p in a.chain) if any(p.name for p in a.chain) else (),
            ranges=(
                tuple((p.layer_lo, p.layer_hi) for p in a.chain)
                if any(p.layer_hi for p in a.chain)
                else ()
            ),
        )


def _check_groups(
    groups: tuple[Group, ...], a: stage_pb2.Assignment, chain: tuple[StageRef, ...]
) -> None:
    """A replicated stage's groups tile its layers in order, and name it as their holder
    in its replica (a layer left out would never get its reduced gradient).

    Raises:
        InvalidRequest: naming the groups and the layers.
    """
    if a.num_replicas <= 1:
        return
    cuts = [a.layer_lo, *(g.hi for g in groups)]
    own = chain[a.index].address if chain and a.index < len(chain) else None
    if (
        [g.lo for g in groups] != cuts[:-1]
        or cuts[-1] != a.layer_hi
        or any(own is not None and g.holders[a.replica].address != own for g in groups)
    ):
        raise InvalidRequest(
            f"bad assignment: groups {[(g.lo, g.hi) for g in groups]} do not tile layers "
            f"[{a.layer_lo}, {a.layer_hi}) held by replica {a.replica}'s stage {own!r}"
        )


@dataclass(frozen=True)
class Move:
    """A layer changing owner between two partitions (stage ids)."""

    layer: int
    source: str
    target: str


def check_boundaries(boundaries: Sequence[int], num_layers: int | None, num_stages: int) -> None:
    """Checks ``0 = b0 < b1 < ... < bS = num_layers`` with ``S = num_stages``.

    Raises:
        InvalidRequest: naming the boundaries and what is wrong with them.
    """
    b = list(boundaries)
    if len(b) != num_stages + 1:
        raise InvalidRequest(
            f"boundaries {b} give {len(b) - 1} ranges for {num_stages} stages "
            f"(need {num_stages + 1} values)"
        )
    if not b or b[0] != 0 or (num_layers is not None and b[-1] != num_layers):
        want = num_layers if num_layers is not None else "the layer count"
        raise InvalidRequest(f"boundaries {b} must run from 0 to {want}")
    empty = [s for s in range(len(b) - 1) if b[s + 1] <= b[s]]
    if empty:
        raise InvalidRequest(
            f"boundaries {b} leave stage {empty[0]} without layers (every stage owns >= 1)"
        )


@dataclass(frozen=True)
class Partition:
    """Which stages, in chain order, own which layers in one epoch.

    Attributes:
        epoch: the partition's epoch; data-path requests carry it.
        job_id: the job the layers belong to.
        boundaries: ``S + 1`` cuts; stage ``s`` owns ``[boundaries[s], boundaries[s+1])``.
        stages: the chain, in order.
        predicted_step_s: the planner's seconds per step for it; None while unknown (the
            stages are not profiled yet: layer costs estimated from parameter sizes have
            no unit).
        restored_step: the step the job was last rolled back to (with ``restore_epoch``).
        restore_epoch: the epoch of the last rollback (recovery or checkpoint load); 0 if
            none. A client that saw an older one must replay from ``restored_step``.
    """

    epoch: int
    job_id: str
    boundaries: tuple[int, ...]
    stages: tuple[StageRef, ...]
    predicted_step_s: float | None = None
    restored_step: int = 0
    restore_epoch: int = 0
    _starts: tuple[int, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "boundaries", tuple(int(b) for b in self.boundaries))
        object.__setattr__(self, "stages", tuple(self.stages))
        object.__setattr__(self, "_starts", self.boundaries[:-1])

    # ---- shape ---------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        """Layers of the model."""
        return self.boundaries[-1] if self.boundaries else 0

    @property
    def num_stages(self) -> int:
        """Stages in the chain."""
        return len(self.stages)

    @property
    def stage_ids(self) -> tuple[str, ...]:
        """Stage ids in chain order."""
        return tuple(s.stage_id for s in self.stages)

    @property
    def addresses(self) -> tuple[str, ...]:
        """Stage addresses in chain order."""
        return tuple(s.address for s in self.stages)

    def validate(self, num_layers: int | None = None) -> Partition:
        """Checks that every layer is owned by exactly one of distinct stages.

        Returns:
            The partition itself, for chaining.

        Raises:
            InvalidRequest: a stage listed twice, no stages, or boundaries that drop,
                duplicate or overrun a layer (the message names the values).
        """
        if not self.stages:
            raise InvalidRequest(f"partition of epoch {self.epoch} has no stages")
        for what, values in (("stage", self.stage_ids), ("address", self.addresses)):
            repeated = sorted({v for v in values if values.count(v) > 1})
            if repeated:
                raise InvalidRequest(
                    f"{what} {repeated[0]!r} appears twice in the chain {list(values)}: "
                    "each stage can hold one range"
                )
        check_boundaries(self.boundaries, num_layers, self.num_stages)
        return self

    # ---- lookups -------------------------------------------------------------------

    def index_of(self, stage_id: str) -> int | None:
        """The chain position of a stage, or None if it holds no layers."""
        ids = self.stage_ids
        return ids.index(stage_id) if stage_id in ids else None

    def layers_of(self, index: int) -> range:
        """The layers chain position ``index`` owns."""
        return range(self.boundaries[index], self.boundaries[index + 1])

    def owner_of(self, layer: int) -> StageRef:
        """The stage owning ``layer``.

        Raises:
            InvalidRequest: no such layer.
        """
        if not 0 <= layer < self.num_layers:
            raise InvalidRequest(f"layer {layer} is outside the model (0..{self.num_layers - 1})")
        return self.stages[bisect.bisect_right(self._starts, layer) - 1]

    def assignment(self, stage_id: str, names: Sequence[str] = ()) -> Placement:
        """The placement of ``stage_id`` (an empty range if it is not in the chain);
        ``names``: the chain's registered names, in chain order."""
        s = self.index_of(stage_id)
        if s is None:
            return Placement(epoch=self.epoch, index=0, num_stages=0, lo=0, hi=0)
        return Placement(
            epoch=self.epoch,
            index=s,
            num_stages=self.num_stages,
            lo=self.boundaries[s],
            hi=self.boundaries[s + 1],
            prev=self.stages[s - 1].address if s > 0 else "",
            next=self.stages[s + 1].address if s + 1 < self.num_stages else "",
            chain=self.stages,
            names=tuple(names),
            ranges=tuple(
                (self.boundaries[i], self.boundaries[i + 1]) for i in range(self.num_stages)
            ),
        )

    def assignments(self, names: Sequence[str] = ()) -> dict[str, stage_pb2.Assignment]:
        """Every chain stage's assignment in wire form (as ``assignment(id).to_proto()``), by
        stage id. The chain they all carry is built once and copied by protobuf: O(S)
        Python work for the S stages, not O(S) each."""
        if not self.stages:
            return {}
        template = self.assignment(self.stages[0].stage_id, names).to_proto()
        out: dict[str, stage_pb2.Assignment] = {}
        for s, ref in enumerate(self.stages):
            wire = stage_pb2.Assignment()
            wire.CopyFrom(template)
            wire.index = s
            wire.layer_lo, wire.layer_hi = self.boundaries[s], self.boundaries[s + 1]
            wire.prev.address = self.stages[s - 1].address if s > 0 else ""
            wire.next.address = self.stages[s + 1].address if s + 1 < self.num_stages else ""
            out.setdefault(ref.stage_id, wire)
        return out

    def moves_to(self, new: Partition) -> list[Move]:
        """The layers whose owner differs in ``new``, in layer order.

        Raises:
            InvalidRequest: ``new`` has another layer count.
        """
        if new.num_layers != self.num_layers:
            raise InvalidRequest(
                f"cannot move from {self.num_layers} layers to {new.num_layers} layers"
            )
        out = []
        for layer in range(self.num_layers):
            src, dst = self.owner_of(layer).stage_id, new.owner_of(layer).stage_id
            if src != dst:
                out.append(Move(layer, src, dst))
        return out

    def evolve(self, **changes: Any) -> Partition:
        """A copy with some fields changed."""
        return replace(self, **changes)

    # ---- wire and storage ----------------------------------------------------------

    def to_proto(self) -> coordinator_pb2.Partition:
        """The wire form."""
        return coordinator_pb2.Partition(
            epoch=self.epoch,
            job_id=self.job_id,
            boundaries=list(self.boundaries),
            stage_ids=list(self.stage_ids),
            addresses=list(self.addresses),
            predicted_step_s=self.predicted_step_s,
            restored_step=self.restored_step,
            restore_epoch=self.restore_epoch,
        )

    @classmethod
    def from_proto(cls, p: coordinator_pb2.Partition) -> Partition:
        """Parses the wire form (validate it where it matters).

        Raises:
            InvalidRequest: stage ids and addresses of different lengths.
        """
        if len(p.stage_ids) != len(p.addresses):
            raise InvalidRequest(
                f"partition of epoch {p.epoch} lists {len(p.stage_ids)} stage ids for "
                f"{len(p.addresses)} addresses"
            )
        return cls(
            epoch=p.epoch,
            job_id=p.job_id,
            boundaries=tuple(p.boundaries),
            stages=tuple(StageRef(i, a) for i, a in zip(p.stage_ids, p.addresses, strict=True)),
            predicted_step_s=p.predicted_step_s if p.HasField("predicted_step_s") else None,
            restored_step=p.restored_step,
            restore_epoch=p.restore_epoch,
        )

    def to_json(self) -> dict[str, Any]:
        """A JSON-able form (the coordinator's store)."""
        return {
            "epoch": self.epoch,
            "job_id": self.job_id,
            "boundaries": list(self.boundaries),
            "stages": [[s.stage_id, s.address] for s in self.stages],
            "predicted_step_s": self.predicted_step_s,
            "restored_step": self.restored_step,
            "restore_epoch": self.restore_epoch,
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Partition:
        """Parses ``to_json``'s form."""
        return cls(
            epoch=int(raw["epoch"]),
            job_id=str(raw["job_id"]),
            boundaries=tuple(raw["boundaries"]),
            stages=tuple(StageRef(str(a), str(b)) for a, b in raw["stages"]),
            # 0 stood for "unknown" in states written before None did.
            predicted_step_s=float(raw["predicted_step_s"])
            if raw.get("predicted_step_s")
            else None,
            restored_step=int(raw.get("restored_step", 0)),
            restore_epoch=int(raw.get("restore_epoch", 0)),
        )
