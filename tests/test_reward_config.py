"""The config's side of rewards and task sources (rl/config's ``env.reward`` and ``env.columns``, read by
rl/rollout/data.py and rl/rollout/episodes.py): an entry with ``reward`` becomes its reward environment's entry and
rewards what the run's episode runner hands it, with the tasks of the environment it names or of its task files;
columns map a dataset's own layout; hf:// ids survive config.yaml. The reward environments themselves are tested
in test_reward_function.py, test_reward_endpoint.py and test_reward_judge.py."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from datasets import Dataset

from envs.arithmetic import ArithmeticEnv
from envs.reward_endpoint import EndpointEnv
from envs.reward_judge import JudgeEnv
from rl.config import dump_config, parse_config
from rl.errors import UserError
from rl.rollout.data import EVAL_SEED, TRAIN_SEED, load_task_sets
from rl.rollout.episodes import EpisodeRunner, make_env
from rl.setup.warmstart import warmstart_key

REWARDS = '''
def exact(response, answer):
    return float(response.strip() == answer)


def ranked(prompts, responses, answers):
    """Per group: 1 for each exact answer, halved for every exact one before it."""
    out, hits = [], 0
    for response, answer in zip(responses, answers):
        right = response.strip() == answer
        out.append(0.5 ** hits if right else 0.0)
        hits += right
    return out
'''
QA = [{"question": f"What is {a} + {b}?", "solution": str(a + b), "level": a % 3} for a, b in
      [(2, 3), (7, 6), (11, 4), (9, 9), (1, 30), (8, 21)]]


@pytest.fixture(scope="module")
def rewards_py(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("rw") / "my_rewards.py"
    path.write_text(REWARDS)
    return path


def config(env: dict, **sections) -> object:
    """A config whose dump and re-read (what config.yaml holds, what a resume reads) is itself."""
    cfg = parse_config({"env": env, **sections})
    assert parse_config(yaml.safe_load(dump_config(cfg))) == cfg
    return cfg


def answers(tasks, right: set[int]) -> list[str]:
    """Responses: the answer for the tasks at ``right``, a wrong one elsewhere."""
    return [f" {t.answer}" if i in right else f"{t.answer}0" for i, t in enumerate(tasks)]


def test_a_function_grades_the_tasks_of_the_environment_it_names(rewards_py):
    spec = f"{rewards_py}:exact"
    cfg = config({"name": "arithmetic", "kwargs": {"max_steps": 1}, "reward": {"function": spec}, "num_train": 12,
                  "num_eval": 6})
    (entry,) = cfg.env_entries
    assert (entry.name, entry.kwargs, entry.reward) == ("function", {"function": spec}, None)
    assert entry.tasks_from.model_dump() == {"name": "arithmetic", "kwargs": {"max_steps": 1}}
    sets = load_task_sets(cfg)
    assert sets.train == ArithmeticEnv.generate_tasks(12, TRAIN_SEED, max_steps=1)
    seen = {t.prompt for t in sets.train}
    assert sets.eval == [t for t in ArithmeticEnv.generate_tasks(6, EVAL_SEED, max_steps=1) if t.prompt not in seen]
    runner = EpisodeRunner(cfg, workers=2)
    try:
        texts = answers(sets.train, {0, 3, 4, 9})
        results = runner.map([(entry, t, r) for t, r in zip(sets.train, texts, strict=True)])
    finally:
        runner.close()
    assert [r.error for r in results] == [None] * 12
    assert [r.reward for r in results] == [float(i in {0, 3, 4, 9}) for i in range(12)]


def test_the_warm_start_learns_the_tasks_the_named_environment_generates(rewards_py):
    """No model.path: the warm start is the one of the environment that generates the tasks (the function gives no
    solutions to learn); the same cache entry as a run of that environment alone, and one that differs otherwise."""
    graded = config({"name": "arithmetic", "kwargs": {"max_steps": 1}, "reward": {"function": f"{rewards_py}:exact"}})
    plain = config({"name": "arithmetic", "kwargs": {"max_steps": 1}})
    assert warmstart_key(graded) == warmstart_key(plain)
    assert warmstart_key(graded) != warmstart_key(config({"name": "arithmetic", "kwargs": {"max_steps": 2}}))


def test_a_group_function_grades_each_group(rewards_py):
    cfg = config({"name": "arithmetic", "reward": {"function": f"{rewards_py}:ranked"}, "num_train": 4, "num_eval": 2})
    (entry,) = cfg.env_entries
    assert entry.name == "group_function"
    sets = load_task_sets(cfg)
    runner = EpisodeRunner(cfg, workers=2)
    try:
        groups = [[f" {t.answer}", "no", f"{t.answer} ", f" {t.answer}"] for t in sets.train]
        results = runner.map_groups([(entry, t, g) for t, g in zip(sets.train, groups, strict=True)])
    finally:
        runner.close()
    assert results == [([1.0, 0.0, 0.5, 0.25], None)] * 4


class Verifier(BaseHTTPRequestHandler):
    """A reward endpoint as docs/environments.md describes it: 1 for a response equal to the item's answer;
    every request's items are kept."""

    requests: ClassVar[list[list[dict]]] = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        items = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["items"]
        self.requests.append(items)
        body = json.dumps({"rewards": [float(i["response"].strip() == i["answer"]) for i in items]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def verifier_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Verifier)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/reward"
    server.shutdown()
    server.server_close()


def test_an_endpoint_grades_through_http(verifier_url):
    cfg = config({"name": "arithmetic", "reward": {"endpoint": {"url": verifier_url, "batch_size": 4,
                                                                "timeout_s": 10, "retries": 0}},
                  "num_train": 8, "num_eval": 2})
    (entry,) = cfg.env_entries
    assert entry.name == "endpoint" and entry.kwargs["url"] == verifier_url and entry.kwargs["batch_size"] == 4
    assert isinstance(make_env(entry, cfg), EndpointEnv)
    sets = load_task_sets(cfg)
    Verifier.requests.clear()
    runner = EpisodeRunner(cfg, workers=8)
    try:
        results = runner.map([(entry, t, r) for t, r in zip(sets.train, answers(sets.train, {1, 2, 7}), strict=True)])
    finally:
        runner.close()
    assert [(r.reward, r.error) for r in results] == [(float(i in {1, 2, 7}), None) for i in range(8)]
    items = [i for request in Verifier.requests for i in request]
    assert max(len(r) for r in Verifier.requests) <= 4
    assert sorted((i["prompt"], i["answer"]) for i in items) == sorted((t.prompt, t.answer) for t in sets.train)


def test_a_judge_entry_is_a_judge_environment():
    cfg = config({"name": "arithmetic", "reward": {"judge": {"base_url": "http://127.0.0.1:8001/v1", "model": "j",
                                                             "rubric": "Is the sum right?", "scale": 5}}})
    (entry,) = cfg.env_entries
    assert entry.name == "judge" and entry.tasks_from.name == "arithmetic"
    env = make_env(entry, cfg)
    assert isinstance(env, JudgeEnv) and env.url == "http://127.0.0.1:8001/v1/chat/completions"
    assert (env.model, env.rubric, env.scale) == ("j", "Is the sum right?", 5)


@pytest.mark.parametrize("kind", ["datasets", "jsonl", "parquet"])
def test_columns_map_a_dataset_to_prompt_and_answer(rewards_py, tmp_path, kind):
    train, held_out = QA[:4], QA[4:]
    paths = []
    for name, rows in (("train", train), ("eval", held_out)):
        if kind == "datasets":
            path = tmp_path / name
            Dataset.from_list(rows).save_to_disk(str(path))
        elif kind == "jsonl":
            path = tmp_path / f"{name}.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        else:
            path = tmp_path / f"{name}.parquet"
            pq.write_table(pa.Table.from_pylist(rows), path)
        paths.append(str(path))
    cfg = config({"reward": {"function": f"{rewards_py}:exact"}, "train_tasks": paths[0], "eval_tasks": paths[1],
                  "columns": {"prompt": "question", "answer": "solution"}})
    (entry,) = cfg.env_entries
    assert entry.tasks_from is None and entry.columns == {"prompt": "question", "answer": "solution"}
    sets = load_task_sets(cfg)
    assert [(t.prompt, t.answer) for t in sets.train] == [(r["question"], r["solution"]) for r in train]
    assert [(t.prompt, t.answer) for t in sets.eval] == [(r["question"], r["solution"]) for r in held_out]
    runner = EpisodeRunner(cfg, workers=2)
    try:
        results = runner.map([(entry, t, r) for t, r in zip(sets.train, answers(sets.train, {2}), strict=True)])
    finally:
        runner.close()
    assert [r.reward for r in results] == [0.0, 0.0, 1.0, 0.0]


def test_a_column_the_file_lacks_is_one_line(rewards_py, tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in QA))
    cfg = parse_config({"env": {"reward": {"function": f"{rewards_py}:exact"}, "train_tasks": str(path),
                                "eval_tasks": str(path), "columns": {"prompt": "query", "answer": "solution"}}})
    with pytest.raises(UserError) as e:
        load_task_sets(cfg)
    assert "\n" not in str(e.value) and str(path) in str(e.value) and "query" in str(e.value)


