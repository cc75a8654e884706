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
  (``certs`` included) parses with the real parser (``elasticpipe.cli.entry.build_parser``),
  under the environment its container gets (ELASTICPIPE_COORDINATOR, downward-API variables
  expanded as the kubelet does), plus the flags of PENDING_FLAGS.
* Mutual TLS on Kubernetes: the ``elasticpipe certs`` and ``kubectl create secret`` commands
  of docs/deploy.md are run (the certificates, into a temporary folder) and replayed (the
  Secrets): every Secret a pod mounts is made from one issued certificate with the role that
  pod needs, the certificates name what the manifests dial (the coordinator's Service, each
  stage's advertised name under the headless Service; gRPC's own hostname check is run on
  the stage certificate's wildcard) and the stage certificate's name covers every pod name.
  No pod holds an admin certificate, and every ``elasticpipe admin`` shown presents one.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import ipaddress
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
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any
from unittest import mock

import grpc
import jsonschema
import kubernetes_validate
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from dockerfile_parse import DockerfileParser

from elasticpipe.cli.entry import build_parser
from elasticpipe.security.tls import (
    DEFAULT_HOSTS,
    ENV_CA,
    ENV_CERT,
    ENV_KEY,
    ROLES,
    TLS,
    identity_of,
    name_matches,
)
from elasticpipe.transport.serving import metrics_host

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
COMPOSE_FILE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
DOCS = REPO / "docs" / "deploy.md"
SECURITY_DOCS = REPO / "docs" / "security.md"

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
# The environment variables that stand in for the --tls-* flags (and Pipeline's tls=).
TLS_ENV = {"tls_cert": ENV_CERT, "tls_key": ENV_KEY, "tls_ca": ENV_CA}
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
# The commands whose lines in docs/deploy.md are checked against the real parser.
_DOC_COMMANDS = (*_TAKE_ALL, "certs")

# Flags used by the deployment files that elasticpipe/cli/entry.py does not have yet: they are
# being added in parallel (issue 11). Each is added here to the real parser, for the
# commands named, so the command lines can be checked now. Once cli.py has a flag,
# test_pending_flags_are_still_pending fails: delete its line, and the real one is checked.
PENDING_FLAGS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    # flag: (commands that take it, how argparse reads it)
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


def _container_env(
    container: dict[str, Any], fields: dict[str, str] = FIELD_VALUES
) -> dict[str, str]:
    """The container's environment, downward-API fields taken from ``fields``."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = kubelet_expand(str(var["value"]), env)
        else:
            ref = var["valueFrom"]
            if "fieldRef" in ref:  # a field without a stand-in: some value
                path = ref["fieldRef"]["fieldPath"]
                env[var["name"]] = fields.get(path, f"<{path}>")
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


def _elasticpipe_argv(container: dict[str, Any]) -> list[str] | None:
    """The arguments of `elasticpipe` in a container of the image (through its entrypoint,
    or a ``command`` naming it); None when the container runs something else."""
    if _image_name(container["image"]) not in IMAGES:
        return None
    args = [str(a) for a in container.get("args", [])]
    if "command" not in container:
        return args
    command = [str(c) for c in container["command"]]
    if PurePosixPath(command[0]).name == "elasticpipe":
        return command[1:] + args
    return None


def _k8s_invocations(fields: dict[str, str] = FIELD_VALUES) -> list[Invocation]:
    found = []
    for where, pod in _pod_specs():
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            raw = _elasticpipe_argv(container)
            if raw is not None:
                env = _container_env(container, fields)
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


_SHELL_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")
_ASSIGNMENT = re.compile(r"(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(\S*)\s*(?:#.*)?")


def shell_expand(line: str, variables: dict[str, str]) -> str:
    """``$NAME`` and ``${NAME}`` of ``variables`` replaced as a shell does: not inside
    single quotes; other references stay as they are."""
    out, quote, i = [], "", 0
    while i < len(line):
        char = line[i]
        if char == "\\" and quote != "'":
            out.append(line[i : i + 2])
            i += 2
            continue
        if char == "$" and quote != "'":
            match = _SHELL_VAR.match(line, i)
            if match and (match.group(1) or match.group(2)) in variables:
                out.append(variables[match.group(1) or match.group(2)])
                i = match.end()
                continue
        if char in "'\"" and quote in ("", char):
            quote = "" if quote else char
        out.append(char)
        i += 1
    return "".join(out)


@dataclass
class ShellCommand:
    """One command of a document's shell blocks: continuation lines joined, the variables
    that the document's earlier lines assigned (``NAME=value``) expanded."""

    where: str
    words: list[str]
    variables: dict[str, str]


def shell_commands(path: Path) -> list[ShellCommand]:
    """The commands of ``path``'s bash/sh/console blocks, in order (one shell session)."""
    text = path.read_text(encoding="utf-8")
    variables: dict[str, str] = {}
    found = []
    for block in re.finditer(r"```(?:bash|sh|console)\n(.*?)```", text, re.DOTALL):
        first = text.count("\n", 0, block.start(1)) + 1
        lines = iter(enumerate(block.group(1).splitlines()))
        for number, line in lines:
            command = line
            while command.endswith("\\"):  # continued on the next line
                command = command[:-1] + " " + next(lines)[1]
            command = re.sub(r"^\s*\$\s+", "", command)  # a prompt
            if assignment := _ASSIGNMENT.fullmatch(command.strip()):
                value = shlex.split(shell_expand(assignment.group(2), variables))
                variables[assignment.group(1)] = value[0] if value else ""
                continue
            words = shlex.split(shell_expand(command, variables), comments=True)
            for operator in ("|", ">", ">>", "<", "&&", "||", ";"):  # the first command only
                if operator in words:
                    words = words[: words.index(operator)]
            if words:
                where = f"{path.relative_to(REPO)}:{first + number}"
                found.append(ShellCommand(where, words, dict(variables)))
    return found


def _elasticpipe_words(words: list[str]) -> list[str] | None:
    """The arguments of `elasticpipe` in a command line: run directly, or in a pod
    (``kubectl exec|run ... -- elasticpipe ...``)."""
    if words[0] == "kubectl" and "--" in words:
        words = words[words.index("--") + 1 :]
    if words and words[0] == "elasticpipe":
        return words[1:]
    return None


def _doc_invocations(path: Path = DOCS) -> list[Invocation]:
    """`elasticpipe coordinator|stage|admin|certs ...` lines of a document's shell blocks."""
    found = []
    for command in shell_commands(path):
        argv = _elasticpipe_words(command.words)
        if argv and argv[0] in _DOC_COMMANDS:
            env = {"ELASTICPIPE_COORDINATOR": "coordinator.example:7100", **command.variables}
            found.append(Invocation(command.where, argv, env, argv))
    return found


K8S_INVOCATIONS = _k8s_invocations()
K8S_SERVERS = [i for i in K8S_INVOCATIONS if i.argv[0] in _SERVERS]
COMPOSE_INVOCATIONS = _compose_invocations()


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def _all_parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """The parser and every (sub)subcommand's."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _all_parsers(sub)


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
    for sub in _all_parsers(parser):
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


def test_stages_are_a_statefulset_of_gpu_pods_advertising_their_dns_name() -> None:
    (stage,) = _by_command(K8S_INVOCATIONS, "stage")
    statefulset = _one("StatefulSet", "elasticpipe-stage")
    assert stage.container is not None and stage.pod is not None
    args = parse(stage)
    assert args.device == "cuda:0"
    resources = stage.container["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 1
    assert resources["requests"]["nvidia.com/gpu"] == 1
    # Stable names from the downward API: the pod's name is the stage's, and the stage
    # advertises the pod's DNS name under the headless governing Service (a certificate can
    # name it; pod IPs are not known when certificates are issued).
    fields = {
        v["name"]: v["valueFrom"]["fieldRef"]["fieldPath"]
        for v in stage.container["env"]
        if "fieldRef" in v.get("valueFrom", {})
    }
    raw = stage.raw_argv
    assert raw[raw.index("--name") + 1] == "$(POD_NAME)" and fields["POD_NAME"] == "metadata.name"
    service_name = statefulset["spec"]["serviceName"]
    port = args.listen.rsplit(":", 1)[1]
    advertise = raw[raw.index("--advertise") + 1]
    pattern = (
        rf"\$\(POD_NAME\)\.{re.escape(service_name)}\.\$\(POD_NAMESPACE\)\.svc"
        rf"(\.[a-z0-9-]+)*:{port}"
    )
    assert re.fullmatch(pattern, advertise), advertise
    assert fields["POD_NAMESPACE"] == "metadata.namespace"
    assert args.listen == "0.0.0.0:7200"
    assert args.name == FIELD_VALUES["metadata.name"]
    assert args.advertise.startswith(f"{args.name}.{service_name}.")
    # The governing Service is headless and publishes a pod's name before it is ready: a
    # stage registers, and is dialled, before its readiness probe passes.
    service = _one("Service", service_name)
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    # The coordinator is its Service, at its gRPC port.
    coordinator = _one("Service", "elasticpipe-coordinator")
    (grpc_port,) = [p for p in coordinator["spec"]["ports"] if p["name"] == "grpc"]
    assert args.coordinator == f"{coordinator['metadata']['name']}:{grpc_port['port']}"
    # SIGTERM drains the stage's layers first: the kubelet must wait for that.
    assert stage.pod["terminationGracePeriodSeconds"] > args.drain_timeout


@pytest.mark.parametrize("invocation", K8S_SERVERS, ids=lambda i: i.where)
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


@pytest.mark.parametrize("invocation", K8S_SERVERS, ids=lambda i: i.where)
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


@pytest.mark.parametrize("invocation", K8S_SERVERS, ids=lambda i: i.where)
def test_metrics_endpoint_placement_is_chosen_explicitly(invocation: Invocation) -> None:
    """A TLS server beyond loopback serves plaintext metrics only where --metrics-listen
    says (else it would refuse to start)."""
    args = parse(invocation)
    assert metrics_host(args.listen, args.metrics_listen, args.insecure) == "0.0.0.0"


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


def test_training_job_presents_its_client_certificate_through_the_environment() -> None:
    """Pipeline reads ELASTICPIPE_TLS_CERT/KEY/CA when it is given no tls=: the Job names
    the files of its mounted TLS Secret there, and train.py passes no tls= of its own."""
    job = _one("Job", "elasticpipe-train")
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = _container_env(container)
    for dest, variable in TLS_ENV.items():
        assert variable in env, f"the Job sets no {variable}"
        mount = _mount_of(container, env[variable])
        secret = _volume(pod, mount["name"])["secret"]
        assert secret["secretName"].endswith("-tls")
        assert PurePosixPath(env[variable]).relative_to(mount["mountPath"]) == PurePosixPath(
            TLS_KEYS[dest]
        )
    script = container["command"][1]
    config_map = _one(
        "ConfigMap", _volume(pod, _mount_of(container, script)["name"])["configMap"]["name"]
    )
    tree = ast.parse(config_map["data"][PurePosixPath(script).name])
    (call,) = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Pipeline"
    ]
    assert "tls" not in {k.arg for k in call.keywords}, "train.py overrides the Job's TLS env"


# ---- mutual TLS: the certificates and Secrets of docs/deploy.md ----------------------------


@dataclass(frozen=True)
class Issued:
    """A certificate that an `elasticpipe certs issue` line of the docs makes."""

    where: str
    folder: PurePosixPath
    name: str
    role: str
    hosts: tuple[str, ...]
    cert: PurePosixPath
    key: PurePosixPath


def _issued(path: Path = DOCS) -> list[Issued]:
    found = []
    for invocation in _doc_invocations(path):
        if invocation.argv[:2] == ["certs", "issue"]:
            args = parse(invocation)
            folder = PurePosixPath(args.dir)
            base = args.out or args.name
            found.append(
                Issued(
                    invocation.where,
                    folder,
                    args.name,
                    args.role,
                    tuple(args.host),
                    folder / f"{base}.pem",
                    folder / f"{base}.key",
                )
            )
    return found


def _ca_folders(path: Path = DOCS) -> set[PurePosixPath]:
    return {
        PurePosixPath(parse(i).dir)
        for i in _doc_invocations(path)
        if i.argv[:2] == ["certs", "init"]
    }


def _docs_namespace() -> str:
    """The namespace the docs' certificates are issued for (their NAMESPACE variable)."""
    (namespace,) = {
        c.variables.get("NAMESPACE", FIELD_VALUES["metadata.namespace"])
        for c in shell_commands(DOCS)
        if c.words[:3] == ["elasticpipe", "certs", "issue"]
    }
    return namespace


def _created_secrets(path: Path = DOCS) -> dict[str, dict[str, PurePosixPath]]:
    """``kubectl create secret generic NAME --from-file=KEY=FILE ...`` lines: NAME's files."""
    secrets: dict[str, dict[str, PurePosixPath]] = {}
    for command in shell_commands(path):
        words = command.words
        if words[:4] != ["kubectl", "create", "secret", "generic"]:
            continue
        rest = iter(words[4:])
        name, files = "", {}
        for word in rest:
            if word.startswith("--from-file"):
                value = word.split("=", 1)[1] if "=" in word else next(rest)
                key, _, file = value.rpartition("=")
                files[key or PurePosixPath(file).name] = PurePosixPath(file)
            elif not word.startswith("-") and not name:
                name = word
        assert name not in secrets, f"{command.where}: {name} is created twice"
        secrets[name] = files
    return secrets


def _secret_certificates() -> dict[str, Issued]:
    """Each Secret docs/deploy.md creates, with the certificate its tls.crt holds."""
    issued = {i.cert: i for i in _issued()}
    return {
        name: issued[files["tls.crt"]]
        for name, files in _created_secrets().items()
        if files.get("tls.crt") in issued
    }


@dataclass
class Party:
    """A process of the manifests that presents a certificate, and the role it needs."""

    where: str
    role: str
    pod: dict[str, Any]
    container: dict[str, Any]
    env: dict[str, str]
    args: argparse.Namespace | None  # its `elasticpipe` arguments; None: a training script
    files: dict[str, str | None]  # tls_cert, tls_key, tls_ca: from the flags or the env

    def secret_of(self, dest: str) -> tuple[str, PurePosixPath]:
        """The Secret the file ``dest`` is read from, and its key there."""
        path = self.files[dest]
        assert path, f"{self.where}: presents no certificate (--{dest.replace('_', '-')})"
        mount = _mount_of(self.container, path)
        volume = _volume(self.pod, mount["name"])
        assert "secret" in volume, f"{self.where}: {path} is not in a Secret"
        return volume["secret"]["secretName"], PurePosixPath(path).relative_to(mount["mountPath"])


def _parties(fields: dict[str, str] = FIELD_VALUES) -> list[Party]:
    """Every container of the images: `elasticpipe` servers and admin commands (the role
    of their command), training scripts (client)."""
    found = []
    for where, pod in _pod_specs():
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            if _image_name(container["image"]) not in IMAGES:
                continue
            env = _container_env(container, fields)
            raw = _elasticpipe_argv(container)
            args, flags = None, {}
            role = "client"
            if raw is not None:
                argv = [kubelet_expand(a, env) for a in raw]
                if argv[0] not in ROLES:
                    continue  # certs, demo: no certificate presented
                role = argv[0]
                args = parse(Invocation(where, argv, env, raw, pod, container))
                flags = {dest: getattr(args, dest, None) for dest in TLS_KEYS}
            files = {dest: flags.get(dest) or env.get(TLS_ENV[dest]) for dest in TLS_KEYS}
            found.append(
                Party(f"{where}/{container['name']}", role, pod, container, env, args, files)
            )
    return found


def _sans(cert: x509.Certificate) -> set[str]:
    alt = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {
        *alt.get_values_for_type(x509.DNSName),
        *map(str, alt.get_values_for_type(x509.IPAddress)),
    }


def covers(cert: x509.Certificate, host: str) -> bool:
    """Whether a TLS client dialling ``host`` accepts ``cert`` (RFC 6125: an IP address
    exactly; a DNS name exactly or by a wildcard for its whole leftmost label)."""
    alt = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    try:
        return ipaddress.ip_address(host.strip("[]")) in alt.get_values_for_type(x509.IPAddress)
    except ValueError:
        pass
    host = host.lower().rstrip(".")
    label, _, parent = host.partition(".")
    for name in (n.lower() for n in alt.get_values_for_type(x509.DNSName)):
        if name == host or (name.startswith("*.") and label and parent == name[2:]):
            return True
    return False


def _host(address: str) -> str:
    return address.rpartition(":")[0].strip("[]")


@pytest.fixture(scope="module")
def docs_certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder where docs/deploy.md's `elasticpipe certs` lines were run, as written
    (relative paths resolved in a temporary folder), by the real command."""
    root = tmp_path_factory.mktemp("docs-certs")
    ran = 0
    for invocation in _doc_invocations():
        if invocation.argv[0] == "certs":
            args = parse(invocation)
            args.dir = str(root / args.dir)
            with contextlib.redirect_stdout(io.StringIO()):
                assert args.func(args) == 0, invocation
            ran += 1
    assert ran, "docs/deploy.md issues no certificates"
    return root


def _load(root: Path, path: PurePosixPath) -> x509.Certificate:
    return x509.load_pem_x509_certificate((root / path).read_bytes())


def test_docs_make_each_tls_secret_from_one_issued_certificate() -> None:
    """Every Secret a pod mounts is created in docs/deploy.md, with tls.crt and tls.key
    from one `elasticpipe certs issue` and ca.crt from its folder's `certs init`."""
    issued = {i.cert: i for i in _issued()}
    created = _created_secrets()
    mounted = {
        volume["secret"]["secretName"]
        for _, pod in _pod_specs()
        for volume in pod.get("volumes", [])
        if "secret" in volume
    }
    assert mounted <= set(created), f"not created in docs/deploy.md: {mounted - set(created)}"
    assert set(created) <= mounted, f"created, but mounted by no pod: {set(created) - mounted}"
    for name, files in created.items():
        assert set(files) == set(TLS_KEYS.values()), name
        cert = issued.get(files["tls.crt"])
        assert cert is not None, f"{name}: {files['tls.crt']} is issued by no docs line"
        assert files["tls.key"] == cert.key, name
        assert files["ca.crt"] == cert.folder / "ca.pem", name
        assert cert.folder in _ca_folders(), f"{name}: no `elasticpipe certs init {cert.folder}`"


@pytest.mark.parametrize("party", _parties(), ids=lambda p: p.where)
def test_every_party_presents_a_certificate_of_its_role(party: Party) -> None:
    """Coordinator, stages and training scripts present the certificate of their role (the
    coordinator refuses any other: an `elasticpipe admin` in a pod needs an admin one)."""
    certificates = _secret_certificates()
    secrets = set()
    for dest, key in TLS_KEYS.items():
        secret, inside = party.secret_of(dest)
        assert inside == PurePosixPath(key), (party.where, dest)
        secrets.add(secret)
    (secret,) = secrets
    assert secret in certificates, f"{party.where}: {secret} holds no certificate of the docs"
    issued = certificates[secret]
    assert issued.role == party.role, (
        f"{party.where}: runs as {party.role} with {secret}, a {issued.role} certificate "
        f"({issued.where}): refused with PERMISSION_DENIED"
    )


def test_no_pod_holds_an_admin_certificate() -> None:
    certificates = _secret_certificates()
    for where, pod in _pod_specs():
        for volume in pod.get("volumes", []):
            name = volume.get("secret", {}).get("secretName")
            if name in certificates:
                assert certificates[name].role != "admin", f"{where} mounts {name}"
    admins = [i for i in _issued() if i.role == "admin"]
    assert admins, "docs/deploy.md issues no admin certificate for the operator"
    assert not {i.cert for i in admins} & {c.cert for c in certificates.values()}


def test_docs_admin_commands_present_an_admin_certificate() -> None:
    """`elasticpipe admin` accepts only the admin role: every one docs/deploy.md shows
    (directly or through kubectl) presents a certificate the docs issue as admin."""
    issued = [*_issued(DOCS), *_issued(SECURITY_DOCS)]
    admin_commands = _by_command(_doc_invocations(), "admin")
    assert admin_commands
    for invocation in admin_commands:
        cert = parse(invocation).tls_cert or invocation.env.get(ENV_CERT)
        assert cert, f"{invocation}: presents no certificate"
        roles = {i.role for i in issued if i.cert.name == PurePosixPath(cert).name}
        assert roles == {"admin"}, f"{invocation}: {cert} is not an admin certificate ({roles})"


def test_docs_certificates_are_what_the_docs_say(docs_certs: Path) -> None:
    """Each certificate the docs' commands made holds the name (CN), role (OU) and host
    names given, loopback, and a key that belongs to it; the CA signed it."""
    namespace = _docs_namespace()
    for issued in _issued():
        cert = _load(docs_certs, issued.cert)
        assert identity_of((docs_certs / issued.cert).read_bytes()) == (issued.name, issued.role)
        assert _sans(cert) == {*DEFAULT_HOSTS, *issued.hosts}, issued.where
        cert.verify_directly_issued_by(_load(docs_certs, issued.folder / "ca.pem"))
        key = serialization.load_pem_private_key((docs_certs / issued.key).read_bytes(), None)
        assert key.public_key().public_numbers() == cert.public_key().public_numbers()  # type: ignore[union-attr]
    # The Secrets' table says the same.
    text = DOCS.read_text(encoding="utf-8")
    certificates = _secret_certificates()
    rows = re.findall(r"^\| `(elasticpipe-[a-z-]+-tls)` \|[^|]*\|([^|]*)\|([^|]*)\|$", text, re.M)
    assert {row[0] for row in rows} == set(certificates)
    for secret, identity, hosts in rows:
        issued = certificates[secret]
        assert re.findall(r"`([^`]+)`", identity) == [issued.name, issued.role], secret
        named = {h.replace("NAMESPACE", namespace) for h in re.findall(r"`([^`]+)`", hosts)}
        assert named == set(issued.hosts), secret


def test_docs_certificates_name_what_the_manifests_dial(docs_certs: Path) -> None:
    """The coordinator's certificate names its Service as stages and clients dial it (and
    127.0.0.1, for a port forward); the stages' certificate covers the name each pod
    registers under and the DNS name it advertises, for every pod the StatefulSet makes."""
    namespace = _docs_namespace()
    certificates = _secret_certificates()

    def cert_of(party: Party) -> tuple[Issued, x509.Certificate]:
        issued = certificates[party.secret_of("tls_cert")[0]]
        return issued, _load(docs_certs, issued.cert)

    statefulset = _one("StatefulSet", "elasticpipe-stage")
    ordinals = [*range(statefulset["spec"]["replicas"]), 9, 10, 127]  # and scaled up
    dialled: set[str] = set()
    checked_stages = 0
    for ordinal in ordinals:
        pod_name = f"{statefulset['metadata']['name']}-{ordinal}"
        fields = {**FIELD_VALUES, "metadata.namespace": namespace, "metadata.name": pod_name}
        for party in _parties(fields):
            if party.role == "stage":
                assert party.args is not None
                issued, cert = cert_of(party)
                assert party.args.name == pod_name
                assert name_matches(issued.name, party.args.name), (issued.name, pod_name)
                host = _host(party.args.advertise)
                assert covers(cert, host), f"{issued.cert} does not name {host}"
                dialled.add(_host(party.args.coordinator))
                checked_stages += 1
            elif party.role == "client":
                dialled.add(_host(party.env["ELASTICPIPE_COORDINATOR"]))
            elif party.role == "coordinator":
                assert party.args is not None
                _, coordinator = cert_of(party)
                dialled.add(_host(party.args.advertise))
    assert checked_stages == len(ordinals)
    service = _one("Service", "elasticpipe-coordinator")["metadata"]["name"]
    dialled |= {
        service,
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.cluster.local",
        "127.0.0.1",  # kubectl port-forward
    }
    missing = sorted(host for host in dialled if not covers(coordinator, host))
    assert not missing, f"the coordinator's certificate does not name {missing}"


def test_grpc_accepts_the_stage_certificate_for_the_advertised_name(docs_certs: Path) -> None:
    """gRPC's own hostname check (not covers() above): the coordinator's certificate dials
    a stage by its advertised DNS name and accepts the stage certificate's wildcard, and
    refuses it for a name in another namespace."""
    namespace = _docs_namespace()
    certificates = _secret_certificates()
    fields = {**FIELD_VALUES, "metadata.namespace": namespace}
    (stage,) = [p for p in _parties(fields) if p.role == "stage"]
    (coordinator,) = [p for p in _parties(fields) if p.role == "coordinator"]

    def tls_of(party: Party) -> TLS:
        issued = certificates[party.secret_of("tls_cert")[0]]
        root = docs_certs / issued.folder
        return TLS(
            str(docs_certs / issued.cert), str(docs_certs / issued.key), str(root / "ca.pem")
        )

    assert stage.args is not None
    host = _host(stage.args.advertise)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    port = server.add_secure_port("127.0.0.1:0", tls_of(stage).server_credentials())
    server.start()
    try:
        codes = {}
        elsewhere = host.replace(f".{namespace}.", f".not-{namespace}.")
        for name in (host, elsewhere):
            options = [("grpc.ssl_target_name_override", name)]
            credentials = tls_of(coordinator).channel_credentials()
            with grpc.secure_channel(f"127.0.0.1:{port}", credentials, options) as channel:
                call = channel.unary_unary("/elasticpipe.test.Nothing/Here", bytes, bytes)
                try:
                    call(b"", timeout=10)
                except grpc.RpcError as exc:
                    codes[name] = exc.code()
    finally:
        server.stop(None)
    # UNIMPLEMENTED: the handshake passed and the server answered; UNAVAILABLE: it failed.
    assert codes == {
        host: grpc.StatusCode.UNIMPLEMENTED,
        elsewhere: grpc.StatusCode.UNAVAILABLE,
    }


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
    assert not arrived, f"now in elasticpipe/cli/entry.py, remove from PENDING_FLAGS: {arrived}"


def test_pending_flags_are_used() -> None:
    """PENDING_FLAGS lists only flags that the deployment files actually use."""
    words = {w.split("=", 1)[0] for i in [*K8S_INVOCATIONS, *COMPOSE_INVOCATIONS] for w in i.argv}
    assert set(PENDING_FLAGS) <= words


def test_docs_show_the_commands_they_explain() -> None:
    commands = {i.argv[0] for i in _doc_invocations()}
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
