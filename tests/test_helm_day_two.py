"""The chart on a shared production cluster, day two (issue 44): one test per defect D1-D19 of the review of the
render, each failing on the chart before it, read from the render (validated as in test_helm_chart.py: the
Kubernetes schemas, KubeRay's v1.2.2 and v1.7.0 CRDs and what the operator refuses). The reachability matrix, RBAC,
capabilities, digests, PDB and quota are checked for every example in test_k8s_policy.py; what runs (launch.sh, the
init containers' commands, the deadline, the backend's policy check, the admission policy) in test_k8s_day_two.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from rl.config import load_config
from rl.launch import CHART
from sandbox import k8s_manifests as m
from tests.k8s_policy import pod_templates
from tests.k8s_validation import validate_documents
from tests.test_helm_chart import EXAMPLES, HELM, QUICKSTART, helm, one, render, run_configmap, train_args

pytestmark = pytest.mark.skipif(HELM is None, reason="helm is not installed (make setup installs it)")
ROOT = Path(__file__).resolve().parents[1]
GPU = CHART / "examples" / "gpu-cluster.yaml"
GPU_CONFIG = QUICKSTART.parent / "qwen3-8b-gpu.yaml"
AGENT = ("sandbox.pods.agentImage.repository=registry.example.com/agent", "sandbox.pods.agentImage.tag=v1")


def refused(*sets: str) -> str:
    """helm template's error for values the chart must refuse."""
    args = [x for s in sets for x in ("--set", s)]
    proc = helm("template", "myrun", str(CHART), "-n", "rl", "--set-file", f"runConfig={QUICKSTART}", *args,
                check=False)
    assert proc.returncode != 0, "rendered, but should have been refused"
    return proc.stderr


def values(tmp_path: Path, data: dict) -> Path:
    f = tmp_path / "values.yaml"
    f.write_text(yaml.safe_dump(data))
    return f


def gpu_group(**extra) -> dict:
    return {"name": "gpu", "replicas": 1, "cpu": "96", "memory": "1600Gi", "gpus": 8, "shmSize": "256Gi", **extra}


def ray(docs: list[dict]) -> dict[str, dict]:
    return {where: t for where, t in pod_templates(docs) if where.startswith("ray-")}


def service_args(docs: list[dict]) -> dict[str, str]:
    """The sandbox service's --set=sandbox.kubernetes.KEY=VALUE arguments."""
    args = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    return dict(a.removeprefix("--set=sandbox.kubernetes.").split("=", 1) for a in args
                if a.startswith("--set=sandbox.kubernetes."))


# --- D1: the Jobs API -------------------------------------------------------------------------------------------------

def test_d1_the_dashboard_opens_to_addresses_only_with_ray_token_auth():
    """dashboardCIDRs opened 8265 (code execution on every GPU of the run) to a /16 with no authentication."""
    assert "rayJob.authToken=true" in refused("head.networkPolicy.dashboardCIDRs={10.8.0.0/16}")
    assert "needs rayJob.rayVersion 2.52.0" in refused("rayJob.authToken=true", "rayJob.rayVersion=2.49.0")
    sets = ("head.networkPolicy.dashboardCIDRs={10.8.0.0/16}", "rayJob.authToken=true", "rayJob.rayVersion=2.60.0")
    text = helm("template", "myrun", str(CHART), "-n", "rl", "--set-file", f"runConfig={QUICKSTART}",
                *[x for s in sets for x in ("--set", s)]).stdout
    # KubeRay 1.2.2's API server would drop authOptions (KubeRay >= 1.6 has it): the docs say so, and the check does
    assert validate_documents(text) == [
        "RayJob/myrun (colocated-rl/templates/rayjob.yaml): spec.rayClusterSpec.authOptions: unknown field (did you "
        "mean 'autoscalerOptions'?) (the kuberay v1.2.2 CRD)"]
    docs = [d for d in yaml.safe_load_all(text) if d]
    assert one(docs, "RayJob")["spec"]["rayClusterSpec"]["authOptions"] == {"mode": "token"}
    policy = next(d for d in docs if d["metadata"]["name"] == "myrun-ray-head")["spec"]
    assert {"from": [{"ipBlock": {"cidr": "10.8.0.0/16"}}], "ports": [{"protocol": "TCP", "port": 8265}]} \
        in policy["ingress"]
    gpu = yaml.safe_load(GPU.read_text())
    assert "dashboardCIDRs" not in gpu["head"]["networkPolicy"] and gpu["head"]["networkPolicy"]["operatorNamespace"]


