"""Profiling a new job's stages: one profile per host and device, shared by the stages there.

Stages on one host that compute on the same device (``"cpu"``, or the same ``cuda:N``)
run the same kernels on the same hardware, and are profiled one at a time anyway (each
would slow the others down: ``concurrency.by_host``). So one of them, the first in the
chain, profiles the model; the others take its figures, its seconds scaled by their
emulated slowdown over its own (``--slowdown``, asked with ``GetStats``; 1 without one).
Four CPU stages on one host profile once instead of four times, and their speeds come out
equal (before, the turns of one host measured each other's leftovers, and the planner cut
the same hosts differently from run to run). A host's stages whose devices differ (a GPU
and the CPU, two GPUs) are each profiled. The live measurements of the first steps then
correct any stage that is not what its host's profile says (a pinned slow core).
"""

from __future__ import annotations

import time
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
STAGE_CALL_TIMEOUT_S = 120.0
STATS_TIMEOUT_S = 10.0


def sharing(chosen: Sequence[Member]) -> dict[str, str]:
    """Each stage's profiler: the first stage (in ``chosen``'s order) on its host with its
    device, by stage id."""
    first: dict[tuple[str, str], str] = {}
    return {
        m.row.stage_id: first.setdefault(
            (split_address(m.row.address)[0], m.row.device), m.row.stage_id
        )
        for m in chosen
    }


def profile_stages(
    cluster: Cluster, job: JobConfig, sample: Value, chosen: Sequence[Member]
) -> Profile:
    """The job's profile on ``chosen``: each host-and-device's first stage profiles the
    model (``Profile``), the others share its figures, scaled by their slowdowns.

    Raises:
        ElasticPipeError: a stage failed to profile, or to say its slowdown.
    """
    spec = job.to_proto()
    bundle.set_sample(spec, sample)
    by = sharing(chosen)
    profilers = [m for m in chosen if by[m.row.stage_id] == m.row.stage_id]
    request = stage_pb2.ProfileRequest(job=spec, repeats=PROFILE_REPEATS)
    started = time.monotonic()
    replies = concurrency.by_host(
        [m.row.address for m in profilers],
        lambda address: cluster.pool.call(address, "Profile", request, STAGE_CALL_TIMEOUT_S),
        PROFILE_HOSTS_AT_ONCE,
    )
    measured = {m.row.stage_id: reply for m, reply in zip(profilers, replies, strict=True)}
    slowdowns = _slowdowns(cluster, chosen) if len(profilers) < len(chosen) else {}
    profiles: dict[str, list[Timing]] = {}
    needs: dict[str, list[tuple[int, int]]] = {}
    for member in chosen:
        sid, source = member.row.stage_id, by[member.row.stage_id]
        scale = slowdowns[sid] / slowdowns[source] if sid != source else 1.0
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
        profiled=len(profilers),
        **({"shared": shared} if shared else {}),
    )
    return profile


def _slowdowns(cluster: Cluster, chosen: Sequence[Member]) -> dict[str, float]:
    """Each stage's emulated slowdown, asked now (a heartbeat's may be a beat old)."""
    probe = stage_pb2.StatsRequest()
    replies = cluster.pool.each(
        [(m.row.address, probe) for m in chosen], "GetStats", STATS_TIMEOUT_S
    )
    found = {}
    for member, reply in zip(chosen, replies, strict=True):
        if isinstance(reply, ElasticPipeError):
            raise reply
        found[member.row.stage_id] = reply.slowdown if reply.slowdown > 0 else 1.0
    return found
