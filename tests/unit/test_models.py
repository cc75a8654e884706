"""Tests of the model contract: factories, per-layer seeding, slices, and the built-ins."""

from __future__ import annotations

import functools
import os.path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from elasticpipe.errors import InvalidRequest, ModelError, PermissionDenied
from elasticpipe.models.contract import (
    build,
    build_layers,
    build_skeleton,
    describe,
    init_layer,
    layer_seed,
    materialize_layer,
    resolve_factory,
)
from elasticpipe.models.zoo import BUILTIN_MODELS

HERE = __name__  # this module doubles as an allowed package of user factories
SEED = 1234

# --------------------------------------------------------------------------- user factories


class Scale(nn.Module):
    """A layer with a direct parameter and no reset_parameters (unusable by the contract)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Scales x."""
        return x * self.weight


class HalfReset(nn.Module):
    """A layer whose reset_parameters forgets its child Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.linear = nn.Linear(4, 4)

    def reset_parameters(self) -> None:
        """Resets only the scale."""
        nn.init.ones_(self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Applies the layer."""
        return self.linear(x) * self.scale


def with_scale() -> list[nn.Module]:
    """A model whose layer 1 cannot be initialised."""
    return [nn.Linear(4, 4), nn.Linear(4, 4), nn.ReLU(), Scale()]


def with_half_reset() -> list[nn.Module]:
    """A model whose layer 1 is only partly initialised."""
    return [nn.Linear(4, 4), HalfReset()]


def with_batchnorm_and_attention() -> nn.Sequential:
    """A model mixing torch modules that need buffer resets and private resets."""
    return nn.Sequential(
        nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)),
        nn.MultiheadAttention(8, 2, batch_first=True),
    )


def tied() -> list[nn.Module]:
    """A model whose first and last layers share a weight."""
    first, last = nn.Linear(4, 4), nn.Linear(4, 4)
    last.weight = first.weight
    return [first, nn.ReLU(), last]


def failing(depth: int = 1) -> list[nn.Module]:
    """A factory that always fails."""
    raise ValueError(f"depth {depth} is too deep")


def returns(what: str) -> Any:
    """A factory returning something chosen by the test."""
    return {
        "int": 3,
        "empty": [],
        "empty_sequential": nn.Sequential(),
        "mixed": [nn.Linear(2, 2), "x"],
        "module": nn.Linear(2, 2),
    }[what]


small_mlp = functools.partial(BUILTIN_MODELS["mlp"], sizes=[4, 8, 2])
not_callable = 42
reexported = os.path.join  # defined in posixpath/ntpath, which no test allows

# --------------------------------------------------------------------------- helpers


def assert_same_layers(expected: list[nn.Module], actual: list[nn.Module]) -> None:
    """Checks two layer lists have bitwise equal parameters and buffers."""
    assert len(expected) == len(actual)
    for a, b in zip(expected, actual, strict=True):
        assert type(a) is type(b)
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys()
        for key in sa:
            assert sa[key].dtype == sb[key].dtype
            assert torch.equal(sa[key].cpu(), sb[key].cpu()), key


def example_input(name: str, batch: int = 4) -> torch.Tensor:
    """An input batch for a built-in model with default arguments."""
    g = torch.Generator().manual_seed(7)
    if name == "mlp":
        return torch.randn(batch, 32, generator=g)
    if name == "gpt":
        return torch.randint(0, 96, (batch, 12), generator=g)
    return torch.randn(batch, 1, 28, 28, generator=g)


# --------------------------------------------------------------------------- seeding


