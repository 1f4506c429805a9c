"""Runs that would go on wrong stop with one clear line instead: non-finite rewards and gradients, environments that
keep failing, a wall-clock budget, damaged checkpoints, machines and directories that cannot hold the run."""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from rich.console import Console

from engines.training.engine import NonFiniteError, TrainingEngine
from engines.training.optim import build_optimizers
from envs import register
from envs.arithmetic import ArithmeticEnv
from rl.cli import main as rl_main
from rl.config import load_config, parse_config
from rl.errors import TrainingStopped, UserError
from rl.loop.checkpoint import latest_checkpoint
from rl.loop.controller import train
from rl.loop.guards import Budget, check_cluster_fits, check_error_rate, check_writable
from rl.rollout.rewards import check_reward
from tests.test_run import TINY, tiny

ROOT = Path(__file__).resolve().parents[1]


class NanRewardEnv(ArithmeticEnv):
    """Arithmetic whose reward is NaN for every response."""

    task_type = "nan"

    def score(self, task, response):
        return math.nan, {}


class BrokenStepEnv(ArithmeticEnv):
    """Arithmetic whose step always raises."""

    task_type = "broken"

    def step(self, action):
        raise KeyError("the grader lost its answer key")


register("test-nan-reward", NanRewardEnv)
register("test-broken-step", BrokenStepEnv)


def mixed(name: str) -> dict:
    """TINY with a task mix whose second entry is the bad environment (the first, arithmetic, warm-starts it)."""
    raw = json.loads(json.dumps(TINY))
    del raw["env"]
    raw["run"] = {"iterations": 2, "eval_every": 2, "save_every": 2}
    raw["envs"] = [{"name": "arithmetic", "num_train": 100, "num_eval": 8},
                   {"name": name, "weight": 50, "num_train": 100, "num_eval": 8}]
    return raw


