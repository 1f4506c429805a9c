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

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, logging, os, ray
from rl.cluster import Cluster
from rl.warmstart import prepare_model
from tests.test_run import tiny

def on_the_cpu():
    import rl.workers
    rl.workers.worker_device = lambda cfg: "cpu"

ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False,
         object_store_memory=200 * 2**20, runtime_env={"worker_process_setup_hook": on_the_cpu})
cfg = tiny(cluster={"workers": 2, "gpus_per_worker": 1})
with Cluster(cfg, str(prepare_model(cfg))) as cluster:
    def seen(actor):
        return ray.get(actor.__ray_call__.remote(lambda self: os.environ.get("CUDA_VISIBLE_DEVICES")))
    print(json.dumps([[seen(t), seen(r)] for t, r in zip(cluster.trainers, cluster.rollouts)]))
"""


def test_each_worker_pair_shares_its_own_gpu():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pairs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(trainer == rollout for trainer, rollout in pairs), pairs   # colocated: one device per worker
    assert sorted(trainer for trainer, _ in pairs) == ["0", "1"], pairs   # and a different one per worker
