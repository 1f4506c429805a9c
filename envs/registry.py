"""Environments by name: built-ins, ``register`` calls, and the ``rl.envs`` entry-point group.

Every environment is also a gymnasium id ``rl/NAME``: ``import envs`` registers the built-ins and the installed
plug-ins with gymnasium lazily (by their ``module:Class`` path, nothing imported yet), so that
``gymnasium.make("rl/arithmetic")`` works right after it. A plug-in that fails to import is skipped with a warning
naming it; only a run that uses it fails, with its import error.
"""

from __future__ import annotations

import importlib
import logging
from importlib import metadata
from typing import Any

import gymnasium

from envs.base import Env

log = logging.getLogger(__name__)
ENTRY_POINT_GROUP = "rl.envs"
#: name -> module:Class of the environments that ship with the project
BUILTINS = {"arithmetic": "envs.arithmetic:ArithmeticEnv", "math": "envs.math:MathEnv",
            "puzzles": "envs.puzzles:ReasoningGymEnv", "code": "envs.code:CodeEnv", "swe": "envs.swe:SWEEnv",
            "rubric": "envs.rubric:RubricEnv", "function": "envs.reward_function:FunctionEnv",
            "group_function": "envs.reward_function:GroupFunctionEnv", "endpoint": "envs.reward_endpoint:EndpointEnv",
            "judge": "envs.reward_judge:JudgeEnv", "shapes": "envs.visual:ShapesEnv"}
BUILTIN_MODULES = tuple(dict.fromkeys(v.split(":")[0] for v in BUILTINS.values()))
_REGISTRY: dict[str, type[Env]] = {}
_FAILED: dict[str, str] = {}  # plug-ins that did not import: name -> why
_loaded_plugins = False


class UnknownEnvironmentError(KeyError):
    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


def _gym_register(name: str, entry_point: Any) -> None:
    gym_id = f"rl/{name}"
    if gym_id not in gymnasium.registry:
        gymnasium.register(id=gym_id, entry_point=entry_point, disable_env_checker=True)


def register(name: str, cls: type[Env]) -> None:
    """Register ``cls`` under ``name`` (and as ``rl/NAME`` in gymnasium)."""
    if not (isinstance(cls, type) and issubclass(cls, Env)):
        raise TypeError(f"environment {name!r} must be a subclass of envs.Env, got {cls!r}")
    _REGISTRY[name] = cls
    _gym_register(name, cls)


def register_gym_ids() -> None:
    """Make every built-in and installed plug-in a gymnasium id, without importing any of them."""
    for name, path in BUILTINS.items():
        _gym_register(name, path)
    for ep in _plugin_entry_points():
        _gym_register(ep.name, ep.value)


def _plugin_entry_points() -> list[metadata.EntryPoint]:
    try:
        return list(metadata.entry_points(group=ENTRY_POINT_GROUP))
    except Exception as e:  # a broken distribution's metadata must not break every run
        log.warning("cannot read the %s entry points: %s", ENTRY_POINT_GROUP, e)
        return []


def _load_plugins() -> None:
    global _loaded_plugins
    if _loaded_plugins:
        return
    _loaded_plugins = True
    for module in BUILTIN_MODULES:  # built-ins register themselves on import
        importlib.import_module(module)
    for ep in _plugin_entry_points():
        if ep.name in _REGISTRY:
            continue
        try:
            register(ep.name, ep.load())
        except Exception as e:  # one broken plug-in must not break runs that do not use it
            _FAILED[ep.name] = f"{type(e).__name__}: {e}"
            log.warning("environment plug-in %r (%s) failed to import and is skipped: %s", ep.name, ep.value,
                        _FAILED[ep.name])


def registered() -> list[str]:
    """Names of all environments, plug-ins included."""
    _load_plugins()
    return sorted(_REGISTRY)


def describe() -> list[tuple[str, str, str]]:
    """(name, "built-in" or "plug-in", first line of its docstring) of every environment, sorted by name."""
    _load_plugins()
    builtin_classes = set(BUILTINS.values())
    rows = []
    for name in sorted(_REGISTRY):
        cls = _REGISTRY[name]
        kind = "built-in" if f"{cls.__module__}:{cls.__qualname__}" in builtin_classes else "plug-in"
        doc = (cls.__doc__ or "").strip().splitlines()
        rows.append((name, kind, doc[0] if doc else ""))
    return rows


def get(name: str) -> type[Env]:
    """The environment class registered as ``name``."""
    _load_plugins()
    if name in _FAILED:
        raise UnknownEnvironmentError(f"environment plug-in {name!r} failed to import: {_FAILED[name]}")
    if name not in _REGISTRY:
        raise UnknownEnvironmentError(
            f"environment {name!r} is not registered; registered: {', '.join(sorted(_REGISTRY))}"
        )
    return _REGISTRY[name]


def make(name: str, **kwargs: Any) -> Env:
    """Build the environment registered as ``name``."""
    return get(name)(**kwargs)
