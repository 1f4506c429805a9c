"""The pod backend's place in a cluster, against the ``KubeApiStandIn`` stand-in of the API server (no real one can run
here; it deletes a pod's dependents as the garbage collector does): session pods in a namespace of their own, owned
by the service pod that made them (or, across namespaces, collected when its owner lease runs out), meeting the
"restricted" Pod Security Standard, and drained at shutdown."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from sandbox import k8s_manifests as m
from sandbox.backend import Limits, Verdict
from tests import test_sandbox_kubernetes as pod_tests
from tests.test_sandbox_kubernetes import LIMITS, _validate

api, make_backend = pod_tests.api, pod_tests.make_backend  # the stand-in and backend fixtures, shared
# the names the Helm chart sets (the downward API, and the session namespace): spelled out, they must not drift
POD_NAME_ENV, POD_UID_ENV, POD_NAMESPACE_ENV = "POD_NAME", "POD_UID", "POD_NAMESPACE"
SESSION_NAMESPACE_ENV = "RL_SANDBOX_SESSION_NAMESPACE"


@pytest.fixture
def service_pod(api, monkeypatch):
    """The service's own pod, as the downward API tells the service about it."""
    pod = api.seed("api/v1/pods", {"apiVersion": "v1", "kind": "Pod",
                                   "metadata": {"name": "rl-sandbox-7d9f-x2k4q", "namespace": "sbx"},
                                   "status": {"phase": "Running"}})
    monkeypatch.setenv(POD_NAME_ENV, pod["metadata"]["name"])
    monkeypatch.setenv(POD_UID_ENV, pod["metadata"]["uid"])
    monkeypatch.setenv(POD_NAMESPACE_ENV, "sbx")
    return pod


def test_session_pods_are_owned_by_the_service_pod_and_collected_with_it(api, make_backend, service_pod):
    """A crashed replica's pod goes away (the Deployment replaces it): its session pods go with it, rather than
    running until their TTL under a random owner no one else knows."""
    backend = make_backend()
    s = backend.create_session("", {"a.txt": b"1"})
    body = api.bodies("POST", "pods")[0]
    assert body["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Pod", "name": service_pod["metadata"]["name"],
         "uid": service_pod["metadata"]["uid"], "blockOwnerDeletion": False}]
    assert backend.owner == service_pod["metadata"]["name"] == body["metadata"]["labels"][m.OWNER_LABEL]
    assert s.exec(["cat", "a.txt"], LIMITS).stdout == b"1"
    backend.core.delete_namespaced_pod(service_pod["metadata"]["name"], "sbx", grace_period_seconds=0)
    assert ("sbx", s.pod.name) not in api.pods


def test_a_restarted_service_container_collects_its_own_leftovers(api, make_backend, service_pod):
    """The same pod (same name) after a container restart: its predecessor's sessions are lost, so their pods are
    deleted at start; another replica's are left alone."""
    before = make_backend().create_session()
    other = make_backend(owner="another-replica").create_session()
    make_backend()  # the restarted container
    assert ("sbx", before.pod.name) not in api.pods and ("sbx", other.pod.name) in api.pods


