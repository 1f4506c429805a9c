"""Workers given GPUs (cluster.gpus_per_worker > 0) that cannot use CUDA stop the run with one line instead of
training on the host: the check runs in the worker's own process, where CUDA's visibility is decided (a driver
older than the wheel, a pod without the NVIDIA runtime). Here a real Ray cluster is told its node has a GPU while the
worker processes see none (CUDA_VISIBLE_DEVICES empty, Ray told to leave it so), as on a node without the runtime;
the driver joins it as a launched run does (cluster.ray_address), so the check on the driver's own machine does not
apply. The same on this CPU-only machine and on a GPU machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.test_run import TINY

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import logging, sys, ray
ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False,
         object_store_memory=200 * 2**20, runtime_env={"env_vars": {"CUDA_VISIBLE_DEVICES": ""}})
from rl.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_workers_given_gpus_without_cuda_stop_the_run_in_one_line(tmp_path):
    cfg = json.loads(json.dumps(TINY))
    cfg["run"] = {"iterations": 1}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, "train", str(tmp_path / "run.yaml"), "--run-dir",
                           str(tmp_path / "r"), "--set", "cluster.ray_address=auto", "--set",
                           "cluster.gpus_per_worker=1"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "error: cluster.gpus_per_worker=1 but CUDA is not available in this worker (torch "), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "File \"" not in proc.stderr and "ray::" not in proc.stderr
    metrics = tmp_path / "r" / "metrics.jsonl"  # no iteration recorded (the file may not even be made)
    assert not (metrics.exists() and metrics.read_text()) and not (tmp_path / "r" / "checkpoints").exists()
