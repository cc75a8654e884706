"""A ``Pipeline``'s ``replicas`` and ``stages`` arguments, checked, as the setup request's
fields.

==========================  ==========================================================
``stages=4``                one pipeline of 4 stages (today's job)
``replicas=2, stages=3``    2 replicas of 3 stages each
``stages=(2, 3)``           2 replicas, of 2 and of 3 stages (``replicas=2`` may be said)
``replicas="auto"``         the coordinator chooses the replicas and their lengths from
                            the live stages (``stages=N``: from N of them)
==========================  ==========================================================
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from elasticpipe.errors import InvalidRequest
from elasticpipe.layout import Layout

__all__ = ["Asked", "ask", "check_batch"]


@dataclass(frozen=True)
class Asked:
    """The setup request's fields: ``num_stages``, ``replica_stages``, ``auto_replicas``."""

    num_stages: int
    replica_stages: tuple[int, ...] = ()
    auto: bool = False


def _count(value: object, what: str) -> int:
    """``value`` if it is an int >= 1 (InvalidRequest naming ``what`` if not)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequest(f"{what} must be an int >= 1 (got {value!r})")
    return value


def ask(replicas: int | str | None, stages: int | Sequence[int] | None) -> Asked:
    """Checks ``replicas`` and ``stages`` (see the module's table).

    Raises:
        InvalidRequest: naming the bad value.
    """
    if replicas == "auto":
        return Asked(
            0 if stages is None else _count(stages, "stages (with replicas='auto')"), (), True
        )
    if isinstance(stages, Sequence) and not isinstance(stages, str):
        sizes = tuple(_count(n, f"stages[{i}]") for i, n in enumerate(stages))
        if not sizes or (replicas is not None and _count(replicas, "replicas") != len(sizes)):
            raise InvalidRequest(
                f"stages={tuple(stages)!r} gives {len(sizes)} replica lengths, but "
                f"replicas={replicas!r}"
            )
    else:
        count = 1 if replicas is None else _count(replicas, "replicas")
        if stages is None:
            if count > 1:
                raise InvalidRequest(
                    f"replicas={count} needs stages: each replica's length (stages=3), or "
                    f"{count} lengths (stages=(2, 3)); or replicas='auto'"
                )
            return Asked(0)
        sizes = (_count(stages, "stages"),) * count
    if len(sizes) == 1:
        return Asked(sizes[0])
    return Asked(sum(sizes), sizes)


def check_batch(layout: Layout | None, micro_batches: int) -> None:
    """Refuses a step split into fewer micro-batches than a job of several replicas
    shares out (each replica runs at least one, so its batch needs that many samples).

    Raises:
        InvalidRequest: naming both counts.
    """
    if layout is not None and len(layout.replicas) > 1 and micro_batches != layout.micro_batches:
        raise InvalidRequest(
            f"a batch of {micro_batches} micro-batches for a job of {len(layout.replicas)} "
            f"replicas sharing {layout.micro_batches}: give every step at least "
            "micro_batches samples"
        )
