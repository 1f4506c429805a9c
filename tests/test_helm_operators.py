"""The chart read against KubeRay's and Kubernetes' real behaviour (issue 19): one test per way a run rendered by
an earlier chart would have failed on a real cluster. Every rendered manifest is validated as in test_helm_chart.py;
the sandbox's session pods are built by the real pod backend, against ``KubeApiStandIn``, a test double of the
Kubernetes API server (none can run here), and no session is opened."""

from __future__ import annotations

import re
from decimal import Decimal

import pytest
import yaml

from rl.config import load_config
from rl.launch import CHART, release_name
from tests.k8s_validation import parse_quantity, validate_manifest
from tests.kube_standin import KubeApiStandIn
from tests.test_helm_chart import (
    EXAMPLES,
    HELM,
    QUICKSTART,
    config_args,
    helm,
    one,
    overrides,
    pod_templates,
    render,
    train_args,
)

pytestmark = pytest.mark.skipif(HELM is None, reason="helm is not installed (make setup installs it)")
ALL = [None, *EXAMPLES]
ids = [v.name if v else "defaults" for v in ALL]
GPU = CHART / "examples" / "gpu-cluster.yaml"


def rendered(values):
    return render(*([values] if values else []))


def ray_groups(job: dict) -> list[dict]:
    spec = job["spec"]["rayClusterSpec"]
    return [spec["headGroupSpec"], *spec["workerGroupSpecs"]]


