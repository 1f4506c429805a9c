"""The Helm chart in helm/colocated-rl: lint and render every example values file, validate every
manifest (Kubernetes schemas + the KubeRay / Prometheus-operator CRD schemas in tests/data/crds),
reject bad values naming the field. The rendered RayJob entrypoint runs on a real multi-node Ray cluster in
tests/test_ray_multinode.py."""

from __future__ import annotations

import copy
import functools
import json
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from rl.cli import main as rl_main
from rl.launch import CHART, release_name
from tests.k8s_validation import helm_binary, validate_documents

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
HELM = helm_binary()
pytestmark = pytest.mark.skipif(HELM is None, reason="helm is not installed (make setup installs it)")


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([HELM, *args], capture_output=True, text=True, timeout=120)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def render(*values: Path | str, config: Path = QUICKSTART, sets: tuple[str, ...] = ()) -> list[dict]:
    """The manifests of ``helm template`` for these values, each validated (a render of the same values and files is
    done once per test session; every caller gets its own copy)."""
    files = tuple((str(v), Path(v).read_text()) for v in values)
    return copy.deepcopy(_render(files, str(config), Path(config).read_text(), tuple(sets)))


@functools.lru_cache(maxsize=64)
def _render(files: tuple[tuple[str, str], ...], config: str, _config_text: str, sets: tuple[str, ...]) -> list[dict]:
    args = ["template", "myrun", str(CHART), "--namespace", "rl", "--set-file", f"runConfig={config}"]
    for v, _ in files:
        args += ["--values", v]
    for s in sets:
        args += ["--set", s]
    text = helm(*args).stdout
    # Ray's token authentication (on by default where rayVersion >= 2.52) needs KubeRay >= 1.6, whose CRD has
    # authOptions: the 1.2.2 CRD's finding is what `rl launch` refuses on such an operator (test_helm_day_two, D1)
    errors = [e for e in validate_documents(text) if not e.endswith(AUTH_ON_OLD_KUBERAY)]
    assert not errors, "\n".join(errors)
    return [d for d in yaml.safe_load_all(text) if d]


AUTH_ON_OLD_KUBERAY = "spec.rayClusterSpec.authOptions: unknown field (did you mean 'autoscalerOptions'?) " \
    "(the kuberay v1.2.2 CRD)"


def one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind} objects"
    return found[0]


def run_configmap(docs: list[dict]) -> dict:
    """The run's ConfigMap (config.yaml and launch.sh; its name ends in a hash of them)."""
    return one([d for d in docs if d["kind"] == "ConfigMap" and "launch.sh" in (d.get("data") or {})], "ConfigMap")


def pod_templates(job: dict) -> list[dict]:
    spec = job["spec"]["rayClusterSpec"]
    return [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]


def train_args(docs: list[dict]) -> list[str]:
    """The command line of the ConfigMap's launch.sh: one, the same on every attempt (it resumes by itself)."""
    return train_command(run_configmap(docs)["data"]["launch.sh"])


def train_command(script: str) -> list[str]:
    """The one ``rl train`` command of a launch.sh (``exec rl train ...``, or ``rl train ... || status=$?`` where the
    script goes on after it), split as bash would, from ``rl`` to its last argument."""
    [line] = [shlex.split(x) for x in script.splitlines() if " rl train " in f" {x.strip()} "]
    line = line[line.index("rl"):]
    return line[: line.index("||")] if "||" in line else line


def sandbox_role(docs: list[dict], kind: str = "Role") -> dict:
    """The sandbox service's Role (or RoleBinding, ServiceAccount): the session pods' rights, not the run's own
    (myrun-run: scaling the sandbox's Deployment at the run's end)."""
    [doc] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith("-sandbox")]
    return doc


def config_args(argv: list[str]) -> list[str]:
    """The run-config overrides of a launch.sh command line (what follows --auto-resume)."""
    return argv[argv.index("--auto-resume") + 1:]


