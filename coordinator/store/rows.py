"""What the coordinator stores, whatever the store: stage incarnations and epoch records."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StageRow:
    """A registered stage incarnation as stored."""

    stage_id: str
    name: str
    address: str
    device: str
    registered_at: float
    drained: bool = False
    incarnation: int = 1
    dead: bool = False
    leaving: bool = False  # drained by its own shutdown (SIGTERM), not by an operator
    left: bool = False  # its shutdown finished: nothing of the job left on it, it exits


@dataclass(frozen=True)
class EpochRow:
    """Why and how the partition changed to an epoch (or why an attempt was abandoned)."""

    epoch: int
    at: float
    reason: str
    boundaries: tuple[int, ...]
    stage_ids: tuple[str, ...] = ()
    layers_moved: int = 0
    bytes_moved: int = 0
    pause_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    kind: str = "move"  # start, move, recovery, restore, abandoned
    job_id: str = ""
    stage_names: tuple[str, ...] = ()
    restored_step: int = 0
    lost_steps: int = 0
    detected_at: float = 0.0  # recovery: when the failure was detected (unix time)
    loop_pause_s: float = 0.0  # what the training loop lost to it, as its client saw (0: unknown)


def latest_epochs(records: Iterable[str | bytes], limit: int, job_id: str | None) -> list[EpochRow]:
    """The first ``limit`` of ``records`` (JSON of ``asdict``, newest first) of ``job_id``
    (None: any job) as rows, oldest first."""
    out = []
    for record in records:
        raw = json.loads(record)
        if job_id is not None and raw.get("job_id", "") != job_id:
            continue
        for key in ("boundaries", "stage_ids", "stage_names"):
            raw[key] = tuple(raw.get(key, ()))
        out.append(EpochRow(**raw))
        if len(out) >= limit:
            break
    return list(reversed(out))
