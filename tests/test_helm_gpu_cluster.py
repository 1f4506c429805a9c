"""The chart read as the operator of a 4 x 8-GPU cluster would (issue 31): one test per way the chart before it
stopped or damaged a first real run, each failing on that chart. Rendered manifests are validated as in
test_helm_chart.py (kubernetes-validate and the KubeRay CRD schema); Pod Security is checked against the
``restricted`` profile of the Pod Security Standards, written out below from the standard's table."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from rl.cli import main as rl_main
from rl.config import load_config
from rl.launch import CHART
from tests.test_helm_chart import (
    EXAMPLES,
    HELM,
    QUICKSTART,
    helm,
    one,
    pod_templates,
    render,
    run_configmap,
    sandbox_role,
    train_command,
)

pytestmark = pytest.mark.skipif(HELM is None, reason="helm is not installed (make setup installs it)")
GPU = CHART / "examples" / "gpu-cluster.yaml"
GPU_CONFIG = QUICKSTART.parent / "qwen3-8b-gpu.yaml"
ALL = [None, *EXAMPLES]
ids = [v.name if v else "defaults" for v in ALL]


# A run with GPU workers names a sandbox agent image of its own: the CUDA run image is several GB, and every session
# pod would pull it (issue 44, D8)
AGENT = {"repository": "registry.example.com/colocated-rl-agent", "tag": "0.1.0"}


def values_file(tmp_path: Path, values: dict) -> Path:
    if any(g.get("gpus") for g in values.get("workerGroups", [])):
        sandbox = values.get("sandbox", {})
        values = {**values, "sandbox": {**sandbox, "pods": {**sandbox.get("pods", {}), "agentImage": AGENT}}}
    f = tmp_path / "values.yaml"
    f.write_text(yaml.safe_dump(values))
    return f


def refused(*args: str) -> str:
    """helm template's error for values the chart must refuse."""
    proc = helm("template", "myrun", str(CHART), "--namespace", "rl", "--set-file", f"runConfig={QUICKSTART}", *args,
                check=False)
    assert proc.returncode != 0, "rendered, but should have been refused"
    return proc.stderr


def command(docs: list[dict]) -> list[str]:
    """launch.sh's one command line (split as bash would)."""
    script = run_configmap(docs)
    return train_command(script["data"]["launch.sh"])


def sets(argv: list[str]) -> dict[str, str]:
    return dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "--set")


def gpu_group(**extra) -> dict:
    return {"name": "gpu", "replicas": 4, "cpu": "96", "memory": "1600Gi", "gpus": 8, "shmSize": "256Gi", **extra}


def every_pod(docs: list[dict]) -> list[tuple[str, dict]]:
    """(where, pod template) of every pod the release makes: Ray head and workers, the submitter, the sandbox."""
    job = one(docs, "RayJob")
    pods = [(t["metadata"]["labels"]["app.kubernetes.io/component"], t) for t in pod_templates(job)]
    if "submitterPodTemplate" in job["spec"]:
        pods.append(("ray-submitter", job["spec"]["submitterPodTemplate"]))
    pods += [(d["metadata"]["name"], d["spec"]["template"]) for d in docs if d["kind"] in ("Deployment", "Job")]
    return pods


