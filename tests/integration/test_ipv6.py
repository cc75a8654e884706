"""IPv6: a cluster on [::1] trains; a plaintext [::] listen is refused without --insecure;
a wildcard [::] listen advertises the host's address, never loopback."""

from __future__ import annotations

import ipaddress
import socket

import pytest
import torch

from elasticpipe import models
from elasticpipe.coordinator.config import CoordinatorConfig
from elasticpipe.coordinator.planning.policy import PolicyConfig
from elasticpipe.coordinator.server import CoordinatorServer
from elasticpipe.errors import InvalidRequest
from elasticpipe.stage_server.stage import StageConfig
from elasticpipe.training.objectives import make_optimizer, reference_step
from elasticpipe.transport import serving
from tests.support import jobs
from tests.support.servers import stage_servers

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not socket.has_ipv6, reason="this Python has no IPv6 support"),
]
KWARGS = {"sizes": [6, 8, 3]}


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback (::1) on this host")
def test_a_cluster_on_ipv6_loopback_trains() -> None:
    """Coordinator and stages on [::1]:0 advertise bracketed IPv6 addresses, and a client
    trains through them like on IPv4."""
    with CoordinatorServer(
        CoordinatorConfig("[::1]:0", policy=PolicyConfig(enabled=False), heartbeat_interval_s=0.2)
    ) as coordinator:
        assert coordinator.address.startswith("[::1]:")
        configs = [StageConfig(name=f"v6-{i}") for i in range(2)]
        with stage_servers(coordinator.address, configs, listen="[::1]:0") as stages:
            for stage in stages:
                assert stage.address.startswith("[::1]:")
            reference = models.build("mlp", seed=0, **KWARGS)
            opt = make_optimizer("adam", reference.parameters(), {"lr": 1e-2})
            x, y = torch.randn(4, 6), torch.randint(0, 3, (4,))
            with jobs.mlp(
                coordinator.address,
                **KWARGS,
                optimizer_kwargs={"lr": 1e-2},
                micro_batches=1,
                stages=2,
            ) as pipe:
                assert all(a.startswith("[::1]:") for a in pipe.partition.addresses)
                got = pipe.train_step(x, y)
            torch.testing.assert_close(
                torch.tensor(got),
                torch.tensor(reference_step(reference, opt, "cross_entropy", x, y)),
            )


def test_plaintext_on_the_ipv6_wildcard_is_refused_without_insecure() -> None:
    """Listening on [::] without TLS needs --insecure, said in one line."""
    with pytest.raises(InvalidRequest, match="without TLS") as info:
        serving.start_server("[::]:0", [])
    assert "--insecure" in str(info.value) and "\n" not in str(info.value)


def test_the_ipv6_wildcard_advertises_a_routable_address() -> None:
    """A [::] listen (plaintext, --insecure) advertises this host's IPv6 address from the
    default route or its only interface -- never loopback."""
    try:
        expected = serving.primary_address(ipv6=True)
    except InvalidRequest as exc:
        pytest.skip(f"this host has no single non-loopback IPv6 address: {exc}")
    try:
        server = serving.start_server("[::]:0", [], insecure=True)
    except InvalidRequest as exc:
        pytest.skip(f"cannot listen on [::] here: {exc}")
    try:
        host, port = serving.split_address(server.address)
        assert not ipaddress.ip_address(host).is_loopback
        assert host == expected and port > 0
        assert server.address == f"[{host}]:{port}"
    finally:
        server.stop()
