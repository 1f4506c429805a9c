"""Runs on Kubernetes: ``rl launch --k8s`` installs the Helm chart in helm/ for a run config; ``rl status``,
``rl logs`` and ``rl delete`` read and remove what it made, through the Kubernetes API (the ``kubernetes`` client,
with kubectl's configuration)."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from rl.errors import CommandFailed, UserError

CHART = Path(__file__).resolve().parents[1] / "helm" / "colocated-rl"
RUN_LABEL = "colocated-rl/run"  # on every object of a run, and on the sandbox's session pods
RUN_NAMESPACE_LABEL = "colocated-rl/run-namespace"  # on session pods: runs of one name in two namespaces differ by it
SESSION_MANAGER = "app.kubernetes.io/managed-by=rl-sandbox"  # the label selector of session pods
COMPONENT_LABEL = "app.kubernetes.io/component"
RAYJOB = ("ray.io", "v1", "rayjobs")
MAX_NAME = 40  # KubeRay appends suffixes to the RayJob's name for its cluster and Services
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
TERMINAL_DEPLOYMENT = ("Complete", "Failed")


def find_tool(name: str) -> str:
    """``helm`` or ``kubectl``: the one `make setup` put beside this Python, else the one on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise UserError(f"{name} not found: `make setup` installs it into .venv/bin, or put it on PATH")
    return found


def release_name(run_name: str) -> str:
    """A release and RayJob name from a run name: lower case, other characters as '-', a letter first
    (``run-`` is put before a leading digit), at most 40 characters."""
    name = re.sub(r"[^a-z0-9-]+", "-", run_name.lower()).strip("-")
    if name and not name[0].isalpha():
        name = f"run-{name}"
    name = name[:MAX_NAME].rstrip("-")
    if not name:
        raise UserError(f"run name {run_name!r} gives no usable release name; pass --name")
    return name


def check_name(name: str) -> str:
    """``name`` if KubeRay accepts it for a RayJob and its Services (a DNS-1035 label of at most 40 characters)."""
    if len(name) > MAX_NAME or not _DNS1035.match(name):
        raise UserError(f"--name {name!r}: must start with a lower-case letter, hold only a-z, 0-9 and '-', end with "
                        f"a letter or digit and be at most {MAX_NAME} characters (KubeRay names the run's Services "
                        "after it; Service names are DNS-1035 labels)")
    return name


# --- The Kubernetes API ----------------------------------------------------------------------------------------------


