"""bench/fake_stage.py answers every RPC of ``StageService``, and refuses to be built when the
service has an RPC it does not implement, naming it (so no bench can rot silently)."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType, SimpleNamespace

import pytest

from elasticpipe.transport import rpc
from elasticpipe.v1 import stage_pb2, stage_pb2_grpc
from tests.support import benches


@pytest.fixture(scope="module")
def fake_stage() -> Iterator[ModuleType]:
    """bench/fake_stage.py, imported as the benches import it (bench/ on sys.path)."""
    with benches.imported("fake_stage") as module:
        yield module


def test_the_fake_serves_every_rpc_of_the_service(fake_stage: ModuleType) -> None:
    """A fake stage lacks no RPC of the service, and its server answers ``OpenBulk`` (the RPC
    the fake once lacked) with port 0: no bulk channel, send over gRPC."""
    assert fake_stage.missing_rpcs(fake_stage.FakeStage) == []
    fake = fake_stage.FakeStage("fake-000", 0, "127.0.0.1:1", fake_stage.Counters())
    address = fake.serve()
    try:
        with rpc.channel(address) as channel:
            reply = stage_pb2_grpc.StageServiceStub(channel).OpenBulk(
                stage_pb2.OpenBulkRequest(), timeout=10
            )
        assert reply.port == 0 and not reply.token
    finally:
        fake.stop()


def test_a_fake_missing_an_rpc_is_refused_naming_it(fake_stage: ModuleType) -> None:
    """A fake stage class without ``OpenBulk`` raises at construction, naming that RPC."""

    class WithoutOpenBulk(fake_stage.FakeStage):  # type: ignore[name-defined,misc]
        OpenBulk = None

    with pytest.raises(TypeError, match=r"WithoutOpenBulk does not implement .*'s OpenBulk:"):
        WithoutOpenBulk("fake-000", 0, "127.0.0.1:1", fake_stage.Counters())
    assert fake_stage.missing_rpcs(WithoutOpenBulk) == ["OpenBulk"]


def test_an_rpc_new_in_the_service_fails_the_fake_loudly(
    fake_stage: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the service gains RPCs the fake does not know, building a fake raises a
    ``TypeError`` naming each of them."""
    service = stage_pb2.DESCRIPTOR.services_by_name["StageService"]
    grown = SimpleNamespace(
        full_name=service.full_name,
        methods=[*service.methods, SimpleNamespace(name="Teleport"), SimpleNamespace(name="Nap")],
    )
    monkeypatch.setattr(fake_stage, "SERVICE", grown)
    with pytest.raises(TypeError, match=r"StageService's Teleport, Nap: a fake stage must"):
        fake_stage.FakeStage("fake-000", 0, "127.0.0.1:1", fake_stage.Counters())
