"""Every RPC of every service fuzzed: well-formed messages with extreme values (generated
from the descriptors, so a new RPC is fuzzed without new code) and garbage bytes, sent by
unauthenticated, wrong-role and right-role callers to the cluster whose job is training.

What must hold: the job's result is bit for bit that of the same job trained on the same
cluster without the traffic; no server dies or answers UNKNOWN or INTERNAL; every wrong
role of every method gets PERMISSION_DENIED; every right-role method gets past
authorisation at least once; each server's peak resident memory stays under ``RSS_BOUND``
although the traffic streams several times that bound through the stages.

Right-role callers send every method except those that change the job by design
(``JOB_CHANGING``): an authorised coordinator may freeze or move layers, an admin may
rebalance or drain, a client may commit or restore, and a stage or client may inject
activations into the data path -- the threat model trusts those roles with that. The
client data path and its job-changing calls are also where client generations are being
bound to callers, so they are fuzzed here only as wrong-role and unauthenticated calls.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elasticpipe.local.cluster import LocalCluster
from elasticpipe.security import authz, tls
from elasticpipe.transport import rpc
from elasticpipe.v1 import coordinator_pb2, stage_pb2, stage_pb2_grpc, tensor_pb2
from tests.support import jobs

pytestmark = pytest.mark.timeout(600)

SERVICES = [
    stage_pb2.DESCRIPTOR.services_by_name["StageService"],
    coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"],
]
METHODS = [m for s in SERVICES for m in s.methods]
RSS_BOUND = 1024 << 20  # bytes of peak resident memory per server process
CALL_TIMEOUT_S = 2.0
BIG_TIMEOUT_S = 60.0
PER_METHOD = int(os.environ.get("ELASTICPIPE_FUZZ_PER_METHOD", "4"))  # per method and caller
STEPS = 10
CHUNK = 1 << 20
# Big streams: each declares BIG_CHUNKS + 4 MiB and sends BIG_CHUNKS, BIG_AT_ONCE at a time,
# BIG_ROUNDS times: 3 x 8 x 8 = 192 MiB through stage 0, whose resident memory may grow by
# at most half of that (what a stage that kept what it read could not do).
BIG_CHUNKS, BIG_AT_ONCE = 8, 3
BIG_ROUNDS = int(os.environ.get("ELASTICPIPE_FUZZ_BIG_ROUNDS", "8"))
JOB_CHANGING = frozenset(
    {
        # stage control (coordinator): moves, freezes, fences or slows the job
        "StageService/Assign",
        "StageService/Freeze",
        "StageService/PrepareEpoch",
        "StageService/CommitEpoch",
        "StageService/AbortEpoch",
        "StageService/Fence",
        "StageService/SetSlowdown",
        "StageService/Profile",  # not a change, but it competes for the stages' CPU
        "StageService/CommitStep",
        "StageService/AbortStep",
        # the data path and the client's step calls (inject or consume a run's tensors)
        "StageService/Forward",
        "StageService/Backward",
        "StageService/Targets",
        "StageService/Deliver",
        "StageService/RunStep",
        "StageService/FetchOutput",
        "StageService/RestoreLayers",
        "StageService/InjectFault",
        # membership, leases and runs (stage, client)
        "CoordinatorService/Register",
        "CoordinatorService/Leave",
        "CoordinatorService/ResolveRun",
        "CoordinatorService/SetupJob",
        "CoordinatorService/RenewLease",
        "CoordinatorService/ReportFailure",
        "CoordinatorService/ProfileJob",
        "CoordinatorService/BeginRestore",
        "CoordinatorService/EndRestore",
        # admin commands that act
        "CoordinatorService/Rebalance",
        "CoordinatorService/SetPartition",
        "CoordinatorService/Drain",
        "CoordinatorService/Undrain",
        "CoordinatorService/Slowdown",
        "CoordinatorService/SetAutoRebalance",
        "CoordinatorService/Forget",
    }
)
KWARGS = {"sizes": [8, 16, 16, 4]}
BAD = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}

STRANGER = bytes(16)  # a 16-byte run secret, not the run's (every data header carries one)


# ---- messages from descriptors -----------------------------------------------------------

_INTS = {
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
}
_STRINGS = st.sampled_from(
    ["", "mlp", "gpt", "os:system", "../../etc/passwd", "\x00", "x" * 5000, "🙂" * 64]
) | st.text(max_size=40)


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    if field.type in _INTS:
        lo, hi = _INTS[field.type]
        edges = [lo, hi, 0, 1, 2, hi // 2, (1 << 40) + 1, min(hi, 2**32)]
        return st.sampled_from([e for e in edges if lo <= e <= hi]) | st.integers(lo, hi)
    if field.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        edges = [0.0, -0.0, 1.0, -1.0, 1e308, -1e308, math.inf, -math.inf, math.nan, 1e-300]
        if field.type == FieldDescriptor.TYPE_FLOAT:
            edges = [0.0, 1.0, -1.0, 3e38, math.inf, -math.inf, math.nan]
        return st.sampled_from(edges) | st.floats(width=32 if len(edges) == 7 else 64)
    if field.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if field.type == FieldDescriptor.TYPE_STRING:
        return _STRINGS
    if field.type == FieldDescriptor.TYPE_BYTES:
        return st.sampled_from([b"", b"\x00" * 4096, b"\xff" * 17]) | st.binary(max_size=512)
    if field.type == FieldDescriptor.TYPE_ENUM:
        return st.integers(-3, 12)  # unknown values included
    raise AssertionError(f"unhandled field type {field.type}")


def messages(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    """Messages of ``descriptor`` with any subset of fields set to extreme values."""
    cls = GetMessageClass(descriptor)
    parts: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if depth >= 3:
                continue
            one = messages(field.message_type, depth + 1)
        else:
            one = _scalar(field)
        parts[field.name] = st.lists(one, max_size=5) if field.is_repeated else one

    def build(values: dict[str, Any]) -> Message:
        message = cls()
        for name, value in values.items():
            target = getattr(message, name)
            field = descriptor.fields_by_name[name]
            if field.is_repeated:
                if field.type == FieldDescriptor.TYPE_MESSAGE:
                    for item in value:
                        target.add().CopyFrom(item)
                else:
                    target.extend(value)
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                target.CopyFrom(value)
            else:
                setattr(message, name, value)
        return message

    return st.fixed_dictionaries({}, optional=parts).map(build)


# ---- calling any method with any bytes -----------------------------------------------------


def _call(
    channel: grpc.Channel,
    method: MethodDescriptor,
    payloads: list[bytes],
    timeout: float = CALL_TIMEOUT_S,
) -> tuple[grpc.StatusCode, str]:
    """Calls ``method`` with raw request bytes; returns the status it ended with."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    ident: Callable[[bytes], bytes] = lambda b: b  # noqa: E731
    kinds = (method.client_streaming, method.server_streaming)
    factory = {
        (False, False): channel.unary_unary,
        (True, False): channel.stream_unary,
        (False, True): channel.unary_stream,
        (True, True): channel.stream_stream,
    }[kinds]
    call = factory(path, request_serializer=ident, response_deserializer=ident)
    request: Any = iter(payloads) if method.client_streaming else payloads[0]
    try:
        if method.server_streaming:
            for _ in zip(range(8), call(request, timeout=timeout), strict=False):
                pass
        else:
            call(request, timeout=timeout)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""  # type: ignore[attr-defined]
    return grpc.StatusCode.OK, ""


