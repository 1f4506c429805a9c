"""Held-out evaluation: greedy accuracy and mean reward on the held-out tasks, and accuracy sampled at the rollout
temperature.

A held-out response is scored alone (``scored_alone``): single-turn environments whose rewards are each response's
own, TRL-style group functions included (scored as a group of one). Environments whose rewards compare a group's
responses (``Env.relative_rewards``) and multi-turn ones are left out, and ``left_out`` says so in one line; a run
where every held-out task is left out has no held-out metrics at all (never NaN).
"""

from __future__ import annotations

import math
import statistics

from rich.progress import Progress

from engines.inference.sampling import SamplingParams
from engines.model.text.tokenizer import TextTokenizer
from rl.config import Config
from rl.rollout.data import TaskSets
from rl.rollout.episodes import EpisodeRunner, env_class, scored_alone, solved
from rl.seeds import eval_seed
from rl.settings import TaskTypes


def evaluated(tasks: TaskSets) -> list[int]:
    """The held-out tasks whose responses are scored alone (indices into ``tasks.eval``)."""
    alone = [scored_alone(e) for e in tasks.entries]
    return [i for i in range(len(tasks.eval)) if alone[tasks.eval_env[i]]]


def left_out(tasks: TaskSets) -> str | None:
    """One line naming the environments held-out evaluation leaves out and why (None: it leaves none out)."""
    why = []
    for e in (tasks.entries[i] for i in sorted(set(tasks.eval_env))):
        fn = e.kwargs.get("function")
        name = f"reward function {fn}" if isinstance(fn, str) else e.name
        if env_class(e).multi_turn:
            why.append(f"{name} (multi-turn episodes)")
        elif not scored_alone(e):
            why.append(f"{name} (its rewards compare a prompt's responses with each other, so one response has "
                       "none)")
    if not why:
        return None
    share = "no held-out metrics" if not evaluated(tasks) else "held-out metrics leave out"
    return f"{share}: {'; '.join(why)}"


def evaluate(rollouts, tasks: TaskSets, tok: TextTokenizer, cfg: Config, types: TaskTypes,
             progress: Progress | None = None, it: int = 0) -> dict:
    """Held-out metrics of the current weights ({} where no held-out task is scored alone):

    - ``accuracy``: the greedy responses' share that is solved (reward ≥ ``run.eval_success``, no environment error,
      ended on its own), overall and, with several task types, per type as ``accuracy/TYPE``;
    - ``eval_reward`` / ``eval_reward_std``: the greedy responses' mean reward and its spread (environment errors
      and non-finite rewards left out; None where no response has a reward);
    - with ``run.eval_samples`` k > 0, ``accuracy_sampled``: solved over k samples per prompt at each task type's
      rollout temperature of iteration ``it``;
    - ``responses``: one record per greedy response (task id, text, reward, solved, finish reason, error), which
      the caller saves and does not log.
    """
    keep = evaluated(tasks)
    if not keep:
        return {}
    held_out = [tasks.eval[i] for i in keep]
    k, success = cfg.run.eval_samples, cfg.run.eval_success
    kinds = [types.get(tasks.type_of(i, held_out=True)) for i in keep]
    prompts = [tok.prompt_ids(t) for t in held_out]
    params = [SamplingParams(0.0, t.max_tokens) for t in kinds]
    # sampled: k per prompt at the rollout temperature, each with its own seed (see eval_seed)
    params += [SamplingParams(t.temperature.at(it), t.max_tokens, seed=eval_seed(n, j))
               for n, t in enumerate(kinds) for j in range(k)]
    bar = progress.add_task(f"held-out eval (greedy{f' + {k} sampled' if k else ''})", total=len(params)) \
        if progress else None
    pictures = [t.images for t in held_out]
    extra = {"images": pictures + [p for p in pictures for _ in range(k)]} if any(pictures) else {}
    outs = rollouts.generate(prompts + [p for p in prompts for _ in range(k)], params, seed=0,
                            on_chunk=(lambda n: progress.advance(bar, n)) if progress else None, **extra)
    if progress:
        progress.remove_task(bar)
    index = keep + [i for i in keep for _ in range(k)]
    texts = [tok.decode(c.token_ids) for c in outs]
    runner = EpisodeRunner(cfg)
    try:
        results = runner.map([(tasks.eval_entry(i), tasks.eval[i], text)
                              for i, text in zip(index, texts, strict=True)])
    finally:
        runner.close()
    solved_all = [solved(r, c, success) for r, c in zip(results, outs, strict=True)]
    n = len(keep)
    right, greedy = solved_all[:n], results[:n]
    # an environment error, or a reward that is not a finite number (the loop's guards stop a run on those in
    # training), has no place in a mean
    rewards = [r.reward for r in greedy if r.error is None and math.isfinite(r.reward)]
    out = {"accuracy": sum(right) / n,
           "eval_reward": statistics.fmean(rewards) if rewards else None,
           "eval_reward_std": statistics.pstdev(rewards) if rewards else None,
           "response_len": sum(len(c.token_ids) for c in outs[:n]) / n}
    if k:
        out["accuracy_sampled"] = sum(solved_all[n:]) / (k * n)
    names = [t.name for t in kinds]
    if len(set(names)) > 1:
        for name in sorted(set(names)):
            hits = [r for r, t in zip(right, names, strict=True) if t == name]
            out[f"accuracy/{name}"] = sum(hits) / len(hits)
    out["responses"] = [{"task_id": tasks.eval[i].id, "response": text,
                         "reward": r.reward if r.error is None and math.isfinite(r.reward) else None,
                         "solved": ok, "finish_reason": c.finish_reason, **({"error": r.error} if r.error else {})}
                        for i, text, r, ok, c in zip(keep, texts, greedy, right, outs, strict=False)]
    return out
