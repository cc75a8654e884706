"""A stage's gradient reduction with the other replicas, over its data channel: each group it
holds is reduced with the group's holders in the other replicas
(``reduction.GroupReduction``) as soon as the run's last backward is done with the group's
layers (``Reductions``), and the sums go into ``.grad``.

The pieces travel as REDUCE data messages, through the links and the mailbox that carry
activations, so they get every check activations get: the run's epoch and secret, bounds
before allocation, the deadline, mutual TLS (only a stage's certificate may send one). On
the wire a piece is its chunk's tensors joined into one flat tensor per run of parameters
of one dtype (a message holds at most 64 tensors; a chunk may span hundreds of
parameters), then one bool tensor: which parameters have a gradient. Both ends know the
chunk's form, so the receiver cuts the runs back. The key (``DataHeader.micro_batch``)
names the group, the sender and the node (``reduction.piece_key``). Pieces are never cast
to the job's wire dtype: the sum is exact.
"""

from __future__ import annotations

import itertools
import struct
import threading
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from elasticpipe.errors import DeadlineExceeded, ElasticPipeError, InvalidRequest, StepAborted
from elasticpipe.logs import get_logger
from elasticpipe.partition import Group, Placement
from elasticpipe.stage_server.collectives import ProcessGroups, reduce_on_groups
from elasticpipe.stage_server.executor import flush
from elasticpipe.stage_server.layers import LayerSlice
from elasticpipe.stage_server.links import Link
from elasticpipe.stage_server.mailbox import Mailbox, Slot
from elasticpipe.stage_server.reduction import (
    GroupReduction,
    Piece,
    Send,
    flatten,
    piece_key,
    unflatten,
)
from elasticpipe.stage_server.tracing import Span, SpanKind, Tracer
from elasticpipe.transport.sending import Outgoing
from elasticpipe.transport.serving import split_address

__all__ = [
    "Reductions",
    "RunIds",
    "refuse_running_stats",
    "share_of",
]

log = get_logger(__name__)

JOIN_GRACE_S = 1.0  # a reduction thread's end, waited for past the run's deadline


@dataclass(frozen=True)
class RunIds:
    """What every message of the run carries."""

    epoch: int
    run: int
    step: int
    secret: bytes
    deadline: float  # time.monotonic() value


def share_of(placement: Placement, shares: Sequence[int], micro_batches: int) -> range:
    """The global micro-batch ids this stage's replica runs.

    Raises:
        InvalidRequest: shares that do not fit the placement or ``micro_batches``.
    """
    replicas = placement.num_replicas
    if len(shares) != replicas or shares[placement.replica] != micro_batches or 0 in shares:
        raise InvalidRequest(
            f"shares {list(shares)} for replica {placement.replica} of {replicas}, which "
            f"runs {micro_batches} micro-batches (every replica runs at least one)"
        )
    return _ranges(shares)[placement.replica]


def refuse_running_stats(modules: Mapping[int, torch.nn.Module]) -> None:
    """Refuses layers that keep running statistics (BatchNorm's ``running_mean``): each
    replica would update them from its share alone, so the replicas' statistics, and the
    model's, would differ from one pipeline's. Combining them in micro-batch order is not
    built.

    Args:
        modules: the stage's layers, by index.

    Raises:
        InvalidRequest: naming the first such layer and module.
    """
    for index in sorted(modules):
        for name, module in modules[index].named_modules():
            if isinstance(module, torch.nn.modules.batchnorm._NormBase) and (
                module.track_running_stats
            ):
                raise InvalidRequest(
                    f"layer {index} ({type(module).__name__}"
                    f"{f' at {name!r}' if name else ''}) keeps running statistics, which "
                    "replicas would each update from their share alone: a job of several "
                    "replicas cannot train it yet (use one pipeline, or a norm without "
                    "running statistics such as LayerNorm or GroupNorm)"
                )


