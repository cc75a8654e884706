"""The wire dtype: half the bytes, float32 again on arrival, the same rounding locally."""

from __future__ import annotations

import pytest
import torch

from elasticpipe import wire


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_encode_halves_and_decode_restores_float32(name: str) -> None:
    """float32 travels in the wire dtype; integers (token ids) travel unchanged."""
    x = torch.randn(4, 8)
    sent = wire.encode(x, name)
    assert sent.element_size() * 2 == x.element_size()
    back = wire.decode(sent, name)
    assert back.dtype == torch.float32 and torch.equal(back, x.to(wire.DTYPES[name]).float())
    ids = torch.arange(5)
    assert wire.encode(ids, name) is ids and wire.encode(x, "") is x


@pytest.mark.timeout(10)
def test_cast_rounds_forward_and_backward() -> None:
    """The local reference rounds the value and its gradient through the wire dtype."""
    x = torch.tensor([1.0 + 2**-12], requires_grad=True)
    y = wire.cast(x, "bf16")
    assert y.item() == 1.0
    y.backward(torch.tensor([1.0 + 2**-12]))
    assert x.grad is not None and x.grad.item() == 1.0
