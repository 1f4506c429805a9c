"""Owner leases: session pods of a service replica that died are found and deleted by the replicas still alive.

A session pod carries its owner's label (the service replica that made it). In the service's own namespace the pod
also names the replica's pod as its owner, and Kubernetes' garbage collector deletes it with that pod; but session
pods live in a namespace of their own (least privilege), and owner references cannot cross namespaces. So each
replica holds a ``coordination.k8s.io`` Lease in the session namespace, ``rl-sandbox-owner-<owner>``, renewed at
every reaper pass. A replica's pass also looks at the other replicas' leases (of the same run: the service's labels):
one not renewed for its duration belongs to a replica that is gone (crashed, evicted, scaled away), and its pods and
its lease are deleted. A replica that closes cleanly deletes its pods and its lease itself.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from kubernetes.client.exceptions import ApiException

from sandbox import k8s_manifests as m

log = logging.getLogger(__name__)
LEASE_PREFIX = "rl-sandbox-owner-"
API_TIMEOUT_S = 30


def _micro_time(t: float) -> str:
    """A Unix time as Kubernetes' MicroTime."""
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1e6):06d}Z"


class OwnerLease:
    """This replica's lease in ``namespace`` (see the module); ``duration_s``: how long it holds unrenewed."""

    def __init__(self, api_client: Any, namespace: str, owner: str, labels: dict[str, str], duration_s: float) -> None:
        from kubernetes.client import CoordinationV1Api

        self.api = CoordinationV1Api(api_client)
        self.namespace, self.owner, self.duration_s = namespace, owner, max(1, int(duration_s))
        self.name = (LEASE_PREFIX + owner)[:253]
        self.labels = {**labels, m.MANAGED_BY_LABEL: m.MANAGED_BY, m.OWNER_LABEL: owner}
        self.selector = ",".join(f"{k}={v}" for k, v in {**labels, m.MANAGED_BY_LABEL: m.MANAGED_BY}.items())

    def renew(self) -> None:
        """Create the lease, or move its renew time to now."""
        now = _micro_time(time.time())
        spec = {"holderIdentity": self.owner, "leaseDurationSeconds": self.duration_s, "renewTime": now}
        try:
            self.api.patch_namespaced_lease(self.name, self.namespace, {"spec": spec}, _request_timeout=API_TIMEOUT_S)
        except ApiException as e:
            if e.status != 404:
                raise
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "labels": self.labels},
                    "spec": {**spec, "acquireTime": now}}
            self.api.create_namespaced_lease(self.namespace, body, _request_timeout=API_TIMEOUT_S)

    def collect_orphans(self, delete_pods_of: Callable[[str], int]) -> int:
        """Delete the pods (``delete_pods_of(owner)``) and the lease of every other replica of the run whose lease
        has run out; returns how many pods went."""
        resp = self.api.list_namespaced_lease(self.namespace, label_selector=self.selector,
                                              _preload_content=False, _request_timeout=API_TIMEOUT_S)
        now, deleted = time.time(), 0
        for lease in json.loads(resp.data).get("items") or []:
            spec, meta = lease.get("spec") or {}, lease["metadata"]
            owner = (meta.get("labels") or {}).get(m.OWNER_LABEL) or spec.get("holderIdentity")
            renewed = spec.get("renewTime") or spec.get("acquireTime")
            if owner == self.owner or not owner or not renewed:
                continue
            if m.parse_rfc3339(renewed) + float(spec.get("leaseDurationSeconds") or self.duration_s) > now:
                continue
            n = delete_pods_of(owner)
            deleted += n
            log.warning("sandbox replica %s stopped renewing its lease in %s: deleted its %d session pod(s)", owner,
                        self.namespace, n)
            self.release(meta["name"])
        return deleted

    def release(self, name: str | None = None) -> None:
        """Delete a lease (this replica's by default); gone already is fine."""
        try:
            self.api.delete_namespaced_lease(name or self.name, self.namespace, _request_timeout=API_TIMEOUT_S)
        except ApiException as e:
            if e.status != 404:
                log.warning("deleting lease %s/%s: HTTP %s %s", self.namespace, name or self.name, e.status, e.reason)
