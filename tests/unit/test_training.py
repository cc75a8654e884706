"""Tests of losses and optimizers by name, and of micro-batch loss scaling and accumulation."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from elasticpipe.errors import InvalidRequest, PermissionDenied, UserCodeError
from elasticpipe.training.job import JobConfig
from elasticpipe.training.objectives import (
    LOSSES,
    OPTIMIZERS,
    check_optimizer,
    check_per_parameter,
    loss_fn,
    make_optimizer,
    reference_step,
    scaled_loss,
    torch_optimizers,
)
from elasticpipe.training.schedule import split_sizes


def test_cross_entropy_on_sequences_equals_flattened() -> None:
    """(B, T, V) logits with (B, T) targets give the mean over every token of the batch."""
    torch.manual_seed(0)
    logits, targets = torch.randn(3, 5, 7), torch.randint(0, 7, (3, 5))
    expected = F.cross_entropy(logits.reshape(15, 7), targets.reshape(15))
    torch.testing.assert_close(loss_fn("cross_entropy")(logits, targets), expected)


def test_cross_entropy_on_classes_is_torch_cross_entropy() -> None:
    """(B, C) logits with (B,) targets give torch's mean cross-entropy."""
    torch.manual_seed(0)
    logits, targets = torch.randn(6, 4), torch.randint(0, 4, (6,))
    torch.testing.assert_close(
        loss_fn("cross_entropy")(logits, targets), F.cross_entropy(logits, targets)
    )


def test_mse_is_mean_squared_error() -> None:
    """The mse loss is the mean of squared differences."""
    a, b = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[1.0, 0.0], [0.0, 4.0]])
    torch.testing.assert_close(loss_fn("mse")(a, b), torch.tensor(13.0 / 4))


