"""A training job's description, parsed once from its protobuf form and validated."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from elasticpipe.errors import InvalidRequest
from elasticpipe.training import loss_scaling, lr
from elasticpipe.training.objectives import check_loss_name, check_optimizer_name
from elasticpipe.training.schedule import SCHEDULES
from elasticpipe.v1 import job_pb2

MAX_KWARGS_JSON = 1 << 20
MAX_SNAPSHOT_EVERY = 1_000_000
MAX_MICRO_BATCHES = 4096
PRECISIONS = ("fp32", "bf16", "fp16")
MAX_RECOMPUTE = 100_000
WIRE_DTYPES = ("bf16", "fp16")
COLLECTIVES = ("", "gloo", "nccl")  # "": the stages' data channel


def json_object(text: str, what: str) -> dict[str, Any]:
    """Parses a JSON object from the wire, bounded and checked (plain data, never code).

    Raises:
        InvalidRequest: too long, malformed, too deep, or not an object.
    """
    if not text:
        return {}
    if len(text) > MAX_KWARGS_JSON:
        raise InvalidRequest(f"{what} is {len(text)} characters of JSON (limit {MAX_KWARGS_JSON})")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"{what} is not valid JSON ({text[:80]!r}): {exc}") from exc
    except RecursionError:
        raise InvalidRequest(f"{what} is nested too deeply ({text[:80]!r}...)") from None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{what} must be a JSON object, got {text[:80]!r}")
    return value


def recompute_fields(recompute: bool | list[int] | tuple[int, ...]) -> dict[str, Any]:
    """``JobConfig``'s recompute fields from ``Pipeline(recompute=...)``.

    Raises:
        InvalidRequest: neither a bool nor a list of layer indices.
    """
    if isinstance(recompute, bool):
        return {"recompute_all": recompute, "recompute": ()}
    if not isinstance(recompute, (list, tuple)) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in recompute
    ):
        raise InvalidRequest(
            f"recompute must be True, False or a list of layer indices (got {recompute!r})"
        )
    return {"recompute_all": False, "recompute": tuple(recompute)}


@dataclass(frozen=True)
class JobConfig:
    """Everything a stage needs to build and train its layers."""

    model: str
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    optimizer: str = "adam"
    optimizer_kwargs: dict[str, Any] = field(default_factory=dict)
    loss: str = "cross_entropy"
    micro_batches: int = 4
    schedule: str = "1f1b"
    job_id: str = ""
    snapshot_every: int = 0
    external_weights: bool = False  # initial weights come from the client (init_state)
    precision: str = "fp32"  # "bf16"/"fp16": layer forwards under autocast (see precision.py)
    grad_scaler_kwargs: dict[str, Any] = field(default_factory=dict)  # fp16: loss_scaling.py
    scheduler: str = ""  # a torch.optim.lr_scheduler class ("": constant learning rate)
    scheduler_kwargs: dict[str, Any] = field(default_factory=dict)
    warmup_steps: int = 0
    max_grad_norm: float = 0.0  # global-norm clipping (0: none)
    recompute_all: bool = False  # every layer recomputes its forward during backward
    recompute: tuple[int, ...] = ()  # or these layers
    wire_dtype: str = ""  # "bf16" / "fp16": activations and gradients between stages
    collectives: str = ""  # replicas' reduction engine: "" (data channel), "gloo", "nccl"
    rendezvous: str = ""  # with collectives: the coordinator's rendezvous store, host:port

    @classmethod
    def from_arguments(
        cls,
        *,
        model_kwargs: dict[str, Any] | None,
        optimizer_kwargs: dict[str, Any] | None,
        scheduler_kwargs: dict[str, Any] | None,
        grad_scaler_kwargs: dict[str, Any] | None,
        recompute: bool | list[int] | tuple[int, ...],
        **fields: Any,
    ) -> JobConfig:
        """The job a ``Pipeline`` or ``LocalPipeline`` is asked for, from their arguments
        as given (``None`` for no keyword arguments), checked as every stage checks it.

        Raises:
            InvalidRequest: naming the argument no stage would accept.
        """
        for what, value in (("model_kwargs", model_kwargs), ("optimizer_kwargs", optimizer_kwargs)):
            try:
                json.dumps(value or {})
            except TypeError as exc:
                raise InvalidRequest(f"{what} must be JSON-able: {exc}") from exc
        job = cls(
            model_kwargs=dict(model_kwargs or {}),
            optimizer_kwargs=dict(optimizer_kwargs or {}),
            scheduler_kwargs=dict(scheduler_kwargs or {}),
            grad_scaler_kwargs=loss_scaling.as_kwargs(grad_scaler_kwargs),
            **recompute_fields(recompute),
            **fields,
        )
        lr.check(job.scheduler, job.scheduler_kwargs, job.warmup_steps)
        return job

    def __post_init__(self) -> None:
        if not self.model:
            raise InvalidRequest("job has no model")
        # Names only: whether a path is allowed is each stage's call (its --allow-models).
        check_optimizer_name(self.optimizer)
        check_loss_name(self.loss)
        if self.schedule not in SCHEDULES:
            raise InvalidRequest(
                f"unknown schedule {self.schedule!r} (choose from {list(SCHEDULES)})"
            )
        if not 1 <= self.micro_batches <= MAX_MICRO_BATCHES:
            raise InvalidRequest(
                f"micro_batches must be in [1, {MAX_MICRO_BATCHES}] (got {self.micro_batches})"
            )
        if self.precision not in PRECISIONS:
            raise InvalidRequest(
                f"unknown precision {self.precision!r} (choose from {list(PRECISIONS)})"
            )
        if self.grad_scaler_kwargs and self.precision != "fp16":
            raise InvalidRequest(
                f"grad_scaler_kwargs {self.grad_scaler_kwargs} need precision='fp16' "
                f"(got precision={self.precision!r})"
            )
        loss_scaling.check_kwargs(self.grad_scaler_kwargs)
        if self.seed < 0:
            raise InvalidRequest(f"seed must be >= 0 (got {self.seed})")
        if not 0 <= self.snapshot_every <= MAX_SNAPSHOT_EVERY:
            raise InvalidRequest(
                f"snapshot_every must be in [0, {MAX_SNAPSHOT_EVERY}] (got {self.snapshot_every})"
            )
        # Stored jobs come back from JSON with lists: one form from here on.
        object.__setattr__(self, "recompute", tuple(sorted(set(self.recompute))))
        lr.check_name(self.scheduler)
        if not 0 <= self.warmup_steps <= lr.MAX_WARMUP_STEPS:
            raise InvalidRequest(
                f"warmup_steps must be in [0, {lr.MAX_WARMUP_STEPS}] (got {self.warmup_steps})"
            )
        if not (self.max_grad_norm == 0.0 or 0.0 < self.max_grad_norm < float("inf")):
            raise InvalidRequest(
                f"max_grad_norm must be a finite number > 0, or 0 for none "
                f"(got {self.max_grad_norm})"
            )
        if len(self.recompute) > MAX_RECOMPUTE or any(i < 0 for i in self.recompute):
            raise InvalidRequest(
                f"recompute must list at most {MAX_RECOMPUTE} layer indices >= 0 "
                f"(got {list(self.recompute)[:10]})"
            )
        if self.wire_dtype and self.wire_dtype not in WIRE_DTYPES:
            raise InvalidRequest(
                f"unknown wire_dtype {self.wire_dtype!r} (choose from {list(WIRE_DTYPES)}, or none)"
            )
        if self.collectives not in COLLECTIVES:
            raise InvalidRequest(
                f"unknown collectives {self.collectives!r} (choose from "
                f"{[c for c in COLLECTIVES if c]}, or none for the stages' data channel)"
            )
        if self.collectives == "nccl":
            raise InvalidRequest(
                "collectives='nccl' is not built yet: it has not run on GPUs (NCCL needs a "
                "round's sends and receives grouped, and its watchdog ends the process on an "
                "operation a failed run leaves behind); collectives='gloo' runs on CUDA hosts "
                "too, through host memory"
            )

    @property
    def scaler(self) -> dict[str, float | int]:
        """GradScaler's arguments with its defaults filled in (``precision="fp16"``)."""
        return loss_scaling.check_kwargs(self.grad_scaler_kwargs)

    @property
    def reports_grad_norm(self) -> bool:
        """Whether stages report their gradients' squared norms for the commit's decision:
        clipping, or fp16 (an inf/nan gradient skips the step everywhere)."""
        return bool(self.max_grad_norm) or self.precision == "fp16"

    def recomputes(self, layer: int) -> bool:
        """Whether ``layer`` keeps only its input and recomputes its forward in backward."""
        return self.recompute_all or layer in self.recompute

    def with_id(self) -> JobConfig:
        """A copy with a fresh job id (a new job re-initialises every layer)."""
        return JobConfig(**{**self.__dict__, "job_id": uuid.uuid4().hex[:12]})

    def to_proto(self) -> job_pb2.JobSpec:
        """The wire form."""
        return job_pb2.JobSpec(
            job_id=self.job_id,
            model=self.model,
            model_kwargs_json=json.dumps(self.model_kwargs, sort_keys=True),
            seed=self.seed,
            optimizer=self.optimizer,
            optimizer_kwargs_json=json.dumps(self.optimizer_kwargs, sort_keys=True),
            loss=self.loss,
            micro_batches=self.micro_batches,
            schedule=self.schedule,
            snapshot_every=self.snapshot_every,
            external_weights=self.external_weights,
            precision=self.precision,
            grad_scaler_kwargs_json=json.dumps(self.grad_scaler_kwargs, sort_keys=True),
            scheduler=self.scheduler,
            scheduler_kwargs_json=json.dumps(self.scheduler_kwargs, sort_keys=True),
            warmup_steps=self.warmup_steps,
            max_grad_norm=self.max_grad_norm,
            recompute_all=self.recompute_all,
            recompute=list(self.recompute),
            wire_dtype=self.wire_dtype,
            collectives=self.collectives,
            rendezvous=self.rendezvous,
        )

    @classmethod
    def from_proto(cls, spec: job_pb2.JobSpec) -> JobConfig:
        """Parses and validates the wire form.

        Raises:
            InvalidRequest: malformed JSON or an unknown optimizer, loss or schedule.
        """
        return cls(
            model=spec.model,
            model_kwargs=json_object(spec.model_kwargs_json, "model_kwargs"),
            seed=spec.seed,
            optimizer=spec.optimizer or "adam",
            optimizer_kwargs=json_object(spec.optimizer_kwargs_json, "optimizer_kwargs"),
            loss=spec.loss or "cross_entropy",
            micro_batches=spec.micro_batches or 1,
            schedule=spec.schedule or "1f1b",
            job_id=spec.job_id,
            snapshot_every=spec.snapshot_every,
            external_weights=spec.external_weights,
            precision=spec.precision or "fp32",
            grad_scaler_kwargs=json_object(spec.grad_scaler_kwargs_json, "grad_scaler_kwargs"),
            scheduler=spec.scheduler,
            scheduler_kwargs=json_object(spec.scheduler_kwargs_json, "scheduler_kwargs"),
            warmup_steps=spec.warmup_steps,
            max_grad_norm=spec.max_grad_norm,
            recompute_all=spec.recompute_all,
            recompute=tuple(sorted(set(spec.recompute))),
            wire_dtype=spec.wire_dtype,
            collectives=spec.collectives,
            rendezvous=spec.rendezvous,
        )
