"""An LLM judge as the reward (envs/reward_judge.py), against `rl serve`'s server of a tiny model trained to grade
four responses (right ones 9, wrong ones 2: tests/served_judge.py, served once per session); its score parse, and
judge failures counted as errors, not rewards."""

from __future__ import annotations

import warnings

import pytest
from gymnasium.utils.env_checker import check_env

from checkpoint_engine.topology import free_port
from envs import make
from envs.base import AnyText
from envs.reward_judge import JudgeEnv, JudgeError, parse_score
from tests.served_judge import CASES, RUBRIC, TASKS


@pytest.fixture(scope="module")
def judge_url(served_judge) -> str:
    """`rl serve`'s server of the trained judge (the session's, tests/served_judge.py)."""
    return served_judge.url


def judge(url: str, max_tokens: int = 8) -> JudgeEnv:
    return make("judge", base_url=url, model="judge", rubric=RUBRIC, max_tokens=max_tokens)


def test_the_judge_rewards_through_the_served_model(judge_url):
    env = judge(judge_url)
    assert env.task_type == "judge" and not env.group_level
    for task, response, score in CASES:
        env.reset(options={"task": task})
        obs, reward, terminated, truncated, info = env.step(response)
        assert (obs, reward, terminated, truncated) == ("", score / 10, True, False)
        assert info == {"judge_score": float(score), "judge_reply": f"Score: {score}"}
        assert env.diagnostics["judge_s"] > 0


def test_a_reply_without_a_score_is_an_error_not_a_reward(judge_url):
    env = judge(judge_url, max_tokens=2)  # the reply is cut before its number
    env.reset(options={"task": TASKS[0]})
    with pytest.raises(JudgeError, match=r"on task j1 has no score from 0 to 10 \(a 'Score: N' line\): 'Score"):
        env.step("The answer is 5.")


def test_server_errors_are_judge_errors(judge_url):
    env = make("judge", base_url=judge_url, model="gpt-4", retries=3)
    with pytest.raises(JudgeError, match=r"answered 404: .*does not exist.*\(after 1 attempt\)"):
        env.score(TASKS[0], "5")  # a client error: not retried
    env = make("judge", base_url=f"http://127.0.0.1:{free_port()}/v1", model="judge", retries=1)
    with pytest.raises(JudgeError, match=r"cannot reach .*\(after 2 attempts\)"):
        env.score(TASKS[0], "5")


def test_check_env_passes(judge_url):
    env = judge(judge_url)
    env.tasks = TASKS
    # responses the tiny judge's 1024-token context holds (a real judge's holds the default 64 Ki characters)
    env.action_space = AnyText(64, min_length=0, charset=env.action_space.character_set)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env, skip_render_check=True)


@pytest.mark.parametrize(("reply", "score"), [
    ("Good.\nScore: 7", 7.0), ("**Score:** 8", 8.0), ("Final score = 6/10", 6.0), ('{"score": 3}', 3.0),
    ("Score: 4/5", 8.0), ("The score is 10.", 10.0), ("Score: 7.5", 7.5), ("Score: 3 at first.\nScore: 9", 9.0),
    ("SCORE: [5]", 5.0), ("Score: 11", None), ("Score: -1", None), ("Score: N", None), ("I like it.", None),
    ("scores: 7", None), ("Score: 3/0", None), ("", None),
])
def test_score_parse(reply, score):
    assert parse_score(reply, 10) == score
