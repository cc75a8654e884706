"""Bytes on the wire, pure: tensors, tensor structures, bundles, layer state, compression.

* ``bundle``: Several tensors in one data message: per-tensor metas, a structure, concatenated
  bytes.
* ``codec``: The wire codec: tensors as dtype + shape + raw bytes. (Layer state moves tensor by
  tensor: ``elasticpipe.wire.layer_state``; ``pack_state``/``unpack_state`` here read and write
  the one-blob msgpack form of earlier checkpoint files.)
* ``compress``: Compressed activations between stages: what ``wire_dtype`` does to the tensors
  sent.
* ``layer_state``: Layer state on the wire, tensor by tensor: no size cap but the operator's
  limits, and about one copy of a layer in memory on each side.
* ``structure``: Layers with several tensors: a tuple or flat dict of tensors as a list plus a
  descriptor.
"""

from elasticpipe.wire.layer_state import PackedLayer
from elasticpipe.wire.structure import Structure, Value

__all__ = ["PackedLayer", "Structure", "Value"]