# --- D2: RDMA memory as non-root ------------------------------------------------------------------------------------

def test_d2_rdma_pinning_is_the_nodes_or_a_root_workers_never_a_lost_capability(tmp_path):
    err = refused("workerGroups[0].name=w", "workerGroups[0].replicas=1", "workerGroups[0].cpu=2000m",
                  "workerGroups[0].memory=16Gi", "workerGroups[0].capabilities={IPC_LOCK}")
    assert "lost at the first execve of a non-root process" in err and "memlock=node" in err
    for memlock, uid, caps, init in (("node", 1000, None, ["check-memlock"]), ("root", 0, ["IPC_LOCK"], None)):
        group = gpu_group(memlock=memlock, **({"capabilities": caps} if caps else {}))
        docs = render(values(tmp_path, {"workerGroups": [group]}), sets=AGENT)
        spec = ray(docs)["ray-worker gpu"]["spec"]
        c = spec["containers"][0]
        assert spec["securityContext"]["runAsUser"] == uid and c["securityContext"]["capabilities"].get("add") == caps
        assert [i["name"] for i in spec.get("initContainers", [])] == (init or [])
        assert spec["securityContext"]["fsGroup"] == 1000  # the run volume stays the run's either way


# --- D3: hostNetwork workers ----------------------------------------------------------------------------------------

def test_d3_host_network_workers_go_one_per_node_of_any_run(tmp_path):
    docs = render(values(tmp_path, {"workerGroups": [{"name": "w", "replicas": 4, "cpu": "4", "memory": "16Gi",
                                                      "hostNetwork": True}],
                                    "storage": {"accessMode": "ReadWriteMany"}, "rayJob": {"rayVersion": "2.60.0"},
                                    "networkPolicy": {"nodeCIDRs": ["10.0.0.0/16"]}}))
    t = ray(docs)["ray-worker w"]
    [term] = t["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname" and term["namespaceSelector"] == {}  # every namespace
    assert m.selects(term["labelSelector"], t["metadata"]["labels"])  # its own kind, of this run or another
    assert not m.selects(term["labelSelector"], ray(render())["ray-worker workers"]["metadata"]["labels"])


def test_n9_gpu_and_cpu_worker_groups_together_are_refused_and_gpu_groups_are_counted_whole(tmp_path):
    """A colocated run counts every worker as run.gpusPerWorker GPUs: a CPU group beside GPU groups made 18 GPU
    bundles for 16 GPUs (never placed). Refused in one line; GPU groups alone ask for exactly their GPUs."""
    cpu = {"name": "cpu", "replicas": 2, "cpu": "8", "memory": "32Gi"}
    mixed = values(tmp_path, {"workerGroups": [gpu_group(replicas=2), cpu], "storage": {"accessMode": "ReadWriteMany"}})
    proc = helm("template", "myrun", str(CHART), "-n", "rl", "--set-file", f"runConfig={QUICKSTART}", "--values",
                str(mixed), *[x for s in AGENT for x in ("--set", s)], check=False)
    err = proc.stderr.split("\n")[0]
    assert proc.returncode != 0
    assert 'workerGroups mix GPU groups ["gpu"] and CPU groups ["cpu"]' in err, proc.stderr
    docs = render(values(tmp_path, {"workerGroups": [gpu_group(replicas=2), gpu_group(name="gpu2", replicas=1)],
                                    "storage": {"accessMode": "ReadWriteMany"}}), sets=AGENT)
    argv = train_args(docs)
    sets = dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "--set")
    assert int(sets["cluster.workers"]) * int(sets["cluster.gpus_per_worker"]) == 3 * 8  # the pods' GPUs, no more


# --- D4: a run's session pods are its namespace's -------------------------------------------------------------------

def test_d4_session_pods_carry_the_runs_name_and_namespace():
    """rl delete and the owner leases found session pods by the run's name only: a same-named run elsewhere too."""
    labels = json.loads(service_args(render())["labels"])
    assert labels == {"colocated-rl/run": "myrun", "colocated-rl/run-namespace": "rl"}
    options = load_config(QUICKSTART, [f"sandbox.kubernetes.labels={json.dumps(labels)}"]).sandbox.kubernetes
    pod = m.sandbox_pod(name="p", namespace="s", session_id="s", owner="o", image="i", agent_image="a",
                        labels=options.labels)
    assert labels.items() <= pod["metadata"]["labels"].items()