def _payloads(data: st.DataObject, method: MethodDescriptor, garbage: bool) -> list[bytes]:
    if garbage:
        return [data.draw(st.binary(min_size=1, max_size=256))]
    n = data.draw(st.integers(1, 3)) if method.client_streaming else 1
    return [data.draw(messages(method.input_type)).SerializeToString() for _ in range(n)]


def _row(method: MethodDescriptor) -> str:
    return f"{method.containing_service.name}/{method.name}"


def _wrong_roles(method: MethodDescriptor) -> list[str]:
    return [r for r in tls.ROLES if r not in authz.ALLOWED[_row(method)]]


def _right_roles(method: MethodDescriptor) -> list[str]:
    """The roles that fuzz ``method`` on the training cluster (none for job-changing ones)."""
    return [] if _row(method) in JOB_CHANGING else sorted(authz.ALLOWED[_row(method)])


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _serving(address: str, who: tls.TLS | None) -> bool:
    stub = health_pb2_grpc.HealthStub(rpc.channel(address, who))
    reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=10, wait_for_ready=True)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def busy() -> Iterator[LocalCluster]:
    """A TLS cluster whose training job must come out exact."""
    with LocalCluster(stages=2, tls=True, auto_rebalance=False) as c:
        yield c


def _servers(cluster: LocalCluster) -> dict[str, list[str]]:
    """Service full name -> the addresses serving it."""
    return {
        SERVICES[0].full_name: cluster.stage_addresses,
        SERVICES[1].full_name: [cluster.coordinator],
    }