def matches(selector: dict, labels: dict) -> bool:
    """A label selector (matchLabels, matchExpressions with In) against a pod's labels."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    return all(labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", [])
               if e["operator"] == "In")


@pytest.mark.parametrize("values", ALL, ids=ids)
def test_1_every_ray_pod_finds_the_warm_start_on_the_run_volume(values):
    """The head warm-starts into RL_CACHE_DIR; it is on the run volume that every Ray pod mounts (the workers
    were told a path under the head's own ~/.cache). rl/placement ships a copy where a node cannot see it
    (tests/test_ray_multinode.py)."""
    job = one(rendered(values), "RayJob")
    for t in pod_templates(job):
        c = t["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        data = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "data")
        assert env.get("RL_CACHE_DIR", "").startswith(f"{data}/"), t["metadata"]["labels"]


def test_3_a_private_registry_reaches_the_submitter_and_the_session_pods():
    docs = render(GPU)
    job = one(docs, "RayJob")
    head = pod_templates(job)[0]["spec"]
    submitter = job["spec"]["submitterPodTemplate"]["spec"]
    assert submitter["imagePullSecrets"] == head["imagePullSecrets"] == [{"name": "registry-credentials"}]
    container = submitter["containers"][0]
    assert container["image"] == head["containers"][0]["image"] == "registry.example.com/colocated-rl:0.1.0-cuda"
    assert "command" not in container and submitter["restartPolicy"] == "Never"  # KubeRay supplies `ray job submit`
    assert one(docs, "Deployment")["spec"]["template"]["spec"]["imagePullSecrets"] == head["imagePullSecrets"]
    # the session pods: the service's own flags -> its config -> the pod backend -> the pod it would create
    from sandbox import k8s_manifests as m
    from sandbox.kubernetes import KubernetesBackend

    args = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    sets = [a.removeprefix("--set=") for a in args if a.startswith("--set=")]
    assert "--backend=kubernetes" in args
    sc = load_config(QUICKSTART, sets).sandbox.model_copy(update={"backend": "kubernetes"})  # as rl sandbox serve does
    with KubeApiStandIn() as api:
        backend = KubernetesBackend(options=sc.backend_options, api_client=api.api_client(), reap_interval_s=0)
        try:
            pod = m.sandbox_pod(name="rl-sbx-1", namespace="rl", session_id="s1", owner="o1", image="swe:task",
                                **backend._pod_options)
        finally:
            backend.close()
    assert pod["spec"]["imagePullSecrets"] == [{"name": "registry-credentials"}]
    assert pod["metadata"]["labels"]["colocated-rl/run"] == "myrun"  # rl delete finds them by it
    # sessions take no part of the training's priority (issue 44, D7): sandbox.pods.priorityClassName, unset here
    assert "priorityClassName" not in pod["spec"] and pod["spec"]["runtimeClassName"] == "gvisor"
    assert validate_manifest(pod) == []


def test_2_the_gpu_example_launches_its_own_run_config():
    """gpu-cluster.yaml with configs/qwen3-8b-gpu.yaml, the pair its header names: the head's command line makes a
    valid run config (32 workers of one GPU each, the model from the hub)."""
    from rl.cli import main as rl_main

    config = QUICKSTART.parent / "qwen3-8b-gpu.yaml"
    docs = render(GPU, config=config)
    argv = train_args(docs)
    o = overrides(argv)
    assert o["cluster.workers"] == "32" and o["model.path"] == "Qwen/Qwen3-8B"
    cfg = load_config(config, [argv[i + 1] for i, a in enumerate(argv) if a == "--set"])
    assert cfg.cluster.workers == 32 and cfg.cluster.gpus_per_worker == 1 and cfg.model.chat_template
    assert rl_main(["check-config", str(config), *config_args(argv)]) == 0


# The KubeRay release that added each RayJob spec field the chart may set (KubeRay's release notes).
KUBERAY_SINCE = {"submissionMode": (1, 1), "activeDeadlineSeconds": (1, 1), "submitterPodTemplate": (1, 1),
                 "backoffLimit": (1, 2), "deletionStrategy": (1, 4)}


def test_4_the_chart_asks_for_the_kuberay_release_its_fields_need():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    required = tuple(int(x) for x in re.fullmatch(r"kuberay-operator >= (\d+)\.(\d+)",
                                                  chart["annotations"]["requires"]).groups())
    for values in ALL:
        spec = one(rendered(values), "RayJob")["spec"]
        for field, since in KUBERAY_SINCE.items():
            assert field not in spec or since <= required, f"{field} needs KubeRay {since}, the chart says {required}"


def test_5_default_storage_works_on_readwriteonce_classes(tmp_path):
    """Block storage (EBS, PD, Azure Disk) offers only ReadWriteOnce: the claim asks for that, and every worker
    pod goes to the head's node, where the volume is attached."""
    docs = render()
    assert one(docs, "PersistentVolumeClaim")["spec"]["accessModes"] == ["ReadWriteOnce"]
    job = one(docs, "RayJob")
    head_labels = pod_templates(job)[0]["metadata"]["labels"]
    for t in pod_templates(job)[1:]:
        [term] = t["spec"]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "kubernetes.io/hostname" and matches(term["labelSelector"], head_labels)
        assert not matches(term["labelSelector"], t["metadata"]["labels"])
    shared = render(sets=("storage.accessMode=ReadWriteMany",))
    assert one(shared, "PersistentVolumeClaim")["spec"]["accessModes"] == ["ReadWriteMany"]
    assert all("affinity" not in t["spec"] for t in pod_templates(one(shared, "RayJob")))
    # a worker's own affinity is kept beside the head's node
    own = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]}}}
    f = tmp_path / "v.yaml"
    f.write_text(yaml.safe_dump({"workerGroups": [{"name": "w", "replicas": 2, "cpu": "2", "memory": "4Gi",
                                                   "shmSize": "1Gi", "affinity": own}]}))
    affinity = pod_templates(one(render(f), "RayJob"))[1]["spec"]["affinity"]
    assert affinity["nodeAffinity"] == own["nodeAffinity"] and "podAffinity" in affinity
    # pods that cannot share the head's node need shared storage: said at install, naming the fix
    f.write_text(yaml.safe_dump({"workerGroups": [{"name": "gpu", "replicas": 1, "cpu": "8", "memory": "64Gi",
                                                   "gpus": 8, "nodeSelector": {"pool": "gpu"}}]}))
    proc = helm("template", "myrun", str(CHART), "--set-file", f"runConfig={QUICKSTART}", "--values", str(f),
                check=False)
    assert proc.returncode != 0
    assert "storage.accessMode ReadWriteOnce" in proc.stderr and "storage.accessMode=ReadWriteMany" in proc.stderr


