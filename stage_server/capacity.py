"""How much memory a stage offers its job: parsing ``--memory`` and measuring the device.

A stage measures its capacity once, at start-up, and reports it with its registration and
every heartbeat; the coordinator plans so that no stage holds more than that:

* CUDA: the free memory ``torch.cuda.mem_get_info`` reports, less ``CUDA_HEADROOM`` of the
  device's total (allocator fragmentation, CUDA context, kernels' workspaces);
* CPU: ``--memory`` when given, else the kernel's ``MemAvailable`` (``/proc/meminfo``), less
  ``CPU_HEADROOM`` of it; 0 (unknown, no cap) where neither exists.

Measured at start-up rather than live: once the job runs, free memory shrinks by what the
stage itself holds, which must not read as a smaller device.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from elasticpipe.errors import InvalidRequest

__all__ = ["CPU_HEADROOM", "CUDA_HEADROOM", "detect", "parse_bytes"]

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