def test_session_pods_go_to_the_namespace_from_the_environment(api, make_backend, service_pod, monkeypatch, caplog):
    """RL_SANDBOX_SESSION_NAMESPACE puts session pods (and their egress ban) in a namespace of their own; the ban
    admits the service from its namespace. An owner reference cannot cross namespaces (the garbage collector would
    delete the pod at once), so there is none, and the log says so."""
    monkeypatch.setenv(SESSION_NAMESPACE_ENV, "sbx-sessions")
    with caplog.at_level(logging.WARNING, logger="sandbox.kubernetes"):
        backend = make_backend()
    assert backend.namespace == "sbx-sessions"
    s = backend.create_session("", {"a.txt": b"ns"})
    assert s.exec(["cat", "a.txt"], LIMITS).stdout == b"ns"
    assert ("sbx-sessions", s.pod.name) in api.pods
    pod, policy = api.bodies("POST", "pods")[0], api.bodies("POST", "networkpolicies")[0]
    assert pod["metadata"]["namespace"] == "sbx-sessions" and "ownerReferences" not in pod["metadata"]
    assert policy["metadata"]["namespace"] == "sbx-sessions"
    assert policy["spec"]["ingress"][0]["from"][0]["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "sbx"}}
    assert any("cannot be owned" in r.message for r in caplog.records)
    s.close()
    assert api.pods.keys() == {("sbx", service_pod["metadata"]["name"])}


def test_a_dead_replicas_session_pods_in_another_namespace_go_when_its_lease_runs_out(api, make_backend, monkeypatch):
    """Session pods in their own namespace cannot be owned by the service pod; each replica holds an owner lease there
    instead. A replica that dies without closing (its pods left, its lease no longer renewed) loses its pods to a
    living replica's reaper once the lease has run out, not at their TTL; a living replica's pods and a replica of
    another run are left alone, and a replica that closes takes its lease with it."""
    LEASES = "apis/coordination.k8s.io/v1/leases"
    monkeypatch.setenv(SESSION_NAMESPACE_ENV, "sbx-sessions")
    run = {"labels": {"colocated-rl/run": "r1"}}
    dead = make_backend(owner="replica-a", lease_s=4, **run)
    alive = make_backend(owner="replica-b", lease_s=4, **run)
    stranger = make_backend(owner="replica-c", lease_s=4, labels={"colocated-rl/run": "r2"})
    a, b, c = dead.create_session(), alive.create_session(), stranger.create_session()
    lease = api.objects[(LEASES, "sbx-sessions", "rl-sandbox-owner-replica-a")]
    assert lease["spec"]["holderIdentity"] == "replica-a" and lease["spec"]["leaseDurationSeconds"] == 4
    assert lease["metadata"]["labels"]["colocated-rl/run"] == "r1"
    dead.lease.renew()  # its last renewal; then its process is gone: no reaper, no close
    dead._stop.set()
    alive.reap()  # the lease still holds: nothing is touched
    assert ("sbx-sessions", a.pod.name) in api.pods
    time.sleep(4.5)
    stranger.reap()  # another run's replica: not its business
    assert ("sbx-sessions", a.pod.name) in api.pods
    assert alive.reap() >= 1
    assert ("sbx-sessions", a.pod.name) not in api.pods
    assert {("sbx-sessions", b.pod.name), ("sbx-sessions", c.pod.name)} <= api.pods.keys()
    assert (LEASES, "sbx-sessions", "rl-sandbox-owner-replica-a") not in api.objects
    alive.close()
    assert (LEASES, "sbx-sessions", "rl-sandbox-owner-replica-b") not in api.objects


def test_session_pods_run_under_gvisor_by_default_where_the_cluster_has_it(api, make_backend, caplog):
    """runtime_class auto (the default): session pods ask for gVisor's RuntimeClass; on a cluster without one the
    API server refuses such a pod, and the backend says so once and runs its sessions on the node's runtime."""
    s = make_backend().create_session()
    assert api.pods[("sbx", s.pod.name)]["spec"]["runtimeClassName"] == "gvisor"
    api.runtime_classes.clear()
    with caplog.at_level(logging.WARNING, logger="sandbox.kubernetes"):
        backend = make_backend()
        first, second = backend.create_session(), backend.create_session()
    for t in (first, second):
        assert "runtimeClassName" not in api.pods[("sbx", t.pod.name)]["spec"]
        assert t.exec(["echo", "up"], LIMITS).stdout == b"up\n"
    assert sum("has no RuntimeClass gvisor" in r.message for r in caplog.records) == 1
    asked = [r.body["spec"].get("runtimeClassName") for r in api.requests if r.method == "POST"
             and r.path.endswith("/pods")]
    assert asked[-3:] == ["gvisor", None, None]  # asked once, then not again
    # named explicitly, a missing RuntimeClass is the operator's error, not quietly dropped
    with pytest.raises(Exception, match="RuntimeClass"):
        make_backend(runtime_class="kata").create_session()


def test_session_pods_meet_the_restricted_pod_security_standard(api, make_backend):
    backend = make_backend(runtime_class="gvisor", run_as_user=1234)
    backend.create_session()
    pod = api.bodies("POST", "pods")[0]
    _validate(pod)
    spec = pod["spec"]
    assert spec["securityContext"] == {"runAsNonRoot": True, "runAsUser": 1234, "runAsGroup": 1234,
                                       "fsGroup": 1234, "seccompProfile": {"type": "RuntimeDefault"}}
    assert spec["runtimeClassName"] == "gvisor"
    for c in spec["initContainers"] + spec["containers"]:
        sc = c["securityContext"]
        assert (sc["runAsNonRoot"], sc["allowPrivilegeEscalation"], sc["privileged"]) == (True, False, False), c
        assert sc["capabilities"] == {"drop": ["ALL"]} and sc["seccompProfile"] == {"type": "RuntimeDefault"}
    default = m.sandbox_pod(name="p", namespace="n", session_id="s", owner="o", image="i", agent_image="a")
    assert default["spec"]["securityContext"]["runAsUser"] == m.NOBODY and "runtimeClassName" not in default["spec"]
    with pytest.raises(ValueError, match="root"):
        m.sandbox_pod(name="p", namespace="n", session_id="s", owner="o", image="i", agent_image="a", run_as_user=0)


def test_shutdown_drains_session_pods_instead_of_deleting_them(api, make_backend):
    """At a stop, an open session's pod stays and serves its commands until the client closes it (or the drain time
    runs out); only then is the service gone."""
    from sandbox.client import SandboxClient
    from sandbox.server import SandboxServer

    limits = Limits(wall_s=5, processes=4096)
    srv = SandboxServer(make_backend(), concurrency=2, drain_s=30)
    c = SandboxClient(srv.address)
    try:
        s = c.create_session(files={"a.txt": "1"})
        pod = next(iter(api.pods))
        stopper = threading.Thread(target=srv.stop)
        stopper.start()
        time.sleep(0.5)
        assert pod in api.pods and stopper.is_alive()
        r = s.exec(["cat", "a.txt"], limits=limits)
        assert (r.verdict, r.stdout) == (Verdict.OK, b"1")
        s.close()
        stopper.join(10)
        assert not stopper.is_alive() and pod not in api.pods
    finally:
        c.close()
        srv.stop()
