"""What the deployment tests share: the manifests (deploy/k8s and its HA variant,
deploy/k8s-ha), the compose files and docs/deploy.md loaded once, and every ``elasticpipe``
command line in them, parsed by the real CLI (and every etcd one, read as etcd's flags)."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path, PurePosixPath
from typing import Any
from unittest import mock

import pytest
import yaml

from elasticpipe.cli.entry import build_parser
from elasticpipe.local.etcd import etcd_binary
from elasticpipe.security.tls import (
    ENV_CA,
    ENV_CERT,
    ENV_KEY,
)

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
K8S_HA = REPO / "deploy" / "k8s-ha"  # three coordinators on etcd
COMPOSE_FILE = REPO / "docker-compose.yml"
COMPOSE_HA_FILE = REPO / "docker-compose.ha.yml"
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
# etcd's official image: the HA variants' store.
ETCD_IMAGE = "quay.io/coreos/etcd"
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


TAKE_ALL = ("coordinator", "stage", "admin")
SERVERS = ("coordinator", "stage")
# The commands whose lines in docs/deploy.md are checked against the real parser.
DOC_COMMANDS = (*TAKE_ALL, "certs")

# Flags used by the deployment files that elasticpipe/cli/entry.py does not have yet: they are
# being added in parallel (issue 11). Each is added here to the real parser, for the
# commands named, so the command lines can be checked now. Once cli.py has a flag,
# test_pending_flags_are_still_pending fails: delete its line, and the real one is checked.
PENDING_FLAGS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    # flag: (commands that take it, how argparse reads it)
}


# ---- loading -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Manifests:
    """One kustomization's directory: its manifests (every YAML file beside
    kustomization.yaml, which must list them all) and the kustomization itself."""

    path: Path
    files: tuple[Path, ...]
    docs: tuple[tuple[str, dict[str, Any]], ...]  # (file name, document)
    kustomization: dict[str, Any]

    def __str__(self) -> str:
        return str(self.path.relative_to(REPO))

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [doc for _, doc in self.docs if doc["kind"] == kind]

    def one(self, kind: str, name: str) -> dict[str, Any]:
        (doc,) = [d for d in self.of(kind) if d["metadata"]["name"] == name]
        return doc

    def pod_specs(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """(where, pod spec) of every workload."""
        for name, doc in self.docs:
            template = doc.get("spec", {}).get("template")
            if template is not None:
                where = f"{self.path.name}/{name}:{doc['kind']}/{doc['metadata']['name']}"
                yield where, template["spec"]


def load_manifests(path: Path) -> Manifests:
    files = tuple(sorted(p for p in path.glob("*.y*ml") if p.name != "kustomization.yaml"))
    found = []
    for file in files:
        for doc in yaml.safe_load_all(file.read_text(encoding="utf-8")):
            if doc is not None:
                found.append((file.name, doc))
    kustomization = yaml.safe_load((path / "kustomization.yaml").read_text(encoding="utf-8"))
    return Manifests(path, files, tuple(found), kustomization)


BASE = load_manifests(K8S)
HA = load_manifests(K8S_HA)
DEPLOYMENTS = (BASE, HA)  # the checks that apply to any kustomization run on both

# The base's, as the tests that are about deploy/k8s alone use them.
K8S_FILES = list(BASE.files)
K8S_DOCS = list(BASE.docs)
KUSTOMIZATION = BASE.kustomization
COMPOSE = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))
COMPOSE_HA = yaml.safe_load(COMPOSE_HA_FILE.read_text(encoding="utf-8"))
COMPOSE_FILES = {COMPOSE_FILE.name: COMPOSE, COMPOSE_HA_FILE.name: COMPOSE_HA}


def doc_id(item: tuple[str, dict[str, Any]]) -> str:
    name, doc = item
    return f"{name}:{doc['kind']}/{doc['metadata']['name']}"


def docs(kind: str, manifests: Manifests = BASE) -> list[dict[str, Any]]:
    return manifests.of(kind)


def one(kind: str, name: str, manifests: Manifests = BASE) -> dict[str, Any]:
    return manifests.one(kind, name)


def kind_name(doc: dict[str, Any]) -> tuple[str, str]:
    return doc["kind"], doc["metadata"]["name"]


def image_name(image: str) -> str:
    """``registry/path/name:tag@digest`` -> ``registry/path/name``."""
    image = image.split("@", 1)[0]
    last = image.rsplit("/", 1)[-1]
    return image[: len(image) - len(last)] + last.split(":", 1)[0]


# ---- command lines -------------------------------------------------------------------------

KUBELET_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def kubelet_expand(value: str, env: dict[str, str]) -> str:
    """``$(VAR)`` replaced as the kubelet does (``$$`` escapes; unknown names stay)."""

    def sub(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return KUBELET_REF.sub(sub, value)


def container_env(
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


def pod_specs(manifests: Manifests = BASE) -> Iterator[tuple[str, dict[str, Any]]]:
    return manifests.pod_specs()


def all_pod_specs() -> Iterator[tuple[str, dict[str, Any]]]:
    """The pod specs of every kustomization."""
    for manifests in DEPLOYMENTS:
        yield from manifests.pod_specs()


def elasticpipe_argv(container: dict[str, Any]) -> list[str] | None:
    """The arguments of `elasticpipe` in a container of the image (through its entrypoint,
    or a ``command`` naming it); None when the container runs something else."""
    if image_name(container["image"]) not in IMAGES:
        return None
    args = [str(a) for a in container.get("args", [])]
    if "command" not in container:
        return args
    command = [str(c) for c in container["command"]]
    if PurePosixPath(command[0]).name == "elasticpipe":
        return command[1:] + args
    return None


def k8s_invocations(
    fields: dict[str, str] = FIELD_VALUES, manifests: Manifests = BASE
) -> list[Invocation]:
    found = []
    for where, pod in manifests.pod_specs():
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            raw = elasticpipe_argv(container)
            if raw is not None:
                env = container_env(container, fields)
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


def compose_env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def compose_invocations(
    compose: dict[str, Any] = COMPOSE, label: str = "compose"
) -> list[Invocation]:
    """The `elasticpipe` command lines of a compose file: its services of the image, bar
    those that run something else (an ``entrypoint``)."""
    found = []
    for name, service in compose["services"].items():
        if "entrypoint" in service or image_name(service.get("image", "")) not in IMAGES:
            continue
        command = service.get("command", [])
        argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
        env = compose_env(service)
        found.append(Invocation(f"{label}:{name}", argv, env, argv, service=name))
    return found


SHELL_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")
ASSIGNMENT = re.compile(r"(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(\S*)\s*(?:#.*)?")


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
            match = SHELL_VAR.match(line, i)
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
            if assignment := ASSIGNMENT.fullmatch(command.strip()):
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


def elasticpipe_words(words: list[str]) -> list[str] | None:
    """The arguments of `elasticpipe` in a command line: run directly, or in a pod
    (``kubectl exec|run ... -- elasticpipe ...``)."""
    if words[0] == "kubectl" and "--" in words:
        words = words[words.index("--") + 1 :]
    if words and words[0] == "elasticpipe":
        return words[1:]
    return None


def doc_invocations(path: Path = DOCS) -> list[Invocation]:
    """`elasticpipe coordinator|stage|admin|certs ...` lines of a document's shell blocks."""
    found = []
    for command in shell_commands(path):
        argv = elasticpipe_words(command.words)
        if argv and argv[0] in DOC_COMMANDS:
            env = {"ELASTICPIPE_COORDINATOR": "coordinator.example:7100", **command.variables}
            found.append(Invocation(command.where, argv, env, argv))
    return found


