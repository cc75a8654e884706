"""Like with like: what a test that compares the stages' arithmetic with a reference computed
in the test process uses, so that the comparison holds on any x86-64 CPU and core count.

Two things change a float32 result of the same operations on the same data:

* the number of intra-op threads: a reduction (a layer norm's, an embedding's backward, a
  large matrix product) split over more threads adds in another order. The stages of a
  ``LocalCluster`` run ``threads_per_stage`` threads (``STAGE_THREADS`` by default)
  whatever ``OMP_NUM_THREADS`` says; the test process runs torch's default (the cores, or
  ``OMP_NUM_THREADS``). A reference for a ``LocalCluster`` runs under ``stage_threads()``
  (``reference_step`` here does). A ``StageServer`` started in the test process computes in
  its threads at the process's own count: a reference for it runs without
  ``stage_threads`` (``elasticpipe.training.objectives.reference_step``).
* the kernels (``ATEN_CPU_CAPABILITY``: the scalar ``default``, ``avx2``, ``avx512``): the
  stage processes inherit the test process's environment, so both sides use the same ones.

What is left is what the test itself changes (a pipeline splits a batch into micro-batches
and adds their gradients; a reference step may not): those comparisons use a tolerance
derived from the dtype of the result, float32's for float32 losses (``assert_losses_close``),
and say so.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

from elasticpipe.client.pipeline import Pipeline
from elasticpipe.local.cluster import LocalCluster
from elasticpipe.training import objectives
from elasticpipe.wire.structure import split_batch

# The intra-op threads of a LocalCluster stage: its own default, read from its signature.
STAGE_THREADS: int = inspect.signature(LocalCluster).parameters["threads_per_stage"].default


@contextlib.contextmanager
def stage_threads(threads: int = STAGE_THREADS) -> Iterator[None]:
    """Runs the block (a reference's forward, backward and optimizer steps, or a
    ``LocalPipeline``'s) under the intra-op thread count of a stage, then restores the
    previous count. The block's work must run in this thread (CPU autograd and
    ``LocalPipeline`` do): a thread that already ran torch keeps its own count."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def reference_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_name: str,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    allow: Sequence[str] = (),
    micro_batches: int | None = None,
) -> float:
    """``elasticpipe.training.objectives.reference_step`` (one plain single-process step on
    the whole batch) under a stage's thread count: what a test compares a pipeline's step with.

    With ``micro_batches``, the batch is cut as the pipeline cuts it (``split_batch``): each
    micro-batch's loss times its share goes backward, the gradients add up, then one
    optimizer step; the loss returned is the sum of those terms. The same shapes as on the
    stages: after some Adam steps a whole-batch reference drifts from the pipeline by more
    than float32's tolerance on small parameters (layer norms' weights, measured 2e-5)."""
    with stage_threads():
        if micro_batches is None:
            return objectives.reference_step(model, optimizer, loss_name, inputs, targets, allow)
        optimizer.zero_grad(set_to_none=True)
        loss = objectives.loss_fn(loss_name, allow)
        total = 0.0
        xs, ys, shares = split_batch(inputs, targets, micro_batches, torch.device("cpu"))
        for x, y, share in zip(xs, ys, shares, strict=True):
            term = loss(model(x), y) * share
            torch.autograd.backward(term)
            total += float(term.detach())
        optimizer.step()
        return total


def assert_losses_close(
    got: Sequence[float],
    want: Sequence[float],
    *,
    exact: bool = False,
    msg: str | None = None,
) -> None:
    """Float32 losses (returned as Python floats) compared as float32: ``assert_close`` on
    lists of floats would apply float64's tolerance (1e-7) to values rounded to float32
    (one unit in the last place is 1.2e-7 relative). Float32's default is rtol 1.3e-6,
    atol 1e-5; ``exact`` asks for bit-equal float32 values."""
    torch.testing.assert_close(
        torch.tensor(list(got), dtype=torch.float32),
        torch.tensor(list(want), dtype=torch.float32),
        rtol=0.0 if exact else None,
        atol=0.0 if exact else None,
        msg=msg,
    )


def assert_steps_match(
    pipe: Pipeline,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    reference: Callable[[torch.Tensor, torch.Tensor], float],
) -> None:
    """Trains ``pipe`` one step per batch and compares each loss with ``reference(x, y)``'s,
    the reference's step on the same batch taken after the pipeline's, at float32's default
    tolerance: ``reference`` is a ``reference_step`` with its model, optimizer and loss bound
    (``functools.partial``), this module's for a ``LocalCluster``, ``objectives``' for stage
    servers in the test process."""
    for step, (x, y) in enumerate(batches):
        got = pipe.train_step(x, y)
        want = reference(x, y)
        torch.testing.assert_close(
            torch.tensor(got), torch.tensor(want), msg=lambda m, step=step: f"step {step}: {m}"
        )
