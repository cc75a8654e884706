"""The coordinator's background loops (the rebalancing policy, storing learned figures)."""

from __future__ import annotations

import threading

from elasticpipe.logs import get_logger

log = get_logger(__name__)


def run_loop(stop: threading.Event, interval: float, fn: object, name: str) -> threading.Thread:
    """Calls ``fn()`` every ``interval`` seconds on a daemon thread until ``stop`` is set;
    a failure of one call is logged and the loop goes on."""
    assert callable(fn)

    def loop() -> None:
        while not stop.wait(interval):
            try:
                fn()
            except Exception as exc:  # the loop must outlive any one failed attempt
                log.warning(f"{name}_failed", error=str(exc))

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    return thread