def overrides(argv: list[str]) -> dict[str, str]:
    return dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "--set")


def point_kubectl_at_nothing(tmp_path: Path, monkeypatch) -> None:
    """KUBECONFIG naming a cluster nobody listens on (127.0.0.1:9)."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:9"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}], "users": [{"name": "u", "user": {}}]}))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))


def test_the_examples_exist_and_lint():
    assert {p.name for p in EXAMPLES} >= {"cpu-demo.yaml", "gpu-cluster.yaml", "local-sandbox.yaml"}
    for values in [None, *EXAMPLES]:
        extra = ["--values", str(values)] if values else []
        proc = helm("lint", str(CHART), "--strict", "--set-file", f"runConfig={QUICKSTART}", *extra)
        assert "0 chart(s) failed" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("values", [None, *EXAMPLES], ids=lambda v: v.name if v else "defaults")
def test_every_example_renders_valid_manifests(values):
    docs = render(*([values] if values else []))
    job = one(docs, "RayJob")
    assert job["spec"]["entrypoint"] == "bash /etc/rl/launch.sh"
    cm = run_configmap(docs)
    assert yaml.safe_load(cm["data"]["config.yaml"]) == yaml.safe_load(QUICKSTART.read_text())
    for t in pod_templates(job):  # every Ray pod: the config, the run storage, a memory-backed /dev/shm
        mounts = {m["mountPath"] for m in t["spec"]["containers"][0]["volumeMounts"]}
        assert {"/etc/rl", "/data", "/dev/shm"} <= mounts
        shm = next(v for v in t["spec"]["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["medium"] == "Memory"
    argv = train_args(docs)
    assert argv[:6] == ["rl", "train", "/etc/rl/config.yaml", "--run-dir", "$run_dir", "--auto-resume"]
    # the overrides the head passes must make a valid run config; the GPU disaggregated example's is refused, as its
    # header says, until GPU point-to-point updates exist (rl launch stops there: tests/test_helm_disaggregated.py)
    runnable = values is None or values.stem != "gpu-disaggregated"
    assert rl_main(["check-config", str(QUICKSTART), *config_args(argv)]) == (0 if runnable else 2)


def test_gpu_example_sizes_workers_and_reaches_model_and_monitoring():
    docs = render(CHART / "examples" / "gpu-cluster.yaml")
    job = one(docs, "RayJob")
    group = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    assert group["replicas"] == 4
    c = group["template"]["spec"]["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "8" and c["image"].endswith("-cuda")
    assert group["template"]["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert group["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    data = next(v for v in group["template"]["spec"]["volumes"] if v["name"] == "data")
    claim = one(docs, "PersistentVolumeClaim")
    assert data["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"] and claim["spec"]["storageClassName"] == "shared-rwx"
    argv = train_args(docs)
    o = overrides(argv)
    assert o["cluster.workers"] == "32" and o["cluster.gpus_per_worker"] == "1"
    assert o["model.path"] == "Qwen/Qwen3-8B" and o["sandbox.address"] == "dns:///myrun-sandbox.rl.svc:50051"
    assert argv[-2:] == ["--set", "run.save_every=5"]
    # the release's own directory: a second release of these values does not share it (issue 44, D15)
    assert "run_dir='/data/runs/myrun'" in run_configmap(docs)["data"]["launch.sh"]
    assert job["spec"]["backoffLimit"] == 3 and job["spec"]["rayClusterSpec"]["rayVersion"] == "2.60.0"
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 16)
    assert "replicas" not in one(docs, "Deployment")["spec"]  # the HPA owns the replica count
    monitor = one(docs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert {e["port"] for e in monitor["spec"]["endpoints"]} == {"rl-metrics", "metrics"}
    dash = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "myrun-dashboard")
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dash["data"]["colocated-rl.json"])["panels"]


def test_sandbox_pod_backend_rbac_is_limited_and_sandboxes_get_no_egress():
    docs = render()
    role = sandbox_role(docs)
    assert role["metadata"]["namespace"] == "rl-myrun-sandbox"  # the session pods' namespace, not the run's
    # NetworkPolicies read, never made: they add up, and one the service made could reopen egress (issue 44, D5)
    assert sorted((tuple(r["apiGroups"]), tuple(r["resources"]), tuple(sorted(r["verbs"]))) for r in role["rules"]) \
        == [(("",), ("pods",), ("create", "delete", "get", "list", "watch")),
            (("coordination.k8s.io",), ("leases",), ("create", "delete", "get", "list", "patch")),
            (("networking.k8s.io",), ("networkpolicies",), ("get", "list"))]
    binding = sandbox_role(docs, "RoleBinding")
    assert binding["subjects"][0]["name"] == sandbox_role(docs, "ServiceAccount")["metadata"]["name"]
    assert binding["subjects"][0]["namespace"] == "rl" and binding["metadata"]["namespace"] == "rl-myrun-sandbox"
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]
    policy = next(d for d in docs if d["metadata"]["name"] == "myrun-sandbox-pods-deny-egress")["spec"]
    # the labels the pod backend puts on session pods, and the label its ingress rule admits
    from sandbox import k8s_manifests as m

    assert policy["podSelector"] == {}  # every pod of the session namespace, the backend's label or not (D5)
    assert policy["egress"] == [] and "Egress" in policy["policyTypes"]
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert m.DEFAULT_SERVICE_LABELS.items() <= pod_labels.items()
    assert policy["ingress"][0]["from"][0]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    args = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--backend=kubernetes" in args and "--set=sandbox.kubernetes.namespace=rl-myrun-sandbox" in args
    assert "--advertise-address=$(POD_IP):50051" in args  # sessions come back to their replica
    env = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["env"]
    assert env[0] == {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    assert one([d for d in docs if d["metadata"]["name"] == "myrun-sandbox"], "Service")["spec"]["clusterIP"] == "None"
    sets = [a.removeprefix("--set=") for a in args if a.startswith("--set=")]
    assert rl_main(["check-config", str(QUICKSTART), *[x for s in sets for x in ("--set", s)]]) == 0


def test_local_sandbox_backend_is_privileged_without_rbac_or_egress():
    docs = render(CHART / "examples" / "local-sandbox.yaml")
    assert not [d for d in docs if d["kind"] in ("Role", "RoleBinding") and d["metadata"]["name"].endswith("-sandbox")]
    assert sandbox_role(docs, "ServiceAccount")["automountServiceAccountToken"] is False
    pod = one(docs, "Deployment")["spec"]["template"]
    assert pod["spec"]["containers"][0]["securityContext"]["privileged"] is True
    policy = next(d for d in docs if d["metadata"]["name"] == "myrun-sandbox-deny-egress")["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert policy["egress"] == [] and policy["policyTypes"] == ["Egress"]
    job = one(docs, "RayJob")
    assert len(job["spec"]["rayClusterSpec"]["workerGroupSpecs"]) == 2
    assert overrides(train_args(docs))["cluster.workers"] == "3"
    assert one(docs, "PodMonitor")["spec"]["podMetricsEndpoints"][0]["interval"] == "15s"
    # no scrape annotations (metrics.scrapeAnnotations false); the do-not-disrupt ones stay (issue 44, D6)
    annotations = pod_templates(job)[0]["metadata"]["annotations"]
    assert not [k for k in annotations if k.startswith("prometheus.io/")] and annotations["karpenter.sh/do-not-disrupt"]


@pytest.mark.parametrize(("values", "named"), [
    ({"workerGroups": [{"name": "w", "replicas": "2", "cpu": "4", "memory": "8Gi"}]}, "/workerGroups/0/replicas"),
    ({"sandbox": {"bakend": "local"}}, "'bakend'"),
    ({"sandbox": {"backend": "docker"}}, "/sandbox/backend"),
    ({"head": {"memory": "lots"}}, "/head/memory"),
    ({"workerGroups": [{"name": "GPU_Pool", "replicas": 1, "cpu": "4", "memory": "8Gi"}]}, "/workerGroups/0/name"),
    ({"metrics": {"podMonitor": {"interval": 30}}}, "/metrics/podMonitor/interval"),
    ({"storage": {"accessModes": ["ReadWriteMany"]}}, "'accessModes'"),
    ({"storage": {"accessMode": "ReadWriteOncePod"}}, "/storage/accessMode"),
    ({"scheduling": {"labels": {"bad key!": "x"}}}, "/scheduling/labels"),
    ({"head": {"networkPolicy": {"dashboardCIDRs": ["everyone"]}}}, "/head/networkPolicy/dashboardCIDRs/0"),
    ({"imagePullSecrets": [{"name": "Registry_Creds"}]}, "/imagePullSecrets/0/name"),
])
def test_bad_values_fail_naming_the_field(tmp_path, values, named):
    f = tmp_path / "values.yaml"
    f.write_text(yaml.safe_dump(values))
    for verb in (["template"], ["install", "--dry-run=client"]):
        proc = helm(*verb, "myrun", str(CHART), "--set-file", f"runConfig={QUICKSTART}", "--values", str(f),
                    check=False)
        assert proc.returncode != 0 and named in proc.stderr, proc.stderr


def test_missing_run_config_is_named():
    proc = helm("template", "myrun", str(CHART), check=False)
    assert proc.returncode != 0 and "runConfig" in proc.stderr


def test_rl_launch_dry_run_prints_the_manifests(capsys):
    assert rl_main(["launch", "--k8s", str(QUICKSTART), "--values", str(CHART / "examples" / "cpu-demo.yaml"),
                    "--namespace", "rl", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert not validate_documents(text)
    job = one([d for d in yaml.safe_load_all(text) if d], "RayJob")
    assert job["metadata"]["name"] == release_name("quickstart") == "quickstart"


def test_rl_launch_errors_name_the_problem(tmp_path, capsys, monkeypatch):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  samples_per_prompt: 1\n")
    assert rl_main(["launch", "--k8s", str(bad), "--dry-run"]) == 2
    assert "rollout.samples_per_prompt" in capsys.readouterr().err
    assert rl_main(["launch", "--k8s", str(QUICKSTART), "--values", str(tmp_path / "none.yaml")]) == 2
    assert "none.yaml: no such file" in capsys.readouterr().err
    assert rl_main(["launch", "--k8s", str(QUICKSTART), "--set", "sandbox.backend=docker", "--dry-run"]) == 2
    assert "/sandbox/backend" in capsys.readouterr().err
    point_kubectl_at_nothing(tmp_path, monkeypatch)  # no cluster: a runtime failure (1), naming the server
    assert rl_main(["launch", "--k8s", str(QUICKSTART)]) == 1
    err = capsys.readouterr().err
    assert "reading RayJob rl/quickstart" not in err and "127.0.0.1:9" in err and "cannot reach" in err


def test_rl_status_describes_the_rayjob():
    from rl.launch import describe_rayjob

    job = {"metadata": {"name": "quickstart"},
           "status": {"jobStatus": "RUNNING", "jobDeploymentStatus": "Running", "rayClusterName": "quickstart-x7k2p",
                      "dashboardURL": "quickstart-x7k2p-head-svc.rl.svc.cluster.local:8265",
                      "jobId": "quickstart-abcde", "startTime": "2026-11-22T20:00:00Z", "failed": 0}}
    text = describe_rayjob(job)
    assert text.splitlines()[0] == "run quickstart: job RUNNING, deployment Running"
    assert "ray cluster: quickstart-x7k2p" in text and "dashboard: quickstart-x7k2p-head-svc" in text
    assert "started: 2026-11-22T20:00:00Z" in text and "ended" not in text and "failed attempts: 0" in text
    assert describe_rayjob({"metadata": {"name": "new"}}) == "run new: job PENDING, deployment New"
