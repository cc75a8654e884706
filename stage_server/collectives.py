"""The reduction's engine on ``torch.distributed`` process groups (``collectives="gloo"``;
``"nccl"`` is refused until it has run on GPUs): the same canonical reduction as the data channel's
(``reduction.GroupReduction``: the same pieces, folded in the same tree, so the same bits),
carried by a process group per reduction group instead of the stages' data channel.

**The groups.** Each reduction group's holders (one per replica, ranked by replica) open a
standalone ``ProcessGroupGloo`` over a ``PrefixStore`` of the
coordinator's rendezvous store (``coordinator.rendezvous``), prefixed by job, epoch,
group and generation: never a world-wide ``new_group``, never a ``destroy_process_group``.
A group lives for its epoch and generation; the next epoch, or a new generation, drops it.

**The rendezvous** is the leading coordinator's: a process group needs it only while it
opens, and each opening connects to it afresh, at the address the stage's last heartbeat
gave (a restarted coordinator, or a standby that took over, serves a new store).

**Failures.** A process group's creation and its pending receives do not return when the
run fails (``abort`` does not wake a gloo receive). So the engine runs in a thread of its
own, which the run's thread waits for while it watches the run: a run that fails
elsewhere, or runs past its deadline, stops waiting at once, and the thread is left to
end on the process group's timeout. Its groups are then no longer used: the client starts
a new **generation** (``RunStepRequest.reduce_generation``, the first run after a failed
one) that every holder sees in the same run, and the holders open fresh groups under the
new generation's prefix. So no holder reuses a group that another has given up on.

**Security.** Neither the rendezvous store nor the process groups authenticate anyone, or
check epochs and secrets as the data channel does: collectives are for trusted fabrics, and
a coordinator that requires mutual TLS refuses them. What a piece carries is still checked
against the chunk's form before it is used (``reducing.piece``).
"""

from __future__ import annotations

import datetime
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from elasticpipe.errors import (
    DeadlineExceeded,
    ElasticPipeError,
    StageUnavailable,
    StepAborted,
)
from elasticpipe.logs import get_logger
from elasticpipe.stage_server.reduction import GroupReduction, Send, piece_key
from elasticpipe.transport.serving import split_address

__all__ = ["ProcessGroups", "reduce_on_groups"]

log = get_logger(__name__)

WATCH_S = 0.005  # how often the run's thread looks at the run while the engine works
MIN_GROUP_TIMEOUT_S = 10.0  # a process group's operations wait at most its run's deadline
GIVEN_UP_KEPT = 64  # generations given up on, remembered


Generation = tuple[str, int, int]  # job, epoch, the run that opened it


