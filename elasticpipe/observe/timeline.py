"""The classic pipeline diagram of a trace, as a PNG: stages as rows, time across.

Forward ops are blue boxes and backward ops orange ones, each labelled with its
micro-batch id; whatever stays white in a row is that stage's bubble (waiting for an
input, a gradient, a send, or the client). Only training steps are drawn: an inference
run's forwards (``predict``) are left out (``traces.latest_ops``). Drawn with matplotlib's
Agg backend (no display needed); matplotlib is the ``plots`` extra.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from elasticpipe.errors import InvalidRequest
from elasticpipe.observe.traces import StageTrace, StepFigure, latest_ops
from elasticpipe.v1 import stage_pb2

FORWARD_COLOUR = "#4c72b0"
BACKWARD_COLOUR = "#dd8452"
WEIGHT_COLOUR = "#55a868"
_COLOURS = {
    stage_pb2.SPAN_FORWARD: FORWARD_COLOUR,
    stage_pb2.SPAN_BACKWARD: BACKWARD_COLOUR,
    stage_pb2.SPAN_WEIGHT: WEIGHT_COLOUR,
}


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise InvalidRequest(
            "drawing the timeline needs matplotlib: pip install 'elasticpipe[plots]' "
            f"(or pip install matplotlib) ({exc})"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw(
    traces: Sequence[StageTrace],
    figures: Sequence[StepFigure],
    out: str | Path,
    title: str = "",
) -> None:
    """Writes the timeline of the traced steps' forward and backward ops to ``out``.

    Raises:
        InvalidRequest: no forward or backward span to draw, or matplotlib missing.
    """
    plt = _pyplot()
    boxes = [(t, s) for t in traces for spans in latest_ops(t).values() for s in spans]
    if not boxes:
        raise InvalidRequest("the stages hold no forward or backward span: train a step first")
    origin = min(t.local(s)[0] for t, s in boxes)
    end_ms = max((t.local(s)[1] - origin) / 1e6 for t, s in boxes)
    rows = len(traces)
    fig, ax = plt.subplots(figsize=(12, 1.5 + 0.7 * rows), dpi=100)
    for t, s in boxes:
        start, end = t.local(s)
        x, w = (start - origin) / 1e6, (end - start) / 1e6
        y = t.index
        ax.broken_barh(
            [(x, w)],
            (y - 0.4, 0.8),
            facecolors=_COLOURS[s.kind],
            edgecolors="black",
            linewidth=0.5,
        )
        if w > end_ms / 150:  # a label only where it fits
            ax.text(
                x + w / 2,
                y,
                str(s.micro_batch),
                ha="center",
                va="center",
                fontsize=8,
                color="white",
            )
    ax.set_ylim(rows - 0.5, -0.5)  # stage 0 on top
    ax.set_xlim(0, end_ms * 1.01)
    ax.set_yticks(range(rows))
    ax.set_yticklabels([f"stage {t.index}\n{t.name} [{t.layer_lo}:{t.layer_hi})" for t in traces])
    ax.set_xlabel("time (ms)")
    ax.grid(axis="x", linestyle=":", alpha=0.5)
    from matplotlib.patches import Patch

    split = any(s.kind == stage_pb2.SPAN_WEIGHT for _, s in boxes)
    ax.legend(
        handles=[
            Patch(facecolor=FORWARD_COLOUR, label="forward (micro-batch id)"),
            Patch(facecolor=BACKWARD_COLOUR, label="backward (input)" if split else "backward"),
            *([Patch(facecolor=WEIGHT_COLOUR, label="backward (weights)")] if split else []),
            Patch(facecolor="white", edgecolor="grey", label="bubble"),
        ],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.16),
        fontsize=8,
        ncol=4 if split else 3,
        frameon=False,
    )
    heading = title
    if figures:
        effs = ", ".join(f"step {f.step}: {f.efficiency:.0%}" for f in figures)
        heading = (
            f"{title}   pipeline efficiency {effs}" if title else f"pipeline efficiency {effs}"
        )
    ax.set_title(heading, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, format="png")
    plt.close(fig)