def _model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(loss: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(2)
    x = torch.randn(n, 6)
    y = torch.randint(0, 3, (n,)) if loss == "cross_entropy" else torch.randn(n, 3)
    return x, y


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize(("batch", "m"), [(8, 4), (10, 4), (7, 3), (3, 5), (5, 1)])
def test_scaled_micro_batch_losses_and_grads_match_the_full_batch(
    loss: str, batch: int, m: int
) -> None:
    """Micro-batch losses scaled by n_i/N sum to the batch mean; accumulated grads match."""
    x, y = _batch(loss, batch)
    full = _model()
    full_loss = loss_fn(loss)(full(x), y)
    torch.autograd.backward(full_loss)

    piped = _model()
    total = torch.zeros(())
    sizes = split_sizes(batch, m)
    for xs, ys in zip(torch.split(x, sizes), torch.split(y, sizes), strict=True):
        part = loss_fn(loss)(piped(xs), ys) * (xs.shape[0] / batch)
        torch.autograd.backward(part)
        total += part.detach()

    torch.testing.assert_close(total, full_loss.detach())
    for a, b in zip(full.parameters(), piped.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_make_optimizer_builds_the_named_class(name: str) -> None:
    """Each optimizer name builds its torch class with the given arguments."""
    check_optimizer(name, {"lr": 0.25})  # the client-side check accepts what stages accept
    param = nn.Parameter(torch.zeros(2))
    opt = make_optimizer(name, [param], {"lr": 0.25})
    assert type(opt) is OPTIMIZERS[name]
    assert opt.param_groups[0]["lr"] == 0.25


def test_reference_step_updates_and_returns_the_loss() -> None:
    """One reference step returns the pre-step loss and moves the parameters by SGD's rule."""
    model = _model()
    x, y = _batch("mse", 4)
    before = [p.detach().clone() for p in model.parameters()]
    expected = loss_fn("mse")(model(x), y)
    torch.autograd.backward(expected)
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    opt = make_optimizer("sgd", model.parameters(), {"lr": 0.5})
    loss = reference_step(model, opt, "mse", x, y)
    assert loss == pytest.approx(float(expected.detach()))
    for p, p0, g in zip(model.parameters(), before, grads, strict=True):
        torch.testing.assert_close(p.detach(), p0 - 0.5 * g)


@pytest.mark.parametrize(
    ("call", "value"),
    [
        (lambda: loss_fn("hinge"), "'hinge'"),
        (lambda: make_optimizer("lamb", [], {}), "'lamb'"),
        (lambda: check_optimizer("rmsprop", {}), "'rmsprop'"),
        (lambda: check_optimizer("sgd", {"lr": -1.0}), "-1.0"),
        (lambda: check_optimizer("adam", {"momentum": 0.9}), "momentum"),
    ],
    ids=["loss", "optimizer", "check-unknown", "bad-lr", "bad-kwarg"],
)
def test_unknown_names_and_bad_arguments_are_invalid(call: object, value: str) -> None:
    """Unknown loss/optimizer names and rejected optimizer arguments raise InvalidRequest."""
    with pytest.raises(InvalidRequest, match=value):
        call()  # type: ignore[operator]


# ---- any torch.optim class, custom losses and optimizers by path ------------------------

CUSTOM = "tests.support.custom_models"


@pytest.mark.parametrize("name", sorted(torch_optimizers()))
def test_every_torch_optimizer_is_accepted_by_name_or_refused_with_the_reason(name: str) -> None:
    """Each torch.optim class passes the per-parameter probe by its own name, except LBFGS
    (refused: global line search) and SparseAdam (dense gradients make it fail the probe)."""
    kwargs = {} if name in ("LBFGS", "Adadelta", "Rprop") else {"lr": 0.01}
    if name == "LBFGS":
        with pytest.raises(InvalidRequest, match="'LBFGS' is refused: it runs a line search"):
            check_optimizer(name, kwargs)
    elif name == "SparseAdam":
        with pytest.raises(InvalidRequest, match="'SparseAdam' failed a probe step"):
            check_optimizer(name, kwargs)
    else:
        check_optimizer(name, kwargs)
        JobConfig(model="mlp", optimizer=name)  # the job accepts the name too


def test_an_optimizer_looking_across_parameters_is_refused() -> None:
    """A global-norm optimizer fails the per-parameter probe; a per-layer copy would differ."""
    name = f"{CUSTOM}:GlobalNormSGD"
    check_optimizer(name, {"lr": 0.1})  # the client checks a path's form only
    with pytest.raises(InvalidRequest, match=f"'{name}' is not per-parameter"):
        check_per_parameter(name, {"lr": 0.1}, allow=[CUSTOM])
    with pytest.raises(PermissionDenied, match=name):
        check_per_parameter(name, {"lr": 0.1}, allow=[])


def test_custom_optimizer_by_path_builds_and_checks_its_result() -> None:
    """A path to an optimizer class builds it; a path to something that is not one is an
    InvalidRequest naming it; bad arguments are named."""
    from tests.support.custom_models import GlobalNormSGD

    param = nn.Parameter(torch.zeros(2))
    opt = make_optimizer(f"{CUSTOM}:GlobalNormSGD", [param], {"lr": 0.5}, allow=[CUSTOM])
    assert isinstance(opt, GlobalNormSGD)
    with pytest.raises(InvalidRequest, match=r"returned a list, not a torch\.optim"):
        make_optimizer(f"{CUSTOM}:no_optimizer", [param], {}, allow=[CUSTOM])
    with pytest.raises(InvalidRequest, match=r"rejected \{'momentum': 0\.9\}"):
        make_optimizer(f"{CUSTOM}:GlobalNormSGD", [param], {"momentum": 0.9}, allow=[CUSTOM])


def test_custom_loss_by_path_follows_the_allow_list() -> None:
    """A loss by path resolves when allowed, is refused naming it otherwise, and malformed
    or unknown names are InvalidRequest naming them (also in a JobConfig)."""
    from tests.support.custom_models import half_mse

    assert loss_fn(f"{CUSTOM}:half_mse", allow=[CUSTOM]) is half_mse
    with pytest.raises(PermissionDenied, match=f"{CUSTOM}:half_mse"):
        loss_fn(f"{CUSTOM}:half_mse")
    for bad in ("hinge", "a b:c", "mod:"):
        with pytest.raises(InvalidRequest, match=re.escape(repr(bad))):
            JobConfig(model="mlp", loss=bad)
    JobConfig(model="mlp", loss=f"{CUSTOM}:half_mse")


def test_scaled_loss_names_a_loss_that_is_not_a_scalar() -> None:
    """A loss returning a vector is the user's error, naming the loss and the shape."""
    out, target = torch.randn(4, 3), torch.randn(4, 3)
    with pytest.raises(UserCodeError, match=r"loss 'vec' failed on micro-batch 2 .*\[4, 3\]"):
        scaled_loss("vec", lambda o, t: (o - t) ** 2, out, target, 0.5, "on micro-batch 2")
    grad, loss = scaled_loss("mse", loss_fn("mse"), out, target, 0.5, "")
    assert loss == pytest.approx(0.5 * float(F.mse_loss(out, target)))
    torch.testing.assert_close(grad, 0.5 * 2 * (out - target) / out.numel())
