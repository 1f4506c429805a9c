"""The chart's entrypoint on a real multi-node Ray cluster, as on Kubernetes: the driver on a head node that holds no
worker, worker nodes with their own HOME and RL_CACHE_DIR that cannot see the head's cache (bubblewrap hides it), each
node sized for one worker (the ``rl_worker`` resource the chart gives worker pods). Also the parts of the placement
that need no cluster: the cgroup CPU limit and the threads that follow from it."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from benchmarks.ray_nodes import RayNodes
from rl.loop.placement import (
    ROLLOUT_SLOT,
    SLOTS_ENV,
    WORKER_SLOT,
    Site,
    cgroup_cpu_limit,
    worker_bundle,
    worker_threads,
)
from tests.test_helm_chart import HELM, one, pod_templates, render, run_configmap
from tests.test_run import TINY

# two CPU worker pods (cluster.workers=2), each one Ray node below
TWO_CPU_PODS = {"workerGroups": [{"name": "cpu", "replicas": 2, "cpu": "2", "memory": "4Gi", "shmSize": "1Gi"}]}
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None or HELM is None,
                                reason="bubblewrap and helm are needed (make setup installs them)")


@pytest.mark.slow
def test_the_charts_entrypoint_trains_on_a_multinode_cluster_and_a_retry_resumes(tmp_path):
    """launch.sh from the rendered ConfigMap (its mount paths pointed at temporary folders) runs `rl train` with the
    head pod's environment from the rendered RayJob, on the head of a Ray cluster of three nodes, as KubeRay runs it:
    the head holds no worker; two worker nodes (cluster.workers=2: two CPU worker pods) have their own HOME and
    RL_CACHE_DIR, offer one rl_worker each, and cannot see the head's cache (bubblewrap hides it; a run volume that
    is not shared). The head warm-starts the model into its cache and the workers are told that path: before the
    fix they failed with ``model directory ... does not exist`` (and were packed onto one node); now each node gets
    a copy through Ray's object store and holds one worker. Run again, as a retried job would, it resumes."""
    cfg = json.loads(json.dumps(TINY))
    cfg["run"] = {"iterations": 1, "eval_every": 1, "save_every": 1, "name": "tiny"}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    etc, data = tmp_path / "etc", tmp_path / "data"
    etc.mkdir()
    (tmp_path / "pods.yaml").write_text(yaml.safe_dump(TWO_CPU_PODS))

    def write_configmap(*sets: str) -> dict[str, str]:
        """The ConfigMap's files into etc/; returns the head container's environment."""
        docs = render(tmp_path / "pods.yaml", config=tmp_path / "run.yaml",
                      sets=(f"run.configMountPath={etc}", f"storage.mountPath={data}", "sandbox.enabled=false", *sets))
        for name, text in run_configmap(docs)["data"].items():
            (etc / name).write_text(text)
        head = pod_templates(one(docs, "RayJob"))[0]["spec"]["containers"][0]
        return {e["name"]: e["value"] for e in head["env"]}

    head_env = write_configmap()
    head_cache = Path(head_env["RL_CACHE_DIR"])
    assert head_cache.parent == data
    with RayNodes(head_cpus=0) as nodes:
        homes = [tmp_path / "node-a", tmp_path / "node-b"]
        for i, home in enumerate(homes):  # 2 CPUs each: room for both workers' bundles, but one worker slot
            nodes.add_node(cpus=2, home=home, resources='{"rl_worker": 1}', hide=(head_cache,))
            nodes.wait_for_nodes(2 + i)  # one at a time: less load while they start
        env = {**nodes.env, **head_env, "HOME": str(tmp_path / "head"), "RAY_ADDRESS": nodes.address}
        first = subprocess.run(["bash", str(etc / "launch.sh")], env=env, capture_output=True, text=True, timeout=600)
        assert first.returncode == 0, first.stderr[-4000:]
        run_dir = data / "runs" / "myrun"
        assert [json.loads(x)["iteration"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [0]
        warm = [p.name for p in head_cache.iterdir() if p.name.startswith("warmstart-")]
        assert len(warm) == 1
        for home in homes:  # each node has its own copy: a worker ran there
            shipped = list((home / "cache" / "shipped").iterdir())
            assert [p.name.rsplit("-", 1)[0] for p in shipped] == warm
            assert {p.name for p in shipped[0].iterdir()} == {p.name for p in (head_cache / warm[0]).iterdir()}
        write_configmap("run.extraArgs={--set,run.iterations=2}")
        second = subprocess.run(["bash", str(etc / "launch.sh")], env=env, capture_output=True, text=True,
                                timeout=600)
        assert second.returncode == 0, second.stderr[-4000:]
        assert [json.loads(x)["iteration"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    assert (run_dir / "final" / "config.json").is_file()


@pytest.mark.slow
def test_a_disaggregated_charts_trainer_and_replicas_go_to_the_pods_of_their_role(tmp_path):
    """The chart's roles on a real multi-node Ray cluster: one trainer node offering one rl_worker (2 CPUs: room for
    a trainer and a replica) and two rollout nodes offering one rl_rollout each, none seeing the head's cache. The
    run (cluster.placement disaggregated, set by the chart) puts its trainer on the trainer node and one replica on
    each rollout node: each of the three nodes got the model shipped, where packing by CPU alone would have left the
    rollout nodes without a worker."""
    cfg = json.loads(json.dumps(TINY))
    cfg["run"] = {"iterations": 1, "eval_every": 1, "save_every": 1, "name": "tiny"}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    etc, data = tmp_path / "etc", tmp_path / "data"
    etc.mkdir()
    pods = {"workerGroups": [{"name": "trainer", "role": "trainer", "replicas": 1, "cpu": "2", "memory": "4Gi",
                              "shmSize": "1Gi"},
                             {"name": "rollout", "role": "rollout", "replicas": 2, "cpu": "1", "memory": "4Gi",
                              "shmSize": "1Gi"}]}
    (tmp_path / "pods.yaml").write_text(yaml.safe_dump(pods))
    docs = render(tmp_path / "pods.yaml", config=tmp_path / "run.yaml",
                  sets=(f"run.configMountPath={etc}", f"storage.mountPath={data}", "sandbox.enabled=false"))
    for name, text in run_configmap(docs)["data"].items():
        (etc / name).write_text(text)
    head_env = {e["name"]: e["value"] for e in pod_templates(one(docs, "RayJob"))[0]["spec"]["containers"][0]["env"]}
    head_cache = Path(head_env["RL_CACHE_DIR"])
    with RayNodes(head_cpus=0) as nodes:
        homes = {"trainer": tmp_path / "trainer", "rollout-a": tmp_path / "rollout-a", "rollout-b": tmp_path / "b"}
        for i, (name, home) in enumerate(homes.items()):
            slot = '{"rl_worker": 1}' if name == "trainer" else '{"rl_rollout": 1}'
            nodes.add_node(cpus=2 if name == "trainer" else 1, home=home, resources=slot, hide=(head_cache,))
            nodes.wait_for_nodes(2 + i)
        env = {**nodes.env, **head_env, "HOME": str(tmp_path / "head"), "RAY_ADDRESS": nodes.address}
        run = subprocess.run(["bash", str(etc / "launch.sh")], env=env, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-4000:]
    run_dir = data / "runs" / "myrun"
    assert [json.loads(x)["staleness_max"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [0]
    for name, home in homes.items():  # a worker ran on each node: its own copy of the warm start
        assert list((home / "cache" / "shipped").iterdir()), name


def test_bundles_take_the_slot_of_their_side_where_the_pods_offer_it(ray_cluster, monkeypatch):
    """RL_WORKER_SLOTS (the chart's) names the slots the pods offer: trainer bundles take rl_worker, a disaggregated
    run's replicas rl_rollout; a local cluster without them places by CPU alone."""
    monkeypatch.setenv(SLOTS_ENV, "rl_worker,rl_rollout")
    assert worker_bundle(2, 0) == {"CPU": 2, WORKER_SLOT: 1}
    assert worker_bundle(1, 1, ROLLOUT_SLOT) == {"CPU": 1, "GPU": 1, ROLLOUT_SLOT: 1}
    monkeypatch.setenv(SLOTS_ENV, "1")  # what charts before the roles set: rl_worker only
    assert worker_bundle(2, 0) == {"CPU": 2, WORKER_SLOT: 1} and worker_bundle(1, 0, ROLLOUT_SLOT) == {"CPU": 1}
    monkeypatch.delenv(SLOTS_ENV)
    assert worker_bundle(1, 0) == {"CPU": 1} and worker_bundle(1, 0, ROLLOUT_SLOT) == {"CPU": 1}


def _cgroup(tmp_path: Path, v2: dict[str, str] | None = None, v1: tuple[str, str] | None = None,
            own: str = "") -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    for rel, text in (v2 or {}).items():
        (root / rel).mkdir(parents=True, exist_ok=True)
        (root / rel / "cpu.max").write_text(text)
    if v1:
        (root / "cpu").mkdir(parents=True)
        (root / "cpu" / "cpu.cfs_quota_us").write_text(v1[0])
        (root / "cpu" / "cpu.cfs_period_us").write_text(v1[1])
    proc = tmp_path / "proc-cgroup"
    proc.write_text(f"0::/{own}\n" if v2 is not None else "4:cpu,cpuacct:/\n")
    return root, proc


def test_cgroup_cpu_limit_reads_the_pods_quota(tmp_path):
    # a pod with cpu limit 4 (cgroup v2, namespaced: the container's cgroup is the root of its view)
    assert cgroup_cpu_limit(*_cgroup(tmp_path / "a", {"": "400000 100000"})) == 4
    # no limit
    assert cgroup_cpu_limit(*_cgroup(tmp_path / "b", {"": "max 100000"})) is None
    # not namespaced: the process's own cgroup and its parents, the tightest wins
    root, proc = _cgroup(tmp_path / "c", {"": "max 100000", "kubepods/pod1": "250000 100000",
                                          "kubepods/pod1/ctr": "max 100000"}, own="kubepods/pod1/ctr")
    assert cgroup_cpu_limit(root, proc) == 2.5
    # cgroup v1
    assert cgroup_cpu_limit(*_cgroup(tmp_path / "d", v1=("300000", "100000"))) == 3
    assert cgroup_cpu_limit(*_cgroup(tmp_path / "e", v1=("-1", "100000"))) is None


def test_threads_are_the_pods_cpus_shared_by_its_workers(ray_cluster, monkeypatch):
    """Each worker's threads come from the node it was placed on (its probe), not from the head's cores: one
    worker on an 8-CPU pod gets 8, the eight workers of a GPU pod share its CPUs; capped by the Ray node's CPUs."""
    import ray

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    here = ray.get_runtime_context().get_node_id()
    ray_cpus = int(ray.cluster_resources()["CPU"])
    sites = [Site(here, 64, True)] * 2
    assert worker_threads(sites, None) == [max(1, ray_cpus // 2)] * 2
    assert worker_threads([Site(here, 1, True)], None) == [1]
    assert worker_threads(sites, 3) == [3, 3]
    # on a node this cluster does not know, the probe's own figure counts
    assert worker_threads([Site("elsewhere", 8, True)], None) == [8]
    assert worker_threads([Site("gpu-pod", 96, True)] * 8, None) == [12] * 8
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # a run started with a thread count asked for (machines shared)
    assert worker_threads([Site("gpu-pod", 96, True)] * 8, None) == [2] * 8 and worker_threads(sites, 3) == [3, 3]


def test_workers_that_cannot_be_placed_are_named(ray_cluster, monkeypatch):
    """More workers than the cluster can hold: a one-line error with what was asked and what there is (it was a
    bare GetTimeoutError after two minutes)."""
    import rl.loop.cluster
    from rl.errors import UserError
    from rl.settings import for_model
    from rl.setup.warmstart import prepare_model
    from tests.test_run import tiny

    monkeypatch.setattr(rl.loop.cluster, "PLACEMENT_WAIT_S", 3)
    cfg = tiny(cluster={"workers": 8})
    with pytest.raises(UserError, match=r"^cluster.workers=8: the Ray cluster could not place 8 workers of "
                                        r"\{'CPU': 1.0\} within 3 s; it has 2 CPU in all; no node offers the "
                                        r"rl_worker resource"):
        rl.loop.cluster.Cluster(for_model(cfg, str(prepare_model(cfg))), str(prepare_model(cfg)))
