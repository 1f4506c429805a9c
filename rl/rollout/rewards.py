"""From completions to rewarded samples (through the environments), and held-out evaluation."""

from __future__ import annotations

import threading
from collections import Counter

from rich.progress import Progress

from engines.inference.sampling import SamplingParams
from engines.model.tokenizer import TextTokenizer
from rl.algo.update import Sample
from rl.config import Config
from rl.loop.guards import check_reward
from rl.rollout.data import GROUPS_PER_ITERATION, TaskSets
from rl.rollout.episodes import EpisodeRunner, env_class, is_group_level, sandbox_restarts, solved, task_type_of
from rl.rollout.partial import Trajectory
from rl.seeds import critic_seed, eval_seed


def score(groups: list[list[Trajectory]], tasks: TaskSets, tok: TextTokenizer, cfg: Config,
          runner: EpisodeRunner | None = None):
    """Reward every finished trajectory of the completed prompt groups through its environment.

    Episodes run concurrently (``rollout.env_workers``). A response that exhausted its token budget
    gets its task type's truncation penalty instead of its reward. An environment that raises or
    times out, or a request the engine refused, costs that trajectory only: it is left out of the
    loss and counted.
    """
    trajs = [t for g in groups for t in g]
    entries = [tasks.train_entry(t.task_index) for t in trajs]
    own = runner is None
    runner = runner or EpisodeRunner(cfg)
    by_key: dict[int, tuple[float, str | None]] = {}
    try:
        # Group-level environments (a critic comparing the K responses) are scored once per group.
        grouped = [[t for t in g if t.finish_reason != "error"] for g in groups
                   if is_group_level(tasks.train_entry(g[0].task_index))]
        grouped = [g for g in grouped if g]
        outs = runner.map_groups([(tasks.train_entry(g[0].task_index), tasks.train[g[0].task_index],
                                   [tok.decode(t.token_ids) for t in g]) for g in grouped])
        for g, (rewards, err) in zip(grouped, outs, strict=True):
            for j, t in enumerate(g):
                by_key[t.key] = (0.0, err) if err else (rewards[j], None)
        single = [t for t, e in zip(trajs, entries, strict=True)
                  if t.finish_reason != "error" and not is_group_level(e)]
        results = runner.map([(tasks.train_entry(t.task_index), tasks.train[t.task_index], tok.decode(t.token_ids))
                              for t in single])
        by_key.update({t.key: (r.reward, r.error) for t, r in zip(single, results, strict=True)})
    finally:
        if own:
            runner.close()
    samples, errors, first_error = [], 0, None
    n_type: Counter[str] = Counter()
    truncated: Counter[str] = Counter()
    reward_sum: Counter[str] = Counter()
    lengths = []
    for traj, entry in zip(trajs, entries, strict=True):
        task = tasks.train[traj.task_index]
        ttype = task_type_of(task, entry)
        n_type[ttype] += 1
        lengths.append(len(traj.token_ids))
        reward, error = by_key.get(traj.key, (0.0, f"the inference engine refused the request: {traj.error}"))
        if error:
            errors += 1
            first_error = first_error or f"env {entry.name!r}, task {task.id}: {error}"
            continue
        reward = check_reward(reward, entry.name, task.id)
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
    stats.update(sandbox_recoveries())
    return samples, stats


def sandbox_recoveries() -> dict[str, int]:
    """Over the run so far (when any happened): restarts of its own sandbox service, and one-shot runs that the
    sandbox infrastructure cut off and that were run once more."""
    from sandbox.client import runs_retried  # loaded where a run has code to run

    counts = {"sandbox_restarts": sandbox_restarts(), "sandbox_retries": runs_retried()}
    return counts if any(counts.values()) else {}


