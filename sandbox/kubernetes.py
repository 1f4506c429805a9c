"""The Kubernetes pod backend: one pod per session, from the task's image, driven through its in-pod agent.

The agent (``sandbox.agent``) listens on the pod's IP; the service calls it over plain HTTP with a per-pod token. Scale
and operations notes (rates, warm pools, RBAC, NetworkPolicy, TTL): docs/sandbox-kubernetes.md.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import kubernetes
from kubernetes.client.rest import ApiException

from sandbox import k8s_manifests as m
from sandbox.agent import AgentClient
from sandbox.backend import ExecResult, Limits, SandboxError, check_relative_path
from sandbox.k8s_leases import OwnerLease
from sandbox.k8s_rate import TokenBucket
from sandbox.options import KubernetesOptions
from sandbox.requests import check_image_allowed

log = logging.getLogger(__name__)

API_TIMEOUT_S = 30.0  # one API-server request (not a watch)
# Set by the Helm chart: where session pods go, and (downward API) the service pod that owns them.
SESSION_NAMESPACE_ENV = "RL_SANDBOX_SESSION_NAMESPACE"
POD_NAME_ENV, POD_UID_ENV, POD_NAMESPACE_ENV = "POD_NAME", "POD_UID", "POD_NAMESPACE"
_SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
WATCH_CHUNK_S = 15  # a start's watch is renewed (from its last resourceVersion) this often, to notice close()


@dataclass(kw_only=True)
class _Pod:
    """A started pod whose agent answered (times are Unix times)."""

    name: str
    session_id: str
    image: str
    ip: str
    token: str
    created_at: float
    expires_at: float


class KubernetesSession:
    """One pod; commands and files go to its agent over HTTP."""

    def __init__(self, backend: KubernetesBackend, pod: _Pod):
        self.id = pod.session_id
        self.pod = pod
        self._backend = backend
        self._closed: str | None = None  # why, once closed
        self._lock = threading.Lock()
        self.agent = AgentClient(_url(pod.ip, backend.agent_port), pod.token, f"pod {backend.namespace}/{pod.name}")

    def _agent(self) -> AgentClient:
        if self._closed is None and time.time() >= self.pod.expires_at:
            self.close("expired after its TTL")
        if self._closed is not None:
            raise SandboxError(f"session {self.id} (pod {self.pod.name}) is closed: {self._closed}", "NOT_FOUND")
        return self.agent

    def exec(self, argv: list[str], limits: Limits, stdin: bytes = b"", env: dict[str, str] | None = None,
             cancel: threading.Event | None = None) -> ExecResult:
        """Run ``argv`` in the pod's work directory; ``cancel`` set → the agent kills it, verdict CANCELLED."""
        return self._agent().exec(argv, limits, stdin, env, cancel)

    def write_files(self, files: dict[str, bytes], executable: frozenset[str] = frozenset()) -> None:
        """Create or replace files in the pod's work directory."""
        for path in files:
            check_relative_path(path)
        self._agent().write_files(files, executable)

    def read_files(self, paths: list[str], max_bytes: int) -> dict[str, bytes]:
        """Read files from the pod's work directory."""
        for path in paths:
            check_relative_path(path)
        return self._agent().read_files(paths, max_bytes)

    def close(self, reason: str = "closed", delete: bool = True) -> None:
        """Delete the pod (grace period 0). Idempotent."""
        with self._lock:
            if self._closed is not None:
                return
            self._closed = reason
        self._backend._forget(self, delete)


def _session_namespace(options: KubernetesOptions) -> str:
    """Where session pods go: RL_SANDBOX_SESSION_NAMESPACE, else the options' namespace."""
    return os.environ.get(SESSION_NAMESPACE_ENV) or options.namespace


