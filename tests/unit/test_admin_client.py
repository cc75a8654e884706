"""``Admin``'s answers mirror their protobuf messages, so its JSON is the CLI's contract."""

from __future__ import annotations

import dataclasses
import json

import pytest
from google.protobuf.message import Message

from elasticpipe import Admin
from elasticpipe.cli.admin import to_json
from elasticpipe.client import admin as typed
from elasticpipe.errors import InvalidRequest
from elasticpipe.v1 import coordinator_pb2 as pb

pytestmark = pytest.mark.timeout(30)

MIRRORS = [
    (typed.Status, pb.StatusResponse),
    (typed.StageInfo, pb.StageInfo),
    (typed.EpochRecord, pb.EpochRecord),
    (typed.PartitionInfo, pb.Partition),
    (typed.PlanReport, pb.PlanResponse),
    (typed.Move, pb.RebalanceResponse),
    (typed.Ack, pb.AdminAck),
]


def _partition(epoch: int, predicted: float | None) -> pb.Partition:
    p = pb.Partition(
        epoch=epoch,
        job_id="job-1",
        boundaries=[0, 3, 7],
        stage_ids=["a-1", "b-1"],
        addresses=["127.0.0.1:1", "127.0.0.1:2"],
        restored_step=4,
        restore_epoch=2,
    )
    if predicted is not None:
        p.predicted_step_s = predicted
    return p


def _status() -> pb.StatusResponse:
    stage = pb.StageInfo(
        stage_id="a-1",
        name="a",
        address="127.0.0.1:1",
        device="cpu",
        speed=1.5,
        alive=True,
        last_heartbeat_unix=1e9,
        index=0,
        layer_lo=0,
        layer_hi=3,
        committed_step=9,
        slowdown=2.0,
        state="chain",
        incarnation=3,
        memory_bytes=1 << 30,
    )
    gone = pb.StageInfo(stage_id="a-0", name="a", state="dead", incarnation=2, index=-1)
    record = pb.EpochRecord(
        epoch=3,
        at_unix=1e9,
        reason="why",
        boundaries=[0, 3, 7],
        layers_moved=1,
        bytes_moved=10,
        pause_s=0.5,
        kind="move",
        stages=["a", "b"],
        restored_step=1,
        lost_steps=2,
        job_id="job-1",
        detected_unix=2e9,
        loop_pause_s=0.75,
    )
    return pb.StatusResponse(
        stages=[gone, stage],
        partition=_partition(3, 0.25),
        history=[record],
        job_model="mlp",
        num_layers=7,
        auto_rebalance=True,
        job_id="job-1",
        client="client-1",
        committed_step=9,
        job_failure="",
        factory_file="f.py",
        factory_sha256="ab" * 32,
        efficiency=0.8,
        efficiency_step=9,
    )


@pytest.mark.parametrize(("cls", "message"), MIRRORS, ids=lambda c: c.__name__)
def test_every_field_of_the_message_is_a_field_of_the_dataclass_in_order(
    cls: type, message: type[Message]
) -> None:
    """A field added to the proto must be added to its dataclass (and in the same place)."""
    assert [f.name for f in dataclasses.fields(cls)] == [f.name for f in message.DESCRIPTOR.fields]


@pytest.mark.parametrize(
    "message",
    [
        _status(),
        pb.StatusResponse(),
        pb.PlanResponse(
            current=_partition(2, None),
            optimal_boundaries=[0, 4, 7],
            current_step_s=0.5,
            optimal_step_s=0.4,
            stage_speeds=[1.0, 2.0],
            layer_costs=[0.1] * 7,
            bytes_to_move=100,
            stage_names=["a", "b"],
        ),
        pb.PlanResponse(current=_partition(1, None)),
        pb.RebalanceResponse(
            changed=True,
            partition=_partition(4, 0.2),
            decision="gain",
            predicted_gain=0.1,
            bytes_moved=5,
            pause_s=0.1,
            target=_partition(4, 0.2),
        ),
        pb.AdminAck(message="done"),
    ],
    ids=["status", "empty-status", "plan", "unprofiled-plan", "move", "ack"],
)
def test_the_json_of_an_answer_is_the_json_of_its_message(message: Message) -> None:
    """The JSON form of the typed answer is the protobuf's, to the byte of its text (field
    order and unset optionals as null included): what ``admin --json`` printed before it
    used ``Admin``."""
    cls = next(c for c, m in MIRRORS if m is type(message))
    answer = typed.document(typed.from_proto(cls, message))
    assert answer == to_json(message)
    assert json.dumps(answer) == json.dumps(to_json(message))


def test_an_unset_optional_is_none_and_a_repeated_field_a_tuple() -> None:
    """The plan of an unprofiled job has no step times (and so no gain)."""
    plan = typed.from_proto(typed.PlanReport, pb.PlanResponse(current=_partition(1, None)))
    assert plan.current_step_s is None and plan.current.predicted_step_s is None
    assert plan.gain is None
    assert plan.current.boundaries == (0, 3, 7)


def test_status_helpers_find_the_chain_and_a_stage_by_name() -> None:
    """``chain`` is in chain order, ``stage`` prefers the live incarnation of a name."""
    status = typed.from_proto(typed.Status, _status())
    assert [s.stage_id for s in status.chain] == ["a-1"]
    assert status.stage("a").incarnation == 3
    assert status.stage("a-0").state == "dead"
    with pytest.raises(InvalidRequest, match="'nobody'"):
        status.stage("nobody")


def test_bad_arguments_are_refused_naming_the_value() -> None:
    """A malformed address or a non-positive timeout is an error before any call."""
    with pytest.raises(InvalidRequest, match="nowhere"):
        Admin("nowhere")
    with pytest.raises(InvalidRequest, match="-1"):
        Admin("127.0.0.1:1", timeout=-1)


@pytest.mark.parametrize(
    ("boundaries", "stages"),
    [([0, -1, 4], ()), ([0, 1.5, 4], ()), ([], ()), ([0, 2, 4], "ab")],
    ids=["negative", "fraction", "empty", "stages-as-a-string"],
)
def test_set_partition_refuses_what_is_not_cuts_and_names_before_any_call(
    boundaries: list[object], stages: object
) -> None:
    """Malformed cuts or a string of stage names are InvalidRequest naming the value; the
    coordinator (none listens here) is never called."""
    with Admin("127.0.0.1:1", timeout=2) as admin, pytest.raises(InvalidRequest, match="got"):
        admin.set_partition(boundaries, stages)  # type: ignore[arg-type]
