"""The Python API: ``rl.train`` runs what ``rl train`` runs, from a dict, a YAML file or a ``Config``, and takes Python
objects where a config takes names and files.

    import rl

    summary = rl.train("configs/quickstart.yaml", "runs/nb", overrides={"run.iterations": 10})
    summary = rl.train({"model": {"path": "runs/nb/final"}, "env": {"num_eval": 64}}, "runs/mine",
                       reward=my_reward, train_tasks=[{"prompt": "2 + 3 =", "answer": "5"}, ...], eval_tasks=held_out)

- A reward function (``reward=``, or ``reward: {function: fn}`` in an entry of a dict config) may be a Python
  callable. One importable by name (a module-level function of a module on ``sys.path``) is recorded as
  ``"module:fn"``, as a config names it; any other (defined in a notebook or a script, a lambda, a closure) is
  registered as an environment of this process named ``python:QUALNAME`` (``<>`` left out, so a closure ``fn``
  of ``outer`` is ``python:outer.locals.fn``), which config.yaml records: a resume passes the function again
  (``rl.train(run_dir=..., resume=True, reward=fn)``).
- Tasks (``train_tasks=``/``eval_tasks=``, or those keys of an entry) may be a list of dicts (task records, any
  layout ``load_tasks`` reads) or of ``envs.Task``, written as JSONL, or a ``datasets.Dataset``, saved with
  ``save_to_disk``; both go to ``RUN_DIR/tasks/`` and config.yaml names the files, so the run resumes from them.

The keyword arguments apply to the single ``env``; a task mix (``envs``) takes them in each entry.
"""

from __future__ import annotations

import importlib
import json
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rich.console import Console

from rl.config import Config, _set, parse_config, read_yaml
from rl.errors import UserError

TASKS_DIR = "tasks"
PYTHON_PREFIX = "python:"  # environments registered for Python reward functions


def run(cfg: Config, run_dir: Path, resume: bool = False, console: Console | None = None) -> dict:
    """The run ``rl train`` starts: ``rl.loop.controller.train`` inside the trackers of ``metrics.loggers``, which
    get the summary and curves at the end; returns the summary."""
    from rl.loop.controller import train as train_loop
    from rl.loop.trackers import tracking

    console = console or Console()
    with tracking(cfg, run_dir, console, resume) as trackers:
        summary = train_loop(cfg, run_dir, resume=resume, console=console)
        trackers.finish(summary, run_dir / "curves.png")
    return summary


def train(config: Config | Mapping[str, Any] | str | Path | None = None, run_dir: str | Path | None = None, *,
          reward: Any = None, train_tasks: Any = None, eval_tasks: Any = None,
          overrides: Mapping[str, Any] | None = None, resume: bool = False, console: Console | None = None) -> dict:
    """Run (or ``resume``) an RL run as ``rl train`` does and return its summary. ``config``: a ``Config``, a dict of
    sections, or a YAML path (with ``resume``, None reads ``RUN_DIR/config.yaml``); ``overrides``: dotted keys to
    values (``{"run.iterations": 2}``); ``reward``, ``train_tasks``, ``eval_tasks``: the single env's (see the
    module). ``run_dir`` defaults to ``runs/NAME-TIMESTAMP``."""
    if resume:
        if run_dir is None or not (Path(run_dir) / "config.yaml").is_file():
            raise UserError(f"resume: {run_dir} is not a run directory (no config.yaml)")
        if train_tasks is not None or eval_tasks is not None:
            raise UserError(f"resume: the run's tasks are those its config.yaml names (in {run_dir}/{TASKS_DIR})")
        if reward is not None and not callable(reward):
            raise UserError("resume: the run's rewards are those its config.yaml names (a Python function may be "
                            "given again: reward=fn)")
        if reward is not None:
            register_reward(reward)  # config.yaml names it; an importable one is imported by that name
            reward = None
    raw, source = _raw(Path(run_dir) / "config.yaml" if resume and config is None else config)
    for key, value in (overrides or {}).items():
        _set(raw, key, value)
    run_dir = Path(run_dir) if run_dir is not None else \
        Path(f"runs/{(raw.get('run') or {}).get('name', 'run')}-{time.strftime('%Y%m%d-%H%M%S')}")
    if not resume and (run_dir / "checkpoints").exists():
        raise UserError(f"run_dir {run_dir} already holds a run; resume it with resume=True")
    given = {k: v for k, v in (("train_tasks", train_tasks), ("eval_tasks", eval_tasks)) if v is not None}
    if reward is not None:
        given["reward"] = reward if isinstance(reward, Mapping) else {"function": reward}
    if given:
        if raw.get("envs"):
            raise UserError("rl.train's reward, train_tasks and eval_tasks are the single env's; with a task mix "
                            "(envs) give them in each entry")
        raw["env"] = {**(raw.get("env") or {}), **given}
    entries = [("env", raw["env"])] if isinstance(raw.get("env"), dict) else []
    entries += [(f"envs{i}", e) for i, e in enumerate(raw.get("envs") or []) if isinstance(e, dict)]
    for label, entry in entries:
        _python_objects(entry, label, run_dir)
    cfg = parse_config(raw, source)
    for i, entry in enumerate(cfg.env_entries):
        _check_registered(entry.name, f"envs[{i}]" if cfg.envs else "env")
    return run(cfg, run_dir, resume, console)


