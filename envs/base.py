"""The environment interface: a ``gymnasium.Env`` whose observations and actions are text.

A rollout calls ``reset(options={"task": task})`` to get the first observation (the prompt), then
``step(response)`` with each model response until ``terminated`` or ``truncated``. The reward comes
from ``step``. Single-turn environments terminate on the first step; multi-turn ones return the
next observation (tool results, a user turn) instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import gymnasium

MAX_TEXT = 1 << 16
_CHARSET = frozenset(chr(i) for i in range(32, 127)) | frozenset("\n\t")


@dataclass(frozen=True)
class Task:
    """One prompt with what the environment needs to grade it."""

    id: str
    prompt: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)
    #: the prompt as chat messages (OpenAI format); when set, the model sees them rendered with its chat
    #: template (``TextTokenizer.prompt_ids``) and ``prompt`` is the last user message, for graders and logs
    messages: list[dict[str, Any]] | None = None


class Env(gymnasium.Env):
    """Base class of text environments; subclasses implement ``score`` or override ``step``."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}
    #: Short name of the task type, used for per-task budgets and metrics.
    task_type: str = "text"
    #: Multi-turn environments return the next observation from ``step`` until the episode ends; the RL loop
    #: then generates turn by turn and trains only on the model's own tokens.
    multi_turn: ClassVar[bool] = False
    #: True: ``__init__`` takes ``sandbox_address`` (the run's sandbox service), to run code
    uses_sandbox: ClassVar[bool] = False
    #: True: rewards come per prompt group, ``score_group`` (e.g. a critic comparing the K responses)
    group_level: ClassVar[bool] = False
    #: True: the episode parses tool calls; the loop sets the model family's format (``set_tool_format``)
    uses_tools: ClassVar[bool] = False

    def __init__(self, tasks: list[Task] | None = None) -> None:
        self.observation_space = gymnasium.spaces.Text(MAX_TEXT, charset=_CHARSET)
        self.action_space = gymnasium.spaces.Text(MAX_TEXT, charset=_CHARSET)
        self.tasks = tasks or []
        self.task: Task | None = None

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Start an episode on ``options["task"]``, or on a task drawn from ``self.tasks``."""
        super().reset(seed=seed)
        options = options or {}
        if "task" in options:
            self.task = options["task"]
        elif self.tasks:
            self.task = self.tasks[int(self.np_random.integers(len(self.tasks)))]
        else:
            raise ValueError(f"{type(self).__name__}.reset needs options['task'] or a task list")
        return self.task.prompt, {"task_id": self.task.id}

    def step(self, action: str):
        """Grade a single-turn response: (observation, reward, terminated, truncated, info)."""
        if self.task is None:
            raise RuntimeError("step() called before reset()")
        reward, info = self.score(self.task, action)
        return "", float(reward), True, False, info

    def score(self, task: Task, response: str) -> tuple[float, dict[str, Any]]:
        """Reward of ``response`` on ``task`` and details for logging."""
        raise NotImplementedError

    def score_group(self, task: Task, responses: Sequence[str]) -> tuple[list[float], dict[str, Any]]:
        """Rewards of the K ``responses`` to ``task`` together (``group_level`` environments)."""
        raise NotImplementedError(f"{type(self).__name__} rewards each response alone (group_level is False)")

    def attach(self, critic: Callable[[list[str]], list[str]]) -> None:
        """Take the policy as critic (prompts -> responses) where the environment judges with it; ignored here."""

    def set_tool_format(self, fmt: Any) -> None:
        """The tool-call format of the model family in training (``uses_tools`` environments parse calls in it)."""
        self.tool_format = fmt

    @classmethod
    def load_tasks(cls, path: str | Path) -> list[Task]:
        """The tasks of a task file; environments with records of their own override this."""
        from envs.tasks import load_tasks

        return load_tasks(path)

    @classmethod
    def generate_tasks(cls, n: int, seed: int) -> list[Task]:
        """Environments that can make their own data override this; others read task files."""
        raise NotImplementedError(f"{cls.__name__} does not generate tasks; give a task file")
