"""``KubeApiStandIn``: a test double of the Kubernetes API server, because no real API server can run in the tests.

It is an HTTP server on 127.0.0.1 that implements only what ``sandbox.kubernetes`` uses, answering with
Kubernetes-shaped JSON so that the real ``kubernetes`` client parses it: pods (create, get, list and watch with
labelSelector/fieldSelector, delete; a list over every namespace), NetworkPolicies (create, get, list), Leases
(create, list, merge-patch, delete) and a Deployment's scale. It records every request, so tests can assert what an
API server would see. ``forbidden`` holds (method, resource) pairs it refuses with 403, as RBAC would (e.g.
("POST", "networkpolicies") for a Role without create on them).

A created pod is run for real: its main container's command starts as a local subprocess (``python3`` replaced by this
interpreter, PYTHONPATH = the repository root instead of the init container's emptyDir, the container's working
directory replaced by a per-pod temporary directory) with ``POD_IP`` = a loopback address of its own (all of
127.0.0.0/8 reaches loopback on Linux). The pod then reports phase Running and that podIP; deleting it kills the
process; ``activeDeadlineSeconds`` is enforced like the kubelet does; a pod naming a RuntimeClass the cluster lacks
(``runtime_classes``, by default gVisor's ``gvisor``) is refused as the RuntimeClass admission plug-in refuses it.
``failures[image] = reason`` makes pods of an image fail instead: "Unschedulable" keeps them Pending, any other reason
(e.g. "ImagePullBackOff") is reported as the container's waiting reason. Init containers are not run.

For the run commands (``rl status``, ``rl logs``, ``rl delete``) it also keeps objects that tests put in place with
``seed``: pods that run nothing (with the status and log given), custom objects such as RayJobs, claims and Secrets,
which it lists (with labelSelector), reads, merge-patches and deletes (deleting, as the garbage collector would, the
objects and pods of the namespace that name the deleted one in their ownerReferences); and pod logs.
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import kubernetes

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_POD_PATH = "/api/v1/namespaces/{ns}/pods"
_NP_PATH = "/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class Recorded:
    """One request the stand-in received."""

    method: str
    path: str
    query: dict[str, str]
    body: Any
    t: float = field(default_factory=time.monotonic)

    @property
    def resource(self) -> str:
        """"pods" or "networkpolicies" (the collection the path names)."""
        parts = self.path.strip("/").split("/")
        i = parts.index("namespaces") + 2 if "namespaces" in parts else len(parts)
        return parts[i] if i < len(parts) else ""

    @property
    def watch(self) -> bool:
        """Whether this was a watch."""
        return self.query.get("watch") in ("true", "1")


@dataclass
class _Run:
    proc: subprocess.Popen
    workdir: str
    deleted: bool = False


def _selector_match(selector: str, values: dict[str, str]) -> bool:
    """Equality-based selectors: ``k=v``, ``k==v``, ``k!=v``, ``k`` (exists), comma-separated."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if values.get(k) == v:
                return False
        elif "=" in term:
            k, v = term.replace("==", "=").split("=", 1)
            if values.get(k) != v:
                return False
        elif term not in values:
            return False
    return True


def _pod_fields(pod: dict[str, Any]) -> dict[str, str]:
    meta = pod["metadata"]
    return {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"],
            "status.phase": (pod.get("status") or {}).get("phase", "")}


