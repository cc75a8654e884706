"""Pipeline training equals single-process training: same losses, same final parameters."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from elasticpipe import models
from elasticpipe.client.pipeline import Pipeline
from elasticpipe.local.cluster import LocalCluster
from elasticpipe.stage_server.executor import STASH_COUNT_EVERY
from elasticpipe.training.objectives import make_optimizer
from tests.support.numerics import reference_step, stage_threads

STEPS = 5
MODELS = {
    "mlp": ({"sizes": [12, 24, 24, 24, 6]}, "cross_entropy"),
    "gpt": (
        {"vocab_size": 17, "d_model": 16, "n_heads": 2, "n_layers": 3, "max_seq_len": 8},
        "cross_entropy",
    ),
}
OPTIMIZERS = {"sgd": {"lr": 0.1, "momentum": 0.9}, "adam": {"lr": 1e-2}}


def _pipeline(cluster: LocalCluster, model: str, **options: Any) -> Pipeline:
    """A job of ``model`` (its ``MODELS`` arguments) on ``cluster``; ``options`` are the
    Pipeline's other arguments."""
    return Pipeline(
        coordinator=cluster.coordinator, model=model, model_kwargs=MODELS[model][0], **options
    )


def _batch(model: str, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if model == "mlp":
        return torch.randn(n, 12, generator=g), torch.randint(0, 6, (n,), generator=g)
    tokens = torch.randint(0, 17, (n, 8), generator=g)
    return tokens, torch.roll(tokens, -1, dims=1)


# `make test-numerics` re-runs one case under other kernels and thread counts: the GPT
# (layer norms, attention, an embedding's backward) with Adam and ZB-H1's split backward.
NUMERICS_CASE = ("zb-h1", "adam", "gpt")


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("schedule", "optimizer", "model"),
    [
        pytest.param(*case, marks=pytest.mark.numerics) if case == NUMERICS_CASE else case
        for case in itertools.product(
            ["gpipe", "1f1b", "zb-h1"], sorted(OPTIMIZERS), sorted(MODELS)
        )
    ],
)
def test_pipeline_matches_single_process(
    cluster4: LocalCluster, model: str, optimizer: str, schedule: str
) -> None:
    """Every stage count 1-4 and micro-batch count 1/3/8 (uneven batches too) matches local:
    losses and weights at float32's default tolerance (rtol 1.3e-6, atol 1e-5), the
    reference under a stage's thread count; the pipeline adds micro-batches' gradients
    where the reference takes one whole-batch step, so not bit for bit."""
    kwargs, loss = MODELS[model]
    failures = []
    for stages in (1, 2, 3, 4):
        for micro_batches, batch in ((1, 6), (3, 10), (8, 11)):
            reference = models.build(model, seed=3, **kwargs)
            ref_opt = make_optimizer(optimizer, reference.parameters(), OPTIMIZERS[optimizer])
            g = torch.Generator().manual_seed(stages * 100 + micro_batches)
            with _pipeline(
                cluster4,
                model,
                seed=3,
                optimizer=optimizer,
                optimizer_kwargs=OPTIMIZERS[optimizer],
                loss=loss,
                micro_batches=micro_batches,
                schedule=schedule,
                stages=stages,
            ) as pipe:
                for step in range(STEPS):
                    x, y = _batch(model, batch, g)
                    got = pipe.train_step(x, y)
                    want = reference_step(reference, ref_opt, loss, x, y)
                    torch.testing.assert_close(
                        torch.tensor(got),
                        torch.tensor(want),
                        msg=f"loss of step {step}, {stages} stages, {micro_batches} micro-batches",
                    )
                assert len(pipe.partition.addresses) == stages
                state = pipe.state_dict()
            expected = reference.state_dict()
            assert state.keys() == expected.keys()
            for key, value in expected.items():
                try:
                    torch.testing.assert_close(state[key], value)
                except AssertionError as exc:
                    failures.append(f"{stages} stages, m={micro_batches}, {key}: {exc}")
    assert not failures, "\n".join(failures[:5])


@pytest.mark.numerics
@pytest.mark.timeout(300)
def test_predict_matches_local_forward_and_changes_nothing(cluster4: LocalCluster) -> None:
    """predict() returns the local model's output and leaves the weights as they were."""
    kwargs, _ = MODELS["gpt"]
    reference = models.build("gpt", seed=0, **kwargs)
    x, _ = _batch("gpt", 7, torch.Generator().manual_seed(0))
    with _pipeline(cluster4, "gpt", micro_batches=3, stages=3) as pipe:
        before = pipe.state_dict()
        out = pipe.predict(x)
        with stage_threads():
            torch.testing.assert_close(out, reference(x).detach())
        after = pipe.state_dict()
    for key, value in before.items():
        torch.testing.assert_close(after[key], value, rtol=0, atol=0)


@pytest.mark.timeout(300)
def test_1f1b_keeps_at_most_s_minus_s_micro_batches_alive(cluster4: LocalCluster) -> None:
    """With 1F1B stage s holds at most S - s micro-batches of activations; GPipe holds m."""
    _, loss = MODELS["mlp"]
    x, y = _batch("mlp", 16, torch.Generator().manual_seed(0))
    held_bytes = {}
    for schedule, expected in (("1f1b", [4, 3, 2, 1]), ("gpipe", [8, 8, 8, 8])):
        with _pipeline(
            cluster4, "mlp", loss=loss, micro_batches=8, schedule=schedule, stages=4
        ) as pipe:
            pipe.train_step(x, y)
            peaks = [report.peak_stashed for report in pipe.last_step.reports]
            assert peaks == expected, schedule
            stats = pipe.stage_stats()
            assert [s.peak_stashed for s in stats] == expected
            assert all(s.peak_stashed_bytes > 0 for s in stats)
            held_bytes[schedule] = sum(s.peak_stashed_bytes for s in stats)
    # GPipe holds all 8 micro-batches on every stage, 1F1B 4+3+2+1 of them in all.
    assert held_bytes["gpipe"] > 2 * held_bytes["1f1b"], held_bytes


@pytest.mark.timeout(300)
def test_runs_that_do_not_count_their_stash_report_the_count_of_their_kind(
    cluster4: LocalCluster,
) -> None:
    """Only the first run of a kind and one in ``STASH_COUNT_EVERY`` count what autograd
    saves (``StashMeter``); the runs between report that count. Over a counted run, the
    uncounted ones after it, and the next counted one, every stage reports the same
    bytes; a batch of another shape is counted at once, and holds less."""
    _, loss = MODELS["mlp"]
    g = torch.Generator().manual_seed(0)
    x, y = _batch("mlp", 16, g)
    with _pipeline(cluster4, "mlp", loss=loss, micro_batches=4, stages=2) as pipe:
        peaks = []
        for _ in range(STASH_COUNT_EVERY + 2):
            pipe.train_step(x, y)
            peaks.append([r.peak_stashed_bytes for r in pipe.last_step.reports])
        assert all(p == peaks[0] for p in peaks), peaks
        assert all(b > 0 for b in peaks[0])
        small_x, small_y = _batch("mlp", 8, g)
        pipe.train_step(small_x, small_y)
        smaller = [r.peak_stashed_bytes for r in pipe.last_step.reports]
        assert all(0 < s < b for s, b in zip(smaller, peaks[0], strict=True)), (smaller, peaks)
