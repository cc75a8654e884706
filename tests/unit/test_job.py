"""Tests of the job description: its wire form and the validation of every field."""

from __future__ import annotations

from typing import Any

import pytest

from elasticpipe.errors import InvalidRequest
from elasticpipe.training.job import JobConfig
from elasticpipe.v1 import job_pb2

JOB = JobConfig(
    model="mlp",
    model_kwargs={"sizes": [8, 16, 4], "act": "relu", "nested": {"p": 0.5, "flag": True}},
    seed=7,
    optimizer="adamw",
    optimizer_kwargs={"lr": 0.01, "betas": [0.8, 0.9]},
    loss="mse",
    micro_batches=6,
    schedule="gpipe",
    job_id="abc123",
)


def test_to_proto_from_proto_round_trip() -> None:
    """A job survives its wire form (serialized and parsed back) unchanged."""
    spec = job_pb2.JobSpec.FromString(JOB.to_proto().SerializeToString())
    assert JobConfig.from_proto(spec) == JOB


def test_default_job_round_trips() -> None:
    """A job with only a model and its defaults survives the wire form unchanged."""
    job = JobConfig(model="gpt")
    assert JobConfig.from_proto(job.to_proto()) == job


def test_unset_fields_take_the_defaults() -> None:
    """A spec that leaves optimizer, loss and schedule empty gets adam, cross_entropy, 1f1b."""
    job = JobConfig.from_proto(job_pb2.JobSpec(model="mlp"))
    assert (job.optimizer, job.loss, job.schedule) == ("adam", "cross_entropy", "1f1b")
    assert job.model_kwargs == job.optimizer_kwargs == {}


def test_with_id_assigns_a_fresh_id_and_keeps_the_rest() -> None:
    """with_id returns the same job under a new, distinct 12-hex-digit id."""
    a, b = JOB.with_id(), JOB.with_id()
    assert a.job_id != b.job_id
    assert len(a.job_id) == 12
    int(a.job_id, 16)
    assert JobConfig(**{**a.__dict__, "job_id": JOB.job_id}) == JOB


@pytest.mark.parametrize(
    ("field", "text", "value"),
    [
        ("model_kwargs_json", '{"sizes": [1, 2', "sizes"),
        ("optimizer_kwargs_json", "lr=0.1", "lr=0.1"),
        ("model_kwargs_json", "[1, 2]", "[1, 2]"),
        ("optimizer_kwargs_json", '"adam"', "adam"),
        ("model_kwargs_json", "3", "3"),
        ("model_kwargs_json", "null", "null"),
    ],
    ids=["truncated", "not-json", "array", "string", "number", "null"],
)
def test_bad_kwargs_json_is_invalid(field: str, text: str, value: str) -> None:
    """Malformed or non-object JSON kwargs raise InvalidRequest naming the field and text."""
    fields: dict[str, Any] = {field: text}
    spec = job_pb2.JobSpec(model="mlp", **fields)
    with pytest.raises(InvalidRequest) as info:
        JobConfig.from_proto(spec)
    assert field.removesuffix("_json") in str(info.value)
    assert value in str(info.value)


def test_deeply_nested_kwargs_json_is_invalid() -> None:
    """Kwargs JSON nested deeper than the parser can recurse raises InvalidRequest."""
    spec = job_pb2.JobSpec(model="mlp", model_kwargs_json='{"a":' * 100_000)
    with pytest.raises(InvalidRequest, match="model_kwargs"):
        JobConfig.from_proto(spec)


@pytest.mark.parametrize(
    ("field", "value"),
    [("optimizer", "lamb"), ("loss", "hinge"), ("schedule", "pipedream")],
)
def test_unknown_names_in_spec_are_invalid(field: str, value: str) -> None:
    """An unknown optimizer, loss or schedule on the wire raises InvalidRequest naming it."""
    with pytest.raises(InvalidRequest, match=f"'{value}'"):
        fields: dict[str, Any] = {field: value}
        JobConfig.from_proto(job_pb2.JobSpec(model="mlp", **fields))


@pytest.mark.parametrize(
    ("kwargs", "value"),
    [
        ({"micro_batches": 0}, r"\(got 0\)"),
        ({"micro_batches": -2}, r"\(got -2\)"),
        ({"seed": -1}, r"\(got -1\)"),
        ({"optimizer": "lamb"}, "'lamb'"),
        ({"loss": "hinge"}, "'hinge'"),
        ({"schedule": "zb"}, "'zb'"),
        ({"model": ""}, "no model"),
    ],
)
def test_bad_config_is_invalid(kwargs: dict[str, object], value: str) -> None:
    """Constructing a job with a bad field raises InvalidRequest naming the value."""
    with pytest.raises(InvalidRequest, match=value):
        JobConfig(**{"model": "mlp", **kwargs})  # type: ignore[arg-type]


def test_missing_model_on_the_wire_is_invalid() -> None:
    """A spec without a model is refused."""
    with pytest.raises(InvalidRequest, match="no model"):
        JobConfig.from_proto(job_pb2.JobSpec())


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("scheduler", "LambdaLR", "unknown scheduler 'LambdaLR'"),
        ("wire_dtype", "int8", "unknown wire_dtype 'int8'"),
        ("max_grad_norm", float("nan"), "max_grad_norm"),
        ("scheduler_kwargs_json", "[1]", "scheduler_kwargs must be a JSON object"),
    ],
)
def test_a_job_spec_with_bad_trainer_options_is_refused(
    field: str, value: object, message: str
) -> None:
    """What a stage receives is checked there too (a client may be anyone)."""
    spec = JobConfig(model="mlp").to_proto()
    setattr(spec, field, value)
    with pytest.raises(InvalidRequest, match=message):
        JobConfig.from_proto(spec)


def test_trainer_options_round_trip_through_the_wire_form() -> None:
    """Scheduler, warm-up, clipping, recompute and wire dtype survive to_proto/from_proto."""
    job = JobConfig(
        model="mlp",
        scheduler="StepLR",
        scheduler_kwargs={"step_size": 3},
        warmup_steps=5,
        max_grad_norm=1.5,
        recompute=(4, 1),
        wire_dtype="bf16",
    )
    again = JobConfig.from_proto(job.to_proto())
    assert again == job and again.recompute == (1, 4) and again.recomputes(4)
