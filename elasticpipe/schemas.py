"""JSON Schemas of what ``elasticpipe admin COMMAND --json`` prints: the contract for scripts.

Each command prints the JSON form of one protobuf message (``admin.to_json``: every field
present, zeros too, 64-bit integers as numbers, enums by name, bytes as hex) or, on any
error, ``{"error": {"code": "<gRPC status name>", "message": "..."}}``. The schemas are
derived from the message descriptors (so a new field is in the schema the day it is in the
proto) plus the value sets the coordinator documents for string fields (a stage's state,
an epoch record's kind); every object is closed (``additionalProperties: false``).

``python -m elasticpipe.schemas DIR`` writes one file per command (``docs/schemas``); a
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
    "drain": coordinator_pb2.RebalanceResponse.DESCRIPTOR,
    "undrain": coordinator_pb2.RebalanceResponse.DESCRIPTOR,
    "forget": coordinator_pb2.AdminAck.DESCRIPTOR,
    "slowdown": coordinator_pb2.AdminAck.DESCRIPTOR,
    "auto": coordinator_pb2.AdminAck.DESCRIPTOR,
}

# String fields whose values are a closed set (message name, field name) -> values.
STRING_VALUES: dict[tuple[str, str], list[str]] = {
    ("StageInfo", "state"): ["chain", "spare", "drained", "dead"],
    ("EpochRecord", "kind"): ["start", "move", "scale-out", "recovery", "restore", "abandoned"],
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
    return {"type": "array", "items": one} if field.is_repeated else one


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
    if command not in COMMAND_MESSAGES:
        raise KeyError(
            f"no schema for admin command {command!r} (known: {sorted(COMMAND_MESSAGES)})"
        )
    message = COMMAND_MESSAGES[command]
    defs: dict[str, Any] = {}
    answer = _object(message, defs)
    return {
        "$schema": DIALECT,
        "$id": f"elasticpipe-admin-{command}.json",
        "title": f"elasticpipe admin {command} --json",
        "description": f"a {message.full_name} message, every field present; or an error",
        "oneOf": [answer, {"$ref": "#/$defs/Error"}],
        "$defs": {**dict(sorted(defs.items())), "Error": ERROR_SCHEMA},
    }


def write(folder: str | Path) -> list[Path]:
    """Writes ``FOLDER/admin-COMMAND.json`` for every command; returns the paths."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for command in COMMAND_MESSAGES:
        path = out / f"admin-{command}.json"
        path.write_text(json.dumps(command_schema(command), indent=2) + "\n")
        paths.append(path)
    return paths


if __name__ == "__main__":  # pragma: no cover - a maintenance command
    for written in write(sys.argv[1] if len(sys.argv) > 1 else "docs/schemas"):
        print(written)
