"""The fork server's own side (``elasticpipe/local/forkserver.py`` is its client and says
what it is for): a Python that imports the ``elasticpipe`` command's modules once, then
forks a child per request that runs the command as ``python -m elasticpipe`` would.

Requests come on standard input, one JSON line each (``{"id", "argv", "env", "cwd",
"log"}``); the answers go to standard output (``{"id", "pid"}``, and ``{"exited": pid,
"code"}`` when a child is reaped). The server forks while it has one Python thread and no
gRPC channel or server, and has run no torch kernel.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import sys
import traceback
from typing import Any

REAP_INTERVAL_S = 0.05  # how often the server looks for children that exited
# What the children run, torch with it: imported once, by the server.
PRELOADED = (
    "elasticpipe.cli.entry",
    "elasticpipe.cli.serve",
    "elasticpipe.coordinator.server",
    "elasticpipe.stage_server.server",
    "elasticpipe.stage_server.stage",
)


def serve() -> None:
    """The server's loop: fork a child per request, report each child's exit."""
    for module in PRELOADED:
        importlib.import_module(module)

    paths = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    out = sys.stdout.buffer
    inp = sys.stdin.fileno()  # read with os.read: select sees every line not yet read
    pending = b""

    def say(message: dict[str, Any]) -> None:
        out.write(json.dumps(message).encode() + b"\n")
        out.flush()

    say({"ready": True})
    children: dict[int, int] = {}  # pid -> the request that forked it
    while True:
        readable, _, _ = select.select([inp], [], [], REAP_INTERVAL_S)
        if readable:
            data = os.read(inp, 1 << 16)
            if not data:
                return  # the client is gone
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                try:
                    pid = _fork(request, paths)
                except OSError as exc:  # (no memory, or too many processes)
                    say({"id": request["id"], "error": f"fork failed: {exc}"})
                    continue
                children[pid] = request["id"]
                say({"id": request["id"], "pid": pid})
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            code = os.waitstatus_to_exitcode(status)
            say({"exited": pid, "id": children.pop(pid, 0), "code": code})


def _fork(request: dict[str, Any], paths: list[str]) -> int:
    """Forks the child of ``request`` (``paths``: the server's own ``PYTHONPATH``, as
    ``sys.path`` holds it); returns its pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDONLY)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(devnull)
        os.close(log)
        os.chdir(request["cwd"])
        _take_paths(paths, request["env"].get("PYTHONPATH", ""))
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # as elasticpipe.cli.entry's import
        sys.argv = ["elasticpipe", *request["argv"]]
        from elasticpipe.cli.entry import main

        code = main()  # a coordinator or stage ends the process itself (cli/process.py)
    except SystemExit as exc:  # as the interpreter ends on it: a message is code 1
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)


def _take_paths(ours: list[str], pythonpath: str) -> None:
    """Puts the child's ``PYTHONPATH`` in ``sys.path`` where the server's (``ours``) was,
    after the current directory, as a new interpreter in the child's directory would have:
    a test's stage may import its own copy of a module the server never imported."""
    theirs = [os.path.abspath(p) for p in pythonpath.split(os.pathsep) if p]
    if ours == theirs:
        return
    kept = [p for p in sys.path[1:] if p not in ours]
    sys.path[1:] = [*theirs, *kept]
    importlib.invalidate_caches()
