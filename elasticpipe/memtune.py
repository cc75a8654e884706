"""Keeping freed memory for reuse: the stage process's malloc settings.

Every activation a stage receives is a new tensor, freed a step later. glibc's malloc
serves a block of a few MiB or more with a fresh ``mmap`` and returns it to the kernel
on free, so the next tensor's every 4 KiB page is faulted in again as it is written: on a
virtual machine that costs more than the copy itself (``bench/transfer.py`` prints the
faults per GB and the price of one). A stage therefore tells malloc, once at start-up,
never to ``mmap`` a block and to keep up to ``TRIM_THRESHOLD`` bytes of freed memory
instead of returning them, so that the next tensor reuses pages already mapped -- what
PyTorch's CUDA caching allocator does on a GPU, and what jemalloc or tcmalloc would do.
The price: the process keeps its high-water mark of freed heap (at most the threshold).

``ELASTICPIPE_MALLOC_TUNE=0`` leaves malloc as it is. Nothing happens outside glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

from elasticpipe.logs import get_logger

log = get_logger(__name__)

ENV = "ELASTICPIPE_MALLOC_TUNE"
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int: 2 GiB of freed heap kept at most


def keep_freed_memory() -> bool:
    """Sets the process's malloc to reuse freed memory; True if it did."""
    if os.environ.get(ENV, "1") == "0":
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:  # not glibc: its allocator decides
        return False
    done = all(
        mallopt(option, value)
        for option, value in (
            (M_MMAP_MAX, 0),
            (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            (M_ARENA_MAX, 1),  # one heap: the memory kept is the process's peak, not one per thread
        )
    )
    log.debug("malloc_tuned", keep_freed_bytes=TRIM_THRESHOLD, ok=done)
    return done
