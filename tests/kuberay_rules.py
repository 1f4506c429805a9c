"""What KubeRay's operator refuses in a RayJob beyond its CRD's schema, for the chart checks (tests/k8s_validation.py).

The CRD's OpenAPI schema says little (no enums, no bounds); the operator validates a RayJob when it reconciles it and
then marks it Failed (``ValidationFailed``) without making a Ray cluster. These are the rules of KubeRay v1.2.2 to
v1.7.0 that a values file could break, read from the operator's validation and submitter code, the strictest of those
releases where they differ. Kueue's own admission check of a RayJob it queues is here too (it refuses autoscaling).

``kuberay_findings(job)`` returns ``(field path, message)`` pairs, like the schema findings.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

FieldPath = tuple[str | int, ...]
Finding = tuple[FieldPath, str]

# Submission modes and the first KubeRay release that has each (the chart supports 1.2 and newer).
SUBMISSION_MODES = {"K8sJobMode": (1, 0), "HTTPMode": (1, 0), "InteractiveMode": (1, 3), "SidecarMode": (1, 5)}
OLDEST_SUPPORTED = (1, 2)
# rayStartParams that say a group's resources; KubeRay >= 1.4 also has a group-level `resources` map, and refuses both.
RESOURCE_PARAMS = ("num-cpus", "num-gpus", "memory", "resources")
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
TOKEN_AUTH_MIN_RAY = (2, 52, 0)
SUBMITTER_RESTART_POLICIES = ("Never", "OnFailure")  # the submitter is a batch/v1 Job's pod


def _version(text: str) -> tuple[int, ...] | None:
    match = re.match(r"^v?(\d+)\.(\d+)(?:\.(\d+))?", str(text))
    return tuple(int(x or 0) for x in match.groups()) if match else None


def _int(spec: dict, key: str) -> int | None:
    value = spec.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _containers(template: Any) -> list:
    spec = (template or {}).get("spec") if isinstance(template, dict) else None
    containers = spec.get("containers") if isinstance(spec, dict) else None
    return containers if isinstance(containers, list) else []


def kuberay_findings(job: dict) -> list[Finding]:
    """The rules of the module docstring that ``job`` (a ray.io/v1 RayJob) breaks."""
    spec = job.get("spec")
    if not isinstance(spec, dict):
        return []
    meta = job.get("metadata") if isinstance(job.get("metadata"), dict) else {}
    labels = meta.get("labels") if isinstance(meta.get("labels"), dict) else {}
    out: list[Finding] = []
    cluster = spec.get("rayClusterSpec")
    selector = spec.get("clusterSelector")
    if not isinstance(cluster, dict) and not selector:
        out.append((("spec", "rayClusterSpec"), "KubeRay needs one of rayClusterSpec or clusterSelector"))
    for key, low, rule in (("ttlSecondsAfterFinished", 0, "a non-negative integer"),
                           ("activeDeadlineSeconds", 1, "a positive integer"),
                           ("preRunningDeadlineSeconds", 1, "a positive integer"),
                           ("backoffLimit", 0, "a non-negative integer")):
        value = _int(spec, key)
        if value is not None and value < low:
            out.append((("spec", key), f"{value}: KubeRay requires {rule}"))
    mode = spec.get("submissionMode", "K8sJobMode")
    since = SUBMISSION_MODES.get(mode)
    if since is None:
        out.append((("spec", "submissionMode"), f"{mode!r} is not one of {list(SUBMISSION_MODES)} (KubeRay)"))
    elif since > OLDEST_SUPPORTED:
        out.append((("spec", "submissionMode"), f"{mode!r} needs KubeRay >= {since[0]}.{since[1]}; the chart "
                                                f"supports {OLDEST_SUPPORTED[0]}.{OLDEST_SUPPORTED[1]} and newer"))
    backoff = _int(spec, "backoffLimit") or 0
    if mode == "InteractiveMode" and backoff > 0:
        out.append((("spec", "backoffLimit"), "KubeRay refuses retries (backoffLimit > 0) in InteractiveMode"))
    if selector and backoff > 0:
        out.append((("spec", "backoffLimit"), "KubeRay refuses retries (backoffLimit > 0) with a clusterSelector"))
    # Kueue admits a RayJob by creating it suspended and unsuspending it: KubeRay refuses to suspend one that keeps
    # its cluster after the job.
    suspended = spec.get("suspend") is True or KUEUE_QUEUE_LABEL in labels
    if suspended and spec.get("shutdownAfterJobFinishes") is not True:
        why = "suspend is true" if spec.get("suspend") is True else f"Kueue suspends it ({KUEUE_QUEUE_LABEL})"
        out.append((("spec", "shutdownAfterJobFinishes"), f"must be true: {why}, and KubeRay refuses to suspend a "
                                                          "RayJob with shutdownAfterJobFinishes false"))
    if suspended and selector:
        out.append((("spec", "clusterSelector"), "KubeRay cannot suspend a RayJob with a clusterSelector"))
    text = spec.get("runtimeEnvYAML")
    if isinstance(text, str) and text.strip():
        try:
            parsed = yaml.safe_load(text)
        except yaml.YAMLError as e:
            parsed = e
        if not isinstance(parsed, dict):
            out.append((("spec", "runtimeEnvYAML"), "KubeRay cannot read it as a YAML mapping"))
    submitter = spec.get("submitterPodTemplate")
    if isinstance(submitter, dict):
        if mode == "SidecarMode":
            out.append((("spec", "submitterPodTemplate"), "KubeRay refuses a submitterPodTemplate in SidecarMode"))
        elif not _containers(submitter):
            out.append((("spec", "submitterPodTemplate", "spec", "containers"),
                        "KubeRay takes the first container as the submitter: there must be one"))
        policy = (submitter.get("spec") or {}).get("restartPolicy")
        if mode != "SidecarMode" and policy not in (None, *SUBMITTER_RESTART_POLICIES):
            out.append((("spec", "submitterPodTemplate", "spec", "restartPolicy"),
                        f"{policy!r}: the submitter is a Job's pod (KubeRay makes a batch/v1 Job of it), one of "
                        f"{list(SUBMITTER_RESTART_POLICIES)}"))
    if isinstance(cluster, dict):
        out += _cluster_findings(cluster, ("spec", "rayClusterSpec"), meta, labels)
    return out


def _cluster_findings(cluster: dict, at: FieldPath, meta: dict, labels: dict) -> list[Finding]:
    out: list[Finding] = []
    head = cluster.get("headGroupSpec") if isinstance(cluster.get("headGroupSpec"), dict) else {}
    groups = cluster.get("workerGroupSpecs") if isinstance(cluster.get("workerGroupSpecs"), list) else []
    autoscaling = cluster.get("enableInTreeAutoscaling") is True
    if not _containers(head.get("template")):
        out.append(((*at, "headGroupSpec", "template", "spec", "containers"), "KubeRay needs a head container"))
    all_groups: list[tuple[FieldPath, dict, str]] = [((*at, "headGroupSpec"), head, "the head")]
    for i, group in enumerate(groups):
        if not isinstance(group, dict):
            continue
        where = (*at, "workerGroupSpecs", i)
        name = group.get("groupName", i)
        all_groups.append((where, group, f"worker group {name}"))
        if not _containers(group.get("template")):
            out.append(((*where, "template", "spec", "containers"), "KubeRay needs a container in each worker group"))
        low, high = _int(group, "minReplicas"), _int(group, "maxReplicas")
        if not autoscaling and (low is None or high is None):
            out.append((where, "KubeRay needs minReplicas and maxReplicas when autoscaling is off"))
        for key, value in (("minReplicas", low), ("maxReplicas", high)):
            if value is not None and value < 0:
                out.append(((*where, key), f"{value}: KubeRay refuses a negative {key}"))
        if low is not None and high is not None and low > high:
            out.append(((*where, "minReplicas"), f"{low} is greater than maxReplicas {high} (KubeRay refuses it)"))
    for where, group, name in all_groups:
        params = group.get("rayStartParams") if isinstance(group.get("rayStartParams"), dict) else {}
        if group.get("resources") and any(params.get(k) for k in RESOURCE_PARAMS):
            out.append(((*where, "resources"), f"{name}: KubeRay refuses resources in both rayStartParams and "
                                               "the group's resources"))
        if "labels" in params:
            out.append(((*where, "rayStartParams", "labels"), f"{name}: KubeRay refuses rayStartParams labels (the "
                                                              "group's labels field says them)"))
    auth = cluster.get("authOptions") if isinstance(cluster.get("authOptions"), dict) else {}
    if auth.get("mode") == "token":
        ray = _version(cluster.get("rayVersion") or "")
        if ray is None or ray < TOKEN_AUTH_MIN_RAY:
            out.append(((*at, "rayVersion"), f"authOptions.mode token needs rayVersion >= 2.52.0 (KubeRay), got "
                                             f"{cluster.get('rayVersion')!r}"))
    if auth.get("enableK8sTokenAuth"):
        out.append(((*at, "authOptions", "enableK8sTokenAuth"), "KubeRay does not support it for a RayJob"))
    annotations = meta.get("annotations") if isinstance(meta.get("annotations"), dict) else {}
    fault_tolerant = cluster.get("gcsFaultToleranceOptions") or annotations.get("ray.io/ft-enabled")
    head_containers = _containers(head.get("template"))
    head_env = head_containers[0].get("env") if head_containers and isinstance(head_containers[0], dict) else None
    if not fault_tolerant and any(isinstance(e, dict) and e.get("name") == "RAY_REDIS_ADDRESS"
                                  for e in head_env or []):
        out.append(((*at, "headGroupSpec"), "RAY_REDIS_ADDRESS without gcsFaultToleranceOptions: KubeRay refuses it"))
    if autoscaling and KUEUE_QUEUE_LABEL in labels:
        out.append(((*at, "enableInTreeAutoscaling"), "Kueue refuses a RayJob it queues that autoscales"))
    return out
