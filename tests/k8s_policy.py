"""What rendered manifests allow, read offline for the chart checks: NetworkPolicy reachability, RBAC rules, and the
pods' images and capabilities. Pure Python over ``helm template`` output (a list of manifests).

``Cluster(docs, namespaces)`` answers ``allowed(src, dst, port)``: whether a TCP (or UDP) connection from one
``Endpoint`` to another passes both the source's egress policies and the destination's ingress policies, as the
NetworkPolicy API defines them:
- a pod is isolated in a direction once a policy of its namespace selects it with that policyType (policyTypes
  defaults to Ingress, plus Egress when the policy has egress rules); an isolated pod admits what any selecting
  policy's rules allow, and policies add up;
- a rule without ``from``/``to`` admits every peer, without ``ports`` every port; a peer is a ``podSelector`` (the
  policy's namespace), a ``namespaceSelector`` (every pod there), both (those pods there), or an ``ipBlock``;
- ports are numbers or container port names of the destination, with ``endPort`` ranges; protocol TCP by default;
- hostNetwork pods are never isolated, and their traffic carries their node's address, which only ipBlocks match (pod
  selectors do not: the common behaviour of CNIs, which the API leaves open); endpoints outside the cluster (the API
  server, a bucket) have an address and no namespace.
Namespaces carry ``kubernetes.io/metadata.name`` (set by the API server) besides the labels given.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from sandbox.k8s_manifests import selects

ALLOWED_CAPABILITIES_NON_ROOT = frozenset({"NET_BIND_SERVICE"})  # restricted's only one (and harmless lost)


@dataclass(frozen=True)
class Endpoint:
    """A pod (``namespace`` set) or an address outside the cluster (``namespace`` None) that connects or accepts.
    ``ip`` is the pod's address, its node's for a hostNetwork pod; ``ports``: its container ports by name."""

    name: str
    namespace: str | None
    ip: str
    labels: dict[str, str] = field(default_factory=dict)
    host_network: bool = False
    ports: dict[str, int] = field(default_factory=dict)

    def __hash__(self) -> int:
        return hash((self.name, self.namespace, self.ip))


class Cluster:
    """The NetworkPolicies of ``docs`` (those without a namespace are in ``default_namespace``) and the labels of
    ``namespaces`` (name -> labels; others have only their name label)."""

    def __init__(self, docs: list[dict], default_namespace: str, namespaces: dict[str, dict[str, str]] | None = None):
        self.policies = [(d["metadata"].get("namespace") or default_namespace, d["spec"]) for d in docs
                         if d.get("kind") == "NetworkPolicy"]
        self.namespace_labels = dict(namespaces or {})

    def labels_of(self, namespace: str) -> dict[str, str]:
        return {**self.namespace_labels.get(namespace, {}), "kubernetes.io/metadata.name": namespace}

    def allowed(self, src: Endpoint, dst: Endpoint, port: int | str, protocol: str = "TCP") -> bool:
        """Whether ``src`` may open a connection to ``dst`` on ``port`` (a number or one of ``dst``'s port names)."""
        number = dst.ports[port] if isinstance(port, str) else port
        return (self._admits("Egress", src, dst, number, protocol, dst)
                and self._admits("Ingress", dst, src, number, protocol, dst))

    def _admits(self, direction: str, pod: Endpoint, peer: Endpoint, port: int, protocol: str, dst: Endpoint) -> bool:
        if pod.namespace is None or pod.host_network:
            return True  # not a pod, or a pod NetworkPolicy does not isolate
        selecting = [(ns, spec) for ns, spec in self.policies if ns == pod.namespace
                     and selects(spec.get("podSelector") or {}, pod.labels) and direction in _types(spec)]
        if not selecting:
            return True
        key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
        for ns, spec in selecting:
            for rule in spec.get(key) or []:
                peers = rule.get(peers_key)
                if peers and not any(self._peer_matches(p, ns, peer) for p in peers):
                    continue
                if _port_matches(rule.get("ports"), port, protocol, dst):
                    return True
        return False

    def _peer_matches(self, peer: dict[str, Any], policy_namespace: str, other: Endpoint) -> bool:
        if "ipBlock" in peer:
            block = peer["ipBlock"]
            address = ipaddress.ip_address(other.ip)
            return (address in ipaddress.ip_network(block["cidr"], strict=False)
                    and not any(address in ipaddress.ip_network(x, strict=False) for x in block.get("except", [])))
        if other.namespace is None or other.host_network:
            return False  # pod selectors match pods on the pod network only
        if "namespaceSelector" in peer:
            if not selects(peer["namespaceSelector"] or {}, self.labels_of(other.namespace)):
                return False
        elif other.namespace != policy_namespace:
            return False
        return "podSelector" not in peer or selects(peer["podSelector"] or {}, other.labels)


def _types(spec: dict[str, Any]) -> list[str]:
    return spec.get("policyTypes") or ["Ingress", *(["Egress"] if "egress" in spec else [])]


def _port_matches(ports: list[dict] | None, port: int, protocol: str, dst: Endpoint) -> bool:
    if not ports:
        return True
    for p in ports:
        if p.get("protocol", "TCP") != protocol:
            continue
        if "port" not in p:
            return True
        low = dst.ports.get(p["port"]) if isinstance(p["port"], str) else p["port"]
        if low is not None and low <= port <= p.get("endPort", low):
            return True
    return False


# --- Pods of a render ---------------------------------------------------------------------------------------------

def pod_templates(docs: list[dict]) -> Iterator[tuple[str, dict]]:
    """(where, pod template) of every pod a release makes itself: the RayJob's head, worker groups and submitter,
    and the pod templates of Deployments and Jobs."""
    for d in docs:
        if d["kind"] == "RayJob":
            cluster = d["spec"]["rayClusterSpec"]
            yield "ray-head", cluster["headGroupSpec"]["template"]
            for g in cluster["workerGroupSpecs"]:
                yield f"ray-worker {g['groupName']}", g["template"]
            if "submitterPodTemplate" in d["spec"]:
                yield "ray-submitter", d["spec"]["submitterPodTemplate"]
        elif d["kind"] in ("Deployment", "Job", "StatefulSet", "DaemonSet"):
            yield d["metadata"]["name"], d["spec"]["template"]


def containers(spec: dict) -> list[dict]:
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def images(docs: list[dict]) -> list[tuple[str, str]]:
    """(where, image) of every container of every pod the release makes."""
    return [(f"{where}/{c['name']}", c["image"]) for where, t in pod_templates(docs) for c in containers(t["spec"])]


def capability_problems(spec: dict) -> list[str]:
    """Containers of a pod spec that add capabilities while running as a non-root user: a capability added to a
    container reaches a non-root process only until its first execve, so it only raises the pod's Pod Security
    level for nothing (or, as IPC_LOCK for RDMA, fails where it is needed)."""
    out = []
    pod_sc = spec.get("securityContext") or {}
    for c in containers(spec):
        sc = c.get("securityContext") or {}
        added = set((sc.get("capabilities") or {}).get("add") or []) - ALLOWED_CAPABILITIES_NON_ROOT
        uid = sc.get("runAsUser", pod_sc.get("runAsUser"))
        if added and uid != 0:
            out.append(f"{c['name']}: adds {sorted(added)} as uid {uid}")
    return out


# --- RBAC ---------------------------------------------------------------------------------------------------------

FORBIDDEN_VERBS = {"escalate", "bind", "impersonate"}


def rbac_problems(docs: list[dict]) -> list[str]:
    """Rules of the release's Roles and ClusterRoles that grant more than a run may have: a wildcard, anything on
    Secrets, creating or changing NetworkPolicies (they add up: one made could reopen what the chart closes), exec into
    pods, or escalate/bind/impersonate."""
    out = []
    for d in docs:
        if d["kind"] not in ("Role", "ClusterRole"):
            continue
        name = f"{d['kind']}/{d['metadata']['name']}"
        for i, rule in enumerate(d.get("rules") or []):
            groups, resources, verbs = (set(rule.get(k) or []) for k in ("apiGroups", "resources", "verbs"))
            where = f"{name} rule {i}"
            if "*" in groups | resources | verbs:
                out.append(f"{where}: a wildcard")
            if "secrets" in resources:
                out.append(f"{where}: Secrets ({sorted(verbs)})")
            if "networkpolicies" in resources and verbs & {"create", "update", "patch", "delete", "deletecollection"}:
                out.append(f"{where}: changes NetworkPolicies ({sorted(verbs)})")
            if resources & {"pods/exec", "pods/attach", "pods/portforward"}:
                out.append(f"{where}: {sorted(resources & {'pods/exec', 'pods/attach', 'pods/portforward'})}")
            if verbs & FORBIDDEN_VERBS:
                out.append(f"{where}: {sorted(verbs & FORBIDDEN_VERBS)}")
    return out
