"""The JSON Schemas of the admin commands: one per command, derived, kept in docs/schemas."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from google.protobuf import message_factory

from elasticpipe.cli.admin import COMMANDS, to_json
from elasticpipe.cli.schemas import COMMAND_MESSAGES, command_schema, write
from elasticpipe.cli.schemas import COMMANDS as SCHEMA_COMMANDS
from elasticpipe.v1 import coordinator_pb2 as pb

pytestmark = pytest.mark.timeout(20)
DOCS = Path(__file__).resolve().parents[2] / "docs" / "schemas"


def test_every_admin_command_has_a_schema() -> None:
    """A new admin command needs its --json contract here."""
    assert set(COMMANDS) <= set(SCHEMA_COMMANDS)


def test_the_schemas_in_docs_are_current(tmp_path: Path) -> None:
    """docs/schemas equals what the module derives.

    (Regenerate: python -m elasticpipe.cli.schemas docs/schemas.)"""
    for path in write(tmp_path):
        assert (DOCS / path.name).read_text() == path.read_text(), f"regenerate {path.name}"


@pytest.mark.parametrize("command", sorted(COMMAND_MESSAGES))
def test_each_schema_is_valid_and_accepts_the_empty_answer(command: str) -> None:
    """A well-formed 2020-12 schema that accepts the message with every field at zero."""
    schema = command_schema(command)
    jsonschema.Draft202012Validator.check_schema(schema)
    empty = message_factory.GetMessageClass(COMMAND_MESSAGES[command])()
    jsonschema.validate(to_json(empty), schema)


@pytest.mark.parametrize(
    ("output", "why"),
    [
        ({"stages": []}, "a missing field"),
        ({**to_json(pb.StatusResponse()), "extra": 1}, "an unknown field"),
        ({**to_json(pb.StatusResponse()), "committed_step": "7"}, "an integer as a string"),
        ({**to_json(pb.StatusResponse()), "committed_step": -1}, "a negative uint64"),
        (
            to_json(pb.StatusResponse(stages=[pb.StageInfo(state="sleeping")])),
            "a state outside chain/spare/drained/dead",
        ),
        ({"error": {"code": "NOPE", "message": "x"}}, "an unknown error code"),
    ],
)
def test_the_status_schema_rejects(output: dict[str, object], why: str) -> None:
    """Outputs a script could not rely on fail validation."""
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(output, command_schema("status"))


def test_the_error_object_is_accepted_by_every_schema() -> None:
    """{"error": {"code", "message"}} is valid output of any command."""
    error = json.loads('{"error": {"code": "UNAVAILABLE", "message": "down"}}')
    for command in SCHEMA_COMMANDS:
        jsonschema.validate(error, command_schema(command))
