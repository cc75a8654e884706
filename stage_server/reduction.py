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

__all__ = [
    "MAX_KEYS",
    "GroupReduction",
    "Partial",
    "Piece",
    "Send",
    "chunk_bounds",
    "cut",
    "flatten",
    "piece_key",
    "spanned",
    "unflatten",
]

# A piece's key on the wire (``DataHeader.micro_batch`` of a REDUCE message): its group,
# its sender, and which of the sender's nodes it is (a reduced chunk: the last slot).
NODE_SLOTS = 32  # a share covers at most 2 log2(M) + 1 <= 25 nodes for M <= 4096
MAX_KEYS = 1 << 24

Tensors = list[torch.Tensor]  # one flat tensor per trainable parameter, in order
Partial = tuple[Tensors, list[bool]]  # the tensors, and which parameters have a gradient


def piece_key(group: int, sender: int, replicas: int, node: int | None) -> int:
    """The key of a piece of ``group`` from replica ``sender``: of its ``node``-th covering
    node (scatter), or of its reduced chunk (``node`` None).

    Raises:
        InvalidRequest: a key past ``MAX_KEYS`` (too many groups and replicas), or a node
            index past ``NODE_SLOTS``.
    """
    slot = NODE_SLOTS - 1 if node is None else node
    key = (group * replicas + sender) * NODE_SLOTS + slot
    if not 0 <= slot < NODE_SLOTS or key >= MAX_KEYS:
        raise InvalidRequest(
            f"no key for group {group}, replica {sender} of {replicas}, node {node}: "
            f"at most {MAX_KEYS // NODE_SLOTS} groups x replicas"
        )
    return key


