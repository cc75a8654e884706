"""Odd layers for the ZB-H1 review: frozen, reused, unused and independent parameters,
tuples with int tensors, batch norm; a layer whose backward raises."""

from __future__ import annotations

import torch
from torch import nn


class Frozen(nn.Module):
    def __init__(self, w: int) -> None:
        super().__init__()
        self.lin = nn.Linear(w, w)
        self.lin.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Twice(nn.Module):
    """One Linear used twice, with a nonlinearity between (W must walk back through it)."""

    def __init__(self, w: int) -> None:
        super().__init__()
        self.lin = nn.Linear(w, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.tanh(self.lin(x)))


class Unused(nn.Module):
    def __init__(self, w: int) -> None:
        super().__init__()
        self.lin = nn.Linear(w, w)
        self.spare = nn.Parameter(torch.ones(w))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.spare.fill_(1.0)
        self.lin.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class WithIds(nn.Module):
    """Returns (hidden, int ids)."""

    def __init__(self, w: int) -> None:
        super().__init__()
        self.lin = nn.Linear(w, w)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids = (x.detach().abs().sum(-1) * 10).long() % 5
        return self.lin(x), ids


class UseIds(nn.Module):
    def __init__(self, w: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, w)
        self.lin = nn.Linear(w, w)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h, ids = x
        return self.lin(h) * self.emb(ids)


class Independent(nn.Module):
    """Output: a parameter-only tensor beside the input passed through a Linear."""

    def __init__(self, w: int) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.linspace(-1, 1, w))
        self.lin = nn.Linear(w, w)

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.p.copy_(torch.linspace(-1, 1, self.p.numel()))
        self.lin.reset_parameters()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(self.lin(x)), self.p.expand(x.shape[0], -1) * 2


class Join(nn.Module):
    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return x[0] + x[1]


def odd(width: int = 8, classes: int = 3) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(width, width),
        Frozen(width),
        Twice(width),
        Unused(width),
        WithIds(width),
        UseIds(width),
        nn.BatchNorm1d(width),
        Independent(width),
        Join(),
        nn.ReLU(),
        nn.Linear(width, classes),
    )


def independent_only(width: int = 8) -> nn.Sequential:
    """A layer whose only output does not depend on its input, then a Linear."""
    return nn.Sequential(nn.Linear(width, width), Bias(width), nn.Linear(width, width))


class Bias(nn.Module):
    def __init__(self, w: int) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.linspace(-1, 1, w))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.p.copy_(torch.linspace(-1, 1, self.p.numel()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.p.expand(x.shape[0], -1) * 3


class Reentrant(nn.Module):
    """A linear layer under reentrant checkpointing (which refuses ``autograd.grad``: its
    split backward runs whole in B)."""

    def __init__(self, w: int) -> None:
        super().__init__()
        self.lin = nn.Linear(w, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.lin, x, use_reentrant=True)


def checkpointed(width: int = 8, classes: int = 3) -> nn.Sequential:
    """Linear, a reentrantly checkpointed Linear, ReLU, Linear."""
    return nn.Sequential(
        nn.Linear(width, width), Reentrant(width), nn.ReLU(), nn.Linear(width, classes)
    )


def unreached(width: int = 8, classes: int = 3) -> nn.Sequential:
    """No batch norm, but a frozen weight, a parameter no input reaches, a Linear used twice
    and a Dropout: Linear, Frozen, Unused, Dropout, Twice, ReLU, Linear."""
    return nn.Sequential(
        nn.Linear(width, width),
        Frozen(width),
        Unused(width),
        nn.Dropout(0.2),
        Twice(width),
        nn.ReLU(),
        nn.Linear(width, classes),
    )


class _Refuses(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, g: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("no backward here")


class RefusesBackward(nn.Module):
    """A Linear whose backward raises (the user's error, to be named)."""

    def __init__(self, w: int) -> None:
        super().__init__()
        self.lin = nn.Linear(w, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Refuses.apply(self.lin(x))


def refuses(width: int = 8) -> nn.Sequential:
    """Linear, Linear, a Linear whose backward raises, Linear."""
    return nn.Sequential(
        nn.Linear(width, width),
        nn.Linear(width, width),
        RefusesBackward(width),
        nn.Linear(width, width),
    )


class Positive(nn.Module):
    """Where its input is positive: a float tensor that needs no gradient."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x > 0).float()


def gradless_between(width: int = 8) -> nn.Sequential:
    """Linear, a float mask without a gradient, Linear (found by a second reader: linked,
    the layers below got no gradient where one by one they got zeros)."""
    return nn.Sequential(nn.Linear(width, width), Positive(), nn.Linear(width, width))


class AddBias(Bias):
    """Adds its bias to its input in place."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.add_(self.p)


def in_place(width: int = 8) -> nn.Sequential:
    """Linear, a layer that changes its input in place, Linear."""
    return nn.Sequential(nn.Linear(width, width), AddBias(width), nn.Linear(width, width))


class Threaded(nn.Module):
    """A Linear whose weight's transform is made on a helper thread (a node with another
    thread's sequence number: autograd runs it after the layer below began)."""

    def __init__(self, w: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.eye(w))

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.w.copy_(torch.eye(self.w.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import threading

        out: list[torch.Tensor] = []
        helper = threading.Thread(target=lambda: out.append(self.w * 2))
        helper.start()
        helper.join()
        return x @ out[0]


def threaded(width: int = 8) -> nn.Sequential:
    """Linear, a layer with a node made on another thread, Linear."""
    return nn.Sequential(nn.Linear(width, width), Threaded(width), nn.Linear(width, width))


class ClampInput(nn.Module):
    """Clamps its input in place where autograd does not record it, then a Linear."""

    def __init__(self, w: int) -> None:
        super().__init__()
        self.lin = nn.Linear(w, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            x.clamp_(-0.5, 0.5)
        return self.lin(x)


def clamped(width: int = 8) -> nn.Sequential:
    """Linear, a layer clamping its input in place without autograd, Linear."""
    return nn.Sequential(nn.Linear(width, width), ClampInput(width), nn.Linear(width, width))
