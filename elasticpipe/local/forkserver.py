"""A fork server for ``LocalCluster``: its coordinators and stages forked from one process
that has imported them already, instead of each starting Python and importing torch.

A new ``python -m elasticpipe stage`` spends 1.5 to 2 s of CPU importing torch and the
servers before it serves; a test's cluster of a coordinator and four stages spends 8 to 10 s,
most of a short test's time on two cores. With ``ELASTICPIPE_FORK_SERVER=1`` in the
environment (the test suite sets it: ``tests/conftest.py``), a ``LocalCluster`` forks them
instead, from a server it starts once per process and shares between its clusters.

The server (``elasticpipe/cli/forked.py``, in a Python of its own) imports the
``elasticpipe`` command's modules, torch with them, and reads requests on its standard
input, one JSON line each: ``{"id", "argv", "env", "cwd", "log"}``. For each it forks a
child, which

* starts a session of its own (as ``Popen(start_new_session=True)`` does: ``os.killpg`` of
  its pid reaches it and only it),
* takes ``env`` as its whole environment (its ``PYTHONPATH`` into ``sys.path`` too),
  ``cwd`` as its directory, ``/dev/null`` as its input and the file ``log`` (appended to)
  as its output and error,
* keeps the server's CPU affinity (the client's when it started the server), which a
  stage's ``--cpus`` narrows (``stage_server.cpus``),
* and runs ``elasticpipe *argv`` as ``python -m elasticpipe`` runs it, ending with its
  exit code.

The server answers ``{"id", "pid"}``, and ``{"exited": pid, "code"}`` when it reaps a child
(``code`` as ``Popen.returncode`` reads: negative for a signal). It exits when its input
closes (its client is gone); its children live on, as ``Popen``'s would.

A child is a real process: its own pid, memory, sockets and signals (SIGKILL, SIGTERM and
SIGSTOP reach it as they reach a spawned one). It starts as a new interpreter would, because
the server forks while it holds no gRPC channel or server and has run no torch kernel: its
one other thread, numpy's OpenBLAS thread server, is shut down around the fork by
OpenBLAS itself. What it inherits from the server and a spawned one would read afresh:

* the environment that libraries read when they were imported, before the child's was put
  in place: libgomp's ``OMP_NUM_THREADS`` (a stage sets its intra-op threads itself, from
  ``ELASTICPIPE_TORCH_THREADS``), and ``GRPC_VERBOSITY``, which the child sets again as the
  command's import does (gRPC reads it when it starts, in the child);
* the modules' import-time state (none depends on the environment but the above);
* its ``/proc/PID/cmdline`` and ``/proc/PID/environ``, the server's: ``pgrep -f`` does not
  find it by its command (the demo's tests, which look for the processes left, spawn them).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

ENV = "ELASTICPIPE_FORK_SERVER"  # "1": a LocalCluster forks its processes from the server
START_TIMEOUT_S = 60.0  # for the server's imports, on a loaded host


def enabled() -> bool:
    """Whether ``LocalCluster`` forks its processes (``ELASTICPIPE_FORK_SERVER=1``)."""
    return os.environ.get(ENV) == "1"


class ServerGone(subprocess.SubprocessError):
    """The fork server exited: its children's exit codes can no longer be known."""


