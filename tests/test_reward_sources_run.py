"""A real short run (one iteration of test_run's TINY on the local Ray cluster) whose task mix takes its rewards from
the three sources a config can name instead of an environment, each on a task source as users bring it, unconverted:
``reward: {function: FILE.py:fn}`` on a ``datasets`` directory (``save_to_disk``, mapped by ``columns``),
``reward: {endpoint: ...}`` on verl's Parquet layout (served by examples/reward_server.py's handler, in this process),
and ``reward: {judge: ...}`` on slime's JSONL (`rl serve`'s server of the tiny judge of tests/served_judge.py).

Each source keeps what it was asked and what it answered; the run's per-type statistics in metrics.jsonl must be
what they answered, settled as the run settles rewards (a response cut off at the budget gets the penalty)."""

from __future__ import annotations

import importlib.util
import io
import json
import math
import re
import threading
from http.server import ThreadingHTTPServer
from itertools import combinations
from pathlib import Path
from typing import ClassVar

import pytest
from datasets import Dataset

import rl
from envs.arithmetic import ArithmeticEnv
from envs.reward_judge import parse_score
from rl.setup.warmstart import prepare_model
from tests.served_judge import RUBRIC
from tests.test_run import TINY

ROOT = Path(__file__).resolve().parents[1]
PENALTY = -0.5  # a response cut off at max_tokens
TASKS = ArithmeticEnv.generate_tasks(60, seed=8)
SOURCES = {"function": (TASKS[0:12], TASKS[12:14]), "endpoint": (TASKS[20:32], TASKS[32:34]),
           "judge": (TASKS[40:52], TASKS[52:54])}
REWARDS_PY = '''
import json

LOG = {log!r}


def graded(prompt, response, answer):
    """1 for the answer among the response's words, plus a hundredth per character (so rewards differ)."""
    reward = float(answer in response.split()) + len(response) / 100
    with open(LOG, "a") as f:
        f.write(json.dumps({{"prompt": prompt, "response": response, "answer": answer, "reward": reward}}) + "\\n")
    return reward
'''


def reference_handler():
    """examples/reward_server.py's handler (the examples are not a package)."""
    spec = importlib.util.spec_from_file_location("reward_server_example", ROOT / "examples" / "reward_server.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.RewardHandler


class Recorded(reference_handler()):
    """The reference endpoint, keeping each request's items and the rewards it answered."""

    answered: ClassVar[list[tuple[dict, float]]] = []
    lock = threading.Lock()

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.items = json.loads(body)["items"]
        self.rfile = io.BytesIO(body)  # the reference handler reads it again
        super().do_POST()

    def _reply(self, status, body):
        if status == 200:
            with self.lock:
                self.answered.extend(zip(self.items, body["rewards"], strict=True))
        super()._reply(status, body)


@pytest.fixture(scope="module")
def endpoint_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorded)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/reward"
    server.shutdown()
    server.server_close()


def write_sources(root: Path) -> dict[str, tuple[str, str]]:
    """Each source's train and eval tasks in its own layout: a datasets directory (columns question/solution), verl's
    Parquet (chat-message prompt, reward_model.ground_truth), slime's JSONL (chat-message prompt, label)."""
    paths = {}
    for source, splits in SOURCES.items():
        out = []
        for split, tasks in zip(("train", "eval"), splits, strict=True):
            if source == "function":
                path = root / f"qa-{split}"
                Dataset.from_list([{"question": t.prompt, "solution": t.answer, "level": 1} for t in tasks]) \
                    .save_to_disk(str(path))
            elif source == "endpoint":
                path = root / f"verl-{split}.parquet"
                Dataset.from_list([{"data_source": "arithmetic", "prompt": [{"role": "user", "content": t.prompt}],
                                    "ability": "math", "reward_model": {"style": "rule", "ground_truth": t.answer},
                                    "extra_info": {"split": split, "index": i}}
                                   for i, t in enumerate(tasks)]).to_parquet(path)
            else:
                path = root / f"slime-{split}.jsonl"
                path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": t.prompt}],
                                                    "label": t.answer, "metadata": {"index": i}}) + "\n"
                                        for i, t in enumerate(tasks)))
            out.append(str(path))
        paths[source] = tuple(out)
    return paths