def _ranges(shares: Sequence[int]) -> list[range]:
    """Each replica's global micro-batch ids: its share, after the shares before it."""
    starts = itertools.accumulate(shares, initial=0)
    return [range(a, a + m) for a, m in zip(starts, shares, strict=False)]


Work = tuple[GroupReduction, list[int], list[Any], list[str], list[Any]]
# (the reduction, its layers with parameters, their parameters, the holders' addresses,
# this holder's partials)


class Reductions:
    """A run's gradient reductions with the other replicas' holders, one per group this
    stage holds.

    **Overlap.** Each group's reduction starts as soon as the run's last backward here is
    done with the group's layers (``layer_done``, called by that backward, highest layer
    first), on a thread of its own, while the backward goes on down the other groups'
    layers: a stage that holds several groups (replicas cut differently) hides the
    reduction of the upper ones behind its backward. ``finish`` reduces the groups not
    started yet, waits for all, and installs the sums. A group whose reduction fails fails
    the run at once (the backward stops at its next op). Over the data channel or, with
    ``collectives``, over the process groups of ``generation`` (the same pieces, so the
    same bits), opened on ``rendezvous`` (the coordinator's now; default: the job's).
    """

    def __init__(
        self,
        layers: LayerSlice,
        placement: Placement,
        shares: Sequence[int],
        links: dict[str, Link],
        mailbox: Mailbox,
        ids: RunIds,
        groups: ProcessGroups | None = None,
        generation: int = 0,
        rendezvous: str = "",
        tracer: Tracer | None = None,
    ):
        """Raises:
        InvalidRequest: collectives without a rendezvous (a coordinator that refuses it).
        StepAborted: collectives of a generation this stage gave up on.
        """
        self.layers, self.placement, self.links, self.mailbox, self.ids = (
            layers,
            placement,
            links,
            mailbox,
            ids,
        )
        self.total, self.ranges = sum(shares), _ranges(shares)
        self.tracer = tracer
        self._engine = groups, rendezvous or layers.job.rendezvous
        self._left: dict[int, set[int]] = {}  # groups not started: their layers not done
        for group in placement.groups:
            owned = {layer for layer in group.layers if layer in layers.optimizers}
            if owned:  # (no parameters, as an activation or a dropout: nothing to reduce)
                self._left[group.index] = owned
        self._threads: list[tuple[threading.Thread, list[BaseException]]] = []
        self._done: list[Work] = []
        self._moved: list[tuple[float, float, float]] = []  # per ``_reduce``: bytes, from, to
        self._abandoned = threading.Event()  # the run failed: reductions under way end
        job = layers.job
        if job.collectives:
            assert groups is not None
            if rendezvous == "-":
                raise InvalidRequest(
                    f"collectives={job.collectives!r}: the coordinator serves no rendezvous "
                    "(it restarted with TLS, which refuses collectives): start the job "
                    "again without collectives"
                )
            groups.use(job.job_id, ids.epoch, generation)

    def layer_done(self, layer: int) -> None:
        """``layer``'s gradients are whole for the run: starts the reduction of its group
        once every layer of the group is (on a thread; it fails the run if it fails)."""
        for index, pending in self._left.items():
            if layer in pending:
                pending.discard(layer)
                if not pending:
                    del self._left[index]
                    started = self.tracer.now_ns() if self.tracer is not None else 0
                    work = self._work([self._group(index)])
                    errors: list[BaseException] = []
                    thread = threading.Thread(
                        target=self._reduce_early,
                        args=(work, errors, started),
                        name=f"reduce-{index}",
                        daemon=True,
                    )
                    self._threads.append((thread, errors))
                    thread.start()
                return

    def finish(self) -> None:
        """Reduces the groups not started, waits for the others, and installs every sum.

        Raises:
            ElasticPipeError: a peer's piece was wrong (InvalidRequest), the deadline passed
                (naming the piece that did not come), or the run failed meanwhile.
        """
        started = self.tracer.now_ns() if self.tracer is not None else 0
        work = self._work([self._group(index) for index in sorted(self._left)])
        self._left.clear()
        self._reduce(work, started)
        for thread, errors in self._threads:
            thread.join(max(0.0, self.ids.deadline - time.monotonic()) + JOIN_GRACE_S)
            if errors:
                raise errors[0]
            if thread.is_alive():
                raise DeadlineExceeded(
                    f"run {self.ids.run}: a gradient reduction did not end by the deadline"
                )
        for reduction, owned, params, _, _ in self._done + work:
            self.layers.install_grads(
                dict(zip(owned, unflatten(reduction.result(), params), strict=True))
            )

    def rate(self) -> float | None:
        """This run's reduction rate, once ``finish`` returned (``Rate``): None when
        it reduced nothing."""
        if not self._moved:
            return None
        began, ended = min(m[1] for m in self._moved), max(m[2] for m in self._moved)
        moved = sum(m[0] for m in self._moved)
        return moved / (ended - began) if moved and ended > began else None

    def abandon(self, why: str) -> None:
        """The run failed: stops the reductions under way and waits (briefly) for them to
        end, before the run is closed (then a process group's watcher would find no
        failure to stop on, and give up the next run's generation at the deadline)."""
        self._abandoned.set()
        if self._threads:
            self.mailbox.abort(self.ids.run, why)
        deadline = time.monotonic() + JOIN_GRACE_S
        for thread, _ in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _failure(self) -> ElasticPipeError | None:
        """Why the reductions must stop now, if they must."""
        failure = self.mailbox.failure(self.ids.run)
        if failure is None and self._abandoned.is_set():
            return StepAborted(f"run {self.ids.run} failed on this stage")
        return failure

    def _group(self, index: int) -> Group:
        return next(g for g in self.placement.groups if g.index == index)

    def _work(self, groups: Sequence[Group]) -> list[Work]:
        """Each group's reduction and this holder's partials (its layers' sums taken)."""
        layers, me = self.layers, self.placement.replica
        owned_of = [[i for i in g.layers if i in layers.optimizers] for g in groups]
        partials = layers.take_partials([i for owned in owned_of for i in owned])
        work = []
        for group, owned in zip(groups, owned_of, strict=True):
            params = [list(layers.layers[layer].parameters()) for layer in owned]
            like = [p.detach().new_empty(p.numel()) for ps in params for p in ps if p.requires_grad]
            mine = [
                (node, flatten([partials[layer][j][1] for layer in owned], params))
                for j, (node, _) in enumerate(partials[owned[0]])
            ]
            reduction = GroupReduction(group.index, me, self.ranges, self.total, like)
            work.append((reduction, owned, params, [h.address for h in group.holders], mine))
        return work

    def _reduce_early(self, work: list[Work], errors: list[BaseException], started: int) -> None:
        try:
            self._reduce(work, started)
            self._done.extend(work)
        except BaseException as exc:  # handed to ``finish``; the run fails now
            errors.append(exc)
            if isinstance(exc, ElasticPipeError):
                failure = exc
            else:
                log.error("reduction_crashed", run=self.ids.run, exc_info=exc)
                failure = StepAborted(f"run {self.ids.run}: a gradient reduction failed: {exc!r}")
            self.mailbox.fail(self.ids.run, failure)

    def _reduce(self, work: list[Work], started: int) -> None:
        """Runs ``work``'s reductions to their end, on the job's engine (``started``: when
        the reduction was asked for, on the tracer's clock)."""
        if not work:
            return
        began = time.monotonic()
        job, ids, replicas = self.layers.job, self.ids, self.placement.num_replicas
        groups, rendezvous = self._engine
        if job.collectives:
            assert groups is not None
            mine_at = work[0][3][self.placement.replica]  # its gloo device's host
            reduce_on_groups(
                groups,
                job.collectives,
                rendezvous,
                split_address(mine_at)[0] if mine_at else "127.0.0.1",
                [(reduction, mine) for reduction, _, _, _, mine in work],
                replicas,
                self._failure,
                ids.deadline,
                _packed,
                piece,
                packed_bytes,
            )
        else:
            _over_data_channel(work, replicas, self.links, self.mailbox, ids)
        grads = sum(
            p.numel() * p.element_size()
            for _, _, params, _, _ in work
            for ps in params
            for p in ps
            if p.requires_grad
        )
        self._moved.append((2 * (replicas - 1) / replicas * grads, began, time.monotonic()))
        if self.tracer is not None:
            end = self.tracer.now_ns()
            for reduction, owned, _, _, _ in work:
                self.tracer.record(
                    Span(
                        SpanKind.REDUCE,
                        started,
                        end,
                        ids.step,
                        ids.run,
                        reduction.group,
                        owned[0],
                        owned[-1] + 1,
                        epoch=ids.epoch,
                    )
                )


