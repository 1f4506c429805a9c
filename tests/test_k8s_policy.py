"""The chart's render read as a cluster would enforce it (tests/k8s_policy.py): who may connect to whom under its
NetworkPolicies, what its Roles grant, which capabilities and images its pods run with, and the disruption budget
and quota it makes. Every example is checked, and the variants of values that change the policies (egress denied,
hostNetwork workers). The session pods are the ones the real pod backend builds from the service's arguments."""

from __future__ import annotations

import functools
import json

import pytest
import yaml

from rl.launch import CHART
from sandbox import k8s_manifests as m
from tests.k8s_policy import Cluster, Endpoint, capability_problems, images, pod_templates, rbac_problems
from tests.test_helm_chart import EXAMPLES, HELM, QUICKSTART, helm, render

pytestmark = pytest.mark.skipif(HELM is None, reason="helm is not installed (make setup installs it)")
GPU = CHART / "examples" / "gpu-cluster.yaml"
GPU_CONFIG = QUICKSTART.parent / "qwen3-8b-gpu.yaml"
NS = "rl"
EGRESS = ("networkPolicy.egress.enabled=true", "networkPolicy.egress.apiServerCIDRs={10.0.0.1/32}",
          "networkPolicy.egress.cidrs={52.216.0.0/15}")
HOST_NETWORK = ("storage.accessMode=ReadWriteMany", "workerGroups[0].name=workers", "workerGroups[0].replicas=2",
                "workerGroups[0].cpu=4000m", "workerGroups[0].memory=16Gi", "workerGroups[0].hostNetwork=true",
                "rayJob.rayVersion=2.60.0", "networkPolicy.nodeCIDRs={10.0.0.0/16}")
CASES = {
    "defaults": ((), ()),
    **{v.stem: ((v,), ()) for v in EXAMPLES},
    "defaults+egress": ((), EGRESS),
    "gpu-cluster+egress": ((GPU,), EGRESS),
    "defaults+hostNetwork": ((), HOST_NETWORK),
    "defaults+hostNetwork+egress": ((), HOST_NETWORK + EGRESS),
}


@functools.cache
def _docs(case: str) -> tuple[str, ...]:
    values, sets = CASES[case]
    return tuple(json.dumps(d) for d in render(*values, config=GPU_CONFIG if GPU in values else QUICKSTART,
                                               sets=sets))


def docs_of(case: str) -> list[dict]:
    return [json.loads(d) for d in _docs(case)]


def values_of(case: str) -> dict:
    """The case's values file, as given (empty for the defaults)."""
    values = CASES[case][0]
    return yaml.safe_load(values[0].read_text()) if values else {}


DISAGGREGATED = [c for c in CASES if "disaggregated" in c]


def _ports(template: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])
            if "name" in p}


