"""One stage's state machine: its job, epoch and layer range, the step protocol, migration.

Phases of the step protocol (the consistent cut of invariant 3 is "every stage IDLE")::

    IDLE --RunStep--> RUNNING --ops done--> AWAITING_COMMIT --CommitStep--> IDLE (step += 1)
                         |                        |
                         +--failure/AbortStep-----+--AbortStep--> IDLE (gradients discarded)

Migration: ``freeze`` waits for IDLE and then refuses new runs; ``prepare_epoch`` pulls the
incoming layers and holds them aside; ``commit_epoch`` installs them and switches epoch;
``abort_epoch`` drops them and leaves the old epoch in force, every layer intact.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum

import grpc
import structlog
import torch

from elasticpipe import codec, models, rpc
from elasticpipe.errors import (
    DeadlineExceeded,
    ElasticPipeError,
    InvalidRequest,
    NotReady,
    PermissionDenied,
    Rebalancing,
    StaleEpoch,
    StepAborted,
    TooLarge,
    TransferError,
)
from elasticpipe.job import JobConfig
from elasticpipe.schedule import Op, OpKind, forward_ops, stage_ops
from elasticpipe.stage_server.layers import LayerSlice, LayerTiming, Slowdown, Stash
from elasticpipe.stage_server.links import Link
from elasticpipe.stage_server.mailbox import Mailbox, Slot
from elasticpipe.training import loss_fn
from elasticpipe.transport import Outgoing
from elasticpipe.v1 import stage_pb2, stage_pb2_grpc

log = structlog.get_logger()


class Phase(Enum):
    """Where a stage is in the step protocol."""

    IDLE = "idle"
    RUNNING = "running"
    AWAITING_COMMIT = "awaiting_commit"


class Fault(Enum):
    """Failures a test can ask a stage to inject into its next layer import."""

    NONE = 0
    CORRUPT_NEXT_IMPORT = 1
    CANCEL_NEXT_IMPORT = 2


@dataclass(frozen=True)
class Placement:
    """A stage's place in one partition epoch."""

    epoch: int
    index: int
    num_stages: int
    lo: int
    hi: int
    prev: str = ""
    next: str = ""

    @property
    def layers(self) -> range:
        """The layers this placement owns."""
        return range(self.lo, self.hi)


@dataclass(frozen=True)
class StageConfig:
    """What the operator chose for this stage (parsed once at start-up)."""

    name: str
    address: str = ""
    device: str = "cpu"
    allow_models: tuple[str, ...] = ()
    slowdown: float = 1.0
    timer: str = "auto"  # "cpu" (thread CPU time), "wall", or "auto": cpu on CPU devices
    max_tensor_bytes: int = codec.DEFAULT_MAX_TENSOR_BYTES
    mailbox_bytes: int = 4 << 30
    send_timeout_s: float = 30.0
    enable_fault_injection: bool = False


@dataclass
class StepResult:
    """What one run of a stage's ops produced."""

    run: int
    losses: list[float] = field(default_factory=list)
    peak_stashed: int = 0
    peak_stashed_bytes: int = 0
    compute_s: float = 0.0
    wall_s: float = 0.0


@dataclass
class _Staged:
    epoch: int
    placement: Placement
    job: JobConfig
    committed_step: int
    layers: dict[int, tuple[torch.nn.Module, torch.optim.Optimizer | None]]
    new_slice: LayerSlice | None


def _clock(timer: str, device: torch.device) -> Callable[[], float]:
    if timer not in ("auto", "cpu", "wall"):
        raise InvalidRequest(f"unknown timer {timer!r} (choose from auto, cpu, wall)")
    if timer == "cpu" or (timer == "auto" and device.type == "cpu"):
        return time.thread_time
    return time.perf_counter