K8S_INVOCATIONS = k8s_invocations()
K8S_SERVERS = [i for i in K8S_INVOCATIONS if i.argv[0] in SERVERS]
HA_INVOCATIONS = k8s_invocations(manifests=HA)
HA_SERVERS = [i for i in HA_INVOCATIONS if i.argv[0] in SERVERS]
COMPOSE_INVOCATIONS = compose_invocations()
COMPOSE_HA_INVOCATIONS = compose_invocations(COMPOSE_HA, "compose-ha")


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def all_parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """The parser and every (sub)subcommand's."""
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from all_parsers(sub)


def pending_targets(
    parser: argparse.ArgumentParser, command: str
) -> list[tuple[argparse.ArgumentParser, bool]]:
    """The parsers that take a command's options: (parser, is an admin subcommand)."""
    sub = subcommands(parser)[command]
    targets = [(sub, False)]
    if command == "admin":  # admin options go before or after the admin subcommand
        targets += [(p, True) for p in subcommands(sub).values()]
    return targets


def parser_with_pending_flags(env: dict[str, str]) -> argparse.ArgumentParser:
    """The real parser, built under ``env`` (its defaults read it), plus PENDING_FLAGS."""
    with mock.patch.dict(os.environ, env, clear=True):
        parser = build_parser()
    # Exact flag names only: `--stat` for `--state` would parse (argparse takes unambiguous
    # prefixes), until a new flag makes it ambiguous.
    for sub in all_parsers(parser):
        sub.allow_abbrev = False
    for flag, (commands, kwargs) in PENDING_FLAGS.items():
        for command in commands:
            for target, nested in pending_targets(parser, command):
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