@pytest.mark.parametrize("values", ALL, ids=ids)
def test_6_each_worker_pod_takes_exactly_the_workers_it_was_sized_for(values):
    """Each pod offers one rl_worker per colocated (or trainer) worker and one rl_rollout per replica of a rollout
    pod (rl/placement's bundles take one each), and Ray's CPU count is the pod's (the workers' threads follow from
    it, not from the node's cores); the run's cluster.workers and cluster.rollout_workers are their sums."""
    docs = rendered(values)
    job = one(docs, "RayJob")
    total = {"rl_worker": 0, "rl_rollout": 0}
    values_groups = (yaml.safe_load(values.read_text()) if values else {}).get("workerGroups") or \
        yaml.safe_load((CHART / "values.yaml").read_text())["workerGroups"]
    for group, given in zip(job["spec"]["rayClusterSpec"]["workerGroupSpecs"], values_groups, strict=True):
        params = group["rayStartParams"]
        slot, n = re.fullmatch(r'"\{\\"(rl_worker|rl_rollout)\\": (\d+)\}"', params["resources"]).groups()
        assert slot == ("rl_rollout" if given.get("role") == "rollout" else "rl_worker")
        assert int(n) == max(1, int(given.get("gpus", 0)))
        assert int(params["num-cpus"]) == int(parse_quantity(given["cpu"]))
        total[slot] += int(n) * group["replicas"]
    sets = overrides(train_args(docs))
    assert sets["cluster.workers"] == str(total["rl_worker"])
    assert sets.get("cluster.rollout_workers") == (str(total["rl_rollout"]) if total["rl_rollout"] else None)
    assert sets.get("cluster.placement") == ("disaggregated" if total["rl_rollout"] else None)


@pytest.mark.parametrize("values", ALL, ids=ids)
def test_7_the_object_store_fits_in_dev_shm(values):
    """Without object-store-memory Ray takes 30% of the pod's memory, more than /dev/shm, and falls back to
    disk."""
    job = one(rendered(values), "RayJob")
    for group in ray_groups(job):
        spec = group["template"]["spec"]
        shm = parse_quantity(next(v for v in spec["volumes"] if v["name"] == "dshm")["emptyDir"]["sizeLimit"])
        memory = parse_quantity(spec["containers"][0]["resources"]["limits"]["memory"])
        store = Decimal(group["rayStartParams"].get("object-store-memory") or memory * Decimal("0.3"))
        assert store <= shm / 2 and shm < memory


def test_7_dev_shm_larger_than_the_pods_memory_is_refused():
    proc = helm("template", "myrun", str(CHART), "--set-file", f"runConfig={QUICKSTART}", "--set", "head.shmSize=8Gi",
                check=False)
    assert proc.returncode != 0 and "head.shmSize 8Gi must be less than head.memory 8Gi" in proc.stderr


def test_9_names_kuberay_rejects_are_refused_at_render():
    proc = helm("template", "1run", str(CHART), "--set-file", f"runConfig={QUICKSTART}", check=False)
    assert proc.returncode != 0 and "must start with a lower-case letter" in proc.stderr
    assert release_name("1run") == "run-1run" and release_name("Math 16 GPU!") == "math-16-gpu"
    args = ["template", "run-1run", str(CHART), "--set-file", f"runConfig={QUICKSTART}"]
    assert helm(*args).returncode == 0


