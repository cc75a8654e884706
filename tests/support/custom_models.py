"""User-defined model factories, a loss and an optimizer, importable by path
(``tests.support.custom_models:tiny``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests.support import custom_losses


def tiny(width: int = 8, classes: int = 3) -> nn.Sequential:
    """Three layers: Linear, Tanh, Linear."""
    return nn.Sequential(nn.Linear(width, 2 * width), nn.Tanh(), nn.Linear(2 * width, classes))


def normed(width: int = 8, classes: int = 3) -> nn.Sequential:
    """Layers whose train and eval behaviour differ: Linear, BatchNorm1d, ReLU, Dropout."""
    return nn.Sequential(
        nn.Linear(width, 2 * width),
        nn.BatchNorm1d(2 * width),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Linear(2 * width, classes),
    )


def dropout(width: int = 8, classes: int = 3, p: float = 0.1) -> nn.Sequential:
    """Seven layers with two Dropouts (random in training): Linear, Dropout, ReLU, Linear,
    Dropout, ReLU, Linear."""
    return nn.Sequential(
        nn.Linear(width, 4 * width),
        nn.Dropout(p),
        nn.ReLU(),
        nn.Linear(4 * width, 4 * width),
        nn.Dropout(p),
        nn.ReLU(),
        nn.Linear(4 * width, classes),
    )


def half_mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A custom loss: half the mean squared error (mean over the micro-batch)."""
    return 0.5 * F.mse_loss(output, target)


reexported_loss = custom_losses.half_mse  # allowed module, callable from one that is not


class GlobalNormSGD(torch.optim.Optimizer):
    """SGD on gradients scaled by their global norm: not per-parameter (refused)."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """Steps every parameter by ``lr * grad / ||all grads||``."""
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.sqrt(sum((g * g).sum() for g in grads)) if grads else torch.tensor(1.0)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / norm, alpha=-group["lr"])


class SignSGD(torch.optim.Optimizer):
    """A custom per-parameter optimizer: steps every parameter by ``lr * sign(grad)``."""

    def __init__(self, params: Any, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """Steps every parameter with a gradient by ``-lr * sign(grad)``."""
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(torch.sign(p.grad), alpha=-group["lr"])


def no_optimizer(params: Any, lr: float = 0.1) -> list[Any]:
    """Takes an optimizer's arguments but returns no optimizer (refused)."""
    return list(params)


# ---- layers with several tensors: blocks that pass (hidden, mask) -------------------------


