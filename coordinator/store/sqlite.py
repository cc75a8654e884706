"""The coordinator's durable state in an embedded SQLite file (``--store sqlite:PATH``).

One host's default: stages, job, partition and history in one WAL-mode file, which a
restarted coordinator on the same host reloads. ``:memory:`` keeps everything in memory
(tests).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import asdict, replace
from typing import Any

from elasticpipe.coordinator.store.base import STAGE_FLAGS, Store
from elasticpipe.coordinator.store.rows import EpochRow, StageRow, latest_epochs
from elasticpipe.partition import Partition

_SCHEMA = """
CREATE TABLE IF NOT EXISTS incarnations (
    stage_id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    incarnation INTEGER NOT NULL,
    address TEXT NOT NULL,
    device TEXT NOT NULL,
    registered_at REAL NOT NULL,
    drained INTEGER NOT NULL DEFAULT 0,
    leaving INTEGER NOT NULL DEFAULT 0,
    left_cleanly INTEGER NOT NULL DEFAULT 0,
    dead INTEGER NOT NULL DEFAULT 0,
    forgotten INTEGER NOT NULL DEFAULT 0,
    UNIQUE (name, incarnation)
);
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS epochs (
    epoch INTEGER PRIMARY KEY,
    at REAL NOT NULL,
    record TEXT NOT NULL
);
"""


class SqliteStore(Store):
    """Thread-safe access to the SQLite file."""

    def __init__(self, path: str = ":memory:"):
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute(
            "PRAGMA journal_mode=WAL" if path != ":memory:" else "PRAGMA foreign_keys=ON"
        )
        self._db.executescript(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(incarnations)")}
        for column in ("leaving", "left_cleanly"):  # a state file from before the column
            if column not in columns:
                self._db.execute(
                    f"ALTER TABLE incarnations ADD COLUMN {column} INTEGER NOT NULL DEFAULT 0"
                )

    def close(self) -> None:
        """Closes the file."""
        with self._lock:
            self._db.close()

    # ---- stages --------------------------------------------------------------------

    def add_stage(self, row: StageRow) -> None:
        """Records a new incarnation (the same row again, a write retried: no change)."""
        with self._lock:
            if self._db.execute(
                "SELECT 1 FROM incarnations WHERE stage_id = ?", (row.stage_id,)
            ).fetchone():
                if row in self._stage_rows("stage_id = ? AND forgotten = 0", (row.stage_id,)):
                    return
                raise ValueError(f"stage id {row.stage_id!r} exists")
            if self._db.execute(
                "SELECT 1 FROM incarnations WHERE name = ? AND incarnation = ?",
                (row.name, row.incarnation),
            ).fetchone():
                raise ValueError(f"stage {row.name!r} incarnation {row.incarnation} exists")
            self._db.execute(
                "INSERT INTO incarnations (stage_id, name, incarnation, address, device, "
                "registered_at, drained, dead, leaving, left_cleanly) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    row.stage_id,
                    row.name,
                    row.incarnation,
                    row.address,
                    row.device,
                    row.registered_at,
                    int(row.drained),
                    int(row.dead),
                    int(row.leaving),
                    int(row.left),
                ),
            )

    def set_stage(self, stage_id: str, **flags: bool) -> None:
        """Sets ``drained``, ``leaving``, ``left``, ``dead`` or ``forgotten`` of an
        incarnation."""
        for name, value in flags.items():
            if name not in STAGE_FLAGS:
                raise ValueError(f"unknown stage flag {name!r}")
            column = "left_cleanly" if name == "left" else name  # LEFT is an SQL keyword
            with self._lock:
                self._db.execute(
                    f"UPDATE incarnations SET {column}=? WHERE stage_id=?",
                    (int(value), stage_id),
                )

    def stages(self) -> list[StageRow]:
        """Every incarnation not forgotten, in registration order."""
        with self._lock:
            return self._stage_rows("forgotten = 0", ())

    def _stage_rows(self, where: str, args: tuple[Any, ...]) -> list[StageRow]:
        """The incarnations ``where`` says, in registration order (call under the lock)."""
        rows = self._db.execute(
            "SELECT stage_id, name, address, device, registered_at, drained, incarnation, "
            f"dead, leaving, left_cleanly FROM incarnations WHERE {where} "
            "ORDER BY registered_at, name",
            args,
        ).fetchall()
        return [
            StageRow(
                r[0],
                r[1],
                r[2],
                r[3],
                r[4],
                bool(r[5]),
                int(r[6]),
                bool(r[7]),
                bool(r[8]),
                bool(r[9]),
            )
            for r in rows
        ]

    def max_incarnation(self, name: str) -> int:
        """The latest incarnation number of a stage name (0: never registered)."""
        with self._lock:
            row = self._db.execute(
                "SELECT MAX(incarnation) FROM incarnations WHERE name=?", (name,)
            ).fetchone()
        return int(row[0] or 0)

    # ---- job, partition, estimates -----------------------------------------------------

    def put(self, key: str, value: Any) -> None:
        """Stores a JSON-able value."""
        with self._lock:
            self._put(key, value)

    def _put(self, key: str, value: Any) -> None:
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

    def delete(self, key: str) -> None:
        """Removes a stored value."""
        with self._lock:
            self._db.execute("DELETE FROM kv WHERE key=?", (key,))

    def commit_change(
        self, partition: Partition, change: dict[str, Any], row: EpochRow | None = None
    ) -> None:
        """The commit point of an epoch change: the new partition, the change's
        "committed" record and its history row, written in one transaction."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._put("partition", partition.to_json())
                if change.get("layout"):  # a job of several replicas: all of them
                    self._put("layout", change["layout"])
                else:
                    self._db.execute("DELETE FROM kv WHERE key=?", ("layout",))
                self._put("epoch_change", {**change, "phase": "committed"})
                if row is not None:
                    self._add_epoch(row)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    # ---- history -----------------------------------------------------------------------

    def add_epoch(self, row: EpochRow) -> None:
        """Records an epoch change."""
        with self._lock:
            self._add_epoch(row)

    def _epoch_record(self, epoch: int) -> dict[str, Any] | None:
        """The stored record of ``epoch`` as written (a dict), or None."""
        found = self._db.execute("SELECT record FROM epochs WHERE epoch = ?", (epoch,)).fetchone()
        return None if found is None else dict(json.loads(found[0]))

    def _add_epoch(self, row: EpochRow) -> None:
        if not row.loop_pause_s:  # a row rewritten after its commit keeps what the loop saw
            old = self._epoch_record(row.epoch)
            if old is not None and old.get("loop_pause_s"):
                row = replace(row, loop_pause_s=old["loop_pause_s"])
        if not row.at:  # stamped when written, as on etcd
            row = replace(row, at=time.time())
        self._db.execute(
            "INSERT OR REPLACE INTO epochs (epoch, at, record) VALUES (?, ?, ?)",
            (row.epoch, row.at, json.dumps(asdict(row))),
        )

    def set_loop_pause(self, job_id: str, epoch: int, pause_s: float) -> bool:
        """Records what ``job_id``'s training loop lost to the change to ``epoch``; False
        (and nothing written) if that epoch is no change of that job, or already says so."""
        with self._lock:
            raw = self._epoch_record(epoch)
            if raw is None or raw.get("job_id", "") != job_id or raw.get("kind") == "abandoned":
                return False
            if raw.get("loop_pause_s") == pause_s:  # a renewal sent again: counted once
                return False
            raw["loop_pause_s"] = pause_s
            self._db.execute(
                "UPDATE epochs SET record = ? WHERE epoch = ?", (json.dumps(raw), epoch)
            )
            return True

    def epochs(self, limit: int = 100, job_id: str | None = None) -> list[EpochRow]:
        """The most recent epoch records (of one job, if given), oldest first."""
        with self._lock:
            rows = self._db.execute("SELECT record FROM epochs ORDER BY epoch DESC").fetchall()
        return latest_epochs((record for (record,) in rows), limit, job_id)

    def max_epoch(self) -> int:
        """The highest epoch ever used (epochs never repeat, across jobs too)."""
        with self._lock:
            row = self._db.execute("SELECT MAX(epoch) FROM epochs").fetchone()
        stored = self.partition()
        attempted = self.get("epoch_attempted") or 0
        return max(row[0] or 0, stored.epoch if stored else 0, attempted)