class Stage:
    """A stage server's domain logic, independent of gRPC."""

    def __init__(self, config: StageConfig):
        self.config = config
        self.device = torch.device(config.device)
        self.slowdown = Slowdown(config.slowdown, _clock(config.timer, self.device))
        self.job: JobConfig | None = None
        self.slice: LayerSlice | None = None
        self.placement: Placement | None = None
        self.epoch = 0
        self.committed_step = 0
        self.phase = Phase.IDLE
        self.active_run = 0
        self.last_peak = (0, 0)
        self._cond = threading.Condition(threading.RLock())
        self._mailbox = Mailbox(config.mailbox_bytes)
        self._links: dict[str, Link] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._frozen_for: int | None = None
        self._staged: _Staged | None = None
        self._fault = Fault.NONE
        self._last_commit = (0, 0)

    # ---- job -------------------------------------------------------------------------

    def describe(self, job: JobConfig) -> tuple[int, list[int]]:
        """Number of layers and bytes of each, checking the model is allowed here."""
        return models.describe(job.model, job.model_kwargs, self.config.allow_models)

    def assign(self, job: JobConfig, placement: Placement) -> int:
        """Starts a job on this stage: builds layers [lo, hi) fresh, at step 0."""
        new_slice = LayerSlice(job, self.device, self.slowdown, self.config.allow_models)
        new_slice.build(placement.lo, placement.hi)
        with self._cond:
            self._abort_active("a new job was assigned")
            self.job, self.slice = job, new_slice
            self.committed_step = 0
            self._frozen_for, self._staged = None, None
            self._mailbox = Mailbox(self.config.mailbox_bytes)
            self._set_placement(placement)
            self._cond.notify_all()
        log.info(
            "job_assigned",
            job=job.job_id,
            epoch=placement.epoch,
            lo=placement.lo,
            hi=placement.hi,
            index=placement.index,
        )
        return placement.hi - placement.lo

    def profile(self, job: JobConfig, sample: torch.Tensor, repeats: int) -> list[LayerTiming]:
        """Times forward and backward of every layer of the whole model on this device.

        One warm-up pass is discarded; each layer's figure is the median of ``repeats``.
        """
        model = models.build(job.model, job.seed, self.config.allow_models, **job.model_kwargs)
        probe = LayerSlice(job, self.device, self.slowdown, self.config.allow_models)
        probe.layers = {i: layer.to(self.device) for i, layer in enumerate(model)}
        runs: list[dict[int, LayerTiming]] = []
        for _ in range(max(1, repeats) + 1):
            probe.timings = {i: LayerTiming() for i in probe.layers}
            out, stash = probe.forward(sample.to(self.device), train=True, input_grad=False)
            assert stash is not None
            probe.backward(stash, torch.ones_like(out) if out.requires_grad else None)
            runs.append(probe.timings)
        measured = runs[1:]
        return [
            LayerTiming(
                forward_s=statistics.median(r[i].forward_s for r in measured),
                backward_s=statistics.median(r[i].backward_s for r in measured),
                output_bytes=measured[-1][i].output_bytes,
                samples=len(measured),
            )
            for i in sorted(probe.layers)
        ]

    def _set_placement(self, placement: Placement) -> None:
        self.placement = placement
        self.epoch = placement.epoch
        wanted = {a for a in (placement.prev, placement.next) if a}
        for address in list(self._links):
            if address not in wanted:
                self._links.pop(address).close()
        for address in wanted:
            if address not in self._links:
                self._links[address] = Link(address, self._fail_run, self.config.send_timeout_s)

    def _fail_run(self, run: int, error: ElasticPipeError) -> None:
        self._mailbox.fail(run, error)

    # ---- data path -------------------------------------------------------------------

    def _check_same_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            raise StaleEpoch(
                f"stale epoch {epoch}: stage {self.config.name} is at epoch {self.epoch}"
            )

    def _check_owned(self, layer_slice: LayerSlice, layers: Sequence[int]) -> None:
        missing = [i for i in layers if i not in layer_slice.layers]
        if missing:
            raise NotReady(
                f"stage {self.config.name} does not own layers {missing} "
                f"(owns {layer_slice.indices})"
            )

    def _check_epoch(self, epoch: int) -> None:
        self._check_same_epoch(epoch)
        if self._frozen_for is not None:
            raise Rebalancing(
                f"rebalancing from epoch {self.epoch} to {self._frozen_for}: retry shortly"
            )
        if self.slice is None or self.placement is None:
            raise NotReady(f"stage {self.config.name} has no job assigned")

    def admit(self, epoch: int, nbytes: int) -> None:
        """Checks a data message's epoch and size before anything is allocated for it."""
        with self._cond:
            self._check_epoch(epoch)
            if not self._mailbox.has_room(nbytes):
                raise TooLarge(
                    f"stage {self.config.name} cannot hold {nbytes} more bytes of "
                    f"waiting inputs (limit {self.config.mailbox_bytes})"
                )

    def deliver(
        self,
        slot: Slot,
        epoch: int,
        run: int,
        micro_batch: int,
        tensor: torch.Tensor,
        loss_scale: float = 0.0,
    ) -> None:
        """Accepts an activation, gradient or target for a run (maybe before its RunStep)."""
        with self._cond:
            self._check_epoch(epoch)
            mailbox = self._mailbox
        if slot is Slot.TARGET and not loss_scale > 0.0:
            raise InvalidRequest(
                f"targets of micro-batch {micro_batch} need a loss_scale > 0 (got {loss_scale})"
            )
        value = (tensor, loss_scale) if slot is Slot.TARGET else tensor
        mailbox.put(run, slot, micro_batch, value, tensor.numel() * tensor.element_size())

    def run_step(
        self,
        epoch: int,
        run: int,
        step: int,
        micro_batches: int,
        schedule: str,
        train: bool,
        timeout: float,
    ) -> StepResult:
        """Runs this stage's ops of one step (or inference pass) and reports."""
        if micro_batches < 1:
            raise InvalidRequest(f"micro_batches must be >= 1 (got {micro_batches})")
        with self._cond:
            self._check_epoch(epoch)
            if self.phase is not Phase.IDLE:
                raise NotReady(
                    f"stage {self.config.name} is busy with run {self.active_run} "
                    f"({self.phase.value}); abort it first"
                )
            if self._mailbox.closed(run):
                raise StepAborted(
                    f"run {run} was aborted before it started on stage {self.config.name}"
                )
            if train and step != self.committed_step + 1:
                raise NotReady(
                    f"step {step} is not the next step of stage {self.config.name} "
                    f"(committed: {self.committed_step})"
                )
            assert self.slice is not None and self.placement is not None
            self.phase, self.active_run = Phase.RUNNING, run
            self._outputs.clear()
            placement, layer_slice, mailbox = self.placement, self.slice, self._mailbox
            links = dict(self._links)
        ops = (
            stage_ops(schedule, placement.num_stages, placement.index, micro_batches)
            if train
            else forward_ops(micro_batches)
        )
        try:
            result = self._execute(
                ops,
                placement,
                layer_slice,
                mailbox,
                links,
                run,
                step,
                train,
                time.monotonic() + timeout,
            )
        except BaseException as exc:
            with self._cond:
                layer_slice.zero_grad()
                if self.active_run == run:
                    self.phase = Phase.IDLE
                self._cond.notify_all()
            if not isinstance(exc, ElasticPipeError):
                log.error("step_crashed", run=run, error=repr(exc))
            raise
        with self._cond:
            if mailbox.closed(run):  # aborted while the last ops computed: discard it
                layer_slice.zero_grad()
                if self.active_run == run:
                    self.phase = Phase.IDLE
                self._cond.notify_all()
                raise StepAborted(f"run {run} was aborted on stage {self.config.name}")
            if self.active_run == run and self.phase is Phase.RUNNING:
                self.phase = Phase.AWAITING_COMMIT if train else Phase.IDLE
            self.last_peak = (result.peak_stashed, result.peak_stashed_bytes)
            self._cond.notify_all()
        return result

    def _execute(
        self,
        ops: Sequence[Op],
        placement: Placement,
        layer_slice: LayerSlice,
        mailbox: Mailbox,
        links: dict[str, Link],
        run: int,
        step: int,
        train: bool,
        deadline: float,
    ) -> StepResult:
        first, last = placement.index == 0, placement.index == placement.num_stages - 1
        criterion = loss_fn(layer_slice.job.loss)
        result = StepResult(run=run)
        stashes: dict[int, Stash] = {}
        loss_grads: dict[int, torch.Tensor] = {}
        losses: dict[int, float] = {}
        started = time.perf_counter()
        for op in ops:
            i = op.micro_batch
            if (failure := mailbox.failure(run)) is not None:
                raise failure
            t0 = time.perf_counter()
            if op.kind is OpKind.FORWARD:
                x = mailbox.take(run, Slot.INPUT, i, deadline)
                t0 = time.perf_counter()
                y, stash = layer_slice.forward(x.to(self.device), train, input_grad=not first)
                if last and train:
                    result.compute_s += time.perf_counter() - t0
                    target, scale = mailbox.take(run, Slot.TARGET, i, deadline)
                    t0 = time.perf_counter()
                    out = y.detach().requires_grad_(True)
                    try:
                        loss = criterion(out, target.to(self.device)) * scale
                    except (RuntimeError, ValueError) as exc:
                        raise InvalidRequest(
                            f"loss {layer_slice.job.loss!r} failed on output {list(y.shape)} "
                            f"and target {list(target.shape)} "
                            f"({str(target.dtype).removeprefix('torch.')}): {exc}"
                        ) from exc
                    torch.autograd.backward(loss)
                    assert out.grad is not None
                    loss_grads[i] = out.grad
                    losses[i] = float(loss.detach())
                elif last:
                    self._outputs[i] = y.detach().cpu()
                else:
                    links[placement.next].put(
                        Outgoing("Forward", placement.epoch, run, step, i, y.detach())
                    )
                if stash is not None:
                    stashes[i] = stash
                    result.peak_stashed = max(result.peak_stashed, len(stashes))
                    held = sum(s.nbytes() for s in stashes.values())
                    result.peak_stashed_bytes = max(result.peak_stashed_bytes, held)
            else:
                grad = loss_grads.pop(i) if last else mailbox.take(run, Slot.GRAD, i, deadline)
                t0 = time.perf_counter()
                grad_in = layer_slice.backward(stashes.pop(i), grad.to(self.device))
                if not first and grad_in is not None:
                    links[placement.prev].put(
                        Outgoing("Backward", placement.epoch, run, step, i, grad_in.detach())
                    )
            result.compute_s += time.perf_counter() - t0
        for link in links.values():
            if not link.flush(max(0.0, deadline - time.monotonic())):
                raise DeadlineExceeded(
                    f"run {run}: sends to {link.address} still pending at the deadline"
                )
        if (failure := mailbox.failure(run)) is not None:
            raise failure
        result.losses = [losses[i] for i in sorted(losses)]
        result.wall_s = time.perf_counter() - started
        return result

    def fetch_output(self, run: int, micro_batch: int) -> torch.Tensor:
        """An inference output kept by the last stage."""
        with self._cond:
            if self.active_run != run or micro_batch not in self._outputs:
                raise NotReady(
                    f"no output of run {run}, micro-batch {micro_batch} here "
                    f"(last run: {self.active_run})"
                )
            return self._outputs[micro_batch]

    def commit_step(self, epoch: int, run: int, step: int) -> int:
        """Applies the run's accumulated gradients: one optimizer step."""
        with self._cond:
            self._check_same_epoch(epoch)
            if self._last_commit == (run, step):
                return self.committed_step  # a retried commit whose reply was lost
            if self.phase is not Phase.AWAITING_COMMIT or self.active_run != run:
                raise NotReady(
                    f"run {run} is not awaiting commit on stage {self.config.name} "
                    f"(run {self.active_run} is {self.phase.value})"
                )
            assert self.slice is not None
            self.slice.step()
            self.committed_step = step
            self._last_commit = (run, step)
            self.phase = Phase.IDLE
            self._mailbox.close_through(run)
            self._cond.notify_all()
            return self.committed_step

    def abort_step(self, run: int, reason: str) -> None:
        """Discards a run wherever it is; returns once the stage is idle again."""
        self._mailbox.abort(run, reason)
        with self._cond:
            self._cond.wait_for(
                lambda: not (self.phase is Phase.RUNNING and self.active_run == run), 10.0
            )
            if self.phase is Phase.AWAITING_COMMIT and self.active_run == run:
                assert self.slice is not None
                self.slice.zero_grad()
                self.phase = Phase.IDLE
            self._mailbox.close_through(run)
            self._cond.notify_all()

    def _abort_active(self, reason: str) -> None:
        if self.phase is not Phase.IDLE:
            self._mailbox.abort(self.active_run, reason)
            if self.slice is not None:
                self.slice.zero_grad()
            self.phase = Phase.IDLE

    # ---- migration -------------------------------------------------------------------

    def freeze(self, new_epoch: int, timeout: float) -> int:
        """Waits for the step boundary, then refuses new runs until the epoch change ends."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.phase is Phase.IDLE, timeout):
                raise DeadlineExceeded(
                    f"stage {self.config.name} did not reach a step boundary within "
                    f"{timeout:.1f}s (run {self.active_run} is {self.phase.value})"
                )
            self._frozen_for = new_epoch
            return self.committed_step

    def prepare_epoch(
        self,
        new_epoch: int,
        placement: Placement,
        job: JobConfig,
        incoming: Sequence[tuple[int, str]],
        committed_step: int,
        timeout: float,
    ) -> tuple[int, float]:
        """Pulls the layers this stage will own in ``new_epoch`` and holds them aside."""
        with self._cond:
            if self._frozen_for != new_epoch:
                raise NotReady(f"stage {self.config.name} is not frozen for epoch {new_epoch}")
            same_job = self.job is not None and self.job.job_id == job.job_id
            target = self.slice if same_job and self.slice is not None else None
            current_epoch = self.epoch
        new_slice = None
        if target is None:
            new_slice = target = LayerSlice(
                job, self.device, self.slowdown, self.config.allow_models
            )
        started, received = time.perf_counter(), 0
        staged: dict[int, tuple[torch.nn.Module, torch.optim.Optimizer | None]] = {}
        deadline = time.monotonic() + timeout
        for layer, address in incoming:
            blob = self._pull_layer(layer, address, current_epoch, deadline)
            received += len(blob)
            state = codec.unpack_state(blob, self.config.max_tensor_bytes)
            if not isinstance(state, dict):
                raise TransferError(f"layer {layer} from {address}: state is not a mapping")
            staged[layer] = target.load_layer(layer, state)
        owned = set(target.layers) | set(staged)
        missing = [i for i in placement.layers if i not in owned]
        if missing:
            raise NotReady(
                f"epoch {new_epoch} gives stage {self.config.name} layers "
                f"{missing} that it neither holds nor receives"
            )
        with self._cond:
            if self._frozen_for != new_epoch:
                raise NotReady(f"epoch {new_epoch} was aborted during the transfer")
            self._staged = _Staged(new_epoch, placement, job, committed_step, staged, new_slice)
        return received, time.perf_counter() - started

    def _pull_layer(self, layer: int, address: str, epoch: int, deadline: float) -> bytes:
        fault, self._fault = self._fault, Fault.NONE
        what = f"layer {layer} from {address}"
        request = stage_pb2.ExportLayersRequest(epoch=epoch, layers=[layer], include_optimizer=True)
        with rpc.channel(address) as chan:
            stub = stage_pb2_grpc.StageServiceStub(chan)
            stream = stub.ExportLayers(request, timeout=max(0.1, deadline - time.monotonic()))

            def received() -> Iterator[stage_pb2.LayerChunk]:
                for n, chunk in enumerate(stream):
                    if n == 0 and fault is Fault.CANCEL_NEXT_IMPORT:
                        stream.cancel()  # type: ignore[no-untyped-call]
                        raise TransferError(
                            f"{what}: transfer cancelled after "
                            f"{len(chunk.data)} bytes (injected fault)"
                        )
                    if n == 0 and fault is Fault.CORRUPT_NEXT_IMPORT and chunk.data:
                        corrupted = stage_pb2.LayerChunk()
                        corrupted.CopyFrom(chunk)
                        corrupted.data = bytes([chunk.data[0] ^ 0xFF]) + chunk.data[1:]
                        yield corrupted
                    else:
                        yield chunk

            try:
                for got, blob in codec.layer_blobs(received(), self.config.max_tensor_bytes):
                    if got != layer:
                        raise TransferError(f"{what}: received layer {got} instead")
                    return blob
            except grpc.RpcError as exc:
                raise TransferError(f"{what}: {rpc.translate(exc, address)}") from exc
        raise TransferError(f"{what}: stream ended before the final checksum")

    def commit_epoch(self, new_epoch: int) -> int:
        """Installs the staged layers, frees the ones that moved away, switches epoch."""
        with self._cond:
            if self.epoch == new_epoch and self._staged is None:
                return self.epoch  # already committed (a retried commit)
            staged = self._staged
            if staged is None or staged.epoch != new_epoch:
                raise NotReady(f"nothing staged for epoch {new_epoch} on stage {self.config.name}")
            if staged.new_slice is not None:  # joining a job: its runs start afresh
                self.job, self.slice = staged.job, staged.new_slice
                self._mailbox = Mailbox(self.config.mailbox_bytes)
            self.committed_step = staged.committed_step
            assert self.slice is not None
            for index, (layer, optimizer) in staged.layers.items():
                self.slice.install(index, layer, optimizer)
            for index in [i for i in self.slice.layers if i not in staged.placement.layers]:
                self.slice.drop(index)
            self._set_placement(staged.placement)
            self._staged, self._frozen_for = None, None
            self._cond.notify_all()
        log.info(
            "epoch_committed",
            epoch=new_epoch,
            lo=staged.placement.lo,
            hi=staged.placement.hi,
            received=sorted(staged.layers),
        )
        return new_epoch

    def abort_epoch(self, new_epoch: int) -> int:
        """Drops anything staged for ``new_epoch``; the current epoch stays in force."""
        with self._cond:
            if self._frozen_for == new_epoch or self._staged is not None:
                self._staged, self._frozen_for = None, None
                log.warning("epoch_aborted", epoch=new_epoch, kept=self.epoch)
            self._cond.notify_all()
            return self.epoch

    def export_layers(
        self, epoch: int, layers: Sequence[int], include_optimizer: bool
    ) -> Iterator[tuple[int, bytes]]:
        """Packs the full state of owned layers, one blob each."""
        with self._cond:
            if epoch:  # 0: no check (the client's state_dict between steps)
                self._check_same_epoch(epoch)
            if self.slice is None:
                raise NotReady(f"stage {self.config.name} has no job assigned")
            self._check_owned(self.slice, layers)
            states = [self.slice.export_layer(i, include_optimizer) for i in layers]
        for i, state in zip(layers, states, strict=True):
            yield i, codec.pack_state(state)

    def restore_layers(self, epoch: int, committed_step: int, blobs: dict[int, bytes]) -> list[int]:
        """Replaces owned layers' full state with a checkpoint's (between steps only).

        Every layer is decoded and built before any is installed: a bad blob changes nothing.
        """
        with self._cond:
            self._check_epoch(epoch)
            if self.phase is not Phase.IDLE:
                raise NotReady(
                    f"stage {self.config.name} is in run {self.active_run} "
                    f"({self.phase.value}); restore between steps"
                )
            assert self.slice is not None
            layer_slice = self.slice
            self._check_owned(layer_slice, list(blobs))
        built = {}
        for index, blob in blobs.items():
            state = codec.unpack_state(blob, self.config.max_tensor_bytes)
            if not isinstance(state, dict):
                raise InvalidRequest(f"checkpoint state of layer {index} is not a mapping")
            built[index] = layer_slice.load_layer(index, state)
        with self._cond:
            self._check_epoch(epoch)
            if self.phase is not Phase.IDLE:
                raise NotReady(f"stage {self.config.name} started run {self.active_run}")
            for index, (layer, optimizer) in built.items():
                layer_slice.drop(index)
                layer_slice.install(index, layer, optimizer)
            self.committed_step = committed_step
        log.info("layers_restored", layers=sorted(built), step=committed_step)
        return sorted(built)

    def inject_fault(self, fault: Fault) -> None:
        """Arms a fault for the next layer import (tests only; off unless enabled)."""
        if not self.config.enable_fault_injection:
            raise PermissionDenied(
                f"stage {self.config.name} was started without --enable-fault-injection"
            )
        self._fault = fault

    # ---- stats -----------------------------------------------------------------------

    def timings(self) -> dict[int, LayerTiming]:
        """A snapshot of the per-layer measurements."""
        with self._cond:
            if self.slice is None:
                return {}
            return {i: LayerTiming(**vars(t)) for i, t in self.slice.timings.items()}

    @property
    def frozen(self) -> bool:
        """Whether an epoch change is in progress here."""
        return self._frozen_for is not None

    def close(self) -> None:
        """Closes the links to the peers."""
        with self._cond:
            for link in self._links.values():
                link.close()
            self._links.clear()