def matches(selector: dict, labels: dict) -> bool:
    """A label selector (matchLabels; matchExpressions with In) against a pod's labels."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    return all(labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", [])
               if e["operator"] == "In")


# --- Pod Security Standards, restricted (https://kubernetes.io/docs/concepts/security/pod-security-standards/) ---

RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected",
                      "secret"}


def restricted_violations(spec: dict, allowed_caps: frozenset[str] = frozenset()) -> list[str]:
    """What of a pod spec the restricted profile forbids; ``allowed_caps``: added capabilities accepted beyond
    NET_BIND_SERVICE (the RDMA ones a fabric needs, which put the pod at the privileged level)."""
    out = []
    pod_sc = spec.get("securityContext") or {}
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(host):
            out.append(host)
    for v in spec.get("volumes", []):
        kind = next(k for k in v if k != "name")
        if kind not in RESTRICTED_VOLUMES:
            out.append(f"volume {v['name']}: {kind}")
    if pod_sc.get("runAsUser") == 0:
        out.append("pod runAsUser 0")
    for c in spec.get("initContainers", []) + spec["containers"]:
        sc, name = c.get("securityContext") or {}, c["name"]
        if sc.get("privileged"):
            out.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{name}: allowPrivilegeEscalation not false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in caps.get("drop", []):
            out.append(f"{name}: capabilities not dropped")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"} - allowed_caps:
            out.append(f"{name}: adds {caps['add']}")
        if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
            out.append(f"{name}: runAsNonRoot not true")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            out.append(f"{name}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{name}: seccompProfile {seccomp}")
    return out


# --- 1: storage every worker reaches ---------------------------------------------------------------------------------

def test_1_several_gpu_pods_on_readwriteonce_storage_are_refused(tmp_path):
    """With RWO every worker needs the head's node: 4 GPU pods (with no nodeSelector, so the old check passed)
    rendered cleanly and stayed Pending on a real cluster."""
    err = refused("--values", str(values_file(tmp_path, {"workerGroups": [gpu_group()]})))
    assert "storage.accessMode ReadWriteOnce" in err and "4 GPU worker pods" in err
    assert "storage.accessMode=ReadWriteMany" in err and "storageClassName" in err
    # one GPU pod can share the head's node; RWX lets four go anywhere
    render(values_file(tmp_path, {"workerGroups": [gpu_group(replicas=1)]}))
    docs = render(values_file(tmp_path, {"workerGroups": [gpu_group()],
                                         "storage": {"accessMode": "ReadWriteMany", "storageClassName": "nfs"}}))
    assert all("affinity" not in t["spec"] for t in pod_templates(one(docs, "RayJob")))


def test_1_the_gpu_example_has_storage_every_node_mounts_sized_for_the_model():
    docs = render(GPU, config=GPU_CONFIG)
    claim = one(docs, "PersistentVolumeClaim")["spec"]
    assert claim["accessModes"] == ["ReadWriteMany"] and claim["storageClassName"]
    assert int(re.fullmatch(r"(\d+)Ti", claim["resources"]["requests"]["storage"]).group(1)) >= 1  # >= 400 GB
    proc = helm("install", "--dry-run=client", "myrun", str(CHART), "-n", "rl", "--set-file", f"runConfig={GPU_CONFIG}",
                "--values", str(GPU))
    notes = proc.stdout.split("NOTES:", 1)[1]
    assert "keeps 2 checkpoint(s)" in notes and "11 bytes per model parameter" in notes and "~376 GB" in notes


# --- 2: RDMA for NCCL -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("fabric", "group"), [
    ("infiniband-multus", {"extraResources": {"rdma/rdma_shared_device_a": 1}, "memlock": "node",
                           "annotations": {"k8s.v1.cni.cncf.io/networks": "rl/ib-ipoib"},
                           "env": [{"name": "NCCL_IB_HCA", "value": "mlx5"}]}),
    ("efa", {"extraResources": {"vpc.amazonaws.com/efa": 32}, "memlock": "node",
             "env": [{"name": "FI_PROVIDER", "value": "efa"}]}),
    ("roce-host-network", {"extraResources": {"rdma/roce": "1"}, "memlock": "root", "capabilities": ["IPC_LOCK"],
                           "hostNetwork": True, "runtimeClassName": "nvidia",
                           "env": [{"name": "NCCL_IB_GID_INDEX", "value": "3"}]}),
])
def test_2_worker_groups_take_what_nccl_needs_for_rdma(tmp_path, fabric, group):
    """The schema rejected every one of these fields; now each reaches the worker pods (and only them). RDMA's
    memory pinning is the nodes' (memlock: node, checked by an init container) or a root worker's with IPC_LOCK
    (memlock: root): a capability added to the uid-1000 worker would be lost at its first execve (issue 44, D2)."""
    docs = render(values_file(tmp_path, {"workerGroups": [gpu_group(**group)], "rayJob": {"rayVersion": "2.60.0"},
                                         "storage": {"accessMode": "ReadWriteMany"},
                                         "networkPolicy": {"nodeCIDRs": ["10.0.0.0/16"]}}))
    head, worker = pod_templates(one(docs, "RayJob"))
    spec, c = worker["spec"], worker["spec"]["containers"][0]
    for name, n in group["extraResources"].items():
        assert c["resources"]["requests"][name] == c["resources"]["limits"][name] == str(n)
    if group["memlock"] == "root":
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
        assert spec["securityContext"]["runAsUser"] == c["securityContext"]["runAsUser"] == 0
    else:
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert [i["name"] for i in spec["initContainers"]] == ["check-memlock"]
        assert spec["securityContext"]["runAsUser"] == 1000
    assert spec.get("runtimeClassName") == group.get("runtimeClassName")
    assert spec.get("hostNetwork", False) == group.get("hostNetwork", False)
    if group.get("hostNetwork"):  # the cluster's DNS stays reachable
        assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert group.get("annotations", {}).items() <= (worker["metadata"].get("annotations") or {}).items()
    assert all(e in c["env"] for e in group["env"])
    assert not [e for e in head["spec"]["containers"][0]["env"] if e in group["env"]]
    assert "add" not in head["spec"]["containers"][0]["securityContext"]["capabilities"]


def test_2_the_gpu_example_carries_the_rdma_and_nccl_knobs():
    """Non-root workers on nodes whose runtime lets them pin memory, checked before Ray starts (was IPC_LOCK on a
    uid-1000 container, lost at its first execve: issue 44, D2)."""
    worker = pod_templates(one(render(GPU, config=GPU_CONFIG), "RayJob"))[1]
    c = worker["spec"]["containers"][0]
    assert any(r.startswith("rdma/") for r in c["resources"]["limits"])
    assert "add" not in c["securityContext"]["capabilities"] and worker["spec"]["securityContext"]["runAsUser"] == 1000
    assert [i["name"] for i in worker["spec"]["initContainers"]] == ["check-memlock"]
    assert "k8s.v1.cni.cncf.io/networks" in worker["metadata"]["annotations"]
    assert {"NCCL_IB_HCA", "NCCL_SOCKET_IFNAME"} <= {e["name"] for e in c["env"]}


@pytest.mark.parametrize("values", ALL, ids=ids)
def test_ray_is_told_its_gpus(values):
    """KubeRay derives num-gpus from nvidia.com/gpu limits only (not MIG or other vendors' resource names)."""
    docs = render(*([values] if values else []))
    spec = one(docs, "RayJob")["spec"]["rayClusterSpec"]
    assert spec["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    for g in spec["workerGroupSpecs"]:
        limits = g["template"]["spec"]["containers"][0]["resources"]["limits"]
        gpus = sum(int(v) for k, v in limits.items() if k.endswith("/gpu") or "/mig-" in k)
        assert g["rayStartParams"]["num-gpus"] == str(gpus)


def test_ray_num_gpus_follows_a_mig_resource(tmp_path):
    docs = render(values_file(tmp_path, {"workerGroups": [gpu_group(replicas=1, gpus=7,
                                                                    gpuResource="nvidia.com/mig-1g.10gb")]}))
    [g] = one(docs, "RayJob")["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert g["rayStartParams"]["num-gpus"] == "7"
    assert "nvidia.com/gpu" not in g["template"]["spec"]["containers"][0]["resources"]["limits"]


# --- 5 and 14: one command that resumes by itself, and retries -

@pytest.mark.parametrize("values", ALL, ids=ids)
def test_5_14_every_attempt_runs_one_command_that_resumes_from_a_complete_checkpoint(values):
    """A first attempt that crashed in its first save left only iter_N.tmp: `--resume` (chosen because
    checkpoints/ existed) then failed on every retry. Now each attempt runs the same `rl train --auto-resume`, and
    retries are on by default."""
    docs = render(*([values] if values else []))
    script = run_configmap(docs)
    text = script["data"]["launch.sh"]
    assert "checkpoints" not in text and "--resume" not in text.replace("--auto-resume", "")
    argv = command(docs)
    assert argv[:6] == ["rl", "train", "/etc/rl/config.yaml", "--run-dir", "$run_dir", "--auto-resume"]
    assert one(docs, "RayJob")["spec"]["backoffLimit"] > 0


# --- 6: the sandbox's sessions in their own namespace -

def test_6_session_pods_and_the_role_live_in_a_namespace_of_their_own(tmp_path):
    docs = render()
    [ns] = [d for d in docs if d["kind"] == "Namespace"]
    name = ns["metadata"]["name"]
    assert name == "rl-myrun-sandbox"
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for kind in ("Role", "RoleBinding"):
        assert sandbox_role(docs, kind)["metadata"]["namespace"] == name  # nothing of the run's own namespace
    deployment = one(docs, "Deployment")["spec"]["template"]["spec"]
    c = deployment["containers"][0]
    assert f"--set=sandbox.kubernetes.namespace={name}" in c["args"]
    assert {"name": "RL_SANDBOX_SESSION_NAMESPACE", "value": name} in c["env"]
    session_policy = next(d for d in docs if d["metadata"]["name"] == "myrun-sandbox-pods-deny-egress")
    assert session_policy["metadata"]["namespace"] == name
    peer = session_policy["spec"]["ingress"][0]["from"][0]
    assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "rl"}
    # a namespace made beforehand (by whoever may create namespaces), and never the run's own
    docs = render(sets=("sandbox.sessionNamespace.name=rl-sandbox", "sandbox.sessionNamespace.create=false"))
    assert not [d for d in docs if d["kind"] == "Namespace"]
    assert sandbox_role(docs)["metadata"]["namespace"] == "rl-sandbox"
    err = refused("--set", "sandbox.sessionNamespace.name=rl")
    assert "sandbox.sessionNamespace.name \"rl\" is the run's own namespace" in err


# --- 7: the sandbox's gRPC endpoint ----------------------------------------------------------------------------------

def test_7_the_sandbox_endpoint_takes_a_token_and_only_the_runs_ray_pods():
    docs = render()
    secret = one(docs, "Secret")
    assert len(secret["data"]["token"]) >= 32
    name = secret["metadata"]["name"]
    job = one(docs, "RayJob")
    service = one(docs, "Deployment")["spec"]["template"]
    for where, t in [("service", service), *[(p["metadata"]["labels"]["app.kubernetes.io/component"], p)
                                             for p in pod_templates(job)]]:
        env = {e["name"]: e for e in t["spec"]["containers"][0]["env"]}
        assert env["RL_SANDBOX_TOKEN"]["valueFrom"] == {"secretKeyRef": {"name": name, "key": "token"}}, where
    assert "RL_SANDBOX_TOKEN" not in str(job["spec"]["submitterPodTemplate"])
    policy = next(d for d in docs if d["metadata"]["name"] == "myrun-sandbox-ingress")["spec"]
    assert matches(policy["podSelector"], service["metadata"]["labels"]) and policy["policyTypes"] == ["Ingress"]
    [grpc] = policy["ingress"]  # the metrics port stays closed: metrics.scrapeFrom names nobody by default (N5)
    assert grpc["ports"] == [{"protocol": "TCP", "port": 50051}]
    peer = grpc["from"][0]["podSelector"]
    head, worker = (t["metadata"]["labels"] for t in pod_templates(job))
    assert matches(peer, head) and matches(peer, worker) and len(grpc["from"]) == 1
    session = {"colocated-rl/run": "myrun", "app.kubernetes.io/managed-by": "rl-sandbox"}
    for stranger in (session, service["metadata"]["labels"], {**worker, "colocated-rl/run": "other"}, {}):
        assert not matches(peer, stranger)
    scraped = render(sets=("metrics.scrapeFrom[0].namespaceSelector.matchLabels.team=observability",))
    policy = next(d for d in scraped if d["metadata"]["name"] == "myrun-sandbox-ingress")["spec"]
    assert policy["ingress"][1] == {"from": [{"namespaceSelector": {"matchLabels": {"team": "observability"}}}],
                                    "ports": [{"protocol": "TCP", "port": 9100}]}


def test_7_sandbox_sessions_get_only_allowed_images(tmp_path):
    """sandbox.pods.allowedImages reaches the service's config as `rl sandbox serve` reads its arguments; by default
    nothing beyond defaultImage is allowed."""
    def served(docs: list[dict]) -> list[str]:
        args = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
        overrides = [a.removeprefix("--set=") for a in args if a.startswith("--set=sandbox.")]
        return load_config(QUICKSTART, overrides).sandbox.kubernetes.allowed_images

    assert served(render()) == []
    patterns = ["python:3.11-*", "registry.example.com/swe/*"]
    assert served(render(values_file(tmp_path, {"sandbox": {"pods": {"allowedImages": patterns}}}))) == patterns
    assert "allowedImages" in refused("--set", "sandbox.pods.allowedImages[0]=has space")


# --- 8: Pod Security Standards ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("values", [None, CHART / "examples" / "cpu-demo.yaml"], ids=["defaults", "cpu-demo"])
def test_8_every_pod_meets_the_restricted_pod_security_standard(values):
    docs = render(*([values] if values else []), sets=("model.source=s3://models/tiny",))
    pods = every_pod(docs)
    assert {w for w, _ in pods} >= {"ray-head", "ray-worker", "ray-submitter", "myrun-sandbox"}
    for where, t in pods:
        assert restricted_violations(t["spec"]) == [], where


def test_8_the_gpu_example_runs_non_root_under_runtime_default_seccomp_adding_only_ipc_lock():
    for where, t in every_pod(render(GPU, config=GPU_CONFIG)):
        assert restricted_violations(t["spec"], allowed_caps=frozenset({"IPC_LOCK"})) == [], where


def test_8_the_local_backends_privileged_pod_needs_consent():
    err = refused("--set", "sandbox.backend=local")
    assert "sandbox.localPrivileged=true" in err and "privileged" in err
    docs = render(sets=("sandbox.backend=local", "sandbox.localPrivileged=true"))
    spec = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert spec["containers"][0]["securityContext"]["privileged"] is True
    # no session pods, no rights to make them
    assert not [d for d in docs if d["kind"] == "Namespace" or (d["metadata"]["name"].endswith("-sandbox")
                and d["kind"] == "Role")]


# --- 9: GPUs freed minutes after the run -

@pytest.mark.parametrize("values", ALL, ids=ids)
def test_9_the_ray_cluster_and_its_gpus_go_minutes_after_the_run(values):
    spec = one(render(*([values] if values else [])), "RayJob")["spec"]
    assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] <= 300


def test_9_a_run_that_succeeded_releases_its_sandbox_fleet(tmp_path):
    """The RayJob (and the fleet it owns) stays after the run, for its status: a run that succeeded, and so will not
    be retried, scales its sandbox service to zero itself (launch.sh, through the Ray pods' own account, whose rights
    are that Deployment's scale and reading its RayJob for the run's deadline); a failed attempt keeps it for the
    retry. Run here with bash, rl and python3 replaced by stand-ins that record their calls (the deadline's answers
    100000 s); the run storage is a directory of the test."""
    data = tmp_path / "data"
    docs = render(GPU, config=GPU_CONFIG, sets=(f"storage.mountPath={data}",))
    role = next(d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "myrun-run")
    assert role["metadata"].get("namespace", "rl") == "rl" and role["rules"] == [
        {"apiGroups": ["apps"], "resources": ["deployments/scale"], "resourceNames": ["myrun-sandbox"],
         "verbs": ["get", "patch"]},
        {"apiGroups": ["ray.io"], "resources": ["rayjobs"], "resourceNames": ["myrun"], "verbs": ["get"]}]
    binding = next(d for d in docs if d["kind"] == "RoleBinding" and d["metadata"]["name"] == "myrun-run")
    for t in pod_templates(one(docs, "RayJob")):
        assert t["spec"]["serviceAccountName"] == binding["subjects"][0]["name"] == "myrun-run"
    script = run_configmap(docs)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "rl").write_text('#!/bin/bash\necho "$@" >> "$CALLS"\n[ "$1" = train ] && exit "$TRAIN_STATUS"\n'
                                'exit 0\n')
    (bin_dir / "python3").write_text('#!/bin/bash\necho "python3 $*" >> "$CALLS"\n'
                                     '[ "$3" = deadline ] && echo 100000\nexit 0\n')
    for tool in ("rl", "python3"):
        (bin_dir / tool).chmod(0o755)
    run_dir = data / "runs" / "myrun"
    for status in (0, 1):
        calls = tmp_path / f"calls-{status}"
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "CALLS": str(calls), "TRAIN_STATUS": str(status)}
        proc = subprocess.run(["bash", "-c", script["data"]["launch.sh"]], env=env, capture_output=True, text=True)
        assert proc.returncode == status, proc.stderr
        lines = calls.read_text().splitlines()
        assert lines[0] == f"python3 -m rl.launch deadline myrun --namespace rl --limit 172800 --run-dir {run_dir}"
        assert lines[1].startswith("train /etc/rl/config.yaml --run-dir")
        assert lines[2:] == ([f"python3 -m engines.model.io.upload_service request {run_dir}/.exports "
                              f"{run_dir}/final s3://rl-results/qwen3-8b-math/final",
                              "sandbox release myrun-sandbox --namespace rl"] if status == 0 else [])


