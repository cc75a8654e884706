"""Data parallelism is exact for any split, in one process: replicas of different shapes,
each a chain of stage slices running its share of the micro-batches, reduced group by group
(``Layout.groups``, ``GroupReduction``) give ``torch.equal`` the losses, weights and optimizer
steps of ``LocalPipeline`` with the same micro-batch count, dropout included.

This composes the stage-side pieces (``SliceState``'s shares, the reduction, the layout's
groups) without the network: the pieces go round in a shuffled order, as they may arrive.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from elasticpipe import LocalPipeline
from elasticpipe.layout import Layout
from elasticpipe.partition import Partition, StageRef
from elasticpipe.stage_server.devicetime import Slowdown
from elasticpipe.stage_server.layers import LayerSlice
from elasticpipe.stage_server.reduction import GroupReduction, Send, flatten, unflatten
from elasticpipe.training.job import JobConfig
from elasticpipe.training.objectives import scaled_loss
from elasticpipe.wire import structure
from elasticpipe.wire.structure import split_batch

pytestmark = pytest.mark.timeout(60)

DROPOUT = "tests.support.custom_models:dropout"  # 7 layers, two Dropout(0.1)
# 7 layers: a frozen weight, a parameter no input reaches, a Linear used twice, a Dropout
UNREACHED = "tests.support.zb_models:unreached"
ALLOW = ("tests.support",)
M = 8
STEPS = 3
OPTIMIZER = {"optimizer": "adamw", "optimizer_kwargs": {"lr": 0.01}}


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)


def _train_replicas(
    model: str, boundaries: list[tuple[int, ...]], shares: tuple[int, ...], seed: int = 5
) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Trains STEPS steps on replicas of ``boundaries`` with ``shares``; returns the losses
    and every replica's weights."""
    job = JobConfig(model=model, seed=seed, micro_batches=M, **OPTIMIZER)  # type: ignore[arg-type]
    chains: list[list[LayerSlice]] = []
    for cuts in boundaries:
        chain = []
        for lo, hi in itertools.pairwise(cuts):
            stage = LayerSlice(job, torch.device("cpu"), Slowdown(), ALLOW)
            stage.build(lo, hi)
            chain.append(stage)
        chains.append(chain)
    layout = Layout(
        tuple(
            Partition(
                epoch=1,
                job_id="j",
                boundaries=cuts,
                stages=tuple(StageRef(f"r{r}s{s}", f"h:{r}{s}") for s in range(len(cuts) - 1)),
            )
            for r, cuts in enumerate(boundaries)
        ),
        shares,
    ).validate(7, M)
    holder = {  # stage id -> its slice
        ref.stage_id: chains[r][s]
        for r, p in enumerate(layout.replicas)
        for s, ref in enumerate(p.stages)
    }
    losses = []
    rng = random.Random(seed)
    for step in range(1, STEPS + 1):
        xs, ys, scales = split_batch(*_batch(step), M, torch.device("cpu"))
        step_losses: dict[int, float] = {}
        for r, chain in enumerate(chains):
            share = layout.share_of(r)
            for stage in chain:
                stage.begin_grads(M, share)
            for k in share:  # one micro-batch through the chain, forward then backward
                x, stashes = xs[k], []
                for s, stage in enumerate(chain):
                    x, stash = stage.forward(
                        x, train=True, input_grad=s > 0, micro_batch=k, step=step
                    )
                    stashes.append(stash)
                last = chain[-1]
                grad, step_losses[k] = scaled_loss(
                    job.loss, last.loss, structure.single(x, "out"), ys[k], scales[k], "here"
                )
                g = grad
                for stage, stash in zip(reversed(chain), reversed(stashes), strict=True):
                    g = stage.backward(stash, g, micro_batch=k)
        partials = {sid: stage.take_partials() for sid, stage in holder.items()}
        queue: list[Send] = []
        reductions: list[tuple[GroupReduction, LayerSlice, list[int]]] = []
        for gi, group in enumerate(layout.groups()):
            for r, ref in enumerate(group.holders):
                stage = holder[ref.stage_id]
                owned = [layer for layer in group.layers if layer in stage.optimizers]
                if not owned:  # no parameters (a ReLU, a Dropout): nothing to reduce
                    continue
                params = [list(stage.layers[layer].parameters()) for layer in owned]
                like = flatten([[None] * len(p) for p in params], params)[0]
                reduction = GroupReduction(
                    gi, r, [layout.share_of(q) for q in range(len(shares))], M, like
                )
                reductions.append((reduction, stage, owned))
                nodes = [n for n, _ in partials[ref.stage_id][owned[0]]]
                mine = [
                    (n, flatten([partials[ref.stage_id][layer][j][1] for layer in owned], params))
                    for j, n in enumerate(nodes)
                ]
                queue += [(gi, send) for send in reduction.start(mine)]  # type: ignore[misc]
        by_group = {
            (gi, r): red
            for gi, red in ((red.group, red) for red, _, _ in reductions)
            for r in [red.me]
        }
        while queue:
            gi, send = queue.pop(rng.randrange(len(queue)))  # type: ignore[misc]
            queue += [(gi, s) for s in by_group[(gi, send.to)].receive(send.piece)]  # type: ignore[misc]
        for reduction, stage, owned in reductions:
            params = [list(stage.layers[layer].parameters()) for layer in owned]
            stage.install_grads(
                dict(zip(owned, unflatten(reduction.result(), params), strict=True))
            )
        for stage in holder.values():
            stage.finish_backward()
            stage.step()
        losses.append(sum(step_losses[k] for k in range(M)))
    weights = []
    for chain in chains:
        state = {}
        for stage in chain:
            for i in stage.indices:
                for name, tensor in stage.layers[i].state_dict().items():
                    state[f"{i}.{name}"] = tensor.detach().clone()
        weights.append(state)
    return losses, weights


