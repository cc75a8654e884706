"""The stage's lock: a commit's optimizer step runs after its reply, before anyone else's turn.

A ``CommitStep`` decides (the step machine is IDLE at step + 1) and replies; the optimizer
step it decided, and the effects that follow it (the run's close, a snapshot), are handed
to ``Deferral.defer``. The client's ``train_step`` returns without waiting for them: one
optimizer step (1-3 ms of a 2-stage MLP step, more for big stages) leaves the step's
critical path and overlaps the reply, the client's next step and the next RunStep.

Nothing can see the state between the decision and its optimizer step: ``Deferral`` is the
``threading.Condition`` every stage method takes, and whoever takes it first carries the
deferred effects out before doing anything else -- the applier thread (woken by ``defer``),
or a next RunStep, a move's freeze, an export, a heartbeat's read, a lease tick. A wait on
the condition does the same when it wakes, since the lock was free meanwhile.

What a returned ``train_step`` guarantees is unchanged: a stage that replied holds the
decision (``StepMachine.committed_step``); whether it crashes before or after the optimizer
step, the step is lost with the process's memory either way, and recovery restores a
snapshot and replays it. An optimizer step that fails poisons the stage (``Stage._apply``)
in whichever thread ran it, which logs the failure and goes on with its own work: the
stage has dropped its job, so its next request is refused for that, and recovery
replaces it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from elasticpipe.logs import get_logger
from elasticpipe.stage_server.protocol import Effect

log = get_logger(__name__)


class Deferral(threading.Condition):
    """A condition on a reentrant lock whose every holder first carries out the deferred
    effects (``carry_out(effects)``, called with the lock held)."""

    def __init__(self, carry_out: Callable[[list[Effect]], None], name: str):
        super().__init__(threading.RLock())
        self._carry_out = carry_out
        self._deferred: list[Effect] = []
        self._wake = threading.Event()
        self._closed = False
        self._applier = threading.Thread(target=self._apply_loop, name=f"{name}-apply", daemon=True)
        self._applier.start()

    def defer(self, effects: list[Effect]) -> None:
        """Carries ``effects`` out after the lock is released, before any other holder's
        work (the lock must be held)."""
        self._deferred.extend(effects)
        self._wake.set()

    def settle(self) -> None:
        """Carries out the deferred effects now (the lock is held; reentrant holders find
        nothing left)."""
        while self._deferred:
            effects, self._deferred = self._deferred, []
            try:
                self._carry_out(effects)
            except Exception as exc:  # not the holder's failure: the effects record their own
                log.error("deferred_effects_failed", error=repr(exc), exc_info=exc)

    def __enter__(self) -> bool:
        entered: bool = super().__enter__()
        try:
            self.settle()
        except BaseException:  # an interrupt: the lock must not stay taken
            super().__exit__(None, None, None)
            raise
        return entered

    def wait(self, timeout: float | None = None) -> bool:
        notified = super().wait(timeout)
        self.settle()  # another thread may have deferred while the lock was free
        return notified

    def close(self) -> None:
        """Stops the applier (what is still deferred runs at the next holder's turn)."""
        self._closed = True
        self._wake.set()
        self._applier.join(timeout=5)

    def _apply_loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._closed:
                return
            with self:
                pass  # taking the lock settles
