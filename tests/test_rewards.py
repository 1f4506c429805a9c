"""Rewards come from the environment; budget truncation and raising environments are handled."""

from engines.inference import Completion
from envs import Env, register
from envs.arithmetic import ArithmeticEnv
from rl.config import parse_config
from rl.rewards import score


class Flaky(Env):
    """A user environment that raises on some tasks."""

    def score(self, task, response):
        if task.id.endswith("-1"):
            raise RuntimeError("grader crashed")
        return ArithmeticEnv().score(task, response)


register("flaky-test", Flaky)


def _completion(tok, text, reason="stop"):
    return Completion(tok.encode(text), [-0.5] * len(tok.encode(text)), reason, [1, 2])


def test_reward_truncation_and_errors(tokenizer):
    tasks = ArithmeticEnv.generate_tasks(2, seed=0)
    cfg = parse_config({"env": {"name": "flaky-test"},
                        "rollout": {"samples_per_prompt": 2, "truncation_penalty": -0.5}})
    comps = [
        _completion(tokenizer, tasks[0].meta["solution"]),              # right
        _completion(tokenizer, tasks[0].meta["solution"], "length"),    # right but out of budget
        _completion(tokenizer, tasks[1].meta["solution"]),              # grader raises
        _completion(tokenizer, " The answer is 0."),                    # grader raises
    ]
    samples, stats = score(tasks, comps, tokenizer, cfg)
    assert [(s.group, s.reward) for s in samples] == [(0, 1.0), (0, -0.5)]
    assert stats["env_errors"] == 2 and "grader crashed" in stats["first_env_error"]
    assert stats["truncation_rate"] == 0.25
