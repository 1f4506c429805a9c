"""Gymnasium conformance of the built-in environments (gymnasium's own ``check_env``, its warnings as errors), reset
without a task for the environments that generate theirs, and the declared seams of ``envs.base.Env`` that a
plug-in relying only on the defaults gets."""

from __future__ import annotations

import json
import warnings

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

from envs import Env, Task
from envs.arithmetic import ArithmeticEnv
from envs.code import CodeEnv
from envs.registry import BUILTINS
from envs.rubric import RubricEnv
from envs.swe import SWEEnv

#: where each built-in environment's check_env runs (the reward environments need their servers)
CHECKED_ELSEWHERE = {"endpoint": "tests/test_reward_endpoint.py", "judge": "tests/test_reward_judge.py",
                     "function": "tests/test_reward_function.py", "group_function": "tests/test_reward_function.py"}


def strict_check(env: Env) -> None:
    """gymnasium's checker with every warning it gives (an observation outside the space...) an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env, skip_render_check=True)


def quality_critic(prompts: list[str]) -> list[str]:
    """A rule-based critic (not the policy): prefers the response that shows more distinct words."""
    out = []
    for p in prompts:
        a = p.split("## Response A\n")[1].split("\n\n## Response B")[0]
        b = p.split("## Response B\n")[1].split("\n\n## Your task")[0]
        na, nb = len(set(a.split())), len(set(b.split()))
        out.append(f"Compared.\nVerdict: {'A' if na > nb else 'B' if nb > na else 'tie'}")
    return out


SWE_TASK = Task("swe-tiny", "f() returns 1 but should return 2.", "", {
    "instance_id": "swe-tiny", "repo": "tiny", "problem_statement": "f() returns 1 but should return 2.",
    "files": {"mod.py": "def f():\n    return 1\n", "test_mod.py": "from mod import f\n\n\ndef test_f():\n"
              "    assert f() == 2\n"},
    "FAIL_TO_PASS": ["test_mod.py::test_f"], "PASS_TO_PASS": [], "test_patch": ""})


def make_builtin(name: str) -> Env:
    """The built-in environment ``name`` as check_env gets it: from gymnasium.make where it generates its tasks,
    else with tasks (and a local sandbox service, a rule-based critic) given."""
    if name in ("arithmetic", "math", "puzzles", "shapes"):
        return gymnasium.make(f"rl/{name}").unwrapped
    if name == "code":
        return CodeEnv(CodeEnv.humaneval_tasks(3), wall_s=5.0)
    if name == "swe":
        return SWEEnv([SWE_TASK], max_turns=5)
    if name == "rubric":
        tasks = [Task("r1", "Name three colours.", "Red, green and blue."),
                 Task("r2", "Say hello politely.", "Hello, nice to meet you.")]
        return RubricEnv(tasks, generate=quality_critic)
    raise AssertionError(f"no check_env set-up for {name}")


def test_every_builtin_has_a_check():
    assert set(BUILTINS) == {"arithmetic", "math", "puzzles", "code", "swe", "rubric", "shapes"} | set(
        CHECKED_ELSEWHERE)


@pytest.mark.parametrize("name", ["arithmetic", "math", "puzzles", "code", "swe", "rubric", "shapes"])
def test_check_env_passes(name):
    env = make_builtin(name)
    try:
        strict_check(env)
    finally:
        env.close()


@pytest.mark.parametrize("name", ["arithmetic", "math", "puzzles", "shapes"])
def test_generating_environments_reset_without_arguments_seeded(name):
    a, b = gymnasium.make(f"rl/{name}"), gymnasium.make(f"rl/{name}")
    first, info = a.reset(seed=0)
    assert isinstance(first, str) and first and first in a.observation_space and info["task_id"]
    assert b.reset(seed=0)[0] == first  # another environment, the same seed: the same task
    assert len({a.reset(seed=s)[0] for s in range(1, 6)}) > 1  # other seeds draw other tasks
    assert a.reset(seed=0)[0] == first
    task = a.unwrapped.task
    _, reward, terminated, _, _ = a.step(task.meta.get("solution", f"<answer>{task.answer}</answer>"))
    assert terminated and reward == 1.0  # the generated task grades its own reference


def test_generated_tasks_follow_the_environments_options():
    env = gymnasium.make("rl/arithmetic", max_operand=3, max_steps=1).unwrapped
    for seed in range(20):
        env.reset(seed=seed)
        first = int(env.task.prompt.split(" has ")[1].split()[0])
        assert 2 <= first <= 3 and env.task.meta["solution"].count("=") == 1


def test_terminal_observation_lies_in_the_space():
    env = ArithmeticEnv(ArithmeticEnv.generate_tasks(3, seed=0))
    obs, _ = env.reset(seed=1)
    end, *_ = env.step("The answer is 0.")
    assert end == "" and end in env.observation_space and obs in env.observation_space
    assert "Unicode ×, ü and 🙂" in env.observation_space and "x" * (1 << 16) in env.action_space
    assert "x" * ((1 << 16) + 1) not in env.action_space and 3 not in env.observation_space


def test_code_step_info_is_deterministic_and_timings_are_diagnostics():
    env = CodeEnv(CodeEnv.humaneval_tasks(1), wall_s=5.0)
    task = env.tasks[0]
    infos = []
    for _ in range(2):
        env.reset(seed=3)
        _, reward, *_, info = env.step(task.answer)
        infos.append(info)
        assert reward == 1.0 and env.diagnostics["wall_s"] > 0 and "wall_s" not in info
    assert infos[0] == infos[1]
    env.close()


class Minimal(Env):
    """A plug-in that relies on every default: only ``score``."""

    task_type = "minimal"

    def score(self, task, response):
        return float(response.strip() == task.answer), {"said": response.strip()}


def test_a_plugin_relying_only_on_the_defaults(tmp_path):
    assert (Minimal.uses_sandbox, Minimal.group_level, Minimal.uses_tools, Minimal.multi_turn) == (False,) * 4
    env = Minimal()
    with pytest.raises(NotImplementedError, match="group_level is False"):
        env.score_group(Task("t", "p", "a"), ["a", "b"])
    assert env.attach(lambda prompts: prompts) is None  # the critic is ignored
    from engines.model.text.chat_format import get_format

    env.set_tool_format(get_format("k2"))
    assert env.tool_format.name == "k2"
    with pytest.raises(NotImplementedError, match="give a task file"):
        Minimal.generate_tasks(2, seed=0)
    with pytest.raises(ValueError, match="needs options\\['task'\\] or a task list"):
        env.reset()
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"question": f"Say {w}.", "solution": w}) + "\n" for w in ("yes", "no")))
    tasks = Minimal.load_tasks(path, columns={"prompt": "question", "answer": "solution"})
    assert [(t.prompt, t.answer) for t in tasks] == [("Say yes.", "yes"), ("Say no.", "no")]
    env = Minimal(tasks)
    strict_check(env)
    env.reset(options={"task": tasks[1]})
    assert env.step(" no ")[1:3] == (1.0, True)


def test_rubric_step_compares_with_the_reference_reproducibly():
    task = Task("r", "Name three colours.", "Red.")
    env = RubricEnv([task], generate=quality_critic)
    env.reset(seed=0)
    assert env.step("Red, green and blue.")[1] == 1.0  # more distinct words than the reference: it wins
    seen = []
    for _ in range(2):
        env.reset(seed=5)
        seen.append(env.step("Blue.")[4])
    assert seen[0] == seen[1] and seen[0]["verdict"] in ("A", "B", "tie")


def test_environments_that_need_no_answer_load_tasks_without_one(tmp_path):
    """``requires_answer = False`` (the rubric, a reward function, an endpoint, a judge, a plug-in) makes the answer
    optional; an environment that declares nothing still rejects a record without one."""
    from envs.reward_endpoint import EndpointEnv
    from envs.reward_function import FunctionEnv, GroupFunctionEnv
    from envs.reward_judge import JudgeEnv
    from envs.tasks import TaskFileError

    class Open(Env):
        requires_answer = False

    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"prompt": "Write a haiku."}) + "\n")
    for cls in (RubricEnv, FunctionEnv, GroupFunctionEnv, EndpointEnv, JudgeEnv, Open):
        assert [(t.prompt, t.answer) for t in cls.load_tasks(path)] == [("Write a haiku.", "")], cls
    with pytest.raises(TaskFileError, match="answer"):
        Env.load_tasks(path)
