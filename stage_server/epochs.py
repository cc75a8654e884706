"""A stage's side of the epoch change, and of a restore: freeze, prepare, commit or abort.

The coordinator drives the change (``coordinator/epochs.py``, the other end); here a stage

1. **freezes** at its step boundary (``freeze``), under the machine's lease;
2. **prepares** (``prepare_epoch``): gathers what it will own in the new epoch and holds it
   aside (``_Staged``) -- a migration pulls the incoming layers' live state from their owners,
   a rollback builds every owned layer from a snapshot (held here or pulled, ``_fetch``), a
   restore takes the layers a client streamed here beforehand (``check_restore``,
   ``stage_restored``);
3. **commits** (``commit_epoch``: the machine's ``INSTALL_STAGED`` effect runs ``_install``)
   or **aborts** (``abort_epoch``: what was staged is dropped, the old epoch stays in force).

``export_layers`` is the other side of a pull: it packs owned layers (or a snapshot held
here) for a peer or a client.

``EpochChanges`` is a base class of ``Stage``: its methods share the stage's lock, step
machine and layers, and carry out their effects through ``Stage._apply``.
"""

from __future__ import annotations

import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from elasticpipe.errors import DeadlineExceeded, InvalidRequest, NotReady, TransferError
from elasticpipe.logs import get_logger
from elasticpipe.partition import Placement
from elasticpipe.stage_server import reducing, transfers
from elasticpipe.stage_server.config import StageConfig
from elasticpipe.stage_server.deferral import Deferral
from elasticpipe.stage_server.faults import Faults
from elasticpipe.stage_server.layers import LayerSlice
from elasticpipe.stage_server.protocol import Effect, Phase, StepMachine
from elasticpipe.stage_server.slicestate import Built
from elasticpipe.stage_server.snapshots import SnapshotStore
from elasticpipe.training.job import JobConfig
from elasticpipe.transport import rpc
from elasticpipe.v1 import stage_pb2
from elasticpipe.wire import layer_state
from elasticpipe.wire.layer_state import IntoModule, PackedLayer, Received

__all__ = ["EpochChanges"]

log = get_logger(__name__)

EXTEND_MARGIN_S = 30.0

Layers = dict[int, Built]


@dataclass
class _Staged:
    """What an epoch change brought here, held aside until it commits."""

    epoch: int
    placement: Placement
    job: JobConfig
    layers: Layers
    new_slice: LayerSlice | None  # replaces the whole slice (joining, rollback, restore)
    loaded: bool = False  # a load's (the client streamed the layers)


