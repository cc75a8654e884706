"""What the demo records as it trains: one sample per step, the events, and the phases.

A :class:`Timeline` is plain data (it round-trips through JSON for tests and plots): each
step's time, loss and layers per stage, plus the events, both the ones the demo caused
(a slowdown, a kill) and the partition changes the job went through (moves, a recovery).
The phases are the spans between two consecutive events, each with its step rate::

    events at steps 40 (slowdown) and 47 (move)  ->  phases 2-40, 41-47, 48-...
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Sample:
    """One training step as the client saw it finish.

    Attributes:
        step: the step number (1-based, in the order the demo ran them).
        t: seconds since training started, when the step returned.
        loss: the step's loss.
        epoch: the partition's epoch after the step.
        layers: layers owned per stage name, in chain order.
    """

    step: int
    t: float
    loss: float
    epoch: int
    layers: dict[str, int]


@dataclass(frozen=True)
class Event:
    """Something that happened after step ``step`` finished.

    Attributes:
        step: the last step finished before it.
        t: seconds since training started.
        kind: ``slowdown``, ``recovered``, ``kill`` (caused by the demo), or the kind of a
            partition change (``move``, ``scale-out``, ``recovery``...).
        label: a short text for the plot and the summary.
        stage: the stage it happened to (a demo's event), or "".
    """

    step: int
    t: float
    kind: str
    label: str
    stage: str = ""


@dataclass(frozen=True)
class Phase:
    """The steps between two events and how fast they went."""

    first: int
    last: int
    after: str
    steps_per_s: float
    layers: dict[str, int]


@dataclass
class Timeline:
    """Samples and events of one demo run."""

    samples: list[Sample] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)

    def phases(self) -> list[Phase]:
        """The spans between consecutive events (and from step 1, whose time is the job's
        setup and is left out, to the first), each with its steps per second."""
        by_step = {s.step: s for s in self.samples}
        if len(self.samples) < 2:
            return []
        cuts = sorted({1, *(e.step for e in self.events if e.step in by_step)})
        last = self.samples[-1].step
        phases = []
        for start, end in itertools.pairwise([*cuts, last]):
            if end <= start:
                continue
            elapsed = by_step[end].t - by_step[start].t
            after = [e.label for e in self.events if e.step == start] or ["start"]
            phases.append(
                Phase(
                    first=start + 1,
                    last=end,
                    after="; ".join(after),
                    steps_per_s=(end - start) / elapsed if elapsed > 0 else 0.0,
                    layers=by_step[start + 1].layers,
                )
            )
        return phases

    def rates(self, window: int = 5) -> list[tuple[float, float]]:
        """(time, steps per second over the last ``window`` steps) for each step after the
        first ``window`` (step 1 excluded: it includes the job's setup)."""
        timed = [s for s in self.samples if s.step > 1]
        return [
            (b.t, window / (b.t - a.t))
            for a, b in zip(timed, timed[window:], strict=False)
            if b.t > a.t
        ]

    def to_json(self) -> dict[str, Any]:
        """Samples, events and phases as plain JSON."""
        return {
            "samples": [asdict(s) for s in self.samples],
            "events": [asdict(e) for e in self.events],
            "phases": [asdict(p) for p in self.phases()],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Timeline:
        """The inverse of :meth:`to_json` (phases are recomputed)."""
        return cls(
            samples=[Sample(**s) for s in data["samples"]],
            events=[Event(**e) for e in data["events"]],
        )

    def save(self, path: str | Path) -> None:
        """Writes :meth:`to_json` to ``path``."""
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")
