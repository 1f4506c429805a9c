"""From completions to rewarded samples (through the environments), and held-out evaluation."""

from __future__ import annotations

from typing import Any

from rich.progress import Progress

from engines.inference import Completion
from engines.tokenizer import TextTokenizer
from envs import Task, registry
from rl.algorithm import Sample
from rl.config import Config


def run_episode(cfg: Config, task: Task, text: str) -> tuple[float, dict[str, Any]]:
    """One single-turn episode of the configured environment: reset on the task, step the text."""
    env = registry.make(cfg.env.name, **cfg.env.kwargs)
    env.reset(options={"task": task})
    _, reward, _, _, info = env.step(text)
    return reward, info


def score(batch: list[Task], completions: list[Completion], tok: TextTokenizer, cfg: Config):
    """Reward every completion; K consecutive completions answer each task of ``batch``.

    A response that exhausted its token budget gets ``truncation_penalty`` instead of its reward.
    An environment that raises costs that trajectory only: it is left out of the loss and counted.
    """
    k = cfg.rollout.samples_per_prompt
    samples, errors, truncated, first_error = [], 0, 0, None
    for j, c in enumerate(completions):
        task = batch[j // k]
        try:
            reward, _ = run_episode(cfg, task, tok.decode(c.token_ids))
        except Exception as e:
            errors += 1
            first_error = first_error or f"task {task.id}: {type(e).__name__}: {e}"
            continue
        if c.finish_reason == "length":
            truncated += 1
            reward = cfg.rollout.truncation_penalty
        samples.append(Sample(j // k, c.prompt_ids, c.token_ids, c.logprobs, reward))
    n = max(1, len(completions))
    stats = {
        "reward_mean": sum(s.reward for s in samples) / max(1, len(samples)),
        "response_len": sum(len(c.token_ids) for c in completions) / n,
        "truncation_rate": truncated / n,
        "env_errors": errors,
        "rollout_tokens": sum(len(c.token_ids) for c in completions),
    }
    if first_error:
        stats["first_env_error"] = first_error
    return samples, stats


def evaluate(cluster, tasks: list[Task], tok: TextTokenizer, cfg: Config, progress: Progress | None = None) -> dict:
    """Greedy accuracy on held-out tasks: the fraction with reward 1 (errors count as wrong)."""
    bar = progress.add_task("held-out eval (greedy)", total=len(tasks)) if progress else None
    outs = cluster.generate([tok.encode(t.prompt) for t in tasks], 0.0, cfg.rollout.max_tokens, seed=0,
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