@pytest.mark.parametrize(("name", "message"), [
    ("test-nan-reward", "environment 'test-nan-reward' returned a non-finite reward (nan) for task"),
    pytest.param("test-broken-step", "episodes failed in their environment this iteration", marks=pytest.mark.slow),
])
def test_bad_environments_stop_the_run_with_one_line(ray_cluster, tmp_path, capsys, name, message):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(mixed(name)))
    code = rl_main(["train", str(cfg), "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 1 and message in err and "Traceback" not in err, err
    if name == "test-broken-step":
        assert "the grader lost its answer key" in err and "test-broken-step" in err
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing half-done was saved


def test_a_non_finite_gradient_skips_the_step(tiny_model):
    engine = TrainingEngine(tiny_model, build_optimizers(tiny_model, "adamw", 1e-3, 0.0), pad_id=0)
    before = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    for p in tiny_model.parameters():
        p.grad = torch.full_like(p, math.nan)
    with pytest.raises(NonFiniteError, match="gradient norm is nan"):
        engine.step()
    assert all(torch.equal(v, tiny_model.state_dict()[k]) for k, v in before.items())
    assert all(p.grad is None for p in tiny_model.parameters())


def test_reward_and_error_rate_checks():
    assert check_reward(1, "e", "t") == 1.0
    for bad in (math.nan, math.inf, "1.0x", None):
        with pytest.raises(TrainingStopped, match="environment 'math' returned .* for task t-7"):
            check_reward(bad, "math", "t-7")
    check_error_rate({"env_errors": 5, "trained_samples": 5, "first_env_error": "x"}, 0.5)  # half: goes on
    with pytest.raises(TrainingStopped, match="6 of 10 episodes failed .* the first: boom"):
        check_error_rate({"env_errors": 6, "trained_samples": 4, "first_env_error": "boom"}, 0.5)
    assert not Budget(None).reached() and Budget(1.0, spent_s=61).reached() and not Budget(1.0).reached()


def test_wall_clock_budget_then_resume_past_a_damaged_checkpoint(ray_cluster, tmp_path):
    """run.max_minutes ends the run after the iteration that reaches it, with a checkpoint, a measured final model
    and the summary; resuming past a checkpoint whose weights were cut short falls back to the one before."""
    run = tmp_path / "run"
    summary = train(tiny(run={"iterations": 20, "eval_every": 10, "save_every": 10, "max_minutes": 1e-4}), run)
    assert summary["stopped_by"] == "max_minutes" and summary["iterations"] == 1
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["accuracy"] is not None and (run / "final" / "model.safetensors").is_file()
    assert latest_checkpoint(run)[1].iteration == 0
    (run / "config.yaml").write_text(yaml.safe_dump({**yaml.safe_load((run / "config.yaml").read_text()),
                                                     "run": {**TINY["run"], "iterations": 2, "save_every": 1}}))
    train(load_config(run / "config.yaml"), run, resume=True)
    weights = run / "checkpoints" / "iter_000001" / "model.safetensors"
    with open(weights, "r+b") as f:  # a crash or full disk mid-copy: the file is cut short
        f.truncate(weights.stat().st_size // 2)
    out = io.StringIO()
    summary = train(load_config(run / "config.yaml", ["run.iterations=3"]), run, resume=True,
                    console=Console(file=out, width=200))
    assert "skipped damaged checkpoint(s) iter_000001 (model.safetensors is cut short" in out.getvalue()
    assert "resuming from iter_000000" in out.getvalue()
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1, 2] and summary["iterations"] == 3


def test_more_workers_than_cores_is_refused_up_front(tmp_path, capsys):
    cfg = parse_config({"cluster": {"workers": (os.cpu_count() or 1) + 64}})
    with pytest.raises(UserError, match=r"cluster\.workers=\d+ needs \d+ CPU cores on this machine, which has"):
        check_cluster_fits(cfg)
    assert "needs 512 CPU cores" in _cli_error(capsys, "train", str(ROOT / "configs/quickstart.yaml"), "--set",
                                               "cluster.workers=512", "--run-dir", str(tmp_path / "r"))


def test_workers_given_gpus_without_cuda_stop_instead_of_training_on_the_host(monkeypatch):
    from rl.loop.workers import worker_device
    from rl.settings import for_model
    from rl.setup.warmstart import prepare_model

    settings = for_model(parse_config({**TINY, "cluster": {"workers": 1, "gpus_per_worker": 1}}), prepare_model(
        parse_config(TINY)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a node whose driver is older than the wheel
    with pytest.raises(UserError, match=r"gpus_per_worker=1 but CUDA is not available.*driver"):
        worker_device(settings.trainer.device, settings.trainer.gpus)
    assert worker_device("cpu", 0) == "cpu"  # no GPUs asked: the host


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a read-only or tiny file system for the test needs root")
@pytest.mark.parametrize(("opts", "why"), [("ro", "Read-only file system"), ("size=8k", "No space left on device")])
def test_read_only_or_full_run_directory(tmp_path, capsys, opts, why):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "none", str(mnt)], check=True)
    try:
        if opts.startswith("size"):  # fill it
            with open(mnt / "filler", "wb") as f, pytest.raises(OSError):
                f.write(b"x" * 16384)
                f.flush()
        with pytest.raises(UserError, match=f"cannot write the run directory .*{why}"):
            check_writable(mnt / "run")
        assert why in _cli_error(capsys, "train", str(ROOT / "configs/quickstart.yaml"), "--run-dir", str(mnt / "run"))
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def _cli_error(capsys, *args: str) -> str:
    """``rl`` run in this process (the entry point's own wrapping is checked once, in a subprocess, below): the
    exit status must be 2 and stderr the error alone; returns it."""
    capsys.readouterr()
    assert rl_main(list(args)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err, err
    return err


def test_config_and_tokenizer_errors_are_one_line(tmp_path, capsys):
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    run_dir = ("--run-dir", str(tmp_path / "r"))
    proc = subprocess.run([sys.executable, "-m", "rl.cli", "train", str(binary), *run_dir], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and "is not text" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    for sets, fragment in (("sandbox.limits.wall_s=.nan", "sandbox.limits.wall_s: Input should be a finite number"),
                           ("run.max_minutes=.inf", "run.max_minutes: Input should be a finite number"),
                           ("rollout.max_tokens=100000", "leaves no room for a prompt")):
        assert fragment in _cli_error(capsys, "train", str(ROOT / "configs/quickstart.yaml"), "--set", sets, *run_dir)
    # a model directory whose tokenizer has no EOS token: responses could never end
    from tests.test_run import _qwen_format_dir

    model = tmp_path / "qwen"
    _qwen_format_dir(model, [t.prompt + t.meta["solution"] for t in ArithmeticEnv.generate_tasks(50, seed=3)])
    for name in ("generation_config.json",):
        (model / name).unlink()
    tok_cfg = json.loads((model / "tokenizer_config.json").read_text())
    tok_cfg["eos_token"] = None
    (model / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    cfg_json = json.loads((model / "config.json").read_text())
    cfg_json.pop("eos_token_id", None)
    (model / "config.json").write_text(json.dumps(cfg_json))
    assert "no EOS token" in _cli_error(capsys, "train", str(ROOT / "configs/quickstart.yaml"), "--set",
                                        f"model.path={model}", "--run-dir", str(tmp_path / "q"))


def test_prompts_longer_than_the_context_are_refused_at_start(tmp_path):
    from rl.rollout.data import load_task_sets, rollout_seq_len
    from rl.setup.warmstart import prepare_model

    tasks = tmp_path / "long.jsonl"
    rows = [{"id": f"t{i}", "prompt": "Question: " + "apples " * (5 if i else 400), "answer": "1"} for i in range(8)]
    tasks.write_text("".join(json.dumps(r) + "\n" for r in rows))
    held_out = tmp_path / "eval.jsonl"
    held_out.write_text("".join(json.dumps({"id": f"e{i}", "prompt": f"Question: {i} pears", "answer": "1"}) + "\n"
                                for i in range(8)))
    cfg = tiny(env={"train_tasks": str(tasks), "eval_tasks": str(held_out)})
    from engines.model.text.tokenizer import TextTokenizer

    tok = TextTokenizer.load(prepare_model(cfg))
    with pytest.raises(UserError, match=r"1 of 16 prompts do not fit the model's context .* task 't0'"):
        rollout_seq_len(cfg, load_task_sets(cfg), tok, 128)


def test_env_errors_and_slow_task_generation_show_on_the_console(tmp_path, monkeypatch):
    from rl.loop.metrics import MetricsLog
    from rl.rollout import data

    out = io.StringIO()
    log = MetricsLog(tmp_path, Console(file=out, width=300))
    log.record({"iteration": 3, "reward_mean": 0.1, "accuracy": None, "response_len": 5.0, "truncation_rate": 0.0,
                "temperature": 1.0, "env_errors": 2, "first_env_error": "env 'code', task t1: RuntimeError: boom"})
    assert "env-errors 2 (first: env 'code', task t1: RuntimeError: boom)" in out.getvalue()
    monkeypatch.setattr(data, "SLOW_GENERATION_S", 0.0)
    out = io.StringIO()
    data.load_task_sets(tiny(), Console(file=out, width=200))
    assert "env 'arithmetic': generated 200 train tasks in" in out.getvalue()