class Forked:
    """A child of the fork server, with the part of ``subprocess.Popen`` that
    ``LocalCluster`` and its users use: ``pid``, ``poll``, ``wait``, ``returncode``.

    Unlike a ``Popen``'s child, it does not stay a zombie until waited for: the server reaps
    it at once, so a signal sent after it exited finds no process (``send_signal`` then
    does nothing, as ``Popen``'s does once it knows)."""

    def __init__(self, server: ForkServer, child: int, pid: int, args: Sequence[str]):
        self.pid = pid
        self.args = list(args)
        self._server = server
        self._child = child  # the request that forked it: unique, where a pid is reused

    @property
    def returncode(self) -> int | None:
        """The exit code once the child exited (negative: the signal that ended it)."""
        return self._server.exit_code(self._child)

    def poll(self) -> int | None:
        """The exit code, or None while the child runs."""
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Waits for the child to exit; returns its exit code.

        Raises:
            subprocess.TimeoutExpired: it still ran after ``timeout`` seconds.
            ServerGone: the server exited first.
        """
        return self._server.wait(self._child, self.args, timeout)

    def send_signal(self, sig: int) -> None:
        """Sends ``sig`` to the child (unless it has exited)."""
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # (exited, not yet reported)
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        """SIGTERM."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL."""
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The client of one fork server process: ``spawn`` forks a child of it."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from elasticpipe.cli.forked import serve; serve()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # a Ctrl-C in the terminal is the client's to handle
        )
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._stdin: IO[bytes] = self._proc.stdin
        self._stdout: IO[bytes] = self._proc.stdout
        self._lock = threading.Lock()  # one request written at a time
        self._changed = threading.Condition()
        self._forked: dict[int, int | str] = {}  # request id -> pid, or why it failed
        self._codes: dict[int, int] = {}  # request id -> the child's exit code
        self._abandoned: set[int] = set()  # requests whose spawn gave up waiting
        self._next = 0
        self.gone = False
        ready, _, _ = select.select([self._stdout], [], [], START_TIMEOUT_S)
        try:
            said = self._read() if ready else None
        except ValueError:  # (not JSON)
            said = None
        if said != {"ready": True}:
            self._proc.kill()
            self._proc.wait()
            raise RuntimeError(f"the fork server did not start (it said {said!r})")
        self._listener = threading.Thread(target=self._listen, name="fork-server", daemon=True)
        self._listener.start()

    def spawn(
        self, argv: Sequence[str], env: Mapping[str, str], log: Path, cwd: str | None = None
    ) -> Forked:
        """Forks ``elasticpipe *argv`` with the environment ``env``, its output appended
        to ``log``.

        Raises:
            RuntimeError: the server could not fork (naming why), or is gone.
        """
        with self._lock:
            self._next += 1
            request = self._next
            line = {
                "id": request,
                "argv": list(argv),
                "env": dict(env),
                "cwd": cwd or os.getcwd(),
                "log": str(log),
            }
            try:
                self._stdin.write(json.dumps(line).encode() + b"\n")
                self._stdin.flush()
            except OSError as exc:
                raise RuntimeError(f"the fork server is gone ({exc})") from exc
        with self._changed:
            if not self._changed.wait_for(
                lambda: request in self._forked or self.gone, START_TIMEOUT_S
            ):
                self._abandoned.add(request)  # forked later: killed at once
                raise RuntimeError(f"the fork server did not fork {list(argv)[:1]}")
            forked = self._forked.pop(request, "the fork server exited")
            if isinstance(forked, str):
                raise RuntimeError(f"cannot fork elasticpipe {' '.join(argv[:1])}: {forked}")
            return Forked(self, request, forked, ["elasticpipe", *argv])

    def exit_code(self, child: int) -> int | None:
        """A child's exit code, or None while it runs (``child``: its request)."""
        with self._changed:
            return self._codes.get(child)

    def wait(self, child: int, args: Sequence[str], timeout: float | None) -> int:
        """Waits for a child's exit code (``subprocess.TimeoutExpired`` after ``timeout``;
        ``ServerGone`` if the server exited first)."""
        with self._changed:
            if not self._changed.wait_for(lambda: child in self._codes or self.gone, timeout):
                raise subprocess.TimeoutExpired(list(args), timeout or 0.0)
            if child not in self._codes:
                raise ServerGone(f"the fork server exited before its child {args}")
            return self._codes[child]

    def close(self) -> None:
        """Ends the server (its children live on)."""
        with contextlib.suppress(OSError):
            self._stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._listener.join(timeout=10)  # (it reads the server's output to its end)
        self._stdout.close()

    def _read(self) -> dict[str, Any] | None:
        line = self._stdout.readline()
        return json.loads(line) if line else None

    def _listen(self) -> None:
        try:
            while (said := self._read()) is not None:
                with self._changed:
                    if "exited" in said:
                        self._codes[int(said["id"])] = int(said["code"])
                    elif int(said["id"]) in self._abandoned:  # its spawn timed out
                        with contextlib.suppress(KeyError, ProcessLookupError):
                            os.kill(int(said["pid"]), signal.SIGKILL)
                    else:
                        self._forked[int(said["id"])] = said.get("pid") or str(said["error"])
                    self._changed.notify_all()
        finally:  # (its output ended, or was not what the server writes)
            with self._changed:
                self.gone = True
                self._changed.notify_all()


_shared: dict[str, ForkServer] = {}  # "server": this process's
_shared_lock = threading.Lock()


def shared() -> ForkServer:
    """This process's fork server, started on first use and ended at exit."""
    with _shared_lock:
        server = _shared.get("server")
        if server is None or server.gone:
            server = _shared["server"] = ForkServer()
            atexit.register(server.close)
        return server