# --- 10: sessions kept alive ------------------------------------------------------------------------------------------

def test_10_no_autoscaler_kills_live_sessions_and_replicas_know_themselves():
    """No scale-down kills live sessions; each replica knows its pod, and may hold the owner lease through which the
    living replicas delete a dead one's session pods in the session namespace (sandbox.k8s_leases)."""
    docs = render(GPU, config=GPU_CONFIG)
    rules = sandbox_role(docs)["rules"]
    assert {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
            "verbs": ["create", "get", "list", "patch", "delete"]} in rules
    hpa = one(docs, "HorizontalPodAutoscaler")["spec"]
    assert hpa["behavior"]["scaleDown"]["selectPolicy"] == "Disabled"
    env = {e["name"]: e for e in one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["POD_UID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.uid"}}


# --- 11: no chown of the shared volume at every start ----------------------------------------------------------------

@pytest.mark.parametrize("values", ALL, ids=ids)
def test_11_fsgroup_changes_ownership_only_on_a_root_mismatch(values):
    for where, t in every_pod(render(*([values] if values else []))):
        sc = t["spec"].get("securityContext") or {}
        if "fsGroup" in sc:
            assert sc["fsGroupChangePolicy"] == "OnRootMismatch", where


# --- 12: the model from a hub or a bucket -

