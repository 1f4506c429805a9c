"""Reasoning puzzles from reasoning-gym (24-game, Sudoku, cryptarithms, ...), generated offline, graded by each
dataset's own ``score_answer``.

Tasks come from reasoning-gym's composite dataset (its own weighted mix of datasets). A task's ``meta`` records the
dataset, the dataset's seed, size and config and the entry's index, so the exact entry (with the Python objects its
scorer expects, such as tuples) is regenerated when grading; ``meta["entry"]`` holds a JSON copy of the entry for
inspection. It is graded against directly when it equals the entry (``meta["exact"]``, which saves regenerating
slow puzzles such as zebra_puzzles) or when the task has no coordinates (e.g. one exported elsewhere).

The prompt asks for the answer between ``<answer>`` and ``</answer>``; a response without tags falls back to the
text after its last "Final answer:" / "Answer:" (the rest of that line, or the lines below it when the line is
empty, for grid answers).

Some scorers ``eval`` the answer (sympy's ``parse_expr`` for the 24-game and countdown, Python's ``eval`` for board and
list answers). Model text must not run in the trainer, and ``9**9**9**9`` would hang it, so those answers must pass a
guard first (``ANSWER_GUARDS`` / ``LITERAL_FALLBACK``) and datasets whose scorers evaluate free-form expressions are
refused (``UNSUPPORTED``).
"""

from __future__ import annotations

import ast
import json
import re
from functools import lru_cache
from typing import Any

from envs.base import Env, Task
from envs.registry import register

# The brief's Morse code puzzle is not in reasoning-gym 0.1.25; the Caesar cipher stands in for a decoding task.
DEFAULT_DATASETS: dict[str, float] = {
    "puzzle24": 1.0, "sudoku": 1.0, "mini_sudoku": 1.0, "cryptarithm": 1.0, "countdown": 1.0,
    "knights_knaves": 1.0, "zebra_puzzles": 1.0, "maze": 1.0, "caesar_cipher": 1.0, "n_queens": 1.0,
}
INSTRUCTION = ("\n\nThink it through, then give only your final answer between <answer> and </answer> tags, "
               "e.g. <answer>your answer</answer>.")
# Scorers that evaluate the answer with sympy: only plain arithmetic (no powers, which can explode) gets through.
_ARITHMETIC = re.compile(r"[0-9+\-*/().\s]{1,200}")
ANSWER_GUARDS: dict[str, re.Pattern[str]] = {"puzzle24": _ARITHMETIC, "countdown": _ARITHMETIC}
# Scorers that ``eval`` an answer other than the reference to accept a Python list: only literals get through.
LITERAL_FALLBACK = frozenset({"n_queens", "binary_matrix", "spiral_matrix", "string_insertion"})
# Scorers that hand free-form expressions to sympy's parse_expr (an eval): no safe guard fits them.
UNSUPPORTED = frozenset({"simple_integration", "intermediate_integration", "polynomial_multiplication"})
_FINAL = re.compile(r"\b(?:final\s+answer|answer)\s*(?:is\s*)?:[ \t]*", re.IGNORECASE)


def extract_answer(response: str) -> str | None:
    """The last ``<answer>...</answer>``, else the text after the last final-answer marker, else None."""
    from reasoning_gym.utils import extract_answer as tagged

    found = tagged(response)
    if found is not None:
        return found
    markers = list(_FINAL.finditer(response))
    if not markers:
        return None
    rest = response[markers[-1].end():]
    line, _, below = rest.partition("\n")
    answer = line.strip() or below.strip()  # a grid starts on the line below "Final answer:"
    return answer.strip("*` ").strip() or None


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    return repr(value)


def to_json(entry: dict[str, Any]) -> dict[str, Any]:
    """A JSON-serialisable copy of a reasoning-gym entry (tuples become lists, numpy scalars numbers)."""
    return json.loads(json.dumps(entry, default=_jsonable))


@lru_cache(maxsize=256)
def _dataset(name: str, seed: int | None, size: int | None, config: str) -> Any:
    import reasoning_gym

    kwargs = json.loads(config)
    if seed is not None:
        kwargs.update(seed=seed, size=size)
    return reasoning_gym.create_dataset(name, **kwargs)


@lru_cache(maxsize=4096)
def _regenerated(name: str, seed: int, size: int, config: str, index: int) -> dict[str, Any]:
    return _dataset(name, seed, size, config)[index]


def _unsafe(dataset: str, answer: str, reference: str) -> str | None:
    """Why the dataset's scorer must not see ``answer``, or None."""
    guard = ANSWER_GUARDS.get(dataset)
    if guard is not None and (not guard.fullmatch(answer) or "**" in answer):
        return "not a plain arithmetic expression (digits, + - * / and parentheses)"
    if dataset in LITERAL_FALLBACK and answer.strip() != reference.strip():
        try:
            ast.literal_eval(answer.strip())
        except SyntaxError:
            pass  # eval fails the same way
        except (ValueError, TypeError, MemoryError, RecursionError):
            return "valid Python but not a literal"
    return None


