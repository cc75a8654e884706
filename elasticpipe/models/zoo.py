"""The built-in models: an MLP, a small decoder-only transformer (GPT) and a small CNN.

Each is a factory of the model contract (``elasticpipe.models.contract``): keyword arguments
in, a list of layers out, every layer initialised from the seed by ``init_layer``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.nn.functional import embedding, scaled_dot_product_attention

from elasticpipe.errors import InvalidRequest, ModelError

_INIT_STD = 0.02  # GPT-2's initialisation of linear weights and embeddings

__all__ = [
    "BUILTIN_MODELS",
    "CausalSelfAttention",
    "LMHead",
    "TokenEmbedding",
    "TransformerBlock",
    "cnn",
    "gpt",
    "mlp",
]


def _int_arg(model: str, name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ModelError(f"model {model!r}: {name} must be an int >= {minimum}, got {value!r}")
    return value


_ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "gelu": nn.GELU,
    "relu": nn.ReLU,
    "sigmoid": nn.Sigmoid,
    "silu": nn.SiLU,
    "tanh": nn.Tanh,
}


def mlp(*, sizes: Sequence[int] = (32, 64, 64, 10), activation: str = "relu") -> nn.Sequential:
    """A multi-layer perceptron whose Linear and activation modules are separate layers.

    Args:
        sizes: Feature sizes from input to output; ``[32, 64, 10]`` gives
            Linear(32, 64), ReLU, Linear(64, 10).
        activation: One of ``"gelu"``, ``"relu"``, ``"sigmoid"``, ``"silu"``, ``"tanh"``.

    Returns:
        The layers; input (B, sizes[0]) float, output (B, sizes[-1]).

    Raises:
        ModelError: ``sizes`` is not at least two positive ints, or the activation is unknown.
    """
    if (
        isinstance(sizes, str | bytes)
        or not isinstance(sizes, Sequence)
        or len(sizes) < 2
        or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes)
    ):
        raise ModelError(f"model 'mlp': sizes must be at least 2 positive ints, got {sizes!r}")
    make_activation = _ACTIVATIONS.get(activation) if isinstance(activation, str) else None
    if make_activation is None:
        raise ModelError(
            f"model 'mlp': unknown activation {activation!r} (known: {sorted(_ACTIVATIONS)})"
        )
    layers: list[nn.Module] = []
    for n_in, n_out in itertools.pairwise(sizes):
        if layers:
            layers.append(make_activation())
        layers.append(nn.Linear(n_in, n_out))
    return nn.Sequential(*layers)


def _init_linear(linear: nn.Linear) -> None:
    nn.init.normal_(linear.weight, mean=0.0, std=_INIT_STD)
    if linear.bias is not None:
        nn.init.zeros_(linear.bias)


class TokenEmbedding(nn.Module):
    """Token plus learned position embedding: int64 ids (B, T) to (B, T, d_model)."""

    def __init__(self, vocab_size: int, d_model: int, max_seq_len: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        # Plain parameters rather than nn.Embedding, whose constructor draws normal_ values;
        # normal_ on the meta device costs seconds of one-time imports in torch.
        self.token = nn.Parameter(torch.empty(vocab_size, d_model))
        self.position = nn.Parameter(torch.empty(max_seq_len, d_model))

    def reset_parameters(self) -> None:
        """Draws both tables from N(0, 0.02²)."""
        nn.init.normal_(self.token, mean=0.0, std=_INIT_STD)
        nn.init.normal_(self.position, mean=0.0, std=_INIT_STD)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Embeds token ids.

        Args:
            ids: int64 token ids of shape (B, T), T <= max_seq_len.

        Returns:
            Embeddings of shape (B, T, d_model).

        Raises:
            InvalidRequest: Wrong shape or dtype, T over max_seq_len, or an id out of range.
        """
        if ids.dim() != 2 or ids.dtype != torch.int64:
            raise InvalidRequest(
                f"token ids must be int64 of shape (batch, seq_len), got {ids.dtype} "
                f"{tuple(ids.shape)}"
            )
        seq_len = ids.shape[1]
        if seq_len > self.max_seq_len:
            raise InvalidRequest(
                f"sequence length {seq_len} is over max_seq_len {self.max_seq_len}"
            )
        # Checked here because an out-of-range id is a device-side assert on CUDA.
        if ids.numel() and bool(((ids < 0) | (ids >= self.vocab_size)).any()):
            raise InvalidRequest(
                f"token ids must be in [0, {self.vocab_size}), got min {int(ids.min())} "
                f"max {int(ids.max())}"
            )
        positions = torch.arange(seq_len, device=ids.device)
        return embedding(ids, self.token) + embedding(positions, self.position)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``scaled_dot_product_attention``."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        # No bias on q/k/v: a key bias cannot change softmax, so its gradient is pure rounding
        # noise, which Adam would amplify into random-sign updates (and it is 0 % useful).
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model)

    def reset_parameters(self) -> None:
        """Draws weights from N(0, 0.02²) and zeroes biases."""
        _init_linear(self.qkv)
        _init_linear(self.proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attends each position to itself and the positions before it.

        Args:
            x: Activations of shape (B, T, d_model).

        Returns:
            Activations of shape (B, T, d_model).
        """
        batch, seq_len, d_model = x.shape
        heads = self.qkv(x).view(batch, seq_len, 3, self.n_heads, d_model // self.n_heads)
        q, k, v = heads.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, heads, T, head_dim)
        y = scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq_len, d_model))  # type: ignore[no-any-return]


class TransformerBlock(nn.Module):
    """A pre-LayerNorm decoder block: causal self-attention then a GELU MLP, each residual."""

    def __init__(self, d_model: int, n_heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, mlp_ratio * d_model)
        self.act = nn.GELU()
        self.out = nn.Linear(mlp_ratio * d_model, d_model)

    def reset_parameters(self) -> None:
        """Resets the LayerNorms to identity, linear weights to N(0, 0.02²), biases to 0."""
        self.ln1.reset_parameters()
        self.attn.reset_parameters()
        self.ln2.reset_parameters()
        _init_linear(self.fc)
        _init_linear(self.out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Applies the block.

        Args:
            x: Activations of shape (B, T, d_model).

        Returns:
            Activations of shape (B, T, d_model).
        """
        x = x + self.attn(self.ln1(x))
        return x + self.out(self.act(self.fc(self.ln2(x))))  # type: ignore[no-any-return]


class LMHead(nn.Module):
    """Final LayerNorm and projection to vocabulary logits."""

    def __init__(self, d_model: int, vocab_size: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d_model)
        self.proj = nn.Linear(d_model, vocab_size)

    def reset_parameters(self) -> None:
        """Resets the LayerNorm to identity, the weight to N(0, 0.02²), the bias to 0."""
        self.ln.reset_parameters()
        _init_linear(self.proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Computes logits.

        Args:
            x: Activations of shape (B, T, d_model).

        Returns:
            Logits of shape (B, T, vocab_size).
        """
        return self.proj(self.ln(x))  # type: ignore[no-any-return]


def gpt(
    *,
    vocab_size: int = 96,
    d_model: int = 64,
    n_heads: int = 4,
    n_layers: int = 4,
    max_seq_len: int = 128,
    mlp_ratio: int = 4,
) -> nn.Sequential:
    """A small decoder-only transformer: embedding, ``n_layers`` blocks, head.

    Args:
        vocab_size: Number of token ids.
        d_model: Width of the residual stream; a multiple of ``n_heads``.
        n_heads: Attention heads per block.
        n_layers: Number of transformer blocks (the model has ``n_layers + 2`` layers).
        max_seq_len: Longest accepted sequence.
        mlp_ratio: Hidden width of each MLP, as a multiple of ``d_model``.

    Returns:
        The layers; input int64 (B, T), output logits (B, T, vocab_size).

    Raises:
        ModelError: An argument is not a positive int, or ``d_model % n_heads != 0``.
    """
    for name, value in (
        ("vocab_size", vocab_size),
        ("d_model", d_model),
        ("n_heads", n_heads),
        ("max_seq_len", max_seq_len),
        ("mlp_ratio", mlp_ratio),
    ):
        _int_arg("gpt", name, value)
    _int_arg("gpt", "n_layers", n_layers, minimum=0)
    if d_model % n_heads:
        raise ModelError(f"model 'gpt': d_model {d_model} is not a multiple of n_heads {n_heads}")
    return nn.Sequential(
        TokenEmbedding(vocab_size, d_model, max_seq_len),
        *(TransformerBlock(d_model, n_heads, mlp_ratio) for _ in range(n_layers)),
        LMHead(d_model, vocab_size),
    )


def _conv_block(in_channels: int, out_channels: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1),
        nn.GroupNorm(math.gcd(out_channels, 8), out_channels),
        nn.ReLU(),
    )


def cnn(
    *, in_channels: int = 1, num_classes: int = 10, width: int = 16, image_size: int = 28
) -> nn.Sequential:
    """A small convolutional classifier of six layers.

    Layers: conv block, max-pool, conv block, max-pool, conv block, Flatten+Linear head,
    where a conv block is Conv2d(3x3) + GroupNorm + ReLU.

    Args:
        in_channels: Channels of the input images.
        num_classes: Number of output logits.
        width: Channels of the first conv block (the later ones have twice as many).
        image_size: Height and width of the (square) input images, at least 4.

    Returns:
        The layers; input float (B, in_channels, image_size, image_size), output
        (B, num_classes).

    Raises:
        ModelError: An argument is not a positive int, or ``image_size < 4``.
    """
    _int_arg("cnn", "in_channels", in_channels)
    _int_arg("cnn", "num_classes", num_classes)
    _int_arg("cnn", "width", width)
    _int_arg("cnn", "image_size", image_size, minimum=4)
    side = image_size // 4
    return nn.Sequential(
        _conv_block(in_channels, width),
        nn.MaxPool2d(2),
        _conv_block(width, 2 * width),
        nn.MaxPool2d(2),
        _conv_block(2 * width, 2 * width),
        nn.Sequential(nn.Flatten(), nn.Linear(2 * width * side * side, num_classes)),
    )


BUILTIN_MODELS: dict[str, Callable[..., nn.Module | list[nn.Module]]] = {
    "cnn": cnn,
    "gpt": gpt,
    "mlp": mlp,
}
