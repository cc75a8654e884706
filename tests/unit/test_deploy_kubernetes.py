"""The Kubernetes manifests, checked offline against Kubernetes' own schemas, plus what the
API server would not catch: selectors, port names, probes, volumes, the GPU request, TLS
Secrets and the training Job."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import PurePosixPath
from typing import Any

import kubernetes_validate
import pytest
import yaml

from elasticpipe.transport.serving import metrics_host
from tests.support.deploy import (
    FIELD_VALUES,
    IMAGES,
    K8S,
    K8S_DOCS,
    K8S_FILES,
    K8S_INVOCATIONS,
    K8S_SERVERS,
    KUBERNETES_VERSION,
    KUSTOMIZATION,
    TLS_ENV,
    TLS_KEYS,
    Invocation,
    by_command,
    container_env,
    doc_id,
    docs,
    image_name,
    kind_name,
    mount_of,
    one,
    parse,
    pod_specs,
    pod_volume,
)

# ---- Kubernetes ----------------------------------------------------------------------------


def test_kustomization_lists_every_manifest_and_image() -> None:
    assert sorted(KUSTOMIZATION["resources"]) == [p.name for p in K8S_FILES]
    used = {
        image_name(c["image"])
        for _, pod in pod_specs()
        for c in [*pod.get("initContainers", []), *pod["containers"]]
    }
    assert used == {entry["name"] for entry in KUSTOMIZATION["images"]}
    assert used <= set(IMAGES)


@pytest.mark.parametrize("item", K8S_DOCS, ids=doc_id)
def test_manifest_matches_kubernetes_schema(item: tuple[str, dict[str, Any]]) -> None:
    _, doc = item
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = "/".join(str(p) for p in exc.path)
        pytest.fail(f"{doc_id(item)}: {path}: {exc.message}")


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
    assert sorted(map(kind_name, rendered)) == sorted(kind_name(d) for _, d in K8S_DOCS)
    wanted = {e["name"]: f"{e['newName']}:{e['newTag']}" for e in KUSTOMIZATION["images"]}
    for doc in rendered:
        for container in (
            doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])
        ):
            assert container["image"] in wanted.values()


def test_workloads_select_their_own_pods_and_services_find_them() -> None:
    workloads = [*docs("Deployment"), *docs("StatefulSet"), *docs("Job")]
    pod_labels = [w["spec"]["template"]["metadata"]["labels"] for w in workloads]
    for workload in workloads:
        selector = workload["spec"].get("selector", {}).get("matchLabels", {})
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), workload["metadata"]["name"]
    for service in docs("Service"):
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
    for budget in docs("PodDisruptionBudget"):
        selector = budget["spec"]["selector"]["matchLabels"]
        assert [lab for lab in pod_labels if selector.items() <= lab.items()]


def test_every_elasticpipe_container_is_checked_here() -> None:
    """Each Deployment and StatefulSet runs `elasticpipe` (through the image's entrypoint)."""
    servers = {
        f"{doc['kind']}/{doc['metadata']['name']}"
        for doc in [*docs("Deployment"), *docs("StatefulSet")]
    }
    checked = {i.where.split(":", 1)[1].rsplit("/", 1)[0] for i in K8S_INVOCATIONS}
    assert servers == checked
    assert {i.argv[0] for i in K8S_INVOCATIONS} == {"coordinator", "stage"}


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


def test_stages_are_a_statefulset_of_gpu_pods_advertising_their_dns_name() -> None:
    (stage,) = by_command(K8S_INVOCATIONS, "stage")
    statefulset = one("StatefulSet", "elasticpipe-stage")
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
    service = one("Service", service_name)
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    # The coordinator is its Service, at its gRPC port.
    coordinator = one("Service", "elasticpipe-coordinator")
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
        mount = mount_of(invocation.container, path)
        secret = pod_volume(invocation.pod, mount["name"])["secret"]
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
    (doc,) = [d for d in docs(workload[0]) if d["metadata"]["name"] == workload[1]]
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
    job = one("Job", "elasticpipe-train")
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert image_name(container["image"]) in IMAGES
    interpreter, script = container["command"]
    assert interpreter == "python"
    mount = mount_of(container, script)
    config_map = one("ConfigMap", pod_volume(pod, mount["name"])["configMap"]["name"])
    source = config_map["data"][PurePosixPath(script).name]
    code = compile(source, script, "exec")  # a syntax error fails here
    assert "from elasticpipe import Pipeline" in source
    assert "Pipeline" in code.co_names
    env = container_env(container)
    coordinator = one("Service", "elasticpipe-coordinator")
    assert env["ELASTICPIPE_COORDINATOR"].split(":")[0] == coordinator["metadata"]["name"]


def test_training_job_presents_its_client_certificate_through_the_environment() -> None:
    """Pipeline reads ELASTICPIPE_TLS_CERT/KEY/CA when it is given no tls=: the Job names
    the files of its mounted TLS Secret there, and train.py passes no tls= of its own."""
    job = one("Job", "elasticpipe-train")
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
    config_map = one(
        "ConfigMap", pod_volume(pod, mount_of(container, script)["name"])["configMap"]["name"]
    )
    tree = ast.parse(config_map["data"][PurePosixPath(script).name])
    (call,) = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Pipeline"
    ]
    assert "tls" not in {k.arg for k in call.keywords}, "train.py overrides the Job's TLS env"
