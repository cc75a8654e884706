"""A training job's description, parsed once from its protobuf form and validated."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from elasticpipe.errors import InvalidRequest
from elasticpipe.schedule import SCHEDULES
from elasticpipe.training import check_loss_name, check_optimizer_name
from elasticpipe.v1 import job_pb2

MAX_KWARGS_JSON = 1 << 20
MAX_SNAPSHOT_EVERY = 1_000_000
MAX_MICRO_BATCHES = 4096
PRECISIONS = ("fp32", "bf16")


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
    precision: str = "fp32"  # "bf16": layer forwards under autocast (see precision.py)

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
        if self.seed < 0:
            raise InvalidRequest(f"seed must be >= 0 (got {self.seed})")
        if not 0 <= self.snapshot_every <= MAX_SNAPSHOT_EVERY:
            raise InvalidRequest(
                f"snapshot_every must be in [0, {MAX_SNAPSHOT_EVERY}] (got {self.snapshot_every})"
            )

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
        )
