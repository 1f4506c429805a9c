"""``rl status``, ``rl logs``, ``rl delete``, ``rl launch`` of a name that exists (``--replace``) and the exit codes,
through the real ``kubernetes`` client (and helm, where it is called) against ``KubeApiStandIn`` -- a test double of
the Kubernetes API server, since none can run here -- and against no server at all."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from rl.cli import main as rl_main
from rl.errors import CommandFailed
from rl.launch import CHART, RUN_LABEL, RUN_NAMESPACE_LABEL, Kube, own_by_rayjob
from tests.k8s_validation import helm_binary
from tests.kube_standin import KubeApiStandIn

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
NS = "rl"
PODS, RAYJOBS, CLAIMS = "api/v1/pods", "apis/ray.io/v1/rayjobs", "api/v1/persistentvolumeclaims"
pytestmark = pytest.mark.skipif(helm_binary() is None, reason="helm is not installed (make setup installs it)")


def kubeconfig(tmp_path: Path, monkeypatch, server: str) -> None:
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "c", "cluster": {"server": server}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u", "namespace": NS}}],
        "users": [{"name": "u", "user": {}}]}))
    monkeypatch.setenv("KUBECONFIG", str(path))


@pytest.fixture
def api(tmp_path, monkeypatch):
    """The stand-in, with kubectl's configuration (KUBECONFIG) pointing at it, namespace rl."""
    with KubeApiStandIn() as standin:
        kubeconfig(tmp_path, monkeypatch, standin.url)
        standin.seed("api/v1/pods", operator_pod("default", {"app.kubernetes.io/name": "kuberay-operator",
                                                             "app.kubernetes.io/component": "kuberay-operator"}))
        yield standin


