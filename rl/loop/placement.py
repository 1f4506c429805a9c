"""Where the workers go, and what each of them finds on its node.

A placement group holds one bundle per worker. On Kubernetes every worker pod advertises a Ray resource once per
worker it was sized for (1 on a CPU pod, its GPUs / gpusPerWorker on a GPU pod) and each bundle takes one, so a pod
never gets more workers than the chart counted for it: ``rl_worker`` on colocated and trainer pods, ``rl_rollout`` on
the rollout pods of a disaggregated run (the chart's ``workerGroups[].role``), so that trainer ranks and replicas go
to the pods sized and labelled for them. Before the workers start, a
probe in each bundle reports its node, the CPUs the pod may use (its cgroup CPU limit) and whether it sees the
model directory; torch threads follow from the first two, and a node that cannot see the model directory (the
head's warm start in the head's own cache, say) gets a copy through Ray's object store.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

WORKER_SLOT = "rl_worker"  # custom Ray resource of the colocated and trainer pods (helm/colocated-rl sets it)
ROLLOUT_SLOT = "rl_rollout"  # of the rollout pods of a disaggregated run
#: the slots the cluster's pods offer, comma-separated ("1": rl_worker), set by the chart: bundles take them even
#: before any worker pod has joined
SLOTS_ENV = "RL_WORKER_SLOTS"
SHIP_CHUNK_BYTES = 32 << 20
SHIP_IN_FLIGHT = 4  # chunks on their way to one node at a time: bounds the object store's share
CGROUP_ROOT = Path("/sys/fs/cgroup")


def offered_slots() -> set[str]:
    """The worker slots the cluster's pods offer: named by ``RL_WORKER_SLOTS``, or seen among its resources."""
    named = os.environ.get(SLOTS_ENV, "")
    slots = {WORKER_SLOT} if named == "1" else {x.strip() for x in named.split(",") if x.strip()}
    have = ray.cluster_resources()
    return slots | {k for k in (WORKER_SLOT, ROLLOUT_SLOT) if have.get(k)}


def worker_bundle(cpus: float, gpus: float, slot: str = WORKER_SLOT) -> dict[str, float]:
    """The resources of one worker's bundle; it takes one ``slot`` (``WORKER_SLOT``: a colocated worker or a trainer,
    ``ROLLOUT_SLOT``: a disaggregated replica) where the cluster's pods offer them."""
    bundle = {"CPU": cpus} | ({"GPU": gpus} if gpus else {})
    if slot in offered_slots():
        bundle[slot] = 1
    return bundle


def unplaceable(bundle: dict[str, float], n: int, waited_s: float) -> str:
    """Why ``n`` bundles did not fit, for the error a user sees: what was asked and what the cluster has."""
    have = ray.cluster_resources()
    parts = [f"{have.get(k, 0):g} {k}" for k in bundle]
    slots = ("" if {WORKER_SLOT, ROLLOUT_SLOT} & set(bundle) else
             f"; no node offers the {WORKER_SLOT} resource, so workers are packed onto nodes by CPU/GPU alone")
    return (f"cluster.workers={n}: the Ray cluster could not place {n} workers of {bundle} within {waited_s:.0f} s; "
            f"it has {', '.join(parts)} in all{slots} (are all worker pods up and sized for cluster.workers?)")


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The CPU quota of this process's cgroup and its ancestors, in CPUs (cgroup v2 ``cpu.max``, else v1
    ``cpu.cfs_quota_us``); None when there is none."""
    limits: list[float] = []
    rel = ""
    try:
        for line in proc_cgroup.read_text().splitlines():
            if line.startswith("0::"):
                rel = line[3:].strip().lstrip("/")
    except OSError:
        pass
    d = root / rel if rel else root
    while True:  # v2: the tightest quota from this cgroup up to the root of the (possibly namespaced) tree
        try:
            quota, period = (d / "cpu.max").read_text().split()[:2]
            if quota != "max":
                limits.append(int(quota) / int(period))
        except (OSError, ValueError):
            pass
        if d == root or root not in d.parents:
            break
        d = d.parent
    for v1 in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        try:
            quota_us = int((root / v1 / "cpu.cfs_quota_us").read_text())
            period_us = int((root / v1 / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError):
            continue
        if quota_us > 0 and period_us > 0:
            limits.append(quota_us / period_us)
        break
    return min(limits) if limits else None


def usable_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by its cgroup's CPU quota (a pod's CPU limit)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    return max(1, min(n, int(limit))) if limit is not None else max(1, n)


@dataclass(frozen=True)
class Site:
    """What the probe in one bundle found."""

    node_id: str
    cpus: int  # usable_cpus() there
    sees_model: bool


def _probe(model_dir: str) -> Site:
    node = ray.get_runtime_context().get_node_id()
    return Site(node, usable_cpus(), (Path(model_dir) / "config.json").is_file())


def probe_bundles(pg, n: int, model_dir: str) -> list[Site]:
    """Run the probe in each of the ``n`` bundles of ``pg`` (before the workers take their CPUs)."""
    probe = ray.remote(num_cpus=0)(_probe)
    return ray.get([probe.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=i)).remote(model_dir) for i in range(n)])


def omp_threads() -> int | None:
    """``OMP_NUM_THREADS`` of this process's environment when it is a positive integer (else None)."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def worker_threads(sites: list[Site], configured: int | None) -> list[int]:
    """Torch threads of each bundle's worker: ``configured``, else ``OMP_NUM_THREADS`` where the run was started with
    it (several runs sharing a machine), else the CPUs of its pod (cgroup limit, capped by the Ray node's CPU count)
    shared by the workers placed there."""
    configured = configured or omp_threads()
    if configured:
        return [configured] * len(sites)
    ray_cpus = {node["NodeID"]: node.get("Resources", {}).get("CPU", 0) for node in ray.nodes() if node.get("Alive")}
    sharing = Counter(s.node_id for s in sites)
    out = []
    for s in sites:
        cpus = min(s.cpus, int(ray_cpus.get(s.node_id) or s.cpus))
        out.append(max(1, cpus // sharing[s.node_id]))
    return out


def _files(model_dir: Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(model_dir)), p.stat().st_size) for p in model_dir.rglob("*") if p.is_file())


