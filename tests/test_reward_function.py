"""Rewards from plain Python functions (envs/reward_function.py): per response and per group, sync and async,
named by module or by file, in this project's, verl's and TRL's signatures; failures are errors, never rewards."""

from __future__ import annotations

import sys
import warnings

import pytest
from datasets import Dataset
from gymnasium.utils.env_checker import check_env

from envs import Task, make
from envs.reward_function import FunctionEnv, GroupFunctionEnv, RewardFunctionError, reward_function_env

TASKS = [Task("t1", "What is 2 + 3?", "5"), Task("t2", "What is 7 * 6?", "42"),
         Task("t3", "Greet me.", "", messages=[{"role": "system", "content": "Be kind."},
                                              {"role": "user", "content": "Greet me."}])]

REWARDS_PY = '''
import asyncio, math

def exact(prompt, response, answer, **info):
    return float(response.strip().split()[-1] == answer) if response.strip() else 0.0

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # verl's signature; a dict with "score" as verl allows
    hit = solution_str.strip().endswith(str(ground_truth))
    return {"score": 1.0 if hit else 0.0, "acc": hit, "source": data_source, "index": extra_info["index"]}

async def slow_length(response, answer):
    await asyncio.sleep(0.01)
    return len(response) / 10

def ranked(prompts, responses, answers):
    order = sorted(range(len(responses)), key=lambda i: len(responses[i]))
    return [order.index(i) / max(1, len(responses) - 1) for i in range(len(responses))]

async def async_ranked(prompts, responses, answers):
    await asyncio.sleep(0.01)
    return ranked(prompts, responses, answers)

SEEN = []

def trl_style(completions, prompts, answer, **kwargs):
    SEEN.append({"completions": completions, "prompts": prompts, "answer": answer, "kwargs": sorted(kwargs)})
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [float(t == a) for t, a in zip(texts, answer)]

def broken(response):
    raise KeyError("no such column")

def nan(response):
    return math.nan

def text(response):
    return "high"

def short(responses):
    return [1.0]
'''


@pytest.fixture(scope="module")
def rewards_py(tmp_path_factory):
    path = tmp_path_factory.mktemp("fn") / "my_rewards.py"
    path.write_text(REWARDS_PY)
    return path


def env_of(spec: str, group: bool = False):
    return (GroupFunctionEnv if group else FunctionEnv)(function=spec)


def test_per_response_function_from_a_file(rewards_py):
    env = make("function", function=f"{rewards_py}:exact")
    assert env.task_type == "function" and not env.group_level
    for task, response, want in [(TASKS[0], "It is 5", 1.0), (TASKS[0], "It is 6", 0.0), (TASKS[1], "42", 1.0)]:
        env.reset(options={"task": task})
        assert env.step(response)[1:4] == (want, True, False)


def test_a_module_function_and_a_python_callable(tmp_path, monkeypatch):
    (tmp_path / "grading_pkg").mkdir()
    (tmp_path / "grading_pkg" / "__init__.py").write_text("def ends(response, answer):\n"
                                                           "    return float(response.endswith(answer))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert env_of("grading_pkg:ends").score(TASKS[1], "so 42")[0] == 1.0
    assert FunctionEnv(function=lambda response: len(response)).score(TASKS[0], "abc")[0] == 3.0


def test_verl_compute_score_on_verl_data(rewards_py, tmp_path):
    from envs.tasks import load_tasks

    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": "2 + 3?"}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": "5"}, "extra_info": {"index": 7, "split": "train"}}]
    Dataset.from_list(rows).to_parquet(tmp_path / "verl.parquet")
    (task,) = load_tasks(tmp_path / "verl.parquet")
    env = env_of(f"{rewards_py}:compute_score")
    assert env.score(task, "The answer is 5")[0] == 1.0 and env.score(task, "The answer is 4")[0] == 0.0