def _options(options: dict[str, Any], allowed: set[str], where: str) -> None:
    # A run config passes one kwargs dict to both __init__ and generate_tasks; each ignores the other's keys.
    if unknown := set(options) - allowed:
        raise TypeError(f"{where} got unexpected keyword arguments: {', '.join(sorted(unknown))}")


class ReasoningGymEnv(Env):
    """Single-turn reasoning-gym puzzles; the reward is the dataset's own score of the extracted answer."""

    task_type = "puzzle"
    _GEN_OPTIONS = frozenset({"datasets", "configs"})

    def __init__(self, tasks: list[Task] | None = None, *, max_answer_chars: int = 4000, **options: Any) -> None:
        _options(options, set(self._GEN_OPTIONS), "ReasoningGymEnv()")
        super().__init__(tasks)
        self.max_answer_chars = max_answer_chars
        self.generate_options = dict(options)  # the tasks reset() generates when it has none

    def score(self, task: Task, response: str) -> tuple[float, dict[str, Any]]:
        meta = task.meta
        name = meta["dataset"]
        answer = extract_answer(response)
        info: dict[str, Any] = {"dataset": name, "extracted": answer if answer is None else answer[:500]}
        if answer is None:
            return 0.0, {**info, "reason": "no <answer> tags or final-answer line"}
        if len(answer) > self.max_answer_chars:
            return 0.0, {**info, "reason": f"answer over {self.max_answer_chars} chars"}
        config = json.dumps(meta.get("config", {}), sort_keys=True)
        entry = meta.get("entry")
        if "index" in meta and not meta.get("exact"):
            regenerated = _regenerated(name, meta["seed"], meta["size"], config, meta["index"])
            if entry is None or regenerated["question"] == entry["question"]:
                entry = regenerated  # else another reasoning-gym version: grade against the stored copy
        if entry is None:
            raise ValueError(f"task {task.id}: meta has neither an 'entry' nor its dataset coordinates")
        if reason := _unsafe(name, answer, entry["answer"]):
            return 0.0, {**info, "reason": reason}
        dataset = _dataset(name, meta.get("seed"), meta.get("size"), config)
        reward = float(dataset.score_answer(answer, entry))
        return min(max(reward, 0.0), 1.0), info

    @classmethod
    def generate_tasks(cls, n: int, seed: int, datasets: dict[str, float] | list[str] | None = None,
                       configs: dict[str, dict[str, Any]] | None = None, **options: Any) -> list[Task]:
        """``n`` puzzles mixed from ``datasets`` (names with weights; a list means equal weights), deterministic in
        ``seed``; ``configs`` gives dataset-specific settings (e.g. ``{"sudoku": {"min_empty": 20}}``)."""
        import reasoning_gym
        from reasoning_gym.composite import DatasetSpec

        _options(options, {"max_answer_chars"}, "ReasoningGymEnv.generate_tasks()")
        weights = dict.fromkeys(datasets, 1.0) if isinstance(datasets, list) else dict(datasets or DEFAULT_DATASETS)
        configs = configs or {}
        if unknown := [d for d in [*weights, *configs] if d not in reasoning_gym.factory.DATASETS]:
            raise ValueError(f"unknown reasoning-gym datasets {unknown}; see reasoning_gym.factory.DATASETS")
        if refused := sorted(UNSUPPORTED & set(weights)):
            raise ValueError(f"datasets {refused} are not supported: their scorers evaluate model text")
        # reasoning-gym seeds item i with seed + i: spread the seeds so that nearby task seeds (train 1, eval 2)
        # do not share items
        base_seed = seed * 1_000_003
        mix = reasoning_gym.create_dataset(
            "composite", size=max(n, 1), seed=base_seed,
            datasets=[DatasetSpec(name, w, dict(configs.get(name, {}))) for name, w in weights.items()])
        tasks = []
        for i in range(n):
            entry = mix[i]
            name = entry["metadata"]["source_dataset"]
            copy = to_json(entry)
            meta = {"dataset": name, "seed": mix.datasets[name].seed, "size": max(n, 1),
                    "config": to_json(configs.get(name, {})), "index": entry["metadata"]["source_index"],
                    "entry": copy, "exact": copy == entry}
            tasks.append(Task(f"puzzle-{seed}-{i}", entry["question"].rstrip() + INSTRUCTION, str(entry["answer"]),
                              meta))
        return tasks


register("puzzles", ReasoningGymEnv)
