"""Stage names as an operator meets them on real processes: a second stage under a name in
use is refused and the holder is left alone (also one that advertises the holder's own
address), a restart elsewhere or on its own port is a new incarnation at once, ``admin
forget NAME`` removes that name's dead incarnations, a stage that left on SIGTERM shows as
``left``, and ``admin status`` lists live stages first, with their ids."""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter
from collections.abc import Iterator

import jsonschema
import pytest

from elasticpipe.cli.schemas import command_schema
from elasticpipe.client.admin import StageInfo
from elasticpipe.local.cluster import LocalCluster
from tests.support import cli
from tests.support.scenario import batch, pipeline

pytestmark = pytest.mark.timeout(240)

DEAD_AFTER_S = 20.0  # long: a restart must not wait for the old incarnation to be missed
RESTARTED: list[str] = []  # the spare the restart test restarts, which later tests use


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """Four stages; silence counts only after 20 s; rebalancing only on request."""
    with LocalCluster(
        stages=4,
        auto_rebalance=False,
        heartbeat_s=0.2,
        dead_after_s=DEAD_AFTER_S,
    ) as c:
        yield c


def incarnations(cluster: LocalCluster, name: str) -> list[StageInfo]:
    """Every incarnation of ``name`` in the status, oldest first."""
    return sorted(
        (s for s in cluster.status().stages if s.name == name), key=lambda s: s.incarnation
    )


def _second_stage(
    cluster: LocalCluster, holder: StageInfo, *args: str
) -> subprocess.CompletedProcess[str]:
    """``elasticpipe stage`` under the live ``holder``'s name on a new port (``args`` added),
    run to its end within 60 s."""
    return cli.elasticpipe(
        "stage",
        *("--coordinator", cluster.coordinator, "--name", holder.name, "--listen", "127.0.0.1:0"),
        *args,
        timeout=60,
    )


def _assert_refusal_names(second: subprocess.CompletedProcess[str], holder: StageInfo) -> None:
    """The refused stage's last line says its name is in use, naming the holder's name, id,
    address and last heartbeat."""
    last = second.stderr.strip().splitlines()[-1]
    assert last.startswith("error: stage name"), second.stderr[-2000:]
    for named in (holder.name, holder.stage_id, holder.address, "last heartbeat"):
        assert named in last, last


def test_a_second_stage_under_a_name_in_use_is_refused_and_the_holder_is_untouched(
    cluster: LocalCluster,
) -> None:
    """``elasticpipe stage --name X`` while X runs elsewhere exits non-zero with a message
    naming the holder's id, address and last heartbeat; X stays the one incarnation of
    its name, in the chain, with no recovery and no rollback, and training goes on."""
    with pipeline(cluster, stages=2) as pipe:
        pipe.train_step(*batch(1))
        holder = cluster.status().stages[1]
        assert holder.state == "chain", holder
        epoch = pipe.partition.epoch
        # Within 60 s: it used to run on, knocking the holder out again and again.
        second = _second_stage(cluster, holder)
        assert second.returncode != 0, second.stderr[-2000:]
        _assert_refusal_names(second, holder)
        pipe.train_step(*batch(2))
        assert pipe.step == 2 and pipe.partition.epoch == epoch
        (still,) = incarnations(cluster, holder.name)
        assert (still.stage_id, still.state, still.alive) == (holder.stage_id, "chain", True)
        kinds = [r.kind for r in cluster.status().history]
        assert "recovery" not in kinds, kinds
    assert "stage_name_refused" in (cluster.log_dir / "coordinator.log").read_text()


def test_a_second_stage_advertising_the_holders_address_is_refused(
    cluster: LocalCluster,
) -> None:
    """A second process under a live stage's name that advertises the holder's own address
    (``--advertise``, as behind NAT or from a copied unit file) is not taken for the
    holder's restart: the probe finds the holder answering as itself, so the second exits
    with code 2 naming it, and the holder stays the one live incarnation of its name."""
    holder = cluster.status().stages[1]
    assert holder.alive, holder
    # Within 60 s: it used to run on, the two knocking each other out.
    second = _second_stage(cluster, holder, "--advertise", holder.address)
    assert second.returncode == 2, second.stderr[-2000:]
    _assert_refusal_names(second, holder)
    (still,) = incarnations(cluster, holder.name)
    assert (still.stage_id, still.alive) == (holder.stage_id, True)
    assert "recovery" not in [r.kind for r in cluster.status().history]


def test_a_stage_restarted_on_its_own_port_is_a_new_incarnation_at_once(
    cluster: LocalCluster,
) -> None:
    """A stage SIGKILLed and started again on the very same address, long before its
    silence would count: the probe there finds no process or one that is no incarnation
    yet, so the restart registers as the next incarnation and the old one is dead."""
    stage = next(s for s in cluster.status().stages if s.state == "spare" and s.alive)
    cluster.kill(stage.name)
    started = time.monotonic()
    cluster.add_stage(stage.name, extra=["--listen", stage.address])  # the last one counts
    while len(rows := incarnations(cluster, stage.name)) < 2:  # the old row still looks alive
        assert time.monotonic() - started < DEAD_AFTER_S / 2, rows
        time.sleep(0.1)
    old, new = rows
    assert (old.stage_id, old.state, old.alive) == (stage.stage_id, "dead", False)
    assert (new.address, new.incarnation, new.state) == (
        stage.address,
        old.incarnation + 1,
        "spare",
    )