def test_async_functions(rewards_py):
    assert env_of(f"{rewards_py}:slow_length").score(TASKS[0], "x" * 7)[0] == pytest.approx(0.7)
    rewards, _ = env_of(f"{rewards_py}:async_ranked", group=True).score_group(TASKS[0], ["ccc", "a", "bb"])
    assert rewards == [1.0, 0.0, 0.5]


def test_group_functions_native_and_trl(rewards_py):
    env = make("group_function", function=f"{rewards_py}:ranked")
    assert env.group_level
    assert env.score_group(TASKS[0], ["ccc", "a", "bb"]) == ([1.0, 0.0, 0.5], {})
    trl = env_of(f"{rewards_py}:trl_style", group=True)
    assert trl.score_group(TASKS[0], ["5", "6"])[0] == [1.0, 0.0]
    assert trl.score_group(TASKS[2], ["", "hi"])[0] == [1.0, 0.0]
    seen = next(m for name, m in sys.modules.items()  # this file's module (other tests load reward files too)
                if name.startswith("_rl_reward_") and getattr(m, "__file__", None) == str(rewards_py)).SEEN
    plain, chat = seen[-2], seen[-1]
    assert plain["completions"] == ["5", "6"] and plain["prompts"] == [TASKS[0].prompt] * 2
    assert plain["answer"] == ["5", "5"] and {"responses", "task_ids", "meta"} <= set(plain["kwargs"])
    # a conversational task: prompts and completions as chat messages, as TRL passes them
    assert chat["prompts"] == [TASKS[2].messages] * 2
    assert chat["completions"] == [[{"role": "assistant", "content": ""}], [{"role": "assistant", "content": "hi"}]]
    # a Gym user's step on a group function: a group of one
    trl.reset(options={"task": TASKS[1]})
    assert trl.step("42")[1] == 1.0


def test_the_environment_name_follows_the_signature(rewards_py):
    assert reward_function_env(f"{rewards_py}:exact") == "function"
    assert reward_function_env(f"{rewards_py}:trl_style") == "group_function"
    assert reward_function_env(f"{rewards_py}:compute_score") == "function"
    with pytest.raises(RewardFunctionError, match="takes a group: use the environment 'group_function'"):
        env_of(f"{rewards_py}:ranked")
    with pytest.raises(RewardFunctionError, match="takes one response: use the environment 'function'"):
        env_of(f"{rewards_py}:exact", group=True)


@pytest.mark.parametrize(("spec", "message"), [
    ("{dir}/nope.py:f", r"no file .*nope\.py"),
    ("{dir}/my_rewards.py:missing", r"has no function 'missing'"),
    ("no_such_package_xyz:f", r"cannot import no_such_package_xyz: ModuleNotFoundError"),
    ("just_a_name", r"give 'package\.module:function' or 'path/to/file\.py:function'"),
    ("os.path:exists", r"parameter 'path' is not one it can be given"),
])
def test_bad_function_names_are_one_line(rewards_py, spec, message):
    with pytest.raises(RewardFunctionError, match=message) as err:
        env_of(spec.format(dir=rewards_py.parent))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("name", "group", "error", "message"), [
    ("broken", False, KeyError, "no such column"),
    ("nan", False, ValueError, r"on task t1 is nan"),
    ("text", False, ValueError, r"not a number: 'high'"),
    ("short", True, ValueError, r"returned 1 rewards for 2 responses"),
])
def test_failures_raise_instead_of_rewarding(rewards_py, name, group, error, message):
    env = env_of(f"{rewards_py}:{name}", group=group)
    with pytest.raises(error, match=message):
        if group:
            env.score_group(TASKS[0], ["a", "b"])
        else:
            env.reset(options={"task": TASKS[0]})
            env.step("a")


def test_check_env_passes(rewards_py):
    for env in (env_of(f"{rewards_py}:exact"), env_of(f"{rewards_py}:ranked", group=True)):
        env.tasks = TASKS[:2]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            check_env(env, skip_render_check=True)
