"""The stage's malloc settings: freed tensors are kept for reuse (no page faults for the
next one), and what is kept is bounded by ``ELASTICPIPE_MALLOC_KEEP_BYTES``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SCRIPT = """
import json, resource, torch
from elasticpipe.stage_server import memory

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

tuned = memory.keep_freed_memory()
rounds = []
for _ in range(6):  # 64 MiB: above anything glibc's own mmap threshold adapts to
    before = faults()
    x = torch.empty(64 << 20, dtype=torch.uint8); x.fill_(1); del x
    rounds.append(faults() - before)
reuse_faults = rounds[-1]
free_before = memory.free_bytes()
trimmed = memory.bound()
print(json.dumps({"tuned": tuned, "reuse_faults": reuse_faults, "free_before": free_before,
                  "trimmed": trimmed, "free_after": memory.free_bytes()}))
"""


def _run(env: dict[str, str]) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "PATH": "/usr/bin:/bin"},
        check=True,
    )
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.timeout(90)
def test_freed_memory_is_reused_and_bounded() -> None:
    got = _run({"ELASTICPIPE_MALLOC_KEEP_BYTES": str(64 << 20)})
    if not got["tuned"]:
        pytest.skip("not glibc >= 2.33: malloc left as it is")
    assert isinstance(got["reuse_faults"], int) and got["reuse_faults"] < 100  # of 16384 pages
    assert isinstance(got["free_before"], int) and got["free_before"] > 64 << 20
    assert got["trimmed"] is True  # over the bound: the free pages went back to the kernel
    untuned = _run({"ELASTICPIPE_MALLOC_TUNE": "0"})
    assert untuned["tuned"] is False and untuned["free_before"] is None
    assert untuned["trimmed"] is False
    assert isinstance(untuned["reuse_faults"], int) and untuned["reuse_faults"] > 10000
