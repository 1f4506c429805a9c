"""The Python API (rl/api.py, exported lazily by rl/__init__.py): ``rl.train`` from a dict with a Python reward
function (a closure, registered as ``python:QUALNAME``) and task lists runs a real tiny run on the local Ray cluster
(the model of test_run's TINY, so a session warms it up once), with TensorBoard and MLflow as its trackers, and
resumes with the function given again; bad arguments are one line before anything starts; ``import rl`` and
``import rl.cli`` stay light."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import rl
from envs.arithmetic import ArithmeticEnv
from rl.errors import UserError
from rl.setup.warmstart import prepare_model
from tests.test_run import TINY

ROOT = Path(__file__).resolve().parents[1]
REWARD, PENALTY = 0.75, -0.5  # every response the function grades; a response cut off at max_tokens
TASKS = [{"prompt": t.prompt, "answer": t.answer} for t in ArithmeticEnv.generate_tasks(40, seed=3)]
TRAIN, HELD_OUT = TASKS[:32], TASKS[32:36]


def make_reward(calls: list[tuple[str, str, str]]):
    """A reward function defined in a function (no module can import it by name), keeping what it was asked."""
    def reward(prompt: str, response: str, answer: str) -> float:
        calls.append((prompt, response, answer))
        return REWARD

    return reward


def raw_config(model_dir: Path) -> dict:
    raw = json.loads(json.dumps({k: v for k, v in TINY.items() if k not in ("warmstart", "checkpoint_engine")}))
    raw["model"] = {"path": str(model_dir)}
    raw["run"] = {"iterations": 1, "eval_every": 1, "save_every": 1, "eval_samples": 0}
    raw["rollout"].update(max_tokens=8, truncation_penalty=PENALTY)
    raw["metrics"] = {"loggers": ["tensorboard", "mlflow"], "project": "api"}
    return raw


@pytest.fixture(scope="module")
def api_run(ray_cluster, model_dir, tmp_path_factory):
    """One iteration by rl.train, then a resume to two with the function passed again."""
    run_dir = tmp_path_factory.mktemp("api") / "run"
    mp = pytest.MonkeyPatch()
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)  # MLflow's file store in the run directory
    calls: list[tuple[str, str, str]] = []
    fn = make_reward(calls)
    first = rl.train(raw_config(model_dir), run_dir, reward=fn, train_tasks=TRAIN, eval_tasks=HELD_OUT)
    after_first = len(calls)
    second = rl.train(run_dir=run_dir, resume=True, reward=fn, overrides={"run.iterations": 2})
    mp.undo()
    return run_dir, first, second, calls, after_first


def training_calls(calls):
    train_prompts = {t["prompt"] for t in TRAIN}
    return [c for c in calls if c[0] in train_prompts]


def test_a_dict_a_closure_and_task_lists_run(api_run):
    run_dir, first, _, calls, after_first = api_run
    assert first["iterations"] == 1
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["env"]["name"] == "python:make_reward.locals.reward"
    assert config["env"]["train_tasks"] == str(run_dir / "tasks" / "env-train.jsonl")
    written = [json.loads(line) for line in Path(config["env"]["train_tasks"]).read_text().splitlines()]
    assert written == TRAIN
    # the function graded every sampled response of the iteration, with the answers of the tasks given
    rollout = TINY["rollout"]
    graded = training_calls(calls[:after_first])
    assert len(graded) == rollout["prompts_per_iteration"] * rollout["samples_per_prompt"]
    answer_of = {t["prompt"]: t["answer"] for t in TASKS}
    assert all(answer == answer_of[prompt] for prompt, _, answer in calls)
    assert {c[0] for c in calls} - {t["prompt"] for t in TRAIN} <= {t["prompt"] for t in HELD_OUT}
    (rec,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][:1]
    tr = rec["truncation_rate"]
    assert rec["reward_mean"] == pytest.approx(REWARD * (1 - tr) + PENALTY * tr)


def test_a_resume_with_the_function_again_continues(api_run):
    run_dir, _, second, calls, after_first = api_run
    assert second["iterations"] == 2
    assert json.loads((run_dir / "summary.json").read_text()) == second
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [0, 1]
    rollout = TINY["rollout"]
    assert len(training_calls(calls[after_first:])) == rollout["prompts_per_iteration"] * rollout["samples_per_prompt"]


def test_the_trackers_get_the_runs_metrics_across_the_resume(api_run):
    """metrics.loggers in a real run: TensorBoard's events and the one MLflow run (continued by the resume) hold
    each iteration's reward_mean as metrics.jsonl has it, and the summary at the end."""
    import os

    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _, second, _, _ = api_run
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    want = [(r["iteration"], r["reward_mean"]) for r in records]
    ea = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    ea.Reload()
    got = ea.Scalars("reward_mean")
    assert [e.step for e in got] == [0, 1]
    assert [e.value for e in got] == pytest.approx([v for _, v in want])
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient((run_dir / "mlruns").absolute().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("api").experiment_id])
    assert run.info.run_id == json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "reward_mean"))
    assert history == want
    assert run.data.metrics["summary.iterations"] == second["iterations"] == 2