@pytest.mark.parametrize("source", ["Qwen/Qwen3-8B", "hf://Qwen/Qwen3-8B", "s3://models/qwen3-8b",
                                    "gs://models/qwen3-8b"])
def test_12_a_model_source_is_downloaded_once_by_the_head_and_found_by_every_pod(source):
    docs = render(sets=(f"model.source={source}", "model.credentialsSecret=model-credentials"))
    head, worker = pod_templates(one(docs, "RayJob"))
    [init] = [i for i in head["spec"]["initContainers"] if i["name"] == "fetch-model"]
    assert init["command"] == ["rl", "fetch-model", source, "--cache", "/data/models"]
    assert init["envFrom"] == [{"secretRef": {"name": "model-credentials"}}]
    assert {"name": "data", "mountPath": "/data"} in init["volumeMounts"]
    for t in (head, worker):  # the run resolves the same source in the cache; the credentials stay in the init step
        c = t["spec"]["containers"][0]
        assert {"name": "RL_MODEL_CACHE", "value": "/data/models"} in c["env"] and "envFrom" not in c
    assert "initContainers" not in worker["spec"]
    assert sets(command(docs))["model.path"] == source
    assert "fetch-model" not in str(pod_templates(one(render(), "RayJob"))[0]["spec"]["initContainers"])
    err = refused("--set", f"model.source={source}", "--set", "model.path=/models/x")
    assert "set one" in err