class World:
    """The endpoints of one render: the run's pods as the chart templates them, a session pod as the pod backend
    builds it, and the others a cluster holds (the KubeRay operator and a pod imitating it, Prometheus, DNS, another
    run, the API server, the cloud's metadata service, a bucket)."""

    def __init__(self, docs: list[dict]):
        values_ns = next(d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "myrun-ray-head"
                         ) if any(d["metadata"]["name"] == "myrun-ray-head" for d in docs) else None
        operator_ns = next(p["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
                           for rule in values_ns["spec"]["ingress"] for p in rule.get("from", [])
                           if "namespaceSelector" in p) if values_ns else "default"
        self.cluster = Cluster(docs, NS, {"monitoring": {"team": "observability"}})
        ray = {where: t for where, t in pod_templates(docs) if where.startswith("ray-")}
        ip = iter(f"10.244.{i}.{j}" for i in range(1, 9) for j in range(2, 250))
        self.head = self._pod("head", ray["ray-head"], next(ip))
        self.workers = [self._pod(where, t, f"10.0.1.{i + 5}" if t["spec"].get("hostNetwork") else next(ip))
                        for i, (where, t) in enumerate(sorted(ray.items())) if where.startswith("ray-worker")]
        self.submitter = self._pod("submitter", ray["ray-submitter"], next(ip)) if "ray-submitter" in ray else None
        service = next((d for d in docs if d["kind"] == "Deployment"), None)
        self.sandbox = self._pod("sandbox", service["spec"]["template"], next(ip)) if service else None
        args = service["spec"]["template"]["spec"]["containers"][0]["args"] if service else []
        given = dict(a.removeprefix("--set=sandbox.kubernetes.").split("=", 1) for a in args
                     if a.startswith("--set=sandbox.kubernetes."))
        session_ns, labels = given.get("namespace"), json.loads(given.get("labels", "{}"))
        self.session = self.stray = None
        if session_ns:
            pod = m.sandbox_pod(name="rl-sbx-1", namespace=session_ns, session_id="s1", owner="myrun-sandbox-0",
                                image="python:3.11-slim", agent_image="agent:1", labels=labels)
            self.session = Endpoint("session", session_ns, next(ip), pod["metadata"]["labels"], ports={"agent": 8000})
            self.stray = Endpoint("unlabelled pod in the session namespace", session_ns, next(ip), {})
        operator = {"app.kubernetes.io/name": "kuberay-operator"}
        self.operator = Endpoint("kuberay operator", operator_ns, next(ip), operator)
        self.spoofed = Endpoint("a tenant's pod labelled as the operator", "tenant", next(ip), operator)
        # KubeRay installed by its kustomization labels its pods otherwise (N8)
        kustomized = {"app.kubernetes.io/name": "kuberay", "app.kubernetes.io/component": "kuberay-operator"}
        self.kustomized = Endpoint("kuberay operator (kustomize)", operator_ns, next(ip), kustomized)
        self.prometheus = Endpoint("prometheus", "monitoring", next(ip), {"app.kubernetes.io/name": "prometheus"})
        self.stranger = Endpoint("a tenant's pod", "tenant", next(ip), {"app": "x"})
        # on the nodes' network (inside networkPolicy.nodeCIDRs where a case sets them): another tenant's hostNetwork
        # pod, and a process of the node itself (no pod at all)
        self.host_stranger = Endpoint("a tenant's hostNetwork pod", "tenant", "10.0.1.200", {"app": "x"}, True)
        self.node = Endpoint("a process on a node", None, "10.0.1.201")
        self.dns = Endpoint("kube-dns", "kube-system", next(ip), {"k8s-app": "kube-dns"})
        other = dict(self.workers[0].labels, **{"colocated-rl/run": "other", "app.kubernetes.io/instance": "other"})
        self.other_run = Endpoint("another run's worker", NS, next(ip), other)
        self.api = Endpoint("API server", None, "10.0.0.1")
        self.metadata = Endpoint("cloud metadata service", None, "169.254.169.254")
        self.bucket = Endpoint("a bucket", None, "52.216.8.8")

    @staticmethod
    def _pod(name: str, template: dict, ip: str) -> Endpoint:
        return Endpoint(name, NS, ip, template["metadata"]["labels"], bool(template["spec"].get("hostNetwork")),
                        _ports(template))

    @staticmethod
    def role(pod: Endpoint) -> str | None:
        """A worker pod's role (colocated, trainer, rollout); None for the head and the submitter."""
        return pod.labels.get("colocated-rl/role")

    def ray_pods(self) -> list[Endpoint]:
        return [self.head, *self.workers, *([self.submitter] if self.submitter else [])]

    def ok(self, src: Endpoint, dst: Endpoint, port: int | str, protocol: str = "TCP") -> bool:
        return self.cluster.allowed(src, dst, port, protocol)


@pytest.mark.parametrize("case", list(CASES))
def test_the_jobs_api_admits_the_run_and_the_operator_in_its_namespace_only(case):
    """D1: 8265 runs any code it is sent. A pod labelled as the KubeRay operator in another namespace is refused (a
    label is set by whoever makes the pod; a namespace's name label by the API server)."""
    w = World(docs_of(case))
    assert w.ok(w.operator, w.head, "dashboard") and w.ok(w.kustomized, w.head, "dashboard")
    for stranger in (w.spoofed, w.stranger, w.other_run, *filter(None, (w.sandbox, w.session, w.stray))):
        assert not w.ok(stranger, w.head, "dashboard"), stranger.name
        assert not w.ok(stranger, w.head, "gcs"), stranger.name
    for pod in w.ray_pods():  # a hostNetwork worker needs Ray's ports, not the Jobs API (N1)
        assert w.ok(pod, w.head, "gcs") and w.ok(pod, w.head, "dashboard") is not pod.host_network, pod.name


@pytest.mark.parametrize("case", list(CASES))
def test_prometheus_reaches_every_scrape_target_that_scrape_from_names_and_nobody_else_does(case):
    """D10: the controller's metrics, Ray's own on every Ray pod (they were blocked by the chart's own policies), the
    sandbox's, for whom metrics.scrapeFrom names (the GPU example: Prometheus's namespace). N5: with scrapeFrom empty
    (the default) they stay closed; they were open to every namespace."""
    docs = docs_of(case)
    w = World(docs)
    targets = [(w.head, "rl-metrics"), *((p, "metrics") for p in [w.head, *w.workers] if not p.host_network)]
    targets += [(w.sandbox, "metrics")] if w.sandbox else []
    named = bool(values_of(case).get("metrics", {}).get("scrapeFrom"))
    for pod, port in targets:
        assert w.ok(w.prometheus, pod, port) is named, (pod.name, port)
        assert not w.ok(w.stranger, pod, port) and not w.ok(w.other_run, pod, port), (pod.name, port)


@pytest.mark.parametrize("case", list(CASES))
def test_no_stranger_reaches_the_jobs_api_ray_client_or_a_dashboard_agent(case):
    """N1: a tenant's pod, another namespace's, another run's, a hostNetwork pod and a process on a node never reach
    8265 or 10001 on the head nor 52365 (the dashboard agent, which takes job submissions) on a Ray pod on the pod
    network; in the examples (no hostNetwork) nor the sandbox service. With hostNetwork workers the nodes' addresses
    reach the head on Ray's internal ports only, and the chart turns Ray's token authentication on for them."""
    docs = docs_of(case)
    w = World(docs)
    strangers = [w.stranger, w.spoofed, w.other_run, w.host_stranger, w.node, w.metadata]
    for who in strangers:
        for port in (8265, 10001, 52365):
            assert not w.ok(who, w.head, port), (who.name, port)
        for pod in w.workers:
            assert pod.host_network or not w.ok(who, pod, 52365), (who.name, pod.name)
        if w.sandbox and "hostNetwork" not in case:
            assert not w.ok(who, w.sandbox, "grpc"), who.name
    job = next(d for d in docs if d["kind"] == "RayJob")
    host = "hostNetwork" in case
    assert ("authOptions" in job["spec"]["rayClusterSpec"]) is (host or bool(values_of(case).get("rayJob", {}).get(
        "rayVersion")))  # the examples that pin Ray pin one with token authentication
    if host:
        head = job["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParams"]
        assert (head["node-manager-port"], head["object-manager-port"]) == ("6380", "6381")
        assert (head["min-worker-port"], head["max-worker-port"]) == ("10002", "19999")
        for port, ok in ((6379, True), (6381, True), (10002, True), (19999, True), (20000, False), (8080, False)):
            assert w.ok(w.host_stranger, w.head, port) is ok, port  # what token authentication has to guard


@pytest.mark.parametrize("case", [c for c in CASES if "local-sandbox" not in c])
def test_nothing_in_the_session_namespace_opens_a_connection(case):
    """D5: the deny-all policy selects every pod of the session namespace, the backend's label or not."""
    w = World(docs_of(case))
    for pod in (w.session, w.stray):
        for dst, port in ((w.head, "dashboard"), (w.head, "gcs"), (w.workers[0], 6379), (w.api, 443),
                          (w.metadata, 80), (w.bucket, 443), (w.sandbox, "grpc"), (w.stranger, 80)):
            assert not w.ok(pod, dst, port), (pod.name, dst.name)
        assert not w.ok(pod, w.dns, 53, "UDP"), pod.name
    assert w.ok(w.sandbox, w.session, "agent")  # the service drives its sessions
    assert not w.ok(w.head, w.session, "agent") and not w.ok(w.stranger, w.session, "agent")


@pytest.mark.parametrize("case", list(CASES))
def test_the_run_reaches_itself_and_its_sandbox_and_nobody_else_does(case):
    w = World(docs_of(case))
    for src in w.ray_pods():
        for dst in w.workers:  # a disaggregated run's rollout pods: below (the transfer's ports only)
            assert w.ok(src, dst, 29500) or "rollout" in (w.role(src), w.role(dst)), (src.name, dst.name)  # NCCL
        # the head holds no trainer: from the nodes' addresses only Ray's ports (a worker's reply to the driver)
        assert w.ok(src, w.head, 15000) and w.ok(src, w.head, 29500) is not src.host_network, src.name
    for pod in [w.head, *w.workers]:
        assert w.ok(pod, w.sandbox, "grpc") if w.sandbox else True
    if w.sandbox:
        assert not w.ok(w.other_run, w.sandbox, "grpc") and not w.ok(w.stranger, w.sandbox, "grpc")
    for worker in w.workers:  # a hostNetwork worker is outside every NetworkPolicy (docs/gpu-cluster.md, section 4)
        assert w.ok(w.stranger, worker, 29500) is worker.host_network
        assert w.ok(w.other_run, worker, 29500) is worker.host_network


@pytest.mark.parametrize("case", DISAGGREGATED)
def test_a_disaggregated_runs_trainer_and_rollout_pods_reach_each_other_on_the_transfer_ports_and_nothing_else(case):
    """Issue 57 item 7: the trainer pods reach the rollout pods (and back: the replicas' ends of the gloo links) on the
    weight transfer's ports, which both roles set as their ephemeral range, and on Ray's pinned ports; nothing else of
    theirs (no NCCL port, no dashboard agent, no metrics port); the rollout pods reach each other on Ray's ports only;
    the head and the submitter reach them on any port; no stranger reaches them at all."""
    docs = docs_of(case)
    w = World(docs)
    trainers = [p for p in w.workers if w.role(p) == "trainer"]
    rollouts = [p for p in w.workers if w.role(p) == "rollout"]
    assert trainers and rollouts and len(trainers) + len(rollouts) == len(w.workers)
    transfer, ray_ports = (20000, 24999, 29999), (6379, 6380, 6381, 10002, 15000, 19999)
    outside = (30000, 40000, 52365, 8080, 9090, 5000, 1024)
    for t in trainers:
        for r in rollouts:
            for a, b in ((t, r), (r, t)):
                assert all(w.ok(a, b, port) for port in transfer + ray_ports), (a.name, b.name)
                assert not any(w.ok(a, b, port) for port in outside), (a.name, b.name)
        for other in trainers:  # FSDP2's NCCL between trainer pods: any port
            assert all(w.ok(t, other, port) for port in (*transfer, *outside))
    for a in rollouts:
        for b in rollouts:
            assert all(w.ok(a, b, port) for port in ray_ports) and not any(w.ok(a, b, port) for port in
                                                                         transfer + outside), (a.name, b.name)
        for src in filter(None, [w.head, w.submitter]):
            assert all(w.ok(src, a, port) for port in (*transfer, *ray_ports, *outside)), (src.name, a.name)
        for who in (w.stranger, w.spoofed, w.other_run, w.host_stranger, w.node, w.operator):
            assert not any(w.ok(who, a, port) for port in (*transfer, *ray_ports, 52365)), (who.name, a.name)
    # the range is the pods' own: every trainer and rollout pod sets it, and the run's transfer listens there
    job = next(d for d in docs if d["kind"] == "RayJob")
    for g in job["spec"]["rayClusterSpec"]["workerGroupSpecs"]:
        assert g["template"]["spec"]["securityContext"]["sysctls"] == [
            {"name": "net.ipv4.ip_local_port_range", "value": "20000 29999"}], g["groupName"]


@pytest.mark.parametrize("case", [c for c in CASES if "egress" in c])
def test_in_egress_mode_the_ray_pods_reach_the_api_server_dns_and_their_bucket(case):
    """D16: `rl sandbox release` and the run's deadline go through the API server; nothing else leaves."""
    w = World(docs_of(case))
    for pod in w.ray_pods():
        if pod.host_network:
            continue  # not isolated at all
        assert w.ok(pod, w.api, 443) and w.ok(pod, w.dns, 53, "UDP") and w.ok(pod, w.bucket, 443), pod.name
        assert not w.ok(pod, w.metadata, 80) and not w.ok(pod, w.stranger, 80), pod.name
    assert w.ok(w.sandbox, w.api, 443) and w.ok(w.sandbox, w.session, "agent")
    assert not w.ok(w.sandbox, w.bucket, 443)


@pytest.mark.parametrize("case", [c for c in CASES if "hostNetwork" in c])
def test_host_network_workers_reach_the_head_and_are_reached(case):
    """D3: their traffic comes from the node's address: admitted by networkPolicy.nodeCIDRs."""
    w = World(docs_of(case))
    [worker] = w.workers
    assert worker.host_network and worker.ip.startswith("10.0.")
    assert w.ok(worker, w.head, "gcs") and w.ok(w.head, worker, 6380) and w.ok(worker, w.sandbox, "grpc")


def test_without_token_authentication_host_network_workers_and_a_head_without_its_policy_are_refused():
    """N1, N2: either would leave the Jobs API or Ray's ports to whoever reaches them. Token authentication is on by
    default where rayJob.rayVersion is 2.52 or newer, off where older or unset, and can be set either way."""
    args = ["template", "myrun", str(CHART), "-n", NS, "--set-file", f"runConfig={QUICKSTART}"]
    hostnet = tuple(s for s in HOST_NETWORK if not s.startswith("rayJob."))
    for sets, says in ((hostnet, "workerGroups[0].hostNetwork: a pod on the node's network is outside every "
                                 "NetworkPolicy"),
                       (("head.networkPolicy.enabled=false",), "head.networkPolicy.enabled=false with Ray's token "
                                                               "authentication off"),
                       (("head.networkPolicy.enabled=false", "rayJob.rayVersion=2.60.0", "rayJob.authToken=false"),
                        "head.networkPolicy.enabled=false with Ray's token authentication off")):
        proc = helm(*args, *[x for s in sets for x in ("--set", s)], check=False)
        assert proc.returncode != 0 and says in proc.stderr and "rayJob.authToken=true" in proc.stderr, proc.stderr
    for version, on in (("", False), ("2.49.0", False), ("2.52.0", True), ("2.60", True)):
        job = next(d for d in render(sets=(f"rayJob.rayVersion={version}",)) if d["kind"] == "RayJob")
        assert ("authOptions" in job["spec"]["rayClusterSpec"]) is on, version
    assert helm(*args, *[x for s in ("head.networkPolicy.enabled=false", "rayJob.rayVersion=2.52.0")
                         for x in ("--set", s)]).returncode == 0


def test_host_network_is_refused_where_the_policies_would_cut_it():
    """D3: without networkPolicy.nodeCIDRs the head's and the workers' policies would drop it."""
    args = ["template", "myrun", str(CHART), "-n", NS, "--set-file", f"runConfig={QUICKSTART}"]
    for sets in (HOST_NETWORK[:-1], (*HOST_NETWORK[:-1], "head.networkPolicy.enabled=false")):
        proc = helm(*args, *[x for s in sets for x in ("--set", s)], check=False)
        assert proc.returncode != 0 and "set networkPolicy.nodeCIDRs" in proc.stderr, proc.stderr
    off = ("head.networkPolicy.enabled=false", "networkPolicy.workers=false", "sandbox.networkPolicy.enabled=false")
    assert helm(*args, *[x for s in (*HOST_NETWORK[:-1], *off) for x in ("--set", s)]).returncode == 0


@pytest.mark.parametrize("case", list(CASES))
def test_rbac_grants_no_wildcard_no_secrets_and_no_network_policy_changes(case):
    """D5: the session Role could create NetworkPolicies (which add up: egress could be reopened)."""
    docs = docs_of(case)
    assert rbac_problems(docs) == []
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding")]


def test_the_rbac_check_catches_what_it_names():
    role = {"kind": "Role", "metadata": {"name": "r"}, "rules": [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["*"]},
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]},
        {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"], "verbs": ["create", "get"]},
        {"apiGroups": [""], "resources": ["pods/exec"], "verbs": ["create"]},
        {"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["roles"], "verbs": ["bind"]}]}
    assert [p.split(": ")[1].split(" ")[0] for p in rbac_problems([role])] == [
        "a", "Secrets", "changes", "['pods/exec']", "['bind']"]


@pytest.mark.parametrize("case", list(CASES))
def test_no_container_adds_capabilities_it_would_lose(case):
    """D2: a capability added to a non-root container is gone after its first execve."""
    for where, t in pod_templates(docs_of(case)):
        assert capability_problems(t["spec"]) == [], where


DIGEST = "sha256:" + "ab" * 32
AGENT_DIGEST = "sha256:" + "cd" * 32
GROUP_DIGEST = "sha256:" + "ef" * 32


@pytest.mark.parametrize("values", [None, *EXAMPLES], ids=lambda v: v.stem if v else "defaults")
def test_every_image_is_pinned_by_its_digest_when_one_is_given(values, tmp_path):
    """D9: the run's pods, its retries, the sandbox service and each session pod's agent run one build; a worker
    group with an image of its own (a disaggregated run's rollout build) runs that one, pinned by its digest."""
    sets = (f"image.digest={DIGEST}", "sandbox.pods.agentImage.repository=registry.example.com/agent",
            f"sandbox.pods.agentImage.digest={AGENT_DIGEST}")
    raw = yaml.safe_load(values.read_text()) if values else {}
    own = [g["name"] for g in raw.get("workerGroups", []) if (g.get("image") or {}).get("repository")]
    if own:  # --set cannot reach into a list of the values file: a copy with the groups' digests
        for g in raw["workerGroups"]:
            if g["name"] in own:
                g["image"]["digest"] = GROUP_DIGEST
        values = tmp_path / values.name
        values.write_text(yaml.safe_dump(raw))
    docs = render(*([values] if values else []), config=GPU_CONFIG if values == GPU else QUICKSTART, sets=sets)
    found = images(docs)
    mine = {where for where, _ in found if any(where.startswith(f"ray-worker {name}/") for name in own)}
    assert found and all(image.endswith("@" + (GROUP_DIGEST if where in mine else DIGEST)) for where, image in found)
    assert len(mine) == len(own)  # each such group's container(s) run its own build
    service = [d for d in docs if d["kind"] == "Deployment"]
    args = service[0]["spec"]["template"]["spec"]["containers"][0]["args"] if service else []
    agent = [a for a in args if a.startswith("--set=sandbox.kubernetes.agent_image=")]
    assert agent == ([f"--set=sandbox.kubernetes.agent_image=registry.example.com/agent@{AGENT_DIGEST}"]
                     if "--backend=kubernetes" in args else [])


@pytest.mark.parametrize("case", list(CASES))
def test_the_disruption_budget_and_the_session_quota_are_there_when_enabled(case):
    """D6, D7: a drain waits for the run; the session namespace holds at most the quota's pods."""
    docs = docs_of(case)
    w = World(docs)
    pdbs = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "PodDisruptionBudget"}
    pdb = pdbs.pop("myrun-ray")
    assert pdb["maxUnavailable"] == 0 and pdb["unhealthyPodEvictionPolicy"] == "AlwaysAllow"  # a broken run: no hold
    selector = pdb["selector"]
    from sandbox.k8s_manifests import selects

    held = [w.head, *(p for p in w.workers if w.role(p) != "rollout")]
    assert all(selects(selector, p.labels) for p in held)
    assert not selects(selector, w.sandbox.labels) and not selects(selector, w.other_run.labels)
    rollouts = [p for p in w.workers if w.role(p) == "rollout"]  # a disaggregated run's: drained one at a time
    if rollouts:
        rollout = pdbs.pop("myrun-rollout")
        assert rollout["maxUnavailable"] == 1 and rollout["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
        assert all(selects(rollout["selector"], p.labels) and not selects(selector, p.labels) for p in rollouts)
        assert not any(selects(rollout["selector"], p.labels) for p in held)
    # N10: the sandbox service's replicas go one at a time (it had none)
    sandbox = pdbs.pop("myrun-sandbox")
    assert sandbox["maxUnavailable"] == 1 and selects(sandbox["selector"], w.sandbox.labels) and not pdbs
    assert not any(selects(sandbox["selector"], p.labels) for p in [w.head, *w.workers, *filter(None, [w.session])])
    quotas = [d for d in docs if d["kind"] == "ResourceQuota"]
    if w.session is None:
        assert quotas == []
        return
    [quota] = quotas
    assert quota["metadata"]["namespace"] == w.session.namespace and int(quota["spec"]["hard"]["pods"]) > 0


def test_without_them_when_disabled():
    off = render(sets=("disruption.podDisruptionBudget=false", "sandbox.pods.quota.enabled=false"))
    assert not [d for d in off if d["kind"] in ("PodDisruptionBudget", "ResourceQuota")]
