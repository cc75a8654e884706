"""Binding a stage process to CPUs: ``elasticpipe stage --cpus 0-3``, and the cores a
``LocalCluster`` gives each of its stages.

A stage's compute thread waits at every hand-off (a micro-batch from its neighbour) and
wakes on whichever core the scheduler picks, leaving the caches that held its layers'
weights and activations on the last one. Bound to its own cores, it wakes where they are:
on the 2-core development machine, two stages of ``bench/vs_torch.py``'s GPT each bound to
one core stepped 0.91x and 0.93x the time of the same stages unbound (``bench/ab.py``-style
A/B, both orders), four emulated devices on two cores 0.91x.

Lists are written as Linux writes them (``/proc/PID/status``' ``Cpus_allowed_list``,
``taskset -c``): ``0-3,8,10-11``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection, Sequence

__all__ = ["available", "bind", "format_cpus", "parse_cpus", "share", "spread", "stage_cpus"]


MAX_CPU = 1 << 16  # above any CPU number a kernel gives (Linux's NR_CPUS is at most 8192)


def parse_cpus(text: str) -> frozenset[int]:
    """The CPUs of a list such as ``0-3,8``.

    Raises:
        ValueError: ``text`` is no such list: names the bad item.
    """
    cpus: set[int] = set()
    for item in text.split(","):
        lo, dash, hi = (part.strip() for part in item.partition("-"))
        if not all(n.isascii() and n.isdecimal() for n in (lo, hi) if n or dash) or not lo:
            raise ValueError(
                f"{item.strip()!r} in CPU list {text!r} is neither a CPU number nor a range "
                "such as 0-3"
            )
        first = int(lo)
        last = int(hi) if dash else first
        if last < first or last >= MAX_CPU:
            raise ValueError(f"{item.strip()!r} in CPU list {text!r} is no range of CPUs")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def format_cpus(cpus: Collection[int]) -> str:
    """``cpus`` as a list ``parse_cpus`` reads back: ranges for runs, ascending."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def available() -> frozenset[int] | None:
    """The CPUs this process may run on; None where the platform cannot bind (not Linux)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    return frozenset(os.sched_getaffinity(0))


def bind(cpus: Collection[int]) -> None:
    """Binds this process -- every thread it has now, and so every thread they start -- to
    ``cpus``.

    Raises:
        ValueError: a CPU of ``cpus`` is outside this process's affinity now (naming it and
            those inside), or this platform cannot bind a process.
    """
    allowed = available()
    if allowed is None:
        raise ValueError("binding a process to CPUs needs Linux (os.sched_setaffinity)")
    outside = set(cpus) - allowed
    if outside:
        raise ValueError(
            f"CPU {format_cpus(outside)} is outside the CPUs this process may run on "
            f"({format_cpus(allowed)})"
        )
    own = [0]  # this thread (Linux: affinity is per thread; new threads inherit it)
    with contextlib.suppress(OSError):  # no /proc: the others' is this thread's from here on
        own += [int(tid) for tid in os.listdir("/proc/self/task")]
    for tid in own:
        with contextlib.suppress(ProcessLookupError):  # that thread ended meanwhile
            os.sched_setaffinity(tid, cpus)


def share(stages: int, per_stage: int, cpus: int) -> int | None:
    """How many of ``cpus`` CPUs each of ``stages`` stages on one host is bound to, at
    least ``per_stage`` (its torch threads): an equal part of them all when there are
    enough, so that a stage's other threads (its sends and receives, gRPC) have cores
    beside its compute; ``per_stage`` when the stages fill the CPUs evenly, each CPU then
    shared by as many stages; None when they cannot be spread evenly (3 stages on 2 CPUs:
    two would share one while one had the other: left unbound, the kernel balances them).
    """
    if stages < 1 or cpus < 1:
        return None
    per_stage = max(1, per_stage)
    if stages * per_stage <= cpus:
        return cpus // stages
    if per_stage <= cpus and (stages * per_stage) % cpus == 0:
        return per_stage
    return None


def spread(index: int, per_stage: int, cpus: Sequence[int]) -> frozenset[int]:
    """The ``per_stage`` CPUs of ``cpus`` that stage ``index`` of a cluster on one host is
    bound to (``per_stage`` from ``share``): stage 0 the first ones, stage 1 the next,
    around again once all are given (with one CPU a stage and more stages than CPUs, stage
    k shares with stage k + len(cpus): neighbours in a chain never share one)."""
    if not cpus:
        raise ValueError("no CPU to spread the stages over")
    n = min(max(1, per_stage), len(cpus))
    return frozenset(cpus[(index * n + k) % len(cpus)] for k in range(n))


def stage_cpus(
    index: int, stages: int, per_stage: int, cpus: Sequence[int]
) -> frozenset[int] | None:
    """The CPUs stage ``index`` of ``stages`` on one host is bound to (``share``, then
    ``spread`` over ``cpus``); None where they stay unbound (no CPU given, or the stages
    cannot be spread evenly)."""
    each = share(stages, per_stage, len(cpus)) if cpus else None
    return spread(index, each, cpus) if each else None
