"""Closing a client's channels never hangs the process: grpcio's ``Channel.close`` waits
forever for a call whose start a ``KeyboardInterrupt`` cut short (Ctrl-C in the demo, one
time in a few), so ``rpc.close_channel`` waits a bounded time and leaves such a channel to
the process's exit."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

# A real gRPC server on loopback whose GetStats never answers (a call stays in flight),
# and a StagePool whose call to it is interrupted exactly where Ctrl-C can land in grpcio:
# after the call is registered, before the thread that would see it end is started.
SCRIPT = textwrap.dedent(
    """
    import threading, time
    from concurrent import futures
    import grpc
    from grpc import _channel
    from elasticpipe.transport import rpc
    from elasticpipe.v1 import stage_pb2, stage_pb2_grpc

    class Silent(stage_pb2_grpc.StageServiceServicer):
        def GetStats(self, request, context):
            release.wait(60)
            return stage_pb2.StageStats()

    release = threading.Event()
    server = grpc.server(futures.ThreadPoolExecutor(2))
    stage_pb2_grpc.add_StageServiceServicer_to_server(Silent(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    address = f"127.0.0.1:{port}"
    pool = rpc.StagePool()
    stub = pool.stub(address)

    def interrupted(state):
        raise KeyboardInterrupt  # as SIGINT would, inside grpcio's call start

    spin, _channel._run_channel_spin_thread = _channel._run_channel_spin_thread, interrupted
    try:
        stub.GetStats.future(stage_pb2.StatsRequest(), timeout=60)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    _channel._run_channel_spin_thread = spin
    rpc.CLOSE_WAIT_S = WAIT_S
    channel = pool._channels[address]
    started = time.monotonic()
    pool.close()  # as Pipeline.close closes the stages' channels
    print(f"close took {time.monotonic() - started:.2f}", flush=True)
    # left open, and kept from the collector (grpcio would close it again, unbounded)
    print("kept", rpc._CLOSING.get(id(channel)) is channel, flush=True)
    del channel
    release.set()
    server.stop(0)
    """
)


@pytest.mark.timeout(60)
def test_a_channel_whose_close_hangs_is_left_and_the_process_exits() -> None:
    wait_s = 1.0
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", f"WAIT_S = {wait_s}\n{SCRIPT}"],
        capture_output=True,
        text=True,
        timeout=45,
        check=False,
    )
    took = time.monotonic() - started
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "interrupted", done.stdout
    # grpcio's close really hangs here, and the pool's close gave up on it after the bound
    # (if a grpcio release fixes the hang, this says so: the bounded wait could then go)
    close_s = float(lines[1].split()[-1])
    assert wait_s <= close_s < wait_s + 2.0, done.stdout
    assert lines[2] == "kept True", done.stdout
    assert "channel_close_abandoned" in done.stdout + done.stderr
    assert took < 30, f"the process took {took:.1f}s to exit after the close was abandoned"
