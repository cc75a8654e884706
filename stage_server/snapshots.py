"""Snapshots of committed layer state in host memory: this stage's own, and its peer's copy.

At step 0, every ``snapshot_every`` committed steps and at the first step of every epoch, a stage
captures the full state of its layers (weights, optimizer state, buffers) at the step
boundary -- a clone, the only copy made on the training thread, so training goes on at
once -- and a background thread packs it (splits it for the wire, copying nothing), takes
each layer's digest once (kept with the snapshot, and reused by every copy sent of it),
and pushes a copy to the next stage of the chain. The push sends each chunk straight from
the clone's memory, with no per-chunk CRC-32 (the digest is the one checksum); the next
stage verifies it as the bytes arrive and keeps the verified digest with its copy; a
restore from a held snapshot checks its bytes against it again. Everything after the
clone runs at the lowest CPU priority, on both sides (the packing thread, gRPC's thread
that sends the copy, the thread that receives it). A recovery restores lost layers from
whichever live host holds them. Each store keeps the last ``keep`` complete steps of its
own snapshots and of each peer's copy, so while a new one is being written the last
complete one always exists (double buffering)::

    step 20 committed -> capture (clones)          own: {10, 20*}  peer copy: {10}
    packed            -> own complete               own: {10, 20}
    pushed            -> the next stage holds it    (peer side) copies: {10, 20}
    step 30 committed -> capture; step 10 dropped once 30 is complete

A store never drops a snapshot of the coordinator's newest *safe* step (every layer held
twice) or later (``keep_from``), so the snapshot a recovery needs is never trimmed while a
slower copy catches up. A snapshot belongs to one job and history: a checkpoint load
starts a new history, so every older snapshot is dropped; a rollback to step k drops
only those after k. At most one capture waits to be packed: a newer one replaces it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from elasticpipe.errors import ElasticPipeError, InvalidRequest, NotReady
from elasticpipe.logs import get_logger
from elasticpipe.v1 import stage_pb2
from elasticpipe.wire import layer_state
from elasticpipe.wire.layer_state import PackedLayer

T = TypeVar("T")
log = get_logger(__name__)

DEFAULT_KEEP = 2
SNAPSHOT_NICE = 19


@dataclass(frozen=True)
class Holding:
    """What a store holds of one step: the full state of ``layers``."""

    job_id: str
    step: int
    layers: tuple[int, ...]
    peer_copy: bool  # a copy kept for the stage whose snapshot peer this is
    digests: tuple[bytes, ...] = ()  # own snapshots: each layer's, in ``layers`` order
    taken_epoch: int = 0  # own snapshots: the epoch they were taken in


@dataclass
class _Snapshot:
    job_id: str
    step: int
    blobs: dict[int, PackedLayer] = field(default_factory=dict)
    epoch: int = 0  # own snapshots: the epoch they were taken in


class SnapshotStore:
    """Complete snapshots held here, own and copies, keyed by (job, step, layer)."""

    def __init__(self, keep: int = DEFAULT_KEEP):
        if keep < 1:
            raise InvalidRequest(f"snapshots to keep must be >= 1 (got {keep})")
        self._keep = keep
        self._lock = threading.Lock()
        self._own: dict[int, _Snapshot] = {}
        self._copies: dict[str, dict[int, _Snapshot]] = {}  # source stage id -> step -> ...
        self.generation = 0  # bumped by every prune: captures taken before it are void
        self._keep_from = 0  # the coordinator's newest safe step: kept whatever ``keep``

    def add_own(
        self,
        job_id: str,
        step: int,
        blobs: Mapping[int, PackedLayer],
        generation: int,
        epoch: int = 0,
    ) -> bool:
        """Records a complete snapshot of this stage's layers, taken in ``epoch``, unless a
        prune since its capture voided it; returns whether it was kept."""
        with self._lock:
            if generation != self.generation:
                return False
            self._own[step] = _Snapshot(job_id, step, dict(blobs), epoch)
            self._trim(self._own)
            return True

    def add_copy(
        self, source: str, job_id: str, step: int, blobs: Mapping[int, PackedLayer], generation: int
    ) -> bool:
        """Records a complete copy of a peer's snapshot, unless a prune since it began
        arriving voided it; returns whether it was kept."""
        with self._lock:
            if generation != self.generation:
                return False
            steps = self._copies.setdefault(source, {})
            steps[step] = _Snapshot(job_id, step, dict(blobs))
            self._trim(steps)
            return True

    def keep_from(self, step: int) -> None:
        """Snapshots of ``step`` and later are kept (the newest safe step)."""
        with self._lock:
            self._keep_from = step

    def _trim(self, steps: dict[int, _Snapshot]) -> None:
        for old in sorted(steps)[: -self._keep]:
            if not self._keep_from or old < self._keep_from:  # 0: no safe step known
                del steps[old]

    def get(self, job_id: str, step: int, layer: int) -> PackedLayer | None:
        """The packed state of ``layer`` at ``step``, own or copy, if held here."""
        with self._lock:
            for steps in (self._own, *self._copies.values()):
                snap = steps.get(step)
                if snap is not None and snap.job_id == job_id and layer in snap.blobs:
                    return snap.blobs[layer]
        return None

    def holdings(self) -> list[Holding]:
        """Every complete snapshot held here."""
        with self._lock:
            own = [
                Holding(
                    s.job_id,
                    s.step,
                    tuple(sorted(s.blobs)),
                    False,
                    tuple(s.blobs[i].digest for i in sorted(s.blobs)),
                    s.epoch,
                )
                for s in self._own.values()
            ]
            copies = [
                Holding(s.job_id, s.step, tuple(sorted(s.blobs)), True)
                for steps in self._copies.values()
                for s in steps.values()
            ]
        return own + copies

    def prune(self, after: int | None) -> None:
        """Drops every snapshot after step ``after`` (all of them if None)."""
        with self._lock:
            self.generation += 1
            for steps in (self._own, *self._copies.values()):
                for step in [s for s in steps if after is None or s > after]:
                    del steps[step]

    def nbytes(self) -> int:
        """Bytes held."""
        with self._lock:
            return sum(
                b.nbytes
                for steps in (self._own, *self._copies.values())
                for s in steps.values()
                for b in s.blobs.values()
            )


@dataclass(frozen=True)
class Capture:
    """A snapshot's cloned state, to be packed and copied off the step's critical path."""

    job_id: str
    step: int
    source: str  # this stage's id
    states: dict[int, dict[str, Any]]
    peer: str  # where the copy goes ("" for none)
    generation: int  # the store's generation when captured
    epoch: int = 0  # the epoch it was taken in


# (peer, capture, its packed layers, superseded) -> whether the peer kept the copy (False:
# given up because ``superseded()``, a newer capture waiting)
Pusher = Callable[[str, Capture, Sequence[tuple[int, PackedLayer]], Callable[[], bool]], bool]


class Snapshotter:
    """Packs captures and pushes their copies, one at a time, on its own thread.

    A push that its peer keeps refusing (a peer that left the chain at an epoch change:
    a leave's) is given up as soon as a newer capture waits (``snapshot_copy_given_up``):
    the newer copy replaces it, and must not wait behind its retries (the leave waits for
    it).
    """

    def __init__(self, store: SnapshotStore, push: Pusher, before_push: Callable[[], None]):
        self._store = store
        self._push = push
        self._before_push = before_push
        self._cond = threading.Condition()
        self._waiting: Capture | None = None  # at most one: a newer capture replaces it
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="snapshots", daemon=True)
        self._thread.start()

    def submit(self, capture: Capture) -> None:
        """Queues a capture (replacing one still waiting); returns at once."""
        with self._cond:
            if self._waiting is not None:
                log.warning(
                    "snapshot_skipped",
                    step=self._waiting.step,
                    newer=capture.step,
                    why="the previous snapshot was still being copied",
                )
            self._waiting = capture
            self._cond.notify_all()

    def flush(self, timeout: float) -> bool:
        """Waits until every queued capture is stored and pushed (or failed, or given up)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._waiting is None and not self._busy, timeout)

    def close(self) -> None:
        """Stops the thread after the capture in progress (a push its peer refuses stops
        retrying at the next refusal)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    def _superseded(self) -> bool:
        """Whether a newer capture waits (or the thread is closing)."""
        with self._cond:
            return self._waiting is not None or self._closed

    def _log_given_up(self, capture: Capture) -> None:
        with self._cond:
            newer = self._waiting.step if self._waiting is not None else None
        log.info(
            "snapshot_copy_given_up",
            step=capture.step,
            peer=capture.peer,
            why="the stage is closing" if newer is None else "a newer one waits",
            newer=newer,
        )

    def _next(self) -> Capture | None:
        with self._cond:
            self._busy = False
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._waiting is not None or self._closed)
            if self._closed:
                return None
            capture, self._waiting, self._busy = self._waiting, None, True
            return capture

    def _run(self) -> None:
        _lower_priority()
        while (capture := self._next()) is not None:
            try:
                blobs = {
                    i: layer_state.seal(layer_state.pack(state))
                    for i, state in capture.states.items()
                }
                kept = self._store.add_own(
                    capture.job_id, capture.step, blobs, capture.generation, capture.epoch
                )
                self._before_push()
                if kept and capture.peer:
                    pushed = self._push(
                        capture.peer, capture, sorted(blobs.items()), self._superseded
                    )
                    if not pushed:
                        self._log_given_up(capture)
            except ElasticPipeError as exc:
                log.warning(
                    "snapshot_copy_failed",
                    step=capture.step,
                    peer=capture.peer,
                    error=str(exc),
                )
            except Exception as exc:  # the thread must outlive any one failure
                log.error("snapshot_failed", step=capture.step, error=repr(exc), exc_info=exc)


def receive_copy(
    pieces: Iterable[stage_pb2.LayerChunk], limits: tuple[int, int]
) -> dict[int, PackedLayer]:
    """Receives a pushed copy's layers (verified, see ``layer_state.receive``) on a thread of
    its own at the lowest CPU priority: the bytes are parsed, checked and copied there
    (gRPC deserializes a request where its iterator is read), off the step's compute.

    Raises:
        whatever ``layer_state.receive`` raises, or reading ``pieces`` raises.
    """
    return at_lowest_priority(
        lambda: {got.layer: got.packed for got in layer_state.receive(pieces, *limits)}
    )


def at_lowest_priority(work: Callable[[], T]) -> T:
    """``work()`` on a thread of its own at the lowest CPU priority, joined: the caller's
    thread keeps its own priority for what it does next (a copy is kept under the stage's
    lock, where the deferred optimizer step may run on whichever thread holds it).

    Raises:
        whatever ``work`` raises.
    """
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        _lower_priority()
        try:
            result.append(work())
        except BaseException as exc:  # handed to the caller
            failure.append(exc)

    thread = threading.Thread(target=run, name="snapshot-copy-in", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


def lower_priority_here() -> None:
    """Lowers the calling thread's CPU priority for good: only for a thread that ends with
    the work it does (gRPC's thread that sends one call's request stream)."""
    _lower_priority()


def _lower_priority() -> None:
    """Runs this thread at the lowest CPU priority where the OS allows it per thread
    (Linux): packing and copying snapshots then fills the pipeline's idle gaps instead of
    competing with the step's compute."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), SNAPSHOT_NICE)


def check_copy(job_id: str, current_job: str, source: str, chain: tuple[str, ...]) -> None:
    """Checks that a pushed copy belongs here: the current job, from a stage of the chain.

    Raises:
        NotReady: another job, or a source outside the chain (its copy is not kept).
    """
    if job_id != current_job:
        raise NotReady(f"snapshot copy of job {job_id!r}, but this stage runs {current_job!r}")
    if source not in chain:
        raise NotReady(f"snapshot copy from {source!r}, which is not in the chain {list(chain)}")


def check_layers(blobs: Mapping[int, PackedLayer], source: str, step: int) -> None:
    """Refuses a copy without layers (a stream cut before its first layer).

    Raises:
        InvalidRequest: no layer in the copy.
    """
    if not blobs:
        raise InvalidRequest(f"snapshot copy of step {step} from {source!r} holds no layer")
