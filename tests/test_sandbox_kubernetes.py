"""The Kubernetes pod backend with the real ``kubernetes`` client against ``KubeApiStandIn`` (a test double of the API
server: no real one can run here), whose pods run the real in-pod agent as local processes."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import kubernetes_validate
import pytest
from kubernetes_validate.utils import latest_version

from sandbox import k8s_manifests as m
from sandbox.agent import TOKEN_HEADER, AgentClient, AgentServer, child_environment
from sandbox.backend import Limits, SandboxError, Verdict
from sandbox.kubernetes import KubernetesBackend, TokenBucket
from sandbox.options import KubernetesOptions
from tests.kube_standin import REPO_ROOT, KubeApiStandIn

K8S_VERSION = latest_version()  # the newest schema set kubernetes-validate ships (offline)
LIMITS = Limits(wall_s=5, processes=1 << 16)  # RLIMIT_NPROC counts all of this user's processes on the test machine


def _validate(obj: dict) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]


def _wait_for(cond, timeout: float = 10.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def api():
    """A stand-in API server; at the end, every pod and NetworkPolicy the backend sent is schema-validated."""
    standin = KubeApiStandIn()
    try:
        yield standin
    finally:
        standin.close()
    for kind in ("pods", "networkpolicies"):
        for body in standin.bodies("POST", kind):
            _validate(body)


@pytest.fixture
def make_backend(api):
    backends = []

    def make(**kw) -> KubernetesBackend:
        # the run config's keys go into the options, the rest are the constructor's own arguments
        keys = {k: kw.pop(k) for k in list(kw) if k in KubernetesOptions.model_fields}
        options = KubernetesOptions(**{"namespace": "sbx", "agent_image": "rl-runtime:test",
                                       "default_image": "task:default", "max_creates_per_s": 100, **keys})
        args = dict(api_client=api.api_client(), agent_port=_free_port(), ready_timeout_s=15, reap_interval_s=0)
        b = KubernetesBackend(options=options, **{**args, **kw})
        backends.append(b)
        return b

    yield make
    for b in backends:
        b.close()


@pytest.mark.serial
def test_session_exec_files_verdicts_and_close(api, make_backend):
    backend = make_backend()
    s = backend.create_session("", {"in.txt": b"data\n", "pkg/mod.py": b"X = 42\n"})
    assert (api.count("POST"), api.count("POST", "networkpolicies"), api.count("GET", watch=True)) == (1, 1, 1)
    assert s.pod.image == "task:default"

    r = s.exec(["cat", "in.txt", "pkg/mod.py"], LIMITS)
    assert (r.verdict, r.exit_code, r.stdout) == (Verdict.OK, 0, b"data\nX = 42\n")
    r = s.exec([sys.executable, "-c", "import os, sys; print(sys.stdin.read(), os.environ['GREETING'])"], LIMITS,
               stdin=b"in", env={"GREETING": "hi"})
    assert (r.verdict, r.stdout) == (Verdict.OK, b"in hi\n")
    r = s.exec(["sh", "-c", "echo oops >&2; exit 3"], LIMITS)
    assert (r.verdict, r.exit_code, r.stderr) == (Verdict.FAILED, 3, b"oops\n")
    r = s.exec(["sleep", "10"], Limits(wall_s=0.5, processes=1 << 16))
    assert r.verdict == Verdict.TIMEOUT and r.wall_s < 3
    cancel = threading.Event()
    threading.Timer(0.3, cancel.set).start()
    t0 = time.monotonic()
    r = s.exec(["sleep", "10"], LIMITS, cancel=cancel)
    assert r.verdict == Verdict.CANCELLED and time.monotonic() - t0 < 3
    env = dict(line.split("=", 1) for line in s.exec(["env"], LIMITS).stdout.decode().splitlines() if "=" in line)
    assert "SANDBOX_AGENT_TOKEN" not in env and REPO_ROOT not in env.get("PYTHONPATH", "")  # no secret, no agent

    s.write_files({"bin/run.sh": b"#!/bin/sh\necho ran\n", "out/a.txt": b"A"}, executable=frozenset({"bin/run.sh"}))
    assert s.exec(["./bin/run.sh"], LIMITS).stdout == b"ran\n"
    assert s.read_files(["out/a.txt", "in.txt"], 100) == {"out/a.txt": b"A", "in.txt": b"data\n"}
    for paths, max_bytes, code in ((["nope.txt"], 100, "NOT_FOUND"), (["in.txt"], 2, "RESOURCE_EXHAUSTED"),
                                   (["../etc/passwd"], 100, "INVALID_ARGUMENT")):
        with pytest.raises(SandboxError) as e:
            s.read_files(paths, max_bytes)
        assert e.value.code == code

    run = api.runs[("sbx", s.pod.name)]
    s.close()
    s.close()
    assert api.pods == {} and run.proc.poll() is not None
    assert api.count("DELETE") == 1 and api.requests[-1].query.get("gracePeriodSeconds") == "0"
    with pytest.raises(SandboxError) as e:
        s.exec(["true"], LIMITS)
    assert e.value.code == "NOT_FOUND"


@pytest.mark.serial
def test_pod_that_cannot_start_is_unavailable_and_deleted(api, make_backend):
    api.failures["registry.example/broken:1"] = "ImagePullBackOff"
    api.failures["huge:1"] = "Unschedulable"
    backend = make_backend(ready_timeout_s=1, allowed_images=["registry.example/*", "huge:1"])
    with pytest.raises(SandboxError) as e:
        backend.create_session("registry.example/broken:1")
    name = api.bodies("POST", "pods")[0]["metadata"]["name"]
    assert e.value.code == "UNAVAILABLE" and name in str(e.value) and "ImagePullBackOff" in str(e.value)
    t0 = time.monotonic()
    with pytest.raises(SandboxError) as e:
        backend.create_session("huge:1")
    name = api.bodies("POST", "pods")[1]["metadata"]["name"]
    assert e.value.code == "UNAVAILABLE" and name in str(e.value)
    assert "phase Pending" in str(e.value) and "Unschedulable" in str(e.value) and time.monotonic() - t0 < 5
    assert api.pods == {} and api.count("DELETE") == 2


def test_ttl_reaper_deletes_expired_pods(api, make_backend):
    backend = make_backend(ttl_s=60, reap_interval_s=0.1)
    s = backend.create_session()
    assert api.bodies("POST", "pods")[0]["spec"]["activeDeadlineSeconds"] == 60
    s.pod.expires_at = time.time()  # as if its TTL had passed (a real 1 s TTL would race a slow pod start)
    _wait_for(lambda: not api.pods, 10, "the reaper to delete the expired session's pod")
    with pytest.raises(SandboxError) as e:
        s.exec(["true"], LIMITS)
    assert e.value.code == "NOT_FOUND" and "TTL" in str(e.value)
    # A pod the kubelet ended at activeDeadlineSeconds (phase Failed) is deleted by the reaper's label query.
    dead = m.sandbox_pod(name="rl-sbx-deadline", namespace="sbx", session_id="deadline", owner=backend.owner,
                         image="task:default", agent_image="x", ttl_s=1)
    backend.core.create_namespaced_pod("sbx", dead)
    _wait_for(lambda: not api.pods, 20, "the stand-in's deadline and then the reaper")
    assert api.count("DELETE") == 2


def test_garbage_collect_by_owner_label(api, make_backend):
    crashed = make_backend(owner="svc-a")  # a service instance that died without closing
    old = crashed.create_session()
    other = make_backend(owner="svc-b").create_session()
    # a leftover of svc-a already past its expiry, as a restarted svc-a finds it
    expired = m.sandbox_pod(name="rl-sbx-leftover", namespace="sbx", session_id="leftover", owner="svc-a",
                            image="task:default", agent_image="x", expires_at=time.time() - 5)
    crashed.core.create_namespaced_pod("sbx", expired)
    restarted = make_backend(owner="svc-a")
    assert restarted.garbage_collect() == 1  # only the expired one
    assert ("sbx", "rl-sbx-leftover") not in api.pods and ("sbx", old.pod.name) in api.pods
    lists = [r for r in api.requests if r.method == "GET" and r.resource == "pods" and not r.watch]
    assert lists[-1].query["labelSelector"] == "app.kubernetes.io/managed-by=rl-sandbox,rl-sandbox/owner=svc-a"
    assert restarted.garbage_collect(max_age_s=0) == 1
    assert set(api.pods) == {("sbx", other.pod.name)}
    crashed.create_session()
    make_backend(owner="svc-a", collect_on_start=True)  # a restart that cleans up before it starts
    assert set(api.pods) == {("sbx", other.pod.name)}


def test_warm_pool_is_used_and_refilled(api, make_backend):
    backend = make_backend(warm_pool={"task:warm": 2}, allowed_images=["task:*"])
    _wait_for(lambda: backend.warm_count("task:warm") == 2, 15, "the warm pool to fill")
    creates = api.count("POST")
    pooled = {b["metadata"]["name"] for b in api.bodies("POST", "pods")}
    s = backend.create_session("task:warm", {"f.txt": b"warm"})
    assert s.pod.name in pooled  # made before the session was asked for
    assert s.exec(["cat", "f.txt"], LIMITS).stdout == b"warm"
    _wait_for(lambda: backend.warm_count("task:warm") == 2, 15, "the warm pool to refill")
    assert api.count("POST") == creates + 1
    cold = backend.create_session("task:other")  # no pool for this image: created on demand
    assert cold.pod.name not in pooled and api.count("POST") == creates + 2
    backend.close()
    assert api.pods == {}


def test_token_bucket_spaces_creates():
    now = [0.0]
    waits = []
    bucket = TokenBucket(2, burst=1, clock=lambda: now[0], sleep=waits.append)
    assert [bucket.acquire() for _ in range(3)] == [0.0, 0.5, 1.0]  # reservations queue up
    now[0] = 10.0
    assert bucket.acquire() == 0.0 and waits == [0.5, 1.0]


def test_create_rate_limit_seen_by_api_server(api, make_backend):
    backend = make_backend(max_creates_per_s=5, create_burst=1)
    threads = [threading.Thread(target=backend.create_session) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    times = sorted(r.t for r in api.requests if r.method == "POST" and r.resource == "pods")
    assert len(times) == 3 and times[-1] - times[0] >= 0.3  # 2 intervals of 0.2 s, less jitter


def test_manifests_are_valid_kubernetes_objects(api, make_backend):
    backend = make_backend(runtime_class="gvisor", workdir="/testbed", workdir_volume=False,
                           node_selector={"pool": "sandbox"},
                           tolerations=[{"key": "sandbox", "operator": "Exists", "effect": "NoSchedule"}],
                           resources={"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}})
    s = backend.create_session("", {"repo/a.py": b"1"})
    assert s.exec(["cat", "repo/a.py"], LIMITS).stdout == b"1"  # the work directory is the image's /testbed
    pod, policy = api.bodies("POST", "pods")[0], api.bodies("POST", "networkpolicies")[0]
    for obj in (pod, policy):
        _validate(obj)
    spec, main = pod["spec"], pod["spec"]["containers"][0]
    assert pod["metadata"]["labels"] == {m.MANAGED_BY_LABEL: m.MANAGED_BY, m.SESSION_LABEL: s.id,
                                         m.OWNER_LABEL: backend.owner}
    assert m.parse_rfc3339(pod["metadata"]["annotations"][m.EXPIRES_ANNOTATION]) > time.time() + 3000
    assert (spec["restartPolicy"], spec["activeDeadlineSeconds"], spec["runtimeClassName"]) == ("Never", 3600, "gvisor")
    assert spec["automountServiceAccountToken"] is False and spec["enableServiceLinks"] is False
    assert main["command"][:3] == ["python3", "-m", "sandbox.agent"] and main["workingDir"] == "/testbed"
    assert main["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in main["env"]
    assert [v["name"] for v in spec["volumes"]] == ["agent"]  # no emptyDir over the image's /testbed
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"] and policy["spec"]["egress"] == []
    assert policy["spec"]["ingress"][0]["ports"] == [{"protocol": "TCP", "port": backend.agent_port}]
    # and the builders' other shapes
    flat = m.sandbox_pod(name="p", namespace="n", session_id="s", owner="o", image="i", agent_image="a",
                         resources={"cpu": "2", "memory": "4Gi"})
    _validate(flat)
    assert flat["spec"]["containers"][0]["resources"]["limits"]["ephemeral-storage"] == "4Gi"
    _validate(m.deny_egress_policy("n", port=9000, service_namespace="rl-system"))
    with pytest.raises(ValueError):
        m.sandbox_pod(name="p", namespace="n", session_id="bad id!", owner="o", image="i", agent_image="a")


def test_agent_paths_errors_and_token(tmp_path):
    work = tmp_path / "work"
    server = AgentServer("127.0.0.1", 0, str(work), token="secret")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        agent = AgentClient(url, "secret")
        outside = tmp_path / "outside"
        outside.mkdir()
        (work / "link").symlink_to(outside)
        (work / "victim").symlink_to(outside / "target")
        with pytest.raises(SandboxError) as e:
            agent.write_files({"link/x": b"no"})
        assert e.value.code == "INVALID_ARGUMENT" and list(outside.iterdir()) == []
        agent.write_files({"victim": b"replaced, not followed"})
        assert not (outside / "target").exists() and not (work / "victim").is_symlink()
        (outside / "secret.txt").write_bytes(b"x")
        for path, code in (("link/secret.txt", "INVALID_ARGUMENT"), ("gone", "NOT_FOUND")):
            with pytest.raises(SandboxError) as e:
                agent.read_files([path], 10)
            assert e.value.code == code
        with pytest.raises(SandboxError) as e:
            AgentClient(url, "wrong").read_files(["victim"], 100)
        assert e.value.code == "INTERNAL" and "UNAUTHENTICATED" in str(e.value)
        for body, status in (({"paths": ["gone"], "max_bytes": 1}, 404), ({"paths": ["victim"], "max_bytes": 1}, 413),
                             ({"paths": ["/etc/passwd"], "max_bytes": 1}, 400)):
            req = urllib.request.Request(url + "/read_files", json.dumps(body).encode(), {TOKEN_HEADER: "secret"})
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=5)
            assert e.value.code == status and set(json.loads(e.value.read())) == {"code", "message"}
    finally:
        server.shutdown()
        server.server_close()
    env = child_environment({"PATH": "/bin", "SANDBOX_AGENT_TOKEN": "t", "PYTHONPATH": f"{REPO_ROOT}:/x"}, {"A": "1"})
    assert env == {"PATH": "/bin", "PYTHONPATH": "/x", "A": "1"}


def test_agent_imports_only_the_standard_library():
    code = ("import sys, sandbox.agent, sandbox.runner; "
            "print([n for n in sys.modules if n.split('.')[0] not in sys.stdlib_module_names "
            "and n.split('.')[0] not in ('sandbox', '__main__')])")
    # -S: no site-packages at all, so a third-party import would fail here
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, cwd=REPO_ROOT,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_grpc_service_on_the_pod_backend(api, make_backend):
    """The same gRPC service, with sessions as pods: a run and a session through SandboxClient."""
    from sandbox.client import SandboxClient
    from sandbox.server import SandboxServer

    grpc_limits = Limits(wall_s=5, processes=4096)  # the service's maximum
    with SandboxServer(make_backend(), concurrency=2) as srv, SandboxClient(srv.address) as c:
        r = c.run(code="def f(x):\n    return 2 * x\n", tests="assert f(21) == 42\nprint('ok')", limits=grpc_limits)
        assert r.verdict == Verdict.OK and r.stdout == b"ok\n", r
        with c.create_session(files={"a.txt": "1"}) as s:
            assert s.exec(["sh", "-c", "cat a.txt; echo 2 > b.txt"], limits=grpc_limits).stdout == b"1"
            assert s.read_files(["b.txt"]) == {"b.txt": b"2\n"}
        with pytest.raises(SandboxError) as e:  # an image outside the allowlist: the gRPC status says so
            c.create_session(image="evil.example/x:1")
        assert e.value.code == "PERMISSION_DENIED" and "evil.example/x:1" in str(e.value)
        assert "sandbox.kubernetes.allowed_images" in str(e.value)
        assert api.count("POST", "pods") == 2 and api.count("DELETE", "pods") == 2


def test_image_allowlist(api, make_backend):
    """Only the operator's images by default (a session pod carries the run's pull secrets); others by pattern, and
    a refused image makes no pod and names itself and the option that would allow it."""
    backend = make_backend(warm_pool={"task:warm": 1})  # allowed_images left at its default
    for image in ("evil.example/miner:latest", "task:default-but-not", "python:3.11-slim"):
        with pytest.raises(SandboxError) as e:
            backend.create_session(image)
        assert e.value.code == "PERMISSION_DENIED" and "\n" not in str(e.value)
        assert image in str(e.value) and "sandbox.kubernetes.allowed_images" in str(e.value)
    _wait_for(lambda: backend.warm_count("task:warm") == 1, 15, "the warm pool to fill")
    assert api.count("POST", "pods") == 1  # the pool's pod only: nothing made for a refused image
    backend.create_session("").close()  # the default image
    backend.create_session("task:warm").close()
    patterns = make_backend(allowed_images=["python:3.11-*", "registry.example.com/swe/*"])
    assert patterns.create_session("registry.example.com/swe/django__django-11099:v1").pod.image == \
        "registry.example.com/swe/django__django-11099:v1"
    patterns.create_session("python:3.11-bookworm").close()
    for image in ("python:3.12-slim", "registry.example.com/other/x:1", "Python:3.11-slim",
                  "evil/registry.example.com/swe/x"):
        with pytest.raises(SandboxError) as e:
            patterns.create_session(image)
        assert e.value.code == "PERMISSION_DENIED"
    make_backend(allowed_images=["*"]).create_session("anything.example/at:all").close()
