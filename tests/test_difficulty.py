"""Prompt-set curation by pass rate (report 3.2.1) with the real engine and environment."""

import json
import subprocess
import sys

import yaml

from envs import Env, Task, register
from envs.arithmetic import ArithmeticEnv
from envs.tasks import load_tasks
from rl.config import parse_config
from rl.setup.difficulty import filter_by_difficulty, pass_rates
from rl.setup.warmstart import prepare_model
from tests.test_run import TINY


class EvenLength(Env):
    """Reward 1 when the response has an even number of characters: sampled responses pass some of the time."""

    def score(self, task, response):
        return float(len(response) % 2 == 0), {}

    @classmethod
    def generate_tasks(cls, n, seed):
        return [Task(f"e-{seed}-{i}", f"Say something {seed}-{i}.", "") for i in range(n)]


register("even-length-test", EvenLength)


def test_filter_keeps_moderate_prompts_and_records_their_pass_rate(tmp_path):
    model = prepare_model(parse_config(TINY))
    cfg = parse_config({**TINY, "model": {"path": str(model)}, "env": {"name": "even-length-test"},
                        "rollout": {**TINY["rollout"], "max_tokens": 8}})
    every = filter_by_difficulty(cfg, tmp_path / "all.jsonl", k=4, min_pass=0.0, max_pass=1.0, limit=24)
    assert every["kept"] == every["prompts"] == 24
    rates = [t.meta["pass_rate"] for t in load_tasks(tmp_path / "all.jsonl")]
    assert set(rates) <= {0.0, 0.25, 0.5, 0.75, 1.0} and len(set(rates)) > 1  # the band below is not trivial
    band = filter_by_difficulty(cfg, tmp_path / "band.parquet", k=4, min_pass=0.25, max_pass=0.75, limit=24)
    kept = load_tasks(tmp_path / "band.parquet")
    assert band["kept"] == len(kept) == sum(0.25 <= r <= 0.75 for r in rates)
    assert band["too_easy"] == sum(r > 0.75 for r in rates) and band["too_hard"] == sum(r < 0.25 for r in rates)
    assert all(0.25 <= t.meta["pass_rate"] <= 0.75 for t in kept)


def test_reference_solutions_always_pass_and_wrong_answers_never(tmp_path):
    """pass_rates against an independent fact: greedy decoding of a model that was never trained still gets
    scored by the environment, and a task whose answer cannot be produced has pass rate 0."""
    cfg = parse_config(TINY)
    model_dir = prepare_model(cfg)
    tasks = ArithmeticEnv.generate_tasks(4, seed=5)
    impossible = [t.__class__(t.id, t.prompt, "not a number", t.meta) for t in tasks]
    assert pass_rates(cfg, model_dir, impossible, [cfg.env] * 4, k=2) == [0.0] * 4


def test_cli_filter_tasks(tmp_path):
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(json.loads(json.dumps(TINY))))
    r = subprocess.run([sys.executable, "-m", "rl.cli", "filter-tasks", str(tmp_path / "c.yaml"), "--out",
                        str(tmp_path / "f.jsonl"), "--k", "2", "--limit", "8", "--min-pass", "0", "--max-pass", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "kept 8 of 8 prompts" in r.stdout, r.stderr[-2000:]
    bad = subprocess.run([sys.executable, "-m", "rl.cli", "filter-tasks", str(tmp_path / "c.yaml"), "--out",
                          str(tmp_path / "g.jsonl"), "--min-pass", "0.9", "--max-pass", "0.1"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "min_pass" in bad.stderr
