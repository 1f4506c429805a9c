"""Plain-dict Kubernetes manifests of the pod backend (a pod per session, the egress ban), and reading pod statuses.

Pure functions, no client import: the dicts go to the API server as they are, and tests validate them against the
Kubernetes OpenAPI schemas.
"""

from __future__ import annotations

import calendar
import re
import time
from typing import Any

MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "rl-sandbox"
SESSION_LABEL = "rl-sandbox/session"
OWNER_LABEL = "rl-sandbox/owner"
EXPIRES_ANNOTATION = "rl-sandbox/expires-at"  # RFC 3339, UTC
IMAGE_ANNOTATION = "rl-sandbox/image"
AGENT_ROOT = "/opt/rl-sandbox"  # the emptyDir the init container copies the ``sandbox`` package into
AGENT_CONTAINER = "sandbox"
POLICY_NAME = "rl-sandbox-deny-egress"
DEFAULT_SERVICE_LABELS = {"app.kubernetes.io/name": "rl-sandbox-service"}
DEFAULT_RESOURCES = {"cpu": "1", "memory": "2Gi", "ephemeral-storage": "4Gi"}
NOBODY = 65534  # the uid (and gid) session pods run as unless configured otherwise
# The init container only copies a few hundred kilobytes.
INIT_RESOURCES = {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"cpu": "500m", "memory": "256Mi"}}
# Waiting reasons after which a pod with restartPolicy Never will not start by itself. ErrImagePull is left out: the
# kubelet retries it (it may be a registry hiccup) and reports ImagePullBackOff when the retry fails too.
FATAL_WAITING = frozenset({"ImagePullBackOff", "ErrImageNeverPull", "InvalidImageName", "CreateContainerConfigError",
                            "CreateContainerError", "RunContainerError"})
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
# Copies the package the runtime image has installed, wherever that is, without bytecode of another Python.
_COPY_AGENT = ("import os, shutil, sandbox; shutil.copytree(os.path.dirname(sandbox.__file__), {dst!r}, "
               "ignore=shutil.ignore_patterns('__pycache__'), dirs_exist_ok=True)")


def label_value(value: str) -> str:
    """``value`` if Kubernetes accepts it as a label value (≤ 63 characters of [A-Za-z0-9-_.]), else ValueError."""
    if not _LABEL_VALUE.match(value):
        raise ValueError(f"{value!r} is not a valid Kubernetes label value")
    return value


def is_label_value(value: str) -> bool:
    """Whether Kubernetes accepts ``value`` as a label value."""
    return bool(_LABEL_VALUE.match(value))


def rfc3339(t: float) -> str:
    """A Unix time as the UTC timestamp format of Kubernetes (second precision)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def parse_rfc3339(text: str) -> float:
    """The inverse of ``rfc3339`` (fractional seconds ignored)."""
    return float(calendar.timegm(time.strptime(text.split(".")[0].rstrip("Z"), "%Y-%m-%dT%H:%M:%S")))


def owner_selector(owner: str) -> str:
    """The label selector of every pod one service instance created."""
    return f"{MANAGED_BY_LABEL}={MANAGED_BY},{OWNER_LABEL}={owner}"


def container_resources(resources: dict[str, Any] | None) -> dict[str, dict[str, str]]:
    """Requests and limits: ``{"requests": {...}, "limits": {...}}`` as given, or a flat ``{"cpu": "1", ...}`` used
    for both (so memory is guaranteed and the pod is not the first evicted); missing keys come from the defaults."""
    if resources and ("requests" in resources or "limits" in resources):
        return {k: {n: str(v) for n, v in resources.get(k, {}).items()} for k in ("requests", "limits")
                if resources.get(k)}
    flat = {**DEFAULT_RESOURCES, **{k: str(v) for k, v in (resources or {}).items() if v}}
    return {"requests": dict(flat), "limits": dict(flat)}


def _hardened() -> dict[str, Any]:
    """The container securityContext: not root, no privilege gain, no capabilities, the runtime's default seccomp
    filter (Pod Security Standards, "restricted")."""
    return {"runAsNonRoot": True, "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
            "privileged": False, "seccompProfile": {"type": "RuntimeDefault"}}


def owner_reference(pod_name: str, pod_uid: str) -> dict[str, Any]:
    """An ownerReference to the service pod that made a session pod: when that pod is gone (a crashed replica), the
    garbage collector deletes its session pods. Only valid within the owner's namespace."""
    return {"apiVersion": "v1", "kind": "Pod", "name": pod_name, "uid": pod_uid, "blockOwnerDeletion": False}


