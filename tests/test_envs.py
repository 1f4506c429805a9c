"""The Gym interface, the registry and the arithmetic environment's grading."""

import json

import gymnasium
import pytest

from envs import Env, make, register, registered
from envs.arithmetic import ArithmeticEnv, extract_answer
from envs.registry import UnknownEnvironmentError, get
from envs.tasks import TaskFileError, load_tasks, save_tasks


def test_arithmetic_is_registered_and_gymnasium_makes_it():
    assert "arithmetic" in registered()
    env = gymnasium.make("rl/arithmetic")
    assert isinstance(env.unwrapped, ArithmeticEnv)


def test_reference_solutions_score_one_and_wrong_answers_zero():
    env = make("arithmetic")
    for task in ArithmeticEnv.generate_tasks(200, seed=4):
        obs, _ = env.reset(options={"task": task})
        assert obs == task.prompt
        _, r, terminated, truncated, _ = env.step(task.meta["solution"])
        assert (r, terminated, truncated) == (1.0, True, False)
        env.reset(options={"task": task})
        assert env.step(f" The answer is {int(task.answer) + 1}.")[1] == 0.0
        assert env.step(task.meta["solution"].replace("The answer", "answer"))[1] == 0.0


def test_reference_solutions_are_arithmetically_correct():
    for task in ArithmeticEnv.generate_tasks(300, seed=5):
        for step in task.meta["solution"].split(". The")[0].strip().split(", "):
            lhs, rhs = step.split("=")
            assert eval(lhs) == int(rhs)
        assert int(task.answer) >= 0


def test_extract_answer_takes_the_last_one():
    assert extract_answer("The answer is 3. No wait. The answer is 12.") == "12"
    assert extract_answer("no answer here") is None


def test_generation_is_deterministic():
    assert ArithmeticEnv.generate_tasks(20, 7) == ArithmeticEnv.generate_tasks(20, 7)
    assert ArithmeticEnv.generate_tasks(20, 7) != ArithmeticEnv.generate_tasks(20, 8)


def test_unknown_environment_names_the_registered_ones():
    with pytest.raises(UnknownEnvironmentError, match="'nope' is not registered; registered: .*arithmetic"):
        get("nope")


def test_user_environment_registers_by_name():
    class Echo(Env):
        task_type = "echo"

        def score(self, task, response):
            return float(response.strip() == task.answer), {}

    register("echo-test", Echo)
    env = gymnasium.make("rl/echo-test", disable_env_checker=True).unwrapped
    task = ArithmeticEnv.generate_tasks(1, 0)[0]
    env.reset(options={"task": task})
    assert env.step(task.answer)[1] == 1.0
    with pytest.raises(TypeError):
        register("bad", dict)


def test_task_file_roundtrip_and_malformed_records(tmp_path):
    tasks = ArithmeticEnv.generate_tasks(5, 1)
    save_tasks(tasks, tmp_path / "t.jsonl")
    assert load_tasks(tmp_path / "t.jsonl") == tasks
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x", "answer": "1"}) + "\n" + json.dumps({"prompt": "y"}) + "\n")
    with pytest.raises(TaskFileError, match=r"bad.jsonl:2: missing field 'answer'"):
        load_tasks(bad)
    bad.write_text("{not json\n")
    with pytest.raises(TaskFileError, match=r"bad.jsonl:1: not valid JSON"):
        load_tasks(bad)
    with pytest.raises(TaskFileError, match="does not exist"):
        load_tasks(tmp_path / "missing.jsonl")
