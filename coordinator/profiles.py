"""Profiling a new job's stages: one profile per host for its CPU stages, shared by them.

CPU stages on one host run the same kernels on the same cores, and are profiled one at a
time anyway (each would slow the others down: ``concurrency.by_host``). So one of them,
the first in the chain, profiles the model; the others take its figures, its seconds
scaled by their emulated slowdown over its own (``--slowdown``, asked with ``GetStats``
before and after; 1 without one). Four CPU stages on one host profile once instead of
four times, and their speeds come out equal (before, the turns of one host measured each
other's leftovers, and the planner cut the same hosts differently from run to run). A
stage on a GPU profiles for itself: ``cuda:0`` names a different GPU in each process
that sees another one (``CUDA_VISIBLE_DEVICES``, MIG slices). The live measurements of the
first steps then correct a CPU stage that is not what its host's profile says (one pinned
to fewer or slower cores).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence

from elasticpipe.coordinator import concurrency
from elasticpipe.coordinator.membership import Member
from elasticpipe.coordinator.planning import estimates
from elasticpipe.coordinator.planning.estimates import Profile, Timing
from elasticpipe.coordinator.state import Cluster
from elasticpipe.errors import ElasticPipeError
from elasticpipe.logs import get_logger
from elasticpipe.training.job import JobConfig
from elasticpipe.transport.serving import split_address
from elasticpipe.v1 import stage_pb2
from elasticpipe.wire import bundle
from elasticpipe.wire.structure import Value

__all__ = ["profile_stages", "sharing"]

log = get_logger(__name__)

PROFILE_REPEATS = 5
# Stages sharing a host are profiled one at a time (they would slow each other down);
# this many hosts at once.
PROFILE_HOSTS_AT_ONCE = 16
STAGE_CALL_TIMEOUT_S = 120.0  # a job's set-up calls to a stage (Profile, Assign, ...)
STATS_TIMEOUT_S = 10.0


def sharing(chosen: Sequence[Member]) -> dict[str, str]:
    """Each stage's profiler, by stage id: for CPU stages, the first stage (in ``chosen``'s
    order) on its host; a stage on any other device profiles for itself (a device string
    such as ``cuda:0`` does not tell which GPU it is: each process may see another one)."""
    first: dict[str, str] = {}
    return {
        m.row.stage_id: first.setdefault(split_address(m.row.address)[0], m.row.stage_id)
        if m.row.device == "cpu"
        else m.row.stage_id
        for m in chosen
    }


def profile_stages(
    cluster: Cluster, job: JobConfig, sample: Value, chosen: Sequence[Member]
) -> Profile:
    """The job's profile on ``chosen``: each host's first CPU stage profiles the model
    (``Profile``) for the host's CPU stages, which share its figures, scaled by their
    slowdowns; a stage whose slowdown (or whose profiler's) changed meanwhile is profiled
    after all.

    Raises:
        ElasticPipeError: a stage failed to profile, or to say its slowdown.
    """
    spec = job.to_proto()
    bundle.set_sample(spec, sample)
    request = stage_pb2.ProfileRequest(job=spec, repeats=PROFILE_REPEATS)
    by = sharing(chosen)
    group_size = Counter(by.values())
    sharers = [m for m in chosen if group_size[by[m.row.stage_id]] > 1]
    before = _slowdowns(cluster, sharers)
    started = time.monotonic()
    measured = _profiled(
        cluster, request, [m for m in chosen if by[m.row.stage_id] == m.row.stage_id]
    )
    after = _slowdowns(cluster, sharers)
    changed = {s for s in after if after[s] != before[s]}
    if changed:  # (an ``admin slowdown`` while the host was profiled): their own figures
        redo = [m for m in sharers if m.row.stage_id in changed or by[m.row.stage_id] in changed]
        measured.update(_profiled(cluster, request, redo))
        by.update({m.row.stage_id: m.row.stage_id for m in redo})
    profiles: dict[str, list[Timing]] = {}
    needs: dict[str, list[tuple[int, int]]] = {}
    for member in chosen:
        sid, source = member.row.stage_id, by[member.row.stage_id]
        scale = after[sid] / after[source] if sid != source else 1.0
        timings = measured[source].timings
        profiles[sid] = [
            (t.forward_s * scale, t.backward_s * scale, t.output_bytes, t.samples) for t in timings
        ]
        needs[sid] = [(t.stash_bytes, t.state_bytes) for t in timings]
    profile = estimates.from_profiles(profiles, needs)
    shared = {cluster.name(s): cluster.name(p) for s, p in by.items() if s != p}
    log.info(
        "stages_profiled",
        speeds={cluster.name(s): round(v, 3) for s, v in profile.speeds.items()},
        seconds=round(time.monotonic() - started, 3),
        profiled=len(measured),
        **({"shared": shared} if shared else {}),
    )
    return profile


def _profiled(
    cluster: Cluster, request: stage_pb2.ProfileRequest, members: Sequence[Member]
) -> dict[str, stage_pb2.ProfileResponse]:
    """Each member's own profile (a host's members one at a time), by stage id."""
    replies = concurrency.by_host(
        [m.row.address for m in members],
        lambda address: cluster.pool.call(address, "Profile", request, STAGE_CALL_TIMEOUT_S),
        PROFILE_HOSTS_AT_ONCE,
    )
    return {m.row.stage_id: reply for m, reply in zip(members, replies, strict=True)}


def _slowdowns(cluster: Cluster, members: Sequence[Member]) -> dict[str, float]:
    """Each member's emulated slowdown, asked now (a heartbeat's may be a beat old)."""
    if not members:
        return {}
    probe = stage_pb2.StatsRequest()
    replies = cluster.pool.each(
        [(m.row.address, probe) for m in members], "GetStats", STATS_TIMEOUT_S
    )
    found = {}
    for member, reply in zip(members, replies, strict=True):
        if isinstance(reply, ElasticPipeError):
            raise reply
        found[member.row.stage_id] = reply.slowdown if reply.slowdown > 0 else 1.0
    return found
