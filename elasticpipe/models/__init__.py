"""Models: the contract every factory meets, the built-in zoo, Hugging Face models, and
the weights a user brings.

* ``contract``: The model contract: resolve an allowed factory, and build or seed any layer of
  it alone.
* ``hf``: Hugging Face decoder-only causal LMs as pipeline layers (``elasticpipe[hf]``).
* ``weights``: Weights the user brings (``init_state``): a mapping, a safetensors file or a
  directory of shards, read lazily tensor by tensor and checked against the model's layers
  before use.
* ``zoo``: The built-in models: an MLP, a small decoder-only transformer (GPT) and a small CNN.
"""

from elasticpipe.models.contract import (
    build,
    build_layers,
    build_skeleton,
    check_name,
    describe,
    factory_source,
    init_layer,
    layer_seed,
    materialize_layer,
    prepare_layer,
    resolve_factory,
    unsaved_buffers,
)
from elasticpipe.models.weights import TensorSource
from elasticpipe.models.zoo import BUILTIN_MODELS, cnn, gpt, mlp

__all__ = [
    "BUILTIN_MODELS",
    "TensorSource",
    "build",
    "build_layers",
    "build_skeleton",
    "check_name",
    "cnn",
    "describe",
    "factory_source",
    "gpt",
    "init_layer",
    "layer_seed",
    "materialize_layer",
    "mlp",
    "prepare_layer",
    "resolve_factory",
    "unsaved_buffers",
]
