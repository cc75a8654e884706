"""``Pipeline``: train one model across stage servers as if it were local.

::

    with Pipeline(coordinator="127.0.0.1:7100", model="mlp",
                  model_kwargs={"sizes": [32, 64, 64, 10]}, micro_batches=4) as pipe:
        loss = pipe.train_step(inputs, targets)   # the mini-batch's mean loss
        out = pipe.predict(inputs)                # forward only, eval mode
        sd = pipe.state_dict()                    # same keys as the local nn.Sequential

The job is set up on first use (the first micro-batch doubles as the profiling sample).
Failures cost time, not results:

* when the coordinator moves layers, the stages refuse the old epoch; the pipeline drops
  the interrupted attempt (nothing of it was committed), adopts the new partition and runs
  the step again;
* when a stage dies, the pipeline reports it; the coordinator replaces or drops the stage
  and rolls every survivor back to the last snapshot; the pipeline replays the
  mini-batches it kept since then and carries on. ``train_step`` returns as if nothing
  happened, with the same loss;
* when the training script itself dies, ``Pipeline(..., resume=True)`` attaches to the
  running job, and ``pipe.step`` says how many steps it has committed.

The pipeline holds the job's *lease* while it lives (renewed in the background, released
by ``close``): another ``Pipeline`` cannot take the job from under it. Once closed, it
touches the job no more: its methods raise ``PipelineClosed``.

This module is the public surface; the machinery is in its base classes: ``Steps``
(``steps.py``: runs, commits, replays) over ``Session`` (``session.py``: the job, its lease,
partition and recovery). Checkpoint files are ``checkpoints.py``'s.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
import torch

from elasticpipe import models
from elasticpipe.client import checkpoints, driver, initial
from elasticpipe.client import replicas as replicas_
from elasticpipe.client.session import RECOVERABLE, RETRY_WAIT_S, _Batch, _RolledBack
from elasticpipe.client.steps import Steps
from elasticpipe.errors import InvalidRequest, Rebalancing, StaleEpoch
from elasticpipe.layout import Layout
from elasticpipe.logs import get_logger
from elasticpipe.models import weights
from elasticpipe.observe import efficiency
from elasticpipe.partition import Partition
from elasticpipe.security.tls import TLS
from elasticpipe.training import loss_scaling
from elasticpipe.training.job import JobConfig
from elasticpipe.training.objectives import check_optimizer
from elasticpipe.transport import rpc
from elasticpipe.v1 import stage_pb2
from elasticpipe.wire import codec, layer_state, structure
from elasticpipe.wire.layer_state import PackedLayer
from elasticpipe.wire.structure import Value, split_batch

log = get_logger(__name__)


@dataclass(frozen=True)
class StageStep:
    """What one stage measured in the last step."""

    address: str
    compute_s: float  # computing its layers (slowdown included)
    wait_s: float  # waiting for inputs, gradients and sends (its run's wall time - compute)
    peak_stashed: int  # most micro-batches whose activations were alive at once
    peak_stashed_bytes: int
    lr: float = 0.0  # the learning rate the step applied on this stage


@dataclass(frozen=True)
class StepStats:
    """What the last step took, stage by stage (``pipe.last_step``).

    Attributes:
        step: the step committed.
        loss: its mean loss.
        micro_batches: how many micro-batches it ran: the pipeline's ``micro_batches``, or
            fewer when the mini-batch had fewer samples (one micro-batch per sample).
        seconds: wall time of ``train_step`` (replays and retries included).
        attempts: runs it took (more than 1 after a rebalance or a failure).
        replayed: earlier steps replayed first, after a recovery.
        grad_norm: the global gradient norm before clipping (``max_grad_norm`` or
            ``precision="fp16"``, of the unscaled gradients; else None); a non-finite one
            skipped the optimizer step.
        loss_scale: ``precision="fp16"``: the loss scale the step's backward used (the
            next step's is backed off if this one was skipped, or grown); else None.
        stages: per stage, in chain order.
        ideal_s: the step's critical path with free communication: the schedule's ops,
            each taking the time it was measured to take (``elasticpipe.observe.efficiency``).
        efficiency: ``ideal_s`` over the measured step time (the longest stage's run), in
            (0, 1]; what is missing to 1 is bubbles and overheads the op times do not force.
        reports: the raw reports (protobufs), for tools.
    """

    step: int = 0
    loss: float = 0.0
    micro_batches: int = 0
    seconds: float = 0.0
    attempts: int = 0
    replayed: int = 0
    grad_norm: float | None = None
    loss_scale: float | None = None
    stages: tuple[StageStep, ...] = ()
    ideal_s: float = 0.0
    efficiency: float = 0.0
    reports: tuple[stage_pb2.StepReport, ...] = field(default=(), repr=False)

    def __str__(self) -> str:
        compute = "/".join(f"{s.compute_s * 1e3:.0f}" for s in self.stages)
        wait = "/".join(f"{s.wait_s * 1e3:.0f}" for s in self.stages)
        extra = f", {self.micro_batches} micro-batches" if self.micro_batches else ""
        extra += f", {self.attempts} attempts" if self.attempts > 1 else ""
        extra += f", {self.replayed} replayed" if self.replayed else ""
        return (
            f"step {self.step}: loss {self.loss:.4f} in {self.seconds * 1e3:.0f} ms{extra}; "
            f"compute {compute} ms, waiting {wait} ms per stage; "
            f"pipeline efficiency {self.efficiency:.0%}"
        )


class Pipeline(Steps):
    """A model trained across the stage servers of one coordinator."""

    def __init__(
        self,
        coordinator: str | Sequence[str],
        model: str,
        model_kwargs: dict[str, Any] | None = None,
        seed: int = 0,
        optimizer: str = "adam",
        optimizer_kwargs: dict[str, Any] | None = None,
        loss: str = "cross_entropy",
        micro_batches: int = 4,
        schedule: str = "1f1b",
        stages: int | Sequence[int] | None = None,
        snapshot_every: int = 10,
        resume: bool = False,
        step_timeout: float = 120.0,
        setup_timeout: float = 60.0,
        rebalance_timeout: float = 300.0,
        recovery_timeout: float = 300.0,
        lease_s: float = 15.0,
        tls: TLS | None = None,
        init_state: Any = None,
        precision: str = "fp32",
        grad_scaler_kwargs: dict[str, Any] | None = None,
        scheduler: str = "",
        scheduler_kwargs: dict[str, Any] | None = None,
        warmup_steps: int = 0,
        max_grad_norm: float = 0.0,
        recompute: bool | list[int] | tuple[int, ...] = False,
        wire_dtype: str = "",
        replicas: int | str | None = None,
        collectives: str = "",
    ):
        """Describes the job; nothing is contacted until first use.

        Args:
            coordinator: "host:port" of the coordinator ("[addr]:port" for IPv6), no
                scheme (checked here); with standby coordinators, every one's address
                ("a:7100,b:7100,c:7100" or a list): calls follow the one that leads.
            model: built-in name ("mlp", "gpt", "cnn") or "package.module:function".
            model_kwargs: JSON-able arguments of the model factory.
            seed: layer i's initial weights depend only on (seed, i).
            optimizer: "sgd", "adam", "adamw", a ``torch.optim`` class by name ("RMSprop"),
                or "package.module:name" allowed by the stages (per-parameter optimizers
                only: see docs/training.md); ``optimizer_kwargs`` its arguments.
            loss: "cross_entropy", "mse" or "package.module:function" allowed by the stages:
                the mean over the micro-batch it is given (each micro-batch's is weighted by
                its share of the mini-batch, so the step's loss is the mini-batch mean).
            micro_batches: micro-batches per mini-batch; a mini-batch of fewer samples is
                split into one micro-batch per sample (``last_step.micro_batches`` says how
                many a step ran).
            schedule: "1f1b" (bounded activation memory), "gpipe", or "zb-h1" (zero bubble:
                1F1B's order with each backward split into input and weight gradients).
            stages: how many stages to use (default: every live stage); more live stages
                are spares, which replace a stage that dies. With replicas: each
                replica's length, or one length per replica (``stages=(2, 3)``).
            replicas: data parallelism over this many pipelines ("replicas"), each a chain
                holding every layer and running its share of the micro-batches, with
                results bitwise equal to one pipeline's; "auto": the coordinator chooses
                them from the live stages. Default: one (or ``len(stages)``). See
                docs/replicas.md.
            collectives: the engine of the replicas' gradient reduction. Default: the
                stages' own data channel (any network, mutual TLS). "gloo":
                ``torch.distributed`` process groups, for trusted fabrics only
                (unauthenticated; a cluster that requires TLS refuses them). The same bits
                either way. ("nccl" is refused until it has run on GPUs.)
            snapshot_every: committed steps between snapshots of every layer (kept in host
                memory on two hosts); after a failure at most this many steps (plus the
                snapshot in flight) are replayed. 0 turns snapshots off: then a dead stage
                ends the job.
            resume: attach to the running job of this description (after the training
                script was restarted) instead of starting a new one; ``step`` then says
                where it is; its ``init_state`` loads only if the job never loaded one.
            step_timeout: deadline of one step on every stage.
            setup_timeout: how long to wait for stages at job setup.
            rebalance_timeout: how long a step may wait for an epoch change to finish.
            recovery_timeout: how long a step may wait for the job to recover from failures.
            lease_s: how long the job stays reserved for this pipeline after it stops
                renewing its lease (it renews every ``lease_s / 3`` seconds).
            tls: this client's certificate, key and the cluster's CA (role ``client``);
                default: ``ELASTICPIPE_TLS_CERT/KEY/CA`` if set, else plaintext.
            init_state: initial weights instead of the seed's: a mapping with the keys of
                the model's ``state_dict()``, a ``.safetensors`` file, or a directory of
                shards (a checkpoint of ``save``, whose optimizer state is then not used,
                or a Hugging Face ``save_pretrained`` directory). Read lazily; each stage
                receives only its layers. Layers then need no ``reset_parameters()``.
            precision: "fp32", or "bf16": every layer's forward under ``torch.autocast``
                (bfloat16) on its stage's device, float32 master weights, optimizer state
                and loss (see docs/training.md); or "fp16": the same with float16, plus
                dynamic loss scaling with ``torch.amp.GradScaler``'s semantics (an inf/nan
                gradient on any stage skips the step everywhere; the scale lives in the job).
            grad_scaler_kwargs: "fp16" only: GradScaler's ``init_scale`` (2**16),
                ``growth_factor`` (2.0), ``backoff_factor`` (0.5), ``growth_interval`` (2000).
            scheduler: a class of ``torch.optim.lr_scheduler`` ("CosineAnnealingLR", ...;
                "" keeps the learning rate constant), stepped once per optimizer step;
                ``scheduler_kwargs`` its JSON-able arguments (``SequentialLR`` and
                ``ChainedScheduler`` take ``{"name": ..., "kwargs": {...}}`` children).
            warmup_steps: a linear warm-up first (step k of N uses ``lr * k / N``).
            max_grad_norm: clip the gradients of the whole model to this global 2-norm,
                as ``torch.nn.utils.clip_grad_norm_`` (0: no clipping); a non-finite
                norm skips the optimizer step on every stage.
            recompute: True, or a list of layer indices: those layers keep only their
                input and run their forward again during backward (less activation
                memory, more compute; same results).
            wire_dtype: "bf16" or "fp16": activations and gradients travel between
                stages in that dtype (half the bytes; rounds them at each cut).

        Raises:
            InvalidRequest: an argument that no stage would accept (checked here).
        """
        self._job = JobConfig.from_arguments(
            model=model,
            model_kwargs=model_kwargs,
            seed=seed,
            optimizer=optimizer,
            optimizer_kwargs=optimizer_kwargs,
            loss=loss,
            micro_batches=micro_batches,
            schedule=schedule,
            snapshot_every=snapshot_every,
            external_weights=init_state is not None,
            precision=precision,
            grad_scaler_kwargs=grad_scaler_kwargs,
            scheduler=scheduler,
            scheduler_kwargs=scheduler_kwargs,
            warmup_steps=warmup_steps,
            max_grad_norm=max_grad_norm,
            wire_dtype=wire_dtype,
            recompute=recompute,
            collectives=collectives,
        )
        models.check_name(model)
        check_optimizer(optimizer, self._job.optimizer_kwargs)
        self._asked = replicas_.ask(replicas, stages)
        for what, seconds in (
            ("step_timeout", step_timeout),
            ("setup_timeout", setup_timeout),
            ("recovery_timeout", recovery_timeout),
            ("lease_s", lease_s),
        ):
            if not seconds > 0:
                raise InvalidRequest(f"{what} must be > 0 (got {seconds})")
        self._open(coordinator, tls)  # the channels and the job's state (none yet)
        self._num_stages = self._asked.num_stages
        self._resume = resume
        self._step_timeout = step_timeout
        self._setup_timeout = setup_timeout
        self._rebalance_timeout = rebalance_timeout
        self._recovery_timeout = recovery_timeout
        self._lease_s = lease_s
        self._last_reports: list[stage_pb2.StepReport] = []
        self._last_step = StepStats()
        self._closed = False
        # Checked now, before anything changes; streamed at setup (resumed: if still awaited)
        self._init = None if init_state is None or resume else initial.check(self._job, init_state)
        self._init_source = init_state if resume else None

    # ---- lifecycle -------------------------------------------------------------------

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Releases the job's lease and closes the channels (the stages keep the layers).

        Afterwards every method that would touch the job raises ``PipelineClosed``;
        ``step``, ``partition`` and ``last_step`` still say what was last known. Closing
        twice does nothing the second time.
        """
        if self._closed:
            return
        self._closed = True
        self._release_lease()
        if self._init is not None:
            self._init.close()
        self._clients.close()
        self._coordinators.close()

    @property
    def step(self) -> int:
        """Optimizer steps committed so far: the next ``train_step`` is step ``step + 1``
        (attaches first when resuming)."""
        if self._resume and self._partition is None:
            self._ensure_job(None)
        return self._done

    @property
    def partition(self) -> Partition:
        """The current boundaries, stages and epoch (sets the job up if needed; after
        ``close``, the last one known)."""
        if self._closed and self._partition is not None:
            return self._partition
        return self._ensure_job(None)

    @property
    def layout(self) -> Layout:
        """The job's replicas: the epoch, and per replica its partition (stages and
        boundaries) and share of the micro-batches (one replica: ``partition``, running
        them all). Sets the job up if needed; after ``close``, the last one known."""
        if not (self._closed and self._layout is not None):
            self._ensure_job(None)
        assert self._layout is not None
        return self._layout

    @property
    def last_step(self) -> StepStats:
        """What the last ``train_step`` took, stage by stage (``StepStats``; all zeros
        before the first)."""
        return self._last_step

    @property
    def num_layers(self) -> int:
        """How many layers the model has (0 until the job is set up)."""
        return self._num_layers

    # ---- training ----------------------------------------------------------------------

    def _split(
        self, inputs: Value, targets: torch.Tensor | None
    ) -> tuple[list[Value], list[torch.Tensor], list[float]]:
        return split_batch(inputs, targets, self._job.micro_batches, torch.device("cpu"))

    def train_step(self, inputs: Value, targets: torch.Tensor) -> float:
        """One synchronous training step on a mini-batch.

        ``inputs`` is a tensor, or a tuple or flat dict of tensors (what the first layer
        takes; every tensor is split along its first, batch, dimension).

        Splits the batch into micro-batches (``micro_batches`` of them, or one per sample
        if it has fewer: ``last_step.micro_batches`` says how many ran), runs forward and
        backward through every stage (the loss is computed on the last stage), then commits
        the optimizer step on every stage. Gradients are accumulated so that the result
        equals ordinary training on the whole mini-batch. A failure on the way (a stage
        dying, a lost message) is recovered from and replayed before this returns.

        Returns:
            The mini-batch's mean loss.

        Raises:
            InvalidRequest: inputs or targets of the wrong kind or batch size (named); the
                step ran nowhere.
            UserCodeError: the model or the loss raised on them (a target out of range, an
                input shape a layer cannot take): the message has the original error, the
                layer or loss, and the micro-batch; the step is discarded on every stage.
            LayersLost: the job cannot recover (every copy of some layers is gone).
            Fenced: another client took the job over.
            PipelineClosed: ``close`` was called.
            ElasticPipeError: the job did not recover within ``recovery_timeout``.
        """
        self._check_open()
        started = time.perf_counter()
        xs, ys, scales = self._split(inputs, targets)
        batch = _Batch(xs, ys, scales)
        self._ensure_job(xs[0])
        replicas_.check_batch(self._layout, len(xs))
        self._profile(xs[0])
        self._catch_up(self._done, None)  # a rollback since the last call: replay first
        target = self._done + 1
        if self._job.snapshot_every:
            self._replay[target] = batch
        loss, attempts, replayed = self._catch_up(target, batch)
        self._done = target
        for old in [s for s in self._replay if s <= min(self._safe_step, self._step)]:
            del self._replay[old]
        reports = self._last_reports
        assert self._partition is not None and self._layout is not None
        first = self._replica_0(reports)  # with replicas: replica 0's (the others alike)
        ideal_s, step_efficiency = efficiency.step_efficiency(self._job.schedule, first)
        self._last_step = StepStats(
            step=target,
            loss=loss,
            micro_batches=len(xs),
            seconds=time.perf_counter() - started,
            attempts=attempts,
            replayed=replayed,
            grad_norm=self._clip(first)[0],
            loss_scale=loss_scaling.reported(first),
            stages=tuple(
                StageStep(
                    address=address,
                    compute_s=r.compute_s,
                    wait_s=max(0.0, r.wall_s - r.compute_s),
                    peak_stashed=r.peak_stashed,
                    peak_stashed_bytes=r.peak_stashed_bytes,
                    lr=r.lr,
                )
                for address, r in zip(self._layout.addresses, reports, strict=False)
            ),
            ideal_s=ideal_s,
            efficiency=step_efficiency,
            reports=tuple(reports),
        )
        return loss

    def predict(self, inputs: Value) -> Value:
        """The model's output on ``inputs``: forward only, in eval mode (dropout off,
        batch-norm statistics used and left unchanged); changes nothing. A last layer that
        returns a tuple or dict gives a tuple or dict.

        Raises:
            InvalidRequest: inputs of the wrong kind (named).
            UserCodeError: the model raised on them (the message says where).
            PipelineClosed: ``close`` was called.
        """
        self._check_open()
        xs, _, scales = self._split(inputs, None)
        batch = _Batch(xs, [], scales)
        self._ensure_job(xs[0])
        self._profile(xs[0])
        deadline = time.monotonic() + self._recovery_timeout
        while True:
            self._catch_up(self._done, None)  # after a rollback, replay first
            try:
                _, partition, run_id, secret, _ = self._run(self._step, batch, train=False)
                last, timeout = partition.addresses[-1], self._step_timeout
                return structure.cat(
                    [
                        driver.fetch_output(self._clients, last, run_id, i, timeout, secret)
                        for i in range(len(xs))
                    ]
                )
            except _RolledBack:
                continue
            except RECOVERABLE as exc:
                self._recover(exc, deadline)

    # ---- state -------------------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights and buffers, keyed like the local ``nn.Sequential``.

        Raises:
            PipelineClosed: ``close`` was called.
        """
        self._ensure_job(None)
        deadline = time.monotonic() + self._recovery_timeout
        while True:
            self._catch_up(self._done, None)
            partition = self._partition
            assert partition is not None
            try:
                state: dict[str, torch.Tensor] = {}
                for s in range(partition.num_stages):
                    for layer, packed in self._export_iter(partition, s, include_optimizer=False):
                        for name, tensor in packed.unpack()["model"].items():
                            state[f"{layer}.{name}"] = tensor
                return state
            except (StaleEpoch, Rebalancing) as exc:
                log.info("state_dict_retried", epoch=partition.epoch, reason=str(exc))
                if time.monotonic() > deadline:
                    raise
                self._refresh(time.monotonic() + RETRY_WAIT_S)  # a rollback: replay first
            except RECOVERABLE as exc:
                self._recover(exc, deadline)

    def _export_iter(
        self, partition: Partition, stage: int, include_optimizer: bool
    ) -> Iterator[tuple[int, PackedLayer]]:
        """Each layer of one stage, received tensor by tensor, one layer at a time."""
        address = partition.addresses[stage]
        request = stage_pb2.ExportLayersRequest(
            epoch=partition.epoch,
            layers=list(partition.layers_of(stage)),
            include_optimizer=include_optimizer,
        )
        try:
            stream = self._clients.stub(address).ExportLayers(request, timeout=self._step_timeout)
            limits = (codec.DEFAULT_MAX_LAYER_BYTES, codec.DEFAULT_MAX_LAYER_BYTES)
            for got in layer_state.receive(stream, *limits):
                yield got.layer, got.packed
        except grpc.RpcError as exc:
            raise rpc.translate(exc, address) from exc

    # ---- checkpoints -------------------------------------------------------------------

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes a checkpoint directory: safetensors shards of every layer's weights and
        buffers, others of its optimizer state, and a manifest (step, job, optimizer
        layout, RNG protocol), so that ``load`` resumes training exactly where it was.

        Merging the ``weights-*`` shards with ``safetensors.torch.load_file`` gives the
        whole model's ``state_dict()``. Layers are fetched and written one at a time; the
        directory appears complete or not at all. It does not depend on the partition, so
        it can be loaded on any number of stages. (Checkpoints of earlier versions were one
        msgpack file: ``load`` still reads them, ``save`` no longer writes them.)

        Raises:
            PipelineClosed: ``close`` was called.
        """
        self._ensure_job(None)
        _, params = weights.expected_state(self._job.model, self._job.model_kwargs)
        deadline = time.monotonic() + self._recovery_timeout
        while True:
            self._catch_up(self._done, None)
            partition = self._partition
            assert partition is not None
            writer = checkpoints.Writer(Path(path), self._job, params)
            try:
                for s in range(partition.num_stages):
                    for _, packed in self._export_iter(partition, s, include_optimizer=True):
                        writer.add(packed.unpack())
                writer.commit(self._step)
                break
            except (StaleEpoch, Rebalancing):
                writer.abandon()
                self._refresh(time.monotonic() + RETRY_WAIT_S)
            except RECOVERABLE as exc:
                writer.abandon()
                self._recover(exc, deadline)
            except BaseException:
                writer.abandon()
                raise
        log.info("checkpoint_saved", path=str(path), step=self._step, layers=self.num_layers)

    def load(
        self, path: str | os.PathLike[str], optimizer_kwargs: dict[str, Any] | None = None
    ) -> None:
        """Restores a checkpoint written by ``save`` for the same model and optimizer, on
        every stage or on none (an epoch change makes it take effect), whatever the
        partition or number of stages it was saved from.

        The optimizer's hyper-parameters come from the checkpoint, as with PyTorch's
        ``load_state_dict``; ``optimizer_kwargs`` (``{"lr": 1e-4}``, say) sets some of them
        after loading. A file (the msgpack format of earlier versions) is still read.

        Raises:
            InvalidRequest: not a checkpoint, one of another model or optimizer, an
                override the optimizer does not have, or shards that do not fit the model.
            PipelineClosed: ``close`` was called.
        """
        self._check_open()
        overrides = dict(optimizer_kwargs or {})
        try:
            overrides_json = json.dumps(overrides)
        except TypeError as exc:
            raise InvalidRequest(f"optimizer_kwargs must be JSON-able: {exc}") from exc
        check_optimizer(self._job.optimizer, {**self._job.optimizer_kwargs, **overrides})
        checkpoint = checkpoints.open_for(path, self._job)
        try:
            partition = self._ensure_job(None)
            checkpoint.check_layers(partition.num_layers)
            self._restore(checkpoint.step, checkpoint.layer_state, overrides_json)
        finally:
            checkpoint.close()
        log.info("checkpoint_loaded", path=str(path), step=checkpoint.step, layers=self.num_layers)

    def stage_stats(self) -> list[stage_pb2.StageStats]:
        """Each stage's own report (epoch, layers, timings, peak activations).

        Raises:
            PipelineClosed: ``close`` was called.
        """
        partition = self._ensure_job(None)
        return [
            rpc.call(a, self._clients.stub(a).GetStats, stage_pb2.StatsRequest(), timeout=10.0)
            for a in partition.addresses
        ]


__all__ = ["Pipeline", "StageStep", "StepStats"]
