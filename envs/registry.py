"""Environments by name: built-ins, ``register`` calls, and the ``rl.envs`` entry-point group.

Every registered environment is also registered with gymnasium as ``rl/NAME``, so
``gymnasium.make("rl/arithmetic")`` builds it.
"""

from __future__ import annotations

import importlib
from importlib import metadata
from typing import Any

import gymnasium

from envs.base import Env

ENTRY_POINT_GROUP = "rl.envs"
BUILTIN_MODULES = ("envs.arithmetic", "envs.math", "envs.puzzles", "envs.code", "envs.swe", "envs.rubric")
_REGISTRY: dict[str, type[Env]] = {}
_loaded_plugins = False


class UnknownEnvironmentError(KeyError):
    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


def register(name: str, cls: type[Env]) -> None:
    """Register ``cls`` under ``name`` (and as ``rl/NAME`` in gymnasium)."""
    if not (isinstance(cls, type) and issubclass(cls, Env)):
        raise TypeError(f"environment {name!r} must be a subclass of envs.Env, got {cls!r}")
    _REGISTRY[name] = cls
    gym_id = f"rl/{name}"
    if gym_id not in gymnasium.registry:
        gymnasium.register(id=gym_id, entry_point=cls, disable_env_checker=True)


def _load_plugins() -> None:
    global _loaded_plugins
    if _loaded_plugins:
        return
    _loaded_plugins = True
    for module in BUILTIN_MODULES:  # built-ins register themselves on import
        importlib.import_module(module)

    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in _REGISTRY:
            register(ep.name, ep.load())


def registered() -> list[str]:
    """Names of all environments, plug-ins included."""
    _load_plugins()
    return sorted(_REGISTRY)


def get(name: str) -> type[Env]:
    """The environment class registered as ``name``."""
    _load_plugins()
    if name not in _REGISTRY:
        raise UnknownEnvironmentError(
            f"environment {name!r} is not registered; registered: {', '.join(sorted(_REGISTRY))}"
        )
    return _REGISTRY[name]


def make(name: str, **kwargs: Any) -> Env:
    """Build the environment registered as ``name``."""
    return get(name)(**kwargs)
