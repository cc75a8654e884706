"""A coordinator address is checked as HOST:PORT where it is given -- Pipeline(coordinator=),
a stage's --coordinator, admin --coordinator -- before anything is dialled."""

from __future__ import annotations

import json

import pytest

from elasticpipe.cli.entry import build_parser
from elasticpipe.client.pipeline import Pipeline
from elasticpipe.errors import InvalidRequest
from elasticpipe.stage_server.server import StageServer
from elasticpipe.stage_server.stage import StageConfig
from tests.support import cli

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("address", "says"),
    [("10.0.0.5", "has no port"), ("http://10.0.0.5:7100", "without 'http://'")],
)
def test_a_pipeline_refuses_a_coordinator_address_it_cannot_dial(address: str, says: str) -> None:
    """Pipeline(coordinator=...) without a port or with a URL scheme raises InvalidRequest
    naming the address, instead of dialling port 443 or failing name resolution."""
    with pytest.raises(InvalidRequest, match="coordinator address") as info:
        Pipeline(coordinator=address, model="mlp")
    assert repr(address) in str(info.value) and says in str(info.value)


def test_a_stage_refuses_a_coordinator_address_it_cannot_dial(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`elasticpipe stage --coordinator HOST` is a usage error naming the value, and a
    StageServer built in code refuses it the same way."""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["stage", "--coordinator", "gpu-host"])
    assert exited.value.code == 2
    assert "coordinator address 'gpu-host' has no port" in capsys.readouterr().err
    with pytest.raises(InvalidRequest, match="'https://h:7100' is a URL"):
        StageServer(StageConfig(name="s"), "https://h:7100")


def test_admin_refuses_a_coordinator_address_it_cannot_dial() -> None:
    """`elasticpipe admin --json --coordinator http://HOST:PORT status` exits 2 with the
    JSON error object naming the value and the form to use."""
    done = cli.elasticpipe(
        "admin", "--json", "--coordinator", "http://127.0.0.1:7100", "status", timeout=60
    )
    assert done.returncode == 2, done.stderr
    error = json.loads(done.stdout)["error"]
    assert error["code"] == "INVALID_ARGUMENT"
    assert "'http://127.0.0.1:7100' is a URL" in error["message"]
    assert "e.g. '127.0.0.1:7100'" in error["message"]


def test_an_ipv6_coordinator_address_in_brackets_is_accepted() -> None:
    """[::1]:PORT passes every entry point's check (the IPv6 cluster test trains on it)."""
    args = build_parser().parse_args(["stage", "--coordinator", "[::1]:7100"])
    assert args.coordinator == "[::1]:7100"
    assert StageServer(StageConfig(name="s"), "[::1]:7100").coordinator == "[::1]:7100"
