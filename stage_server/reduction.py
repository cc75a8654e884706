"""One reduction group's gradient sum among its holders: reduce-scatter, then all-gather,
every chunk folded once, in the canonical tree, so that every holder ends with the same bits.

A group (``elasticpipe.layout.Group``) is a run of layers that one stage holds in each of
the R replicas. Each holder ran its replica's share of the step's M micro-batches and
summed each layer's gradients over the tree nodes its share covers (``SliceState``'s
``take_partials``). Its gradients, one flat tensor per parameter in the group's order, are
cut into R chunks of elements; holder c folds chunk c::

    holders a (replica 0, micro-batches 0-4) and d (replica 1, 5-7), M = 8, 2 chunks

    a's partials: [0,4) and 4          d's partials: 5 and [6,8)
    scatter: a sends d chunk 1 of [0,4) and of 4; d sends a chunk 0 of 5 and of [6,8)
    fold:    a folds chunk 0 of the four nodes in the tree over 0-7; d folds chunk 1
    gather:  a sends d its reduced chunk 0; d sends a chunk 1
    result:  a and d hold the same bytes: each chunk was computed once

The fold is ``TreeSum`` over the whole step, so the sum is the one ``LocalPipeline`` computes
whatever the shares. Pure: ``start`` and ``receive`` return the pieces to send; the stage
carries them over its data channel and feeds back what arrives. Every piece is checked
(group, chunk, sender, tree node, tensor sizes and dtypes) before it is used.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from elasticpipe.errors import InvalidRequest
from elasticpipe.training.gradsum import Node, TreeSum, covering

__all__ = ["GroupReduction", "Piece", "Send", "chunk_bounds", "cut", "flatten", "unflatten"]

Tensors = list[torch.Tensor]  # one flat tensor per parameter of the group, in order


def chunk_bounds(elements: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous element ranges covering ``[0, elements)``, as equal as can be."""
    return [(c * elements // parts, (c + 1) * elements // parts) for c in range(parts)]


def cut(flat: Sequence[torch.Tensor], lo: int, hi: int) -> Tensors:
    """Views of elements ``[lo, hi)`` of the tensors laid end to end (one view per tensor
    the range meets, in order; none for a tensor it misses)."""
    pieces, start = [], 0
    for t in flat:
        end = start + t.numel()
        if start < hi and lo < end:
            pieces.append(t[max(lo, start) - start : min(hi, end) - start])
        start = end
    return pieces


def flatten(
    grads: Sequence[Sequence[torch.Tensor | None]], params: Sequence[Sequence[torch.Tensor]]
) -> Tensors:
    """A group's gradients as the reduction carries them: per layer, per parameter, one
    flat tensor (zeros for a parameter without a gradient)."""
    return [
        g.reshape(-1) if g is not None else torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
        for layer_grads, layer_params in zip(grads, params, strict=True)
        for g, p in zip(layer_grads, layer_params, strict=True)
    ]


def unflatten(
    flat: Sequence[torch.Tensor], params: Sequence[Sequence[torch.Tensor]]
) -> list[list[torch.Tensor | None]]:
    """``flatten`` undone: per layer, its parameters' gradients in their shapes."""
    out: list[list[torch.Tensor | None]] = []
    it = iter(flat)
    for layer_params in params:
        out.append([next(it).reshape(p.shape) for p in layer_params])
    return out


def _plus(left: Tensors, right: Tensors) -> Tensors:
    return [a.add_(b) for a, b in zip(left, right, strict=True)]  # left is owned


@dataclass(frozen=True)
class Piece:
    """What one holder sends another: a chunk of one of its tree nodes' partial sums
    (scatter), or a chunk it reduced (gather: ``node`` None)."""

    group: int
    chunk: int
    sender: int  # the sender's replica
    node: Node | None
    tensors: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Send:
    """A piece to send to the holder in replica ``to``."""

    to: int
    piece: Piece


class GroupReduction:
    """The reduction of group ``group`` as seen by its holder in replica ``me``.

    Args:
        group: the group's index in the layout's ``groups()``.
        me: this holder's replica.
        shares: every replica's micro-batches, in replica order.
        total: the step's micro-batch count ``M``.
        like: this holder's gradients' form (one flat tensor per parameter, in order): the
            sizes and dtypes every piece must have.
    """

    def __init__(
        self,
        group: int,
        me: int,
        shares: Sequence[range],
        total: int,
        like: Sequence[torch.Tensor],
    ):
        self.group, self.me, self.total = group, me, total
        self._shares = [range(s.start, s.stop) for s in shares]
        self._like = list(like)
        self._bounds = chunk_bounds(sum(t.numel() for t in self._like), len(self._shares))
        self._forms = [
            [(p.numel(), p.dtype) for p in cut(self._like, lo, hi)] for lo, hi in self._bounds
        ]
        self._covers = [covering(s.start, s.stop, total) if s else [] for s in self._shares]
        self._mine: TreeSum[Tensors] = TreeSum(total, _plus)
        self._chunks: dict[int, Tensors] = {}
        self._started = False

    @property
    def done(self) -> bool:
        """Whether every chunk is reduced here."""
        return len(self._chunks) == len(self._shares)

    def start(self, partials: Sequence[tuple[Node, Sequence[torch.Tensor]]]) -> list[Send]:
        """Hands this holder's partial sums over (one per node its share covers, in order):
        returns the scatter's pieces (and the gather's, if that completes the chunk).

        Raises:
            InvalidRequest: the nodes are not the ones this holder's share covers, or a
                partial's form differs from ``like``.
        """
        if self._started:
            raise InvalidRequest(f"group {self.group}: the reduction was started already")
        self._started = True
        nodes = [node for node, _ in partials]
        if nodes != self._covers[self.me]:
            raise InvalidRequest(
                f"group {self.group}: replica {self.me} holds nodes "
                f"{[str(n) for n in nodes]}, its share covers "
                f"{[str(n) for n in self._covers[self.me]]}"
            )
        sends = []
        for node, flat in partials:
            self._check_form(self.me, node, list(flat), [(t.numel(), t.dtype) for t in self._like])
            for c, (lo, hi) in enumerate(self._bounds):
                pieces = cut(list(flat), lo, hi)
                if c == self.me:  # folded here, in place: a copy, as the others are sent
                    self._mine.add_node(node, [p.clone() for p in pieces])
                else:
                    sends.append(Send(c, Piece(self.group, c, self.me, node, tuple(pieces))))
        return sends + self._gather_if_complete()

    def receive(self, piece: Piece) -> list[Send]:
        """Takes a piece from another holder; returns the gather's pieces once this
        holder's chunk is complete.

        Raises:
            InvalidRequest: a piece of another group, from a stranger or this holder
                itself, of a node the sender's share does not cover or that came already,
                a reduced chunk not from its reducer or that came already, or tensors of
                other sizes or dtypes than the chunk's (naming what is wrong).
        """
        where = f"group {self.group}: a piece from replica {piece.sender}, chunk {piece.chunk}"
        replicas = len(self._shares)
        if piece.group != self.group:
            raise InvalidRequest(f"{where} is of group {piece.group}")
        if not (0 <= piece.sender < replicas) or piece.sender == self.me:
            raise InvalidRequest(f"{where}: no other holder is in replica {piece.sender}")
        if not 0 <= piece.chunk < replicas:
            raise InvalidRequest(f"{where}: there are {replicas} chunks")
        tensors = list(piece.tensors)
        self._check_form(piece.sender, piece.node, tensors, self._forms[piece.chunk])
        if piece.node is None:  # gather: chunk c comes reduced from holder c
            if piece.chunk != piece.sender or piece.chunk in self._chunks:
                raise InvalidRequest(f"{where}: not its reducer's, or it came already")
            self._chunks[piece.chunk] = tensors
            return []
        if piece.chunk != self.me:
            raise InvalidRequest(f"{where}: replica {self.me} reduces chunk {self.me}")
        if piece.node not in self._covers[piece.sender]:
            raise InvalidRequest(f"{where}: node {piece.node} is not of the sender's share")
        try:
            self._mine.add_node(piece.node, tensors)
        except ValueError as exc:
            raise InvalidRequest(f"{where}: {exc}") from None
        return self._gather_if_complete()

    def result(self) -> Tensors:
        """The group's summed gradients, one flat tensor per parameter, in order.

        Raises:
            InvalidRequest: chunks are still missing (naming them).
        """
        missing = [c for c in range(len(self._shares)) if c not in self._chunks]
        if missing:
            raise InvalidRequest(f"group {self.group}: chunks {missing} not reduced yet")
        out = [torch.empty_like(t) for t in self._like]
        for c, (lo, hi) in enumerate(self._bounds):
            for target, piece in zip(cut(out, lo, hi), self._chunks[c], strict=True):
                target.copy_(piece)
        return out

    def _gather_if_complete(self) -> list[Send]:
        if self.me in self._chunks or not self._mine.complete:
            return []
        reduced = self._mine.result()
        self._chunks[self.me] = reduced
        return [
            Send(r, Piece(self.group, self.me, self.me, None, tuple(reduced)))
            for r in range(len(self._shares))
            if r != self.me
        ]

    def _check_form(
        self,
        sender: int,
        node: Node | None,
        tensors: list[torch.Tensor],
        form: list[tuple[int, torch.dtype]],
    ) -> None:
        got = [(t.numel(), t.dtype) for t in tensors]
        if got != form or any(t.dim() != 1 for t in tensors):
            raise InvalidRequest(
                f"group {self.group}: replica {sender}'s node {node} has tensors "
                f"{[(n, str(d)) for n, d in got]}, expected flat {[(n, str(d)) for n, d in form]}"
            )
