"""A stage's gradient reduction with the other replicas, over its data channel: after a run's
last backward, each group it holds is reduced with the group's holders in the other
replicas (``reduction.GroupReduction``), and the sums go into ``.grad``.

The pieces travel as REDUCE data messages, through the links and the mailbox that carry
activations, so they get every check activations get: the run's epoch and secret, bounds
before allocation, the deadline, mutual TLS (only a stage's certificate may send one). A
piece is a tuple of flat tensors (the chunk of each parameter it spans) ending with one
bool tensor (which of them have a gradient); its key (``DataHeader.micro_batch``) names the
group, the sender and the node (``reduction.piece_key``). Pieces are never cast to the
job's wire dtype: the sum is exact.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from elasticpipe.errors import InvalidRequest
from elasticpipe.partition import Placement
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
from elasticpipe.transport.sending import Outgoing

__all__ = ["RunIds", "reduce_gradients", "share_of"]


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
    if len(shares) != replicas or shares[placement.replica] != micro_batches:
        raise InvalidRequest(
            f"shares {list(shares)} for replica {placement.replica} of {replicas}, which "
            f"runs {micro_batches} micro-batches"
        )
    first = sum(shares[: placement.replica])
    return range(first, first + micro_batches)


def reduce_gradients(
    layers: LayerSlice,
    placement: Placement,
    shares: Sequence[int],
    links: dict[str, Link],
    mailbox: Mailbox,
    ids: RunIds,
) -> None:
    """Reduces every group this stage holds with its other holders and installs the sums.

    Raises:
        ElasticPipeError: a peer's piece was wrong (InvalidRequest), the deadline passed
            (naming the piece that did not come), or the run failed meanwhile.
    """
    total = sum(shares)
    starts = [sum(shares[:r]) for r in range(len(shares))]
    ranges = [range(a, a + m) for a, m in zip(starts, shares, strict=True)]
    partials = layers.take_partials()
    me, replicas = placement.replica, placement.num_replicas
    work = []
    for group in placement.groups:
        owned = [layer for layer in group.layers if layer in layers.optimizers]
        if not owned:  # no parameters (an activation, a dropout): nothing to reduce
            continue
        params = [list(layers.layers[layer].parameters()) for layer in owned]
        like = flatten([[None] * len(p) for p in params], params)[0]
        reduction = GroupReduction(group.index, me, ranges, total, like)
        mine = [
            (node, flatten([partials[layer][j][1] for layer in owned], params))
            for j, (node, _) in enumerate(partials[owned[0]])
        ]
        addresses = [h.address for h in group.holders]
        _send(reduction.start(mine), reduction, addresses, replicas, links, ids)
        work.append((reduction, owned, params, addresses))
    for reduction, _, _, addresses in work:
        for sender, index in reduction.expected():
            key = piece_key(reduction.group, sender, replicas, index)
            value = mailbox.take(ids.run, Slot.REDUCE, key, ids.deadline)
            node = None if index is None else reduction.node_of(sender, index)
            piece = _piece(
                value, reduction.group, me if index is not None else sender, sender, node
            )
            _send(reduction.receive(piece), reduction, addresses, replicas, links, ids)
    for reduction, owned, params, _ in work:
        layers.install_grads(dict(zip(owned, unflatten(reduction.result(), params), strict=True)))


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
        value = (*piece.tensors, flags)
        links[addresses[send.to]].put(
            Outgoing("Reduce", ids.epoch, ids.run, ids.step, key, value, secret=ids.secret)
        )


def _piece(value: object, group: int, chunk: int, sender: int, node: object) -> Piece:
    """A received REDUCE message as a ``Piece`` (its tensors copied: this run adds into
    them, and what the wire decoded may be read-only)."""
    if (
        not isinstance(value, tuple)
        or not value
        or not all(isinstance(t, torch.Tensor) for t in value)
    ):
        raise InvalidRequest(
            f"a reduction piece of group {group} from replica {sender} is not a tuple of "
            f"tensors ending with its flags (got {type(value).__name__})"
        )
    *tensors, flags = value
    if flags.dtype != torch.bool or flags.dim() != 1:
        raise InvalidRequest(
            f"a reduction piece of group {group} from replica {sender}: its last tensor must "
            f"be 1-d bool flags (got {flags.dtype}, {flags.dim()}-d)"
        )
    return Piece(
        group,
        chunk,
        sender,
        node,  # type: ignore[arg-type]
        tuple(t.clone() for t in tensors),
        tuple(bool(f) for f in flags.tolist()),
    )
