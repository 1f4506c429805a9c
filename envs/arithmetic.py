"""Arithmetic word problems with an integer answer, generated offline and graded exactly.

A problem chains one to three steps (add, take away, multiply). The reference solution writes
each step as ``a+b=c`` and ends with ``The answer is N.``; the grader reads the last
``The answer is N`` in a response, so the reward is checked, not judged.
"""

from __future__ import annotations

import random
import re
from typing import Any

from envs.base import Env, Task
from envs.registry import register

NAMES = ["Mia", "Leo", "Ava", "Noah", "Zoe", "Omar", "Ivy", "Sam", "Lena", "Ravi", "Kai", "Nora"]
ITEMS = ["apples", "marbles", "coins", "books", "stamps", "shells", "cards", "pens", "eggs", "beads"]
_ANSWER = re.compile(r"The answer is (-?\d+)")


def _steps(rng: random.Random, value: int, n_steps: int, max_operand: int) -> list[tuple[str, int]]:
    steps = []
    for _ in range(n_steps):
        op = rng.choice("+-*") if value <= 30 else rng.choice("+-")
        if op == "+":
            b = rng.randint(1, max_operand)
        elif op == "-":
            if value < 2:
                op, b = "+", rng.randint(1, max_operand)
            else:
                b = rng.randint(1, value - 1)
        else:
            b = rng.randint(2, 4)
        steps.append((op, b))
        value = value + b if op == "+" else value - b if op == "-" else value * b
    return steps


def make_problem(rng: random.Random, max_operand: int = 60, max_steps: int = 2) -> tuple[str, str, str]:
    """(prompt, reference solution, answer) of one random problem."""
    name, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    value = rng.randint(2, max_operand)
    text = [f"{name} has {value} {item}."]
    work = []
    for op, b in _steps(rng, value, rng.randint(1, max_steps), max_operand):
        if op == "+":
            text.append(f"{name} finds {b} more.")
            new = value + b
        elif op == "-":
            text.append(f"{name} gives {b} to {other}.")
            new = value - b
        else:
            text.append(f"Then the {item} are {['', '', 'doubled', 'tripled', 'quadrupled'][b]}.")
            new = value * b
        work.append(f"{value}{op}{b}={new}")
        value = new
    prompt = f"Question: {' '.join(text)} How many {item} does {name} have?\nAnswer:"
    solution = f" {', '.join(work)}. The answer is {value}."
    return prompt, solution, str(value)


def extract_answer(response: str) -> str | None:
    """The integer after the last ``The answer is`` in ``response``, if any."""
    found = _ANSWER.findall(response)
    return found[-1] if found else None


class ArithmeticEnv(Env):
    """Single-turn arithmetic word problems: reward 1 for the exact integer answer, else 0."""

    task_type = "arithmetic"

    def __init__(self, tasks: list[Task] | None = None, *, max_operand: int = 60, max_steps: int = 2) -> None:
        # a run config passes one kwargs dict to both __init__ and generate_tasks: the generation options play no
        # part in scoring, only in the tasks reset() generates when it has none
        super().__init__(tasks)
        self.generate_options = {"max_operand": max_operand, "max_steps": max_steps}

    def score(self, task: Task, response: str) -> tuple[float, dict[str, Any]]:
        got = extract_answer(response)
        correct = got is not None and int(got) == int(task.answer)
        return (1.0 if correct else 0.0), {"extracted": got, "correct": correct}

    @classmethod
    def generate_tasks(cls, n: int, seed: int, max_operand: int = 60, max_steps: int = 2) -> list[Task]:
        rng = random.Random(seed)
        tasks = []
        for i in range(n):
            prompt, solution, answer = make_problem(rng, max_operand, max_steps)
            meta = {"solution": solution, "direct_solution": f" The answer is {answer}."}
            tasks.append(Task(f"arith-{seed}-{i}", prompt, answer, meta))
        return tasks


register("arithmetic", ArithmeticEnv)