def _over_data_channel(
    work: list[tuple[GroupReduction, list[int], list[Any], list[str], list[Any]]],
    replicas: int,
    links: dict[str, Link],
    mailbox: Mailbox,
    ids: RunIds,
) -> None:
    """The pieces as REDUCE data messages: every group's scatter sent, then each piece
    taken from the mailbox as it comes and answered."""
    for reduction, _, _, addresses, mine in work:
        _send(reduction.start(mine), reduction, addresses, replicas, links, ids)
    for reduction, _, _, addresses, _ in work:
        for sender, index in reduction.expected():
            key = piece_key(reduction.group, sender, replicas, index)
            value = mailbox.take(ids.run, Slot.REDUCE, key, ids.deadline)
            node = None if index is None else reduction.node_of(sender, index)
            chunk = reduction.me if index is not None else sender
            _send(
                reduction.receive(_piece(value, reduction, chunk, sender, node)),
                reduction,
                addresses,
                replicas,
                links,
                ids,
            )
    peers = {a for _, _, _, addresses, _ in work for a in addresses if a in links}
    flush([links[a] for a in sorted(peers)], mailbox, ids.run, ids.deadline)


# After a packed piece: its payload's length and CRC-32. A process group's receive fills
# a buffer of the expected size whatever the sender sent, so a short piece would leave its
# tail as it was: the trailer (in a zeroed buffer) tells a short or garbled one.
TRAILER = struct.Struct("<QI")


