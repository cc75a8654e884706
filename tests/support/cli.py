"""Running the ``elasticpipe`` command as a user does: one subprocess runner for every CLI
test, and ``as_at_a_terminal`` for commands a test stops with Ctrl-C."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

from elasticpipe.local.cluster import LocalCluster


def elasticpipe(
    *args: str, timeout: float = 120, check: bool = False, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Runs ``python -m elasticpipe ARGS`` to its end, its output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "elasticpipe", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=check,
        env=env,
    )


def admin(
    cluster: LocalCluster, *args: str, after: bool = False, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Runs ``elasticpipe admin --coordinator ADDRESS ARGS``, or with ``after``
    ``elasticpipe admin ARGS --coordinator ADDRESS`` (the option after the command)."""
    coordinator = ["--coordinator", cluster.coordinator]
    command = [*args, *coordinator] if after else [*coordinator, *args]
    return elasticpipe("admin", *command, timeout=timeout)


def admin_json(cluster: LocalCluster, *args: str, coordinator: str = "") -> Any:
    """``elasticpipe admin --json ARGS`` against ``cluster`` (or ``coordinator``), parsed;
    asserts the exit code the contract gives (2 with an ``error`` object, else 0)."""
    run = elasticpipe("admin", "--json", "--coordinator", coordinator or cluster.coordinator, *args)
    out = json.loads(run.stdout)
    assert run.returncode == (2 if "error" in out else 0), run.stdout + run.stderr
    return out


def as_at_a_terminal(command: list[str]) -> list[str]:
    """``python -m MODULE ARGS`` that a test will stop with Ctrl-C (SIGINT), run with SIGINT
    handled as at a terminal: a suite started in the background of a non-interactive shell
    runs with SIGINT ignored, children inherit that, and Python then installs no handler."""
    python, flag, module, *args = command
    assert flag == "-m", command
    code = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        f"sys.argv[0] = {module!r}; runpy.run_module({module!r}, run_name='__main__', "
        "alter_sys=True)"
    )
    return [python, "-c", code, *args]