def test_10_scheduler_fields_reach_every_pod_of_the_run(tmp_path):
    affinity = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 1, "preference": {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["rl"]}]}}]}}
    tolerations = [{"key": "dedicated", "operator": "Equal", "value": "rl", "effect": "NoSchedule"}]
    f = tmp_path / "v.yaml"
    f.write_text(yaml.safe_dump({
        "scheduling": {"queueName": "team-a", "priorityClassName": "high", "serviceAccountName": "rl-runner",
                       "labels": {"team": "rl"}, "annotations": {"cost-center": "42"}},
        "head": {"affinity": affinity, "tolerations": tolerations},
        "sandbox": {"affinity": affinity, "tolerations": tolerations, "pods": {"tolerations": tolerations}},
        "storage": {"accessMode": "ReadWriteMany"}}))
    docs = render(f)
    job = one(docs, "RayJob")
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert job["metadata"]["labels"]["team"] == "rl" and job["metadata"]["annotations"] == {"cost-center": "42"}
    ray_pods = [*pod_templates(job), job["spec"]["submitterPodTemplate"]]
    for t in ray_pods:
        assert t["spec"]["priorityClassName"] == "high" and t["spec"]["serviceAccountName"] == "rl-runner"
        assert t["metadata"]["labels"]["team"] == "rl" and t["metadata"]["annotations"]["cost-center"] == "42"
    assert pod_templates(job)[0]["spec"]["affinity"] == affinity
    assert job["spec"]["submitterPodTemplate"]["spec"]["tolerations"] == tolerations
    sandbox = one(docs, "Deployment")["spec"]["template"]
    assert sandbox["spec"]["priorityClassName"] == "high" and sandbox["spec"]["affinity"] == affinity
    assert sandbox["metadata"]["labels"]["team"] == "rl" and sandbox["metadata"]["annotations"]["cost-center"] == "42"
    assert sandbox["spec"]["serviceAccountName"] == "myrun-sandbox"  # its own: the pod backend's RBAC
    args = sandbox["spec"]["containers"][0]["args"]
    assert '--set=sandbox.kubernetes.tolerations=[{"effect":"NoSchedule","key":"dedicated","operator":"Equal",' \
           '"value":"rl"}]' in args


def test_10_the_ray_dashboard_is_reachable_only_from_the_run_and_the_operator():
    docs = render(GPU)
    policy = next(d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "myrun-ray-head")
    job = one(docs, "RayJob")
    head, worker = (t["metadata"]["labels"] for t in pod_templates(job))
    submitter = job["spec"]["submitterPodTemplate"]["metadata"]["labels"]
    sandbox = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    session = {"colocated-rl/run": "myrun", "app.kubernetes.io/managed-by": "rl-sandbox"}
    spec = policy["spec"]
    assert matches(spec["podSelector"], head) and not matches(spec["podSelector"], worker)
    assert spec["policyTypes"] == ["Ingress"]
    # the example no longer opens 8265 to a /16 without Ray's token authentication, and the operator is admitted from
    # its own namespace only (issue 44, D1); the metrics ports admit the example's Prometheus (D10)
    own, operator, metrics = spec["ingress"]
    peer = own["from"][0]["podSelector"]
    assert "ports" not in own and all(matches(peer, x) for x in (head, worker, submitter))
    assert not matches(peer, sandbox) and not matches(peer, session)  # untrusted code never reaches the Jobs API
    assert not matches(peer, {**worker, "colocated-rl/run": "otherrun"})
    in_its_namespace = {"matchLabels": {"kubernetes.io/metadata.name": "kuberay-system"}}
    assert operator["from"] == [{"namespaceSelector": in_its_namespace, "podSelector": {"matchLabels": labels}}
                                for labels in ({"app.kubernetes.io/name": "kuberay-operator"},  # its Helm chart's
                                               {"app.kubernetes.io/component": "kuberay-operator"})]  # and kustomize's
    assert operator["ports"] == [{"protocol": "TCP", "port": 8265}]
    assert metrics["ports"] == [{"protocol": "TCP", "port": 9090}, {"protocol": "TCP", "port": 8080}]
    assert metrics["from"][0]["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    off = render(GPU, sets=("head.networkPolicy.enabled=false",))
    assert not [d for d in off if d["metadata"]["name"] == "myrun-ray-head"]