@given(st.integers(0, 2**62), st.integers(0, 10_000))
def test_layer_seed_is_deterministic_and_in_range(seed: int, index: int) -> None:
    """layer_seed is a pure function into [0, 2**63) that separates neighbouring layers."""
    value = layer_seed(seed, index)
    assert value == layer_seed(seed, index)
    assert 0 <= value < 2**63
    assert value != layer_seed(seed, index + 1)


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_build_layers_equals_slice_of_build(name: str) -> None:
    """Every slice built alone is bitwise equal to the same slice of the full model."""
    full = list(build(name, seed=SEED))
    count = len(full)
    for lo, hi in [(0, count), (0, 1), (1, 3), (2, count), (count - 1, count), (3, 3)]:
        assert_same_layers(full[lo:hi], build_layers(name, SEED, {}, lo, hi))


def test_build_is_deterministic_and_depends_on_seed() -> None:
    """Building twice with one seed gives the same weights; another seed gives others."""
    assert_same_layers(list(build("gpt", seed=1)), list(build("gpt", seed=1)))
    a, b = build("gpt", seed=1), build("gpt", seed=2)
    assert not torch.equal(a[1].fc.weight, b[1].fc.weight)


def test_build_leaves_global_rng_untouched() -> None:
    """Building and initialising layers does not advance or reseed the global RNG."""
    layer = nn.Linear(3, 3)
    torch.manual_seed(99)
    expected = torch.rand(3)
    torch.manual_seed(99)
    build("cnn", seed=5)
    init_layer(layer, 5, 0)
    assert torch.equal(torch.rand(3), expected)


def test_layer_weights_do_not_depend_on_other_layers() -> None:
    """Layer i's initial weights are the same whatever the layers after it."""
    short, deep = build("gpt", seed=3, n_layers=2), build("gpt", seed=3, n_layers=3)
    assert_same_layers(list(short[:3]), list(deep[:3]))
    narrow, wide = build("mlp", sizes=[8, 8, 4]), build("mlp", sizes=[8, 8, 16])
    assert torch.equal(narrow[0].weight, wide[0].weight)


# --------------------------------------------------------------------------- skeletons


def test_build_skeleton_is_on_meta() -> None:
    """The skeleton's parameters and buffers all live on the meta device."""
    for layer in build_skeleton("gpt", {"n_layers": 2}):
        assert all(p.is_meta for p in layer.parameters())
        assert all(b.is_meta for b in layer.buffers())


def test_materialize_layer_copies_and_accepts_a_state_dict() -> None:
    """materialize_layer allocates a copy on the device; load_state_dict then completes it."""
    skeleton = build_skeleton("gpt", {"n_layers": 1})
    layer = materialize_layer(skeleton[1], "cpu")
    assert all(p.device.type == "cpu" for p in layer.parameters())
    assert all(p.is_meta for p in skeleton[1].parameters())
    reference = build("gpt", seed=SEED, n_layers=1)[1]
    layer.load_state_dict(reference.state_dict())
    assert_same_layers([reference], [layer])


def test_init_layer_reinitialises_a_trained_layer() -> None:
    """init_layer restores the initial weights of a layer whose values were changed."""
    reference = build("cnn", seed=SEED)
    layer = build("cnn", seed=SEED)[2]
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(1.0)
    init_layer(layer, SEED, 2)
    assert_same_layers([reference[2]], [layer])


def test_init_layer_rejects_parameter_without_reset() -> None:
    """A layer with a parameter that no reset_parameters sets is a ModelError naming it."""
    with pytest.raises(ModelError, match=r"layer 3 \(Scale\).*'weight'"):
        build(f"{HERE}:with_scale", allow=[HERE])


def test_init_layer_rejects_reset_that_skips_a_child() -> None:
    """A reset_parameters that leaves a child's values unwritten is detected."""
    with pytest.raises(ModelError, match=r"layer 1 \(HalfReset\).*'linear.weight'"):
        build_layers(f"{HERE}:with_half_reset", 0, {}, 0, 2, allow=[HERE])


def test_init_layer_rejects_meta_layer() -> None:
    """Initialising a layer that was never materialized is a ModelError."""
    with pytest.raises(ModelError, match="meta"):
        init_layer(build_skeleton("mlp", {})[0], 0, 0)