def test_a_resume_without_the_function_is_one_line(api_run):
    run_dir = api_run[0]
    out = subprocess.run([sys.executable, "-c", f"import rl; rl.train(run_dir={str(run_dir)!r}, resume=True)"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1] == (
        "rl.errors.UserError: env.name 'python:make_reward.locals.reward' is a Python reward function given to "
        "rl.train: pass it again (rl.train(..., reward=fn)) to run this config")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"config": 42}, "rl.train: config must be a Config, a dict or a YAML path, got int"),
    ({"train_tasks": [{"prompt": "1 + 1 =", "answer": "2"}, "3 + 4 ="]},
     "env-train: task 1 is a str; give dicts (task records) or envs.Task objects"),
    ({"train_tasks": 7}, "env-train: give a path, a list of task records or a datasets.Dataset, not int"),
    ({"reward": lambda text, gold: 1.0, "train_tasks": TRAIN, "eval_tasks": HELD_OUT},
     "reward: reward function '<lambda>': parameter 'text' is not one it can be given"),
    ({"reward": make_reward([])}, "env: with reward, the tasks come from train_tasks and eval_tasks (give both) or "
                                  "from the environment `name` names"),
    ({"resume": True}, "resume: "),
    ({"resume": True, "train_tasks": TRAIN}, "resume: the run's tasks are those its config.yaml names"),
    ({"config": {"envs": [{"name": "arithmetic"}]}, "train_tasks": TRAIN},
     "rl.train's reward, train_tasks and eval_tasks are the single env's; with a task mix (envs) give them in each "
     "entry"),
])
def test_bad_arguments_are_one_line(tmp_path, kwargs, message):
    kwargs = {"config": {}, **kwargs}
    if kwargs.get("resume") and "train_tasks" in kwargs:  # a run directory, so the tasks are what is refused
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / "config.yaml").write_text("{}\n")
    with pytest.raises(UserError) as e:
        rl.train(run_dir=tmp_path / "run", **kwargs)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_rl_exports_lazily_and_the_cli_imports_no_torch():
    code = ("import sys, rl, rl.cli\n"
            "assert 'torch' not in sys.modules and 'ray' not in sys.modules and 'rl.api' not in sys.modules\n"
            "from rl import Config, train, parse_config, load_config\n"
            "import rl.api, rl.config\n"
            "assert train is rl.api.train and Config is rl.config.Config and parse_config is rl.config.parse_config\n"
            "assert 'torch' not in sys.modules\n"
            "try:\n    rl.no_such_name\nexcept AttributeError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "module 'rl' has no attribute 'no_such_name'"
    assert sorted(rl.__all__) == ["Config", "load_config", "parse_config", "train"]


def test_the_quick_start_runs_its_first_iteration_from_python(ray_cluster, model_dir, tmp_path):
    """rl.train on configs/quickstart.yaml, made small by overrides: its objective (K1.5, tau 0.2), Muon, packed
    micro-batches and constant temperature run an iteration with an optimizer step. The quick start's own warm start
    (260 SFT steps of its default model) takes minutes to build, so the run takes test_run's TINY warm start (the
    same cache entry as model_dir's) and a truncation penalty; the rest of the config is the quick start's, as
    config.yaml records."""
    small = {"warmstart": TINY["warmstart"], "env.num_train": 200, "env.num_eval": 8, "run.iterations": 1,
             "run.eval_every": 1, "run.save_every": 1, "run.eval_samples": 0,
             "rollout.prompts_per_iteration": 4, "rollout.samples_per_prompt": 4,
             # TINY's warm start answers no sum right: a response cut off at the budget is what makes a group's
             # rewards differ, so that a group is trained on (equal ones are left out) and the optimizer steps
             "rollout.truncation_penalty": -0.5}
    summary = rl.train(ROOT / "configs" / "quickstart.yaml", tmp_path / "qs", overrides=small)
    assert summary["iterations"] == 1 and Path(summary["final_model"]).is_dir()
    want = rl.load_config(ROOT / "configs" / "quickstart.yaml", [f"{k}={json.dumps(v)}" for k, v in small.items()])
    assert rl.parse_config(yaml.safe_load((tmp_path / "qs" / "config.yaml").read_text())) == want
    assert (want.optimizer.kind, want.algorithm.tau, want.run.name) == ("muon", 0.2, "quickstart")
    assert prepare_model(want) == model_dir  # the cached warm start, not a new one
    (record,) = [json.loads(line) for line in (tmp_path / "qs" / "metrics.jsonl").read_text().splitlines()]
    assert record["optimizer_steps"] >= 1 and record["grad_norm"] > 0 and record["env_errors"] == 0


def test_the_notebook_example_calls_the_api_as_documented():
    """examples/python_api.py (cells a notebook runs; running it builds the quick start's warm start, minutes here):
    its rl.train calls take only rl.train's parameters, its overrides are valid on the quick start's config, its
    reward function is one the function environment accepts and grades as it says, and the docs link it."""
    import ast
    import inspect

    from envs import Task, make

    source = (ROOT / "examples" / "python_api.py").read_text()
    calls = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)
             and ast.unparse(n.func) == "rl.train"]
    assert len(calls) == 2
    params = inspect.signature(rl.train).parameters
    assert all(k.arg in params for call in calls for k in call.keywords)
    quick = {k.arg: k.value for k in calls[0].keywords}
    assert ast.literal_eval(calls[0].args[0]) == "configs/quickstart.yaml"
    overrides = ast.literal_eval(ast.unparse(quick["overrides"]).replace("ITERATIONS", "5"))
    cfg = rl.load_config(ROOT / "configs" / "quickstart.yaml", [f"{k}={v}" for k, v in overrides.items()])
    assert cfg.run.iterations == cfg.run.eval_every == 5
    (cell,) = [c for c in source.split("# %%") if "def exact" in c]
    namespace: dict = {}
    exec(cell.split("\n\n\ntasks = ")[0], namespace)  # the function's cell up to its data (no run)
    env = make("function", function=namespace["exact"])
    assert [env.score(Task("t", "2 + 3 =", "5"), r)[0] for r in (" 5 apples", "apples 5", "", "55")] == [1, 0, 0, 0]
    assert "examples/python_api.py" in (ROOT / "docs" / "python-api.md").read_text()
