"""Per-iteration metrics: ``metrics.jsonl``, a console line, Prometheus gauges, ``curves.png``, and the experiment
trackers open around the run (``rl.loop.trackers``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console

from rl.loop import trackers

CURVES = [("reward_mean", "mean reward (dots: held-out)"), ("accuracy", "held-out accuracy (greedy; dashed: sampled)"),
          ("response_len", "mean response length (tokens)")]


def _parses(line: str) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


def differs(rec: dict[str, Any]) -> bool:
    """Whether the held-out mean reward says more than the accuracy printed beside it (with 0/1 rewards that all
    end on their own they are the same number, printed once)."""
    reward, acc = rec.get("eval_reward"), rec.get("accuracy")
    return reward is not None and (acc is None or f"{reward:.3f}" != f"{acc:.3f}")


class MetricsLog:
    """Appends one JSON record per iteration and mirrors it to the console, Prometheus and the trackers."""

    def __init__(self, run_dir: Path, console: Console, prometheus_port: int | None = None,
                 resume_at: int | None = None) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.console = console
        self.records: list[dict[str, Any]] = []
        if resume_at is not None and self.path.exists():
            # keep what the checkpoint covers; later records belong to the interrupted attempt
            lines = [x for x in self.path.read_text().splitlines() if x.strip()]
            if lines and not _parses(lines[-1]):  # an append cut short (a full disk, a killed driver)
                lines.pop()
            self.records = [r for r in map(json.loads, lines) if r["iteration"] < resume_at]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in self.records))
        self.gauges: dict[str, Any] = {}
        self.prometheus = prometheus_port is not None
        if self.prometheus:
            from prometheus_client import start_http_server

            start_http_server(prometheus_port)

    def _export(self, rec: dict[str, Any]) -> None:
        from prometheus_client import Gauge

        for k, v in rec.items():
            if isinstance(v, (int, float)):
                if k not in self.gauges:  # "truncation_rate/math" -> rl_truncation_rate_math
                    self.gauges[k] = Gauge(f"rl_{k.replace('/', '_').replace('.', '_')}", f"RL run metric {k}")
                self.gauges[k].set(v)

    def record(self, rec: dict[str, Any]) -> None:
        self.records.append(rec)
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.prometheus:
            self._export(rec)
        tracking = trackers.current()
        if tracking is not None:
            tracking.log(rec)
        acc = rec.get("accuracy")
        if acc is not None and rec.get("accuracy_sampled") is not None:
            extra_acc = f"/{rec['accuracy_sampled']:.3f}"
        else:
            extra_acc = ""
        held_out_reward = f" (reward {rec['eval_reward']:.3f})" if differs(rec) else ""
        times = " ".join(f"{k.removeprefix('time_')}={rec[k]:.1f}s" for k in rec
                         if k.startswith("time_") and k not in ("time_onload", "time_offload"))
        extra = ""
        if rec.get("partial_paused") or rec.get("partial_resumed") or rec.get("partial_waiting_groups"):
            extra += f"  paused {rec['partial_paused']} resumed {rec['partial_resumed']}"
        if rec.get("max_logit") is not None:
            extra += f"  max-logit {rec['max_logit']:.1f}"
        if rec.get("env_errors"):
            extra += f"  env-errors {rec['env_errors']} (first: {str(rec.get('first_env_error', ''))[:160]})"
        if rec.get("entropy") is not None:
            extra += f"  H {rec['entropy']:.2f}  dlogp {rec['logprob_diff_mean']:.1e}"
        if rec.get("router_max_load") is not None:  # an MoE: its routers' health (rl.loop.health watches it)
            extra += f"  experts max-load {rec['router_max_load']:.2f}x cv {rec['router_load_cv']:.2f}"
            if rec.get("route_mismatch") is not None:
                extra += f" mismatch {rec['route_mismatch']:.1%}"
        self.console.print(
            f"iter {rec['iteration']:>4}  reward {rec['reward_mean']:.3f}  "
            f"acc {'  -  ' if acc is None else f'{acc:.3f}'}{extra_acc}{held_out_reward}  "
            f"len {rec['response_len']:.1f}  "
            f"trunc {rec['truncation_rate']:.2f}  T {rec['temperature']:.2f}{extra}  {times}",
            soft_wrap=True,
        )


def plot_curves(records: list[dict[str, Any]], path: Path,
                initial: dict[str, Any] | None = None) -> None:
    """Reward (dots: the held-out greedy mean), held-out accuracy (greedy, and sampled where measured) and response
    length against iteration, as one PNG; ``initial``: the warm start's held-out metrics, drawn at iteration -1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    initial = initial or {}
    fig, axes = plt.subplots(1, len(CURVES), figsize=(4.2 * len(CURVES), 3.4))
    for ax, (key, title) in zip(axes, CURVES, strict=True):
        pts = [(r["iteration"], r[key]) for r in records if r.get(key) is not None]
        if key == "accuracy" and initial.get("accuracy") is not None:
            pts = [(-1, initial["accuracy"]), *pts]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o" if key == "accuracy" else None, markersize=3)
        extra = {"accuracy": ("accuracy_sampled", "--"), "reward_mean": ("eval_reward", "")}.get(key)
        if extra is not None:
            more = [(r["iteration"], r[extra[0]]) for r in records if r.get(extra[0]) is not None]
            if more and initial.get(extra[0]) is not None:
                more = [(-1, initial[extra[0]]), *more]
            if more:
                xs, ys = zip(*more, strict=True)
                ax.plot(xs, ys, linestyle=extra[1], marker="o", markersize=3)
        ax.set_title(title)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