def by_command(invocations: list[Invocation], command: str) -> list[Invocation]:
    return [i for i in invocations if i.argv[:1] == [command]]


def mount_of(container: dict[str, Any], path: str) -> dict[str, Any]:
    """The volume mount that ``path`` lies on (the deepest one)."""
    mounts = [
        m
        for m in container.get("volumeMounts", [])
        if PurePosixPath(path).is_relative_to(m["mountPath"])
    ]
    assert mounts, f"{path} is on no mounted volume"
    return max(mounts, key=lambda m: len(m["mountPath"]))


def pod_volume(pod: dict[str, Any], name: str) -> dict[str, Any]:
    (volume,) = [v for v in pod["volumes"] if v["name"] == name]
    return volume


# ---- etcd ----------------------------------------------------------------------------------


def etcd_flags(argv: list[str]) -> dict[str, str]:
    """etcd's command line as {flag: value}: ``--flag=value``, or ``--flag`` alone for a
    boolean (``"true"``); nothing else (etcd takes no positional arguments)."""
    flags: dict[str, str] = {}
    for word in argv:
        assert word.startswith("--"), f"etcd takes no argument {word!r}"
        name, sep, value = word.partition("=")
        assert name not in flags, f"{name} given twice"
        flags[name] = value if sep else "true"
    return flags


@cache
def etcd_known_flags() -> frozenset[str] | None:
    """The flags the installed etcd binary documents (``etcd --help``); None without one."""
    binary = etcd_binary()
    if binary is None:
        return None
    done = subprocess.run(
        [binary, "--help"], capture_output=True, text=True, timeout=30, check=False
    )
    return frozenset(re.findall(r"^\s+(--[a-z0-9-]+)", done.stdout + done.stderr, re.M))


@dataclass
class EtcdMember:
    """One etcd container of a manifest, as one pod of its StatefulSet runs it."""

    where: str
    pod_name: str
    flags: dict[str, str]  # the kubelet's expansion done
    pod: dict[str, Any]
    container: dict[str, Any]


def etcd_members(
    manifests: Manifests, namespace: str = FIELD_VALUES["metadata.namespace"]
) -> list[EtcdMember]:
    """Every pod of the etcd StatefulSets (each ordinal), with its expanded flags."""
    found = []
    for statefulset in manifests.of("StatefulSet"):
        pod = statefulset["spec"]["template"]["spec"]
        for container in pod["containers"]:
            if image_name(container["image"]) != ETCD_IMAGE:
                continue
            for ordinal in range(statefulset["spec"]["replicas"]):
                pod_name = f"{statefulset['metadata']['name']}-{ordinal}"
                fields = {
                    **FIELD_VALUES,
                    "metadata.name": pod_name,
                    "metadata.namespace": namespace,
                }
                env = container_env(container, fields)
                argv = [kubelet_expand(str(a), env) for a in container.get("args", [])]
                found.append(
                    EtcdMember(
                        f"{manifests}:{pod_name}/{container['name']}",
                        pod_name,
                        etcd_flags(argv),
                        pod,
                        container,
                    )
                )
    return found


def compose_etcd_members(compose: dict[str, Any]) -> dict[str, dict[str, str]]:
    """The etcd services of a compose file: {service: its flags}."""
    return {
        name: etcd_flags([str(a) for a in service.get("command", [])])
        for name, service in compose["services"].items()
        if image_name(service.get("image", "")) == ETCD_IMAGE
    }


def url_host_port(url: str) -> tuple[str, str, int]:
    """``https://host:2379`` -> (scheme, host, port)."""
    scheme, sep, rest = url.partition("://")
    assert sep, url
    host, _, port = rest.rstrip("/").rpartition(":")
    return scheme, host, int(port)