def _raw(config: Config | Mapping[str, Any] | str | Path | None) -> tuple[dict[str, Any], str]:
    """The config as a dict of sections to validate, and what to call it in errors."""
    if config is None:
        return {}, "(defaults)"
    if isinstance(config, Config):
        return config.model_dump(), "(Config)"
    if isinstance(config, (str, Path)):
        raw = read_yaml(config)
        if raw is not None and not isinstance(raw, dict):
            raise UserError(f"invalid config {config}: the top level must be a mapping of sections")
        return raw or {}, str(config)
    if isinstance(config, Mapping):
        return _copy(config), "(dict)"
    raise UserError(f"rl.train: config must be a Config, a dict or a YAML path, got {type(config).__name__}")


def _copy(tree: Any) -> Any:
    """Dicts and lists copied (overrides must not change the caller's), everything else as it is."""
    if isinstance(tree, Mapping):
        return {k: _copy(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_copy(v) for v in tree]
    return tree


def _python_objects(entry: dict[str, Any], label: str, run_dir: Path) -> None:
    """An entry's Python reward function and task objects as the names and files a config holds."""
    for split in ("train_tasks", "eval_tasks"):
        if entry.get(split) is not None:
            entry[split] = write_tasks(entry[split], run_dir / TASKS_DIR / f"{label}-{split.split('_')[0]}")
    reward = entry.get("reward")
    if not (isinstance(reward, Mapping) and callable(reward.get("function"))):
        return
    fn = reward["function"]
    spec = importable_name(fn)
    if spec is not None:
        entry["reward"] = {**reward, "function": spec}
        return
    rest = {k: v for k, v in entry.items() if k != "reward"}
    if "name" not in rest and not (rest.get("train_tasks") and rest.get("eval_tasks")):  # as EnvConfig says it
        raise UserError(f"{label}: with reward, the tasks come from train_tasks and eval_tasks (give both) or from "
                        "the environment `name` names")
    source = {"name": rest["name"], "kwargs": rest.get("kwargs") or {}} if "name" in rest else None
    entry.clear()
    if reward.get("relative"):
        from envs.reward_function import takes_group

        if not takes_group(fn):
            raise UserError(f"{label}.reward.relative: only a group function (one that takes responses or "
                            "completions) compares responses")
    entry.update(rest, name=register_reward(fn), kwargs={"relative": True} if reward.get("relative") else {},
                 tasks_from=source)


def write_tasks(tasks: Any, stem: Path) -> str:
    """A task source as config text: a path as it is; a list of task records (dicts) or ``envs.Task`` written to
    ``STEM.jsonl``; a ``datasets.Dataset`` saved to the directory ``STEM``."""
    if isinstance(tasks, (str, Path)):
        return str(tasks)
    stem.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(tasks, (list, tuple)):
        from envs import Task
        from envs.tasks import save_tasks

        path = stem.with_suffix(".jsonl")
        if tasks and all(isinstance(t, Task) for t in tasks):
            save_tasks(list(tasks), path)
            return str(path)
        lines = []
        for i, rec in enumerate(tasks):
            if not isinstance(rec, Mapping):
                raise UserError(f"{stem.name}: task {i} is a {type(rec).__name__}; give dicts (task records) or "
                                "envs.Task objects")
            try:
                lines.append(json.dumps(dict(rec)) + "\n")
            except (TypeError, ValueError) as e:
                raise UserError(f"{stem.name}: task {i} is not JSON: {e}") from None
        path.write_text("".join(lines))
        return str(path)
    from datasets import Dataset, DatasetDict

    if isinstance(tasks, DatasetDict):
        raise UserError(f"{stem.name}: a DatasetDict holds the splits {', '.join(tasks)}: give one, e.g. "
                        f"dataset[{next(iter(tasks), 'train')!r}]")
    if isinstance(tasks, Dataset):
        tasks.save_to_disk(str(stem))
        return str(stem)
    raise UserError(f"{stem.name}: give a path, a list of task records or a datasets.Dataset, not "
                    f"{type(tasks).__name__}")


def importable_name(fn: Callable[..., Any]) -> str | None:
    """``"module:fn"`` when ``fn`` is that module's attribute (so another process imports it by that name)."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or module.startswith("_rl_reward_") or not name.isidentifier():
        return None
    try:
        found = getattr(importlib.import_module(module), name, None)
    except Exception:  # a module that cannot be imported again by name
        return None
    return f"{module}:{name}" if found is fn else None


def register_reward(fn: Callable[..., Any]) -> str:
    """Register a Python reward function as an environment of this process (``function`` or ``group_function``
    by its parameters, as a config's would be); returns its name, ``python:QUALNAME``."""
    from envs.registry import register
    from envs.reward_function import FunctionEnv, GroupFunctionEnv, RewardFunctionError, takes_group

    qualname = getattr(fn, "__qualname__", type(fn).__name__)
    base = GroupFunctionEnv if takes_group(fn) else FunctionEnv

    def __init__(self: Any, tasks: Any = None, **kwargs: Any) -> None:
        base.__init__(self, tasks, function=fn, **kwargs)  # relative=True for a group function that ranks

    cls = type("PythonReward", (base,), {"__init__": __init__, "__module__": __name__,
                                          "__doc__": f"Reward: the Python function {qualname} (rl.train)."})
    try:
        cls()  # a signature the environment cannot call: one line now, not an error per episode
    except RewardFunctionError as e:
        raise UserError(f"reward: {e}") from None
    # an environment name is also a gymnasium id (letters, digits, _ : . -): outer.<locals>.fn is outer.locals.fn
    name = PYTHON_PREFIX + re.sub(r"[^\w:.-]", "", qualname)
    register(name, cls)
    return name


def _check_registered(name: str, where: str) -> None:
    from envs import registry

    if name.startswith(PYTHON_PREFIX) and name not in registry.registered():
        raise UserError(f"{where}.name {name!r} is a Python reward function given to rl.train: pass it again "
                        f"(rl.train(..., reward=fn)) to run this config")