# --- 13: tensor-parallel replicas ------------------------------------------------------------------------------------

def test_13_a_worker_spans_gpus_per_worker_gpus_of_one_pod(tmp_path):
    f = values_file(tmp_path, {"run": {"gpusPerWorker": 4}, "workerGroups": [gpu_group()],
                               "storage": {"accessMode": "ReadWriteMany"}})
    docs = render(f)
    o = sets(command(docs))
    assert o["cluster.workers"] == "8" and o["cluster.gpus_per_worker"] == "4"
    assert o["rollout.tensor_parallel_size"] == "4"
    argv = command(docs)  # the overrides make a run config the run accepts
    assert rl_main(["check-config", str(QUICKSTART), *argv[argv.index("--auto-resume") + 1:]]) == 0
    [g] = one(docs, "RayJob")["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert g["rayStartParams"]["resources"] == '"{\\"rl_worker\\": 2}"' and g["rayStartParams"]["num-gpus"] == "8"
    err = refused("--values", str(f), "--set", "run.gpusPerWorker=3")
    assert "gpus 8 is not a multiple of run.gpusPerWorker 3" in err
    assert "rollout.tensor_parallel_size" not in sets(command(render()))  # CPU workers: nothing to split


# --- 15: NetworkPolicy in default-deny namespaces ---------------------------------------------------------------------

def test_15_workers_admit_each_other_for_nccl_and_only_the_runs_pods():
    docs = render(GPU, config=GPU_CONFIG)
    job = one(docs, "RayJob")
    head, worker = (t["metadata"]["labels"] for t in pod_templates(job))
    policy = next(d for d in docs if d["metadata"]["name"] == "myrun-ray-workers")["spec"]
    assert matches(policy["podSelector"], worker) and not matches(policy["podSelector"], head)
    rule, metrics = policy["ingress"]
    assert "ports" not in rule  # NCCL picks its ports
    assert metrics["ports"] == [{"protocol": "TCP", "port": 8080}]  # Ray's metrics, for Prometheus (issue 44, D10)
    peer = rule["from"][0]["podSelector"]
    assert matches(peer, worker) and matches(peer, head)
    sandbox = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert not matches(peer, sandbox) and not matches(peer, {**worker, "colocated-rl/run": "other"})


def test_15_egress_rules_for_a_namespace_that_denies_egress():
    names = [d["metadata"]["name"] for d in render()]
    assert "myrun-ray-egress" not in names and "myrun-sandbox-egress" not in names  # off unless asked for
    docs = render(sets=("networkPolicy.egress.enabled=true", "networkPolicy.egress.apiServerCIDRs={10.0.0.1/32}",
                        "networkPolicy.egress.cidrs={0.0.0.0/0}"))
    job = one(docs, "RayJob")
    labels = [t["metadata"]["labels"] for t in pod_templates(job)] + \
        [job["spec"]["submitterPodTemplate"]["metadata"]["labels"]]
    ray = next(d for d in docs if d["metadata"]["name"] == "myrun-ray-egress")["spec"]
    assert all(matches(ray["podSelector"], x) for x in labels) and ray["policyTypes"] == ["Egress"]
    own, dns, sandbox, api, world = ray["egress"]
    assert api["to"] == [{"ipBlock": {"cidr": "10.0.0.1/32"}}]  # rl sandbox release, the deadline (issue 44, D16)
    assert all(matches(own["to"][0]["podSelector"], x) for x in labels)
    assert {p["port"] for p in dns["ports"]} == {53}
    service = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert matches(sandbox["to"][0]["podSelector"], service) and sandbox["ports"][0]["port"] == 50051
    assert world["to"] == [{"ipBlock": {"cidr": "0.0.0.0/0"}}]
    svc = next(d for d in docs if d["metadata"]["name"] == "myrun-sandbox-egress")["spec"]
    _, sessions, api = svc["egress"]
    assert sessions["to"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "rl-myrun-sandbox"}
    assert api["to"] == [{"ipBlock": {"cidr": "10.0.0.1/32"}}]
    assert "apiServerCIDRs" in refused("--set", "networkPolicy.egress.enabled=true")


def test_15_the_operator_selector_is_the_operators_own(tmp_path):
    """An operator installed with other labels (or in a known namespace): the labels given replace the default
    (they were merged with it, so no pod matched), and its namespace is named. The default was any namespace, where
    anyone who may create a pod could label it as the operator (issue 44, D1): now KubeRay's own default install
    namespace, by the name label the API server sets."""
    policy = next(d for d in render() if d["metadata"]["name"] == "myrun-ray-head")["spec"]
    assert policy["ingress"][1]["from"] == [{
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "default"}},
        "podSelector": {"matchLabels": labels}} for labels in (  # KubeRay's Helm chart's labels, and kustomize's too
        {"app.kubernetes.io/name": "kuberay-operator"}, {"app.kubernetes.io/component": "kuberay-operator"})]
    f = values_file(tmp_path, {"head": {"networkPolicy": {
        "operatorPodLabels": {"app": "ray-operator"}, "operatorNamespace": "kuberay"}}})
    policy = next(d for d in render(f) if d["metadata"]["name"] == "myrun-ray-head")["spec"]
    [peer] = policy["ingress"][1]["from"]
    assert peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "kuberay"}}
    assert peer["podSelector"]["matchLabels"] == {"app": "ray-operator"}
