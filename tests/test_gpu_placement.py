"""cluster.gpus_per_worker: each colocated worker's placement-group bundle takes its GPUs, and the
worker's trainer and inference actors both see them. Ray's GPU resources are declared on this CPU
machine, so the placement is what is under test here, not CUDA: a worker given GPUs refuses to run without
CUDA (``rl.workers.worker_device``), so each Ray worker process here is set up to compute on the CPU instead
(the stand-in for the GPUs this machine does not have)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, logging, os, ray
from rl.cluster import Cluster
from rl.warmstart import prepare_model
from tests.test_run import tiny

def on_the_cpu():
    import rl.workers
    rl.workers.worker_device = lambda cfg: "cpu"
    native = rl.workers.rollout_engine

    def one_device(d, c, n):  # the native engine stands in for vLLM's tensor-parallel ranks
        r = c.rollout.model_copy(update={"engine": "native", "tensor_parallel_size": 1})
        return native(d, c.model_copy(update={"rollout": r}), n)
    rl.workers.rollout_engine = one_device

ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False,
         object_store_memory=200 * 2**20, runtime_env={"worker_process_setup_hook": on_the_cpu})
for tp in (1, 2):
    cfg = tiny(cluster={"workers": 2, "gpus_per_worker": tp}, rollout={"engine": "vllm" if tp > 1 else "native",
                                                                        "tensor_parallel_size": tp})
    with Cluster(cfg, str(prepare_model(cfg))) as cluster:
        def seen(actor):
            return ray.get(actor.__ray_call__.remote(lambda self: os.environ.get("CUDA_VISIBLE_DEVICES")))
        print(json.dumps([[seen(t), seen(r)] for t, r in zip(cluster.trainers, cluster.rollouts)]))
"""


@pytest.fixture(scope="module")
def seen() -> dict[int, list[list[str]]]:
    """Per replica size (1, 2 GPUs): [trainer's, inference actor's] CUDA_VISIBLE_DEVICES of each worker."""
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(zip((1, 2), (json.loads(line) for line in proc.stdout.strip().splitlines()[-2:]), strict=True))


def test_each_worker_pair_shares_its_own_gpu(seen):
    pairs = seen[1]
    assert all(trainer == rollout for trainer, rollout in pairs), pairs   # colocated: one device per worker
    assert sorted(trainer for trainer, _ in pairs) == ["0", "1"], pairs   # and a different one per worker


def test_a_tensor_parallel_replica_holds_its_workers_gpus_and_its_trainer_computes_on_them(seen):
    """rollout.tensor_parallel_size 2 with cluster.gpus_per_worker 2: each inference actor is given both GPUs
    of its bundle (vLLM's ranks run on them) and its trainer sees the same two, not a third device."""
    pairs = seen[2]
    assert all(trainer == rollout and len(rollout.split(",")) == 2 for trainer, rollout in pairs), pairs
    gpus = [g for _, rollout in pairs for g in rollout.split(",")]
    assert sorted(gpus) == ["0", "1", "2", "3"], pairs  # two workers, two GPUs each, none shared