def test_a_stage_restarted_elsewhere_before_it_is_missed_is_a_new_incarnation_at_once(
    cluster: LocalCluster,
) -> None:
    """A stage SIGKILLed and started again on another port, long before its silence would
    count: the old address no longer answers, so the restart registers within seconds as
    the next incarnation, and the old one is dead."""
    stages = cluster.status().stages
    # Counted in one status: rows of two calls differ in their heartbeat times.
    registered = Counter(s.name for s in stages)
    once = [s.name for s in stages if s.state == "spare" and registered[s.name] == 1]
    name = once[-1]  # not the one the previous test restarted
    RESTARTED.append(name)
    cluster.kill(name)
    started = time.monotonic()
    address = cluster.add_stage(name)
    assert time.monotonic() - started < DEAD_AFTER_S / 2
    old, new = incarnations(cluster, name)
    assert (old.state, old.alive) == ("dead", False)
    assert (new.address, new.incarnation, new.state) == (address, old.incarnation + 1, "spare")


def test_forget_by_name_removes_its_dead_incarnations_and_keeps_the_live_one(
    cluster: LocalCluster,
) -> None:
    """``admin forget NAME``, when a replacement holds the name, forgets the dead old
    incarnations (naming their ids) rather than refusing because the name is alive; once
    only the live one is left, forget refuses, naming it."""
    (name,) = RESTARTED
    before = incarnations(cluster, name)
    dead = [s.stage_id for s in before if s.state == "dead"]
    live = [s.stage_id for s in before if s.alive]
    assert dead and len(live) == 1, before
    forgot = cli.admin(cluster, "forget", name, after=True)
    assert forgot.returncode == 0, forgot.stderr
    assert all(sid in forgot.stdout for sid in dead), forgot.stdout
    assert [s.stage_id for s in incarnations(cluster, name)] == live
    again = cli.admin(cluster, "forget", name, after=True)
    assert again.returncode == 2 and "alive" in again.stderr and live[0] in again.stderr


def test_a_stage_that_left_on_sigterm_is_left_not_dead(cluster: LocalCluster) -> None:
    """SIGTERM on a chain stage (its layers move off first) and on a spare: both exit 0
    and show as ``left`` in admin status and --json (valid against the schema), not as
    dead stages that missed their heartbeats; training goes on, exact in its step count."""
    (spare,) = RESTARTED  # registered last: the new job's spare
    with pipeline(cluster, stages=3) as pipe:
        pipe.train_step(*batch(1))
        chain_stage = cluster.name_of(pipe.partition.addresses[2])
        assert spare not in (cluster.name_of(a) for a in pipe.partition.addresses)
        assert cluster.terminate(chain_stage) == 0
        assert cluster.terminate(spare) == 0
        pipe.train_step(*batch(2))
        assert pipe.step == 2 and len(pipe.partition.addresses) == 2
    deadline = time.monotonic() + 10  # well before their silence could count (20 s)
    while {incarnations(cluster, n)[-1].state for n in (chain_stage, spare)} != {"left"}:
        assert time.monotonic() < deadline, cluster.status()
        time.sleep(0.2)
    shown = cli.admin(cluster, "status", "--json", after=True)
    assert shown.returncode == 0, shown.stderr
    answer = json.loads(shown.stdout)
    jsonschema.validate(answer, command_schema("status"))
    newest = {s["name"]: s for s in sorted(answer["stages"], key=lambda s: s["incarnation"])}
    assert newest[chain_stage]["state"] == newest[spare]["state"] == "left", newest
    table = cli.admin(cluster, "status", after=True).stdout.splitlines()
    gone_at = next(i for i, line in enumerate(table) if line.startswith("gone"))
    gone_rows = [line for line in table[gone_at + 2 :] if line.strip()]
    assert any(line.startswith(chain_stage) and " left " in line for line in gone_rows)
    live_rows = [line for line in table[:gone_at] if line.startswith("stage-")]
    assert live_rows and all(" left " not in r and " dead " not in r for r in live_rows)


def test_status_shows_ids_a_dash_for_unmeasured_speed_and_one_step(cluster: LocalCluster) -> None:
    """During a job: every row names its incarnation's id, a spare's speed is "-" (not
    0.000), and the job's committed step is shown once, not as per-stage values that
    heartbeats report at different moments."""
    with pipeline(cluster, stages=1) as pipe:
        for step in range(1, 4):
            pipe.train_step(*batch(step))
        deadline = time.monotonic() + 10
        while (status := cluster.status()).committed_step != 3:  # the next heartbeats
            assert time.monotonic() < deadline, status
            time.sleep(0.1)
        table = cli.admin(cluster, "status", after=True).stdout.splitlines()
    assert "step: 3" in table[0]
    for st in status.stages:
        row = next(line for line in table if st.stage_id in line)
        assert row.startswith(st.name), row
        if st.state == "spare":
            cells = row.split()
            assert cells[cells.index(st.device) + 1] == "-", row
    header = next(line for line in table if line.startswith("name"))
    assert "step" not in header.split(), header
