"""JSON Schemas of what ``elasticpipe admin COMMAND --json`` prints: the contract for scripts.

Each command prints the JSON form of one protobuf message (``client.admin.document`` of
``Admin``'s answer, equal to ``cli.admin.to_json`` of the message: every field
present, zeros too, 64-bit integers as numbers, enums by name, bytes as hex, null for an
``optional`` number that is unknown) or, on any
error, ``{"error": {"code": "<gRPC status name>", "message": "..."}}``; ``admin trace``
prints its own summary object. The message schemas are derived from the descriptors (so a
new field is in the schema the day it is in the proto) plus the value sets the coordinator
documents for string fields (a stage's state, an epoch record's kind); every object is
closed (``additionalProperties: false``).

``python -m elasticpipe.cli.schemas DIR`` writes one file per command (``docs/schemas``); a
test keeps those files equal to what this module derives.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from elasticpipe.v1 import coordinator_pb2

DIALECT = "https://json-schema.org/draft/2020-12/schema"

# The message each admin command prints with --json (status --watch --json: one per line).
COMMAND_MESSAGES: dict[str, Descriptor] = {
    "status": coordinator_pb2.StatusResponse.DESCRIPTOR,
    "plan": coordinator_pb2.PlanResponse.DESCRIPTOR,
    "rebalance": coordinator_pb2.RebalanceResponse.DESCRIPTOR,
    "set-partition": coordinator_pb2.RebalanceResponse.DESCRIPTOR,
    "set-layout": coordinator_pb2.RebalanceResponse.DESCRIPTOR,
    "drain": coordinator_pb2.RebalanceResponse.DESCRIPTOR,
    "undrain": coordinator_pb2.RebalanceResponse.DESCRIPTOR,
    "forget": coordinator_pb2.AdminAck.DESCRIPTOR,
    "slowdown": coordinator_pb2.AdminAck.DESCRIPTOR,
    "auto": coordinator_pb2.AdminAck.DESCRIPTOR,
}

# Commands that print a plain object rather than a message (admin trace: traces.summary).
_NUMBER = {"type": "number"}
TRACE_ANSWER: dict[str, Any] = {
    "type": "object",
    "required": ["stages", "steps", "inference_runs", "out", "png"],
    "additionalProperties": False,
    "properties": {
        "stages": {
            "type": "array",
            "items": {
                "type": "object",
                "required": [
                    "index",
                    "name",
                    "address",
                    "layers",
                    "spans",
                    "truncated",
                    "clock_offset_ms",
                    "clock_rtt_ms",
                ],
                "additionalProperties": False,
                "properties": {
                    "index": {"type": "integer", "minimum": 0},
                    "name": {"type": "string"},
                    "address": {"type": "string"},
                    "layers": {
                        "type": "array",
                        "items": {"type": "integer", "minimum": 0},
                        "minItems": 2,
                        "maxItems": 2,
                    },
                    "spans": {"type": "integer", "minimum": 0},
                    "truncated": {"type": "boolean"},
                    "clock_offset_ms": _NUMBER,
                    "clock_rtt_ms": {"type": "number", "minimum": 0},
                },
            },
        },
        "steps": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["step", "ideal_s", "measured_s", "efficiency"],
                "additionalProperties": False,
                "properties": {
                    "step": {"type": "integer", "minimum": 1},
                    "ideal_s": {"type": "number", "exclusiveMinimum": 0},
                    "measured_s": {"type": "number", "exclusiveMinimum": 0},
                    "efficiency": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                },
            },
        },
        "inference_runs": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["run", "after_step"],
                "additionalProperties": False,
                "properties": {
                    "run": {"type": "integer", "minimum": 1},
                    "after_step": {"type": "integer", "minimum": 0},
                },
            },
        },
        "out": {"type": "string"},
        "png": {"type": "string"},
    },
}
COMMAND_OBJECTS: dict[str, tuple[str, dict[str, Any]]] = {
    "trace": (
        "the trace's summary: per stage, per training step, and the inference runs "
        "(traces.summary)",
        TRACE_ANSWER,
    ),
}
COMMANDS = [*COMMAND_MESSAGES, *COMMAND_OBJECTS]

# String fields whose values are a closed set (message name, field name) -> values.
STRING_VALUES: dict[tuple[str, str], list[str]] = {
    ("StageInfo", "state"): ["chain", "spare", "drained", "dead", "left"],
    ("EpochRecord", "kind"): [
        "start",
        "move",
        "scale-out",
        "shares",
        "recovery",
        "restore",
        "attach",
        "abandoned",
    ],
}

_SCALARS: dict[int, dict[str, Any]] = {
    FieldDescriptor.TYPE_DOUBLE: {"type": "number"},
    FieldDescriptor.TYPE_FLOAT: {"type": "number"},
    FieldDescriptor.TYPE_INT64: {"type": "integer"},
    FieldDescriptor.TYPE_SINT64: {"type": "integer"},
    FieldDescriptor.TYPE_SFIXED64: {"type": "integer"},
    FieldDescriptor.TYPE_INT32: {"type": "integer"},
    FieldDescriptor.TYPE_SINT32: {"type": "integer"},
    FieldDescriptor.TYPE_SFIXED32: {"type": "integer"},
    FieldDescriptor.TYPE_UINT64: {"type": "integer", "minimum": 0},
    FieldDescriptor.TYPE_FIXED64: {"type": "integer", "minimum": 0},
    FieldDescriptor.TYPE_UINT32: {"type": "integer", "minimum": 0},
    FieldDescriptor.TYPE_FIXED32: {"type": "integer", "minimum": 0},
    FieldDescriptor.TYPE_BOOL: {"type": "boolean"},
    FieldDescriptor.TYPE_STRING: {"type": "string"},
    FieldDescriptor.TYPE_BYTES: {"type": "string", "pattern": "^([0-9a-f]{2})*$"},
}

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "code": {"enum": sorted(code.name for code in grpc.StatusCode)},
                "message": {"type": "string", "minLength": 1},
            },
            "required": ["code", "message"],
            "additionalProperties": False,
        }
    },
    "required": ["error"],
    "additionalProperties": False,
}


def _field(message: Descriptor, field: FieldDescriptor, defs: dict[str, Any]) -> dict[str, Any]:
    if field.message_type is not None:
        _define(field.message_type, defs)
        one: dict[str, Any] = {"$ref": f"#/$defs/{field.message_type.name}"}
    elif field.enum_type is not None:
        one = {"enum": [v.name for v in field.enum_type.values]}
    elif (message.name, field.name) in STRING_VALUES:
        one = {"enum": STRING_VALUES[(message.name, field.name)]}
    else:
        one = dict(_SCALARS[field.type])
        if _unknown_when_unset(field):
            one["type"] = [one["type"], "null"]
    return {"type": "array", "items": one} if field.is_repeated else one


def _unknown_when_unset(field: FieldDescriptor) -> bool:
    """A scalar field declared ``optional``: JSON null when unset (unknown), not zero."""
    return field.message_type is None and not field.is_repeated and field.has_presence


def _object(message: Descriptor, defs: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {f.name: _field(message, f, defs) for f in message.fields},
        "required": [f.name for f in message.fields],
        "additionalProperties": False,
    }


def _define(message: Descriptor, defs: dict[str, Any]) -> None:
    if message.name not in defs:
        defs[message.name] = {}  # placeholder first: a recursive message ends here
        defs[message.name] = _object(message, defs)


def command_schema(command: str) -> dict[str, Any]:
    """The schema of ``elasticpipe admin COMMAND --json``'s output: the command's message,
    or the error object.

    Raises:
        KeyError: a command without JSON output (the message names the known ones).
    """
    defs: dict[str, Any] = {}
    if command in COMMAND_MESSAGES:
        message = COMMAND_MESSAGES[command]
        answer = _object(message, defs)
        description = f"a {message.full_name} message, every field present; or an error"
    elif command in COMMAND_OBJECTS:
        what, answer = COMMAND_OBJECTS[command]
        description = f"{what}; or an error"
    else:
        raise KeyError(f"no schema for admin command {command!r} (known: {sorted(COMMANDS)})")
    return {
        "$schema": DIALECT,
        "$id": f"elasticpipe-admin-{command}.json",
        "title": f"elasticpipe admin {command} --json",
        "description": description,
        "oneOf": [answer, {"$ref": "#/$defs/Error"}],
        "$defs": {**dict(sorted(defs.items())), "Error": ERROR_SCHEMA},
    }


def write(folder: str | Path) -> list[Path]:
    """Writes ``FOLDER/admin-COMMAND.json`` for every command; returns the paths."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for command in COMMANDS:
        path = out / f"admin-{command}.json"
        path.write_text(json.dumps(command_schema(command), indent=2) + "\n")
        paths.append(path)
    return paths


if __name__ == "__main__":  # pragma: no cover - a maintenance command
    for written in write(sys.argv[1] if len(sys.argv) > 1 else "docs/schemas"):
        print(written)