class ProcessGroups:
    """A stage's process groups: one per (epoch, reduction group), of one generation."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups: dict[tuple[int, int], Any] = {}
        self._generation: Generation | None = None
        self._given_up: deque[Generation] = deque(maxlen=GIVEN_UP_KEPT)

    def use(self, job_id: str, epoch: int, generation: int) -> None:
        """Drops every group not of this job, epoch and generation (the run's).

        Raises:
            StepAborted: this stage gave up on that generation's groups (a run failed on
                them): opening them again under the same prefix would wait for holders
                that keep theirs. The client starts a new generation with its next run.
        """
        with self._lock:
            if (job_id, epoch, generation) in self._given_up:
                raise StepAborted(
                    f"the process groups of generation {generation} (epoch {epoch}) were "
                    "given up here after a failed run: the next run opens new ones"
                )
            if self._generation != (job_id, epoch, generation):
                if self._groups:
                    log.info("process_groups_dropped", groups=len(self._groups), epoch=epoch)
                self._groups.clear()
                self._generation = (job_id, epoch, generation)

    def drop(self, generation: Generation | None = None) -> None:
        """Forgets every group (a run gave up on them: the next run opens new ones); with
        ``generation``, only if that is still the one in use (a run left behind must not
        give up the next run's)."""
        with self._lock:
            if generation is not None and generation != self._generation:
                return
            self._groups.clear()
            if self._generation is not None:
                self._given_up.append(self._generation)
            self._generation = None

    def current(self) -> Generation:
        """The generation in use (``use``'s), captured once by a run's engine.

        Raises:
            StepAborted: none is (a run gave them up meanwhile).
        """
        with self._lock:
            if self._generation is None:
                raise StepAborted("the process groups were given up after a failed run")
            return self._generation

    def group(
        self,
        generation: Generation,
        rendezvous: str,
        host: str,
        group: int,
        rank: int,
        size: int,
        timeout_s: float,
    ) -> Any:
        """The process group of reduction group ``group`` in ``generation``, opened (with
        every other holder: this blocks until they all come) if new; its connections on
        ``host``, this stage's.

        Raises:
            StepAborted: ``generation`` is no longer in use (a run left behind by a failure
                asks: it must not open or take the next generation's groups).
        """
        job_id, epoch, number = generation
        with self._lock:
            if self._generation != generation:
                raise StepAborted(f"the process groups of generation {number} are given up")
            found = self._groups.get((epoch, group))
        if found is not None:
            return found
        import torch.distributed as dist  # (only a job of collectives needs it)

        store = _store(rendezvous, timeout_s)
        prefix = f"elasticpipe/{job_id}/{epoch}/{group}/{number}"
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = datetime.timedelta(seconds=max(timeout_s, MIN_GROUP_TIMEOUT_S))
        options._devices = [_device(dist, host)]
        scoped = dist.PrefixStore(prefix, store)  # type: ignore[attr-defined]
        pg = dist.ProcessGroupGloo(scoped, rank, size, options)
        log.info("process_group_opened", epoch=epoch, group=group, generation=number, rank=rank)
        with self._lock:
            if self._generation != generation:
                raise StepAborted(f"the process groups of generation {number} are given up")
            return self._groups.setdefault((epoch, group), pg)


def _store(rendezvous: str, timeout_s: float) -> Any:
    """A connection to the rendezvous store of its own, for one group's opening: a
    ``TCPStore`` client blocks every other call on it while one waits for a key, so groups
    opened at once on a shared one would wait on each other (and two stages could each
    wait for the other's group first). It also reaches whichever store serves the address
    now (a restarted coordinator's, a new leader's)."""
    import torch.distributed as dist

    host, port = split_address(rendezvous)
    return dist.TCPStore(  # type: ignore[attr-defined]
        host,
        port,
        is_master=False,
        timeout=datetime.timedelta(seconds=max(timeout_s, MIN_GROUP_TIMEOUT_S)),
    )


def _device(dist: Any, host: str) -> Any:
    """Gloo's device on ``host`` (the stage's advertised host) if it can be bound here,
    else gloo's default (the host name's address): behind NAT, or with a DNS name of a
    Service, the advertised address is not this host's own."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
    except OSError:
        return dist.ProcessGroupGloo.create_default_device()
    return dist.ProcessGroupGloo.create_device(hostname=host)


def reduce_on_groups(
    groups: ProcessGroups,
    engine: str,
    rendezvous: str,
    host: str,
    work: Sequence[tuple[GroupReduction, list[Any]]],
    replicas: int,
    failed: Callable[[], ElasticPipeError | None],
    deadline: float,
    pack: Callable[[Send], torch.Tensor],
    unpack: Callable[[torch.Tensor, GroupReduction, int, int, Any], Any],
    nbytes: Callable[[GroupReduction, int], int],
) -> None:
    """Runs every reduction of ``work`` (each with this holder's partials) to its end over
    the process groups, in a thread of its own, while this thread watches the run.

    Raises:
        ElasticPipeError: the run failed meanwhile (its failure), the deadline passed, or
            the engine failed (a peer gone, a piece of the wrong form): the groups are
            dropped, and the next generation opens new ones.
    """
    outcome: list[BaseException] = []
    done = threading.Event()
    buffers = torch.device("cpu")  # gloo: through host memory
    generation = groups.current()

    def body() -> None:
        try:
            timeout_s = max(deadline - time.monotonic(), 0.0)
            opened = [
                groups.group(
                    generation, rendezvous, host, reduction.group, reduction.me, replicas, timeout_s
                )
                for reduction, _ in work
            ]
            pending: list[tuple[Any, torch.Tensor]] = []  # sends in flight, and their bytes

            def send(pg: Any, reduction: GroupReduction, sends: list[Send]) -> None:
                for s in sends:
                    index = (
                        None
                        if s.piece.node is None
                        else reduction.node_index(s.piece.sender, s.piece.node)
                    )
                    tag = piece_key(reduction.group, s.piece.sender, replicas, index)
                    data = pack(s).to(buffers)
                    pending.append((pg.send([data], s.to, tag), data))

            for pg, (reduction, mine) in zip(opened, work, strict=True):
                send(pg, reduction, reduction.start(mine))
            for pg, (reduction, _) in zip(opened, work, strict=True):
                for sender, index in reduction.expected():
                    chunk = reduction.me if index is not None else sender
                    tag = piece_key(reduction.group, sender, replicas, index)
                    data = torch.zeros(nbytes(reduction, chunk), dtype=torch.uint8, device=buffers)
                    pg.recv([data], sender, tag).wait()
                    node = None if index is None else reduction.node_of(sender, index)
                    piece = unpack(data, reduction, chunk, sender, node)
                    send(pg, reduction, reduction.receive(piece))
            for handle, _ in pending:
                handle.wait()
        except BaseException as exc:  # handed to the run's thread
            outcome.append(exc)
        finally:
            done.set()

    threading.Thread(target=body, name="collectives", daemon=True).start()
    while not done.wait(WATCH_S):
        failure = failed()
        if failure is not None:
            groups.drop(generation)
            raise failure
        if time.monotonic() > deadline:
            groups.drop(generation)
            raise DeadlineExceeded(
                f"the gradient reduction over {engine} process groups did not finish before "
                "the run's deadline (a holder in another replica is silent)"
            )
    if outcome:
        groups.drop(generation)
        exc = outcome[0]
        if isinstance(exc, ElasticPipeError):
            raise exc
        raise StageUnavailable(
            f"the gradient reduction over {engine} process groups failed (a holder in "
            f"another replica gone?): {str(exc)[:300]}"
        ) from exc