def _packed(send: Send) -> torch.Tensor:
    """A piece as one byte tensor (the process groups' form): its runs (``_joined``),
    one byte per flag, then ``TRAILER``."""
    flags = torch.tensor(send.piece.present, dtype=torch.uint8)
    runs = [t.contiguous().view(torch.uint8).reshape(-1) for t in _joined(send.piece.tensors)]
    payload = torch.cat([*runs, flags])
    trailer = TRAILER.pack(payload.numel(), zlib.crc32(payload.numpy().data))
    return torch.cat([payload, torch.frombuffer(bytearray(trailer), dtype=torch.uint8)])


def _payload_bytes(reduction: GroupReduction, chunk: int) -> int:
    form = reduction.chunk_form(chunk)
    return sum(n * d.itemsize for n, d, _ in form) + len(form)


def packed_bytes(reduction: GroupReduction, chunk: int) -> int:
    """The bytes of a packed piece of chunk ``chunk``, its trailer included."""
    return _payload_bytes(reduction, chunk) + TRAILER.size


def piece(
    data: torch.Tensor, reduction: GroupReduction, chunk: int, sender: int, node: object
) -> Piece:
    """A packed piece (``_packed``) of chunk ``chunk`` as a ``Piece``, checked as a data
    message's is, and against its trailer.

    Raises:
        InvalidRequest: not the bytes of this chunk's form, or a payload that its trailer
            does not describe (a short or garbled piece).
    """
    where = f"a reduction piece of group {reduction.group} from replica {sender}"
    size = _payload_bytes(reduction, chunk)
    if data.dtype != torch.uint8 or data.numel() != size + TRAILER.size:
        raise InvalidRequest(
            f"{where}: {data.numel()} {data.dtype} elements, expected {size + TRAILER.size} bytes"
        )
    data = data.cpu().contiguous()
    payload = data[:size]
    length, crc = TRAILER.unpack(data[size:].numpy().tobytes())
    actual = zlib.crc32(payload.numpy().data)
    if (length, crc) != (size, actual):
        raise InvalidRequest(
            f"{where}: its trailer says {length} bytes with CRC-32 {crc:08x}, the payload "
            f"is {size} bytes with CRC-32 {actual:08x} (a short or garbled piece)"
        )
    form = reduction.chunk_form(chunk)
    runs, start = [], 0
    for run in _joined([torch.empty(n, dtype=d) for n, d, _ in form]):
        nbytes = run.numel() * run.dtype.itemsize
        runs.append(payload[start : start + nbytes].clone().view(run.dtype))  # (aligned)
        start += nbytes
    flags = payload[start:].to(torch.bool)
    return _piece((*runs, flags), reduction, chunk, sender, node)