def shipped_name(model_dir: Path, files: list[tuple[str, int]]) -> str:
    """The node-local directory name of a copy: the source's name and a hash of its path, files, sizes, times."""
    h = hashlib.sha256(str(model_dir.resolve()).encode())
    for rel, size in files:
        h.update(f"{rel}\0{size}\0{(model_dir / rel).stat().st_mtime_ns}\0".encode())
    return f"{model_dir.name}-{h.hexdigest()[:16]}"


class _DirWriter:
    """Receives a directory's files in chunks on one node, in the node's own cache (``RL_CACHE_DIR``)."""

    def __init__(self, name: str) -> None:
        from rl.setup.warmstart import cache_root

        self.dest = cache_root() / "shipped" / name
        self.tmp = self.dest.with_name(f"{name}.tmp-{uuid.uuid4().hex[:8]}")

    def target(self) -> tuple[str, bool]:
        """The copy's path here, and whether an earlier run left it complete (it is renamed in place only then)."""
        return str(self.dest), self.dest.is_dir()

    def write(self, rel: str, offset: int, data: bytes) -> None:
        path = self.tmp / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "r+b" if path.exists() else "wb") as f:
            f.seek(offset)
            f.write(data)

    def finish(self, files: list[tuple[str, int]]) -> str:
        for rel, size in files:  # empty files get no write
            path = self.tmp / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
            if path.stat().st_size != size:
                raise OSError(f"shipping {rel} to {self.dest}: {path.stat().st_size} of {size} bytes arrived")
        try:
            self.tmp.rename(self.dest)
        except OSError:  # another run shipped the same directory meanwhile
            if not self.dest.is_dir():
                raise
            shutil.rmtree(self.tmp, ignore_errors=True)
        return str(self.dest)


def ship_directory(model_dir: str, node_ids: list[str]) -> dict[str, str]:
    """Copy ``model_dir`` (read here, once) into the cache of each node in ``node_ids``; returns node -> path.

    Each chunk is put into the object store once and written by every node that needs it; at most
    ``SHIP_IN_FLIGHT`` chunks are on their way at a time. A node that holds a complete copy already keeps it."""
    src = Path(model_dir)
    files = _files(src)
    name = shipped_name(src, files)
    writer_cls = ray.remote(num_cpus=0)(_DirWriter)
    writers = {node: writer_cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
        name) for node in node_ids}
    paths: dict[str, str] = {}
    for node, (path, complete) in zip(writers, ray.get([w.target.remote() for w in writers.values()]), strict=True):
        if complete:
            paths[node] = path
    todo = {node: w for node, w in writers.items() if node not in paths}
    pending: list = []
    for rel, _ in files:
        with open(src / rel, "rb") as f:
            offset = 0
            while chunk := f.read(SHIP_CHUNK_BYTES):
                ref = ray.put(chunk)
                pending += [w.write.remote(rel, offset, ref) for w in todo.values()]
                offset += len(chunk)
                while len(pending) > SHIP_IN_FLIGHT * max(1, len(todo)):
                    done, pending = ray.wait(pending, num_returns=1)
                    ray.get(done)
    ray.get(pending)
    paths.update(zip(todo, ray.get([w.finish.remote(files) for w in todo.values()]), strict=True))
    for w in writers.values():
        ray.kill(w)
    return paths


def reachable_model_dirs(model_dir: str, sites: list[Site]) -> list[str]:
    """Per bundle, where its worker finds the model: ``model_dir`` where the node sees it, else a copy shipped
    to that node (the run volume is not shared, or the model is in the head's own cache)."""
    blind = sorted({s.node_id for s in sites if not s.sees_model})
    shipped = ship_directory(model_dir, blind) if blind else {}
    return [shipped.get(s.node_id, model_dir) for s in sites]
