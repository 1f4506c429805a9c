"""A complete third-party environment: reverse a word. Installed, it is `rl train`'s env "reverse"."""

from __future__ import annotations

import random
import string
from typing import Any

from envs import Env, Task


class ReverseEnv(Env):
    """Single-turn: the reward is 1 when the first word of the response is the prompt's word reversed."""

    task_type = "reverse"

    def __init__(self, tasks: list[Task] | None = None, min_len: int = 3, max_len: int = 6) -> None:
        super().__init__(tasks)
        self.min_len, self.max_len = min_len, max_len
        # what reset() passes to generate_tasks when it is called without a task (gymnasium.make("rl/reverse"))
        self.generate_options = {"min_len": min_len, "max_len": max_len}

    def score(self, task: Task, response: str) -> tuple[float, dict[str, Any]]:
        words = response.split()
        guess = words[0].strip(".") if words else ""
        return float(guess == task.answer), {"guess": guess}

    @classmethod
    def generate_tasks(cls, n: int, seed: int, min_len: int = 3, max_len: int = 6) -> list[Task]:
        rng = random.Random(seed)
        tasks = []
        for i in range(n):
            word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(min_len, max_len)))
            tasks.append(Task(f"reverse-{seed}-{i}", f"Reverse the word {word}. Answer:", word[::-1],
                              {"solution": f" {word[::-1]}."}))
        return tasks
