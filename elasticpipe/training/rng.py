"""Reproducible randomness: every layer's forward draws from an RNG seeded by
(job seed, step, micro-batch, layer), so a step computes the same thing wherever and however
often it runs (design invariant 6).

The protocol (version ``RNG_PROTOCOL``; a checkpoint records it):

* the seed of layer ``l`` on micro-batch ``m`` of step ``s`` of a job with seed ``j`` is the
  first 8 bytes (little-endian, top bit cleared) of BLAKE2b over the ASCII text
  ``"j:s:m:l"``, personalised ``b"elasticpipe-rng1"``;
* ``s`` is the logical step: the optimizer step the forward belongs to (1 for the first
  ``train_step``), the same on a retry, a replay after recovery or a run after a migration;
  an inference pass uses the committed step, a profiling pass step 0 and micro-batch -1;
* ``m`` is the micro-batch's index within its mini-batch, ``l`` the layer's index in the model;
* before the layer runs, the CPU default generator and, on CUDA, the default generator of the
  layer's device are seeded with it (``manual_seed``); the generators are restored after the
  slice's forward, so the process's own random stream is left as it was.

Torch's default generators are process-global, so the seeding and the draws of a layer must
not interleave with another thread's: ``LOCK`` serialises them, and ``models.init_layer``
(which seeds the CPU generator to initialise a layer) takes the same lock.

Worked example: seed 0, step 1, micro-batch 2, layer 3 hashes ``b"0:1:2:3"``; the same
``nn.Dropout`` then drops the same elements on a 2-stage chain, a 3-stage chain after a
migration, and in ``LocalPipeline``.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Callable, Iterator

import torch

RNG_PROTOCOL = 1
_PERSON = b"elasticpipe-rng1"
_MASK = (1 << 63) - 1

LOCK = threading.Lock()


def forward_seed(seed: int, step: int, micro_batch: int, layer: int) -> int:
    """The seed of one layer's forward on one micro-batch of one step (see the module doc).

    Returns:
        A seed in ``[0, 2**63)``.
    """
    text = f"{seed}:{step}:{micro_batch}:{layer}".encode("ascii")
    digest = hashlib.blake2b(text, digest_size=8, person=_PERSON).digest()
    return int.from_bytes(digest, "little") & _MASK


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@contextlib.contextmanager
def forked(device: torch.device) -> Iterator[Callable[[int], None]]:
    """Holds ``LOCK`` and yields ``seed_layer(seed)``, which seeds the generators that a
    layer on ``device`` draws from; restores their states on exit.

    One fork per micro-batch through a slice (not per layer) keeps the cost to one state
    save/restore per micro-batch plus one ``manual_seed`` per layer.
    """
    with LOCK:
        cpu_state = torch.get_rng_state()
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.init()  # type: ignore[no-untyped-call]  # the default generators exist once CUDA is initialised
        cuda_generator = torch.cuda.default_generators[_cuda_index(device)] if cuda else None
        cuda_state = cuda_generator.get_state() if cuda_generator is not None else None
        cpu_generator = torch.default_generator

        def seed_layer(layer_seed: int) -> None:
            cpu_generator.manual_seed(layer_seed)
            if cuda_generator is not None:
                cuda_generator.manual_seed(layer_seed)

        try:
            yield seed_layer
        finally:
            torch.set_rng_state(cpu_state)
            if cuda_generator is not None and cuda_state is not None:
                cuda_generator.set_state(cuda_state)
