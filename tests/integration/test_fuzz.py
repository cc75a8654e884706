"""Every RPC of every service fuzzed: well-formed messages with extreme values (generated
from the descriptors, so a new RPC is fuzzed without new code) and garbage bytes, sent by
unauthenticated, wrong-role and right-role callers while a training job runs beside them.

What must hold: the job's result stays exact; no server dies or answers UNKNOWN or
INTERNAL; a wrong role always gets PERMISSION_DENIED; each server's peak resident memory
stays under ``RSS_BOUND``.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import os
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

from elasticpipe import authz, models, rpc, tls
from elasticpipe.client.pipeline import Pipeline
from elasticpipe.cluster import LocalCluster
from elasticpipe.training import make_optimizer, reference_step
from elasticpipe.v1 import coordinator_pb2, stage_pb2

pytestmark = pytest.mark.timeout(600)

SERVICES = [
    stage_pb2.DESCRIPTOR.services_by_name["StageService"],
    coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"],
]
METHODS = [m for s in SERVICES for m in s.methods]
RSS_BOUND = 1536 << 20  # bytes of peak resident memory per server process
CALL_TIMEOUT_S = 2.0
PER_METHOD = int(os.environ.get("ELASTICPIPE_FUZZ_PER_METHOD", "6"))  # messages per method, caller
KWARGS = {"sizes": [8, 16, 16, 4]}
BAD = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


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
    channel: grpc.Channel, method: MethodDescriptor, payloads: list[bytes]
) -> grpc.StatusCode:
    """Calls ``method`` with raw request bytes; returns the status code it ended with."""
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
            for _ in zip(range(8), call(request, timeout=CALL_TIMEOUT_S), strict=False):
                pass
        else:
            call(request, timeout=CALL_TIMEOUT_S)
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[attr-defined, no-any-return]
    return grpc.StatusCode.OK


def _payloads(data: st.DataObject, method: MethodDescriptor, garbage: bool) -> list[bytes]:
    if garbage:
        return [data.draw(st.binary(min_size=1, max_size=256))]
    n = data.draw(st.integers(1, 3)) if method.client_streaming else 1
    return [data.draw(messages(method.input_type)).SerializeToString() for _ in range(n)]


def _wrong_role(method: MethodDescriptor) -> str | None:
    allowed = authz.ALLOWED[f"{method.containing_service.name}/{method.name}"]
    wrong = [r for r in tls.ROLES if r not in allowed]
    return wrong[0] if wrong else None


def _right_role(method: MethodDescriptor) -> str:
    return sorted(authz.ALLOWED[f"{method.containing_service.name}/{method.name}"])[0]


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
    with LocalCluster(stages=2, tls=True, coordinator_args=["--no-auto-rebalance"]) as c:
        yield c


@pytest.fixture(scope="module")
def target() -> Iterator[LocalCluster]:
    """A TLS cluster with an idle job, for callers of the right role."""
    with LocalCluster(stages=2, tls=True, coordinator_args=["--no-auto-rebalance"]) as c:
        with Pipeline(
            coordinator=c.coordinator, model="mlp", model_kwargs=KWARGS, tls=c.client_tls
        ) as pipe:
            pipe.train_step(torch.randn(4, 8), torch.randint(0, 4, (4,)))
        yield c


def _servers(cluster: LocalCluster) -> dict[str, str]:
    """Service full name -> the addresses serving it."""
    return {
        SERVICES[0].full_name: ",".join(cluster.stage_addresses),
        SERVICES[1].full_name: cluster.coordinator,
    }


@settings(max_examples=1, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_fuzzing_every_rpc_breaks_no_server_and_no_job(
    busy: LocalCluster, target: LocalCluster, data: st.DataObject
) -> None:
    """While a job trains on one cluster, every RPC of both services gets generated and
    garbage requests: unauthenticated and wrong-role callers on the busy cluster (all
    refused: PERMISSION_DENIED for a wrong role), right-role callers on the other. No
    answer is UNKNOWN or INTERNAL, every server survives, memory stays bounded, and the
    job's result equals single-process training."""
    reference = models.build("mlp", seed=0, **KWARGS)
    opt = make_optimizer("adam", reference.parameters(), {"lr": 1e-2})
    g = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(30)
    ]
    stop, done = threading.Event(), threading.Event()
    losses: list[tuple[float, float]] = []
    errors: list[BaseException] = []

    def train() -> None:
        try:
            with Pipeline(
                coordinator=busy.coordinator,
                model="mlp",
                model_kwargs=KWARGS,
                optimizer_kwargs={"lr": 1e-2},
                tls=busy.client_tls,
            ) as pipe:
                for x, y in batches:
                    if stop.is_set():
                        break
                    losses.append(
                        (
                            pipe.train_step(x, y),
                            reference_step(reference, opt, "cross_entropy", x, y),
                        )
                    )
                state = pipe.state_dict()
            for key, value in reference.state_dict().items():
                torch.testing.assert_close(state[key], value)
        except BaseException as exc:
            errors.append(exc)
        finally:
            done.set()

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    tmp = Path(busy.log_dir) / "foreign-ca"
    tls.init_ca(tmp)
    foreign = tls.TLS(*(str(p) for p in tls.issue(tmp, "mallory", "admin")), str(tmp / "ca.pem"))
    jobs: list[tuple[str, MethodDescriptor, grpc.Channel, list[bytes]]] = []
    channels: dict[tuple[str, str], grpc.Channel] = {}

    def channel(address: str, who: tls.TLS | None, key: str) -> grpc.Channel:
        if (address, key) not in channels:
            channels[(address, key)] = rpc.channel(address, who)
        return channels[(address, key)]

    for method in METHODS:
        busy_addresses = _servers(busy)[method.containing_service.full_name].split(",")
        target_addresses = _servers(target)[method.containing_service.full_name].split(",")
        wrong = _wrong_role(method)
        right = _right_role(method)
        for i in range(PER_METHOD):
            garbage = i == PER_METHOD - 1
            address = busy_addresses[i % len(busy_addresses)]
            payloads = _payloads(data, method, garbage)
            jobs.append(("plaintext", method, channel(address, None, "none"), payloads))
            jobs.append(("foreign", method, channel(address, foreign, "foreign"), payloads))
            if wrong is not None:
                who = busy.tls_of(f"fuzz-{wrong}", wrong)
                jobs.append(("wrong", method, channel(address, who, wrong), payloads))
            address = target_addresses[i % len(target_addresses)]
            who = target.tls_of(f"fuzz-{right}", right)
            jobs.append(("right", method, channel(address, who, right), payloads))
    with cf.ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda job: (job[0], job[1], _call(job[2], job[1], job[3])), jobs))
    counts: dict[str, int] = {}
    for caller, method, code in results:
        counts[caller] = counts.get(caller, 0) + 1
        assert code not in BAD, f"{caller} caller got {code.name} from {method.full_name}"
        if caller in ("plaintext", "foreign"):
            assert code == grpc.StatusCode.UNAVAILABLE, (caller, method.full_name, code)
        if caller == "wrong":
            assert code == grpc.StatusCode.PERMISSION_DENIED, (method.full_name, code)
    assert done.wait(300), "the job did not finish"
    stop.set()
    trainer.join(10)
    assert not errors, errors
    for got, want in losses:
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want))
    peaks = {}
    for cluster in (busy, target):
        for name, proc in cluster.procs.items():
            assert proc.poll() is None, f"{name} died"
            peaks[name] = _peak_rss(proc.pid)
        assert _serving(cluster.coordinator, cluster.admin_tls)
        for address in cluster.stage_addresses:
            assert _serving(address, cluster.admin_tls)
    assert max(peaks.values()) < RSS_BOUND, peaks
    print(
        f"\nfuzzed {len(METHODS)} RPCs with {len(results)} requests {counts}; "
        f"peak RSS {max(peaks.values()) / 2**20:.0f} MiB (bound {RSS_BOUND / 2**20:.0f} MiB)"
    )