def _reference(model: str, seed: int = 5) -> tuple[list[float], dict[str, torch.Tensor]]:
    with LocalPipeline(model=model, seed=seed, micro_batches=M, allow=ALLOW, **OPTIMIZER) as pipe:  # type: ignore[arg-type]
        losses = [pipe.train_step(*_batch(step)) for step in range(1, STEPS + 1)]
        return losses, pipe.state_dict()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits (``torch.equal`` takes -0.0 for 0.0)."""
    return t.view(torch.int32) if t.dtype == torch.float32 else t


@pytest.mark.parametrize("model", [DROPOUT, UNREACHED], ids=["dropout", "unreached"])
@pytest.mark.parametrize(
    ("boundaries", "shares"),
    [
        ([(0, 3, 7), (0, 2, 5, 7)], (4, 4)),
        ([(0, 3, 7), (0, 2, 5, 7)], (5, 3)),
        ([(0, 3, 7), (0, 2, 5, 7)], (1, 7)),
        ([(0, 3, 7), (0, 2, 5, 7)], (8, 0)),
        ([(0, 7), (0, 4, 7), (0, 1, 6, 7)], (2, 3, 3)),
        ([(0, 7), (0, 4, 7), (0, 1, 6, 7)], (1, 1, 6)),
    ],
    ids=[
        "2x(2,3)-4:4",
        "2x(2,3)-5:3",
        "2x(2,3)-1:7",
        "2x(2,3)-8:0",
        "3x(1,2,3)-2:3:3",
        "3x(1,2,3)-1:1:6",
    ],
)
def test_replicas_of_any_shape_and_share_equal_local_pipeline_bit_for_bit(
    model: str, boundaries: list[tuple[int, ...]], shares: tuple[int, ...]
) -> None:
    """Every replica's weights and buffers, bit for bit, and the losses equal
    LocalPipeline's; also with a replica that runs no micro-batch, a frozen weight, and a
    parameter no input reaches (it keeps no gradient, so AdamW leaves it alone)."""
    want_losses, want = _reference(model)
    losses, weights = _train_replicas(model, boundaries, shares)
    assert losses == want_losses
    for r, state in enumerate(weights):
        assert state.keys() == want.keys()
        for key, value in want.items():
            assert torch.equal(_bits(state[key]), _bits(value)), (r, key)