def operator_pod(namespace: str, labels: dict[str, str]) -> dict:
    """A running KubeRay operator pod (rl launch refuses a cluster without one), labelled as an install labels it."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "kuberay-operator-0", "namespace": namespace,
                                                             "labels": labels},
            "spec": {"containers": [{"name": "c", "image": "i"}]}, "status": {"phase": "Running"}}


def rayjob(name: str, job: str = "RUNNING", deployment: str = "Running") -> dict:
    return {"apiVersion": "ray.io/v1", "kind": "RayJob",
            "metadata": {"name": name, "namespace": NS, "labels": {RUN_LABEL: name}},
            "spec": {"entrypoint": "bash /etc/rl/launch.sh"},
            "status": {"jobStatus": job, "jobDeploymentStatus": deployment, "rayClusterName": f"{name}-x7k2p",
                       "dashboardURL": f"{name}-x7k2p-head-svc.{NS}.svc.cluster.local:8265", "failed": 0}}


def pod(name: str, run: str, component: str | None, phase: str = "Running", waiting: str | None = None) -> dict:
    labels = {RUN_LABEL: run, **({"app.kubernetes.io/component": component} if component else
                                 {"app.kubernetes.io/managed-by": "rl-sandbox"})}
    state = {"waiting": {"reason": waiting}} if waiting else {"running": {}}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS, "labels": labels},
            "spec": {"containers": [{"name": "c", "image": "i"}]},
            "status": {"phase": phase, "containerStatuses": [{"name": "c", "image": "i", "imageID": "", "ready": True,
                                                              "restartCount": 0, "state": state}]}}


def seed_run(api: KubeApiStandIn, name: str = "quickstart", **job) -> None:
    api.seed(RAYJOBS, rayjob(name, **job))
    api.seed(PODS, pod(f"{name}-head", name, "ray-head"))
    api.seed(PODS, pod(f"{name}-worker-0", name, "ray-worker"))
    api.seed(PODS, pod(f"{name}-worker-1", name, "ray-worker", "Pending", "ImagePullBackOff"))
    api.seed(PODS, pod(f"{name}-submit", name, "ray-submitter"), log="warm start: held-out accuracy 0.120\n"
                                                                     "iter    0  reward 0.250\n")
    api.seed(PODS, pod(f"{name}-sandbox-1", name, "sandbox"))
    api.seed(PODS, pod("rl-sbx-0123", name, None))  # a session pod of the run's sandbox
    api.seed(PODS, pod("other-head", "other", "ray-head"))


def test_status_reads_the_rayjob_and_pods_through_the_api(api, capsys):
    seed_run(api)
    assert rl_main(["status", "quickstart"]) == 0  # the namespace from kubectl's context
    text = capsys.readouterr().out
    assert text.splitlines()[0] == "run quickstart: job RUNNING, deployment Running"
    assert "ray cluster: quickstart-x7k2p" in text and "dashboard: quickstart-x7k2p-head-svc" in text
    assert "pods ray-worker: 1 Pending (ImagePullBackOff), 1 Running" in text
    assert "pods sandbox session: 1 Running" in text and "other" not in text
    gets = [r for r in api.requests if r.method == "GET"]
    assert gets[0].path == f"/apis/ray.io/v1/namespaces/{NS}/rayjobs/quickstart"
    assert gets[1].query["labelSelector"] == f"{RUN_LABEL}=quickstart"


def test_status_of_a_finished_run_points_at_its_sandbox(api, capsys):
    seed_run(api, job="SUCCEEDED", deployment="Complete")
    assert rl_main(["status", "quickstart", "-n", NS]) == 0
    assert "the run has ended, its sandbox service still runs: rl delete quickstart" in capsys.readouterr().out


def test_status_and_logs_of_a_missing_run_exit_1(api, capsys):
    assert rl_main(["status", "nothere"]) == 1
    assert capsys.readouterr().err == f"error: no run nothere in namespace {NS} (no RayJob of that name); rl " \
                                      "launch prints the name, -n picks the namespace\n"
    assert rl_main(["logs", "nothere"]) == 1
    assert "no run nothere" in capsys.readouterr().err


def test_logs_print_the_submitters_log(api, capsys):
    seed_run(api)
    assert rl_main(["logs", "quickstart"]) == 0
    assert capsys.readouterr().out == "warm start: held-out accuracy 0.120\niter    0  reward 0.250\n"
    log = [r for r in api.requests if r.path.endswith("/log")]
    assert log[0].path == f"/api/v1/namespaces/{NS}/pods/quickstart-submit/log"


def test_logs_without_a_submitter_fall_back_to_the_head(api, capsys):
    api.seed(RAYJOBS, rayjob("http"))
    api.seed(PODS, pod("http-head", "http", "ray-head"), log="ray head started\n")
    assert rl_main(["logs", "http"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# no submitter pod") and out.endswith("ray head started\n")


def test_commands_without_a_reachable_cluster_exit_1_naming_it(tmp_path, monkeypatch, capsys):
    kubeconfig(tmp_path, monkeypatch, "https://127.0.0.1:9")
    for argv in (["status", "quickstart"], ["logs", "quickstart"], ["delete", "quickstart"]):
        assert rl_main(argv) == 1, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") <= 3, err
        assert "127.0.0.1:9" in err and "Traceback" not in err
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    monkeypatch.setenv("HOME", str(tmp_path))
    assert rl_main(["status", "quickstart"]) == 1
    assert "no Kubernetes configuration" in capsys.readouterr().err


def test_usage_errors_exit_2_and_version_exits_0(capsys):
    with pytest.raises(SystemExit) as e:
        rl_main(["status"])  # no NAME
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        rl_main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("rl (colocated-rl) ")
    assert rl_main(["launch", "--k8s", str(QUICKSTART), "--name", "1run", "--dry-run"]) == 2
    assert "must start with a lower-case letter" in capsys.readouterr().err


def test_delete_removes_the_run_and_what_its_sandbox_left(api, capsys):
    """helm finds no release here (the stand-in keeps none): the run's RayJob and session pods are deleted through
    the API all the same, also those in the sandbox's session namespace (one the release did not make, so nothing
    else removes them); the claim only with --delete-data, and only the one the chart made for this run. Session
    pods are the run's by its name and namespace: those of a run of the same name in another namespace stay (they
    went too, issue 44, D4)."""
    seed_run(api)
    for ns, run, run_ns in (("sessions", "quickstart", NS), ("sessions", "other", NS),
                            ("elsewhere", "quickstart", NS), ("sessions", "quickstart", "team-b")):
        session = pod(f"rl-sbx-{ns}-{run}-{run_ns}", run, None)
        session["metadata"]["namespace"] = ns
        session["metadata"]["labels"][RUN_NAMESPACE_LABEL] = run_ns
        api.seed(PODS, session)
    api.seed(CLAIMS, {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                      "metadata": {"name": "quickstart-data", "namespace": NS, "labels": {RUN_LABEL: "quickstart"}}})
    assert rl_main(["delete", "quickstart"]) == 0
    assert (RAYJOBS, NS, "quickstart") not in api.objects
    assert {n for (ns, n) in api.pods if ns != "default"} == {"other-head", "rl-sbx-sessions-other-rl",
                                                              "rl-sbx-sessions-quickstart-team-b"}  # not the operator
    [listing] = [r for r in api.requests if r.path == "/api/v1/pods"]
    assert listing.query["labelSelector"] == (f"{RUN_LABEL}=quickstart,{RUN_NAMESPACE_LABEL}={NS},"
                                              "app.kubernetes.io/managed-by=rl-sandbox")
    assert (CLAIMS, NS, "quickstart-data") in api.objects  # checkpoints stay by default
    assert "deleted 8 pod(s) of run quickstart (namespace elsewhere, rl, sessions)" in capsys.readouterr().out
    helm = [r for r in api.requests if "secrets" in r.path]
    assert helm and helm[0].query["labelSelector"] == "name=quickstart,owner=helm"  # helm uninstall looked
    api.seed(CLAIMS, {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                      "metadata": {"name": "mine-data", "namespace": NS, "labels": {}}})
    assert rl_main(["delete", "quickstart", "--delete-data"]) == 0
    assert rl_main(["delete", "mine", "--delete-data"]) == 0
    assert (CLAIMS, NS, "quickstart-data") not in api.objects
    assert (CLAIMS, NS, "mine-data") in api.objects  # not made by the chart for run "mine": kept


def test_launch_refuses_a_name_whose_rayjob_exists(api, capsys):
    seed_run(api, job="SUCCEEDED", deployment="Complete")
    assert rl_main(["launch", "--k8s", str(QUICKSTART)]) == 1
    err = capsys.readouterr().err
    assert "run quickstart exists already in namespace rl (job SUCCEEDED, deployment Complete)" in err
    assert "rl launch --replace" in err and "rl delete quickstart" in err
    assert (RAYJOBS, NS, "quickstart") in api.objects  # nothing was touched


def test_launch_replace_deletes_the_old_run_first(api, capsys):
    """--replace deletes the RayJob and the session pods, then installs; the install itself needs a real API
    server (helm's discovery), so here it fails, after the old run is gone."""
    seed_run(api)
    assert rl_main(["launch", "--k8s", str(QUICKSTART), "--replace", "--values",
                    str(CHART / "examples" / "cpu-demo.yaml")]) == 1
    captured = capsys.readouterr()
    assert "replacing run quickstart" in captured.out and "helm install failed" in captured.err
    assert (RAYJOBS, NS, "quickstart") not in api.objects
    assert {n for (ns, n) in api.pods if ns == NS} == {"other-head"}


def test_the_rayjob_owns_the_sandbox_fleet_and_takes_it_along(api, capsys):
    """After the install, the RayJob becomes the owner of what the chart made beside it in the run's namespace (the
    chart's real manifests, stored in the stand-in), so that deleting the RayJob (ttlSecondsAfterFinished with
    KubeRay's DeleteSelf policy, kubectl delete rayjob) frees the sandbox's nodes; the claim (checkpoints) and the
    session namespace's objects (owner references do not cross namespaces) are left alone."""
    manifests = subprocess.run([helm_binary(), "template", "quickstart", str(CHART), "--namespace", NS,
                                "--set-file", f"runConfig={QUICKSTART}"], capture_output=True, text=True,
                               check=True).stdout
    stored = {}
    cluster_scoped = ("Namespace", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
    for d in (d for d in yaml.safe_load_all(manifests) if d and d["kind"] not in cluster_scoped):  # namespaced ones
        group = "api/v1" if d["apiVersion"] == "v1" else f"apis/{d['apiVersion']}"
        plural = d["kind"].lower()[:-1] + "ies" if d["kind"].endswith("y") else d["kind"].lower() + "s"
        d["metadata"].setdefault("namespace", NS)
        stored[d["kind"], d["metadata"]["name"]] = api.seed(f"{group}/{plural}", d)
    uid = stored["RayJob", "quickstart"]["metadata"]["uid"]

    assert own_by_rayjob("quickstart", Kube(NS), manifests) == 14
    owned = {(c.rsplit("/", 1)[1], name) for (c, ns, name), o in api.objects.items()
             if o["metadata"].get("ownerReferences") == [{"apiVersion": "ray.io/v1", "kind": "RayJob",
                                                           "name": "quickstart", "uid": uid}]}
    config = next(d["metadata"]["name"] for d in yaml.safe_load_all(manifests) if d and d["kind"] == "ConfigMap")
    assert owned == {("deployments", "quickstart-sandbox"), ("services", "quickstart-sandbox"),
                     ("horizontalpodautoscalers", "quickstart-sandbox"), ("secrets", "quickstart-sandbox-token"),
                     ("serviceaccounts", "quickstart-sandbox"), ("configmaps", config),
                     ("poddisruptionbudgets", "quickstart-ray"), ("poddisruptionbudgets", "quickstart-sandbox"),
                     ("networkpolicies", "quickstart-sandbox-ingress"), ("networkpolicies", "quickstart-ray-head"),
                     ("networkpolicies", "quickstart-ray-workers"), ("serviceaccounts", "quickstart-run"),
                     ("roles", "quickstart-run"), ("rolebindings", "quickstart-run")}
    patched = [r.path for r in api.requests if r.method == "PATCH"]
    # cluster-scoped objects (the admission policy and its binding) are never given a namespaced owner: the garbage
    # collector would delete them at once
    assert len(patched) == 14 and all(f"/namespaces/{NS}/" in p for p in patched)

    api.requests.clear()
    Kube(NS).custom.delete_namespaced_custom_object("ray.io", "v1", NS, "rayjobs", "quickstart")
    assert {(c, name) for c, ns, name in api.objects if ns == NS} == {
        ("api/v1/persistentvolumeclaims", "quickstart-data")}
    assert ("apis/rbac.authorization.k8s.io/v1/roles", "rl-quickstart-sandbox", "quickstart-sandbox") in api.objects


def test_owning_needs_the_rayjob(api):
    """Without the RayJob (an install that did not make one) nothing is patched, and the error names it."""
    with pytest.raises(CommandFailed, match="no RayJob rl/quickstart after the install"):
        own_by_rayjob("quickstart", Kube(NS), "")
    assert api.count("PATCH", "deployments") == 0


def test_sandbox_release_scales_the_fleet_to_zero(api, capsys):
    """`rl sandbox release DEPLOYMENT` (a run's launch.sh, once the run succeeded): the sandbox service's Deployment
    goes to zero replicas through its scale subresource; a Deployment that is not there is said so, not an error."""
    api.seed("apis/apps/v1/deployments", {"apiVersion": "apps/v1", "kind": "Deployment",
                                          "metadata": {"name": "quickstart-sandbox", "namespace": NS},
                                          "spec": {"replicas": 3}})
    assert rl_main(["sandbox", "release", "quickstart-sandbox"]) == 0
    assert api.objects[("apis/apps/v1/deployments", NS, "quickstart-sandbox")]["spec"]["replicas"] == 0
    [patch] = [r for r in api.requests if r.method == "PATCH"]
    assert patch.path == f"/apis/apps/v1/namespaces/{NS}/deployments/quickstart-sandbox/scale"
    assert "sandbox service rl/quickstart-sandbox scaled to 0" in capsys.readouterr().out
    assert rl_main(["sandbox", "release", "gone-sandbox"]) == 0
    assert "no Deployment rl/gone-sandbox: nothing to release" in capsys.readouterr().out
