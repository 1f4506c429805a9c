"""The reward phase: every ended sample of the iteration's completed groups gets its reward, in one place.

Single-turn samples are scored by their environments (one-turn episodes, stepped concurrently:
``rollout.env_workers``; group-level environments, e.g. a critic comparing the K responses, score a prompt's
responses together); multi-turn samples bring the reward their environment gave when the episode ended. ``settle``
then treats every sample alike: a truncated one (its token budget, its turns, the context) takes its task type's
truncation penalty instead of its reward, an error (an environment that raised or timed out, a request the engine
refused) costs that sample only — it is left out of the loss and counted, the first one named — and the per-type
statistics are computed there.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from typing import Any

from engines.inference.sampling import SamplingParams
from engines.model.text.tokenizer import TextTokenizer
from rl.config import Config
from rl.errors import TrainingStopped
from rl.rollout.data import TaskSets
from rl.rollout.episodes import EpisodeRunner, env_class, sandbox_restarts
from rl.sample import Sample
from rl.seeds import critic_seed
from rl.settings import TaskTypes


def check_reward(reward: Any, env_name: str, task_id: str) -> float:
    """``reward`` as a float, or TrainingStopped naming the environment and task when it is NaN or infinite."""
    try:
        value = float(reward)
    except (TypeError, ValueError):
        raise TrainingStopped(f"environment {env_name!r} returned a reward that is not a number ({reward!r}) "
                              f"for task {task_id}; the update was not applied") from None
    if not math.isfinite(value):
        raise TrainingStopped(f"environment {env_name!r} returned a non-finite reward ({value}) for task {task_id}; "
                              "the update was not applied")
    return value


def score(groups: list[list[Sample]], tasks: TaskSets, tok: TextTokenizer, runner: EpisodeRunner) -> None:
    """Set the reward of every single-turn sample of ``groups`` that ended on its own or at its budget (a truncated
    one's penalty replaces its reward in ``settle``, but its environment still sees it: an environment that fails on
    it fails there), or its error."""
    for s in (s for g in groups for s in g if not s.multi_turn and s.status == "error"):
        s.error = f"the inference engine refused the request: {s.error}"
    grouped = [[s for s in g if s.status != "error"] for g in groups
               if not g[0].multi_turn and env_class(tasks.train_entry(g[0].task_index)).group_level]
    grouped = [g for g in grouped if g]
    outs = runner.map_groups([(tasks.train_entry(g[0].task_index), tasks.train[g[0].task_index],
                               [tok.decode(s.response_ids.tolist()) for s in g]) for g in grouped])
    for g, (rewards, err) in zip(grouped, outs, strict=True):
        for j, s in enumerate(g):
            if err:
                s.status, s.error = "error", err
            else:
                s.reward = rewards[j]
    judged = {s.key for g in grouped for s in g}
    single = [s for g in groups for s in g if not s.multi_turn and s.status != "error" and s.key not in judged]
    results = runner.map([(tasks.train_entry(s.task_index), tasks.train[s.task_index],
                           tok.decode(s.response_ids.tolist())) for s in single])
    for s, r in zip(single, results, strict=True):
        if r.error:
            s.status, s.error = "error", r.error
        else:
            s.reward = r.reward


def settle(samples: list[Sample], tasks: TaskSets, types: TaskTypes, template_errors: int = 0
           ) -> tuple[list[Sample], dict[str, Any]]:
    """The samples to train on, each with its final reward (the truncation penalty where truncated; a non-finite
    reward stops the run naming its environment and task), and the iteration's reward statistics: overall, per
    task type (with several types or ``rollout.task_types``), and of multi-turn episodes where there are any."""
    trained: list[Sample] = []
    n_type: Counter[str] = Counter()
    truncated: Counter[str] = Counter()
    reward_sum: Counter[str] = Counter()
    errors, first_error = 0, None
    multi = [s for s in samples if s.multi_turn]
    multi_errors = 0
    for s in samples:
        task, entry, name = tasks.train[s.task_index], tasks.train_entry(s.task_index), s.task_type.name
        n_type[name] += 1
        error = s.error if s.status == "error" else "no tokens generated" if s.multi_turn and not s.own_tokens() \
            else None
        if error is not None:
            errors += 1
            multi_errors += s.multi_turn
            first_error = first_error or f"env {entry.name!r}, task {task.id}: {error}"
            continue
        if s.reward is not None or s.status != "truncated":  # an episode cut off by its turns may have none
            reward = check_reward(s.reward, entry.name, task.id)
        if s.status == "truncated":
            truncated[name] += 1
            reward = s.task_type.truncation_penalty
        s.reward = reward
        reward_sum[name] += reward
        trained.append(s)
    n = max(1, len(samples))
    stats: dict[str, Any] = {
        "reward_mean": sum(s.reward for s in trained) / max(1, len(trained)),
        "response_len": sum(s.own_tokens() for s in samples) / n,
        "truncation_rate": sum(truncated.values()) / n,
        "env_errors": errors,
        "trained_samples": len(trained),
    }
    if len(n_type) > 1 or types.named:
        for name, count in sorted(n_type.items()):
            stats[f"truncation_rate/{name}"] = truncated[name] / count
            stats[f"reward_mean/{name}"] = reward_sum[name] / count
    if multi:
        stats.update({"multi_turn_episodes": len(multi), "multi_turn_errors": multi_errors,
                      "multi_turn_turns": sum(s.turns for s in multi) / len(multi),
                      "multi_turn_truncated": sum(s.status == "truncated" for s in multi),
                      "multi_turn_template_errors": template_errors})
    if first_error:
        stats["first_env_error"] = first_error
    stats.update(sandbox_recoveries())
    return trained, stats


def sandbox_recoveries() -> dict[str, int]:
    """Over the run so far (when any happened): restarts of its own sandbox service, and one-shot runs that the
    sandbox infrastructure cut off and that were run once more."""
    from sandbox.client import runs_retried  # loaded where a run has code to run

    counts = {"sandbox_restarts": sandbox_restarts(), "sandbox_retries": runs_retried()}
    return counts if any(counts.values()) else {}


def policy_critic(rollouts, tok: TextTokenizer, types: TaskTypes, seed: int):
    """The policy itself as the critic, on the shared inference engines (task type "critic" sets its budget and
    temperature)."""
    critic = types.get("critic")
    lock = threading.Lock()  # episodes call it from several threads; the engines take one batch at a time

    def generate(prompts: list[str]) -> list[str]:
        params = [SamplingParams(critic.temperature.start, critic.max_tokens) for _ in prompts]
        with lock:
            outs = rollouts.generate([tok.encode(p) for p in prompts], params, seed=seed)
        return [tok.decode(c.token_ids) for c in outs]

    return generate


def episode_runner(rollouts, cfg: Config, tasks: TaskSets, tok: TextTokenizer, types: TaskTypes,
                   it: int) -> EpisodeRunner:
    """The iteration's environment runner, with the policy attached as critic where an environment judges."""
    critic = policy_critic(rollouts, tok, types, critic_seed(cfg.run.seed, it)) \
        if any(env_class(e).group_level for e in tasks.entries) else None
    return EpisodeRunner(cfg, critic=critic)


def reward_phase(groups: list[list[Sample]], tasks: TaskSets, tok: TextTokenizer, types: TaskTypes,
                 runner: EpisodeRunner, template_errors: int = 0) -> tuple[list[Sample], dict[str, Any]]:
    """The iteration's training samples and reward metrics: the completed groups scored and settled."""
    score(groups, tasks, tok, runner)
    return settle([s for g in groups for s in g], tasks, types, template_errors)