def test_torch_modules_with_buffers_and_private_resets_build_identically() -> None:
    """BatchNorm running stats and MultiheadAttention weights are set by init_layer."""
    path = f"{HERE}:with_batchnorm_and_attention"
    full = build(path, seed=SEED, allow=[HERE])
    assert_same_layers(list(full), build_layers(path, SEED, {}, 0, 2, allow=[HERE]))
    norm = full[0][1]
    assert torch.equal(norm.running_mean, torch.zeros(8))
    assert torch.equal(norm.running_var, torch.ones(8))
    assert torch.equal(full[1].out_proj.bias, torch.zeros(8))
    with torch.no_grad():
        norm.running_mean.fill_(3.0)
    init_layer(full[0], SEED, 0)
    assert torch.equal(norm.running_mean, torch.zeros(8))


def test_layers_sharing_a_tensor_are_rejected() -> None:
    """Weight tying across layers is a ModelError naming both layers."""
    with pytest.raises(ModelError, match="layers 0 and 2 share"):
        build_skeleton(f"{HERE}:tied", {}, allow=[HERE])


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_describe_matches_built_model(name: str) -> None:
    """describe counts the layers and the parameter+buffer bytes of each."""
    model = build(name)
    count, sizes = describe(name, {})
    assert count == len(model)
    assert sizes == [
        sum(t.numel() * t.element_size() for t in layer.state_dict().values()) for layer in model
    ]


@pytest.mark.parametrize(("lo", "hi"), [(-1, 2), (3, 2), (0, 6), (1.0, 2)])
def test_build_layers_rejects_range_outside_model(lo: Any, hi: Any) -> None:
    """A layer range outside [0, num_layers] is an InvalidRequest naming it."""
    with pytest.raises(InvalidRequest, match="5 layers"):
        build_layers("mlp", 0, {}, lo, hi)


def test_build_layers_rejects_bad_device() -> None:
    """An unparsable device is an InvalidRequest naming it."""
    with pytest.raises(InvalidRequest, match="nonsense"):
        build_layers("mlp", 0, {}, 0, 1, device="nonsense")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_build_layers_on_cuda_equals_cpu_build() -> None:
    """Layers built on a GPU hold exactly the CPU reference weights."""
    for name in sorted(BUILTIN_MODELS):
        full = list(build(name, seed=SEED))
        on_gpu = build_layers(name, SEED, {}, 1, len(full), device="cuda")
        assert all(p.is_cuda for layer in on_gpu for p in layer.parameters())
        assert_same_layers(full[1:], on_gpu)
        init_layer(on_gpu[0], SEED, 1)
        assert_same_layers(full[1:2], on_gpu[:1])


# --------------------------------------------------------------------------- factories


def test_resolve_factory_returns_builtins() -> None:
    """Built-in names resolve without any allow-list."""
    for name, factory in BUILTIN_MODELS.items():
        assert resolve_factory(name) is factory


def test_resolve_factory_allows_prefix_and_its_submodules() -> None:
    """A prefix allows the module itself and every module below it."""
    assert resolve_factory(f"{HERE}:with_scale", allow=[HERE]) is with_scale
    assert resolve_factory(f"{HERE}:with_scale", allow=["tests"]) is with_scale
    assert resolve_factory(f"{HERE}:small_mlp", allow="tests.unit") is small_mlp


@pytest.mark.parametrize(
    ("path", "allow"),
    [
        ("myorgevil.models:f", ["myorg"]),
        ("myorg:f", []),
        ("myorg:f", [""]),
        (f"{HERE}:with_scale", ["tests.uni"]),
    ],
)
def test_resolve_factory_denies_paths_outside_allow_list(path: str, allow: list[str]) -> None:
    """A path under no allowed prefix is PermissionDenied, before any import."""
    with pytest.raises(PermissionDenied) as info:
        resolve_factory(path, allow)
    assert repr(path) in str(info.value)
    assert repr(allow) in str(info.value)


