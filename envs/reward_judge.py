"""Rewards from an LLM judge over an OpenAI-compatible chat endpoint (env ``judge``): another model served by
``rl serve``, vLLM or a hosted API grades each response against a rubric.

The judge gets one user message (``judge_prompt``): the rubric, the prompt, the reference answer when the task has
one, and the response, with the instruction to end with a line ``Score: N`` (N from 0 to ``scale``). The reward is
N / ``scale``. The score is read from the reply's last score statement (``Score: 7``, ``**Score:** 7/10``,
``"score": 7``; a fraction out of another total is rescaled); a reply without one, or with a score outside the
range, is a judge failure: the episode is lost and counted in ``env_errors``, never rewarded. A connection error,
a timeout or status 408, 429 or 5xx is retried ``retries`` times (0.5 s, 1 s, 2 s... apart); other statuses fail
at once. The API key is ``api_key``, else ``$OPENAI_API_KEY``, else none (local servers need none).
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

from envs.base import Env, Task
from envs.http_retry import after, post_with_retries
from envs.registry import register

DEFAULT_RUBRIC = ("Is the response a correct, complete and clear answer to the prompt? When a reference answer is "
                  "given, a response whose final answer disagrees with it is wrong, however well argued.")
_SCORE = re.compile(r"\bscore\b[\s*_`\"'\]]*(?:is\s+)?[\s*_`\"':=\[]*(-?\d+(?:\.\d+)?)"
                    r"(?:\s*(?:/|out\s+of)\s*(\d+(?:\.\d+)?))?", re.IGNORECASE)


class JudgeError(RuntimeError):
    """The judge could not be asked, or its reply has no usable score."""


def judge_prompt(task: Task, response: str, rubric: str, scale: int) -> str:
    """The judge's one user message."""
    reference = f"## Reference answer\n{task.answer}\n\n" if task.answer else ""
    return (f"You are grading a response to a prompt.\n\n## Rubric\n{rubric}\n\n## Prompt\n{task.prompt}\n\n"
            f"{reference}## Response\n{response}\n\n## Your task\nExplain briefly how the response meets the "
            f"rubric, then end with one line of exactly `Score: N`, N an integer from 0 (worst) to {scale} (best).")


def parse_score(text: str, scale: float) -> float | None:
    """The last score in ``text`` on the 0..``scale`` range (``N/M`` rescaled to it), or None if there is none or
    it lies outside the range."""
    found = _SCORE.findall(text or "")
    if not found:
        return None
    value, total = found[-1]
    if total and float(total) <= 0:
        return None
    score = float(value) * (scale / float(total) if total else 1.0)
    return score if 0.0 <= score <= scale else None


class JudgeEnv(Env):
    """Single-turn: an LLM judge served over an OpenAI-compatible API scores the response against a rubric."""

    task_type = "judge"
    requires_answer = False  # the judge grades against the rubric; a reference answer, when given, goes with it

    def __init__(self, tasks: list[Task] | None = None, *, base_url: str, model: str, rubric: str = DEFAULT_RUBRIC,
                 scale: int = 10, api_key: str | None = None, max_tokens: int = 512, temperature: float = 0.0,
                 timeout_s: float = 60.0, retries: int = 2) -> None:
        super().__init__(tasks)
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"judge base_url must start with http:// or https://, got {base_url!r}")
        if scale < 1 or max_tokens < 1 or timeout_s <= 0 or retries < 0:
            raise ValueError("judge: scale >= 1, max_tokens >= 1, timeout_s > 0 and retries >= 0")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.rubric, self.scale = model, rubric, scale
        self.max_tokens, self.temperature, self.timeout_s, self.retries = max_tokens, temperature, timeout_s, retries
        key = api_key or os.environ.get("OPENAI_API_KEY")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    def ask(self, prompt: str) -> str:
        """The judge's reply to ``prompt`` (one user message), with retries; JudgeError when there is none."""
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": self.max_tokens, "temperature": self.temperature}
        r, error, attempts = post_with_retries(self.url, timeout_s=self.timeout_s, retries=self.retries, json=body,
                                               headers=self.headers)
        if r is None:
            raise JudgeError(after(error, attempts))
        try:
            return str(r.json()["choices"][0]["message"]["content"] or "")
        except (ValueError, KeyError, IndexError, TypeError):
            raise JudgeError(f"{self.url} answered 200 but not a chat completion: {r.text[:200]!r}") from None

    def score(self, task: Task, response: str) -> tuple[float, dict[str, Any]]:
        t0 = time.monotonic()
        reply = self.ask(judge_prompt(task, response, self.rubric, self.scale))
        self.diagnostics["judge_s"] = round(time.monotonic() - t0, 4)
        score = parse_score(reply, self.scale)
        if score is None:
            raise JudgeError(f"the judge's reply on task {task.id} has no score from 0 to {self.scale} "
                             f"(a 'Score: N' line): {reply[-200:]!r}")
        return score / self.scale, {"judge_score": score, "judge_reply": reply[-1000:]}


register("judge", JudgeEnv)