@pytest.mark.parametrize("source", ["hf://org/name?split=train&config=main", "hf://org/name", "data/a b.parquet",
                                    "gs://bucket/tasks.jsonl"])
def test_task_sources_stay_text_through_config_yaml(source):
    cfg = config({"name": "math", "train_tasks": source, "eval_tasks": source})
    again = parse_config(yaml.safe_load(dump_config(cfg)))
    assert again.env.train_tasks == source and again.env.eval_tasks == source
    assert type(again.env.train_tasks) is str


@pytest.mark.parametrize(("env", "problem"), [
    ({"name": "arithmetic", "reward": {"function": "{f}:exact", "endpoint": {"url": "http://h"}}},
     "env.reward: Value error, give exactly one of function, endpoint, judge"),
    ({"name": "arithmetic", "reward": {}}, "env.reward: Value error, give exactly one of function, endpoint, judge"),
    ({"name": "arithmetic", "reward": {"function": "no_such_module_h42:fn"}},
     "env.reward: Value error, reward function 'no_such_module_h42:fn': cannot import no_such_module_h42"),
    ({"name": "arithmetic", "reward": {"function": "{f}:missing"}}, "has no function 'missing'"),
    ({"name": "arithmetic", "reward": {"endpoint": {"url": "ftp://h"}}},
     "env.reward.endpoint.url: String should match pattern '^https?://'"),
    ({"name": "arithmetic", "reward": {"endpoint": {"url": "http://h", "batch_size": 0}}},
     "env.reward.endpoint.batch_size: Input should be greater than or equal to 1"),
    ({"name": "arithmetic", "reward": {"judge": {"base_url": "http://h/v1"}}},
     "env.reward.judge.model: Field required"),
    ({"reward": {"function": "{f}:exact"}}, "env: Value error, with reward, the tasks come from train_tasks and "
                                            "eval_tasks (give both) or from the environment `name` names"),
    ({"reward": {"function": "{f}:exact"}, "kwargs": {"a": 1}, "train_tasks": "a", "eval_tasks": "b"},
     "(kwargs are its)"),
    ({"columns": {"question": "prompt"}}, "env.columns.question.[key]: Input should be 'id', 'prompt', 'answer'"),
])
def test_bad_reward_and_column_settings_are_one_line_each(rewards_py, env, problem):
    raw = json.loads(json.dumps(env).replace("{f}", str(rewards_py)))
    with pytest.raises(UserError) as e:
        parse_config({"env": raw})
    lines = str(e.value).splitlines()
    assert lines[0] == "invalid config <config>:" and len(lines) == 2  # the header, then one line: the problem
    assert problem.replace("{f}", str(rewards_py)) in lines[1]


def test_an_unknown_task_source_environment_is_one_line(rewards_py):
    cfg = parse_config({"env": {"name": "no_such_env_h42", "reward": {"function": f"{rewards_py}:exact"}}})
    with pytest.raises(UserError) as e:
        load_task_sets(cfg)
    assert str(e.value).startswith("env.tasks_from: ") and "no_such_env_h42" in str(e.value)
    assert "\n" not in str(e.value)