@pytest.fixture(scope="module")
def mixed_run(ray_cluster, served_judge, endpoint_url, tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    log = root / "function-calls.jsonl"
    (root / "my_rewards.py").write_text(REWARDS_PY.format(log=str(log)))
    paths = write_sources(root)
    raw = json.loads(json.dumps({k: v for k, v in TINY.items() if k not in ("warmstart", "checkpoint_engine")}))
    raw["model"] = {"path": str(prepare_model(rl.parse_config(json.loads(json.dumps(TINY)))))}  # TINY's warm start
    raw["run"] = {"iterations": 1, "eval_every": 1, "save_every": 1, "eval_samples": 0, "seed": 1}
    raw["rollout"].update(prompts_per_iteration=6, truncation_penalty=PENALTY)
    raw.pop("env")
    raw["envs"] = [
        {"reward": {"function": f"{root / 'my_rewards.py'}:graded"}, "train_tasks": paths["function"][0],
         "eval_tasks": paths["function"][1], "columns": {"prompt": "question", "answer": "solution"}},
        {"reward": {"endpoint": {"url": endpoint_url, "batch_size": 4, "retries": 0}},
         "train_tasks": paths["endpoint"][0], "eval_tasks": paths["endpoint"][1]},
        {"reward": {"judge": {"base_url": served_judge.url, "model": "judge", "rubric": RUBRIC, "max_tokens": 8}},
         "train_tasks": paths["judge"][0], "eval_tasks": paths["judge"][1]},
    ]
    Recorded.answered.clear()
    served_judge.answered.clear()
    summary = rl.train(raw, root / "run")
    (record,) = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    return summary, record, calls, list(Recorded.answered), list(served_judge.answered)


def settles_to(record: dict, kind: str, rewards: list[float]) -> bool:
    """Whether the run's mean reward of ``kind`` is the source's ``rewards`` with the truncated responses (as many
    as the run's truncation rate says; which ones the sources cannot tell) given the penalty instead."""
    n = len(rewards)
    cut = round(record[f"truncation_rate/{kind}"] * n)
    want = record[f"reward_mean/{kind}"]
    return any(math.isclose((sum(rewards) - sum(c) + PENALTY * cut) / n, want, abs_tol=1e-9)
               for c in combinations(rewards, cut))


def test_a_function_an_endpoint_and_a_judge_reward_a_run(mixed_run):
    summary, record, calls, endpoint, judged = mixed_run
    assert summary["iterations"] == 1
    assert record["env_errors"] == 0 and "first_env_error" not in record
    assert record["optimizer_steps"] >= 1 and record["grad_norm"] > 0
    rollout = TINY["rollout"]
    train_prompts = {source: {t.prompt for t in tasks} for source, (tasks, _) in SOURCES.items()}

    fn = [c["reward"] for c in calls if c["prompt"] in train_prompts["function"]]
    ep = [r for item, r in endpoint if item["prompt"] in train_prompts["endpoint"]]
    jd = [parse_score(reply, 10) / 10 for request, reply in judged
          if any(f"## Prompt\n{p}\n\n" in request["messages"][0]["content"] for p in train_prompts["judge"])]
    # every sampled response was graded once by its entry's source, and each entry was drawn
    sizes = [len(fn), len(ep), len(jd)]
    assert all(n > 0 and n % rollout["samples_per_prompt"] == 0 for n in sizes), sizes
    assert sum(sizes) == 6 * rollout["samples_per_prompt"]
    # TINY's warm start ends few responses within the budget (most get the penalty, whatever the source said): some
    # must end, so that the sources' own rewards are in the statistics checked here
    assert record["truncation_rate"] < 1
    for kind, rewards in (("function", fn), ("endpoint", ep), ("judge", jd)):
        assert settles_to(record, kind, rewards), (kind, rewards, record)
    # the reference endpoint's rewards are exact matches of the last number; the function's are its formula
    for item, r in endpoint:
        numbers = re.findall(r"-?\d+(?:\.\d+)?", item["response"])
        assert r == float(bool(numbers) and float(numbers[-1]) == float(item["answer"]))
    assert all(c["reward"] == pytest.approx(float(c["answer"] in c["response"].split()) + len(c["response"]) / 100)
               for c in calls)


def test_each_layout_reached_its_source_as_it_is(mixed_run):
    """The columns of the datasets directory, verl's ground truth and chat prompt, and slime's label arrived."""
    _, _, calls, endpoint, judged = mixed_run
    answer_of = {t.prompt: t.answer for tasks in SOURCES.values() for split in tasks for t in split}
    assert all(c["answer"] == answer_of[c["prompt"]] for c in calls)
    assert {c["prompt"] for c in calls} <= {t.prompt for split in SOURCES["function"] for t in split}
    for item, _ in endpoint:
        assert item["answer"] == answer_of[item["prompt"]]
        assert item["messages"] == [{"role": "user", "content": item["prompt"]}]
        assert item["meta"]["data_source"] == "arithmetic" and item["meta"]["reward_model"]["style"] == "rule"
    for request, _ in judged:
        text = request["messages"][0]["content"]
        prompt = text.split("## Prompt\n", 1)[1].split("\n\n## Reference answer\n", 1)[0]
        assert f"## Reference answer\n{answer_of[prompt]}\n\n" in text