def _train(
    cluster: LocalCluster,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    started: Callable[[], None] = lambda: None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The job: the same seed, data and chain every time, so runs agree bit for bit;
    ``started`` is called once the job is set up, before its first step."""
    with jobs.mlp(
        cluster.coordinator,
        **KWARGS,
        optimizer_kwargs={"lr": 1e-2},
        micro_batches=2,
        stages=2,
        tls=cluster.client_tls,
    ) as pipe:
        started()
        losses = [pipe.train_step(x, y) for x, y in batches]
        return losses, pipe.state_dict()


def _big_forward(header: stage_pb2.DataHeader) -> list[bytes]:
    """A Forward stream that declares 4 MiB more than it sends: the stage admits it,
    assembles every chunk, then refuses it (and must free it all)."""
    declared = (BIG_CHUNKS + 4) * CHUNK
    first = stage_pb2.DataHeader()
    first.CopyFrom(header)
    first.meta.CopyFrom(
        tensor_pb2.TensorMeta(dtype=tensor_pb2.FLOAT32, shape=[declared // 4], nbytes=declared)
    )
    chunk = stage_pb2.DataChunk(data=bytes(range(256)) * (CHUNK // 256)).SerializeToString()
    return [stage_pb2.DataChunk(header=first).SerializeToString()] + [chunk] * BIG_CHUNKS


def _big_stream_calls(
    cluster: LocalCluster, channel: Callable[[str, tls.TLS | None, str], grpc.Channel]
) -> list[tuple[str, MethodDescriptor, grpc.Channel, Callable[[], list[bytes]]]]:
    """Many-chunk streams: right-role Forwards the stage reads to the end (a run of a client
    generation the job never reaches, in the epoch the stage is at when the stream starts),
    and wrong-role PushSnapshots of as many chunks."""
    stage = cluster.stage_addresses[0]
    admin = stage_pb2_grpc.StageServiceStub(channel(stage, cluster.admin_tls, "admin"))

    def payloads() -> list[bytes]:
        stats = admin.GetStats(stage_pb2.StatsRequest(), timeout=10)
        return _big_forward(
            stage_pb2.DataHeader(
                secret=STRANGER, epoch=stats.epoch, run=(stats.state.fence + 8) << 40
            )
        )

    forward = SERVICES[0].methods_by_name["Forward"]
    push = SERVICES[0].methods_by_name["PushSnapshot"]
    who = channel(stage, cluster.tls_of("fuzz-stage", "stage"), "stage")
    wrong = channel(stage, cluster.tls_of("fuzz-client", "client"), "client")
    calls = [("big", forward, who, payloads) for _ in range(BIG_AT_ONCE * BIG_ROUNDS)]
    calls += [("wrong", push, wrong, payloads) for _ in range(BIG_AT_ONCE)]
    return calls


@settings(max_examples=1, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_fuzzing_every_rpc_breaks_no_server_and_no_job(
    busy: LocalCluster, data: st.DataObject
) -> None:
    """While a job trains, every RPC of both services gets generated and garbage requests
    on its cluster: from unauthenticated callers and a foreign CA (refused), from every
    wrong role (PERMISSION_DENIED), from every right role (past authorisation, job-changing
    RPCs left out), plus big many-chunk streams. No answer is UNKNOWN or INTERNAL, every
    server survives, memory stays bounded, and the job's losses and weights equal bit for
    bit those of the same job trained before without the traffic."""
    g = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g))
        for _ in range(STEPS)
    ]
    want_losses, want_state = _train(busy, batches)  # the same job, no traffic

    tmp = Path(tempfile.mkdtemp(prefix="foreign-ca-", dir=busy.log_dir))
    tls.init_ca(tmp)
    foreign = tls.TLS(*(str(p) for p in tls.issue(tmp, "mallory", "admin")), str(tmp / "ca.pem"))
    channels: dict[tuple[str, str], grpc.Channel] = {}

    def channel(address: str, who: tls.TLS | None, key: str) -> grpc.Channel:
        if (address, key) not in channels:
            channels[(address, key)] = rpc.channel(address, who)
        return channels[(address, key)]

    jobs: list[tuple[str, MethodDescriptor, grpc.Channel, Any]] = []
    for method in METHODS:
        addresses = _servers(busy)[method.containing_service.full_name]
        for i in range(PER_METHOD):
            garbage = i == PER_METHOD - 1
            address = addresses[i % len(addresses)]
            payloads = _payloads(data, method, garbage)
            if i < 2:
                jobs.append(("plaintext", method, channel(address, None, "none"), payloads))
                jobs.append(("foreign", method, channel(address, foreign, "foreign"), payloads))
            for role in _wrong_roles(method) if i in (0, PER_METHOD - 1) else ():
                who = busy.tls_of(f"fuzz-{role}", role)
                jobs.append(("wrong", method, channel(address, who, role), payloads))
            for role in _right_roles(method):
                who = busy.tls_of(f"fuzz-{role}", role)
                jobs.append(("right", method, channel(address, who, role), payloads))

    stop = threading.Event()
    results: list[tuple[str, MethodDescriptor, grpc.StatusCode, str]] = []

    def send(job: tuple[str, MethodDescriptor, grpc.Channel, Any]) -> None:
        payloads = job[3] if isinstance(job[3], list) else job[3]()  # big ones: made now
        timeout = BIG_TIMEOUT_S if len(payloads) > 3 else CALL_TIMEOUT_S
        results.append((job[0], job[1], *_call(job[2], job[1], payloads, timeout)))

    def traffic() -> None:
        """Every call once, then the right-role ones again until the job is done."""
        with cf.ThreadPoolExecutor(max_workers=BIG_AT_ONCE + 1) as pool:
            list(pool.map(send, jobs + _big_stream_calls(busy, channel)))
            again = [j for j in jobs if j[0] == "right"]
            while not stop.is_set():
                list(pool.map(send, again[:16]))
                again = again[16:] + again[:16]

    sender = threading.Thread(target=traffic, name="fuzz-traffic", daemon=True)
    stage0 = busy.procs["stage-0"].pid
    baseline = _peak_rss(stage0)  # after the reference job: what the bound leaves room for
    try:
        got_losses, got_state = _train(busy, batches, sender.start)
    finally:
        stop.set()
        sender.join(120)
    assert not sender.is_alive(), "the traffic did not stop"

    assert got_losses == want_losses  # floats compared exactly
    assert want_state.keys() == got_state.keys()
    for key, value in want_state.items():
        assert torch.equal(got_state[key], value), key

    counts: dict[str, int] = {}
    read = 0  # big streams the stage read to the end
    passed: set[str] = set()
    denied: dict[tuple[str, str], int] = {}
    for caller, method, code, details in results:
        counts[caller] = counts.get(caller, 0) + 1
        assert code not in BAD, f"{caller} caller got {code.name} from {method.full_name}"
        if caller in ("plaintext", "foreign"):
            assert code == grpc.StatusCode.UNAVAILABLE, (caller, method.full_name, code)
        if caller == "wrong":
            assert code == grpc.StatusCode.PERMISSION_DENIED, (method.full_name, code)
            role = details.split("'")[1]  # "role 'client' (fuzz-client) may not call ..."
            denied[(_row(method), role)] = denied.get((_row(method), role), 0) + 1
        if caller == "right" and code != grpc.StatusCode.PERMISSION_DENIED:
            passed.add(_row(method))
        if caller == "big" and code == grpc.StatusCode.INVALID_ARGUMENT:
            assert f"for a tensor declared as {(BIG_CHUNKS + 4) * CHUNK} bytes" in details
            read += 1
        elif caller == "big":  # the epoch moved on between GetStats and the header
            assert code == grpc.StatusCode.FAILED_PRECONDITION, (code, details)
            assert details.startswith("stale epoch"), details
    every_wrong = {(_row(m), r) for m in METHODS for r in _wrong_roles(m)}
    assert set(denied) == every_wrong, every_wrong - set(denied)
    right = {_row(m) for m in METHODS if _right_roles(m)}
    assert passed == right, right - passed
    assert {"StageService/PushSnapshot", "CoordinatorService/Heartbeat"} <= right

    admin = stage_pb2_grpc.StageServiceStub(rpc.channel(busy.stage_addresses[0], busy.admin_tls))
    epoch = admin.GetStats(stage_pb2.StatsRequest(), timeout=10).epoch
    peaks = {}
    for name, proc in busy.procs.items():
        assert proc.poll() is None, f"{name} died"
        peaks[name] = _peak_rss(proc.pid)
    assert _serving(busy.coordinator, busy.admin_tls)
    for address in busy.stage_addresses:
        assert _serving(address, busy.admin_tls)
    assert max(peaks.values()) < RSS_BOUND, peaks
    assert read >= counts.get("big", 0) / 2, (read, counts)
    streamed = read * BIG_CHUNKS * CHUNK
    grown = peaks["stage-0"] - baseline
    assert grown < streamed / 2 or streamed == 0, (grown, streamed)
    print(
        f"\nfuzzed {len(METHODS)} RPCs with {len(results)} requests {counts} "
        f"({len(right)} methods by right roles, {len(every_wrong)} method x wrong role pairs); "
        f"the job ended at epoch {epoch}; "
        f"{streamed / 2**20:.0f} MiB streamed; peak RSS {max(peaks.values()) / 2**20:.0f} MiB "
        f"(bound {RSS_BOUND / 2**20:.0f} MiB; stage 0 grew {grown / 2**20:.0f} MiB)"
    )
