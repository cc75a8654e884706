"""Where servers listen and what they advertise: the default route's address first, and
the plaintext metrics endpoint kept on loopback unless the operator says otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticpipe.errors import InvalidRequest
from elasticpipe.transport import serving

ROUTE = (
    "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"
    "tun0\t0000000A\t00000000\t0001\t0\t0\t0\t000000FF\t0\t0\t0\n"  # a VPN's 10.0.0.0/8
    "eth1\t00000000\t0101A8C0\t0003\t0\t0\t200\t00000000\t0\t0\t0\n"  # default, metric 200
    "eth0\t00000000\t010200C0\t0003\t0\t0\t100\t00000000\t0\t0\t0\n"  # default, metric 100
    "eth2\t00000000\t010200C0\t0002\t0\t0\t0\t00000000\t0\t0\t0\n"  # not up
)
IPV6_ROUTE = (
    "fd000000000000000000000000000000 40 "
    + "0" * 32
    + " 00 "
    + "0" * 32
    + " 00000100 00000002 00000000 00000001     eth0\n"
    + "0" * 32
    + " 00 "
    + "0" * 32
    + " 00 fd000000000000000000000000000001"
    " 00000400 00000003 00000000 00000003     eth0\n"
    + "0" * 32
    + " 00 "
    + "0" * 32
    + " 00 "
    + "0" * 32
    + " ffffffff 00000001 00000000 00200200       lo\n"
)
IF_INET6 = (
    "fe8000000000000000fc00fffe000001 04 40 20 80     eth0\n"
    "00000000000000000000000000000001 01 80 10 80       lo\n"
    "fd000000000000000000000000000002 04 40 00 82     eth0\n"
)


def test_the_default_route_with_the_lowest_metric_wins(tmp_path: Path) -> None:
    """A VPN route to 10/8 does not decide: the up default route of lowest metric does."""
    (tmp_path / "route").write_text(ROUTE)
    assert serving._default_interface(False, tmp_path) == "eth0"


def test_the_ipv6_default_route_gives_its_interfaces_global_address(tmp_path: Path) -> None:
    """The IPv6 default route's interface is found, and its global (not link-local)
    address is the one advertised."""
    (tmp_path / "ipv6_route").write_text(IPV6_ROUTE)
    (tmp_path / "if_inet6").write_text(IF_INET6)
    assert serving.default_route_address(True, tmp_path) == "fd00::2"


def test_no_default_route_gives_none(tmp_path: Path) -> None:
    """Without a default route (or without /proc) the probe and interfaces decide."""
    (tmp_path / "route").write_text(ROUTE.splitlines()[0] + "\n")
    assert serving.default_route_address(False, tmp_path) is None
    assert serving.default_route_address(True, tmp_path / "missing") is None


def test_metrics_beyond_loopback_need_an_explicit_choice() -> None:
    """Plain-HTTP metrics stay on a loopback listen host; beyond it only with
    --metrics-listen or --insecure."""
    assert serving.metrics_host("127.0.0.1:7100") == "127.0.0.1"
    assert serving.metrics_host("[::1]:7100") == "::1"
    with pytest.raises(InvalidRequest, match="--metrics-listen"):
        serving.metrics_host("0.0.0.0:7100")
    with pytest.raises(InvalidRequest, match=r"10\.0\.0\.5"):
        serving.metrics_host("10.0.0.5:7100")
    assert serving.metrics_host("0.0.0.0:7100", "127.0.0.1") == "127.0.0.1"
    assert serving.metrics_host("0.0.0.0:7100", insecure=True) == "0.0.0.0"
    assert serving.metrics_host("[::]:7100", "[::1]") == "::1"


@pytest.mark.parametrize(
    "address", ["127.0.0.1:7100", "localhost:1", "host-2.example.org:65535", "[::1]:7100"]
)
def test_a_dialable_address_is_accepted_unchanged(address: str) -> None:
    """HOST:PORT, and [ADDR]:PORT for IPv6, pass the check as they are."""
    assert serving.check_dial_address(address, "coordinator address") == address


@pytest.mark.parametrize(
    ("address", "says"),
    [
        ("", "no coordinator address given"),
        ("10.0.0.5", "has no port"),  # gRPC would dial 443
        ("10.0.0.5:", "has no port"),
        ("[::1]", "has no port"),
        ("http://10.0.0.5:7100", "without 'http://', e.g. '10.0.0.5:7100'"),
        ("grpc://h:7100/", "is a URL"),
        (":7100", "has no host"),
        ("h:0", "port 0 is not in [1, 65535]"),
        ("h:70000", "port 70000"),
        ("h:seven", "port 'seven' is not a number"),
        ("::1:7100", "put an IPv6 address in brackets"),
        ("h 1:7100", "is not HOST:PORT"),
    ],
)
def test_an_address_that_cannot_be_dialled_is_refused_naming_it(address: str, says: str) -> None:
    """What gRPC would misread (no port: port 443; a URL: "Misformatted domain name") is
    refused up front, the message naming the value and what is wrong with it."""
    with pytest.raises(InvalidRequest) as info:
        serving.check_dial_address(address, "coordinator address")
    assert says in str(info.value)
    assert repr(address) in str(info.value) or not address
