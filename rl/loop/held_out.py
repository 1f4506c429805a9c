"""What the loop does with held-out evaluations: the start's one line on what is evaluated, the collapse guard on the
signal the run has, the responses saved beside the metrics, and the summary's held-out figures (null where a metric
is not defined, never NaN)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rl.config import Config
from rl.errors import UserError
from rl.loop.health import CollapseGuard
from rl.loop.metrics import differs
from rl.rollout.data import TaskSets
from rl.rollout.evaluate import evaluated, left_out

HELD_OUT_DIR = "held_out"  # one JSONL of greedy responses per evaluation
#: the held-out figures a summary reports as initial_, final_ and best_ (the sampled accuracy: initial_ and final_)
SUMMARY_METRICS = ("accuracy", "eval_reward")


def held_out_line(cfg: Config, tasks: TaskSets) -> str | None:
    """What the held-out evaluation leaves out, said once at start (None: nothing); a run that asks for the collapse
    guard (``run.collapse_guard: true``) with no held-out task scored alone is refused in one line."""
    line = left_out(tasks)
    if not evaluated(tasks):
        if cfg.run.collapse_guard:
            raise UserError(f"run.collapse_guard: true needs held-out metrics, and this run has none ({line}); "
                            "set run.collapse_guard: false, or add held-out tasks of an environment that rewards "
                            "each response alone")
        return f"{line}; best/ and the collapse guard are off"
    return line


def make_guard(cfg: Config, tasks: TaskSets, best: float | None) -> CollapseGuard | None:
    """The collapse guard on ``run.best_metric``, resumed at ``best``; None where it is off or has nothing to
    watch (``held_out_line`` said why)."""
    held_out = len(evaluated(tasks))
    if cfg.run.collapse_guard is False or not held_out:
        return None
    return CollapseGuard(cfg.run.collapse_drop, best, cfg.run.collapse_drop_relative, held_out,
                         metric=cfg.run.best_metric)


def save_responses(run_dir: Path, name: str, metrics: dict[str, Any]) -> dict[str, Any]:
    """Write an evaluation's greedy responses to ``held_out/NAME.jsonl``; returns its metrics without them."""
    rows = metrics.pop("responses", None)
    if rows is not None:
        (run_dir / HELD_OUT_DIR).mkdir(parents=True, exist_ok=True)
        (run_dir / HELD_OUT_DIR / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return metrics


def start_line(start: dict[str, Any], prompts: int, samples: int) -> str:
    """The warm start's held-out figures, as printed."""
    sampled = "" if start.get("accuracy_sampled") is None else \
        f", sampled {start['accuracy_sampled']:.3f} (mean of {samples} at the rollout temperature)"
    reward = f", mean reward {start['eval_reward']:.3f}" if differs(start) else ""
    return f"warm start: held-out accuracy {start['accuracy']:.3f} on {prompts} prompts{reward}{sampled}"


def finite(value: Any) -> Any:
    """``value``, with NaN and infinities (which strict JSON has no words for) as None, in dicts and lists too."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


def summary_figures(records: list[dict[str, Any]], initial: dict[str, Any]) -> dict[str, Any]:
    """``initial_``, ``final_`` and ``best_`` of each held-out metric (None where the run never measured it), and
    the sampled accuracy's initial and final where it was measured."""
    out: dict[str, Any] = {}
    for key in SUMMARY_METRICS:
        seen = [r[key] for r in records if r.get(key) is not None]
        first = initial.get(key)
        out[f"initial_{key}"] = first
        out[f"final_{key}"] = seen[-1] if seen else first
        out[f"best_{key}"] = max([*seen, *([first] if first is not None else [])], default=None)
    if initial.get("accuracy_sampled") is not None:
        sampled = [r["accuracy_sampled"] for r in records if r.get("accuracy_sampled") is not None]
        out["initial_accuracy_sampled"] = initial["accuracy_sampled"]
        out["final_accuracy_sampled"] = sampled[-1] if sampled else initial["accuracy_sampled"]
    return out


def summary_line(summary: dict[str, Any]) -> str:
    """The held-out figures of a run's summary as ``rl train`` prints them at the end (the mean reward where it
    differs from the accuracy)."""
    def pair(key: str) -> tuple[Any, Any]:
        return summary.get(f"initial_{key}"), summary.get(f"final_{key}")

    if None in pair("accuracy"):
        return "no held-out metrics"
    line = "held-out accuracy {:.3f} -> {:.3f}".format(*pair("accuracy"))
    (r0, r1), (a0, a1) = pair("eval_reward"), pair("accuracy")
    if None not in (r0, r1) and (differs({"eval_reward": r0, "accuracy": a0}) or
                                 differs({"eval_reward": r1, "accuracy": a1})):
        line += f", mean reward {r0:.3f} -> {r1:.3f}"
    return line
