"""Rewards come from the environment; budget control per task type; raising environments are handled."""

from engines.sampling import SamplingParams
from envs import Env, Task, register
from envs.arithmetic import ArithmeticEnv
from rl.config import parse_config
from rl.partial import Trajectory
from rl.rewards import score


class Flaky(Env):
    """A user environment that raises on some tasks."""

    def score(self, task, response):
        if task.id.endswith("-1"):
            raise RuntimeError("grader crashed")
        return ArithmeticEnv().score(task, response)


register("flaky-test", Flaky)


def _traj(tok, key, group, task_index, text, reason="stop", temperature=1.0):
    ids = tok.encode(text)
    return Trajectory(key=key, group=group, task_index=task_index, prompt_ids=[1, 2],
                      params=SamplingParams(temperature, 40), started=0, token_ids=ids,
                      logprobs=[-0.5] * len(ids), segments=[(0, 0)], finish_reason=reason)


def test_reward_truncation_and_errors(tokenizer):
    tasks = ArithmeticEnv.generate_tasks(2, seed=0)
    cfg = parse_config({"env": {"name": "flaky-test"},
                        "rollout": {"samples_per_prompt": 2, "truncation_penalty": -0.5}})
    groups = [
        [_traj(tokenizer, 0, 7, 0, tasks[0].meta["solution"], temperature=0.8),    # right
         _traj(tokenizer, 1, 7, 0, tasks[0].meta["solution"], "length")],           # right but out of budget
        [_traj(tokenizer, 2, 9, 1, tasks[1].meta["solution"]),                      # grader raises
         _traj(tokenizer, 3, 9, 1, " The answer is 0.")],                           # grader raises
    ]
    samples, stats = score(groups, tasks, tokenizer, cfg)
    assert [(s.group, s.reward, s.temperature) for s in samples] == [(7, 1.0, 0.8), (7, -0.5, 1.0)]
    assert stats["env_errors"] == 2 and "grader crashed" in stats["first_env_error"]
    assert stats["truncation_rate"] == 0.25


def test_budget_and_penalty_per_task_type(tokenizer):
    """Each task type has its own token budget and truncation penalty, and its own truncation rate."""
    base = ArithmeticEnv.generate_tasks(3, seed=1)
    tasks = [Task(t.id, t.prompt, t.answer, {**t.meta, "task_type": tt})
             for t, tt in zip(base, ["short", "long", "long"], strict=True)]
    cfg = parse_config({"rollout": {"max_tokens": 30, "truncation_penalty": 0.0,
                                    "task_types": {"short": {"max_tokens": 8, "truncation_penalty": -1.0},
                                                   "long": {"temperature": {"schedule": "linear", "start": 1.2,
                                                                            "end": 0.6}}}}})
    assert cfg.task_type("short")[:2] == (8, -1.0)
    assert cfg.task_type("long")[:2] == (30, 0.0) and cfg.task_type("long")[2].start == 1.2
    assert cfg.task_type("other")[:2] == (30, 0.0)
    groups = [[_traj(tokenizer, 0, 0, 0, "12+", "length"), _traj(tokenizer, 1, 0, 0, base[0].meta["solution"])],
              [_traj(tokenizer, 2, 1, 1, "1", "length"), _traj(tokenizer, 3, 1, 1, base[1].meta["solution"])],
              [_traj(tokenizer, 4, 2, 2, base[2].meta["solution"]), _traj(tokenizer, 5, 2, 2, "x")]]
    samples, stats = score(groups, tasks, tokenizer, cfg)
    assert [s.reward for s in samples] == [-1.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    assert stats["truncation_rate/short"] == 0.5 and stats["truncation_rate/long"] == 0.25
    assert stats["truncation_rate"] == 2 / 6
    assert stats["reward_mean/short"] == 0.0 and stats["reward_mean/long"] == 0.5
