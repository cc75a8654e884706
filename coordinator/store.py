"""The coordinator's durable state in an embedded SQLite file: stages, job, partition, history.

A restarted coordinator reloads all of it, so stages keep their ids (their heartbeats go
on without re-registering), and the job, the partition with its epoch, and the epoch
history survive. ``:memory:`` keeps everything in memory (tests).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS stages (
    stage_id TEXT PRIMARY KEY,
    name TEXT UNIQUE NOT NULL,
    address TEXT NOT NULL,
    device TEXT NOT NULL,
    registered_at REAL NOT NULL,
    drained INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS epochs (
    epoch INTEGER PRIMARY KEY,
    at REAL NOT NULL,
    record TEXT NOT NULL
);
"""


@dataclass(frozen=True)
class StageRow:
    """A registered stage as stored."""

    stage_id: str
    name: str
    address: str
    device: str
    registered_at: float
    drained: bool = False


@dataclass(frozen=True)
class PartitionRow:
    """One partition epoch: which stages, in which order, own which layers."""

    epoch: int
    job_id: str
    boundaries: tuple[int, ...]
    stage_ids: tuple[str, ...]
    addresses: tuple[str, ...]
    predicted_step_s: float = 0.0


@dataclass(frozen=True)
class EpochRow:
    """Why and how the partition changed to an epoch."""

    epoch: int
    at: float
    reason: str
    boundaries: tuple[int, ...]
    stage_ids: tuple[str, ...] = ()
    layers_moved: int = 0
    bytes_moved: int = 0
    pause_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


class Store:
    """Thread-safe access to the SQLite file."""

    def __init__(self, path: str = ":memory:"):
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute(
            "PRAGMA journal_mode=WAL" if path != ":memory:" else "PRAGMA foreign_keys=ON"
        )
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        """Closes the file."""
        with self._lock:
            self._db.close()

    # ---- stages --------------------------------------------------------------------

    def upsert_stage(self, row: StageRow) -> None:
        """Adds a stage or updates its address and device (same name = same host)."""
        with self._lock:
            self._db.execute(
                "INSERT INTO stages (stage_id, name, address, device, registered_at, drained) "
                "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT(name) DO UPDATE SET "
                "address=excluded.address, device=excluded.device",
                (
                    row.stage_id,
                    row.name,
                    row.address,
                    row.device,
                    row.registered_at,
                    int(row.drained),
                ),
            )

    def set_drained(self, stage_id: str, drained: bool) -> None:
        """Marks a stage as drained (kept out of partitions) or not."""
        with self._lock:
            self._db.execute(
                "UPDATE stages SET drained=? WHERE stage_id=?", (int(drained), stage_id)
            )

    def stages(self) -> list[StageRow]:
        """Every registered stage, in registration order."""
        with self._lock:
            rows = self._db.execute(
                "SELECT stage_id, name, address, device, registered_at, drained FROM stages "
                "ORDER BY registered_at, name"
            ).fetchall()
        return [StageRow(r[0], r[1], r[2], r[3], r[4], bool(r[5])) for r in rows]

    # ---- job, partition, estimates -----------------------------------------------------

    def put(self, key: str, value: Any) -> None:
        """Stores a JSON-able value."""
        with self._lock:
            self._db.execute(
                "INSERT INTO kv (key, value) VALUES (?, ?) "
                "ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                (key, json.dumps(value)),
            )

    def get(self, key: str) -> Any:
        """A stored value, or None."""
        with self._lock:
            row = self._db.execute("SELECT value FROM kv WHERE key=?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    def put_partition(self, partition: PartitionRow) -> None:
        """Makes ``partition`` the durable current partition (the commit point of a move)."""
        self.put("partition", asdict(partition))

    def partition(self) -> PartitionRow | None:
        """The current partition, if any."""
        raw = self.get("partition")
        if raw is None:
            return None
        return PartitionRow(
            epoch=raw["epoch"],
            job_id=raw["job_id"],
            boundaries=tuple(raw["boundaries"]),
            stage_ids=tuple(raw["stage_ids"]),
            addresses=tuple(raw["addresses"]),
            predicted_step_s=raw.get("predicted_step_s", 0.0),
        )

    # ---- history -----------------------------------------------------------------------

    def add_epoch(self, row: EpochRow) -> None:
        """Records an epoch change."""
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO epochs (epoch, at, record) VALUES (?, ?, ?)",
                (row.epoch, row.at or time.time(), json.dumps(asdict(row))),
            )

    def epochs(self, limit: int = 100) -> list[EpochRow]:
        """The most recent epoch changes, oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT record FROM epochs ORDER BY epoch DESC LIMIT ?", (limit,)
            ).fetchall()
        out = []
        for (record,) in reversed(rows):
            raw = json.loads(record)
            raw["boundaries"] = tuple(raw["boundaries"])
            raw["stage_ids"] = tuple(raw.get("stage_ids", ()))
            out.append(EpochRow(**raw))
        return out

    def max_epoch(self) -> int:
        """The highest epoch ever used (epochs never repeat, across jobs too)."""
        with self._lock:
            row = self._db.execute("SELECT MAX(epoch) FROM epochs").fetchone()
        stored = self.partition()
        attempted = self.get("epoch_attempted") or 0
        return max(row[0] or 0, stored.epoch if stored else 0, attempted)

    def reserve_epoch(self) -> int:
        """A fresh epoch number, never handed out again (even if its change is abandoned,
        so that a late message of an abandoned attempt can never match a new one)."""
        epoch = self.max_epoch() + 1
        self.put("epoch_attempted", epoch)
        return epoch