# --- D5: the session namespace --------------------------------------------------------------------------------------

def test_d5_the_session_namespace_is_bounded_by_rbac_policy_and_admission():
    docs = render()
    ns = service_args(docs)["namespace"]
    [role] = [d for d in docs if d["kind"] == "Role" and d["metadata"].get("namespace") == ns]
    assert [r["verbs"] for r in role["rules"] if "networkpolicies" in r["resources"]] == [["get", "list"]]
    [policy] = [d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"].get("namespace") == ns]
    assert policy["spec"]["podSelector"] == {} and policy["spec"]["egress"] == []
    vap = one(docs, "ValidatingAdmissionPolicy")
    binding = one(docs, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"]["policyName"] == vap["metadata"]["name"] and binding["spec"]["validationActions"] == ["Deny"]
    assert binding["spec"]["matchResources"]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": ns}
    assert "system:serviceaccount:rl:myrun-sandbox" in vap["spec"]["matchConditions"][0]["expression"]
    proc = helm("template", "myrun", str(CHART), "-n", "rl", "--set-file", f"runConfig={QUICKSTART}",
                "--kube-version", "1.29.0", check=False)
    assert proc.returncode != 0 and "ValidatingAdmissionPolicy" in proc.stderr and "1.30" in proc.stderr
    # N3: the example's session namespace is each release's own (it named one every release of it would share)
    assert "name" not in yaml.safe_load(GPU.read_text())["sandbox"]["sessionNamespace"]
    for release in ("math-32gpu", "math-32gpu-b"):
        text = helm("template", release, str(CHART), "-n", "rl", "--set-file", f"runConfig={QUICKSTART}", "--values",
                    str(GPU)).stdout
        [ns] = [d for d in yaml.safe_load_all(text) if d and d["kind"] == "ValidatingAdmissionPolicyBinding"]
        assert ns["spec"]["matchResources"]["namespaceSelector"]["matchLabels"] == {
            "kubernetes.io/metadata.name": f"rl-{release}-sandbox"}


# --- D6: disruptions ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("example", [None, *EXAMPLES], ids=lambda v: v.stem if v else "defaults")
def test_d6_ray_pods_are_kept_from_consolidation_and_checkpoint_when_stopped(example):
    docs = render(*([example] if example else []), config=GPU_CONFIG if example == GPU else QUICKSTART)
    grace = (yaml.safe_load(example.read_text()) if example else {}).get("disruption", {}).get(
        "terminationGracePeriodSeconds", 300)
    for where, t in ray(docs).items():
        if where == "ray-submitter":
            continue
        # a disaggregated run's rollout pod may go (the run replaces its replica): no hold, no stop asked
        held = t["metadata"]["labels"].get("colocated-rl/role") != "rollout"
        assert (t["metadata"]["annotations"].get("karpenter.sh/do-not-disrupt") == "true") is held, where
        assert (t["metadata"]["annotations"].get("cluster-autoscaler.kubernetes.io/safe-to-evict") == "false") is held
        assert t["spec"]["terminationGracePeriodSeconds"] == grace, where
        stop = t["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
        assert stop[:2] == ["sh", "-c"] and ("stop-requested" in stop[2]) is held, where
        assert f"-lt {grace - 10}" in stop[2] or not held, where
        assert 'dst="$d/logs/ray/$(hostname)"' in stop[2], where  # every pod keeps its Ray logs
    script = run_configmap(docs)["data"]["launch.sh"]
    assert 'tee -a "$run_dir/logs/attempt-' in script  # a failed attempt's console outlives its submitter pod


def test_d6_without_kueue_the_notes_say_each_preemption_uses_a_retry():
    notes = helm("install", "--dry-run=client", "myrun", str(CHART), "-n", "rl", "--set-file",
                 f"runConfig={QUICKSTART}").stdout.split("NOTES:", 1)[1]
    assert "each preemption of a Ray pod fails an attempt and uses one of the 3 retries" in notes
    notes = helm("install", "--dry-run=client", "myrun", str(CHART), "-n", "rl", "--set-file",
                 f"runConfig={QUICKSTART}", "--set", "scheduling.queueName=gpu").stdout.split("NOTES:", 1)[1]
    assert "a preemption suspends it" in notes
    assert "KubeRay refuses to suspend" in refused("scheduling.queueName=gpu", "rayJob.shutdownAfterJobFinishes=false")


# --- D7: the sandbox fleet's bounds ---------------------------------------------------------------------------------

def test_d7_sessions_have_their_own_priority_a_quota_and_a_fleet_wide_rate():
    docs = render(GPU, config=GPU_CONFIG)
    args = service_args(docs)
    assert "priority_class" not in args  # was the training's rl-training: sessions preempted nothing for it
    assert float(args["max_creates_per_s"]) * 16 == 50  # the fleet's 50/s over its 16 replicas at most
    [quota] = [d for d in docs if d["kind"] == "ResourceQuota"]
    assert quota["spec"]["hard"] == {"pods": "4096", "requests.cpu": "8192000m", "limits.memory": "16777216Mi"}
    default = one(render(), "ResourceQuota")["spec"]["hard"]
    assert default["pods"] == str(256 * 4)  # maxSessions x the autoscaler's most replicas
    assert service_args(render(sets=("sandbox.pods.priorityClassName=sessions",)))["priority_class"] == "sessions"


# --- D8: the agent image --------------------------------------------------------------------------------------------

def test_d8_session_pods_pull_a_small_agent_image_not_the_cuda_one(tmp_path):
    err = refused("workerGroups[0].name=gpu", "workerGroups[0].replicas=1", "workerGroups[0].cpu=8000m",
                  "workerGroups[0].memory=64Gi", "workerGroups[0].gpus=1")
    assert "sandbox.pods.agentImage" in err and "docker/Dockerfile.agent" in err
    docs = render(GPU, config=GPU_CONFIG)
    agent = service_args(docs)["agent_image"]
    assert agent == "registry.example.com/colocated-rl-agent:0.1.0"
    assert agent not in {c["image"] for t in ray(docs).values() for c in t["spec"]["containers"]}
    assert (ROOT / "docker" / "Dockerfile.agent").is_file()


# --- D9: pinned images ----------------------------------------------------------------------------------------------

def test_d9_a_mutable_tag_pulled_always_is_refused_and_the_ray_version_is_checked():
    assert "image.digest" in refused("image.pullPolicy=Always")
    docs = render(sets=("image.pullPolicy=Always", "image.digest=sha256:" + "0" * 64, "rayJob.rayVersion=2.60.0"))
    head = ray(docs)["ray-head"]["spec"]
    [check] = [i for i in head["initContainers"] if i["name"] == "check-image"]
    assert check["command"][:2] == ["python3", "-c"] and "'2.60.0'" in check["command"][2]
    gpu = yaml.safe_load(GPU.read_text())
    assert gpu["image"]["pullPolicy"] == "IfNotPresent" and "digest" in gpu["image"]


# --- D10: metrics and logs ------------------------------------------------------------------------------------------

def test_d10_ray_exports_metrics_on_every_ray_pod_and_logs_to_stderr(tmp_path):
    docs = render(GPU, config=GPU_CONFIG)
    job = one(docs, "RayJob")["spec"]["rayClusterSpec"]
    for group in [job["headGroupSpec"], *job["workerGroupSpecs"]]:
        assert group["rayStartParams"]["metrics-export-port"] == "8080"
        c = group["template"]["spec"]["containers"][0]
        assert {"containerPort": 8080, "name": "metrics"} in c["ports"]
        assert {"name": "RAY_LOG_TO_STDERR", "value": "1"} in c["env"]
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "myrun-metrics")
    assert {"name": "metrics", "port": 8080, "targetPort": "metrics"} in service["spec"]["ports"]
    for where, t in ray(docs).items():
        if where != "ray-submitter":
            assert m.selects({"matchLabels": service["spec"]["selector"]}, t["metadata"]["labels"]), where
    assert {e["port"] for e in one(docs, "ServiceMonitor")["spec"]["endpoints"]} == {"rl-metrics", "metrics"}


# --- D11: what leaves the cluster -----------------------------------------------------------------------------------

def test_d11_n4_the_final_model_goes_to_object_storage_with_credentials_only_the_export_container_mounts():
    """N4: the export's keys were model.credentialsSecret's (the download's), mounted in the head's Ray container,
    readable by the driver and any code the Jobs API runs. Now storage.export.credentialsSecret is mounted in the
    head's export container alone, which uploads what launch.sh asks for."""
    docs = render(GPU, config=GPU_CONFIG)
    head = ray(docs)["ray-head"]["spec"]
    [volume] = [v for v in head["volumes"] if v["name"] == "export-credentials"]
    assert volume["secret"]["secretName"] == "export-credentials"
    ray_head, export = head["containers"]
    assert ray_head["name"] == "ray-head" and export["name"] == "export"
    mounts = {c["name"]: {m["name"] for m in c.get("volumeMounts", [])} for c in [*head["initContainers"], ray_head]}
    assert all("export-credentials" not in m for m in mounts.values()) and "envFrom" not in ray_head
    assert {"name": "export-credentials", "mountPath": "/var/run/rl-export", "readOnly": True} in export["volumeMounts"]
    assert export["command"] == ["python3", "-m", "engines.model.io.upload_service", "serve",
                                 "/data/runs/myrun/.exports", "--allow", "s3://rl-results/qwen3-8b-math", "--root",
                                 "/data/runs", "--credentials-dir", "/var/run/rl-export"]
    [fetch] = [c for c in head["initContainers"] if c["name"] == "fetch-model"]  # the download keeps its own
    assert fetch["envFrom"] == [{"secretRef": {"name": "run-credentials"}}]
    script = run_configmap(docs)["data"]["launch.sh"]
    assert ("python3 -m engines.model.io.upload_service request \"$run_dir/.exports\" \"$run_dir/final\" "
            "'s3://rl-results/qwen3-8b-math/final'") in script
    assert "--newest-checkpoint" not in script  # checkpoints only when asked for
    script = run_configmap(render(GPU, config=GPU_CONFIG, sets=("storage.export.checkpoints=true",)))["data"][
        "launch.sh"]
    assert "\"$run_dir/checkpoints\" 's3://rl-results/qwen3-8b-math/checkpoints' --newest-checkpoint" in script
    assert all(not any(v["name"] == "export-credentials" for v in t["spec"].get("volumes", []))
               for w, t in ray(docs).items() if w != "ray-head")
    err = refused("storage.export.uri=s3://rl-results/x", "model.credentialsSecret=run-credentials")
    assert "storage.export.uri s3://rl-results/x takes its credentials from storage.export.credentialsSecret" in err


def test_d11_the_notes_print_sizes_only_for_the_models_own_parameters():
    def notes(*sets: str) -> str:
        args = [x for s in sets for x in ("--set", s)]
        return helm("install", "--dry-run=client", "myrun", str(CHART), "-n", "rl", "--set-file",
                    f"runConfig={QUICKSTART}", *args).stdout.split("NOTES:", 1)[1]

    assert "GB" not in notes() and "Qwen" not in notes()  # was ~90 GB per checkpoint for any model
    assert "~770 GB per checkpoint, ~3080 GB in all" in notes("model.parametersBillions=70")


# --- D12: volumes that ignore fsGroup -------------------------------------------------------------------------------

def test_d12_the_head_checks_the_volume_is_writable_and_can_fix_its_owner():
    head = ray(render())["ray-head"]["spec"]
    assert [i["name"] for i in head["initContainers"]] == ["check-volume"]
    fixed = ray(render(sets=("storage.fixOwnership=true",)))["ray-head"]["spec"]
    owner, check = fixed["initContainers"][:2]
    assert (owner["name"], check["name"]) == ("volume-owner", "check-volume")
    assert owner["securityContext"]["runAsUser"] == 0
    assert owner["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    assert owner["command"] == ["sh", "-c", "chown 1000:1000 /data && chmod u+rwx /data"]


# --- D13: upgrades and GitOps ---------------------------------------------------------------------------------------

def test_d13_an_upgrade_makes_a_new_configmap_and_the_token_can_be_a_secret_of_ones_own(tmp_path):
    one_run = render()
    cm = run_configmap(one_run)
    assert cm["immutable"] is True and re.fullmatch(r"myrun-config-[0-9a-f]{10}", cm["metadata"]["name"])
    assert run_configmap(render())["metadata"]["name"] == cm["metadata"]["name"]  # the same values, the same name
    other = render(sets=("run.extraArgs={--set,run.save_every=3}",))
    assert run_configmap(other)["metadata"]["name"] != cm["metadata"]["name"]
    for t in [*ray(one_run).values(), one(one_run, "Deployment")["spec"]["template"]]:
        names = [v["configMap"]["name"] for v in t["spec"].get("volumes", []) if "configMap" in v]
        assert names in ([], [cm["metadata"]["name"]])
    docs = render(sets=("sandbox.tokenSecret=rl-sandbox-token",))
    assert not [d for d in docs if d["kind"] == "Secret"]
    for t in [*ray(docs).values(), one(docs, "Deployment")["spec"]["template"]]:
        for e in t["spec"]["containers"][0].get("env", []):
            if e["name"] == "RL_SANDBOX_TOKEN":
                assert e["valueFrom"]["secretKeyRef"]["name"] == "rl-sandbox-token"


# --- D14: a busy sandbox replica is not restarted -------------------------------------------------------------------

def test_d14_the_liveness_probe_does_not_restart_a_busy_replica():
    c = one(render(GPU, config=GPU_CONFIG), "Deployment")["spec"]["template"]["spec"]["containers"][0]
    probe = c["livenessProbe"]
    assert "httpGet" not in probe and probe["tcpSocket"] == {"port": "grpc"}
    assert probe["timeoutSeconds"] >= 5 and probe["periodSeconds"] * probe["failureThreshold"] >= 120


# --- D15: one run per run directory ---------------------------------------------------------------------------------

def test_d15_the_run_directory_is_the_releases_unless_named_and_then_guarded():
    assert "name" not in (yaml.safe_load(GPU.read_text())["run"])  # the example fixed math-32gpu for every release
    script = run_configmap(render(GPU, config=GPU_CONFIG))["data"]["launch.sh"]
    assert "run_dir='/data/runs/myrun'" in script and "owner='rl/myrun'" in script
    assert 'belongs to run $(cat "$run_dir/.owner")' in script


# --- D16: the API server from the head ------------------------------------------------------------------------------

def test_d16_egress_mode_needs_and_admits_the_api_server():
    assert "apiServerCIDRs" in refused("sandbox.enabled=false", "networkPolicy.egress.enabled=true")


# --- D17: gVisor or an explicit choice ------------------------------------------------------------------------------

def test_d17_session_pods_run_under_gvisor_unless_none_is_chosen():
    assert service_args(render())["runtime_class"] == "gvisor"  # was unset: auto, falling back to the node's kernel
    assert service_args(render(CHART / "examples" / "cpu-demo.yaml"))["runtime_class"] == "none"
    options = load_config(QUICKSTART, ["sandbox.kubernetes.runtime_class=gvisor"]).sandbox.kubernetes
    assert options.runtime_class == "gvisor"


# --- D18: the deadline, tokens, ephemeral storage -------------------------------------------------------------------

def test_d18_the_deadline_spans_retries_workers_carry_no_token_and_disk_is_requested():
    docs = render(GPU, config=GPU_CONFIG)
    script = run_configmap(docs)["data"]["launch.sh"]
    assert "python3 -m rl.launch deadline myrun --namespace rl --limit 172800" in script
    assert 'timeout --signal=TERM --kill-after=60 "$left" rl train' in script
    for where, t in ray(docs).items():
        assert t["spec"].get("automountServiceAccountToken", True) is (where == "ray-head"), where
        assert "ephemeral-storage" in t["spec"]["containers"][0]["resources"]["requests"], where
    service = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert "ephemeral-storage" in service["resources"]["requests"]


# --- D19: one GPU pod on ReadWriteOnce, other schedulers ------------------------------------------------------------

def test_d19_readwriteonce_needs_the_head_to_tolerate_the_gpu_nodes(tmp_path):
    taint = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    proc = helm("template", "myrun", str(CHART), "-n", "rl", "--set-file", f"runConfig={QUICKSTART}", "--values",
                str(values(tmp_path, {"workerGroups": [gpu_group(tolerations=[taint])]})), *["--set", AGENT[0]],
                *["--set", AGENT[1]], check=False)
    assert proc.returncode != 0 and "tolerates the taint" in proc.stderr and "head.tolerations" in proc.stderr
    docs = render(values(tmp_path, {"workerGroups": [gpu_group(tolerations=[taint])], "head": {"tolerations": [taint]},
                                    "scheduling": {"schedulerName": "volcano"}}), sets=AGENT)
    for where, t in ray(docs).items():
        assert t["spec"]["schedulerName"] == "volcano", where
    doc = (ROOT / "docs" / "gpu-cluster.md").read_text()
    for name in ("Volcano", "YuniKorn", "KAI", "kueue.x-k8s.io/podset-required-topology"):
        assert name in doc, name
