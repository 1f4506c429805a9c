"""From completions to rewarded samples (through the environments), and held-out evaluation."""

from __future__ import annotations

from collections import Counter
from typing import Any

from rich.progress import Progress

from engines.inference import SamplingParams
from engines.tokenizer import TextTokenizer
from envs import Task, registry
from rl.algorithm import Sample
from rl.config import Config
from rl.data import env_class
from rl.partial import Trajectory


def run_episode(cfg: Config, task: Task, text: str) -> tuple[float, dict[str, Any]]:
    """One single-turn episode of the configured environment: reset on the task, step the text."""
    env = registry.make(cfg.env.name, **cfg.env.kwargs)
    env.reset(options={"task": task})
    _, reward, _, _, info = env.step(text)
    return reward, info


def task_type_of(task: Task, cfg: Config) -> str:
    """A task's type (budgets, temperatures and metrics are per type): ``meta.task_type`` or the env's."""
    return str(task.meta.get("task_type") or env_class(cfg).task_type)


def score(groups: list[list[Trajectory]], tasks: list[Task], tok: TextTokenizer, cfg: Config):
    """Reward every finished trajectory of the completed prompt groups through the environment.

    A response that exhausted its token budget gets its task type's truncation penalty instead of
    its reward. An environment that raises, or a request the engine refused, costs that trajectory
    only: it is left out of the loss and counted.
    """
    samples, errors, first_error = [], 0, None
    n_type: Counter[str] = Counter()
    truncated: Counter[str] = Counter()
    reward_sum: Counter[str] = Counter()
    lengths = []
    for group in groups:
        for traj in group:
            task = tasks[traj.task_index]
            ttype = task_type_of(task, cfg)
            n_type[ttype] += 1
            lengths.append(len(traj.token_ids))
            try:
                if traj.finish_reason == "error":
                    raise RuntimeError(f"the inference engine refused the request: {traj.error}")
                reward, _ = run_episode(cfg, task, tok.decode(traj.token_ids))
            except Exception as e:
                errors += 1
                first_error = first_error or f"task {task.id}: {type(e).__name__}: {e}"
                continue
            if traj.finish_reason == "length":
                truncated[ttype] += 1
                reward = cfg.task_type(ttype)[1]
            reward_sum[ttype] += reward
            samples.append(Sample(traj.group, traj.prompt_ids, traj.token_ids, traj.logprobs, reward,
                                  temperature=traj.params.temperature))
    n = max(1, sum(n_type.values()))
    stats = {
        "reward_mean": sum(s.reward for s in samples) / max(1, len(samples)),
        "response_len": sum(lengths) / max(1, len(lengths)),
        "truncation_rate": sum(truncated.values()) / n,
        "env_errors": errors,
        "trained_samples": len(samples),
    }
    if len(n_type) > 1 or cfg.rollout.task_types:
        for ttype, count in sorted(n_type.items()):
            stats[f"truncation_rate/{ttype}"] = truncated[ttype] / count
            stats[f"reward_mean/{ttype}"] = reward_sum[ttype] / count
    if first_error:
        stats["first_env_error"] = first_error
    return samples, stats


def evaluate(cluster, tasks: list[Task], tok: TextTokenizer, cfg: Config, progress: Progress | None = None) -> dict:
    """Greedy accuracy on held-out tasks: the fraction with reward 1 (errors count as wrong)."""
    bar = progress.add_task("held-out eval (greedy)", total=len(tasks)) if progress else None
    params = [SamplingParams(0.0, cfg.task_type(task_type_of(t, cfg))[0]) for t in tasks]
    outs = cluster.generate([tok.encode(t.prompt) for t in tasks], params, seed=0,
                            on_chunk=(lambda n: progress.advance(bar, n)) if progress else None)
    if progress:
        progress.remove_task(bar)
    correct = 0
    for t, c in zip(tasks, outs, strict=True):
        try:
            correct += run_episode(cfg, t, tok.decode(c.token_ids))[0] >= 1.0 and c.finish_reason == "stop"
        except Exception:
            pass
    return {"accuracy": correct / len(tasks), "response_len": sum(len(c.token_ids) for c in outs) / len(outs)}
