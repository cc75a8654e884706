"""Parsing ``--memory`` and measuring what a stage offers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elasticpipe.errors import InvalidRequest
from elasticpipe.stage_server import memory


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1048576", 1 << 20),
        ("512M", 512 << 20),
        ("2G", 2 << 30),
        ("2g", 2 << 30),
        ("1.5GiB", 3 << 29),
        ("800MB", 800_000_000),
        ("64K", 64 << 10),
        (" 3 T ", 3 << 40),
    ],
)
def test_parse_bytes_accepts_plain_numbers_and_units(text: str, expected: int) -> None:
    """Byte counts parse with binary (K, M, G, KiB...) and decimal (KB, MB...) units."""
    assert memory.parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "G", "12Q", "-5M", "0", "1e9", "two gigs", "0.0001"])
def test_parse_bytes_refuses_bad_values_naming_them(text: str) -> None:
    """A bad size is refused with a message that quotes it."""
    with pytest.raises(InvalidRequest, match="invalid memory size") as info:
        memory.parse_bytes(text)
    assert repr(text) in str(info.value)


def test_available_cpu_bytes_reads_memavailable(tmp_path: Path) -> None:
    """MemAvailable is read in kB; a missing file or line means unknown (0)."""
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       16000000 kB\nMemAvailable:    8000000 kB\n")
    assert memory.available_cpu_bytes(info) == 8_000_000 * 1024
    info.write_text("MemTotal:       16000000 kB\n")
    assert memory.available_cpu_bytes(info) == 0
    assert memory.available_cpu_bytes(tmp_path / "absent") == 0


def test_detect_prefers_the_operators_memory_on_cpu() -> None:
    """On CPU --memory wins; without it the host's available memory less headroom."""
    cpu = torch.device("cpu")
    assert memory.detect(cpu, 123456) == 123456
    measured = memory.detect(cpu, 0)
    expected = memory.available_cpu_bytes() * (1 - memory.CPU_HEADROOM)
    assert measured == pytest.approx(expected, rel=0.2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_detect_on_cuda_leaves_headroom_and_honours_memory() -> None:
    """On CUDA: free memory less 10% of the device; --memory caps it."""
    device = torch.device("cuda:0")
    free, total = torch.cuda.mem_get_info(device)
    measured = memory.detect(device)
    assert 0 < measured <= free - memory.CUDA_HEADROOM * total + (64 << 20)
    assert memory.detect(device, 1 << 20) == 1 << 20