class MaskedEmbedding(nn.Module):
    """(ids, mask) -> (hidden, mask): token embeddings zeroed where ``mask`` is False.

    With ``as_dict``, takes ``{"ids", "mask"}`` and returns ``{"hidden", "keep"}`` where
    ``keep`` is the mask as float32 0/1 (a floating tensor that needs no gradient).
    """

    def __init__(self, vocab: int, width: int, as_dict: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.as_dict = as_dict

    def forward(self, x: Any) -> Any:
        ids, mask = (x["ids"], x["mask"]) if self.as_dict else x
        hidden = self.embed(ids) * mask.unsqueeze(-1)
        if self.as_dict:
            return {"hidden": hidden, "keep": mask.float()}
        return hidden, mask


class MaskedAttention(nn.Module):
    """(hidden, mask) -> (hidden + attention over the unmasked positions, mask)."""

    def __init__(self, width: int, as_dict: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.as_dict = as_dict

    def forward(self, x: Any) -> Any:
        hidden, mask = (x["hidden"], x["keep"]) if self.as_dict else x
        q, k, v = self.qkv(self.norm(hidden)).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        scores = scores.masked_fill(~mask.bool().unsqueeze(1), -1e9)
        hidden = hidden + self.out(scores.softmax(-1) @ v)
        return {"hidden": hidden, "keep": mask} if self.as_dict else (hidden, mask)


class MaskedMLP(nn.Module):
    """(hidden, mask) -> (hidden + MLP(hidden) on the unmasked positions, mask)."""

    def __init__(self, width: int, as_dict: bool = False) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.as_dict = as_dict

    def forward(self, x: Any) -> Any:
        hidden, mask = (x["hidden"], x["keep"]) if self.as_dict else x
        update = self.down(torch.tanh(self.up(hidden))) * mask.unsqueeze(-1).to(hidden.dtype)
        hidden = hidden + update
        return {"hidden": hidden, "keep": mask} if self.as_dict else (hidden, mask)


class MaskedHead(nn.Module):
    """(hidden, mask) -> logits of the mean of the unmasked positions."""

    def __init__(self, width: int, classes: int, as_dict: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(width, classes)
        self.as_dict = as_dict

    def forward(self, x: Any) -> torch.Tensor:
        hidden, mask = (x["hidden"], x["keep"]) if self.as_dict else x
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1.0)
        return self.proj(pooled)  # type: ignore[no-any-return]


class ClampIds(nn.Module):
    """(ids, mask) -> (ids clamped into the vocabulary, mask): integers only, no gradient."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        ids, mask = x
        return ids.clamp(0, self.vocab - 1), mask


def masked(
    vocab: int = 13,
    width: int = 8,
    blocks: int = 2,
    classes: int = 3,
    as_dict: bool = False,
    head: bool = True,
    clamp: bool = False,
) -> nn.Sequential:
    """A model whose layers pass (hidden, mask): embedding, ``blocks`` times (masked
    attention, masked MLP), head. Inputs are (ids int64, mask bool); with ``as_dict``,
    {"ids", "mask"} in and {"hidden", "keep" (float)} between layers. Without ``head`` the
    model ends on a block (its output is (hidden, mask)). With ``clamp`` a first layer
    passes (ids, mask) on, integers only (no floating tensor for a gradient)."""
    layers: list[nn.Module] = [ClampIds(vocab)] if clamp else []
    layers.append(MaskedEmbedding(vocab, width, as_dict))
    for _ in range(blocks):
        layers += [MaskedAttention(width, as_dict), MaskedMLP(width, as_dict)]
    if head:
        layers.append(MaskedHead(width, classes, as_dict))
    return nn.Sequential(*layers)


class BadStructure(nn.Module):
    """Returns a structure no stage can send: a nested tuple or a non-tensor element."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x: torch.Tensor) -> Any:
        if self.kind == "nested":
            return (x, (x, x))
        return {"hidden": x, "scale": 2.0}


def bad_structure(kind: str = "nested", width: int = 8, classes: int = 3) -> nn.Sequential:
    """Linear, then a layer returning a bad structure (``kind``: "nested" or "non_tensor"),
    then Linear."""
    return nn.Sequential(nn.Linear(width, width), BadStructure(kind), nn.Linear(width, classes))


class Scale(nn.Module):
    """Multiplies by a learned vector set in ``__init__``: it has no ``reset_parameters()``,
    as many library layers do not (a seed cannot initialise it; ``init_state`` can)."""

    def __init__(self, width: int):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


def no_reset(width: int = 6, classes: int = 3) -> nn.Sequential:
    """Linear, Scale (no reset_parameters), Tanh, Linear."""
    return nn.Sequential(nn.Linear(width, 12), Scale(12), nn.Tanh(), nn.Linear(12, classes))


class _Tally(nn.Module):
    """A Linear that also sums its training inputs into a buffer: state kept outside the
    gradients, which each replica would update from its own micro-batches only."""

    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.register_buffer("seen", torch.zeros(()))

    def reset_parameters(self) -> None:
        self.lin.reset_parameters()
        self.seen.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen += x.detach().sum()
        return self.lin(x)


def tallied(width: int = 8, classes: int = 3) -> nn.Sequential:
    """Four layers, the second a ``_Tally``: Linear, _Tally, ReLU, Linear."""
    return nn.Sequential(
        nn.Linear(width, width), _Tally(width), nn.ReLU(), nn.Linear(width, classes)
    )
