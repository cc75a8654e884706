"""The store interface: everything the coordinator persists, with one meaning per backend.

Two implementations: ``SqliteStore`` (one embedded file, the default) and ``EtcdStore`` (an
etcd v3 cluster). Both keep the same four things:

- **stage incarnations** (``add_stage``, ``set_stage``, ``stages``, ``max_incarnation``);
- **named JSON values** (``put``, ``get``, ``delete``): the job, the client's lease and
  generation, the policy switch, the profile, the epoch change in flight, a job failure;
- **the partition** (``put_partition``, ``partition``), changed only through
- **the commit point** of an epoch change (``commit_change``): the new partition, the
  change's "committed" record and its history row, all or nothing (one SQLite transaction,
  one etcd transaction);
- **the epoch history** (``add_epoch``, ``epochs``, ``set_loop_pause``, ``max_epoch``).

Epoch numbers and client generations derive from what is stored (``reserve_epoch``,
``next_client``), so a coordinator that reloads a store goes on from where it stopped.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from elasticpipe.coordinator.store.rows import EpochRow, StageRow
from elasticpipe.partition import Partition

STAGE_FLAGS = ("drained", "dead", "forgotten", "leaving", "left")


class Store(ABC):
    """The coordinator's durable state (thread-safe in every implementation)."""

    @abstractmethod
    def close(self) -> None:
        """Releases the file or the connections."""

    # ---- stages --------------------------------------------------------------------

    @abstractmethod
    def add_stage(self, row: StageRow) -> None:
        """Records a new incarnation (its id, and its name with its number, are new).

        Raises:
            ValueError: the stage id, or the name with that incarnation number, exists
                (nothing was written).
        """

    @abstractmethod
    def set_stage(self, stage_id: str, **flags: bool) -> None:
        """Sets ``drained``, ``leaving``, ``left``, ``dead`` or ``forgotten`` of an
        incarnation."""

    @abstractmethod
    def stages(self) -> list[StageRow]:
        """Every incarnation not forgotten, in registration order."""

    @abstractmethod
    def max_incarnation(self, name: str) -> int:
        """The latest incarnation number of a stage name (0: never registered)."""

    # ---- named values ------------------------------------------------------------------

    @abstractmethod
    def put(self, key: str, value: Any) -> None:
        """Stores a JSON-able value."""

    @abstractmethod
    def get(self, key: str) -> Any:
        """A stored value, or None."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Removes a stored value."""

    @abstractmethod
    def commit_change(
        self, partition: Partition, change: dict[str, Any], row: EpochRow | None = None
    ) -> None:
        """The commit point of an epoch change: the new partition, the change's
        "committed" record and its history row, written in one transaction; with them the
        record's ``layout`` under the key ``layout`` (a job of several replicas), or that
        key deleted."""

    # ---- history -----------------------------------------------------------------------

    @abstractmethod
    def add_epoch(self, row: EpochRow) -> None:
        """Records an epoch change (a row rewritten keeps the loop pause it had)."""

    @abstractmethod
    def set_loop_pause(self, job_id: str, epoch: int, pause_s: float) -> bool:
        """Records what ``job_id``'s training loop lost to the change to ``epoch``; False
        (and nothing written) if that epoch is no change of that job, or already says so."""

    @abstractmethod
    def epochs(self, limit: int = 100, job_id: str | None = None) -> list[EpochRow]:
        """The most recent epoch records (of one job, if given), oldest first."""

    @abstractmethod
    def max_epoch(self) -> int:
        """The highest epoch ever used (epochs never repeat, across jobs too)."""

    # ---- derived -----------------------------------------------------------------------

    def put_partition(self, partition: Partition) -> None:
        """Makes ``partition`` the durable current partition."""
        self.put("partition", partition.to_json())

    def partition(self) -> Partition | None:
        """The current partition, if any."""
        raw = self.get("partition")
        return None if raw is None else Partition.from_json(raw)

    def reserve_epoch(self) -> int:
        """A fresh epoch number, never handed out again (even if its change is abandoned,
        so that a late message of an abandoned attempt can never match a new one)."""
        epoch = self.max_epoch() + 1
        self.put("epoch_attempted", epoch)
        return epoch

    def next_client(self) -> int:
        """A fresh client generation (fences every earlier client)."""
        generation = int(self.get("client_generation") or 0) + 1
        self.put("client_generation", generation)
        return generation