def test_resolve_factory_denies_callable_defined_elsewhere() -> None:
    """An allowed module cannot hand out a callable defined in a module that is not allowed."""
    with pytest.raises(PermissionDenied, match=r"reexported.*defined in module"):
        resolve_factory(f"{HERE}:reexported", [HERE])


@pytest.mark.parametrize(
    "path",
    ["nocolon", ":f", "pkg:", "pkg:f:g", "a b:f", "pkg..mod:f", "1pkg:f", "pkg:f.g", "pkg:__c__"],
)
def test_resolve_factory_rejects_malformed_paths(path: str) -> None:
    """A name that is neither a built-in nor 'package.module:function' is a ModelError."""
    with pytest.raises(ModelError, match=r"malformed|unknown model"):
        resolve_factory(path, allow=["pkg", "a b", "1pkg", ""])


def test_a_misspelt_built_in_gets_a_suggestion() -> None:
    """A bare name close to a built-in is answered with "did you mean"."""
    with pytest.raises(ModelError, match="unknown model 'gtp': did you mean 'gpt'"):
        resolve_factory("gtp")


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("tests.unit.no_such_module:f", "cannot import"),
        (f"{HERE}:no_such_factory", "no attribute 'no_such_factory'"),
        (f"{HERE}:not_callable", "not a callable"),
    ],
)
def test_resolve_factory_reports_unusable_targets(path: str, message: str) -> None:
    """Import failures, missing attributes and non-callables are ModelErrors naming the path."""
    with pytest.raises(ModelError, match=message):
        resolve_factory(path, allow=["tests"])


@pytest.mark.parametrize("what", ["int", "empty", "empty_sequential", "mixed", "module"])
def test_factory_returning_no_layers_is_a_model_error(what: str) -> None:
    """A factory must return an nn.Sequential or a non-empty list of modules."""
    with pytest.raises(ModelError, match=f"model '{HERE}:returns'"):
        build_skeleton(f"{HERE}:returns", {"what": what}, allow=[HERE])


def test_rejected_kwargs_are_named() -> None:
    """Keyword arguments a factory does not accept are a ModelError naming them."""
    with pytest.raises(ModelError, match=r"model 'mlp' rejected its arguments \{'sizez'"):
        build("mlp", sizez=[1, 2])


def test_failing_factory_is_a_model_error() -> None:
    """Any exception raised by a user factory becomes a ModelError carrying its message."""
    with pytest.raises(ModelError, match="ValueError: depth 3 is too deep"):
        build(f"{HERE}:failing", allow=[HERE], depth=3)


def test_partial_factory_is_resolved_through_its_function() -> None:
    """A functools.partial of a built-in, exported by an allowed module, can be built."""
    model = build(f"{HERE}:small_mlp", allow=[HERE])
    assert [type(layer) for layer in model] == [nn.Linear, nn.ReLU, nn.Linear]


# --------------------------------------------------------------------------- built-ins


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_builtins_are_deterministic(name: str) -> None:
    """The same input through the same model gives bitwise the same output."""
    model, x = build(name, seed=SEED), example_input(name)
    with torch.no_grad():
        assert torch.equal(model(x), model(x))


@pytest.mark.parametrize("name", sorted(BUILTIN_MODELS))
def test_builtins_split_exactly_into_microbatches(name: str) -> None:
    """Outputs and gradients of micro-batches match those of the whole batch."""
    model, x = build(name, seed=SEED), example_input(name)
    whole = model(x)
    whole.sum().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    parts = [model(part) for part in x.chunk(2)]
    sum(part.sum() for part in parts).backward()
    torch.testing.assert_close(torch.cat(parts), whole)
    torch.testing.assert_close([p.grad for p in model.parameters() if p.grad is not None], grads)


