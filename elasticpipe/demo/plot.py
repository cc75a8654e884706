"""The demo's picture: steps/s over time with the events marked, and the partition over time.

Drawn with matplotlib's Agg backend (no display needed). Two panels share the time axis:

* top: the step rate (a moving window of steps), a dashed vertical line per event, labelled;
* bottom: layers per stage as stacked bands, one colour per stage name, so a band that
  thins is a stage giving layers away and a band that ends is a stage that left the chain.
"""

from __future__ import annotations

from pathlib import Path

from elasticpipe.demo.record import Timeline

EVENT_COLOURS = {"slowdown": "tab:red", "recovered": "tab:green", "kill": "black"}
WIDTH_IN, HEIGHT_IN, DPI = 11.0, 6.5, 100  # 1100 x 650 pixels


def plot(timeline: Timeline, path: str | Path, title: str = "") -> Path:
    """Draws ``timeline`` into a PNG at ``path``; returns the path.

    Raises:
        ValueError: fewer than two samples (nothing to draw).
    """
    import matplotlib

    matplotlib.use("Agg")  # before pyplot: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    samples = [s for s in timeline.samples if s.step > 1]
    if len(samples) < 2:
        raise ValueError(f"{len(timeline.samples)} samples: too few to draw a timeline")
    fig, (top, bottom) = plt.subplots(
        2, 1, sharex=True, figsize=(WIDTH_IN, HEIGHT_IN), height_ratios=[3, 2]
    )
    rates = timeline.rates()
    if rates:
        # steps-pre: each rate holds over the steps it was measured on (a long recovery step
        # reads as a flat low stretch, not as a slope)
        top.plot(
            [t for t, _ in rates],
            [r for _, r in rates],
            color="tab:blue",
            lw=1.5,
            drawstyle="steps-pre",
            label="steps/s (moving window of 5 steps)",
        )
    top.set_ylabel("steps / s")
    top.set_ylim(bottom=0)
    top.grid(alpha=0.3)
    top.set_title(title or "ElasticPipe demo: step rate and partition over time")
    ymax = top.get_ylim()[1]
    for i, event in enumerate(timeline.events):
        colour = EVENT_COLOURS.get(event.kind, "tab:purple")
        for ax in (top, bottom):
            ax.axvline(event.t, color=colour, ls="--", lw=1)
        top.text(
            event.t,
            ymax * (0.97 - 0.09 * (i % 4)),  # staggered so close events stay readable
            " " + event.label,
            color=colour,
            fontsize=8,
            va="top",
            ha="left",
        )

    slowed = [e.t for e in timeline.events if e.kind == "slowdown"]
    recovered = [e.t for e in timeline.events if e.kind == "recovered"]
    if slowed:
        end = recovered[0] if recovered else samples[-1].t
        top.axvspan(slowed[0], end, color="tab:red", alpha=0.07, label="a stage slowed down")
    top.legend(loc="lower left", fontsize=8)

    names = list(dict.fromkeys(name for s in samples for name in s.layers))
    times = [s.t for s in samples]
    bands = [[s.layers.get(name, 0) for s in samples] for name in names]
    bottom.stackplot(times, bands, labels=names, step="post", alpha=0.8)
    bottom.set_ylabel("layers per stage")
    bottom.set_xlabel("seconds since training started")
    bottom.set_ylim(0, max(sum(s.layers.values()) for s in samples))
    handles, labels = bottom.get_legend_handles_labels()  # top of the stack first
    bottom.legend(
        handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8
    )
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return out
