"""``Pipeline``: train one model across stage servers as if it were local.

::

    with Pipeline(coordinator="127.0.0.1:7100", model="mlp",
                  model_kwargs={"sizes": [32, 64, 64, 10]}, micro_batches=4) as pipe:
        loss = pipe.train_step(inputs, targets)   # the mini-batch's mean loss
        out = pipe.predict(inputs)                # forward only
        sd = pipe.state_dict()                    # same keys as the local nn.Sequential

The job is set up on first use (the first micro-batch doubles as the profiling sample).
When the coordinator moves layers between stages, the stages refuse the old epoch; the
pipeline discards the interrupted attempt (nothing of it was committed), picks up the new
partition, logs the change, and runs the step again -- the script notices nothing.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
import structlog
import torch

from elasticpipe import codec, rpc
from elasticpipe.client import driver
from elasticpipe.client.driver import Chain, StageClients
from elasticpipe.errors import (
    ElasticPipeError,
    InvalidRequest,
    NotReady,
    Rebalancing,
    StaleEpoch,
)
from elasticpipe.job import JobConfig
from elasticpipe.schedule import split_sizes
from elasticpipe.training import check_optimizer
from elasticpipe.transport import layer_chunks
from elasticpipe.v1 import coordinator_pb2, coordinator_pb2_grpc, stage_pb2

log = structlog.get_logger()

RETRY_WAIT_S = 2.0
CHECKPOINT_FORMAT = "elasticpipe-checkpoint-v1"  # how long one wait for a newer partition may take


@dataclass(frozen=True)
class PartitionInfo:
    """Where the layers are: boundaries, stages in chain order, and the epoch."""

    epoch: int
    boundaries: tuple[int, ...]
    stages: tuple[str, ...]  # addresses in chain order
    stage_ids: tuple[str, ...] = ()

    def layers_of(self, stage: int) -> range:
        """The layers stage ``stage`` (chain position) owns."""
        return range(self.boundaries[stage], self.boundaries[stage + 1])


@dataclass
class StepStats:
    """What the last step measured on each stage (chain order)."""

    reports: list[stage_pb2.StepReport] = field(default_factory=list)
    seconds: float = 0.0
    attempts: int = 1


class Pipeline:
    """A model trained across the stage servers of one coordinator."""

    def __init__(
        self,
        coordinator: str,
        model: str,
        model_kwargs: dict[str, Any] | None = None,
        seed: int = 0,
        optimizer: str = "adam",
        optimizer_kwargs: dict[str, Any] | None = None,
        loss: str = "cross_entropy",
        micro_batches: int = 4,
        schedule: str = "1f1b",
        stages: int | None = None,
        step_timeout: float = 120.0,
        setup_timeout: float = 60.0,
        rebalance_timeout: float = 300.0,
    ):
        """Describes the job; nothing is contacted until first use.

        Args:
            coordinator: "host:port" of the coordinator.
            model: built-in name ("mlp", "gpt", "cnn") or "package.module:function".
            model_kwargs: JSON-able arguments of the model factory.
            seed: layer i's initial weights depend only on (seed, i).
            optimizer: "sgd", "adam" or "adamw"; ``optimizer_kwargs`` its arguments.
            loss: "cross_entropy" or "mse" (mean over the mini-batch).
            micro_batches: micro-batches per mini-batch (fewer if the batch is smaller).
            schedule: "1f1b" (bounded activation memory) or "gpipe".
            stages: how many stages to use (default: every live stage).
            step_timeout: deadline of one step on every stage.
            setup_timeout: how long to wait for stages at job setup.
            rebalance_timeout: how long a step may wait for an epoch change to finish.

        Raises:
            InvalidRequest: an argument that no stage would accept (checked here).
        """
        self._job = JobConfig(
            model=model,
            model_kwargs=dict(model_kwargs or {}),
            seed=seed,
            optimizer=optimizer,
            optimizer_kwargs=dict(optimizer_kwargs or {}),
            loss=loss,
            micro_batches=micro_batches,
            schedule=schedule,
        )
        check_optimizer(optimizer, self._job.optimizer_kwargs)
        for what, value in (("model_kwargs", model_kwargs), ("optimizer_kwargs", optimizer_kwargs)):
            try:
                json.dumps(value or {})
            except TypeError as exc:
                raise InvalidRequest(f"{what} must be JSON-able: {exc}") from exc
        if stages is not None and stages < 1:
            raise InvalidRequest(f"stages must be >= 1 (got {stages})")
        if step_timeout <= 0:
            raise InvalidRequest(f"step_timeout must be > 0 (got {step_timeout})")
        self.coordinator = coordinator
        self._num_stages = stages or 0
        self._step_timeout = step_timeout
        self._setup_timeout = setup_timeout
        self._rebalance_timeout = rebalance_timeout
        self._channel = rpc.channel(coordinator)
        self._coord = coordinator_pb2_grpc.CoordinatorServiceStub(self._channel)
        self._clients = StageClients()
        self._chain: Chain | None = None
        self._stage_ids: tuple[str, ...] = ()
        self._step = 0
        self._runs = itertools.count(random.randrange(1, 1 << 40))
        self.num_layers = 0
        self.last_step = StepStats()

    # ---- lifecycle -------------------------------------------------------------------

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Closes the channels (the stages keep the trained layers)."""
        self._clients.close()
        self._channel.close()

    @property
    def step(self) -> int:
        """Optimizer steps committed so far."""
        return self._step

    @property
    def partition(self) -> PartitionInfo:
        """The current boundaries, stages and epoch (sets the job up if needed)."""
        chain = self._ensure_job(None)
        return PartitionInfo(chain.epoch, chain.boundaries, chain.addresses, self._stage_ids)

    # ---- job and partition ---------------------------------------------------------------

    def _ensure_job(self, sample: torch.Tensor | None) -> Chain:
        if self._chain is not None:
            return self._chain
        spec = self._job.to_proto()
        if sample is not None:
            spec.sample_input.CopyFrom(codec.to_proto(sample))
        reply = rpc.call(
            self.coordinator,
            self._coord.SetupJob,
            coordinator_pb2.SetupJobRequest(
                job=spec, num_stages=self._num_stages, wait_s=self._setup_timeout
            ),
            timeout=self._setup_timeout + 120.0,
        )
        self.num_layers = reply.num_layers
        self._adopt(reply.partition)
        assert self._chain is not None
        log.info(
            "pipeline_ready",
            model=self._job.model,
            layers=self.num_layers,
            boundaries=list(self._chain.boundaries),
            epoch=self._chain.epoch,
            stages=len(self._chain.addresses),
        )
        return self._chain

    def _adopt(self, p: coordinator_pb2.Partition) -> None:
        self._chain = Chain(p.epoch, tuple(p.addresses), tuple(p.boundaries))
        self._stage_ids = tuple(p.stage_ids)

    def _refresh(self, old: Chain, deadline: float, since: float | None = None) -> None:
        """Waits (until ``deadline``) for a partition newer than ``old`` and adopts it.

        ``since`` is when the old partition was first refused: the pause logged runs from then.
        """
        started = time.monotonic()
        wait = min(RETRY_WAIT_S, max(0.0, deadline - started))
        reply = rpc.call(
            self.coordinator,
            self._coord.GetPartition,
            coordinator_pb2.GetPartitionRequest(newer_than=old.epoch, timeout_s=wait),
            timeout=wait + 10.0,
        )
        self._adopt(reply)
        assert self._chain is not None
        if self._chain.epoch != old.epoch:
            log.info(
                "partition_changed",
                old_epoch=old.epoch,
                new_epoch=self._chain.epoch,
                old=list(old.boundaries),
                new=list(self._chain.boundaries),
                pause_s=round(time.monotonic() - (since or started), 3),
            )

    # ---- training ----------------------------------------------------------------------

    def _split(
        self, inputs: torch.Tensor, targets: torch.Tensor | None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, list[float]]:
        if not isinstance(inputs, torch.Tensor) or inputs.dim() == 0:
            raise InvalidRequest("inputs must be a tensor with a batch dimension")
        sizes = split_sizes(inputs.shape[0], self._job.micro_batches)
        xs = list(torch.split(inputs.detach().cpu(), sizes))
        ys = None
        if targets is not None:
            if not isinstance(targets, torch.Tensor) or targets.shape[:1] != inputs.shape[:1]:
                raise InvalidRequest(
                    f"targets must have the batch size of the inputs ({inputs.shape[0]}), got "
                    f"{list(getattr(targets, 'shape', []))}"
                )
            ys = list(torch.split(targets.detach().cpu(), sizes))
        scales = [n / inputs.shape[0] for n in sizes]
        return xs, ys, scales

    def _attempt(
        self, xs: list[torch.Tensor], ys: list[torch.Tensor] | None, scales: list[float]
    ) -> tuple[list[stage_pb2.StepReport], Chain, int]:
        chain = self._ensure_job(xs[0])
        deadline = time.monotonic() + self._rebalance_timeout
        attempts = 0
        refused_at: float | None = None
        while True:
            attempts += 1
            run_id = next(self._runs)
            try:
                reports = driver.run(
                    self._clients,
                    chain,
                    run_id,
                    self._step + 1,
                    xs,
                    ys,
                    scales,
                    self._job.schedule,
                    self._step_timeout,
                )
                self.last_step.attempts = attempts
                return reports, chain, run_id
            except (StaleEpoch, Rebalancing) as exc:
                if time.monotonic() > deadline:
                    raise
                refused_at = refused_at or time.monotonic()
                log.info("step_retried", step=self._step + 1, epoch=chain.epoch, reason=str(exc))
                self._refresh(chain, deadline, refused_at)
                chain = self._chain or chain

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """One synchronous training step on a mini-batch.

        Splits the batch into micro-batches, runs forward and backward through every stage
        (the loss is computed on the last stage), then commits the optimizer step on every
        stage. Gradients are accumulated so that the result equals ordinary training on the
        whole mini-batch.

        Returns:
            The mini-batch's mean loss.

        Raises:
            InvalidRequest: inputs or targets the model cannot take (message names them).
            StageUnavailable / DeadlineExceeded: a stage died or stalled; nothing was
                committed.
        """
        started = time.perf_counter()
        xs, ys, scales = self._split(inputs, targets)
        reports, chain, run_id = self._attempt(xs, ys, scales)
        driver.commit(self._clients, chain, run_id, self._step + 1)
        self._step += 1
        self.last_step = StepStats(reports, time.perf_counter() - started, self.last_step.attempts)
        return float(sum(reports[-1].losses))

    def predict(self, inputs: torch.Tensor) -> torch.Tensor:
        """The model's output on ``inputs`` (forward only; changes nothing)."""
        xs, _, scales = self._split(inputs, None)
        _, chain, run_id = self._attempt(xs, None, scales)
        outs = [
            driver.fetch_output(self._clients, chain.addresses[-1], run_id, i, self._step_timeout)
            for i in range(len(xs))
        ]
        return torch.cat(outs)

    # ---- state -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights and buffers, keyed like the local ``nn.Sequential``."""
        chain = self._ensure_job(None)
        for _ in range(10):
            try:
                return self._collect(chain)
            except (StaleEpoch, NotReady) as exc:
                log.info("state_dict_retried", epoch=chain.epoch, reason=str(exc))
                self._refresh(chain, time.monotonic() + RETRY_WAIT_S)
                chain = self._chain or chain
        raise NotReady("the partition kept changing while reading the state")

    def _export(self, chain: Chain, stage: int, include_optimizer: bool) -> dict[int, bytes]:
        """Each layer of one stage as its checksummed state blob."""
        address = chain.addresses[stage]
        layers = list(range(chain.boundaries[stage], chain.boundaries[stage + 1]))
        request = stage_pb2.ExportLayersRequest(
            epoch=chain.epoch, layers=layers, include_optimizer=include_optimizer
        )
        try:
            stream = self._clients.stub(address).ExportLayers(request, timeout=self._step_timeout)
            return dict(codec.layer_blobs(stream, codec.DEFAULT_MAX_TENSOR_BYTES))
        except grpc.RpcError as exc:
            raise rpc.translate(exc, address) from exc

    def _collect(self, chain: Chain) -> dict[str, torch.Tensor]:
        state: dict[str, torch.Tensor] = {}
        for s in range(len(chain.addresses)):
            for layer, blob in self._export(chain, s, include_optimizer=False).items():
                for name, tensor in codec.unpack_state(blob)["model"].items():
                    state[f"{layer}.{name}"] = tensor
        return state

    # ---- checkpoints -------------------------------------------------------------------

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes a checkpoint: every layer's weights, buffers and optimizer state, and the
        step count, so that ``load`` resumes training exactly where it was.

        The file is msgpack (no pickle), written atomically; it does not depend on the
        partition, so it can be loaded on any number of stages.
        """
        chain = self._ensure_job(None)
        layers: dict[int, bytes] = {}
        for s in range(len(chain.addresses)):
            layers.update(self._export(chain, s, include_optimizer=True))
        job = self._job
        checkpoint = {
            "format": CHECKPOINT_FORMAT,
            "job": {
                "model": job.model,
                "model_kwargs": job.model_kwargs,
                "seed": job.seed,
                "optimizer": job.optimizer,
                "optimizer_kwargs": job.optimizer_kwargs,
            },
            "step": self._step,
            "layers": layers,
        }
        target = Path(path)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_bytes(codec.pack_state(checkpoint))
        tmp.replace(target)
        log.info("checkpoint_saved", path=str(target), step=self._step, layers=len(layers))

    def load(self, path: str | os.PathLike[str]) -> None:
        """Restores a checkpoint written by ``save`` for the same model and optimizer.

        Raises:
            InvalidRequest: not a checkpoint, or one of another model or optimizer.
        """
        raw = Path(path).read_bytes()
        checkpoint = codec.unpack_state(raw, max(len(raw), 1))
        if not isinstance(checkpoint, dict) or checkpoint.get("format") != CHECKPOINT_FORMAT:
            raise InvalidRequest(f"{path} is not an ElasticPipe checkpoint")
        job = self._job
        mine = {
            "model": job.model,
            "model_kwargs": job.model_kwargs,
            "optimizer": job.optimizer,
            "optimizer_kwargs": job.optimizer_kwargs,
        }
        theirs = {k: checkpoint["job"].get(k) for k in mine}
        if json.dumps(theirs, sort_keys=True) != json.dumps(mine, sort_keys=True):
            raise InvalidRequest(f"checkpoint {path} is of {theirs}, this pipeline trains {mine}")
        layers: dict[int, bytes] = checkpoint["layers"]
        chain = self._ensure_job(None)
        if sorted(layers) != list(range(chain.boundaries[-1])):
            raise InvalidRequest(
                f"checkpoint {path} has layers {sorted(layers)}, the model {chain.boundaries[-1]}"
            )
        step = int(checkpoint["step"])
        for s, address in enumerate(chain.addresses):
            owned = range(chain.boundaries[s], chain.boundaries[s + 1])

            def messages(owned: range = owned) -> Iterator[stage_pb2.RestoreChunk]:
                first = True
                for layer in owned:
                    for chunk in layer_chunks(layer, layers[layer]):
                        yield stage_pb2.RestoreChunk(
                            epoch=chain.epoch if first else 0,
                            committed_step=step if first else 0,
                            chunk=chunk,
                        )
                        first = False

            rpc.call(
                address,
                self._clients.stub(address).RestoreLayers,
                messages(),
                timeout=self._step_timeout,
            )
        self._step = step
        log.info("checkpoint_loaded", path=str(path), step=step, layers=len(layers))

    def stage_stats(self) -> list[stage_pb2.StageStats]:
        """Each stage's own report (epoch, layers, timings, peak activations)."""
        chain = self._ensure_job(None)
        return [
            rpc.call(a, self._clients.stub(a).GetStats, stage_pb2.StatsRequest(), timeout=10.0)
            for a in chain.addresses
        ]


__all__ = ["ElasticPipeError", "PartitionInfo", "Pipeline", "StepStats"]
