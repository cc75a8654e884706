"""A stage's memory: what it offers its job, and how its process keeps freed memory.

**What a stage offers its job** (``detect``; ``parse_bytes`` reads ``--memory``). A stage
measures its capacity once, at start-up, and reports it with its registration and every
heartbeat; the coordinator plans so that no stage holds more than that:

* CUDA: the free memory ``torch.cuda.mem_get_info`` reports, less ``CUDA_HEADROOM`` of the
  device's total (allocator fragmentation, CUDA context, kernels' workspaces);
* CPU: ``--memory`` when given, else the kernel's ``MemAvailable`` (``/proc/meminfo``), less
  ``CPU_HEADROOM`` of it; 0 (unknown, no cap) where neither exists.

Measured at start-up rather than live: once the job runs, free memory shrinks by what the
stage itself holds, which must not read as a smaller device.

**Keeping freed memory for reuse, within a bound**: the stage process's malloc settings.
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
import re
from pathlib import Path
from typing import Any

import torch

from elasticpipe.errors import InvalidRequest
from elasticpipe.logs import get_logger

__all__ = [
    "CPU_HEADROOM",
    "CUDA_HEADROOM",
    "bound",
    "detect",
    "free_bytes",
    "keep_freed_memory",
    "parse_bytes",
]

log = get_logger(__name__)

CUDA_HEADROOM = 0.10
CPU_HEADROOM = 0.10
MEMINFO = Path("/proc/meminfo")

_UNITS = {
    "": 1,
    "B": 1,
    "K": 1 << 10,
    "KB": 1000,
    "KIB": 1 << 10,
    "M": 1 << 20,
    "MB": 1000**2,
    "MIB": 1 << 20,
    "G": 1 << 30,
    "GB": 1000**3,
    "GIB": 1 << 30,
    "T": 1 << 40,
    "TB": 1000**4,
    "TIB": 1 << 40,
}
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str) -> int:
    """Parses a byte count such as ``1048576``, ``512M``, ``2G``, ``1.5GiB`` or ``800MB``.

    ``K``, ``M``, ``G``, ``T`` (and ``KiB``...) are binary (1024-based); ``KB``, ``MB``...
    are decimal.

    Raises:
        InvalidRequest: not a positive number with a known unit (the message names it).
    """
    match = _PATTERN.match(text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS:
        raise InvalidRequest(
            f"invalid memory size {text!r}: expected a number of bytes with an optional "
            "unit, e.g. 1073741824, 512M, 2G, 1.5GiB, 800MB"
        )
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise InvalidRequest(f"invalid memory size {text!r}: must be more than 0 bytes")
    return value


def available_cpu_bytes(meminfo: Path = MEMINFO) -> int:
    """The kernel's estimate of memory available to a new process, or 0 when unknown."""
    try:
        text = meminfo.read_text()
    except OSError:
        return 0
    match = re.search(r"^MemAvailable:\s+([0-9]+)\s*kB", text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else 0


def detect(device: torch.device, memory: int = 0) -> int:
    """The bytes this stage offers its job (0: unknown, the planner then puts no cap).

    Args:
        device: the stage's device.
        memory: the operator's ``--memory`` (bytes; 0: measure). On CUDA it caps what is
            measured.
    """
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        measured = max(0, int(free - CUDA_HEADROOM * total))
        return min(measured, memory) if memory else measured
    if memory:
        return memory
    return int(available_cpu_bytes() * (1 - CPU_HEADROOM))


# ---- keeping freed memory ---------------------------------------------------------------

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