class Kube:
    """The API clients for one namespace, configured like kubectl (KUBECONFIG, ~/.kube/config, or in a pod)."""

    def __init__(self, namespace: str | None = None, api_client: Any = None) -> None:
        import kubernetes

        if api_client is None:
            # KUBECONFIG read now: the client's own default is fixed when it is first imported
            files = os.environ.get("KUBECONFIG") or str(Path("~/.kube/config").expanduser())
            try:
                kubernetes.config.load_kube_config(config_file=files)
                _, active = kubernetes.config.list_kube_config_contexts(config_file=files)
                default_ns = (active or {}).get("context", {}).get("namespace") or "default"
            except (kubernetes.config.ConfigException, OSError) as e:
                try:
                    kubernetes.config.load_incluster_config()
                except kubernetes.config.ConfigException:
                    raise CommandFailed(f"no Kubernetes configuration ({e}); set KUBECONFIG or kubectl's "
                                        "context to the cluster") from None
                default_ns = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read_text().strip()
            api_client = kubernetes.client.ApiClient()
        else:
            default_ns = "default"
        self.namespace = namespace or default_ns
        self.host = api_client.configuration.host
        self.core = kubernetes.client.CoreV1Api(api_client)
        self.custom = kubernetes.client.CustomObjectsApi(api_client)
        self.apps = kubernetes.client.AppsV1Api(api_client)
        self.extensions = kubernetes.client.ApiextensionsV1Api(api_client)

    def call(self, what: str, fn: Callable[..., Any], *args: Any, missing_ok: bool = False,
             forbidden_ok: bool = False, **kw: Any) -> Any:
        """``fn(*args, **kw)``; API and connection errors become CommandFailed naming ``what`` (None for a
        404 when ``missing_ok``, for a 401 or 403 when ``forbidden_ok``: a check this account may not make)."""
        import urllib3
        from kubernetes.client.exceptions import ApiException

        try:
            return fn(*args, _request_timeout=kw.pop("_request_timeout", 30), **kw)
        except ApiException as e:
            if (e.status == 404 and missing_ok) or (e.status in (401, 403) and forbidden_ok):
                return None
            raise CommandFailed(f"{what}: HTTP {e.status} {e.reason} from the Kubernetes API at {self.host}"
                                + (f": {_api_message(e)}" if _api_message(e) else "")) from None
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise CommandFailed(f"{what}: cannot reach the Kubernetes API at {self.host} ({type(e).__name__}: "
                                f"{str(e)[:300]}); is kubectl's context the cluster?") from None

    def rayjob(self, name: str) -> dict | None:
        """The RayJob called ``name``, or None."""
        return self.call(f"reading RayJob {self.namespace}/{name}", self.custom.get_namespaced_custom_object,
                         *RAYJOB[:2], self.namespace, RAYJOB[2], name, missing_ok=True)

    def run_pods(self, name: str, component: str | None = None) -> list[Any]:
        """The pods of run ``name`` (of one component: ray-head, ray-worker, ray-submitter, sandbox), oldest first."""
        selector = f"{RUN_LABEL}={name}" + (f",{COMPONENT_LABEL}={component}" if component else "")
        pods = self.call(f"listing the pods of run {name}", self.core.list_namespaced_pod, self.namespace,
                         label_selector=selector).items
        return sorted(pods, key=lambda p: p.metadata.creation_timestamp or 0)


def release_sandbox(deployment: str, *, namespace: str | None = None, kube: Kube | None = None,
                    out: TextIO | None = None) -> None:
    """Scale the sandbox service's Deployment to zero: what a run that ended for good (``launch.sh`` after ``rl
    train`` succeeded) does, so that its fleet frees its nodes without waiting for ``rl delete``. Its autoscaler
    stops acting on a Deployment of zero replicas; open sessions are drained as at any shutdown."""
    kube, out = kube or Kube(namespace), out or sys.stdout
    ns = kube.namespace
    scale = kube.call(f"scaling Deployment {ns}/{deployment} to 0", kube.apps.patch_namespaced_deployment_scale,
                      deployment, ns, {"spec": {"replicas": 0}}, missing_ok=True)
    if scale is None:
        print(f"no Deployment {ns}/{deployment}: nothing to release", file=out, flush=True)
        return
    print(f"the run is over: sandbox service {ns}/{deployment} scaled to 0 (rl delete removes the rest)", file=out,
          flush=True)


def session_pods(kube: Kube, name: str, namespaces: list[str] = ()) -> list[tuple[str, Any]]:
    """(namespace, pod) of the sandbox session pods of run ``name`` of ``kube``'s namespace (by the run's name and
    namespace: another namespace may hold a run of the same name), outside the run's namespace: in every namespace
    where the caller may list pods cluster-wide, else in ``namespaces`` (the release's, see ``release_namespaces``)
    or the chart's default session namespace."""
    from kubernetes.client.exceptions import ApiException

    selector = f"{RUN_LABEL}={name},{RUN_NAMESPACE_LABEL}={kube.namespace},{SESSION_MANAGER}"
    try:
        pods = kube.core.list_pod_for_all_namespaces(label_selector=selector, _request_timeout=30).items
    except ApiException as e:
        if e.status != 403:
            raise CommandFailed(f"listing the session pods of run {name}: HTTP {e.status} {e.reason}") from None
        default = f"{kube.namespace}-{name[:40].rstrip('-')}-sandbox"[:63].rstrip("-")  # rl.sessionNamespace's
        pods = []
        for where in [n for n in namespaces if n != kube.namespace] or [default]:
            found = kube.call(f"listing the session pods of run {name} in {where}", kube.core.list_namespaced_pod,
                              where, label_selector=selector, missing_ok=True)
            pods += found.items if found is not None else []
    return [(p.metadata.namespace, p) for p in pods if p.metadata.namespace != kube.namespace]


