"""A run on a real multi-node Ray cluster, as on Kubernetes: the driver on a head node that holds no worker, worker
nodes with their own HOME and RL_CACHE_DIR that cannot see the head's cache (bubblewrap hides it), each node sized
for one worker (the ``rl_worker`` resource the chart gives worker pods). Also the parts of the placement that need
no cluster: the cgroup CPU limit and the threads that follow from it."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from rl.placement import Site, cgroup_cpu_limit, worker_threads
from tests.ray_nodes import RayNodes
from tests.test_run import TINY

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (make setup)")


def test_a_run_whose_model_is_only_on_the_head_trains_with_one_worker_per_node(tmp_path):
    """The head warm-starts the model into its own cache (no model.path, as the cpu-demo example does); the
    workers are told that path. Before the fix they failed with ``model directory ... does not exist`` (and both
    were packed onto one node); now each node gets a copy of the model through Ray's object store and holds
    exactly one worker."""
    head_cache = tmp_path / "head" / "cache"
    head_cache.mkdir(parents=True)
    with RayNodes(head_cpus=0) as nodes:
        homes = [tmp_path / "node-a", tmp_path / "node-b"]
        for home in homes:  # 2 CPUs each: room for both workers' bundles, but one worker slot
            nodes.add_node(cpus=2, home=home, resources='{"rl_worker": 1}', hide=(head_cache,))
        nodes.wait_for_nodes(3)
        cfg = json.loads(json.dumps(TINY))
        cfg["run"] = {"iterations": 1, "eval_every": 1, "save_every": 1, "name": "multinode"}
        cfg["cluster"] = {"ray_address": nodes.address, "workers": 2}
        (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
        env = {**nodes.env, "HOME": str(tmp_path / "head"), "RL_CACHE_DIR": str(head_cache)}
        run = subprocess.run(["rl", "train", str(tmp_path / "run.yaml"), "--run-dir", str(tmp_path / "run")], env=env,
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-4000:]
    assert [json.loads(x)["iteration"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [0]
    assert (tmp_path / "run" / "final" / "config.json").is_file()
    warm = [p.name for p in head_cache.iterdir() if p.name.startswith("warmstart-")]
    assert len(warm) == 1
    for home in homes:  # each node has its own copy: a worker ran there
        shipped = list((home / "cache" / "shipped").iterdir())
        assert [p.name.rsplit("-", 1)[0] for p in shipped] == warm
        assert {p.name for p in shipped[0].iterdir()} == {p.name for p in (head_cache / warm[0]).iterdir()}


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


def test_threads_are_the_pods_cpus_shared_by_its_workers(ray_cluster):
    """Each worker's threads come from the node it was placed on (its probe), not from the head's cores: one
    worker on an 8-CPU pod gets 8, the eight workers of a GPU pod share its CPUs; capped by the Ray node's CPUs."""
    import ray

    here = ray.get_runtime_context().get_node_id()
    ray_cpus = int(ray.cluster_resources()["CPU"])
    sites = [Site(here, 64, True)] * 2
    assert worker_threads(sites, None) == [max(1, ray_cpus // 2)] * 2
    assert worker_threads([Site(here, 1, True)], None) == [1]
    assert worker_threads(sites, 3) == [3, 3]
    # on a node this cluster does not know, the probe's own figure counts
    assert worker_threads([Site("elsewhere", 8, True)], None) == [8]
    assert worker_threads([Site("gpu-pod", 96, True)] * 8, None) == [12] * 8
