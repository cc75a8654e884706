"""Failures a test can inject into a stage (only with ``--enable-fault-injection``).

Import faults corrupt or cut short the next layer pulled by a migration. ``DROP_NEXT_COMMIT``
loses every ``CommitStep`` of the next run committed (nothing applied, the caller sees the
stage as unreachable), so the stage must learn the decision another way. A pause point
blocks the stage where a protocol step happens, announcing it in the log (``paused_at``),
so that a test can ``SIGKILL`` the process exactly there::

    run_started      RunStep accepted, before any op
    awaiting_commit  every op done and reported, before the reply leaves
    commit           CommitStep received, before the optimizer step
    prepare          PrepareEpoch's layers received, before the stage says it is prepared
    epoch_commit     CommitEpoch received, before the new epoch is installed
    snapshot         a snapshot captured, before its copy is pushed to the peer
"""

from __future__ import annotations

import threading
from enum import Enum

from elasticpipe.errors import InvalidRequest, PermissionDenied
from elasticpipe.logs import get_logger

log = get_logger(__name__)

PAUSE_POINTS = (
    "run_started",
    "reducing",
    "awaiting_commit",
    "commit",
    "prepare",
    "epoch_commit",
    "snapshot",
)


class Fault(Enum):
    """What ``InjectFault`` can arm (values of the wire enum)."""

    NONE = 0
    CORRUPT_NEXT_IMPORT = 1
    CANCEL_NEXT_IMPORT = 2
    DROP_NEXT_COMMIT = 3
    PAUSE_AT = 4


class Faults:
    """The faults armed on one stage."""

    def __init__(self, name: str, enabled: bool):
        self._name = name
        self._enabled = enabled
        self._lock = threading.Lock()
        self._import = Fault.NONE
        self._drop_commit = False
        self._dropping: int | None = None  # the run whose commits are being lost
        self._pause_at = ""
        self._released = threading.Event()

    def arm(self, fault: Fault, point: str = "") -> None:
        """Arms a fault.

        Raises:
            PermissionDenied: the stage was started without ``--enable-fault-injection``.
            InvalidRequest: an unknown pause point.
        """
        if not self._enabled:
            raise PermissionDenied(
                f"stage {self._name} was started without --enable-fault-injection"
            )
        with self._lock:
            if fault is Fault.PAUSE_AT:
                if point not in PAUSE_POINTS:
                    raise InvalidRequest(
                        f"unknown pause point {point!r} (choose from {list(PAUSE_POINTS)})"
                    )
                self._pause_at = point
            elif fault is Fault.DROP_NEXT_COMMIT:
                self._drop_commit = True
            else:
                self._import = fault

    def take_import_fault(self) -> Fault:
        """The import fault armed for the next pulled layer (disarmed by taking it)."""
        with self._lock:
            fault, self._import = self._import, Fault.NONE
            return fault

    def drops_commit(self, run: int) -> bool:
        """Whether to lose this commit: once armed, every commit of the next run that
        commits is lost, retries included (its stage must learn the decision otherwise)."""
        with self._lock:
            if self._drop_commit:
                self._drop_commit, self._dropping = False, run
            return self._dropping == run

    def point(self, name: str) -> None:
        """Blocks for good if a pause was armed at ``name`` (the test kills the process)."""
        with self._lock:
            if self._pause_at != name:
                return
            self._pause_at = ""
        log.warning("paused_at", stage=self._name, point=name)
        self._released.wait()
