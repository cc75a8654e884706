"""Moving layers between running stages: the two-phase epoch change, driven by the coordinator.

1. **Freeze** every stage of the old and new chains: each waits for its step boundary and
   then refuses new runs. The cut is consistent only if every stage of the old chain has
   committed the same step; otherwise the change is abandoned.
2. **Prepare**: each stage of the new chain pulls the layers it will own from their current
   owners (weights, optimizer state, buffers, in checksummed chunks) and holds them aside.
3. The new partition is written to the coordinator's store -- the commit point -- and
   **CommitEpoch** makes every stage install what it holds and free what moved away.

Any failure before the commit point sends **AbortEpoch** to every stage: staged layers
are dropped, nothing was freed, and the old epoch stays in force.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import structlog

from elasticpipe import rpc
from elasticpipe.errors import ElasticPipeError, TransferError
from elasticpipe.job import JobConfig
from elasticpipe.v1 import stage_pb2

log = structlog.get_logger()
T = TypeVar("T")
COMMIT_ATTEMPTS = 4


class StagePool(rpc.StagePool):
    """The coordinator's channels to stages, with a parallel "call every stage" helper."""

    def each(self, fn: Callable[[str], T], addresses: Sequence[str]) -> list[T]:
        """Runs ``fn`` for every address in parallel; raises the first failure after all end."""
        futures = [self.executor.submit(fn, a) for a in addresses]
        results, first_error = [], None
        for future in futures:
            try:
                results.append(future.result())
            except ElasticPipeError as exc:
                first_error = first_error or exc
        if first_error is not None:
            raise first_error
        return results


@dataclass(frozen=True)
class Chain:
    """A partition in the terms migration needs: ordered stage addresses and boundaries."""

    epoch: int
    addresses: tuple[str, ...]
    boundaries: tuple[int, ...]

    def owner(self, layer: int) -> str:
        """The address of the stage owning ``layer``."""
        for s, address in enumerate(self.addresses):
            if self.boundaries[s] <= layer < self.boundaries[s + 1]:
                return address
        raise IndexError(layer)

    def assignment(self, address: str) -> stage_pb2.Assignment:
        """The assignment of ``address`` in this chain (empty range if it is not in it)."""
        if address not in self.addresses:
            return stage_pb2.Assignment(epoch=self.epoch)
        s = self.addresses.index(address)
        return stage_pb2.Assignment(
            epoch=self.epoch,
            index=s,
            num_stages=len(self.addresses),
            layer_lo=self.boundaries[s],
            layer_hi=self.boundaries[s + 1],
            prev=stage_pb2.Peer(address=self.addresses[s - 1] if s > 0 else ""),
            next=stage_pb2.Peer(
                address=self.addresses[s + 1] if s + 1 < len(self.addresses) else ""
            ),
        )


@dataclass(frozen=True)
class MoveResult:
    """What an epoch change did.

    ``pause_s`` is how long training stood still: from the moment every stage was frozen at
    the cut to the moment the new epoch was committed everywhere. ``wait_s`` is how long the
    freeze waited for the step in flight to finish (training went on meanwhile).
    """

    layers_moved: int
    bytes_moved: int
    pause_s: float
    committed_step: int
    wait_s: float = 0.0
    transfer_s: float = 0.0


def moves(old: Chain, new: Chain) -> list[tuple[int, str, str]]:
    """(layer, from, to) for each layer whose owner changes."""
    num_layers = old.boundaries[-1]
    out = []
    for layer in range(num_layers):
        src, dst = old.owner(layer), new.owner(layer)
        if src != dst:
            out.append((layer, src, dst))
    return out


def change_epoch(
    pool: StagePool,
    job: JobConfig,
    old: Chain,
    new: Chain,
    commit_point: Callable[[], None],
    freeze_timeout_s: float = 60.0,
    transfer_timeout_s: float = 120.0,
) -> MoveResult:
    """Moves from ``old`` to ``new`` at a consistent cut, or leaves ``old`` in force.

    Args:
        pool: stage stubs.
        job: the running job (sent to stages joining the chain).
        old: the partition in force.
        new: the partition to move to (``new.epoch == old.epoch + 1`` or later).
        commit_point: persists ``new``; called once every layer has arrived intact.
        freeze_timeout_s: how long a stage may take to reach its step boundary.
        transfer_timeout_s: how long the transfers may take.

    Raises:
        ElasticPipeError: the change was abandoned (every stage is back on ``old``).
    """
    started = time.perf_counter()
    involved = list(dict.fromkeys(old.addresses + new.addresses))
    moved = moves(old, new)
    try:
        steps = pool.each(
            lambda a: (
                pool.call(
                    a, "Freeze", stage_pb2.EpochRequest(epoch=new.epoch), freeze_timeout_s
                ).committed_step
            ),
            involved,
        )
        chain_steps = {s for a, s in zip(involved, steps, strict=True) if a in old.addresses}
        if len(chain_steps) != 1:
            raise TransferError(
                f"no consistent cut: the stages of epoch {old.epoch} committed steps "
                f"{sorted(chain_steps)}"
            )
        (cut,) = chain_steps
        frozen_at = time.perf_counter()
        spec = job.to_proto()

        def prepare(address: str) -> int:
            incoming = [
                stage_pb2.LayerSource(layer=layer, address=src)
                for layer, src, dst in moved
                if dst == address
            ]
            reply = pool.call(
                address,
                "PrepareEpoch",
                stage_pb2.PrepareEpochRequest(
                    epoch=new.epoch,
                    assignment=new.assignment(address),
                    incoming=incoming,
                    timeout_s=transfer_timeout_s,
                    job=spec,
                    committed_step=cut,
                ),
                transfer_timeout_s,
            )
            return int(reply.bytes_received)

        received = pool.each(prepare, involved)
        transferred_at = time.perf_counter()
        commit_point()
    except ElasticPipeError as exc:
        log.warning("epoch_change_aborted", epoch=new.epoch, kept=old.epoch, error=str(exc))
        _abort_all(pool, involved, new.epoch, str(exc))
        raise
    failures = []
    for address in involved:
        # Past the commit point the change can only go forward: CommitEpoch is idempotent,
        # so a stage that missed it is asked again before giving up on it.
        for attempt in range(COMMIT_ATTEMPTS):
            try:
                pool.call(address, "CommitEpoch", stage_pb2.EpochRequest(epoch=new.epoch), 30.0)
                break
            except ElasticPipeError as exc:
                if attempt == COMMIT_ATTEMPTS - 1:
                    failures.append(f"{address}: {exc}")
                else:
                    time.sleep(0.5 * (attempt + 1))
    if failures:
        log.error("epoch_commit_incomplete", epoch=new.epoch, failures=failures)
    return MoveResult(
        layers_moved=len(moved),
        bytes_moved=sum(received),
        pause_s=time.perf_counter() - frozen_at,
        committed_step=cut,
        wait_s=frozen_at - started,
        transfer_s=transferred_at - frozen_at,
    )


def _abort_all(pool: StagePool, addresses: Sequence[str], epoch: int, reason: str) -> None:
    for address in addresses:
        try:
            pool.call(
                address, "AbortEpoch", stage_pb2.EpochRequest(epoch=epoch, reason=reason), 10.0
            )
        except ElasticPipeError as exc:
            log.error("abort_epoch_failed", stage=address, epoch=epoch, error=str(exc))
