"""The layout: a job's replicas (pipelines, each a chain holding every layer), their
partitions in one epoch, and each replica's share of the step's micro-batches.

One epoch covers the whole layout, because which stages reduce which layers' gradients
together depends on every replica's boundaries. Worked example, 5 layers, 2 replicas,
M = 8 micro-batches split 5:3::

    replica 0: boundaries (0, 2, 5),    stages (a, b)      share: micro-batches 0-4
    replica 1: boundaries (0, 1, 3, 5), stages (c, d, e)   share: micro-batches 5-7

    layer      0     1     2     3     4
    holders  (a,c) (a,d) (b,d) (b,e) (b,e)
    groups   [0,1) [1,2) [2,3) [3,5)          (``groups``: one per run of equal holders)

A group's layers reduce together among its holders: they change only at the union of the
replicas' boundaries, so there are at most ``sum(S_r - 1) + 1`` groups. With one replica the
layout is its partition: each stage is a group of one holder, and nothing is reduced.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from elasticpipe.errors import InvalidRequest
from elasticpipe.partition import Group, Partition, Placement, StageRef
from elasticpipe.v1 import coordinator_pb2, stage_pb2

__all__ = ["Group", "Layout"]  # (Group lives in partition: a Placement carries it)


@dataclass(frozen=True)
class Layout:
    """A job's replicas in one epoch and their shares of the micro-batches.

    Attributes:
        replicas: each replica's partition, all of one epoch and job, on distinct stages.
        shares: how many of the step's micro-batches each replica runs, in replica order;
            replica ``r`` runs the contiguous range ``share_of(r)``.
    """

    replicas: tuple[Partition, ...]
    shares: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "replicas", tuple(self.replicas))
        object.__setattr__(self, "shares", tuple(int(m) for m in self.shares))

    @classmethod
    def single(cls, partition: Partition, micro_batches: int) -> Layout:
        """Today's job: one replica running every micro-batch."""
        return cls((partition,), (micro_batches,))

    # ---- shape ---------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch of every replica's partition."""
        return self.replicas[0].epoch

    @property
    def num_layers(self) -> int:
        """Layers of the model (every replica holds them all)."""
        return self.replicas[0].num_layers

    @property
    def micro_batches(self) -> int:
        """The step's global micro-batch count ``M``."""
        return sum(self.shares)

    @property
    def stage_ids(self) -> tuple[str, ...]:
        """Every replica's stage ids, replica after replica, each in chain order."""
        return tuple(sid for p in self.replicas for sid in p.stage_ids)

    @property
    def addresses(self) -> tuple[str, ...]:
        """Every replica's stage addresses, in ``stage_ids`` order."""
        return tuple(a for p in self.replicas for a in p.addresses)

    def validate(self, num_layers: int | None = None, micro_batches: int | None = None) -> Layout:
        """Checks that every replica is a valid partition of the same model, epoch and job,
        that no stage serves two replicas, and that the shares cover the micro-batches.

        Returns:
            The layout itself, for chaining.

        Raises:
            InvalidRequest: naming the replica, stage or shares at fault.
        """
        if not self.replicas:
            raise InvalidRequest("a layout needs at least one replica")
        first = self.replicas[0]
        layers = first.num_layers if num_layers is None else num_layers
        for r, partition in enumerate(self.replicas):
            if (partition.epoch, partition.job_id) != (first.epoch, first.job_id):
                raise InvalidRequest(
                    f"replica {r} is of epoch {partition.epoch} of job {partition.job_id!r}, "
                    f"replica 0 of epoch {first.epoch} of job {first.job_id!r}: one layout "
                    "is one epoch"
                )
            try:
                partition.validate(layers)
            except InvalidRequest as exc:
                raise InvalidRequest(f"replica {r}: {exc}") from None
        seen: dict[str, int] = {}
        for r, partition in enumerate(self.replicas):
            for what, values in (("stage", partition.stage_ids), ("address", partition.addresses)):
                for value in values:
                    other = seen.setdefault(f"{what} {value!r}", r)
                    if other != r:
                        raise InvalidRequest(
                            f"{what} {value!r} serves replicas {other} and {r}: a stage "
                            "belongs to one replica"
                        )
        if len(self.shares) != len(self.replicas) or any(m < 0 for m in self.shares):
            raise InvalidRequest(
                f"shares {list(self.shares)} must be {len(self.replicas)} counts >= 0, one "
                "per replica"
            )
        want = self.micro_batches if micro_batches is None else micro_batches
        if self.micro_batches != want or want < 1:
            raise InvalidRequest(
                f"shares {list(self.shares)} add up to {self.micro_batches}, not the "
                f"{want} micro-batches of a step (at least 1)"
            )
        return self

    # ---- lookups -------------------------------------------------------------------

    def share_of(self, replica: int) -> range:
        """The global micro-batch ids replica ``replica`` runs."""
        lo = sum(self.shares[:replica])
        return range(lo, lo + self.shares[replica])

    def replica_of_stage(self, stage_id: str) -> int | None:
        """The replica a stage serves, or None if it serves none."""
        for r, partition in enumerate(self.replicas):
            if partition.index_of(stage_id) is not None:
                return r
        return None

    def holders(self, layer: int) -> tuple[StageRef, ...]:
        """The stage holding ``layer`` in each replica, in replica order.

        Raises:
            InvalidRequest: no such layer.
        """
        return tuple(partition.owner_of(layer) for partition in self.replicas)

    def groups(self) -> tuple[Group, ...]:
        """The reduction groups: maximal runs of layers with the same holders, in layer
        order (a pure function of the layout; see the module's example)."""
        cuts = sorted({b for p in self.replicas for b in p.boundaries})
        groups: list[Group] = []
        for lo, hi in itertools.pairwise(cuts):
            holders = self.holders(lo)
            if groups and groups[-1].holders == holders:
                groups[-1] = Group(len(groups) - 1, groups[-1].lo, hi, holders)
            else:
                groups.append(Group(len(groups), lo, hi, holders))
        return tuple(groups)

    def groups_of(self, stage_id: str) -> tuple[Group, ...]:
        """The groups a stage holds layers of (none if it serves no replica)."""
        return tuple(g for g in self.groups() if any(h.stage_id == stage_id for h in g.holders))

    def assignment(self, stage_id: str, names: Sequence[str] = ()) -> Placement:
        """The placement of ``stage_id``: its place in its replica's chain, the replica,
        and the groups it reduces with the other replicas (an empty range if it serves
        none); ``names``: its chain's registered names, in chain order.

        Raises:
            InvalidRequest: the stage serves no replica (naming it).
        """
        r = self.replica_of_stage(stage_id)
        if r is None:
            raise InvalidRequest(f"stage {stage_id!r} serves no replica of epoch {self.epoch}")
        placement = self.replicas[r].assignment(stage_id, names)
        if len(self.replicas) == 1:
            return placement
        return replace(
            placement, replica=r, num_replicas=len(self.replicas), groups=self.groups_of(stage_id)
        )

    def assignments(
        self, names: Callable[[Sequence[str]], Sequence[str]]
    ) -> dict[str, stage_pb2.Assignment]:
        """Every stage's assignment in wire form, by stage id (``names``: a chain's
        registered names from its stage ids, for the chain each stage is placed in)."""
        wire: dict[str, stage_pb2.Assignment] = {}
        for chain in self.replicas:
            chain_names = names(chain.stage_ids)
            for ref in chain.stages:
                wire[ref.stage_id] = self.assignment(ref.stage_id, chain_names).to_proto()
        return wire

    # ---- forms -----------------------------------------------------------------------

    def to_proto(self) -> coordinator_pb2.Partition:
        """The wire form: replica 0's partition, with every replica and the shares (one
        replica: just its partition)."""
        message = self.replicas[0].to_proto()
        if len(self.replicas) > 1:
            message.replicas.extend(p.to_proto() for p in self.replicas)
            message.shares.extend(self.shares)
        return message

    @classmethod
    def from_proto(cls, message: coordinator_pb2.Partition, micro_batches: int) -> Layout:
        """Parses ``to_proto``'s form; one partition is a layout of one replica running
        all ``micro_batches``.

        Raises:
            InvalidRequest: the replicas are not one valid layout (named).
        """
        if not message.replicas:
            return cls.single(Partition.from_proto(message), micro_batches)
        return cls(
            tuple(Partition.from_proto(p) for p in message.replicas), tuple(message.shares)
        ).validate(micro_batches=micro_batches)

    def to_json(self) -> dict[str, Any]:
        """A JSON-able form (the coordinator's store)."""
        return {
            "replicas": [p.to_json() for p in self.replicas],
            "shares": list(self.shares),
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Layout:
        """Parses ``to_json``'s form."""
        return cls(
            replicas=tuple(Partition.from_json(p) for p in raw["replicas"]),
            shares=tuple(int(m) for m in raw["shares"]),
        )
