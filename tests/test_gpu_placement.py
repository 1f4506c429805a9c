"""cluster.gpus_per_worker: each colocated worker's placement-group bundle takes its GPUs, and the
worker's trainer and inference actors both see them (a replica that spans several GPUs has a trainer rank on each
of them). Ray's GPU resources are declared on this CPU machine, so the placement is what is under test here, not
CUDA: a worker given GPUs refuses to run without CUDA (``rl.loop.workers.worker_device``), so each Ray worker process
here is set up to compute on the CPU instead, its engine built as the native one on the CPU (the stand-ins for the
GPUs and for vLLM's GPU build, which this machine does not have)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # one two-cluster run in its own Ray (the placement; the update is checked elsewhere)

SCRIPT = """
import json, logging, os, ray
from rl.loop.cluster import Cluster
from rl.settings import for_model
from rl.setup.warmstart import prepare_model
from tests.test_run import tiny

def on_the_cpu():
    import dataclasses

    import rl.loop.workers
    rl.loop.workers.worker_device = lambda device, gpus: "cpu"
    build = rl.loop.workers.build_engine

    def one_device(s):  # the native engine on the CPU stands in for vLLM's tensor-parallel ranks on the GPUs
        return build(dataclasses.replace(s, kind="native", device="cpu", attention="torch", tensor_parallel_size=1,
                                         ipc_views=False))
    rl.loop.workers.build_engine = one_device

import rl.settings
rl.settings.vllm_build = lambda: "gpu"  # the driver resolves as where vLLM's GPU build is installed

ray.init(num_cpus=4, num_gpus=4, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False,
         object_store_memory=200 * 2**20, runtime_env={"worker_process_setup_hook": on_the_cpu})
for tp in (1, 2):
    cfg = tiny(cluster={"workers": 2, "gpus_per_worker": tp}, rollout={"engine": "vllm" if tp > 1 else "native",
                                                                        "tensor_parallel_size": tp})
    with Cluster(for_model(cfg, str(prepare_model(cfg))), str(prepare_model(cfg))) as cluster:
        def seen(actor):
            return ray.get(actor.__ray_call__.remote(lambda self: os.environ.get("CUDA_VISIBLE_DEVICES")))

        def world(actor):
            return ray.get(actor.__ray_call__.remote(lambda self: (self.rank, self.world)))

        # a step on every rank, then an update: each engine then holds the trainers' weights
        from engines.inference.sampling import SamplingParams
        from tests.conftest import make_sample, train_on
        outs = cluster.rollouts.generate([[5, 6, 7]] * 4, [SamplingParams(1.0, 8)] * 4, seed=0)
        cluster.rollouts.sleep()
        cluster.trainers.onload()
        train_on(cluster, [make_sample(0, o.prompt_ids, o.token_ids, o.logprobs, float(i % 2))
                           for i, o in enumerate(outs)])
        trained = ray.get([t.state_dict.remote() for t in cluster.trainers])[0]
        cluster.trainers.offload()
        cluster.rollouts.wake()
        cluster.rollouts.update_weights()
        same = all(all(v.equal(trained[k]) for k, v in ray.get(r.state_dict.remote()).items())
                   for r in cluster.rollouts)
        print(json.dumps({"trainers": [seen(t) for t in cluster.trainers], "rollouts": [seen(r) for r in
                          cluster.rollouts], "ranks": [world(t) for t in cluster.trainers], "updated": same}))
"""


@pytest.fixture(scope="module")
def seen() -> dict[int, dict]:
    """Per replica size (1, 2 GPUs): the trainers' and inference actors' CUDA_VISIBLE_DEVICES, the trainers' (rank,
    world), and whether an update after a training step left every engine with the trainers' weights."""
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(zip((1, 2), (json.loads(line) for line in proc.stdout.strip().splitlines()[-2:]), strict=True))


def test_each_worker_pair_shares_its_own_gpu(seen):
    one = seen[1]
    assert one["trainers"] == one["rollouts"], one   # colocated: one device per worker, both actors on it
    assert sorted(one["trainers"]) == ["0", "1"], one  # and a different one per worker
    assert one["ranks"] == [[0, 2], [1, 2]] and one["updated"], one


def test_a_tensor_parallel_replica_holds_its_workers_gpus_and_its_trainer_has_a_rank_on_each(seen):
    """rollout.tensor_parallel_size 2 with cluster.gpus_per_worker 2: each inference actor is given both GPUs of its
    bundle (vLLM's ranks run on them), and its worker's trainer is two ranks, one on each of those GPUs: FSDP2
    shards over all four GPUs of the run, none idle in training. A step on every rank, then an update through the
    workers' first ranks, leaves both engines with the trainers' weights."""
    two = seen[2]
    assert all(len(r.split(",")) == 2 for r in two["rollouts"]), two
    assert sorted(g for r in two["rollouts"] for g in r.split(",")) == ["0", "1", "2", "3"], two  # none shared
    # trainer rank r: worker r // 2, on GPU r % 2 of that worker's replica
    assert two["trainers"] == [g for r in two["rollouts"] for g in r.split(",")], two
    assert two["ranks"] == [[r, 4] for r in range(4)] and two["updated"], two
