"""Tests of LocalPipeline, the single-process reference: plain PyTorch without randomness,
reproducible dropout, the process's RNG left alone, and errors before anything changes."""

from __future__ import annotations

import pytest
import torch

from elasticpipe import LocalPipeline, models
from elasticpipe.errors import InvalidRequest, PermissionDenied, PipelineClosed
from elasticpipe.training.objectives import make_optimizer, reference_step
from tests.support import jobs

STEPS = 4
DROPOUT = "tests.support.custom_models:dropout"
ALLOW = ["tests.support"]


@pytest.mark.numerics
def test_local_pipeline_equals_plain_pytorch_without_randomness() -> None:
    """An MLP (no dropout) through LocalPipeline equals ordinary PyTorch training: bit for bit
    with one micro-batch, to 1e-6 with four."""
    kwargs = {"sizes": [12, 24, 24, 6]}
    sgd = {"lr": 0.1, "momentum": 0.9}
    for micro_batches, tolerance in ((1, 0.0), (4, 1e-6)):
        reference = models.build("mlp", seed=3, **kwargs)
        optimizer = make_optimizer("sgd", reference.parameters(), sgd)
        g = torch.Generator().manual_seed(1)
        with jobs.local_mlp(
            **kwargs, seed=3, optimizer="sgd", optimizer_kwargs=sgd, micro_batches=micro_batches
        ) as pipe:
            for _ in range(STEPS):
                x, y = torch.randn(10, 12, generator=g), torch.randint(0, 6, (10,), generator=g)
                got = pipe.train_step(x, y)
                want = reference_step(reference, optimizer, "cross_entropy", x, y)
                assert got == pytest.approx(want, rel=tolerance, abs=tolerance)
            assert pipe.step == STEPS and pipe.last_step.step == STEPS
            state = pipe.state_dict()
            torch.testing.assert_close(
                pipe.predict(x), reference(x).detach(), rtol=tolerance, atol=tolerance
            )
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=tolerance, atol=tolerance)


def _dropout_run(seed: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    with LocalPipeline(model=DROPOUT, seed=seed, micro_batches=2, allow=ALLOW) as pipe:
        losses = [
            pipe.train_step(torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g))
            for _ in range(3)
        ]
        return losses, pipe.state_dict()


def test_dropout_is_reproducible_and_leaves_the_process_rng_alone() -> None:
    """Two runs with one seed agree bit for bit whatever the global RNG says; another seed
    differs; the global stream goes on as if training had not drawn from it."""
    torch.manual_seed(1)
    first = _dropout_run(seed=5)
    after_training = torch.rand(3)
    torch.manual_seed(1)
    expected = torch.rand(3)
    assert torch.equal(after_training, expected)
    torch.manual_seed(999)
    second = _dropout_run(seed=5)
    assert first[0] == second[0]
    for key, value in first[1].items():
        assert torch.equal(second[1][key], value), key
    assert _dropout_run(seed=6)[0] != first[0]


def test_predict_is_eval_mode_and_deterministic() -> None:
    """predict turns dropout off: equal to the layers' eval() output, twice the same."""
    with LocalPipeline(model=DROPOUT, micro_batches=3, allow=ALLOW) as pipe:
        x = torch.randn(7, 8)
        out = pipe.predict(x)
        assert torch.equal(out, pipe.predict(x))
        assert all(layer.training for layer in pipe.layers)  # back in training mode
        reference = torch.nn.Sequential(*pipe.layers).eval()
        torch.testing.assert_close(out, reference(x).detach())


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"model": DROPOUT, "allow": ["mypkg"]}, PermissionDenied,
         "add 'tests' to LocalPipeline's allow= argument"),
        ({"model": "mlp", "loss": "tests.support.custom_models:reexported_loss",
          "allow": ["tests.support.custom_models"]}, PermissionDenied,
         "defined in module 'tests.support.custom_losses'"),
        ({"model": "mlp", "optimizer": "LBFGS"}, InvalidRequest, "'LBFGS' is refused"),
        ({"model": "mlp", "optimizer_kwargs": {"lr": object()}}, InvalidRequest, "JSON"),
        ({"model": "mlp", "micro_batches": 0}, InvalidRequest, "micro_batches"),
    ],
    ids=["model", "loss", "optimizer", "kwargs", "micro-batches"],
)  # fmt: skip
def test_bad_arguments_are_refused_naming_them(
    kwargs: dict[str, object], error: type[Exception], text: str
) -> None:
    """What a stage would refuse, LocalPipeline refuses up front, naming it (paths: those
    outside the ``allow=`` it was given)."""
    with pytest.raises(error) as info:
        LocalPipeline(**kwargs)  # type: ignore[arg-type]
    assert text in str(info.value)


def test_a_failed_step_changes_nothing() -> None:
    """Targets of the wrong shape: the user's error, and the weights and step stay as they
    were (the accumulated gradients are dropped)."""
    with LocalPipeline(model="mlp", model_kwargs={"sizes": [4, 3]}, micro_batches=2) as pipe:
        before = pipe.state_dict()
        with pytest.raises(InvalidRequest, match="batch size"):
            pipe.train_step(torch.randn(4, 4), torch.zeros(3, dtype=torch.long))
        with pytest.raises(InvalidRequest, match="loss 'cross_entropy' failed on micro-batch 0"):
            pipe.train_step(torch.randn(4, 4), torch.full((4,), 7))
        assert pipe.step == 0
        assert all(p.grad is None for layer in pipe.layers for p in layer.parameters())
        pipe.train_step(torch.randn(4, 4), torch.zeros(4, dtype=torch.long))
        assert pipe.step == 1
        assert not torch.equal(pipe.state_dict()["0.weight"], before["0.weight"])