def test_mlp_has_separate_linear_and_activation_layers() -> None:
    """sizes [32, 64, 64, 10] give Linear, ReLU, Linear, ReLU, Linear mapping 32 to 10."""
    model = build("mlp")
    assert [type(layer) for layer in model] == [nn.Linear, nn.ReLU] * 2 + [nn.Linear]
    assert model(torch.randn(3, 32)).shape == (3, 10)
    assert isinstance(build("mlp", activation="tanh")[1], nn.Tanh)


@pytest.mark.parametrize("sizes", [[5], [4, 0], "ab", [4, 2.5], [True, 3], 7])
def test_mlp_rejects_bad_sizes(sizes: Any) -> None:
    """sizes other than at least two positive ints are a ModelError naming the value."""
    with pytest.raises(ModelError, match="sizes") as info:
        build("mlp", sizes=sizes)
    assert repr(sizes) in str(info.value)


def test_mlp_rejects_unknown_activation() -> None:
    """An unknown activation name is a ModelError naming it."""
    with pytest.raises(ModelError, match="'swish'"):
        build("mlp", activation="swish")


def test_gpt_has_embedding_blocks_and_head() -> None:
    """gpt has n_layers + 2 layers and maps (B, T) ids to (B, T, vocab) logits."""
    model = build("gpt", n_layers=3, vocab_size=50, d_model=32, n_heads=2)
    assert [type(layer).__name__ for layer in model] == (
        ["TokenEmbedding"] + ["TransformerBlock"] * 3 + ["LMHead"]
    )
    assert model(torch.randint(0, 50, (2, 9))).shape == (2, 9, 50)
    assert model[0](torch.zeros(2, 9, dtype=torch.int64)).shape == (2, 9, 32)


def test_gpt_is_causal() -> None:
    """Changing a later token does not change the logits of earlier positions."""
    model = build("gpt", seed=SEED)
    x = example_input("gpt", batch=1)
    y = x.clone()
    y[0, 8] = (y[0, 8] + 1) % 96
    with torch.no_grad():
        a, b = model(x), model(y)
    assert torch.equal(a[:, :8], b[:, :8])
    assert not torch.equal(a[:, 8:], b[:, 8:])


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        (torch.zeros(1, 17, dtype=torch.int64), "sequence length 17 is over max_seq_len 16"),
        (torch.full((1, 4), 96, dtype=torch.int64), r"in \[0, 96\)"),
        (torch.zeros(1, 4), "int64"),
        (torch.zeros(4, dtype=torch.int64), "shape"),
    ],
)
def test_gpt_rejects_bad_token_ids(ids: torch.Tensor, message: str) -> None:
    """Too long, out-of-range, non-integer or badly shaped ids are an InvalidRequest."""
    model = build("gpt", max_seq_len=16)
    with pytest.raises(InvalidRequest, match=message):
        model(ids)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"d_model": 30, "n_heads": 4}, "d_model 30 is not a multiple of n_heads 4"),
        ({"n_heads": 0}, "n_heads must be an int >= 1, got 0"),
        ({"vocab_size": "96"}, "vocab_size"),
        ({"n_layers": -1}, "n_layers must be an int >= 0"),
    ],
)
def test_gpt_rejects_bad_arguments(kwargs: dict[str, Any], message: str) -> None:
    """Invalid gpt arguments are a ModelError naming the value."""
    with pytest.raises(ModelError, match=message):
        describe("gpt", kwargs)


def test_cnn_maps_images_to_logits() -> None:
    """cnn has at least five layers and maps (B, C, H, W) to (B, num_classes)."""
    model = build("cnn", in_channels=3, num_classes=7, width=8, image_size=32)
    assert len(model) >= 5
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)


def test_cnn_rejects_bad_arguments() -> None:
    """Invalid cnn arguments are a ModelError naming the value."""
    with pytest.raises(ModelError, match="image_size must be an int >= 4, got 2"):
        build("cnn", image_size=2)