def chunk_bounds(elements: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous element ranges covering ``[0, elements)``, as equal as can be."""
    return [(c * elements // parts, (c + 1) * elements // parts) for c in range(parts)]


def spanned(sizes: Sequence[int], lo: int, hi: int) -> list[int]:
    """The indices of the tensors (of ``sizes`` elements, laid end to end) that elements
    ``[lo, hi)`` meet."""
    found, start = [], 0
    for j, n in enumerate(sizes):
        if start < hi and lo < start + n:
            found.append(j)
        start += n
    return found


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
) -> Partial:
    """A group's gradients as the reduction carries them: per trainable parameter of each
    layer, in order, one flat tensor, and whether it has a gradient at all (one that no
    micro-batch reached has none, as in ``.grad``: zeros would let weight decay or momentum
    move it, and 0.0 + -0.0 is not -0.0). Frozen parameters are left out."""
    tensors, present = [], []
    for layer_grads, layer_params in zip(grads, params, strict=True):
        for g, p in zip(layer_grads, layer_params, strict=True):
            if p.requires_grad:
                tensors.append(g.reshape(-1) if g is not None else p.new_zeros(p.numel()))
                present.append(g is not None)
    return tensors, present


def unflatten(
    reduced: Partial, params: Sequence[Sequence[torch.Tensor]]
) -> list[list[torch.Tensor | None]]:
    """``flatten`` undone: per layer, its parameters' gradients in their shapes (None for a
    frozen parameter, or one without a gradient)."""
    tensors, present = iter(reduced[0]), iter(reduced[1])
    out: list[list[torch.Tensor | None]] = []
    for layer_params in params:
        grads: list[torch.Tensor | None] = []
        for p in layer_params:
            if p.requires_grad:
                t, has = next(tensors), next(present)
                grads.append(t.reshape(p.shape) if has else None)
            else:
                grads.append(None)
        out.append(grads)
    return out


def _plus(left: Partial, right: Partial) -> Partial:
    """Two partials added: both present, added (into ``left``, which is owned); a
    parameter without a gradient on one side adds nothing, as a ``.grad`` of None."""
    tensors = [
        a.add_(b) if has_a and has_b else (b if has_b else a)
        for a, b, has_a, has_b in zip(left[0], right[0], left[1], right[1], strict=True)
    ]
    return tensors, [a or b for a, b in zip(left[1], right[1], strict=True)]


@dataclass(frozen=True)
class Piece:
    """What one holder sends another: a chunk of one of its tree nodes' partial sums
    (scatter), or a chunk it reduced (gather: ``node`` None)."""

    group: int
    chunk: int
    sender: int  # the sender's replica
    node: Node | None
    tensors: tuple[torch.Tensor, ...]
    present: tuple[bool, ...]  # per tensor: whether its parameter has a gradient there


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
        like: this holder's gradients' form (``flatten``'s tensors): the sizes, dtypes and
            device every piece must have.
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
        sizes = [t.numel() for t in self._like]
        self._bounds = chunk_bounds(sum(sizes), len(self._shares))
        self._spans = [spanned(sizes, lo, hi) for lo, hi in self._bounds]
        self._covers = [covering(s.start, s.stop, total) if s else [] for s in self._shares]
        self._mine: TreeSum[Partial] = TreeSum(total, _plus)
        self._chunks: dict[int, Partial] = {}
        self._started = False

    @property
    def done(self) -> bool:
        """Whether every chunk is reduced here."""
        return len(self._chunks) == len(self._shares)

    def expected(self) -> list[tuple[int, int | None]]:
        """Every piece this holder will receive, as (sender, node index or None for a
        reduced chunk): the others' nodes of its own chunk first, then their chunks."""
        scatter = [
            (r, j)
            for r in range(len(self._shares))
            if r != self.me
            for j in range(len(self._covers[r]))
        ]
        return scatter + [(r, None) for r in range(len(self._shares)) if r != self.me]

    def node_index(self, sender: int, node: Node) -> int:
        """Which of ``sender``'s covering nodes ``node`` is (its slot in ``piece_key``).

        Raises:
            InvalidRequest: ``node`` is none of them.
        """
        if node not in self._covers[sender]:
            raise InvalidRequest(f"group {self.group}: node {node} is not of replica {sender}")
        return self._covers[sender].index(node)

    def chunk_form(self, chunk: int) -> list[tuple[int, torch.dtype, torch.device]]:
        """The elements, dtype and device of each tensor of chunk ``chunk``'s pieces."""
        lo, hi = self._bounds[chunk]
        return [(t.numel(), t.dtype, t.device) for t in cut(self._like, lo, hi)]

    def node_of(self, sender: int, index: int) -> Node:
        """``sender``'s ``index``-th covering node."""
        return self._covers[sender][index]

    def start(self, partials: Sequence[tuple[Node, Partial]]) -> list[Send]:
        """Hands this holder's partial sums over (one per node its share covers, in order,
        as ``flatten`` makes them): returns the scatter's pieces (and the gather's, if that
        completes this holder's chunk).

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
        everything = list(range(len(self._like)))
        for node, (flat, present) in partials:
            self._check(self.me, node, list(flat), list(present), self._like, everything)
            for c, (lo, hi) in enumerate(self._bounds):
                pieces = cut(list(flat), lo, hi)
                has = [present[j] for j in self._spans[c]]
                if c == self.me:  # folded here, in place: a copy, as the others are sent
                    self._mine.add_node(node, ([t.clone() for t in pieces], has))
                else:
                    piece = Piece(self.group, c, self.me, node, tuple(pieces), tuple(has))
                    sends.append(Send(c, piece))
        return sends + self._gather_if_complete()

    def receive(self, piece: Piece) -> list[Send]:
        """Takes a piece from another holder (its tensors this reduction's to keep and
        add into); returns the gather's pieces once this holder's chunk is complete.

        Raises:
            InvalidRequest: a piece of another group, from a stranger or this holder
                itself, of a node the sender's share does not cover or that came already,
                a reduced chunk not from its reducer or that came already, or tensors of
                other sizes, dtypes or device than the chunk's (naming what is wrong).
        """
        where = f"group {self.group}: a piece from replica {piece.sender}, chunk {piece.chunk}"
        replicas = len(self._shares)
        if piece.group != self.group:
            raise InvalidRequest(f"{where} is of group {piece.group}")
        if not (0 <= piece.sender < replicas) or piece.sender == self.me:
            raise InvalidRequest(f"{where}: no other holder is in replica {piece.sender}")
        if not 0 <= piece.chunk < replicas:
            raise InvalidRequest(f"{where}: there are {replicas} chunks")
        lo, hi = self._bounds[piece.chunk]
        tensors, present = list(piece.tensors), list(piece.present)
        self._check(
            piece.sender,
            piece.node,
            tensors,
            present,
            cut(self._like, lo, hi),
            self._spans[piece.chunk],
        )
        if piece.node is None:  # gather: chunk c comes reduced from holder c
            if piece.chunk != piece.sender or piece.chunk in self._chunks:
                raise InvalidRequest(f"{where}: not its reducer's, or it came already")
            self._chunks[piece.chunk] = (tensors, present)
            return []
        if piece.chunk != self.me:
            raise InvalidRequest(f"{where}: replica {self.me} reduces chunk {self.me}")
        if piece.node not in self._covers[piece.sender]:
            raise InvalidRequest(f"{where}: node {piece.node} is not of the sender's share")
        try:
            self._mine.add_node(piece.node, (tensors, present))
        except ValueError as exc:
            raise InvalidRequest(f"{where}: {exc}") from None
        return self._gather_if_complete()

    def result(self) -> Partial:
        """The group's summed gradients (``unflatten`` takes them), and which parameters
        have one.

        Raises:
            InvalidRequest: chunks are still missing (naming them).
        """
        missing = [c for c in range(len(self._shares)) if c not in self._chunks]
        if missing:
            raise InvalidRequest(f"group {self.group}: chunks {missing} not reduced yet")
        out = [torch.empty_like(t) for t in self._like]
        present = [False] * len(self._like)
        for c, (lo, hi) in enumerate(self._bounds):
            tensors, has = self._chunks[c]
            for target, piece in zip(cut(out, lo, hi), tensors, strict=True):
                target.copy_(piece)
            for j, flag in zip(self._spans[c], has, strict=True):
                present[j] = flag  # (a parameter cut in two: both chunks say the same)
        return out, present

    def _gather_if_complete(self) -> list[Send]:
        if self.me in self._chunks or not self._mine.complete:
            return []
        tensors, present = self._chunks[self.me] = self._mine.result()
        piece = Piece(self.group, self.me, self.me, None, tuple(tensors), tuple(present))
        return [Send(r, piece) for r in range(len(self._shares)) if r != self.me]

    def _check(
        self,
        sender: int,
        node: Node | None,
        tensors: list[torch.Tensor],
        present: list[bool],
        like: list[torch.Tensor],
        spans: list[int],
    ) -> None:
        got = [(t.numel(), t.dtype, t.device) for t in tensors]
        want = [(t.numel(), t.dtype, t.device) for t in like]
        if got != want or any(t.dim() != 1 for t in tensors) or len(present) != len(spans):
            raise InvalidRequest(
                f"group {self.group}: replica {sender}'s node {node} has {len(present)} "
                f"flags and tensors {[(n, str(d), str(v)) for n, d, v in got]}, expected "
                f"{len(spans)} flags and flat {[(n, str(d), str(v)) for n, d, v in want]}"
            )
