"""Config validation and the CLI's handling of bad input: one clear message, non-zero exit."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl.config import load_config, parse_config
from rl.errors import UserError
from rl.settings import task_types

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_config_is_valid():
    cfg = load_config(ROOT / "configs" / "quickstart.yaml")
    assert cfg.env.name == "arithmetic" and cfg.optimizer.kind == "muon"


def test_unknown_key_is_named():
    with pytest.raises(UserError, match=r"rollout\.max_tokenz: unknown key"):
        parse_config({"rollout": {"max_tokenz": 3}})


def test_bad_value_names_key_and_constraint():
    with pytest.raises(UserError, match=r"algorithm\.tau: Input should be greater than 0 \(got -1\)"):
        parse_config({"algorithm": {"tau": -1}})
    with pytest.raises(UserError, match=r"optimizer\.kind: Input should be 'muon' or 'adamw'"):
        parse_config({"optimizer": {"kind": "sgd"}})


def test_algorithm_sections_validate():
    cfg = parse_config({"cluster": {"workers": 2}, "optimizer": {"qk_clip_tau": None},
                        "rollout": {"partial": {"token_budget": 5000, "max_age": 1},
                                    "task_types": {"math": {"max_tokens": 64}}}})
    assert cfg.cluster.workers == 2 and cfg.optimizer.qk_clip_tau is None
    types = task_types(cfg)
    assert types.get("math").max_tokens == 64 and types.get("code").max_tokens == cfg.rollout.max_tokens
    with pytest.raises(UserError, match=r"algorithm: Value error, ptx.coef > 0 needs ptx.data"):
        parse_config({"algorithm": {"ptx": {"coef": 0.1}}})
    with pytest.raises(UserError, match=r"rollout\.task_types\.math\.max_tokens: Input should be greater"):
        parse_config({"rollout": {"task_types": {"math": {"max_tokens": 0}}}})
    with pytest.raises(UserError, match=r"rollout\.partial\.token_budget: Input should be greater"):
        parse_config({"rollout": {"partial": {"token_budget": 0}}})


def test_ptx_file_errors_name_the_line(tmp_path):
    from rl.rollout.ptx import load_ptx

    good = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
    f = tmp_path / "ptx.jsonl"
    f.write_text(json.dumps(good) + "\n" + json.dumps({"prompt": "a", "response": "b"}) + "\n")
    samples = load_ptx(f)
    assert samples[0].prompt == "user: 2+2?\nassistant:" and samples[0].response == " 4"
    assert (samples[1].prompt, samples[1].response) == ("a", "b")
    f.write_text(json.dumps(good) + "\n" + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(UserError, match=r"ptx.jsonl:2: the last message must be the assistant's reply"):
        load_ptx(f)
    f.write_text("{not json\n")
    with pytest.raises(UserError, match=r"ptx.jsonl:1: not valid JSON"):
        load_ptx(f)
    with pytest.raises(UserError, match="does not exist"):
        load_ptx(tmp_path / "missing.jsonl")


def test_overrides_are_parsed_as_yaml():
    cfg = parse_config({}, overrides=["run.iterations=7", "rollout.temperature.schedule=linear"])
    assert cfg.run.iterations == 7 and cfg.rollout.temperature.schedule == "linear"
    with pytest.raises(UserError, match="must look like section.key=value"):
        parse_config({}, overrides=["run.iterations"])


def _rl(*args, cwd=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "rl.cli", *args], capture_output=True, text=True,
                          cwd=cwd or ROOT, env=env, timeout=120)


def _assert_user_error(proc, fragment):
    assert proc.returncode == 2, proc.stderr
    assert fragment in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_missing_config(tmp_path):
    _assert_user_error(_rl("train", str(tmp_path / "nope.yaml")), "does not exist")


def test_cli_malformed_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed\n")
    _assert_user_error(_rl("train", str(bad)), "is not valid YAML")


def test_cli_unknown_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run:\n  iteratons: 3\n")
    _assert_user_error(_rl("train", str(bad)), "run.iteratons: unknown key")


def test_cli_unregistered_environment(tmp_path):
    _assert_user_error(_rl("train", str(ROOT / "configs/quickstart.yaml"), "--set", "env.name=chess",
                           "--run-dir", str(tmp_path / "r")), "environment 'chess' is not registered")


def test_cli_model_dir_without_config_json(tmp_path):
    _assert_user_error(_rl("train", str(ROOT / "configs/quickstart.yaml"), "--set", f"model.path={tmp_path}",
                           "--run-dir", str(tmp_path / "r")), "has no config.json")


def test_cli_malformed_task_file(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"prompt": "1+1?", "answer": "2"}) + "\n" + '{"prompt": 3}\n')
    _assert_user_error(_rl("train", str(ROOT / "configs/quickstart.yaml"), "--set", f"env.train_tasks={tasks}",
                           "--run-dir", str(tmp_path / "r")), "tasks.jsonl:2: missing field 'answer'")


def test_cli_resume_without_checkpoint(tmp_path):
    _assert_user_error(_rl("train", "--resume", str(tmp_path)), "is not a run directory")


def test_cli_help_lists_commands():
    out = _rl("--help")
    assert out.returncode == 0 and "train" in out.stdout and "check-config" in out.stdout
