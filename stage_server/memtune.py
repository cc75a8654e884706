"""Keeping freed memory for reuse, within a bound: the stage process's malloc settings.

Every activation a stage receives is a new tensor, freed a step later. glibc's malloc
serves a block of a few MiB or more with a fresh ``mmap`` and returns it to the kernel
on free, so the next tensor's every 4 KiB page is faulted in again as it is written: on a
virtual machine that costs more than the copy itself (``bench/transfer.py`` prints the
faults per GB and the price of one). A stage therefore tells malloc, once at start-up
(``keep_freed_memory``), to serve every block from its heap (no ``mmap``), from one arena
(so that what is kept is one pool, not one per thread), and not to trim the heap's top on
every free: the next tensor reuses pages already mapped -- what PyTorch's CUDA caching
allocator does on a GPU, and what jemalloc or tcmalloc would do.

Freed memory between live blocks is never returned by itself, so what is kept is bounded
explicitly: after each run the stage calls ``bound``, which returns every free page to the
kernel (``malloc_trim``) once more than ``KEEP_BYTES`` lie free in the heap. Steady
training reuses the same holes and never trims; a change of shapes (a migration, another
batch size) may leave up to ``KEEP_BYTES`` free for one step.

``ELASTICPIPE_MALLOC_TUNE=0`` leaves malloc as it is; ``ELASTICPIPE_MALLOC_KEEP_BYTES``
sets the bound (default 1 GiB). Nothing happens outside glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from typing import Any

from elasticpipe.logs import get_logger

log = get_logger(__name__)

ENV = "ELASTICPIPE_MALLOC_TUNE"
ENV_KEEP = "ELASTICPIPE_MALLOC_KEEP_BYTES"
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int: the heap's top is never trimmed
KEEP_BYTES = 1 << 30


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


class _Tuning:
    """What ``keep_freed_memory`` set: glibc (None: malloc untouched) and the bound."""

    libc: Any = None
    keep = KEEP_BYTES


_TUNING = _Tuning()


def _glibc() -> Any:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    needed = ("mallopt", "malloc_trim", "mallinfo2")
    if libc is None or not all(hasattr(libc, f) for f in needed):
        return None  # not glibc (or older than 2.33): its allocator decides
    libc.mallinfo2.restype = _MallInfo2
    return libc


def keep_freed_memory() -> bool:
    """Sets the process's malloc to reuse freed memory (``bound`` then keeps it bounded);
    True if it did."""
    if os.environ.get(ENV, "1") == "0":
        return False
    libc = _glibc()
    if libc is None:
        return False
    _TUNING.keep = int(os.environ.get(ENV_KEEP, KEEP_BYTES))
    done = all(
        libc.mallopt(option, value)
        for option, value in (
            (M_ARENA_MAX, 1),  # one heap: the memory kept is one pool, not one per thread
            (M_MMAP_MAX, 0),
            (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        )
    )
    if done:
        _TUNING.libc = libc
    log.debug("malloc_tuned", keep_bytes=_TUNING.keep, ok=done)
    return done


def free_bytes() -> int | None:
    """Bytes free in malloc's heap, kept for reuse; None when malloc was not tuned."""
    libc = _TUNING.libc
    return int(libc.mallinfo2().fordblks) if libc is not None else None


def bound() -> bool:
    """Returns the heap's free pages to the kernel if more than the bound lie free; True
    if it did (after a run: ``Stage.run_step``)."""
    free = free_bytes()
    if free is None or free <= _TUNING.keep:
        return False
    _TUNING.libc.malloc_trim(0)
    log.debug("malloc_trimmed", free_bytes=free, keep_bytes=_TUNING.keep)
    return True
