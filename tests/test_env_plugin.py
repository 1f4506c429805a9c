"""A third-party environment package (examples/reverse_env) is installed with pip and trains one iteration, in a
task mix with a built-in environment, without any change to the trainer."""

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.test_run import TINY

ROOT = Path(__file__).resolve().parents[1]


def test_installed_package_adds_an_environment_that_trains(tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                    "--no-build-isolation", "--target", str(site), str(ROOT / "examples" / "reverse_env")],
                   check=True, capture_output=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), "RAY_AUTH_MODE": "disabled"}

    listed = subprocess.run([sys.executable, "-m", "rl.cli", "envs"], capture_output=True, text=True, env=env,
                            check=True).stdout.split()
    assert "reverse" in listed and "arithmetic" in listed
    gym = subprocess.run([sys.executable, "-c", "import gymnasium, envs; envs.registered(); "
                          "e = gymnasium.make('rl/reverse'); print(type(e.unwrapped).__name__)"],
                         capture_output=True, text=True, env=env, check=True).stdout
    assert gym.strip() == "ReverseEnv"

    cfg = json.loads(json.dumps(TINY))
    cfg["run"] = {"iterations": 1, "eval_every": 1, "save_every": 1}
    del cfg["env"]
    cfg["envs"] = [{"name": "arithmetic", "num_train": 100, "num_eval": 8},
                   {"name": "reverse", "weight": 2, "num_train": 100, "num_eval": 8, "kwargs": {"max_len": 4}}]
    cfg["rollout"]["task_types"] = {"reverse": {"max_tokens": 6}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    run = subprocess.run([sys.executable, "-m", "rl.cli", "train", str(tmp_path / "run.yaml"), "--run-dir",
                          str(tmp_path / "run")], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rec = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert rec["env_errors"] == 0 and rec["trained_samples"] > 0
    assert "reward_mean/reverse" in rec and "reward_mean/arithmetic" in rec and "accuracy/reverse" in rec
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