class EpochChanges:
    """The epoch change and restore: a base class of ``Stage``, whose state it shares."""

    # The stage's, set in ``Stage.__init__`` and shared with the run path under ``_cond``.
    config: StageConfig
    machine: StepMachine
    faults: Faults
    snapshots: SnapshotStore
    job: JobConfig | None
    slice: LayerSlice | None
    placement: Placement | None
    _cond: Deferral
    _peers: rpc.StagePool
    _apply: Callable[[Iterable[Effect]], None]  # carries out the machine's effects
    _new_slice: Callable[[JobConfig], LayerSlice]
    _set_placement: Callable[[Placement], None]
    # The change's own state (None between changes).
    _staged: _Staged | None
    # A load in progress: its epoch, the layers built so far, and the bytes each came in.
    _restoring: tuple[int, Layers, dict[int, int]] | None
    # The job whose load (a restore epoch) committed here: its layers are never built anew.
    loaded_job: str | None = None
    # Layers built empty for a job's init_state (at Assign, or anew by a ``fresh``
    # rollback) that no load has written into yet: the first load's may (``restore_into``).
    _empty: weakref.WeakSet[nn.Module]

    def freeze(self, new_epoch: int, timeout: float, lease_s: float, abort_running: bool) -> int:
        """Waits for the step boundary (or ends the run in flight), then holds it."""
        with self._cond:
            if abort_running:
                self._apply(self.machine.preempt())
            if not self._cond.wait_for(lambda: self.machine.phase is Phase.IDLE, timeout):
                raise DeadlineExceeded(
                    f"stage {self.config.name} did not reach a step boundary within "
                    f"{timeout:.1f}s (run {self.machine.active_run} is "
                    f"{self.machine.phase.value})"
                )
            self._apply(self.machine.freeze(new_epoch, lease_s, time.monotonic()))
            return self.machine.committed_step

    def prepare_epoch(
        self,
        new_epoch: int,
        placement: Placement,
        job: JobConfig,
        incoming: Sequence[tuple[int, str]],
        committed_step: int,
        source_epoch: int,
        rollback: bool,
        restored_by_client: bool,
        lease_s: float,
        timeout: float,
        fresh: bool = False,
    ) -> tuple[int, float]:
        """Gathers what this stage will own in ``new_epoch`` and holds it aside.

        A migration pulls the incoming layers' live state from their owners (at
        ``source_epoch``); a rollback builds every owned layer from the snapshot of
        ``committed_step`` (held here or pulled from ``incoming``'s holders), or, ``fresh``,
        new and empty (Assign snapshots none of the empty layers awaiting init_state); a restore
        takes what ``RestoreLayers`` staged.

        Returns:
            Bytes received (for a restore: the bytes the client streamed here) and seconds
            spent.
        """
        with self._cond:
            # The transfers may outlast the freeze lease: hold it for as long as they may take.
            self.machine.extend(new_epoch, timeout + EXTEND_MARGIN_S, time.monotonic())
            same_job = self.job is not None and self.job.job_id == job.job_id
            if fresh:
                rolls_back = rollback and not restored_by_client
                self._check_fresh(new_epoch, job, committed_step, rolls_back, same_job)
            joining = not (same_job and self.placement is not None and self.placement.in_chain)
            keep = self.slice if same_job and not (rollback or restored_by_client) else None
            restoring = self._restoring
        started, received = time.perf_counter(), 0
        deadline = time.monotonic() + timeout
        new_slice = None if keep is not None else self._new_slice(job)
        target = keep if keep is not None else new_slice
        assert target is not None
        staged: Layers = {}
        if restored_by_client:
            if restoring is None or restoring[0] != new_epoch:
                raise NotReady(f"no checkpoint was streamed here for epoch {new_epoch}")
            staged = dict(restoring[1])
            received = sum(restoring[2].values())  # what the client streamed here
        elif fresh:
            staged = dict(target.fresh_layers(placement.lo, placement.hi, draw=False))
            with self._cond:
                self._empty.update(built.module for built in staged.values())
        else:
            sources = dict(incoming)
            wanted = list(placement.layers) if rollback else [layer for layer, _ in incoming]
            for layer in wanted:
                into = IntoModule(target.new_layer(layer), f"layer {layer}")
                state, size = self._fetch(
                    job,
                    layer,
                    sources.get(layer, ""),
                    source_epoch,
                    committed_step if rollback else None,
                    deadline,
                    into,
                )
                received += size
                if not isinstance(state, dict):
                    raise TransferError(f"layer {layer}: state is not a mapping")
                staged[layer] = target.load_layer(layer, state, into.module)
        owned = set(keep.layers if keep is not None else ()) | set(staged)
        missing = [i for i in placement.layers if i not in owned]
        if missing:
            raise NotReady(
                f"epoch {new_epoch} gives stage {self.config.name} layers "
                f"{missing} that it neither holds nor receives"
            )
        if placement.num_replicas > 1:  # (kept layers first: a staged one replaces one)
            kept = {i: keep.layers[i] for i in placement.layers if keep and i in keep.layers}
            reducing.refuse_running_stats(kept | {i: b.module for i, b in staged.items()})
        self.faults.point("prepare")
        with self._cond:
            self._apply(
                self.machine.prepared(
                    new_epoch,
                    committed_step,
                    time.monotonic(),
                    lease_s,
                    rollback=rollback or restored_by_client,
                    new_history=restored_by_client,
                    joining=joining,
                )
            )
            self._staged = _Staged(
                new_epoch, placement, job, staged, new_slice, loaded=restored_by_client
            )
        return received, time.perf_counter() - started

    def _check_fresh(
        self, epoch: int, job: JobConfig, step: int, rollback: bool, same_job: bool
    ) -> None:
        """Refuses to build layers anew (``fresh``) unless the change rolls back to step 0
        of a job whose weights are external and that this stage neither loaded nor
        committed a step of (lock held): layers with state are never replaced by empty ones.

        Raises:
            InvalidRequest: naming why.
        """
        done = self.machine.committed_step if same_job else 0
        if not (rollback and job.external_weights and step == 0):
            why = "it is not a rollback to step 0 of a job whose weights are external"
        elif done:
            why = f"this stage committed step {done} of the job"
        elif same_job and self.loaded_job == job.job_id:
            why = "this stage loaded the job's init_state"
        else:
            return
        raise InvalidRequest(
            f"epoch {epoch}: layers are built anew only at a rollback to step 0 of a job whose "
            f"weights (init_state) never loaded; {why}"
        )

    def _fetch(
        self,
        job: JobConfig,
        layer: int,
        source: str,
        source_epoch: int,
        snapshot_step: int | None,
        deadline: float,
        into: IntoModule,
    ) -> tuple[Any, int]:
        """One layer's state and its size: a copy of a snapshot held here, or pulled from
        ``source`` (its weights straight into ``into``'s module)."""
        if snapshot_step is not None:
            held = self.snapshots.get(job.job_id, snapshot_step, layer)
            if held is not None:
                return held.copy_into(into), held.nbytes
        if not source:
            raise TransferError(
                f"layer {layer}: no source given and no snapshot of step {snapshot_step} here"
            )
        request = (
            stage_pb2.ExportLayersRequest(
                layers=[layer],
                include_optimizer=True,
                from_snapshot=True,
                snapshot_step=snapshot_step,
                job_id=job.job_id,
            )
            if snapshot_step is not None
            else stage_pb2.ExportLayersRequest(
                epoch=source_epoch, layers=[layer], include_optimizer=True
            )
        )
        got = transfers.pull_layer(
            self._peers,
            source,
            request,
            deadline,
            (self.config.max_tensor_bytes, self.config.max_layer_bytes),
            into,
            self.faults.take_import_fault(),
        )
        return got.packed.unpack(), got.packed.nbytes

    def _install(self, epoch: int) -> None:
        """Installs what was staged for ``epoch`` (the lock is held)."""
        staged = self._staged
        assert staged is not None and staged.epoch == epoch
        if staged.new_slice is not None:
            self.job, self.slice = staged.job, staged.new_slice
        assert self.slice is not None
        for index, built in staged.layers.items():
            self.slice.drop(index)
            self.slice.install(index, built)
        for index in [i for i in self.slice.layers if i not in staged.placement.layers]:
            self.slice.drop(index)
        self._set_placement(staged.placement)
        self._staged, self._restoring = None, None
        log.info(
            "epoch_committed",
            epoch=epoch,
            lo=staged.placement.lo,
            hi=staged.placement.hi,
            received=sorted(staged.layers),
            step=self.machine.committed_step,
        )

    def commit_epoch(self, new_epoch: int) -> int:
        """Installs what was staged and switches epoch (idempotent)."""
        self.faults.point("epoch_commit")
        with self._cond:
            staged = self._staged
            every = staged.job.snapshot_every if staged is not None else None
            self._apply(self.machine.commit_epoch(new_epoch, every))
            if staged is not None and staged.loaded and self.machine.epoch == staged.epoch:
                self.loaded_job = staged.job.job_id
            return self.machine.epoch

    def abort_epoch(self, new_epoch: int) -> int:
        """Drops anything staged for ``new_epoch``; the current epoch stays in force."""
        with self._cond:
            self._apply(self.machine.abort_epoch(new_epoch))
            return self.machine.epoch

    # ---- layer state out and in ------------------------------------------------------

    def export_layers(
        self,
        epoch: int,
        layers: Sequence[int],
        include_optimizer: bool,
        snapshot: tuple[str, int] | None = None,
    ) -> Iterator[tuple[int, PackedLayer]]:
        """Packs the full state of owned layers (or of a snapshot held here), one at a time.

        Args:
            epoch: the epoch the caller computed in (0: no check, the client between steps).
            layers: which layers.
            include_optimizer: with optimizer state.
            snapshot: (job id, step) to export a snapshot held here instead.

        Raises:
            InvalidRequest: a layer asked for twice.
            NotReady: a layer not owned (or not held), or the state moved on meanwhile.
        """
        repeated = sorted(i for i, n in Counter(layers).items() if n > 1)
        if repeated:
            raise InvalidRequest(f"layers {repeated} asked for more than once")
        if snapshot is not None:
            job_id, step = snapshot
            for layer in layers:
                held = self.snapshots.get(job_id, step, layer)
                if held is None:
                    raise NotReady(
                        f"stage {self.config.name} holds no snapshot of layer {layer} at step "
                        f"{step} of job {job_id!r}"
                    )
                yield layer, held
            return
        with self._cond:
            if epoch and epoch != self.machine.epoch:
                self.machine.check_epoch(epoch)
            if self.slice is None:
                raise NotReady(f"stage {self.config.name} has no job assigned")
            missing = [i for i in layers if i not in self.slice.layers]
            if missing:
                raise NotReady(
                    f"stage {self.config.name} does not own layers {missing} "
                    f"(owns {self.slice.indices})"
                )
            at = (self.machine.epoch, self.machine.committed_step)
        for i in layers:  # one layer at a time, all of the same committed state
            with self._cond:
                if (self.machine.epoch, self.machine.committed_step) != at or self.slice is None:
                    raise NotReady(
                        f"stage {self.config.name} moved past epoch {at[0]}, step {at[1]} "
                        "during the export: export again"
                    )
                state = self.slice.export_layer(i, include_optimizer)
            yield i, layer_state.pack(state)

    def check_restore(self, epoch: int) -> LayerSlice:
        """Checks, before any layer arrives, that a load's epoch change holds this stage.

        Raises:
            NotReady: not frozen for ``epoch``, or no job.
        """
        with self._cond:
            self.machine.check_frozen(epoch)
            if self.slice is None or self.job is None:
                raise NotReady(f"stage {self.config.name} has no job assigned")
            return self._new_slice(self.job)

    def check_restored_layer(self, index: int) -> None:
        """Checks a checkpointed layer is this stage's, at its first chunk.

        Raises:
            NotReady: naming the layer and the layers owned.
        """
        with self._cond:
            owned = self.placement.layers if self.placement is not None else range(0)
        if index not in owned:
            raise NotReady(
                f"stage {self.config.name} does not own layer {index} (owns {list(owned)})"
            )

    def restore_into(self, index: int, builder: LayerSlice) -> IntoModule:
        """Where a checkpointed layer's tensors go, on its header (after
        ``check_restored_layer``), before any of it is allocated: a new layer of
        ``builder``'s, so that the layer in use stays as it is if the load fails. Except
        where that layer is one of the empty ones built for the job's ``init_state`` that
        no load has written into yet (``_empty``): nothing in it is worth keeping, and the
        load writes straight into its memory, mapped and zeroed when it was built, instead
        of into a second copy of the weights (for a GPT-2 small, 649 MB more at the load's
        peak, every page of it faulted in as the weights stream). Only the first load
        does: a later one (after that one failed) stages apart, so that a stale stream of
        the first, still writing, writes into no layer that trains."""
        with self._cond:
            live = self.slice.layers.get(index) if self.slice is not None else None
            mine = self.job is not None and builder.job.job_id == self.job.job_id
            if mine and live is not None and live in self._empty:
                self._empty.discard(live)  # the first load's: no other writes into it
                return IntoModule(live, f"layer {index}")
        return IntoModule(builder.new_layer(index), f"layer {index}")

    def stage_restored(
        self,
        epoch: int,
        got: Received,
        builder: LayerSlice,
        overrides: dict[str, Any] | None = None,
    ) -> None:
        """Builds one checkpointed layer and holds it for ``epoch``'s change (a load).

        Args:
            got: the layer as received (into ``restore_into``'s destination).
            overrides: optimizer hyper-parameters to set after loading its state (as in
                plain PyTorch: load the state, then set the ``lr``).

        Raises:
            NotReady: the change was abandoned.
            InvalidRequest: the state does not fit the layer, or an override names a
                hyper-parameter the optimizer does not have.
        """
        index = got.layer
        state = got.packed.unpack()
        if not isinstance(state, dict) or not isinstance(got.destination, IntoModule):
            raise InvalidRequest(f"checkpoint state of layer {index} is not a mapping")
        built = builder.load_layer(index, state, got.destination.module)
        if overrides and built.optimizer is not None:
            for group in built.optimizer.param_groups:
                unknown = sorted(set(overrides) - set(group))
                if unknown:
                    raise InvalidRequest(
                        f"optimizer {builder.job.optimizer!r} has no hyper-parameter {unknown} "
                        f"(it has {sorted(k for k in group if k != 'params')})"
                    )
                group.update(overrides)
        with self._cond:
            self.machine.check_frozen(epoch)
            if self._restoring is None or self._restoring[0] != epoch:
                self._restoring = (epoch, {}, {})
            self._restoring[1][index] = built
            self._restoring[2][index] = got.packed.nbytes