def release_namespaces(name: str, namespace: str) -> list[str]:
    """The namespaces release ``name`` (of ``namespace``) has objects in besides its own, from its manifest (the
    sandbox's session namespace); empty where helm knows no such release."""
    import yaml

    proc = subprocess.run([find_tool("helm"), "get", "manifest", name, "--namespace", namespace],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        return []
    found = {(d.get("metadata") or {}).get("namespace") for d in yaml.safe_load_all(proc.stdout) if d}
    return sorted(n for n in found if n and n != namespace)


def _api_message(e: Any) -> str:
    import json

    try:
        return str(json.loads(e.body).get("message", ""))[:500]
    except (TypeError, ValueError, AttributeError):
        return str(e.body or "")[:300]


# --- launch / delete --------------------------------------------------------------------------------------------------


def helm_command(config: Path, release: str, *, namespace: str | None = None, values: list[str] = (),
                 sets: list[str] = (), dry_run: bool = False, chart: Path = CHART) -> list[str]:
    """The helm invocation: ``template`` for a dry run (or a check), else ``install``."""
    verb = ["template"] if dry_run else ["install"]
    cmd = [find_tool("helm"), *verb, release, str(chart), "--set-file", f"runConfig={config}"]
    if namespace:
        cmd += ["--namespace", namespace]
    for v in values:
        cmd += ["--values", str(v)]
    for s in sets:
        cmd += ["--set", s]
    return cmd


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    """What ``rl launch`` is asked besides the run config: values files and ``--set`` overrides of the chart, the
    release's name and namespace, a dry run (print the manifests), whether to replace a run of the same name."""

    values: Sequence[str] = ()
    sets: Sequence[str] = ()
    name: str | None = None
    namespace: str | None = None
    dry_run: bool = False
    replace: bool = False


def launch(config: str, options: LaunchOptions | None = None, *, chart: Path = CHART, kube: Kube | None = None,
           out: TextIO | None = None) -> str:
    """Validate the run config and the chart values, then install the chart (or print it); returns helm's output.

    A name whose RayJob exists is refused (KubeRay would not run it again), unless ``replace``: then the old run
    is deleted first (its checkpoints stay, and the new run resumes from the newest complete one: the chart's
    entrypoint runs ``rl train --auto-resume``, which names it in the run's log)."""
    from rl.config import load_config

    out, options = out or sys.stdout, options or LaunchOptions()
    values, sets, namespace = list(options.values), list(options.sets), options.namespace
    cfg = load_config(config)  # a bad config fails here, naming the field, before anything reaches the cluster
    for v in values:
        if not Path(v).is_file():
            raise UserError(f"--values {v}: no such file")
    if not (chart / "Chart.yaml").is_file():
        raise UserError(f"no Helm chart at {chart} (rl launch runs from a source checkout or the runtime image)")
    release = check_name(options.name) if options.name else release_name(cfg.run.name)
    rendered = subprocess.run(helm_command(Path(config), release, namespace=namespace, values=values, sets=sets,
                                           dry_run=True, chart=chart), capture_output=True, text=True)
    if rendered.returncode != 0:  # values that fail the schema or the chart's checks: the user's to fix
        raise UserError(f"helm template failed:\n{rendered.stderr.strip()}")
    check_run_config(config, rendered.stdout)
    if options.dry_run:
        return rendered.stdout
    kube = kube or Kube(namespace)
    check_operator_namespace(rendered.stdout, kube, out)
    check_token_auth_support(rendered.stdout, kube, out)
    existing = kube.rayjob(release)
    if existing is not None:
        if not options.replace:
            state = describe_rayjob(existing).splitlines()[0].split(": ", 1)[1]
            raise CommandFailed(f"run {release} exists already in namespace {kube.namespace} ({state}); KubeRay "
                                f"would not run it again. rl launch --replace deletes it and launches anew "
                                f"(resuming from its newest complete checkpoint); rl delete {release} removes it; "
                                "or pick another --name")
        print(f"replacing run {release}: deleting the old one first (its checkpoints stay; the new run resumes from "
              f"the newest complete one, which rl logs {release} names)", file=out, flush=True)
        delete(release, kube=kube, out=out)
    proc = subprocess.run(helm_command(Path(config), release, namespace=kube.namespace, values=values, sets=sets,
                                       chart=chart), capture_output=True, text=True)
    if proc.returncode != 0:
        raise CommandFailed(f"helm install failed:\n{proc.stderr.strip()}")
    try:
        n = own_by_rayjob(release, kube)
        print(f"RayJob {release} now owns {n} object(s) of the release (the sandbox service among them): they go "
              "when it is deleted", file=out, flush=True)
    except CommandFailed as e:  # the run is installed and runs; only the cleanup is left to rl delete
        print(f"warning: the sandbox service is not tied to RayJob {release} ({e}); rl delete {release} removes it",
              file=out, flush=True)
    return proc.stdout


def chart_settings(manifests: str) -> list[str]:
    """The ``--set`` arguments the chart's launch.sh gives ``rl train`` (the workers, the placement, the sandbox)."""
    import shlex

    import yaml

    for d in yaml.safe_load_all(manifests):
        if d and d.get("kind") == "ConfigMap" and "launch.sh" in (d.get("data") or {}):
            line = next((x for x in d["data"]["launch.sh"].splitlines() if "rl train " in x), "")
            words = shlex.split(line[line.index("rl train "):]) if line else []
            return [words[i + 1] for i, w in enumerate(words[:-1]) if w == "--set"]
    return []


def check_run_config(config: str, manifests: str) -> None:
    """The run config as the chart's pods will run it (its ``--set`` arguments applied) is validated here, so that a
    run the workers would refuse (say, GPU workers in a placement that takes none yet) fails before any pod starts."""
    from rl.config import load_config

    sets = chart_settings(manifests)
    try:
        load_config(config, sets)
    except UserError as e:
        raise UserError(f"the run config with the chart's settings ({' '.join(sets)}): {e}") from None


#: how KubeRay's installs label the operator's pods: its Helm chart name=kuberay-operator, its kustomization
#: name=kuberay; both component=kuberay-operator (what the chart's head policy admits when operatorPodLabels is empty)
OPERATOR_SELECTORS = ("app.kubernetes.io/name=kuberay-operator", "app.kubernetes.io/component=kuberay-operator")


def check_operator_namespace(manifests: str, kube: Kube, out: TextIO) -> None:
    """Refuse a release where no KubeRay operator runs (the RayJob would hold its GPUs and never start), or whose head
    admits the operator from a namespace it does not run in (the run would wait forever for its job's status): the
    operator's pods are looked for by the labels the head's NetworkPolicy selects (KubeRay's own where it has none),
    in any namespace. Says so, and goes on, where they cannot be listed."""
    import yaml

    policy = next((d for d in yaml.safe_load_all(manifests) if d and d.get("kind") == "NetworkPolicy"
                   and d["metadata"]["name"].endswith("-ray-head")), None)
    peers = [peer for rule in (policy or {}).get("spec", {}).get("ingress", []) for peer in rule.get("from", [])
             if "namespaceSelector" in peer and "podSelector" in peer]
    wanted = peers[0]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"] if peers else None
    selectors = [",".join(f"{k}={v}" for k, v in (p["podSelector"].get("matchLabels") or {}).items())
                 for p in peers] or list(OPERATOR_SELECTORS)
    named = " or ".join(selectors)
    found: set[str] = set()
    for selector in selectors:
        pods = kube.call("looking for the KubeRay operator's pods", kube.core.list_pod_for_all_namespaces,
                         label_selector=selector, forbidden_ok=True)
        if pods is None:
            print(f"note: cannot list pods cluster-wide (forbidden) to check that the KubeRay operator ({named}) "
                  f"runs{f' in namespace {wanted} (head.networkPolicy.operatorNamespace)' if wanted else ''}",
                  file=out, flush=True)
            return
        found |= {p.metadata.namespace for p in pods.items}
    if not found:
        raise UserError(f"no KubeRay operator runs in this cluster (no pod labelled {named} in any namespace): the "
                        "RayJob would hold its pods and never start; install KubeRay (its Helm chart or "
                        "kustomization), or name its pods' labels in head.networkPolicy.operatorPodLabels")
    if wanted is not None and wanted not in found:
        raise UserError(f"head.networkPolicy.operatorNamespace is {wanted}, but the KubeRay operator's pods "
                        f"({named}) run in {', '.join(sorted(found))}: its status polls of the Ray head (port 8265) "
                        "would be refused and the run would never finish; --set head.networkPolicy.operatorNamespace="
                        "NS naming the operator's namespace")


def check_token_auth_support(manifests: str, kube: Kube, out: TextIO) -> None:
    """Refuse a release that turns Ray's token authentication on where the installed RayJob CRD has no
    ``authOptions`` (KubeRay < 1.6): the API server would prune it without a word, and the run would go unguarded.
    Says so, and goes on, where the CRD cannot be read."""
    import json

    import yaml

    job = next((d for d in yaml.safe_load_all(manifests) if d and d.get("kind") == "RayJob"), None)
    if not job or "authOptions" not in job["spec"].get("rayClusterSpec", {}):
        return
    raw = kube.call("reading the RayJob CRD (rayjobs.ray.io)", kube.extensions.read_custom_resource_definition,
                    "rayjobs.ray.io", _preload_content=False, forbidden_ok=True)
    if raw is None:
        print("note: cannot read the RayJob CRD (forbidden) to check that the installed KubeRay keeps authOptions "
              "(KubeRay >= 1.6)", file=out, flush=True)
        return
    crd = json.loads(raw.data)
    version = job["apiVersion"].split("/")[-1]
    schema = next((v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"] if v["name"] == version), {})
    cluster = schema.get("properties", {}).get("spec", {}).get("properties", {}).get("rayClusterSpec", {})
    if "authOptions" not in cluster.get("properties", {}):
        raise UserError("Ray's token authentication is on (rayJob.authToken, or rayJob.rayVersion >= 2.52), but the "
                        "installed KubeRay's RayJob CRD has no authOptions (KubeRay < 1.6): the API server would drop "
                        "it and the run's Jobs API and Ray ports would take no token; upgrade KubeRay to 1.6 or newer, "
                        "or set rayJob.authToken=false with the head's NetworkPolicy on and no hostNetwork group")


def seconds_left(name: str, limit_s: float, run_dir: str | Path, *, namespace: str | None = None,
                 kube: Kube | None = None, now: float | None = None) -> int:
    """Seconds run ``name`` has left of ``limit_s`` counted from the start of its first attempt, which the first
    call records in ``run_dir`` under the RayJob's uid (a RayJob made anew, by rl launch --replace, starts afresh;
    retries of one do not)."""
    kube = kube or Kube(namespace)
    job = kube.rayjob(name)
    if job is None:
        raise CommandFailed(f"no RayJob {kube.namespace}/{name}: its deadline cannot be counted")
    now = time.time() if now is None else now
    record = Path(run_dir) / f".started-{job['metadata']['uid']}"
    try:
        started = float(record.read_text())
    except (OSError, ValueError):
        started = now
        tmp = record.with_name(record.name + ".tmp")
        tmp.write_text(f"{started}\n")
        tmp.replace(record)
    return int(started + limit_s - now)


# the owner; the checkpoints; cluster-scoped kinds (an owner reference to a namespaced owner would make the garbage
# collector delete them at once)
KEPT_KINDS = ("RayJob", "PersistentVolumeClaim", "Namespace", "ValidatingAdmissionPolicy",
              "ValidatingAdmissionPolicyBinding", "ClusterRole", "ClusterRoleBinding", "PriorityClass")


def owned_by_rayjob(manifests: str, namespace: str) -> list[dict[str, Any]]:
    """The objects of a release (its manifests) that its RayJob owns: all in ``namespace`` but the RayJob itself,
    the run's claim (its checkpoints outlive the run) and objects elsewhere (owner references cannot cross
    namespaces: the garbage collector would take the owner for absent and delete them at once)."""
    import yaml

    return [d for d in yaml.safe_load_all(manifests) if d and d.get("kind") not in KEPT_KINDS
            and d.get("metadata", {}).get("namespace", namespace) == namespace]


def own_by_rayjob(release: str, kube: Kube, manifests: str | None = None) -> int:
    """Make RayJob ``release`` the owner of the rest of its release (``manifests``; None: what helm installed), so
    that the garbage collector removes the sandbox fleet with the RayJob; returns how many objects were patched."""
    if manifests is None:
        proc = subprocess.run([find_tool("helm"), "get", "manifest", release, "--namespace", kube.namespace],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise CommandFailed(f"helm get manifest {release}: {proc.stderr.strip()}")
        manifests = proc.stdout
    job = kube.rayjob(release)
    if job is None:
        raise CommandFailed(f"no RayJob {kube.namespace}/{release} after the install")
    # blockOwnerDeletion left unset: setting it needs the right to update the RayJob's finalizers
    ref = {"apiVersion": "/".join(RAYJOB[:2]), "kind": "RayJob", "name": release, "uid": job["metadata"]["uid"]}
    patch = {"metadata": {"ownerReferences": [ref]}}
    objects = owned_by_rayjob(manifests, kube.namespace)
    for obj in objects:
        kind, name, api_version = obj["kind"], obj["metadata"]["name"], obj["apiVersion"]
        what = f"setting the owner of {kind} {kube.namespace}/{name}"
        if "/" not in api_version:  # the core group: its typed method (patch_namespaced_config_map, ...)
            method = getattr(kube.core, "patch_namespaced_" + re.sub(r"(?<!^)(?=[A-Z])", "_", kind).lower())
            kube.call(what, method, name, kube.namespace, patch, _content_type="application/merge-patch+json")
        else:
            group, version = api_version.split("/")
            plural = kind.lower()[:-1] + "ies" if kind.endswith("y") else kind.lower() + "s"
            kube.call(what, kube.custom.patch_namespaced_custom_object, group, version, kube.namespace, plural,
                      name, patch, _content_type="application/merge-patch+json")
    return len(objects)


def delete(name: str, *, namespace: str | None = None, delete_data: bool = False, kube: Kube | None = None,
           wait_s: float = 300, out: TextIO | None = None) -> None:
    """Remove everything run ``name`` made: the release (RayJob, whose Ray cluster and submitter KubeRay deletes
    with it; the sandbox service, its autoscaler and policies), session pods left behind (in the run's namespace
    and the sandbox's session namespace), and with ``delete_data`` its run storage claim. Waits until the RayJob is
    gone, so the name can be launched again."""
    kube, out = kube or Kube(namespace), out or sys.stdout
    ns = kube.namespace
    elsewhere = release_namespaces(name, ns)  # read before the uninstall forgets the release
    proc = subprocess.run([find_tool("helm"), "uninstall", name, "--namespace", ns, "--wait", "--timeout",
                           f"{int(wait_s)}s"], capture_output=True, text=True)
    if proc.returncode == 0:
        print(f"uninstalled release {name}", file=out, flush=True)
    elif "release: not found" not in proc.stderr:
        raise CommandFailed(f"helm uninstall {name} failed:\n{proc.stderr.strip()}")
    if kube.rayjob(name) is not None:  # made without the chart, or the uninstall left it behind
        kube.call(f"deleting RayJob {ns}/{name}", kube.custom.delete_namespaced_custom_object, *RAYJOB[:2], ns,
                  RAYJOB[2], name, propagation_policy="Foreground", missing_ok=True)
    # the run's pods left behind, here and in the sandbox's session namespace (its service is gone, so nothing else
    # deletes them now; a namespace the release made went with it, one that existed before stays)
    left = [(ns, p) for p in kube.run_pods(name)] + session_pods(kube, name, elsewhere)
    for where, pod in left:
        kube.call(f"deleting pod {where}/{pod.metadata.name}", kube.core.delete_namespaced_pod, pod.metadata.name,
                  where, grace_period_seconds=0, missing_ok=True)
    if left:
        places = ", ".join(sorted({where for where, _ in left}))
        print(f"deleted {len(left)} pod(s) of run {name} (namespace {places})", file=out, flush=True)
    if delete_data:
        claim = f"{name}-data"
        pvc = kube.call(f"reading claim {ns}/{claim}", kube.core.read_namespaced_persistent_volume_claim, claim, ns,
                        missing_ok=True)
        if pvc is not None and (pvc.metadata.labels or {}).get(RUN_LABEL) == name:
            kube.call(f"deleting claim {ns}/{claim}", kube.core.delete_namespaced_persistent_volume_claim, claim, ns,
                      missing_ok=True)
            print(f"deleted claim {claim} (checkpoints and metrics of the run)", file=out, flush=True)
    deadline = time.monotonic() + wait_s
    while kube.rayjob(name) is not None:  # KubeRay's finalizer runs first
        if time.monotonic() > deadline:
            raise CommandFailed(f"RayJob {ns}/{name} is still there after {wait_s:.0f} s (is the KubeRay operator "
                                f"running? its finalizer must run); kubectl describe rayjob {name} -n {ns}")
        time.sleep(2)


# --- status / logs ----------------------------------------------------------------------------------------------------


def describe_rayjob(job: dict[str, Any]) -> str:
    """A few lines on a RayJob object: its state, cluster and times."""
    st = job.get("status") or {}
    lines = [f"run {job['metadata']['name']}: job {st.get('jobStatus') or 'PENDING'}, "
             f"deployment {st.get('jobDeploymentStatus') or 'New'}"]
    for key, label in (("rayClusterName", "ray cluster"), ("dashboardURL", "dashboard"), ("jobId", "ray job id"),
                       ("startTime", "started"), ("endTime", "ended"), ("failed", "failed attempts"),
                       ("reason", "reason"), ("message", "message")):
        if st.get(key) not in (None, ""):
            lines.append(f"  {label}: {st[key]}")
    return "\n".join(lines)


def describe_pods(pods: list[Any]) -> list[str]:
    """One line per component: how many pods in which phase (waiting containers named)."""
    by: dict[str, Counter] = {}
    for p in pods:
        comp = (p.metadata.labels or {}).get(COMPONENT_LABEL) or (
            "sandbox session" if (p.metadata.labels or {}).get("app.kubernetes.io/managed-by") == "rl-sandbox"
            else "other")
        phase = (p.status.phase if p.status else None) or "Pending"
        for cs in (p.status.container_statuses or []) if p.status else []:
            if cs.state and cs.state.waiting and cs.state.waiting.reason:
                phase = f"{phase} ({cs.state.waiting.reason})"
        by.setdefault(comp, Counter())[phase] += 1
    return [f"  pods {comp}: " + ", ".join(f"{n} {ph}" for ph, n in sorted(c.items()))
            for comp, c in sorted(by.items())]


def status(name: str, namespace: str | None = None, kube: Kube | None = None) -> str:
    """The state of a launched run: its RayJob and its pods."""
    kube = kube or Kube(namespace)
    job = kube.rayjob(name)
    if job is None:
        raise CommandFailed(f"no run {name} in namespace {kube.namespace} (no RayJob of that name); "
                            "rl launch prints the name, -n picks the namespace")
    pods = kube.run_pods(name)
    lines = [describe_rayjob(job), *describe_pods(pods)]
    st = job.get("status") or {}
    finished = st.get("jobDeploymentStatus") in TERMINAL_DEPLOYMENT
    sandbox_up = any((p.metadata.labels or {}).get(COMPONENT_LABEL) == "sandbox" and p.status
                     and p.status.phase == "Running" for p in pods)
    if finished and sandbox_up:
        lines.append(f"  the run has ended, its sandbox service still runs: rl delete {name} -n {kube.namespace} "
                     "removes it (the run storage and its checkpoints stay)")
    return "\n".join(lines)


def logs(name: str, namespace: str | None = None, follow: bool = False, kube: Kube | None = None,
         out: TextIO | None = None) -> None:
    """Print the run's console: the submitter's log (it follows the Ray job's), else the head's."""
    kube, out = kube or Kube(namespace), out or sys.stdout
    pods = kube.run_pods(name, "ray-submitter")
    if not pods:
        pods = kube.run_pods(name, "ray-head")
        if not pods:
            if kube.rayjob(name) is None:
                raise CommandFailed(f"no run {name} in namespace {kube.namespace} (no RayJob of that name)")
            raise CommandFailed(f"run {name} has no submitter or head pod yet (rl status {name} -n {kube.namespace})")
        print("# no submitter pod (submissionMode HTTPMode?): the Ray head's log; the job's own output is in the "
              "Ray dashboard (ray job logs)", file=out, flush=True)
    pod = pods[-1].metadata.name  # the newest: a retried job has a new one
    if (pods[-1].status and pods[-1].status.phase) == "Pending":
        raise CommandFailed(f"pod {pod} of run {name} is still Pending (rl status {name} -n {kube.namespace})")
    resp = kube.call(f"reading the log of pod {kube.namespace}/{pod}", kube.core.read_namespaced_pod_log, pod,
                     kube.namespace, follow=follow, _preload_content=False,
                     _request_timeout=None if follow else 60)
    import urllib3

    try:
        for chunk in resp.stream(4096):
            out.write(chunk.decode(errors="replace"))
            out.flush()
    except urllib3.exceptions.HTTPError as e:
        raise CommandFailed(f"the log of pod {kube.namespace}/{pod} broke off: {e}") from None
    finally:
        resp.release_conn()


def main(argv: list[str] | None = None) -> int:
    """``python -m rl.launch deadline NAME --limit S --run-dir DIR``: what a run's launch.sh asks on the head (the
    seconds the run has left of its rayJob.activeDeadlineSeconds); prints the number, or one line and exits 1."""
    parser = argparse.ArgumentParser(prog="python -m rl.launch")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("deadline", help="seconds left of a run's limit, counted from its first attempt")
    d.add_argument("name")
    d.add_argument("--namespace", "-n")
    d.add_argument("--limit", type=float, required=True, help="the run's limit in seconds")
    d.add_argument("--run-dir", required=True)
    args = parser.parse_args(argv)
    try:
        print(seconds_left(args.name, args.limit, args.run_dir, namespace=args.namespace))
    except (UserError, CommandFailed, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

