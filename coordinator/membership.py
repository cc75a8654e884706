"""Who is in the cluster: registered stages, their heartbeats, liveness and measurements."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from elasticpipe.coordinator.estimates import Timing
from elasticpipe.coordinator.store import StageRow, Store


@dataclass
class Member:
    """A registered stage and what its last heartbeat said."""

    row: StageRow
    last_seen: float | None = None  # monotonic time of the last heartbeat; None: not yet
    last_seen_unix: float = 0.0
    timings: dict[int, Timing] = field(default_factory=dict)
    epoch: int = 0
    committed_step: int = 0
    slowdown: float = 1.0
    speed: float | None = None  # last live estimate


class Membership:
    """Registered stages (persisted) and their liveness (in memory)."""

    def __init__(
        self, store: Store, dead_after_s: float = 5.0, clock: Callable[[], float] = time.monotonic
    ):
        self._store = store
        self._dead_after = dead_after_s
        self._clock = clock
        self._lock = threading.Lock()
        self._members = {row.stage_id: Member(row) for row in store.stages()}

    def register(self, name: str, address: str, device: str) -> str:
        """Adds a stage, or updates the one of the same name; returns its stable id."""
        with self._lock:
            existing = next((m for m in self._members.values() if m.row.name == name), None)
            stage_id = existing.row.stage_id if existing else f"st-{uuid.uuid4().hex[:8]}"
            row = StageRow(
                stage_id=stage_id,
                name=name,
                address=address,
                device=device,
                registered_at=existing.row.registered_at if existing else time.time(),
                drained=existing.row.drained if existing else False,
            )
            self._store.upsert_stage(row)
            member = Member(row)
            member.last_seen, member.last_seen_unix = self._clock(), time.time()
            self._members[stage_id] = member
            return stage_id

    def heartbeat(
        self,
        stage_id: str,
        epoch: int,
        timings: dict[int, Timing],
        committed_step: int,
        slowdown: float,
    ) -> bool:
        """Records a heartbeat; False if the id is unknown (the stage must re-register)."""
        with self._lock:
            member = self._members.get(stage_id)
            if member is None:
                return False
            member.last_seen, member.last_seen_unix = self._clock(), time.time()
            member.epoch, member.committed_step, member.slowdown = epoch, committed_step, slowdown
            member.timings = timings
            return True

    def alive(self, member: Member) -> bool:
        """Whether the stage has been heard from recently."""
        return member.last_seen is not None and self._clock() - member.last_seen < self._dead_after

    def members(self) -> list[Member]:
        """Every registered stage in registration order."""
        with self._lock:
            return sorted(self._members.values(), key=lambda m: (m.row.registered_at, m.row.name))

    def find(self, key: str) -> Member | None:
        """A stage by id, name or address."""
        with self._lock:
            for member in self._members.values():
                if key in (member.row.stage_id, member.row.name, member.row.address):
                    return member
        return None

    def by_id(self, stage_id: str) -> Member | None:
        """A stage by id."""
        with self._lock:
            return self._members.get(stage_id)

    def set_drained(self, stage_id: str, drained: bool) -> None:
        """Keeps a stage out of (or lets it back into) future partitions."""
        with self._lock:
            member = self._members[stage_id]
            member.row = StageRow(**{**vars(member.row), "drained": drained})
            self._store.set_drained(stage_id, drained)