class KubeApiStandIn:
    """The stand-in API server (see the module docstring). Use as a context manager or call ``close()``."""

    def __init__(self) -> None:
        self.requests: list[Recorded] = []
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.policies: dict[tuple[str, str], dict[str, Any]] = {}
        self.failures: dict[str, str] = {}
        self.forbidden: set[tuple[str, str]] = set()  # (method, resource) refused with 403, as RBAC would
        # the cluster's RuntimeClasses: a pod naming another is refused, as the RuntimeClass admission plug-in does
        self.runtime_classes: set[str] = {"gvisor"}
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}  # (collection path, namespace, name)
        self.logs: dict[tuple[str, str], str] = {}
        self.start_delay_s = 0.0
        self.runs: dict[tuple[str, str], _Run] = {}
        self._rv = 1000
        self._events: list[tuple[int, str, dict[str, Any]]] = []  # (resourceVersion, type, pod snapshot)
        self._cond = threading.Condition()
        self._closing = False
        # a random 127.a.b.0/24 per stand-in, so that parallel test runs do not collide on pod addresses
        self._ip_base, self._ip_next = f"127.{random.randint(1, 254)}.{random.randint(0, 255)}", 1
        handler = type("Handler", (_Handler,), {"standin": self})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True, name="kube-standin").start()

    def __enter__(self) -> KubeApiStandIn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def api_client(self) -> kubernetes.client.ApiClient:
        """A real client configured for this stand-in."""
        cfg = kubernetes.client.Configuration()
        cfg.host = self.url
        return kubernetes.client.ApiClient(cfg)

    def count(self, method: str, resource: str = "pods", *, watch: bool | None = None) -> int:
        """How many ``method`` requests on ``resource`` were received (``watch`` filters GETs)."""
        return sum(1 for r in list(self.requests) if r.method == method and r.resource == resource
                   and (watch is None or r.watch == watch))

    def bodies(self, method: str, resource: str) -> list[Any]:
        """The JSON bodies of those requests, as sent."""
        return [r.body for r in list(self.requests) if r.method == method and r.resource == resource]

    def close(self) -> None:
        """Stop serving and kill every pod process."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            keys = list(self.runs)
        for key in keys:
            self._stop_run(key)
        self.server.shutdown()
        self.server.server_close()

    def seed(self, collection: str, obj: dict[str, Any], log: str = "") -> dict[str, Any]:
        """Put an object in place: ``collection`` is its API path without the namespace part, e.g. "api/v1/pods"
        (a pod that runs nothing: its status as given), "apis/ray.io/v1/rayjobs", "api/v1/persistentvolumeclaims".
        ``log``: what GET .../pods/NAME/log answers."""
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        meta.setdefault("namespace", "default")  # "" for a cluster-scoped object
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", _now())
        key = (meta["namespace"], meta["name"])
        with self._cond:
            if collection == "api/v1/pods":
                self.pods[key] = obj
                self._bump("ADDED", obj)
                self.logs[key] = log
            else:
                self.objects[(collection, *key)] = obj
        return obj

    def _objects(self, method: str, parts: list[str], query: dict[str, str]) -> tuple[int, dict[str, Any]] | None:
        """GET (list or one), PATCH, DELETE of seeded objects; None if the path is not such a collection."""
        i = parts.index("namespaces") if "namespaces" in parts else len(parts)
        if len(parts) < i + 3:
            return None
        ns, plural, rest = parts[i + 1], parts[i + 2], parts[i + 3:]
        collection = "/".join([*parts[:i], plural])
        body = query.pop("_body", None)
        with self._cond:
            if not rest and method == "POST":  # create (what the sandbox's owner leases need)
                meta = body.setdefault("metadata", {})
                key = (collection, ns, meta["name"])
                if key in self.objects:
                    return 409, _status(409, "AlreadyExists", f'{plural} "{meta["name"]}" already exists',
                                        meta["name"])
                meta.update(namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=_now())
                self.objects[key] = body
                return 201, copy.deepcopy(body)
            if not rest and method == "GET":
                items = [copy.deepcopy(o) for (c, n, _), o in self.objects.items() if c == collection and n == ns
                         and _selector_match(query.get("labelSelector", ""), o["metadata"].get("labels") or {})]
                return 200, {"apiVersion": "v1", "kind": "List", "metadata": {"resourceVersion": str(self._rv)},
                             "items": items}
            if len(rest) == 2 and rest[1] == "scale" and method == "PATCH":  # a Deployment's scale subresource
                obj = self.objects.get((collection, ns, rest[0]))
                if obj is None:
                    return 404, _status(404, "NotFound", f'{plural} "{rest[0]}" not found', rest[0])
                _merge(obj, {"spec": {"replicas": (body.get("spec") or {}).get("replicas")}})
                return 200, {"apiVersion": "autoscaling/v1", "kind": "Scale", "metadata": {"name": rest[0],
                                                                                         "namespace": ns},
                             "spec": {"replicas": obj["spec"]["replicas"]}, "status": {"replicas": 0}}
            if len(rest) != 1:
                return None
            key = (collection, ns, rest[0])
            if key not in self.objects:
                return 404, _status(404, "NotFound", f'{plural} "{rest[0]}" not found', rest[0])
            if method == "GET":
                return 200, copy.deepcopy(self.objects[key])
            if method == "PATCH":  # a JSON merge patch (RFC 7386), what rl launch sends
                _merge(self.objects[key], body)
                return 200, copy.deepcopy(self.objects[key])
            if method != "DELETE":
                return None
            gone = self.objects.pop(key)
            # as the garbage collector does: the objects and pods of its namespace that name it as their owner
            uid = gone["metadata"].get("uid")
            owned = [(c, n) for (c, o_ns, n), o in self.objects.items() if o_ns == ns and _owned_by(o, uid)]
            pods = [n for (p_ns, n), p in self.pods.items() if p_ns == ns and _owned_by(p, uid)]
        for c, n in owned:
            self._objects("DELETE", [*c.split("/")[:-1], "namespaces", ns, c.split("/")[-1], n], {})
        for n in pods:
            self.delete_pod(ns, n)
        return 200, gone

    # ---- state changes (all under self._cond) ----

    def _bump(self, kind: str, pod: dict[str, Any]) -> None:
        self._rv += 1
        pod["metadata"]["resourceVersion"] = str(self._rv)
        self._events.append((self._rv, kind, copy.deepcopy(pod)))
        self._cond.notify_all()

    def _set_status(self, key: tuple[str, str], status: dict[str, Any]) -> None:
        with self._cond:
            pod = self.pods.get(key)
            if pod is not None:
                pod["status"] = status
                self._bump("MODIFIED", pod)

    def create_pod(self, ns: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """POST pods: store it, then run (or fail) it in the background."""
        name = body["metadata"]["name"]
        runtime = (body.get("spec") or {}).get("runtimeClassName")
        if runtime is not None and runtime not in self.runtime_classes:
            return 403, _status(403, "Forbidden", f'pods "{name}" is forbidden: pod rejected: RuntimeClass '
                                                  f'"{runtime}" not found', name)
        with self._cond:
            if (ns, name) in self.pods:
                return 409, _status(409, "AlreadyExists", f'pods "{name}" already exists', name)
            pod = copy.deepcopy(body)
            pod["metadata"].update(namespace=ns, uid=str(uuid.uuid4()), creationTimestamp=_now())
            pod["status"] = {"phase": "Pending", "qosClass": "Guaranteed"}
            self.pods[(ns, name)] = pod
            self._bump("ADDED", pod)
            ip = f"{self._ip_base}.{self._ip_next}"
            self._ip_next += 1
            out = copy.deepcopy(pod)
        threading.Thread(target=self._run_pod, args=((ns, name), ip), daemon=True).start()
        return 201, out

    def _run_pod(self, key: tuple[str, str], ip: str) -> None:
        time.sleep(self.start_delay_s)
        with self._cond:
            pod = self.pods.get(key)
            if pod is None:
                return
            spec = copy.deepcopy(pod["spec"])
        c = spec["containers"][0]
        reason = self.failures.get(c["image"])
        if reason == "Unschedulable":
            self._set_status(key, {"phase": "Pending", "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                 "message": "0/3 nodes are available: 3 Insufficient cpu."}]})
            return
        if reason:
            waiting = {"reason": reason, "message": f'Back-off pulling image "{c["image"]}"'}
            self._set_status(key, {"phase": "Pending", "containerStatuses": [_cstatus(c, {"waiting": waiting})]})
            return
        workdir = tempfile.mkdtemp(prefix=f"standin-{key[1]}-")
        argv = [*c.get("command", []), *c.get("args", [])]
        argv = [sys.executable if i == 0 and a == "python3" else workdir if a == c.get("workingDir") else a
                for i, a in enumerate(argv)]
        env = dict(os.environ)
        for e in c.get("env", []):
            ref = (e.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath")
            env[e["name"]] = ip if ref == "status.podIP" else key[1] if ref == "metadata.name" else e.get("value", "")
        env["PYTHONPATH"] = REPO_ROOT  # instead of the emptyDir the init container fills
        with open(os.path.join(workdir, ".standin-pod.log"), "wb") as log:
            proc = subprocess.Popen(argv, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        with self._cond:
            self.runs[key] = _Run(proc, workdir)
            if key not in self.pods or self._closing:  # deleted while starting
                gone = True
            else:
                gone = False
        if gone:
            self._stop_run(key)
            return
        started = _now()
        self._set_status(key, {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": "127.0.0.1",
                               "startTime": started, "conditions": [{"type": "Ready", "status": "True"}],
                               "containerStatuses": [_cstatus(c, {"running": {"startedAt": started}}, ready=True)]})
        deadline = spec.get("activeDeadlineSeconds")
        try:
            code = proc.wait(timeout=deadline)
            status = {"phase": "Succeeded" if code == 0 else "Failed", "podIP": ip}
            term = {"exitCode": code if code >= 0 else 128 - code, "reason": "Completed" if code == 0 else "Error"}
        except subprocess.TimeoutExpired:  # what the kubelet does at activeDeadlineSeconds
            self._kill(proc)
            status = {"phase": "Failed", "reason": "DeadlineExceeded", "podIP": ip,
                      "message": f"Pod was active on the node for longer than the specified deadline ({deadline}s)"}
            term = {"exitCode": 137, "reason": "Error"}
        with self._cond:
            run = self.runs.get(key)
            if run is None or run.deleted:
                return
        self._set_status(key, {**status, "containerStatuses": [_cstatus(c, {"terminated": term})]})

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    def _stop_run(self, key: tuple[str, str]) -> None:
        with self._cond:
            run = self.runs.pop(key, None)
            if run is None:
                return
            run.deleted = True
        self._kill(run.proc)
        shutil.rmtree(run.workdir, ignore_errors=True)

    def delete_pod(self, ns: str, name: str) -> tuple[int, dict[str, Any]]:
        """DELETE a pod: gone at once (as with gracePeriodSeconds=0), its process killed; then, as the garbage
        collector does, the pods of its namespace that name it (by uid) in their ownerReferences."""
        with self._cond:
            pod = self.pods.pop((ns, name), None)
            if pod is None:
                return 404, _status(404, "NotFound", f'pods "{name}" not found', name)
            pod["metadata"]["deletionTimestamp"] = _now()
            self._bump("DELETED", pod)
            uid = pod["metadata"].get("uid")
            dependents = [n for (pns, n), p in self.pods.items() if pns == ns and uid and any(
                ref.get("uid") == uid for ref in p["metadata"].get("ownerReferences") or ())]
        self._stop_run((ns, name))
        for dependent in dependents:
            self.delete_pod(ns, dependent)
        return 200, pod

    def list_pods(self, ns: str, query: dict[str, str]) -> dict[str, Any]:
        """GET pods (not a watch)."""
        with self._cond:
            items = [copy.deepcopy(p) for (n, _), p in self.pods.items() if n == ns and _matches(p, query)]
            rv = self._rv
        return {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": str(rv)}, "items": items}

    def watch_events(self, ns: str, query: dict[str, str], send: Any) -> None:
        """GET pods?watch=true: events after ``resourceVersion`` (or the current pods as ADDED, then changes), until
        ``timeoutSeconds``. ``send(event)`` writes one event; it raises when the client went away."""
        end = time.monotonic() + float(query.get("timeoutSeconds") or 1800)
        with self._cond:
            if query.get("resourceVersion"):
                cursor = int(query["resourceVersion"])
                pending = []
            else:
                cursor = self._rv
                pending = [("ADDED", copy.deepcopy(p)) for (n, _), p in self.pods.items()
                           if n == ns and _matches(p, query)]
        while True:
            for kind, obj in pending:
                send({"type": kind, "object": obj})
            with self._cond:
                while not self._closing and time.monotonic() < end and self._rv <= cursor:
                    self._cond.wait(max(0.0, end - time.monotonic()))
                if self._closing or time.monotonic() >= end:
                    return
                pending = [(k, o) for rv, k, o in self._events if rv > cursor and o["metadata"]["namespace"] == ns
                           and _matches(o, query)]
                cursor = self._rv


def _owned_by(obj: dict[str, Any], uid: str | None) -> bool:
    return bool(uid) and any(ref.get("uid") == uid for ref in obj["metadata"].get("ownerReferences") or ())


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    """Apply a JSON merge patch in place: null removes a key, objects merge, anything else replaces."""
    for k, v in patch.items():
        if v is None:
            target.pop(k, None)
        elif isinstance(v, dict) and isinstance(target.get(k), dict):
            _merge(target[k], v)
        else:
            target[k] = copy.deepcopy(v)


def _matches(pod: dict[str, Any], query: dict[str, str]) -> bool:
    return (_selector_match(query.get("labelSelector", ""), pod["metadata"].get("labels") or {})
            and _selector_match(query.get("fieldSelector", ""), _pod_fields(pod)))


def _cstatus(c: dict[str, Any], state: dict[str, Any], ready: bool = False) -> dict[str, Any]:
    return {"name": c["name"], "image": c["image"], "imageID": "", "ready": ready, "restartCount": 0,
            "started": "running" in state, "state": state}


def _status(code: int, reason: str, message: str, name: str = "") -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "details": {"name": name}, "code": code}


class _Handler(BaseHTTPRequestHandler):
    standin: KubeApiStandIn
    protocol_version = "HTTP/1.1"  # keep-alive and chunked watches, like the real API server

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _json(self, code: int, obj: dict[str, Any]) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _handle(self, method: str) -> None:
        url = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        s = self.standin
        s.requests.append(Recorded(method, url.path, query, body))
        if (method, s.requests[-1].resource) in s.forbidden:
            return self._json(403, _status(403, "Forbidden", f"{method} {url.path} is forbidden to this account"))
        parts = url.path.strip("/").split("/")
        ns = parts[parts.index("namespaces") + 1] if "namespaces" in parts else ""
        name = parts[-1] if len(parts) in (6, 7) and parts[-2] in ("pods", "networkpolicies") else ""
        if url.path == "/api/v1/pods" and method == "GET":  # every namespace's
            with s._cond:
                items = [copy.deepcopy(p) for p in s.pods.values() if _matches(p, query)]
            return self._json(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"},
                                    "items": items})
        if url.path == _POD_PATH.format(ns=ns) and method == "POST":
            return self._json(*s.create_pod(ns, body))
        if url.path == _POD_PATH.format(ns=ns) and method == "GET":
            if query.get("watch") in ("true", "1"):
                return self._watch(ns, query)
            return self._json(200, s.list_pods(ns, query))
        if url.path == f"{_POD_PATH.format(ns=ns)}/{name}" and method == "GET":
            pod = s.pods.get((ns, name))
            return self._json(200, pod) if pod else self._json(404, _status(404, "NotFound", "not found", name))
        if url.path == f"{_POD_PATH.format(ns=ns)}/{name}" and method == "DELETE":
            return self._json(*s.delete_pod(ns, name))
        if url.path == "/version":  # what helm asks first
            return self._json(200, {"major": "1", "minor": "33", "gitVersion": "v1.33.0", "platform": "linux/amd64"})
        if len(parts) == 7 and parts[-1] == "log" and parts[-3] == "pods":
            text = s.logs.get((ns, parts[-2]))
            if text is None:
                return self._json(404, _status(404, "NotFound", f'pods "{parts[-2]}" not found', parts[-2]))
            data = text.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return None
        if url.path == _NP_PATH.format(ns=ns) and method == "POST":
            with s._cond:
                key = (ns, body["metadata"]["name"])
                if key in s.policies:
                    return self._json(409, _status(409, "AlreadyExists", "already exists", key[1]))
                s.policies[key] = {**body, "metadata": {**body["metadata"], "namespace": ns, "uid": str(uuid.uuid4()),
                                                        "resourceVersion": "1", "creationTimestamp": _now()}}
            return self._json(201, s.policies[key])
        if url.path == _NP_PATH.format(ns=ns) and method == "GET":
            with s._cond:
                items = [copy.deepcopy(p) for (p_ns, _), p in s.policies.items() if p_ns == ns]
            return self._json(200, {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicyList",
                                    "metadata": {"resourceVersion": "1"}, "items": items})
        if url.path == f"{_NP_PATH.format(ns=ns)}/{name}" and method == "GET":
            pol = s.policies.get((ns, name))
            return self._json(200, pol) if pol else self._json(404, _status(404, "NotFound", "not found", name))
        if parts[-2:-1] != ["pods"] and (found := s._objects(method, parts, {**query, "_body": body})) is not None:
            return self._json(*found)
        if "namespaces" not in parts and method == "GET" and len(parts) >= 4:  # a cluster-scoped object (a CRD)
            obj = s.objects.get(("/".join(parts[:-1]), "", parts[-1]))
            if obj is not None:
                return self._json(200, copy.deepcopy(obj))
        return self._json(404, _status(404, "NotFound", f"the stand-in does not serve {method} {url.path}"))

    def _watch(self, ns: str, query: dict[str, str]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def send(event: dict[str, Any]) -> None:
            data = json.dumps(event).encode() + b"\n"
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        try:
            self.standin.watch_events(ns, query, send)
            self.wfile.write(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError, OSError):
            self.close_connection = True

    def do_GET(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def do_DELETE(self) -> None:
        self._handle("DELETE")

    def do_PATCH(self) -> None:
        self._handle("PATCH")
