"""The reference a pipeline test compares with: ``LocalPipeline`` with the pipeline's own
arguments, stepped beside it on the same batches under a stage's thread count
(``tests/support/numerics.py``), so that every loss and the final weights are equal bit for
bit, across moves and failures alike."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from elasticpipe import LocalPipeline
from elasticpipe.client.pipeline import Pipeline
from elasticpipe.local.cluster import LocalCluster
from tests.support.numerics import stage_threads

# The arguments a LocalPipeline shares with a Pipeline (the rest are the pipeline's own:
# ``stages``, ``snapshot_every``, ``lease_s``, ...).
LOCAL_ARGUMENTS = frozenset(inspect.signature(LocalPipeline).parameters)


def assert_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    """The two state dicts have the same keys and equal tensors, to the bit."""
    assert got.keys() == want.keys(), what
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=f"{key}, {what}")


class Lockstep:
    """A ``Pipeline`` on ``cluster`` and its ``LocalPipeline``, trained step by step on the
    same batches; ``train_step`` asserts the two losses equal, ``close`` the weights."""

    def __init__(self, cluster: LocalCluster, **options: Any) -> None:
        self.pipe = Pipeline(coordinator=cluster.coordinator, **options)
        self.local = LocalPipeline(**{k: v for k, v in options.items() if k in LOCAL_ARGUMENTS})
        self.steps = 0

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """One step on both; returns the pipeline's loss, once it is the reference's."""
        got = self.pipe.train_step(inputs, targets)
        with stage_threads():
            want = self.local.train_step(inputs, targets)
        self.steps += 1
        assert got == want, f"loss of step {self.steps}: pipeline {got!r}, LocalPipeline {want!r}"
        return got

    def assert_same_weights(self) -> None:
        """Every parameter and buffer of the pipeline is the reference's, bit for bit."""
        assert_exact(self.pipe.state_dict(), self.local.state_dict(), f"after {self.steps} steps")

    def close(self) -> None:
        """Closes both (the pipeline releases its job)."""
        try:
            self.pipe.close()
        finally:
            self.local.close()

    def __enter__(self) -> Lockstep:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
