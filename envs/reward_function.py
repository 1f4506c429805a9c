"""Rewards from a plain Python function, without writing an environment: ``function`` (one response at a time) and
``group_function`` (a prompt's K responses at once).

The function is named ``"package.module:fn"`` (importable where the environments run) or ``"path/to/file.py:fn"``
(loaded from the file), or given as a Python callable. It may be ``async``. Its parameters are matched by name,
so the usual signatures work as they are:

- per response (env ``function``): ``fn(prompt, response, answer, **info) -> float``. Available names: ``prompt``
  (the task's text), ``response``, ``answer`` (the reference, "" when none), ``task_id``, ``messages`` (the prompt
  as chat messages, or None), ``meta`` (the task's meta dict) and each of the meta's keys, plus verl's names
  ``data_source``, ``solution_str`` (= response), ``ground_truth`` (= the raw ``reward_model.ground_truth`` when
  the task came from verl's layout, else the answer) and ``extra_info``: a verl
  ``compute_score(data_source, solution_str, ground_truth, extra_info=None)`` works unchanged, and may return a
  dict with a ``"score"`` as verl allows;
- per group (env ``group_function``): ``fn(prompts, responses, answers, **info) -> list[float]``, one reward per
  response in order; each name above is available in the plural or as a list (``prompts``, ``responses``,
  ``answers``, ``task_ids``, and every meta key as a list of K equal values). A function that takes
  ``completions`` is called as TRL calls reward functions — ``fn(prompts, completions, **kwargs)`` — with
  prompts and completions as chat messages when the task is (``[{"role": "assistant", "content": ...}]``).
  As in TRL, the lists are for batching: each response's reward is taken as its own, and a held-out response is
  scored as a group of one. A function whose rewards compare the responses (a ranking) is declared with
  ``relative=True`` (``reward.relative`` in a config); held-out evaluation then leaves it out.

A parameter of neither kind, without a default, is an error when the environment is made; ``**kwargs`` receives
every name. A function that raises, or returns NaN, infinity or not a number, costs the episode (per group:
the group) as an environment error, counted in ``env_errors``; it never becomes a reward.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import math
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from envs.base import Env, Task
from envs.registry import register

GROUP_NAMES = frozenset({"prompts", "responses", "completions", "answers", "task_ids"})
SAMPLE_NAMES = ("prompt", "response", "answer", "task_id", "messages", "meta", "data_source", "solution_str",
                "ground_truth", "extra_info")
#: what a group function may name: the per-group lists, and each per-response name but the response as a list
GROUP_ARGUMENTS = (*sorted(GROUP_NAMES), *(n for n in SAMPLE_NAMES if n not in ("response", "solution_str")))
_loaded: dict[str, Callable[..., Any]] = {}
_load_lock = threading.Lock()


class RewardFunctionError(ValueError):
    """A reward function that cannot be loaded or called as named; the message is one line."""


def load_function(spec: str | Callable[..., Any]) -> Callable[..., Any]:
    """The callable named by ``"module:fn"`` or ``"path/to/file.py:fn"`` (loaded once per process)."""
    if callable(spec):
        return spec
    if not isinstance(spec, str) or ":" not in spec:
        raise RewardFunctionError(f"reward function {spec!r}: give 'package.module:function' or "
                                  "'path/to/file.py:function'")
    with _load_lock:
        if spec in _loaded:
            return _loaded[spec]
        where, _, name = spec.rpartition(":")
        if where.endswith(".py"):
            path = Path(where).expanduser().absolute()
            if not path.is_file():
                raise RewardFunctionError(f"reward function {spec!r}: no file {path}")
            module_name = f"_rl_reward_{abs(hash(str(path)))}"
            loader = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(loader)
            sys.modules[module_name] = module  # dataclasses and pickling look their module up here
            try:
                loader.loader.exec_module(module)
            except Exception as e:
                del sys.modules[module_name]
                raise RewardFunctionError(f"reward function {spec!r}: {path} failed to run: "
                                          f"{type(e).__name__}: {e}") from None
        else:
            try:
                module = importlib.import_module(where)
            except Exception as e:
                raise RewardFunctionError(f"reward function {spec!r}: cannot import {where}: "
                                          f"{type(e).__name__}: {e}") from None
        fn = getattr(module, name, None)
        if not callable(fn):
            raise RewardFunctionError(f"reward function {spec!r}: {where} has no function {name!r}")
        _loaded[spec] = fn
        return fn


def takes_group(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` rewards a whole group (it names ``responses``, ``completions``, ``prompts``...)."""
    return bool(GROUP_NAMES & set(_parameters(fn)))


def reward_function_env(spec: str | Callable[..., Any]) -> str:
    """The environment name for a reward function: ``group_function`` or ``function``, from its parameters."""
    return "group_function" if takes_group(load_function(spec)) else "function"