def sandbox_pod(*, name: str, namespace: str, session_id: str, owner: str, image: str, agent_image: str,
                token: str = "", port: int = 8000, ttl_s: float = 3600, expires_at: float | None = None,
                workdir: str = "/work", workdir_volume: bool = True, resources: dict[str, Any] | None = None,
                runtime_class: str | None = None, node_selector: dict[str, str] | None = None,
                tolerations: list[dict[str, Any]] | None = None, run_as_user: int = NOBODY,
                image_pull_policy: str = "IfNotPresent", image_pull_secrets: list[str] = (),
                labels: dict[str, str] | None = None, priority_class: str | None = None,
                owner_pod: tuple[str, str] | None = None) -> dict[str, Any]:
    """The pod of one session: an init container copies the agent into an emptyDir, the task's image runs it, as
    ``run_as_user`` (never root). ``labels`` are added to the backend's own (which win); ``image_pull_secrets`` name
    Secrets of a private registry; ``owner_pod`` (name, uid): the service pod that owns it."""
    if run_as_user <= 0:
        raise ValueError(f"run_as_user={run_as_user}: session pods never run as root")
    expires_at = time.time() + ttl_s if expires_at is None else expires_at
    res = container_resources(resources)
    volumes: list[dict[str, Any]] = [{"name": "agent", "emptyDir": {"sizeLimit": "64Mi"}}]
    mounts = [{"name": "agent", "mountPath": AGENT_ROOT, "readOnly": True}]
    if workdir_volume:  # else the image provides the work directory (e.g. SWE-bench images keep the repo at /testbed)
        work: dict[str, Any] = {}
        if "ephemeral-storage" in res.get("limits", {}):
            work["sizeLimit"] = res["limits"]["ephemeral-storage"]
        volumes.append({"name": "work", "emptyDir": work})
        mounts.append({"name": "work", "mountPath": workdir})
    env = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           {"name": "PYTHONPATH", "value": AGENT_ROOT}]
    if token:
        # Per pod and random: it only ever opens this pod's agent, which the pod's own code can reach anyway.
        env.append({"name": "SANDBOX_AGENT_TOKEN", "value": token})
    main = {"name": AGENT_CONTAINER, "image": image, "imagePullPolicy": image_pull_policy,
            "command": ["python3", "-m", "sandbox.agent", "--port", str(port), "--workdir", workdir],
            "workingDir": workdir, "env": env, "ports": [{"name": "agent", "containerPort": port, "protocol": "TCP"}],
            "resources": res, "securityContext": _hardened(), "volumeMounts": mounts}
    init = {"name": "install-agent", "image": agent_image, "imagePullPolicy": "IfNotPresent",
            "command": ["python3", "-c", _COPY_AGENT.format(dst=f"{AGENT_ROOT}/sandbox")],
            "resources": INIT_RESOURCES, "securityContext": _hardened(),
            "volumeMounts": [{"name": "agent", "mountPath": AGENT_ROOT}]}
    # the emptyDirs belong to the fsGroup, so the agent and the program can write their work directory
    pod_security: dict[str, Any] = {"runAsNonRoot": True, "runAsUser": run_as_user, "runAsGroup": run_as_user,
                                    "fsGroup": run_as_user, "seccompProfile": {"type": "RuntimeDefault"}}
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        # The kubelet kills the pod at its TTL even if the service that created it is gone.
        "activeDeadlineSeconds": max(1, int(ttl_s)),
        "terminationGracePeriodSeconds": 1,
        "automountServiceAccountToken": False,  # untrusted code gets no credentials for the API server
        "enableServiceLinks": False,  # nor a list of the namespace's services in its environment
        "securityContext": pod_security,
        "initContainers": [init],
        "containers": [main],
        "volumes": volumes,
    }
    if runtime_class:
        spec["runtimeClassName"] = runtime_class
    if node_selector:
        spec["nodeSelector"] = dict(node_selector)
    if tolerations:
        spec["tolerations"] = [dict(t) for t in tolerations]
    if image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": n} for n in image_pull_secrets]
    if priority_class:
        spec["priorityClassName"] = priority_class
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": {**{k: label_value(v) for k, v in (labels or {}).items()}, MANAGED_BY_LABEL: MANAGED_BY,
                   SESSION_LABEL: label_value(session_id), OWNER_LABEL: label_value(owner)},
        "annotations": {EXPIRES_ANNOTATION: rfc3339(expires_at), IMAGE_ANNOTATION: image},
    }
    if owner_pod is not None:
        metadata["ownerReferences"] = [owner_reference(*owner_pod)]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def deny_egress_policy(namespace: str, *, port: int = 8000, name: str = POLICY_NAME,
                       service_labels: dict[str, str] | None = None,
                       service_namespace: str | None = None) -> dict[str, Any]:
    """A NetworkPolicy: sandbox pods may open no connection at all (not even DNS) and accept only the service's."""
    peer: dict[str, Any] = {"podSelector": {"matchLabels": dict(service_labels or DEFAULT_SERVICE_LABELS)}}
    if service_namespace and service_namespace != namespace:
        peer["namespaceSelector"] = {"matchLabels": {"kubernetes.io/metadata.name": service_namespace}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": namespace, "labels": {MANAGED_BY_LABEL: MANAGED_BY}},
        "spec": {
            "podSelector": {"matchLabels": {MANAGED_BY_LABEL: MANAGED_BY}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": [peer], "ports": [{"protocol": "TCP", "port": port}]}],
            "egress": [],  # listed in policyTypes with no rule: all egress is denied
        },
    }


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a label selector (matchLabels and matchExpressions: In, NotIn, Exists, DoesNotExist) matches
    ``labels``; the empty selector matches everything."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e.get("key"), e.get("operator"), e.get("values") or []
        present = key in labels
        if not {"In": present and labels.get(key) in values, "NotIn": not present or labels.get(key) not in values,
                "Exists": present, "DoesNotExist": not present}.get(op, False):
            return False
    return True


def egress_policies(policies: list[dict[str, Any]], labels: dict[str, str]) -> tuple[list[str], list[str]]:
    """(names of the policies that select a pod of ``labels`` and allow it no egress, names of those that select it
    and allow it some egress) among NetworkPolicy objects."""
    denying, opening = [], []
    for policy in policies:
        spec = policy.get("spec") or {}
        types = spec.get("policyTypes") or (["Ingress", "Egress"] if "egress" in spec else ["Ingress"])
        if "Egress" in types and selects(spec.get("podSelector") or {}, labels):
            (opening if spec.get("egress") else denying).append(policy["metadata"]["name"])
    return denying, opening


def pod_problem(pod: dict[str, Any]) -> str | None:
    """Why a pod will never run (failed phase or a fatal container state), or None."""
    st = pod.get("status") or {}
    phase = st.get("phase") or "Pending"
    statuses = (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or [])
    if phase in ("Failed", "Succeeded"):
        why = [f"phase {phase}"] + [f"{st[k]}" for k in ("reason", "message") if st.get(k)]
        for cs in statuses:
            term = (cs.get("state") or {}).get("terminated")
            if term:
                why.append(f"container {cs.get('name')} terminated: {term.get('reason')} (exit {term.get('exitCode')})")
        return "; ".join(why)
    for cs in statuses:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in FATAL_WAITING:
            return f"phase {phase}, container {cs.get('name')} {waiting['reason']}: {waiting.get('message', '')}"
    return None


def describe_pod(pod: dict[str, Any] | None) -> str:
    """Phase, scheduling and container states of a pod, for error messages."""
    if pod is None:
        return "no status seen"
    st = pod.get("status") or {}
    parts = [f"phase {st.get('phase') or 'Pending'}"]
    for c in st.get("conditions") or []:
        if c.get("status") != "True" and (c.get("reason") or c.get("message")):
            parts.append(f"{c.get('type')}={c.get('status')} {c.get('reason', '')}: {c.get('message', '')}")
    for cs in (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or []):
        waiting = (cs.get("state") or {}).get("waiting")
        if waiting:
            parts.append(f"container {cs.get('name')} waiting: {waiting.get('reason')}")
    return "; ".join(parts)


def pod_due(pod: dict[str, Any], now: float, max_age_s: float | None = None) -> bool:
    """Whether garbage collection deletes a pod: past its expiry annotation or finished (``max_age_s`` None), or
    created ``max_age_s`` or more seconds ago."""
    meta = pod.get("metadata") or {}
    if max_age_s is not None:
        created = meta.get("creationTimestamp")
        return created is None or now - parse_rfc3339(created) >= max_age_s
    expires = (meta.get("annotations") or {}).get(EXPIRES_ANNOTATION)
    finished = (pod.get("status") or {}).get("phase") in ("Failed", "Succeeded")
    return finished or (expires is not None and parse_rfc3339(expires) <= now)
