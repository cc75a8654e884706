"""Benchmark of the per-layer RNG seeding (``elasticpipe.training.rng``): what it adds to a step.

What is measured, in one process with one intra-op thread (a stage's budget):

* the pieces: ``forward_seed`` (a BLAKE2b of four ints), ``manual_seed`` of the CPU
  generator (once per layer per micro-batch), and one ``forked`` enter/exit (a CPU generator
  state save and restore, once per micro-batch through a slice);
* whole steps of ``LocalPipeline`` (the code a stage runs) on a small MLP, with the seeding
  on, and with ``rng.forked`` replaced by a no-op: the difference is the overhead per step.
  Steps are timed in this thread's CPU time, and runs alternate (on, off, on, off, ...), so
  that load from other processes hits both alike; the median of each is compared.

The small model makes the overhead as visible as it can be: on a real model each layer's
forward takes milliseconds, the seeding microseconds.

Usage: ``.venv/bin/python bench/rng_overhead.py [--steps N] [--rounds R] [--quick]``
(``--quick``: 1 round of 3 steps and 2,000 calls per piece, to check the script end to end in
seconds). The last line is JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable, Iterator
from unittest import mock

import torch

from elasticpipe import LocalPipeline
from elasticpipe.training import rng

SIZES = [64, 128, 128, 128, 128, 128, 128, 128, 10]  # 8 Linear + 7 ReLU = 15 layers
MICRO_BATCHES = 4
BATCH = 32


CALLS = 20000  # per piece timed


def _per_call_us(fn: Callable[[], object], n: int = CALLS) -> float:
    start = time.thread_time()  # CPU time, as the steps below
    for _ in range(n):
        fn()
    return (time.thread_time() - start) / n * 1e6


@contextlib.contextmanager
def _no_fork(device: torch.device) -> Iterator[Callable[[int], None]]:
    yield lambda seed: None


def _steps_ms(pipe: LocalPipeline, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    # This thread's CPU time: other processes' load on a shared host does not count.
    start = time.thread_time()
    for x, y in batches:
        pipe.train_step(x, y)
    return (time.thread_time() - start) / len(batches) * 1e3


def main() -> None:
    """Prints the pieces' costs and the per-step overhead."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="1 round of 3 steps, fewer calls")
    args = parser.parse_args()
    calls = CALLS
    if args.quick:
        args.steps, args.rounds, calls = 3, 1, 2000
    torch.set_num_threads(1)
    device = torch.device("cpu")

    seed_us = _per_call_us(lambda: rng.forward_seed(5, 123, 3, 14), calls)
    manual_us = _per_call_us(lambda: torch.default_generator.manual_seed(12345), calls)

    def fork() -> None:
        with rng.forked(device):
            pass

    fork_us = _per_call_us(fork, calls)
    layers = 2 * len(SIZES) - 3
    print(f"forward_seed        {seed_us:7.2f} us per layer per micro-batch")
    print(f"manual_seed (CPU)   {manual_us:7.2f} us per layer per micro-batch")
    print(f"forked enter/exit   {fork_us:7.2f} us per micro-batch per stage")
    predicted = (layers * (seed_us + manual_us) + fork_us) * MICRO_BATCHES / 1e3
    print(
        f"predicted per step  {predicted:7.3f} ms ({layers} layers, {MICRO_BATCHES} micro-batches)"
    )

    g = torch.Generator().manual_seed(0)
    batches = [
        (
            torch.randn(BATCH, SIZES[0], generator=g),
            torch.randint(0, SIZES[-1], (BATCH,), generator=g),
        )
        for _ in range(args.steps)
    ]
    kwargs = {"model": "mlp", "model_kwargs": {"sizes": SIZES}, "micro_batches": MICRO_BATCHES}
    seeded, unseeded = LocalPipeline(**kwargs), LocalPipeline(**kwargs)  # type: ignore[arg-type]
    _steps_ms(seeded, batches[:3])
    with mock.patch.object(rng, "forked", _no_fork):
        _steps_ms(unseeded, batches[:3])
    on, off = [], []
    for _ in range(args.rounds):
        on.append(_steps_ms(seeded, batches))
        with mock.patch.object(rng, "forked", _no_fork):
            off.append(_steps_ms(unseeded, batches))
    on_ms, off_ms = statistics.median(on), statistics.median(off)
    print(
        f"step, seeded        {on_ms:7.3f} ms CPU (median of {args.rounds} x {args.steps} steps)\n"
        f"step, not seeded    {off_ms:7.3f} ms\n"
        f"overhead            {on_ms - off_ms:7.3f} ms per step "
        f"({(on_ms / off_ms - 1) * 100:+.1f} %)"
    )
    figures = {
        "forward_seed_us": seed_us,
        "manual_seed_us": manual_us,
        "forked_us": fork_us,
        "predicted_ms_per_step": predicted,
        "seeded_ms_per_step": on_ms,
        "unseeded_ms_per_step": off_ms,
        "overhead_ms_per_step": on_ms - off_ms,
    }
    print(json.dumps({k: round(v, 4) for k, v in figures.items()}))


if __name__ == "__main__":
    main()
