"""``elasticpipe admin status --watch``: a live view of the cluster, redrawn every interval.

The view is :func:`render`, a pure function of two consecutive ``Status`` answers
and the seconds between them (the step rate is the committed-step delta over that time), so
it is tested without a cluster by printing it to a recording ``rich`` console. :func:`watch`
polls the coordinator and redraws: in place on a terminal, frame after frame otherwise (a
log, a pipe), or as one JSON object per line with ``--json``.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from elasticpipe.cli.admin import ordered_stages
from elasticpipe.client.admin import Status
from elasticpipe.errors import ElasticPipeError

DECISIONS_SHOWN = 6
STATE_STYLES = {
    "chain": "green",
    "spare": "cyan",
    "drained": "yellow",
    "dead": "red",
    "left": "dim",
}


def step_rate(
    previous: Status | None,
    current: Status,
    elapsed_s: float,
) -> float | None:
    """Committed steps per second between two statuses of the same job (None: unknown).

    A rollback (recovery) lowers the committed step: the rate is then 0 for that interval,
    not negative.
    """
    if previous is None or elapsed_s <= 0 or previous.job_id != current.job_id:
        return None
    return max(0, current.committed_step - previous.committed_step) / elapsed_s


def efficiency(status: Status) -> tuple[float, int] | None:
    """The latest pipeline efficiency (ideal over measured step time) and the step it was
    measured on; None while the job's client has reported none."""
    if not status.efficiency_step:
        return None
    return status.efficiency, status.efficiency_step


def _ranges(boundaries: list[int]) -> str:
    return ",".join(f"{a}:{b}" for a, b in itertools.pairwise(boundaries))


def _header(
    previous: Status | None,
    s: Status,
    elapsed_s: float,
) -> Text:
    rate = step_rate(previous, s, elapsed_s)
    eff = efficiency(s)
    text = Text()
    text.append(f"job {s.job_id or '-'}", style="bold")
    text.append(f"   model {s.job_model or '-'}   layers {s.num_layers}   ")
    text.append(f"epoch {s.partition.epoch}   step {s.committed_step}   ")
    text.append("step rate ")
    text.append("-" if rate is None else f"{rate:.2f}/s", style="bold")
    if eff is not None:
        text.append(f"   efficiency {eff[0]:.0%}", style="bold")
        text.append(f" (step {eff[1]})")
    text.append(f"\npartition {_ranges(list(s.partition.boundaries)) or '-'}   ")
    text.append(f"auto-rebalance {'on' if s.auto_rebalance else 'off'}   ")
    text.append(f"client {s.client or 'none'}")
    if s.job_failure:
        text.append(f"\nJOB FAILED: {s.job_failure}", style="bold red")
    return text


def _stages(s: Status) -> Table:
    table = Table(title="stages", title_justify="left", expand=False)
    for name, justify in (
        ("name", "left"),
        ("state", "left"),
        ("speed", "right"),
        ("slowdown", "right"),
        ("layers", "right"),
        ("step", "right"),
    ):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    live, gone = ordered_stages(s.stages)  # the chain in chain order, the gone ones last
    for st in [*live, *gone]:
        layers = (
            f"{st.layer_lo}:{st.layer_hi} ({st.layer_hi - st.layer_lo})" if st.index >= 0 else "-"
        )
        table.add_row(
            st.name,
            Text(st.state, style=STATE_STYLES.get(st.state, "")),
            f"{st.speed:.3f}" if st.speed > 0 else "-",
            f"{st.slowdown:g}x",
            layers,
            str(st.committed_step),
        )
    return table


def _decisions(s: Status, shown: int) -> Table:
    table = Table(title=f"last decisions (of {len(s.history)})", title_justify="left")
    for name, justify in (
        ("epoch", "right"),
        ("when", "left"),
        ("kind", "left"),
        ("partition", "left"),
        ("moved", "right"),
        ("pause", "right"),
        ("reason", "left"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for r in list(s.history)[-shown:]:
        table.add_row(
            str(r.epoch),
            time.strftime("%H:%M:%S", time.localtime(r.at_unix)),
            r.kind,
            _ranges(list(r.boundaries)),
            f"{r.layers_moved} ({r.bytes_moved:,} B)",
            f"{r.pause_s:.2f}s" + (f" (loop {r.loop_pause_s:.2f}s)" if r.loop_pause_s else ""),
            r.reason,
        )
    return table


def render(
    previous: Status | None,
    current: Status,
    elapsed_s: float,
    decisions: int = DECISIONS_SHOWN,
    note: str = "",
) -> RenderableType:
    """One frame of the live view.

    Args:
        previous: the status polled before ``current`` (None for the first frame: no rate).
        current: the status to show.
        elapsed_s: seconds between the two polls.
        decisions: how many of the newest epoch-history records to list.
        note: a line shown above the view (a failed poll, say).

    Returns:
        A ``rich`` renderable: the header (job, epoch, step, step rate, the latest
        efficiency once the client reported one), the stage table, and the last decisions.
    """
    parts: list[RenderableType] = []
    if note:
        parts.append(Text(note, style="bold yellow"))
    parts += [_header(previous, current, elapsed_s), _stages(current)]
    if current.history:
        parts.append(_decisions(current, decisions))
    return Group(*parts)


def watch(
    fetch: Callable[[], Status],
    console: Console,
    interval_s: float,
    count: int = 0,
    as_json: Callable[[Status], dict[str, Any]] | None = None,
) -> int:
    """Polls ``fetch`` every ``interval_s`` seconds and shows each status until Ctrl-C (or
    ``count`` polls, when positive).

    The first poll's error propagates (nothing to show yet); a later one is shown above
    the last good status and polling goes on. With ``as_json`` each poll prints one line
    of JSON (an error line ``{"error": ...}`` for a failed poll).

    Returns:
        The exit code: 0 (Ctrl-C is a normal end).
    """
    if interval_s <= 0:
        raise ValueError(f"--interval must be positive, got {interval_s}")
    previous: Status | None = None
    current = fetch()
    polled = time.monotonic()
    elapsed, shown = 0.0, 0
    failure: ElasticPipeError | None = None
    live = Live(console=console, auto_refresh=False) if console.is_terminal else None
    try:
        if live is not None:
            live.start()
        while True:
            if as_json is not None:
                error = {"code": failure.code.name, "message": str(failure)} if failure else {}
                line = {"error": error} if failure else as_json(current)
                console.file.write(json.dumps(line) + "\n")  # one line, no markup, no wrap
                console.file.flush()
            else:
                note = f"poll failed (showing the last good status): {failure}" if failure else ""
                frame = render(previous, current, elapsed, note=note)
                if live is not None:
                    live.update(frame, refresh=True)
                else:
                    console.print(frame)
                    console.rule()
            shown += 1
            if count and shown >= count:
                return 0
            time.sleep(interval_s)
            try:
                status = fetch()
            except ElasticPipeError as exc:
                failure = exc
                continue
            now = time.monotonic()
            previous, current, elapsed, failure = current, status, now - polled, None
            polled = now
    except KeyboardInterrupt:
        return 0
    finally:
        if live is not None:
            live.stop()