def _send(
    sends: list[Send],
    reduction: GroupReduction,
    addresses: list[str],
    replicas: int,
    links: dict[str, Link],
    ids: RunIds,
) -> None:
    for send in sends:
        piece = send.piece
        index = None if piece.node is None else reduction.node_index(piece.sender, piece.node)
        key = piece_key(piece.group, piece.sender, replicas, index)
        flags = torch.tensor(piece.present, dtype=torch.bool)
        value = (*_joined(piece.tensors), flags)
        links[addresses[send.to]].put(
            Outgoing("Reduce", ids.epoch, ids.run, ids.step, key, value, secret=ids.secret)
        )


def _joined(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The chunk's flat tensors joined, one per run of one dtype, on the host."""
    runs: list[list[torch.Tensor]] = []
    for t in tensors:
        if runs and runs[-1][0].dtype == t.dtype:
            runs[-1].append(t)
        else:
            runs.append([t])
    return [torch.cat(run).cpu() if len(run) > 1 else run[0].cpu() for run in runs]


def _piece(
    value: object, reduction: GroupReduction, chunk: int, sender: int, node: object
) -> Piece:
    """A received REDUCE message as a ``Piece``: its runs cut back into the chunk's
    parameters, on the parameters' device (copies: this run adds into them, and what the
    wire decoded may be read-only).

    Raises:
        InvalidRequest: not the runs and flags of this chunk's form (naming them).
    """
    where = f"a reduction piece of group {reduction.group} from replica {sender}"
    if (
        not isinstance(value, tuple)
        or not value
        or not all(isinstance(t, torch.Tensor) for t in value)
    ):
        raise InvalidRequest(
            f"{where} is not a tuple of tensors ending with its flags (got {type(value).__name__})"
        )
    *runs, flags = value
    if flags.dtype != torch.bool or flags.dim() != 1:
        raise InvalidRequest(
            f"{where}: its last tensor must be 1-d bool flags (got {flags.dtype}, {flags.dim()}-d)"
        )
    form = reduction.chunk_form(chunk)
    want = _joined([torch.empty(n, dtype=d) for n, d, _ in form])
    got = [(t.numel(), t.dtype, t.dim()) for t in runs]
    if got != [(t.numel(), t.dtype, 1) for t in want]:
        raise InvalidRequest(
            f"{where}, chunk {chunk}: runs {[(n, str(d)) for n, d, _ in got]}, expected flat "
            f"{[(t.numel(), str(t.dtype)) for t in want]}"
        )
    tensors = []
    same_dtype = itertools.groupby(form, key=lambda f: f[1])  # the runs _joined made
    for run, (_, entries) in zip(runs, same_dtype, strict=True):
        start = 0
        for n, _, device in entries:
            tensors.append(run[start : start + n].to(device, copy=True))
            start += n
    return Piece(
        reduction.group,
        chunk,
        sender,
        node,  # type: ignore[arg-type]
        tuple(tensors),
        tuple(bool(f) for f in flags.tolist()),
    )