def _parameters(fn: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # builtins without a signature
        return {}


def _check_signature(fn: Callable[..., Any], spec: Any, names: Sequence[str]) -> None:
    for p in _parameters(fn).values():
        if p.kind is p.VAR_POSITIONAL or (p.kind is p.POSITIONAL_ONLY and p.default is p.empty):
            raise RewardFunctionError(f"reward function {spec!r}: parameters are passed by name; "
                                      f"{p.name!r} is positional-only")
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty and p.name not in names:
            raise RewardFunctionError(f"reward function {spec!r}: parameter {p.name!r} is not one it can be given "
                                      f"({', '.join(names)}; a task's meta keys need a default)")


def _call(fn: Callable[..., Any], values: dict[str, Any]) -> Any:
    """``fn`` with the values its parameters name (all of them with ``**kwargs``); awaited when async."""
    params = _parameters(fn)
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        kwargs = values
    else:
        kwargs = {k: v for k, v in values.items() if k in params}
    result = fn(**kwargs)
    if inspect.isawaitable(result):
        result = _run(result)
    return result


def _run(awaitable: Any) -> Any:
    async def wait() -> Any:
        return await awaitable

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(wait())  # episodes run on worker threads, which have no event loop
    box: dict[str, Any] = {}  # called from inside a running loop: run it on a thread of its own

    def run() -> None:
        try:
            box["value"] = asyncio.run(wait())
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def as_reward(value: Any, what: str) -> float:
    """``value`` as a finite float (verl's ``{"score": ...}`` dicts included); ValueError otherwise."""
    if isinstance(value, dict) and "score" in value:
        value = value["score"]
    if isinstance(value, bool) or (not isinstance(value, (int, float)) and not hasattr(value, "__float__")):
        raise ValueError(f"{what} is not a number: {value!r}"[:300])
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"{what} is {reward}")
    return reward


def _sample_values(task: Task, response: str) -> dict[str, Any]:
    meta = task.meta
    truth = meta.get("reward_model", {}).get("ground_truth") if isinstance(meta.get("reward_model"), dict) else None
    return {**meta, "prompt": task.prompt, "response": response, "answer": task.answer, "task_id": task.id,
            "messages": task.messages, "meta": meta, "data_source": meta.get("data_source", ""),
            "solution_str": response, "ground_truth": task.answer if truth is None else truth,
            "extra_info": meta.get("extra_info") or {}}


def _group_values(task: Task, responses: Sequence[str], trl: bool) -> dict[str, Any]:
    k = len(responses)
    one = _sample_values(task, "")
    values = {key: [value] * k for key, value in one.items() if key not in ("response", "solution_str")}
    conversational = trl and task.messages is not None
    values.update(prompts=[task.messages if conversational else task.prompt] * k, responses=list(responses),
                  answers=[task.answer] * k, task_ids=[task.id] * k,
                  completions=[[{"role": "assistant", "content": r}] if conversational else r for r in responses])
    return values


class FunctionEnv(Env):
    """Single-turn: the reward is a Python function of the response (``function: "module:fn"`` or a file path)."""

    task_type = "function"
    requires_answer = False  # the function decides what it needs of the task

    def __init__(self, tasks: list[Task] | None = None, *, function: str | Callable[..., Any]) -> None:
        super().__init__(tasks)
        self.function_name = function if isinstance(function, str) else getattr(function, "__name__", repr(function))
        self.function = load_function(function)
        if takes_group(self.function) != self.group_level:
            other = "group_function" if takes_group(self.function) else "function"
            raise RewardFunctionError(f"reward function {self.function_name!r} takes "
                                      f"{'a group' if other == 'group_function' else 'one response'}: use the "
                                      f"environment {other!r}")
        _check_signature(self.function, self.function_name, GROUP_ARGUMENTS if self.group_level else SAMPLE_NAMES)

    def score(self, task: Task, response: str) -> tuple[float, dict[str, Any]]:
        return as_reward(_call(self.function, _sample_values(task, response)),
                         f"reward function {self.function_name!r} on task {task.id}"), {}


class GroupFunctionEnv(FunctionEnv):
    """Per group: one Python function call rewards a prompt's K responses together (TRL's reward functions)."""

    task_type = "group_function"
    group_level = True

    def __init__(self, tasks: list[Task] | None = None, *, function: str | Callable[..., Any],
                 relative: bool = False) -> None:
        super().__init__(tasks, function=function)
        self.relative = relative

    @classmethod
    def rewards_relative(cls, kwargs: dict[str, Any]) -> bool:
        """Declared by the ``relative`` argument: TRL's reward functions score each completion alone."""
        return bool(kwargs.get("relative", False))

    def score_group(self, task: Task, responses: Sequence[str]) -> tuple[list[float], dict[str, Any]]:
        """The function's rewards for ``responses``; a wrong count, NaN or non-number fails the group."""
        trl = "completions" in _parameters(self.function)
        out = _call(self.function, _group_values(task, responses, trl))
        what = f"reward function {self.function_name!r} on task {task.id}"
        if isinstance(out, (str, bytes)) or (not isinstance(out, Sequence) and not hasattr(out, "tolist")):
            raise ValueError(f"{what} returned {type(out).__name__}, not a list of rewards")
        out = list(out.tolist() if hasattr(out, "tolist") else out)
        if len(out) != len(responses):
            raise ValueError(f"{what} returned {len(out)} rewards for {len(responses)} responses")
        return [as_reward(r, f"{what}, response {i}") for i, r in enumerate(out)], {}

    def score(self, task: Task, response: str) -> tuple[float, dict[str, Any]]:
        """One response as a group of one (what a Gym user's ``step`` gets)."""
        rewards, info = self.score_group(task, [response])
        return rewards[0], info


register("function", FunctionEnv)
register("group_function", GroupFunctionEnv)