def evaluate(cluster, tasks: TaskSets, tok: TextTokenizer, cfg: Config, progress: Progress | None = None,
             it: int = 0) -> dict:
    """Greedy accuracy on the held-out tasks: the fraction with reward 1 (errors count as wrong), overall and,
    with several task types, per type; with ``run.eval_samples`` k > 0 also ``accuracy_sampled``: the mean
    over k samples per prompt at each task type's rollout temperature of iteration ``it``."""
    # Group-level rewards (a critic comparing responses) have no right answer to count; multi-turn episodes are
    # not single greedy responses.
    keep = [i for i in range(len(tasks.eval))
            if not is_group_level(tasks.eval_entry(i)) and not env_class(tasks.eval_entry(i)).multi_turn]
    held_out = [tasks.eval[i] for i in keep]
    if not held_out:
        return {"accuracy": float("nan"), "response_len": 0.0}
    k = cfg.run.eval_samples
    types = [task_type_of(tasks.eval[i], tasks.eval_entry(i)) for i in keep]
    prompts = [tok.prompt_ids(t) for t in held_out]
    params = [SamplingParams(0.0, cfg.task_type(tt)[0]) for tt in types]
    # sampled: k per prompt at the rollout temperature, each with its own seed (see eval_seed)
    params += [SamplingParams(cfg.temperature(tt, it), cfg.task_type(tt)[0], seed=eval_seed(n, j))
               for n, tt in enumerate(types) for j in range(k)]
    bar = progress.add_task(f"held-out eval (greedy{f' + {k} sampled' if k else ''})", total=len(params)) \
        if progress else None
    outs = cluster.generate(prompts + [p for p in prompts for _ in range(k)], params, seed=0,
                            on_chunk=(lambda n: progress.advance(bar, n)) if progress else None)
    if progress:
        progress.remove_task(bar)
    index = keep + [i for i in keep for _ in range(k)]
    runner = EpisodeRunner(cfg)
    try:
        results = runner.map([(tasks.eval_entry(i), tasks.eval[i], tok.decode(c.token_ids))
                              for i, c in zip(index, outs, strict=True)])
    finally:
        runner.close()
    solved_all = [solved(r, c) for r, c in zip(results, outs, strict=True)]
    right, outs = solved_all[:len(keep)], outs[:len(keep)]
    out = {"accuracy": sum(right) / len(held_out),
           "response_len": sum(len(c.token_ids) for c in outs) / len(outs)}
    if k:
        out["accuracy_sampled"] = sum(solved_all[len(keep):]) / (k * len(keep))
    if len(set(types)) > 1:
        for tt in sorted(set(types)):
            hits = [r for r, t in zip(right, types, strict=True) if t == tt]
            out[f"accuracy/{tt}"] = sum(hits) / len(hits)
    return out


def policy_critic(cluster, tok: TextTokenizer, cfg: Config, seed: int):
    """The policy itself as the critic, on the shared inference engines (task type "critic" sets its budget and
    temperature)."""
    max_tokens, _, sched = cfg.task_type("critic")
    lock = threading.Lock()  # episodes call it from several threads; the engines take one batch at a time

    def generate(prompts: list[str]) -> list[str]:
        params = [SamplingParams(sched.start, max_tokens) for _ in prompts]
        with lock:
            outs = cluster.generate([tok.encode(p) for p in prompts], params, seed=seed)
        return [tok.decode(c.token_ids) for c in outs]

    return generate


def collect_samples(cluster, cfg: Config, tasks: TaskSets, tok: TextTokenizer, it: int,
                    completed: list[list[Trajectory]], episodes: list, runner: EpisodeRunner):
    """The iteration's training samples and reward metrics: the completed single-turn groups scored by their
    environments (the policy as critic where one judges), the multi-turn episodes the rollout played, and the
    critic's own judgments when closed-loop critic training is on."""
    from rl.rollout.critic_loop import critic_training_batch
    from rl.rollout.multiturn import episode_samples

    samples, stats = score(completed, tasks, tok, cfg, runner)
    if episodes:
        more, multi_stats = episode_samples(episodes, cfg)
        samples += more
        stats.update({k: v for k, v in multi_stats.items() if k not in stats})
        stats["env_errors"] += multi_stats["multi_turn_errors"]
        stats["reward_mean"] = sum(s.reward for s in samples) / max(1, len(samples))
    if cfg.algorithm.critic_training.enabled:
        judged, critic_stats = critic_training_batch(cluster, tok, cfg, samples, it, GROUPS_PER_ITERATION)
        samples += judged
        stats.update(critic_stats)
    stats["trained_samples"] = len(samples)
    return samples, stats


def episode_runner(cluster, cfg: Config, tasks: TaskSets, tok: TextTokenizer, it: int) -> EpisodeRunner:
    """The iteration's environment runner, with the policy attached as critic where an environment judges."""
    critic = policy_critic(cluster, tok, cfg, critic_seed(cfg.run.seed, it)) \
        if any(is_group_level(e) for e in tasks.entries) else None
    return EpisodeRunner(cfg, critic=critic)