@pytest.mark.numerics
def test_schedules_clipping_and_recompute_equal_plain_pytorch() -> None:
    """A cosine schedule with warm-up, global-norm clipping and recomputation in
    LocalPipeline equal the same features of plain PyTorch on the whole model."""
    kwargs = {"sizes": [12, 24, 24, 6]}
    reference = models.build("mlp", seed=5, **kwargs)
    optimizer = make_optimizer("sgd", reference.parameters(), {"lr": 0.5})
    warmup, cosine = 2, {"T_max": 6}
    schedule = torch.optim.lr_scheduler.SequentialLR(
        optimizer,
        [
            torch.optim.lr_scheduler.LinearLR(
                optimizer, start_factor=1 / warmup, total_iters=warmup - 1
            ),
            torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, **cosine),
        ],
        milestones=[warmup],
    )
    g = torch.Generator().manual_seed(2)
    with jobs.local_mlp(
        **kwargs,
        seed=5,
        optimizer="sgd",
        optimizer_kwargs={"lr": 0.5},
        micro_batches=1,
        scheduler="CosineAnnealingLR",
        scheduler_kwargs=cosine,
        warmup_steps=warmup,
        max_grad_norm=0.05,
        recompute=True,
    ) as pipe:
        for _ in range(STEPS + 2):
            x, y = torch.randn(10, 12, generator=g) * 10, torch.randint(0, 6, (10,), generator=g)
            got = pipe.train_step(x, y)
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(reference(x), y)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
            optimizer.step()
            schedule.step()
            assert got == pytest.approx(float(loss.detach()), rel=1e-6)
            assert pipe.last_step.grad_norm == pytest.approx(float(norm), rel=1e-5)
        state = pipe.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value)


def test_the_users_own_factory_loss_and_optimizer_need_no_allow_list() -> None:
    """Without ``allow=``, LocalPipeline imports a model factory, a loss and an optimizer
    from the user's own modules (here under tests/), as the user's process would, and
    trains them as plain PyTorch does (bit for bit: one micro-batch, the same process)."""
    from tests.support.custom_models import SignSGD

    own = "tests.support.custom_models"
    loss = "tests.support.custom_losses:half_mse"
    reference = models.build(f"{own}:tiny", seed=0, allow=["tests"])
    optimizer = SignSGD(reference.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(0)
    with LocalPipeline(
        model=f"{own}:tiny",
        loss=loss,
        optimizer=f"{own}:SignSGD",
        optimizer_kwargs={"lr": 0.01},
        micro_batches=1,
    ) as pipe:
        for _ in range(STEPS):
            x, y = torch.randn(6, 8, generator=g), torch.randn(6, 3, generator=g)
            want = reference_step(reference, optimizer, loss, x, y, allow=["tests"])
            assert pipe.train_step(x, y) == want
        state = pipe.state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(state[key], value), key


@pytest.mark.parametrize(
    "kwargs",
    [
        {"model": "tests.support.custom_models:tiny"},
        {"model": "mlp", "loss": "tests.support.custom_losses:half_mse"},
        {"model": "mlp", "optimizer": "tests.support.custom_models:SignSGD"},
    ],
    ids=["model", "loss", "optimizer"],
)
def test_an_allow_list_that_excludes_the_module_names_the_argument(
    kwargs: dict[str, object],
) -> None:
    """With ``allow=`` that leaves the module out, LocalPipeline refuses it and says to add
    its package to the ``allow=`` argument, not to start stages with a flag."""
    with pytest.raises(PermissionDenied) as info:
        LocalPipeline(**kwargs, allow=["mypkg"])  # type: ignore[arg-type]
    message = str(info.value)
    assert "allowed prefixes ['mypkg']" in message
    assert "add 'tests' to LocalPipeline's allow= argument" in message
    assert "--allow-models" not in message and "stage" not in message


def test_a_closed_local_pipeline_refuses_what_a_closed_pipeline_refuses() -> None:
    """After its ``with`` block, train_step, predict, state_dict and layers raise
    PipelineClosed, as Pipeline's do (so the two stay swappable), and no step is taken;
    step and last_step still say what was done."""
    x, y = torch.randn(8, 12), torch.randint(0, 6, (8,))
    with LocalPipeline(model="mlp", model_kwargs={"sizes": [12, 24, 6]}) as pipe:
        pipe.train_step(x, y)
    calls = {
        "train_step": lambda: pipe.train_step(x, y),
        "predict": lambda: pipe.predict(x),
        "state_dict": pipe.state_dict,
        "layers": lambda: pipe.layers,
    }
    for name, call in calls.items():
        with pytest.raises(PipelineClosed, match="this LocalPipeline is closed"):
            call()
        assert pipe.step == 1 and pipe.last_step.step == 1, name
    pipe.close()  # a second close does nothing


@pytest.mark.parametrize(("rows", "ran"), [(8, 4), (6, 4), (3, 3), (1, 1)])
def test_last_step_says_how_many_micro_batches_ran(rows: int, ran: int) -> None:
    """A mini-batch of fewer samples than ``micro_batches`` (4) is split into one
    micro-batch per sample; ``last_step.micro_batches`` says how many ran."""
    with LocalPipeline(model="mlp", model_kwargs={"sizes": [12, 6]}, micro_batches=4) as pipe:
        pipe.train_step(torch.randn(rows, 12), torch.randint(0, 6, (rows,)))
        assert pipe.last_step.micro_batches == ran
