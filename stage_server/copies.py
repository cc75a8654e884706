"""A stage's snapshots of its own layers, and the copies it keeps of its peers'.

Every ``snapshot_every`` committed steps a stage clones its layers' committed state
(``_capture``, the machine's ``SNAPSHOT`` effect) and its ``Snapshotter`` pushes a copy to the
chain's next stage (``_push_copy``); the peer checks and keeps it (``check_copy_source``,
``keep_copy``). Recovery restores lost layers from these copies (``epochs``).

``SnapshotCopies`` is a base class of ``Stage``, whose lock, job and placement it shares.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from elasticpipe.errors import NotReady
from elasticpipe.partition import Placement
from elasticpipe.stage_server import transfers
from elasticpipe.stage_server.callers import check_source
from elasticpipe.stage_server.config import StageConfig
from elasticpipe.stage_server.deferral import Deferral
from elasticpipe.stage_server.layers import LayerSlice
from elasticpipe.stage_server.snapshots import (
    Capture,
    Holding,
    SnapshotStore,
    Snapshotter,
    check_copy,
    check_layers,
)
from elasticpipe.training.job import JobConfig
from elasticpipe.transport import rpc
from elasticpipe.wire.layer_state import PackedLayer

__all__ = ["SnapshotCopies"]

SNAPSHOT_PUSH_TIMEOUT_S = 120.0


class SnapshotCopies:
    """Snapshots taken here and copies kept here: a base class of ``Stage``."""

    # The stage's, set in ``Stage.__init__`` and shared under ``_cond``.
    config: StageConfig
    snapshots: SnapshotStore
    stage_id: str
    job: JobConfig | None
    slice: LayerSlice | None
    placement: Placement | None
    _cond: Deferral
    _peers: rpc.StagePool
    _snapshotter: Snapshotter

    def _capture(self, step: int) -> None:
        """Clones the committed state of every owned layer and queues it (lock held)."""
        if self.slice is None or self.job is None or self.placement is None:
            return
        if not self.placement.in_chain or not self.job.snapshot_every:
            return
        states = {i: self.slice.snapshot_layer(i) for i in self.slice.indices}
        self._snapshotter.submit(
            Capture(
                job_id=self.job.job_id,
                step=step,
                source=self.stage_id,
                states=states,
                peer=self.placement.snapshot_peer,
                generation=self.snapshots.generation,
                epoch=self.placement.epoch,
            )
        )

    def _push_copy(
        self,
        peer: str,
        capture: Capture,
        blobs: Sequence[tuple[int, PackedLayer]],
        superseded: Callable[[], bool],
    ) -> bool:
        return transfers.push_snapshot(
            self._peers,
            peer,
            capture,
            blobs,
            SNAPSHOT_PUSH_TIMEOUT_S,
            self.config.transfer_chunk_bytes,
            superseded,
        )

    def check_copy_source(self, job_id: str, source: str) -> range:
        """Checks, before any layer arrives, that a pushed copy is of this job and from a
        stage of the chain (with TLS: the caller); returns the layers it may hold."""
        with self._cond:
            self._check_copy(job_id, source)
            return check_source(source, self.placement)

    def keep_copy(
        self, job_id: str, step: int, source: str, blobs: dict[int, PackedLayer], generation: int
    ) -> None:
        """Keeps a peer's snapshot copy (it must be of this job, from this chain, and not
        voided by a prune since ``generation``, taken when it began arriving)."""
        with self._cond:
            self._check_copy(job_id, source)
        check_layers(blobs, source, step)
        if not self.snapshots.add_copy(source, job_id, step, blobs, generation):
            raise NotReady(
                f"snapshot copy of step {step} from {source!r} arrived across a reset of "
                f"stage {self.config.name}'s snapshots: send it again"
            )

    def _check_copy(self, job_id: str, source: str) -> None:
        """``snapshots.check_copy`` against this stage's job and chain (lock held)."""
        chain = tuple(s.stage_id for s in self.placement.chain) if self.placement else ()
        check_copy(job_id, self.job.job_id if self.job else "", source, chain)

    def holdings(self) -> list[Holding]:
        """The complete snapshots held here."""
        return self.snapshots.holdings()

    def keep_from(self, safe_step: int) -> None:
        """Snapshots of ``safe_step`` and later stay (the coordinator's newest safe step)."""
        self.snapshots.keep_from(safe_step)
