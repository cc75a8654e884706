"""The wire dtype: half the bytes, float32 again on arrival, the same rounding locally."""

from __future__ import annotations

import pytest
import torch

from elasticpipe.wire import compress


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_encode_halves_and_decode_restores_float32(name: str) -> None:
    """float32 travels in the wire dtype; integers (token ids) travel unchanged."""
    x = torch.randn(4, 8)
    sent = compress.encode(x, name)
    assert sent.element_size() * 2 == x.element_size()
    back = compress.decode(sent, name)
    assert back.dtype == torch.float32 and torch.equal(back, x.to(compress.DTYPES[name]).float())
    ids = torch.arange(5)
    assert compress.encode(ids, name) is ids and compress.encode(x, "") is x


@pytest.mark.timeout(10)
def test_cast_rounds_forward_and_backward() -> None:
    """The local reference rounds the value and its gradient through the wire dtype."""
    x = torch.tensor([1.0 + 2**-12], requires_grad=True)
    y = compress.cast(x, "bf16")
    assert y.item() == 1.0
    y.backward(torch.tensor([1.0 + 2**-12]))
    assert x.grad is not None and x.grad.item() == 1.0


@pytest.mark.timeout(10)
@pytest.mark.parametrize("as_dict", [False, True])
def test_each_floating_tensor_of_a_tuple_or_dict_is_cast_integers_untouched(as_dict: bool) -> None:
    """A layer's several outputs: every float32 tensor travels in bf16, ids and masks as
    they are, and decoding gives float32 back in the same structure."""
    hidden, ids, mask = torch.randn(2, 3), torch.arange(6).view(2, 3), torch.ones(2, 3).bool()
    value = {"hidden": hidden, "ids": ids, "mask": mask} if as_dict else (hidden, ids, mask)
    sent = compress.encode_value(value, "bf16")
    parts = list(sent.values()) if isinstance(sent, dict) else list(sent)
    assert isinstance(sent, dict) == as_dict
    assert [t.dtype for t in parts] == [torch.bfloat16, torch.int64, torch.bool]
    assert parts[1] is ids and parts[2] is mask
    back = compress.decode_value(sent, "bf16")
    got = list(back.values()) if isinstance(back, dict) else list(back)
    assert torch.equal(got[0], hidden.bfloat16().float()) and got[1] is ids and got[2] is mask
    assert compress.encode_value(value, "") is value