def _own_namespace(options: KubernetesOptions) -> str:
    """The service pod's namespace: POD_NAMESPACE, the service account's, else the options' namespace."""
    if os.environ.get(POD_NAMESPACE_ENV):
        return os.environ[POD_NAMESPACE_ENV]
    try:
        with open(_SA_NAMESPACE_FILE) as f:
            return f.read().strip() or options.namespace
    except OSError:
        return options.namespace


def _url(ip: str, port: int) -> str:
    return f"http://[{ip}]:{port}" if ":" in ip else f"http://{ip}:{port}"


#: what runtime_class auto tries first: gVisor's usual RuntimeClass name (its runsc handler)
GVISOR = "gvisor"


def _runtime_class(option: str | None) -> str | None:
    """The RuntimeClass session pods start with: auto's guess, the one named, or none."""
    if option == "auto":
        return GVISOR
    return None if option in (None, "", "none") else option


class KubernetesBackend:
    """Sessions as pods: created at a limited rate, optionally taken from a warm pool, deleted on close or at TTL."""

    name = "kubernetes"

    # owner: label value naming this service instance (default: its pod's name, from POD_NAME; else random); a
    # restarted instance with the same one and collect_on_start (the default with POD_NAME) deletes its
    # predecessor's pods first. Session pods go to RL_SANDBOX_SESSION_NAMESPACE (else options.namespace), owned by
    # the service pod (POD_NAME, POD_UID) when that is in the same namespace; in any namespace each instance holds an
    # owner lease there (lease_s unrenewed, default 3 reaper passes, at least 60 s), and the others delete the pods
    # of one whose lease ran out (sandbox.k8s_leases). workdir_volume=False: the image
    # provides ``workdir`` (e.g. the repository at /testbed). service_labels/service_namespace: who may reach the
    # agents (the NetworkPolicy; default namespace: the service's own).
    def __init__(self, *, options: KubernetesOptions | None = None,
                 api_client: kubernetes.client.ApiClient | None = None, agent_port: int = 8000,
                 resources: dict[str, Any] | None = None, ready_timeout_s: float = 300,
                 create_burst: float | None = None, workdir: str = "/work", workdir_volume: bool = True,
                 owner: str | None = None, service_labels: dict[str, str] | None = None,
                 service_namespace: str | None = None, network_policy: bool = True, reap_interval_s: float = 60,
                 pool_max_age_s: float | None = None, pool_workers: int = 16, collect_on_start: bool | None = None,
                 lease_s: float | None = None):
        """``options``: a run config's keys for this backend (namespace, images, pod settings, rates, warm pool);
        ``resources``: requests and limits of session pods where they differ (None: ``options.cpu``/``memory``)."""
        self.options = o = options if options is not None else KubernetesOptions()
        if not o.agent_image:
            raise SandboxError("the kubernetes backend needs agent_image (the runtime image with the sandbox package)",
                               "INVALID_ARGUMENT")
        self._owns_client = api_client is None
        if api_client is None:
            try:
                kubernetes.config.load_incluster_config()
            except kubernetes.config.ConfigException:
                kubernetes.config.load_kube_config()
            api_client = kubernetes.client.ApiClient()
        self.api_client = api_client
        self.core = kubernetes.client.CoreV1Api(api_client)
        self.net = kubernetes.client.NetworkingV1Api(api_client)
        self.namespace, self.agent_image, self.agent_port = _session_namespace(o), o.agent_image, agent_port
        self.default_image, self.ttl_s, self.ready_timeout_s = o.default_image, float(o.ttl_s), float(ready_timeout_s)
        # the operator's own images are always allowed; callers' others only by pattern (their pods get pull secrets)
        self.allowed_images = tuple(dict.fromkeys([*filter(None, [o.default_image]), *o.warm_pool, *o.allowed_images]))
        own_namespace = _own_namespace(o)
        pod_name, pod_uid = os.environ.get(POD_NAME_ENV, ""), os.environ.get(POD_UID_ENV, "")
        self.owner_pod = (pod_name, pod_uid) if pod_name and pod_uid else None
        if self.owner_pod is not None and self.namespace != own_namespace:
            log.warning("session pods in namespace %s cannot be owned by the service pod %s/%s (owner references do "
                        "not cross namespaces): its owner lease there lets the others delete them if it dies",
                        self.namespace, own_namespace, pod_name)
            self.owner_pod = None
        stable = pod_name if pod_name and m.is_label_value(pod_name) else pod_uid
        self.owner = m.label_value(owner or stable or f"rl-sandbox-{uuid.uuid4().hex[:10]}")
        if collect_on_start is None:  # the same pod restarted its container: its old sessions are gone with it
            collect_on_start = not owner and bool(stable)
        if service_namespace is None and self.namespace != own_namespace:
            service_namespace = own_namespace
        self._pod_options = {"agent_image": o.agent_image, "port": agent_port, "ttl_s": self.ttl_s,
                             "workdir": workdir, "workdir_volume": workdir_volume,
                             "resources": {"cpu": o.cpu, "memory": o.memory} if resources is None else resources,
                             "runtime_class": _runtime_class(o.runtime_class), "node_selector": o.node_selector,
                             "tolerations": o.tolerations, "image_pull_secrets": list(o.image_pull_secrets),
                             "labels": o.labels, "priority_class": o.priority_class,
                             "run_as_user": o.run_as_user, "owner_pod": self.owner_pod}
        self._policy = m.deny_egress_policy(self.namespace, port=agent_port, service_labels=service_labels,
                                            service_namespace=service_namespace) if network_policy else None
        self._policy_ready, self._policy_lock = self._policy is None, threading.Lock()
        self.bucket = TokenBucket(o.max_creates_per_s, create_burst)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sessions: dict[str, KubernetesSession] = {}
        # Warm pool: per image, ready pods (oldest first), fills in flight, and a backoff after failed fills.
        self._warm_target = {img: int(n) for img, n in o.warm_pool.items() if n > 0}
        self._pool: dict[str, list[_Pod]] = {img: [] for img in self._warm_target}
        self._filling = dict.fromkeys(self._warm_target, 0)
        self._fill_failures = dict.fromkeys(self._warm_target, 0)
        self._fill_retry_at = dict.fromkeys(self._warm_target, 0.0)
        # A pooled pod ages towards its activeDeadlineSeconds; past this age it is replaced, so that a session taken
        # from the pool still has most of its TTL.
        self.pool_max_age_s = self.ttl_s / 4 if pool_max_age_s is None else pool_max_age_s
        self._filler = ThreadPoolExecutor(pool_workers, "k8s-warm-pool") if self._warm_target else None
        self.reap_interval_s = reap_interval_s
        if collect_on_start:
            self.garbage_collect(max_age_s=0)  # before this instance owns any pod: all of them are leftovers
        # a lease held while this replica lives, so that its pods go if it dies (owner references cannot cross
        # from the service's namespace into the session namespace)
        self.lease: OwnerLease | None = OwnerLease(api_client, self.namespace, self.owner, dict(o.labels),
                                                   lease_s or max(60.0, 3 * reap_interval_s))
        self._leases()
        self._reaper = threading.Thread(target=self._reap_loop, name="k8s-sandbox-reaper", daemon=True)
        if reap_interval_s > 0:
            self._reaper.start()
        self._refill()

    def create_session(self, image: str = "", files: dict[str, bytes] | None = None) -> KubernetesSession:
        """A session in a pod of ``image`` (or the default image), with ``files`` written to its work directory."""
        image = image or self.default_image
        if not image:
            raise SandboxError("no image given and no default image configured", "INVALID_ARGUMENT")
        check_image_allowed(image, self.allowed_images)
        for path in files or {}:
            check_relative_path(path)  # refused before a pod is made for nothing
        while (pod := self._take_warm(image)) is not None:
            try:
                return self._open(pod, files, pooled=True)
            except SandboxError as e:
                if e.code != "UNAVAILABLE":  # a dead pooled pod is replaced; any other error is the caller's
                    raise
                log.warning("warm pod %s unusable, trying another: %s", pod.name, e)
        return self._open(self._start_pod(image), files)

    def _open(self, pod: _Pod, files: dict[str, bytes] | None, pooled: bool = False) -> KubernetesSession:
        session = KubernetesSession(self, pod)
        with self._lock:
            closed = self._stop.is_set()
            if not closed:
                self._sessions[session.id] = session
        if closed:
            self._delete_pod(pod.name)
            raise SandboxError("the kubernetes backend is closed", "UNAVAILABLE")
        try:
            if files:
                session.write_files(files)
            elif pooled:  # it waited in the pool: make sure it is still alive
                session.agent.call("/healthz", timeout=5.0)
        except BaseException:
            session.close("its initial files could not be written" if files else "its agent did not answer")
            raise
        return session

    def _forget(self, session: KubernetesSession, delete: bool) -> None:
        with self._lock:
            self._sessions.pop(session.id, None)
        if delete:
            self._delete_pod(session.pod.name)

    def _ensure_network_policy(self) -> None:
        """Make sure, once per backend, that a NetworkPolicy of the namespace denies its session pods all egress: one
        there already (the Helm chart's, whose Role lets the service read policies but make none), else this
        backend's own (``deny_egress_policy``; AlreadyExists is fine). No pod is started without one."""
        with self._policy_lock:
            if self._policy_ready:
                return
            try:
                found = self._denying_policy()
                if found is None:
                    self.net.create_namespaced_network_policy(self.namespace, self._policy,
                                                              _request_timeout=API_TIMEOUT_S)
                    found = m.POLICY_NAME
            except ApiException as e:
                if e.status != 409:
                    raise SandboxError(f"no NetworkPolicy in {self.namespace} denies the session pods' egress, and "
                                       f"creating {m.POLICY_NAME} failed: HTTP {e.status} {e.reason}; sandboxes are "
                                       "not started without one", "UNAVAILABLE") from None
                found = m.POLICY_NAME
            log.info("session pods in %s: egress denied by NetworkPolicy %s", self.namespace, found)
            self._policy_ready = True

    def _denying_policy(self) -> str | None:
        """The name of a NetworkPolicy of the namespace that denies session pods all egress, or None (also when this
        service may not list policies); those that allow them some are warned of (policies add up)."""
        try:
            resp = self.net.list_namespaced_network_policy(self.namespace, _preload_content=False,
                                                           _request_timeout=API_TIMEOUT_S)
        except ApiException as e:
            if e.status in (403, 404):
                return None
            raise
        labels = {m.MANAGED_BY_LABEL: m.MANAGED_BY, m.SESSION_LABEL: "x", m.OWNER_LABEL: self.owner,
                  **self.options.labels}
        denying, opening = m.egress_policies(json.loads(resp.data).get("items") or [], labels)
        if opening:
            log.warning("NetworkPolicies %s in %s allow session pods egress: policies add up, so the sandboxes can "
                        "connect where they say", ", ".join(opening), self.namespace)
        return denying[0] if denying else None

    def _start_pod(self, image: str) -> _Pod:
        """Create a pod, wait until it runs and its agent answers; on any failure delete it (UNAVAILABLE)."""
        self._ensure_network_policy()
        sid = uuid.uuid4().hex[:16]
        name = f"rl-sbx-{sid}"
        token = secrets.token_urlsafe(24)
        self.bucket.acquire()
        if self._stop.is_set():
            raise SandboxError("the kubernetes backend is closed", "UNAVAILABLE")
        now = time.time()
        manifest = m.sandbox_pod(name=name, namespace=self.namespace, session_id=sid, owner=self.owner, image=image,
                                 token=token, expires_at=now + self.ttl_s, **self._pod_options)
        try:
            try:
                created = self.core.create_namespaced_pod(self.namespace, manifest, _request_timeout=API_TIMEOUT_S)
            except ApiException as e:
                if not self._no_gvisor(e):
                    raise
                manifest["spec"].pop("runtimeClassName", None)
                created = self.core.create_namespaced_pod(self.namespace, manifest, _request_timeout=API_TIMEOUT_S)
        except ApiException as e:
            body = str(e.body or "")
            code = ("RESOURCE_EXHAUSTED" if e.status == 403 and "quota" in body
                    else "INVALID_ARGUMENT" if e.status == 422 else "UNAVAILABLE")
            raise SandboxError(f"creating pod {self.namespace}/{name}: HTTP {e.status} {e.reason}: {body[:500]}",
                               code) from None
        pod = _Pod(name=name, session_id=sid, image=image, ip="", token=token, created_at=now,
                   expires_at=now + self.ttl_s)
        deadline = time.monotonic() + self.ready_timeout_s
        try:
            pod.ip = self._wait_running(name, created.metadata.resource_version, deadline)
            self._wait_agent(pod, deadline)
        except BaseException as e:
            self._delete_pod(name)
            if isinstance(e, SandboxError) or not isinstance(e, Exception):
                raise
            raise SandboxError(f"pod {self.namespace}/{name} did not start: {type(e).__name__}: {e}",
                               "UNAVAILABLE") from e
        return pod

    def _no_gvisor(self, e: ApiException) -> bool:
        """Whether ``e`` is the API server refusing a pod of runtime_class auto's guess (its RuntimeClass does not
        exist): session pods then use the node's runtime, said once."""
        guess = self._pod_options["runtime_class"]
        if self.options.runtime_class != "auto" or guess is None or e.status != 403:
            return False
        try:
            message = str(json.loads(e.body).get("message", ""))
        except (TypeError, ValueError, AttributeError):
            message = str(e.body or "")
        if f'RuntimeClass "{guess}" not found' not in message:
            return False
        with self._lock:
            if self._pod_options["runtime_class"] is not None:
                self._pod_options["runtime_class"] = None
                log.warning("the cluster has no RuntimeClass %s (gVisor): session pods in %s share their node's "
                            "kernel; install gVisor, or set sandbox.kubernetes.runtime_class", guess, self.namespace)
        return True

    def _wait_running(self, name: str, resource_version: str | None, deadline: float) -> str:
        """The pod's IP once it runs. A watch from the create's resourceVersion: the Running transition arrives when
        it happens, no event can be missed, and the API server serves it from its watch cache with one request
        (polling would cost a GET per backoff step per starting pod)."""
        where, last, rv = f"pod {self.namespace}/{name}", None, resource_version
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise SandboxError(f"{where} not running after {self.ready_timeout_s:g} s: {m.describe_pod(last)}",
                                   "UNAVAILABLE")
            if self._stop.is_set():
                raise SandboxError(f"{where}: the kubernetes backend closed while it started", "UNAVAILABLE")
            w = kubernetes.watch.Watch()
            stream = w.stream(self.core.list_namespaced_pod, self.namespace, field_selector=f"metadata.name={name}",
                              resource_version=rv, timeout_seconds=max(1, min(WATCH_CHUNK_S, math.ceil(remaining))),
                              _request_timeout=(API_TIMEOUT_S, remaining + API_TIMEOUT_S))
            try:
                for event in stream:
                    obj = event["raw_object"]
                    rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
                    if event["type"] == "DELETED":
                        raise SandboxError(f"{where} was deleted while it started", "UNAVAILABLE")
                    last = obj
                    problem = m.pod_problem(obj)
                    if problem:
                        raise SandboxError(f"{where} failed to start: {problem}", "UNAVAILABLE")
                    ip = (obj.get("status") or {}).get("podIP")
                    if (obj.get("status") or {}).get("phase") == "Running" and ip:
                        return ip
            except ApiException as e:
                if e.status != 410:  # 410 Gone: our resourceVersion left the watch cache; restart from "now"
                    raise
                rv = None
            finally:
                stream.close()

    def _wait_agent(self, pod: _Pod, deadline: float) -> None:
        """Poll the agent's /healthz (the container runs before its server listens), checking the pod now and then."""
        agent = AgentClient(_url(pod.ip, self.agent_port), pod.token, f"pod {self.namespace}/{pod.name}")
        delay, check_at, last = 0.05, time.monotonic() + 5, None
        while True:
            try:
                agent.call("/healthz", timeout=2.0)
                return
            except SandboxError as e:
                last = e
            now = time.monotonic()
            if now + delay >= deadline:
                raise SandboxError(f"pod {self.namespace}/{pod.name} runs at {pod.ip} but its agent did not answer "
                                   f"within {self.ready_timeout_s:g} s: {last}", "UNAVAILABLE")
            if now >= check_at:  # the agent may have died (e.g. no python3 in the image): fail fast, not at timeout
                check_at = now + 5
                obj = self._read_pod(pod.name)
                problem = "deleted" if obj is None else m.pod_problem(obj)
                if problem:
                    raise SandboxError(f"pod {self.namespace}/{pod.name} failed to start: {problem}", "UNAVAILABLE")
            time.sleep(delay)
            delay = min(0.5, delay * 2)

    def _read_pod(self, name: str) -> dict[str, Any] | None:
        try:
            resp = self.core.read_namespaced_pod(name, self.namespace, _preload_content=False,
                                                 _request_timeout=API_TIMEOUT_S)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        return json.loads(resp.data)

    def _delete_pod(self, name: str) -> bool:
        """Delete a pod now (grace period 0); False if it was gone or the API server failed (the TTL then acts)."""
        try:
            self.core.delete_namespaced_pod(name, self.namespace, grace_period_seconds=0,
                                            _request_timeout=API_TIMEOUT_S)
            return True
        except ApiException as e:
            if e.status != 404:
                log.warning("deleting pod %s/%s: HTTP %s %s", self.namespace, name, e.status, e.reason)
        except Exception as e:  # the API server may be unreachable; activeDeadlineSeconds still ends the pod
            log.warning("deleting pod %s/%s: %s", self.namespace, name, e)
        return False

    def warm_count(self, image: str) -> int:
        """Ready pods waiting in the pool for ``image``."""
        with self._lock:
            return len(self._pool.get(image, ()))

    def _take_warm(self, image: str) -> _Pod | None:
        if image not in self._pool:
            return None
        stale, chosen = [], None
        with self._lock:
            pods = self._pool[image]
            while pods and chosen is None:
                pod = pods.pop(0)
                if time.time() - pod.created_at < self.pool_max_age_s:
                    chosen = pod
                else:
                    stale.append(pod)
        for pod in stale:
            self._delete_pod(pod.name)
        self._refill()
        return chosen

    def _refill(self) -> None:
        """Start fills so that every pooled image has its target of ready plus starting pods."""
        if self._filler is None:
            return
        with self._lock:
            if self._stop.is_set():
                return
            now = time.monotonic()
            for image, target in self._warm_target.items():
                if self._fill_retry_at[image] > now:
                    continue
                for _ in range(target - len(self._pool[image]) - self._filling[image]):
                    self._filling[image] += 1
                    self._filler.submit(self._fill_one, image)

    def _fill_one(self, image: str) -> None:
        pod = None
        try:
            pod = self._start_pod(image)
        except Exception as e:
            log.warning("warm pod for %s failed: %s", image, e)
        with self._lock:
            self._filling[image] -= 1
            if pod is None:  # back off, so that a broken image does not make pods in a loop
                self._fill_failures[image] += 1
                self._fill_retry_at[image] = time.monotonic() + min(300.0, 2.0 ** self._fill_failures[image])
                return
            self._fill_failures[image] = 0
            if not self._stop.is_set():
                self._pool[image].append(pod)
                return
        self._delete_pod(pod.name)

    def garbage_collect(self, max_age_s: float | None = None, owner: str | None = None) -> int:
        """Delete this owner's pods (``owner``'s: another replica's) by label: those past their expiry or finished
        (None), or older than ``max_age_s`` (0: all). Returns how many were deleted."""
        now, deleted, cont = time.time(), 0, None
        while True:
            resp = self.core.list_namespaced_pod(self.namespace, label_selector=m.owner_selector(owner or self.owner),
                                                 limit=500, _continue=cont, _preload_content=False,
                                                 _request_timeout=API_TIMEOUT_S)
            page = json.loads(resp.data)  # raw JSON: deserialising thousands of V1Pod models is slow
            for pod in page.get("items") or []:
                meta = pod["metadata"]
                if m.pod_due(pod, now, max_age_s) and meta.get("deletionTimestamp") is None:
                    with self._lock:  # forget it first: its session (closed) or its pool entry
                        session = self._sessions.get((meta.get("labels") or {}).get(m.SESSION_LABEL, ""))
                        for pods in self._pool.values():
                            pods[:] = [p for p in pods if p.name != meta["name"]]
                    if session is not None:
                        session.close("its pod was garbage-collected", delete=False)
                    deleted += self._delete_pod(meta["name"])
            cont = (page.get("metadata") or {}).get("continue")
            if not cont:
                return deleted

    def reap(self) -> int:
        """One reaper pass: close expired sessions, replace stale pooled pods, collect expired pods, refill."""
        now = time.time()
        with self._lock:
            expired = [s for s in self._sessions.values() if s.pod.expires_at <= now]
            stale = [p for pods in self._pool.values() for p in pods if now - p.created_at >= self.pool_max_age_s]
            for pods in self._pool.values():
                pods[:] = [p for p in pods if p not in stale]
        for s in expired:
            s.close("expired after its TTL")
        n = len(expired) + sum(self._delete_pod(p.name) for p in stale) + self.garbage_collect()
        n += self._leases()
        self._refill()
        return n

    def _leases(self) -> int:
        """Renew this replica's owner lease and delete the pods of replicas whose leases ran out (see
        ``sandbox.k8s_leases``); returns how many pods went. A Role without leases turns them off, with a warning."""
        if self.lease is None:
            return 0
        try:
            self.lease.renew()
            return self.lease.collect_orphans(lambda owner: self.garbage_collect(max_age_s=0, owner=owner))
        except ApiException as e:
            if e.status != 403:
                raise
            log.warning("leases in %s are forbidden to this service (HTTP 403): a crashed replica's session pods "
                        "will end at their TTL only; give its Role coordination.k8s.io leases", self.namespace)
            self.lease = None
            return 0

    def _reap_loop(self) -> None:
        while not self._stop.wait(self.reap_interval_s):
            try:
                self.reap()
            except Exception:
                log.exception("sandbox pod reaper pass failed")

    def close(self) -> None:
        """Delete every pod of this owner (sessions and warm pool), stop the background threads. Idempotent."""
        with self._lock:
            if self._stop.is_set():
                return
            self._stop.set()
            sessions = list(self._sessions.values())
            self._sessions.clear()
            pooled = [p for pods in self._pool.values() for p in pods]
            for pods in self._pool.values():
                pods.clear()
        for s in sessions:
            s.close("the backend was closed", delete=False)
        if self._filler is not None:
            self._filler.shutdown(wait=False, cancel_futures=True)
        try:
            self.garbage_collect(max_age_s=0)  # one list, then a delete per pod, including pods still starting
        except Exception as e:
            log.warning("garbage collection at close failed (%s); deleting the pods this backend knows", e)
            for name in [s.pod.name for s in sessions] + [p.name for p in pooled]:
                self._delete_pod(name)
        if self._filler is not None:
            self._filler.shutdown(wait=True)  # fills in flight see the stop flag and delete their pods
        if self._reaper.is_alive():
            self._reaper.join(timeout=5)
        if self.lease is not None:
            self.lease.release()
        if self._owns_client:
            self.api_client.close()
