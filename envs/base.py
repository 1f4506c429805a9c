"""The environment interface: a ``gymnasium.Env`` whose observations and actions are text.

A rollout calls ``reset(options={"task": task})`` to get the first observation (the prompt), then
``step(response)`` with each model response until ``terminated`` or ``truncated``. The reward comes
from ``step``. Single-turn environments terminate on the first step; multi-turn ones return the
next observation (tool results, a user turn) instead. An observation of a multi-turn environment given as chat
messages (``info["messages"]``) may show images: ``info["images"]`` holds one per ``{"type": "image"}`` content
part of those messages, in order (``engines.model.images.ImageRef``, a PIL image, a path or bytes).

The RL loop reads an environment's optional capabilities from the class attributes and methods declared
below with their defaults (``uses_sandbox``, ``group_level``/``score_group``, ``relative_rewards``, ``attach``,
``uses_tools``/``set_tool_format``, ``requires_answer``/``load_tasks``, ``generate_tasks``); a plug-in overrides only
what it uses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import gymnasium

from engines.model.images import ImageRef

if TYPE_CHECKING:
    from engines.model.text.chat_format import ToolFormat

MAX_TEXT = 1 << 16  # an action (a model response) is at most this many characters
MAX_OBSERVATION = 1 << 20  # a prompt or a tool result: SWE problem statements and outputs run long
_CHARSET = frozenset(chr(i) for i in range(32, 127)) | frozenset("\n\t")


class AnyText(gymnasium.spaces.Text):
    """Text of any Unicode characters, as prompts and model responses are; ``sample`` draws printable ASCII.

    gymnasium's ``Text`` holds only the characters of its ``charset``; a prompt with "×" or a response with an
    emoji would fall outside it, so membership here checks the type and the length alone.
    """

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length


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
    #: the images of the prompt, one per ``{"type": "image"}`` content part of ``messages``, in order
    #: (``engines.model.images``: paths or bytes, decoded only where the prompt is rendered)
    images: tuple[ImageRef, ...] = ()


class Env(gymnasium.Env):
    """Base class of text environments; subclasses implement ``score`` (or ``score_group``) or override ``step``."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}
    #: Short name of the task type, used for per-task budgets and metrics.
    task_type: str = "text"
    #: Multi-turn environments return the next observation from ``step`` until the episode ends; the RL loop
    #: then generates turn by turn and trains only on the model's own tokens.
    multi_turn: ClassVar[bool] = False
    #: True: the environment runs code in the sandbox service, and ``__init__`` accepts ``sandbox_address: str``
    #: (the run's service, ``host:port``), which the RL loop passes.
    uses_sandbox: ClassVar[bool] = False
    #: True: the RL loop calls ``score_group`` once per prompt's group of responses instead of ``step`` per
    #: response (a critic comparing them; TRL's reward functions, which take lists to batch). A subclass that
    #: defines ``score_group`` and does not set it is taken as group-level (older plug-ins keep working).
    group_level: ClassVar[bool] = False
    #: True: a response's reward depends on the other responses of its group (a critic ranking them, a pairwise
    #: judge), so a held-out response alone has none and held-out evaluation leaves the environment out (saying so
    #: once). False: each response's reward is its own, and held-out responses are scored one by one by ``step``.
    #: A group-level subclass that does not set it and has no ``score`` of its own is taken as relative.
    relative_rewards: ClassVar[bool] = False
    #: True: the model calls tools; the RL loop calls ``set_tool_format`` with the model family's tool-call format
    #: before each episode's ``reset``.
    uses_tools: ClassVar[bool] = False
    #: ``reset()`` with no task and no task list draws a task from ``generate_tasks`` (seeded by reset's seed)
    #: when the class overrides it; False where generating is too slow for a reset.
    generate_on_reset: ClassVar[bool] = True
    #: ``load_tasks`` rejects a record without a reference answer; False where the reward needs none (an answer
    #: is then optional and defaults to "").
    requires_answer: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "score_group" in vars(cls) and "group_level" not in vars(cls):
            cls.group_level = True
        declared = any("relative_rewards" in vars(c) for c in cls.__mro__ if c is not Env)
        if cls.group_level and not declared and cls.score is Env.score:
            cls.relative_rewards = True

    def __init__(self, tasks: list[Task] | None = None) -> None:
        self.observation_space = AnyText(MAX_OBSERVATION, min_length=0, charset=_CHARSET)
        self.action_space = AnyText(MAX_TEXT, min_length=0, charset=_CHARSET)
        self.tasks = tasks or []
        self.task: Task | None = None
        #: keyword arguments of ``generate_tasks`` for the tasks ``reset()`` generates (set by subclasses)
        self.generate_options: dict[str, Any] = {}
        #: what the last reset or step measured that differs from run to run (timings, sandbox ids): kept out of
        #: ``info`` so that ``info`` depends only on the seed and the action, as gymnasium's checker requires
        self.diagnostics: dict[str, Any] = {}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Start an episode on ``options["task"]``, else on a task drawn from ``self.tasks``, else on one made by
        ``generate_tasks``; the draw follows ``seed``."""
        super().reset(seed=seed)
        options = options or {}
        self.diagnostics = {}
        if "task" in options:
            self.task = options["task"]
        elif self.tasks:
            self.task = self.tasks[int(self.np_random.integers(len(self.tasks)))]
        elif self._generates():
            task_seed = int(self.np_random.integers(2**31 - 1))
            self.task = type(self).generate_tasks(1, task_seed, **self.generate_options)[0]
        else:
            raise ValueError(f"{type(self).__name__}.reset needs options['task'] or a task list")
        return self.task.prompt, {"task_id": self.task.id}

    @classmethod
    def _generates(cls) -> bool:
        own = getattr(cls.generate_tasks, "__func__", None) is not Env.generate_tasks.__func__
        return cls.generate_on_reset and own

    def step(self, action: str):
        """Grade a single-turn response: (observation, reward, terminated, truncated, info); the episode ends
        with the empty observation."""
        if self.task is None:
            raise RuntimeError("step() called before reset()")
        reward, info = self.score(self.task, action)
        return "", float(reward), True, False, info

    def score(self, task: Task, response: str) -> tuple[float, dict[str, Any]]:
        """Reward of ``response`` on ``task`` and details for logging."""
        raise NotImplementedError

    def score_group(self, task: Task, responses: Sequence[str]) -> tuple[list[float], dict[str, Any]]:
        """Rewards of all K ``responses`` to ``task`` (one per response, in order) and details for logging; only
        ``group_level`` environments implement it. An exception costs the whole group (counted as errors)."""
        raise NotImplementedError(f"{type(self).__name__} rewards responses one by one (group_level is False)")

    @classmethod
    def rewards_relative(cls, kwargs: dict[str, Any]) -> bool:
        """Whether the environment made with ``kwargs`` rewards responses relative to their group (see
        ``relative_rewards``); an environment whose kwargs decide it overrides this."""
        return cls.relative_rewards

    def attach(self, critic: Callable[[list[str]], list[str]]) -> None:
        """Receive the policy as a critic (prompts -> completions on the shared inference engine), attached by the
        RL loop to every environment it makes; the default ignores it (the rubric environment uses it)."""

    def set_tool_format(self, fmt: ToolFormat) -> None:
        """Use ``fmt`` (the model family's tool-call format, ``engines.model.text.chat_format``) to render and parse
        tool calls; called by the RL loop on ``uses_tools`` environments. The default stores it."""
        self.tool_format = fmt

    @classmethod
    def load_tasks(cls, path: str | Path, *, columns: dict[str, str] | None = None) -> list[Task]:
        """The tasks of a task file or dataset (``envs.tasks.load_tasks``, an answer required as ``requires_answer``
        says); an environment with its own record schema overrides this. ``columns`` maps the task fields to the
        dataset's column names."""
        from envs.tasks import load_tasks

        return load_tasks(path, require_answer=cls.requires_answer, columns=columns)

    @classmethod
    def generate_tasks(cls, n: int, seed: int) -> list[Task]:
        """Environments that can make their own data override this; others read task files."""
        raise NotImplementedError(f"{cls.__name__} does not generate tasks; give a task file")
