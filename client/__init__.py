"""The client SDK: ``Pipeline`` drives micro-batches through the stage servers.

* ``pipeline``: ``Pipeline``, the public methods, and ``StepStats``/``StageStep``;
* ``steps``: its steps' runs until one is accepted, the commit decision, the replays;
* ``session``: its job on the coordinator: setup/attach, lease, partition, recovery, restore;
* ``driver``: one run of a step through the chain of stages;
* ``checkpoints``: the checkpoint formats (``save`` writes, ``load`` opens);
* ``admin``: ``Admin``, the typed client of the coordinator's admin RPCs, and its answers;
* ``initial``: ``init_state``, checked against the model before a job starts;
* ``repeats``: warnings and waits that recur during an outage, logged once, then now and then.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elasticpipe.client.admin import Admin
    from elasticpipe.client.pipeline import Pipeline, StageStep, StepStats

__all__ = ["Admin", "Pipeline", "StageStep", "StepStats"]

# Imported on first use, so that ``elasticpipe admin`` (which needs only ``admin``) starts
# without importing torch.
_HOMES = {
    "Admin": "admin",
    "Pipeline": "pipeline",
    "StageStep": "pipeline",
    "StepStats": "pipeline",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
