"""A third-party environment package, made of exactly the two files the README shows, is installed with pip and
trains on its own with the default model (its tasks' solutions warm-start it) and in a task mix with a built-in
environment; a broken plug-in beside it is skipped with a warning naming it."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.test_run import TINY

ROOT = Path(__file__).resolve().parents[1]


def readme_block(marker: str) -> str:
    """The fenced block of the README's environment section that starts with the comment ``marker``."""
    text = (ROOT / "README.md").read_text()
    m = re.search(r"```\w+\n# " + re.escape(marker) + r"\n(.*?)```", text, re.DOTALL)
    assert m, f"README has no block for {marker}"
    return m.group(1)


def install(tmp_path: Path) -> dict:
    """The README's package and a broken plug-in, installed into a target directory; the environment to use it."""
    pkg = tmp_path / "reverse_env"
    pkg.mkdir()
    (pkg / "rl_reverse_env.py").write_text(readme_block("rl_reverse_env.py"))
    (pkg / "pyproject.toml").write_text(readme_block("pyproject.toml"))
    broken = tmp_path / "broken_env"
    broken.mkdir()
    (broken / "rl_broken_env.py").write_text("raise ImportError('no module named quantum_chess')\n")
    (broken / "pyproject.toml").write_text(readme_block("pyproject.toml").replace("rl-reverse-env", "rl-broken-env")
                                           .replace('reverse = "rl_reverse_env:ReverseEnv"',
                                                    'chess = "rl_broken_env:ChessEnv"')
                                           .replace("rl_reverse_env", "rl_broken_env"))
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                    "--no-build-isolation", "--target", str(site), str(pkg), str(broken)],
                   check=True, capture_output=True, timeout=300)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), "RAY_AUTH_MODE": "disabled"}


def train(tmp_path: Path, env: dict, name: str, envs: list) -> dict:
    cfg = json.loads(json.dumps(TINY))
    cfg["run"] = {"iterations": 1, "eval_every": 1, "save_every": 1}
    del cfg["env"]
    cfg["envs"] = envs
    cfg["rollout"]["task_types"] = {"reverse": {"max_tokens": 6}}
    (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    run = subprocess.run([sys.executable, "-m", "rl.cli", "train", str(tmp_path / f"{name}.yaml"), "--run-dir",
                          str(tmp_path / name)], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / name / "final" / "model.safetensors").is_file()
    return json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[-1])


@pytest.mark.slow
def test_the_readme_plugin_installs_and_trains(tmp_path):
    env = install(tmp_path)
    listed = subprocess.run([sys.executable, "-m", "rl.cli", "envs"], capture_output=True, text=True, env=env)
    assert listed.returncode == 0, listed.stderr
    rows = {line.split()[0]: line.split()[1] for line in listed.stdout.splitlines()}
    assert rows["reverse"] == "plug-in" and rows["arithmetic"] == "built-in" and "chess" not in rows
    assert "'chess'" in listed.stderr and "no module named quantum_chess" in listed.stderr
    assert "Reverse a word" in listed.stdout

    gym = subprocess.run([sys.executable, "-c", "import gymnasium, envs; e = gymnasium.make('rl/reverse'); "
                          "print(type(e.unwrapped).__name__)"], capture_output=True, text=True, env=env, check=True)
    assert gym.stdout.strip() == "ReverseEnv"

    # alone, with the default model: the README's tasks carry the solutions its warm start needs
    rec = train(tmp_path, env, "alone", [{"name": "reverse", "num_train": 200, "num_eval": 8}])
    assert rec["env_errors"] == 0 and rec["trained_samples"] > 0
    rec = train(tmp_path, env, "mix", [{"name": "arithmetic", "num_train": 100, "num_eval": 8},
                                       {"name": "reverse", "weight": 2, "num_train": 100, "num_eval": 8}])
    assert rec["env_errors"] == 0 and rec["trained_samples"] > 0
    assert "reward_mean/reverse" in rec and "reward_mean/arithmetic" in rec and "accuracy/reverse" in rec

    used = subprocess.run([sys.executable, "-m", "rl.cli", "train", str(tmp_path / "alone.yaml"), "--set",
                           "envs=[{name: chess}]", "--run-dir", str(tmp_path / "chess")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert used.returncode == 2 and "plug-in 'chess' failed to import" in used.stderr, used.stderr
    assert "Traceback" not in used.stderr
