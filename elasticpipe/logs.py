"""Logging: structured events through the standard ``logging`` machinery.

Every module logs with ``log = get_logger(__name__)``: structlog's bound-logger API (an
event name in snake_case past tense, values as keywords), emitted as ordinary ``logging``
records of the ``elasticpipe`` logger hierarchy. As a library, ElasticPipe configures
nothing and prints nothing: the application decides what to show (``logging.basicConfig``
or ``configure_logging`` below). The command-line entry points call ``configure_logging``
once, for their process.

A record's message reads ``event key=value ...``; the event's fields also travel on the
record (``record.elasticpipe``), so ``configure_logging`` renders them as aligned console
lines or as JSON lines.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any, TextIO

import structlog

LOGGER_ROOT = "elasticpipe"
LEVELS = ("debug", "info", "warning", "error")


def _to_record(
    logger: Any, method: str, event: MutableMapping[str, Any]
) -> tuple[tuple[str], dict[str, Any]]:
    """The last processor: a readable message, and the fields for our formatter."""
    name = str(event.pop("event", ""))
    fields = " ".join(f"{k}={v!r}" for k, v in sorted(event.items()))
    return (f"{name} {fields}".rstrip(),), {"extra": {"elasticpipe": {"event": name, **event}}}


def get_logger(name: str) -> structlog.stdlib.BoundLogger:
    """A structured logger emitting through ``logging.getLogger(name)``."""
    logger: structlog.stdlib.BoundLogger = structlog.wrap_logger(
        logging.getLogger(name),
        processors=[
            structlog.stdlib.filter_by_level,
            structlog.contextvars.merge_contextvars,
            _to_record,
        ],
        wrapper_class=structlog.stdlib.BoundLogger,
    )
    return logger


class _Formatter(logging.Formatter):
    """Renders ElasticPipe's events as console lines or JSON; other records as usual."""

    def __init__(self, fmt: str, colors: bool):
        super().__init__("%(asctime)s [%(levelname)s] %(name)s: %(message)s")
        renderer: structlog.typing.Processor = (
            structlog.processors.JSONRenderer()
            if fmt == "json"
            else structlog.dev.ConsoleRenderer(colors=colors)
        )
        self._chain: list[structlog.typing.Processor] = [
            structlog.processors.TimeStamper(fmt="iso" if fmt == "json" else "%H:%M:%S.%f"),
            renderer,
        ]

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "elasticpipe", None)
        if not isinstance(fields, dict):
            return super().format(record)
        event: Any = {**fields, "level": record.levelname.lower()}
        if record.exc_info:
            event["exception"] = self.formatException(record.exc_info)
        for processor in self._chain:
            event = processor(None, record.levelname.lower(), event)
        return str(event)


def configure_logging(
    fmt: str = "console", level: str = "info", stream: TextIO | None = None
) -> None:
    """Shows log records on ``stream`` (default: stderr): one call, for an application.

    Args:
        fmt: "console" (aligned, human-readable) or "json" (one object per line).
        level: "debug", "info", "warning" or "error".
        stream: where to write.

    Raises:
        ValueError: an unknown format or level (the message names it).
    """
    if fmt not in ("console", "json"):
        raise ValueError(f"unknown log format {fmt!r} (choose from console, json)")
    if level.lower() not in LEVELS:
        raise ValueError(f"unknown log level {level!r} (choose from {', '.join(LEVELS)})")
    out = stream or sys.stderr
    handler = logging.StreamHandler(out)
    handler.setFormatter(_Formatter(fmt, colors=fmt == "console" and out.isatty()))
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_elasticpipe", False)]:
        root.removeHandler(old)
    handler._elasticpipe = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(logging.WARNING)  # other libraries: warnings only
    logging.getLogger(LOGGER_ROOT).setLevel(level.upper())
