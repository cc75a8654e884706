"""Tests of layer values of several tensors: flatten/unflatten, descriptors, splitting."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticpipe.errors import InvalidRequest, ModelError
from elasticpipe.wire import structure
from elasticpipe.wire.structure import MAX_PARTS, Structure


@settings(max_examples=50, deadline=None)
@given(
    st.one_of(
        st.integers(0, 5).map(lambda n: tuple(torch.full((2,), float(i)) for i in range(n))),
        st.lists(st.text(min_size=1, max_size=8), unique=True, max_size=5).map(
            lambda keys: {k: torch.tensor([i]) for i, k in enumerate(keys)}
        ),
    )
)
def test_flatten_then_unflatten_gives_the_value_back_through_json(value: object) -> None:
    """Any tuple or flat dict of tensors survives flatten, the JSON descriptor and unflatten,
    keys and order included."""
    tensors, shape = structure.flatten(value, "x is")
    assert shape is not None
    back = structure.unflatten(tensors, Structure.from_json(shape.to_json()))
    assert type(back) is type(value)
    if isinstance(value, dict):
        assert isinstance(back, dict) and list(back) == list(value)
    for got, want in zip(structure.tensors(back), tensors, strict=True):
        assert got is want


def test_a_plain_tensor_has_no_structure() -> None:
    """A tensor flattens to itself with structure None: the single-tensor path."""
    t = torch.ones(3)
    tensors, shape = structure.flatten(t, "x is")
    assert tensors == [t] and shape is None
    assert structure.unflatten(tensors, None) is t


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ((torch.ones(1), (torch.ones(1),)), "element 1 is a nested tuple"),
        ({"a": torch.ones(1), "b": {"c": torch.ones(1)}}, "element 'b' is a nested dict"),
        ((torch.ones(1), None), "element 1 is a NoneType"),
        ({"a": 2.0}, "element 'a' is a float"),
        ([torch.ones(1)], "a list: a layer takes and returns a tensor"),
        ({1: torch.ones(1)}, "has key 1: keys must be strings"),
        ({"": torch.ones(1)}, "has key ''"),
        (tuple(torch.ones(1) for _ in range(MAX_PARTS + 1)), f"(at most {MAX_PARTS})"),
    ],
)
def test_bad_structures_are_errors_naming_the_element(value: object, message: str) -> None:
    """Nested values, non-tensors, lists, bad keys and too many tensors raise the given
    error class with a message naming where and what."""
    with pytest.raises(ModelError) as info:
        structure.flatten(value, "layer 3 (Block) returned", ModelError)
    assert message in str(info.value)
    assert "layer 3 (Block)" in str(info.value) or "keys" in str(info.value)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "[1]",
        '{"tuple": -1}',
        f'{{"tuple": {MAX_PARTS + 1}}}',
        '{"tuple": true}',
        '{"dict": ["a", "a"]}',
        '{"dict": [1]}',
        '{"tuple": 1, "dict": []}',
        '{"list": 2}',
        "x" * 20_000,
    ],
)
def test_malformed_descriptors_are_invalid(text: str) -> None:
    """A descriptor from the wire that is not JSON, of an unknown kind, out of bounds or with
    bad keys is refused with InvalidRequest quoting it."""
    with pytest.raises(InvalidRequest):
        Structure.from_json(text)


def test_descriptors_are_compact_json() -> None:
    """The wire form is the documented one."""
    assert Structure(None, 2).to_json() == '{"tuple":2}'
    assert json.loads(Structure(("h", "m"), 2).to_json()) == {"dict": ["h", "m"]}


def test_split_and_cat_cut_every_tensor_along_the_batch() -> None:
    """A (hidden, mask) mini-batch splits into micro-batches that rejoin to the same value;
    targets follow, and each micro-batch's share is its size over the batch."""
    hidden, mask = torch.randn(5, 3, 2), torch.rand(5, 3) > 0.5
    xs, ys, scales = structure.split_batch((hidden, mask), torch.arange(5), 2, torch.device("cpu"))
    assert [x[0].shape[0] for x in xs] == [3, 2] and scales == [0.6, 0.4]  # type: ignore[index]
    assert [y.tolist() for y in ys] == [[0, 1, 2], [3, 4]]
    back = structure.cat(xs)
    assert isinstance(back, tuple)
    assert torch.equal(back[0], hidden) and torch.equal(back[1], mask)


def test_inputs_of_different_batch_sizes_are_refused() -> None:
    """Tensors that do not share the first dimension cannot be split into micro-batches."""
    with pytest.raises(InvalidRequest, match=r"share a batch dimension \(shapes: \[\[4\], \[3\]\]"):
        structure.split_batch((torch.ones(4), torch.ones(3)), None, 2, torch.device("cpu"))


def test_only_floating_tensors_get_gradients() -> None:
    """Positions of floating tensors; one gradient travels as a tensor, others as a tuple."""
    values = [torch.ones(1), torch.ones(1, dtype=torch.bool), torch.ones(1, dtype=torch.half)]
    assert structure.floating(values) == [0, 2]
    g = torch.ones(1)
    assert structure.grads_value([g]) is g
    assert structure.grads_value([]) == ()


def test_the_loss_takes_one_tensor() -> None:
    """``single`` refuses a tuple, naming where it came from and what it holds."""
    with pytest.raises(ModelError, match="layer 4 returned a tuple of 2 tensors; to train"):
        structure.single((torch.ones(1), torch.ones(1)), "layer 4 returned")
