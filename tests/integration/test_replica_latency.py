"""Shares follow the network: replicas of (2, 2) on separate "hosts" (network
namespaces on a bridge). Replica "slow" has each of its stages on a host of its own
behind a slow link, so each activation and gradient between its stages waits, which no
compute speed shows. The stages report how long their replica's pipeline takes
(``pipeline_s``); the coordinator adds what its prediction missed to the replica's step
time, and the policy moves micro-batches away from the slow replica. The losses and
weights stay ``LocalPipeline``'s, bit for bit, through the re-split.

Each slow host sends through a cable that holds every frame 20 ms
(``tests.support.delay_wire``, two TAP devices and a process: what ``tc qdisc add ... netem
delay 20ms`` on the host's interface does; this kernel has no ``netem``), so every hop of
the slow replica's activations and gradients, and every message it sends the client and
the other replica, arrives 20 ms late."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import torch

from elasticpipe import LocalPipeline, Pipeline
from elasticpipe.client.admin import Admin
from tests.support.netns import Hosts, hosts, wait_for_log

__all__ = ["hosts"]  # the fixture

pytestmark = pytest.mark.timeout(240)

SUBNET = "10.78.0"
COORDINATOR = f"{SUBNET}.1:7100"
DELAY_S = 0.020  # on every frame a slow host sends
JOB = {
    "model": "mlp",
    "model_kwargs": {"sizes": [16, 16, 16, 16, 4]},  # 2.5 KB of gradients
    "seed": 3,
    "micro_batches": 8,
    "optimizer": "adamw",
}
STEPS = 14


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(700 + step)
    rows = 256  # 32 a micro-batch: 2 KB activations
    return torch.randn(rows, 16, generator=g), torch.randint(0, 4, (rows,), generator=g)


def test_shares_move_away_from_a_replica_behind_a_slow_link(hosts: Hosts, tmp_path: Path) -> None:
    hosts.join(f"{SUBNET}.100")  # the client: this process
    coordinator_log = tmp_path / "coordinator.log"
    coordinator = hosts.spawn(
        hosts.add("coord", f"{SUBNET}.1"),
        [
            *("coordinator", "--listen", "0.0.0.0:7100", "--insecure"),
            *("--state", str(tmp_path / "coordinator.sqlite")),
            *("--heartbeat-interval", "0.2", "--policy-interval", "0.3"),
            *("--rebalance-cooldown", "0", "--rebalance-horizon", "100000"),
        ],
        coordinator_log,
    )
    wait_for_log(coordinator_log, "coordinator_listening", coordinator)
    places = [  # (host, its address, the replica its stages serve, their names)
        ("fast", f"{SUBNET}.11", "a-fast", ["fast-0", "fast-1"]),
        ("slow0", f"{SUBNET}.21", "b-slow", ["slow-0"]),
        ("slow1", f"{SUBNET}.22", "b-slow", ["slow-1"]),
    ]
    stages = []
    for host, address, replica, names in places:
        ns = hosts.add(host, address, delay_s=DELAY_S if host.startswith("slow") else 0.0)
        for port, name in enumerate(names, start=7201):
            log = tmp_path / f"{name}.log"
            args = ["stage", "--coordinator", COORDINATOR, "--listen", f"{address}:{port}"]
            args += ["--name", name, "--replica", replica, "--insecure"]
            stages.append((log, hosts.spawn(ns, args, log)))
    for log, proc in stages:
        wait_for_log(log, "stage_registered", proc)
    for _, address, _, _ in places[1:]:  # a TCP handshake waits for the host's SYN-ACK
        started = time.perf_counter()
        socket.create_connection((address, 7201), timeout=5).close()
        assert time.perf_counter() - started >= DELAY_S, address

    local = LocalPipeline(**JOB)  # type: ignore[arg-type]
    want = [local.train_step(*_batch(step)) for step in range(STEPS)]
    with Pipeline(COORDINATOR, **JOB, stages=(2, 2), step_timeout=60) as pipe:  # type: ignore[arg-type]
        losses, shares = [], []
        for step in range(STEPS):
            losses.append(pipe.train_step(*_batch(step)))
            shares.append(pipe.layout.shares)
            time.sleep(0.3)  # heartbeats carry the pipelines' times; the policy re-plans
        state = pipe.state_dict()
        with Admin(COORDINATOR) as admin:
            resplits = [r for r in admin.status().history if r.kind == "shares"]
    logs = "\n".join(p.read_text(errors="replace")[-1500:] for p in tmp_path.glob("*.log"))
    # Away from the slow link, further than compute speeds alone take them (measured
    # without the pipelines' times: (5, 3)), and they stay there (between (7, 1) and
    # (6, 2): the estimates of the two are within the policy's noise).
    assert resplits and all(r.reason.startswith("auto: shares") for r in resplits), resplits
    moved = next((i for i, s in enumerate(shares) if s[1] <= 2), None)
    assert moved is not None and moved < STEPS // 2, (shares, logs)
    assert all(s[1] <= 2 for s in shares[moved:]), (
        f"{shares} {[r.reason for r in resplits]}\n{logs}"
    )
    assert losses == want
    for name, value in local.state_dict().items():
        assert torch.equal(state[name], value), name
