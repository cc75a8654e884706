"""The demo's picture: a PNG of the documented size, and a refusal with nothing to draw."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticpipe.demo.plot import DPI, HEIGHT_IN, WIDTH_IN, plot
from elasticpipe.demo.record import Event, Sample, Timeline

pytestmark = pytest.mark.timeout(30)


def test_plot_writes_a_png_of_the_documented_size(tmp_path: Path) -> None:
    """Rates, events and bands drawn: a PNG of WIDTH_IN x HEIGHT_IN inches at DPI."""
    samples = [
        Sample(s, float(s), 3.0, 1, {"a": 2, "b": 2} if s < 12 else {"a": 3, "b": 1})
        for s in range(1, 25)
    ]
    events = [Event(8, 8.0, "slowdown", "b 3x slower", "b"), Event(12, 12.0, "move", "epoch 2")]
    data = plot(Timeline(samples, events), tmp_path / "sub" / "t.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    size = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert size == (int(WIDTH_IN * DPI), int(HEIGHT_IN * DPI))


def test_plot_refuses_a_timeline_without_steps_to_draw(tmp_path: Path) -> None:
    """One sample (the setup step) is nothing to draw: a ValueError naming the count."""
    with pytest.raises(ValueError, match="1 samples"):
        plot(Timeline([Sample(1, 1.0, 3.0, 1, {"a": 4})]), tmp_path / "t.png")
