"""Held-out evaluation: greedy accuracy on the held-out tasks, and the same sampled at the rollout temperature."""

from __future__ import annotations

from rich.progress import Progress

from engines.inference.sampling import SamplingParams
from engines.model.text.tokenizer import TextTokenizer
from rl.config import Config
from rl.rollout.data import TaskSets
from rl.rollout.episodes import EpisodeRunner, env_class, solved
from rl.seeds import eval_seed
from rl.settings import TaskTypes


def evaluate(rollouts, tasks: TaskSets, tok: TextTokenizer, cfg: Config, types: TaskTypes,
             progress: Progress | None = None, it: int = 0) -> dict:
    """Greedy accuracy on the held-out tasks: the fraction with reward 1 (errors count as wrong), overall and,
    with several task types, per type; with ``run.eval_samples`` k > 0 also ``accuracy_sampled``: the mean
    over k samples per prompt at each task type's rollout temperature of iteration ``it``."""
    # Group-level rewards (a critic comparing responses) have no right answer to count; multi-turn episodes are
    # not single greedy responses.
    keep = [i for i in range(len(tasks.eval)) if not env_class(tasks.eval_entry(i)).group_level
            and not env_class(tasks.eval_entry(i)).multi_turn]
    held_out = [tasks.eval[i] for i in keep]
    if not held_out:
        return {"accuracy": float("nan"), "response_len": 0.0}
    k = cfg.run.eval_samples
    kinds = [types.get(tasks.type_of(i, held_out=True)) for i in keep]
    prompts = [tok.prompt_ids(t) for t in held_out]
    params = [SamplingParams(0.0, t.max_tokens) for t in kinds]
    # sampled: k per prompt at the rollout temperature, each with its own seed (see eval_seed)
    params += [SamplingParams(t.temperature.at(it), t.max_tokens, seed=eval_seed(n, j))
               for n, t in enumerate(kinds) for j in range(k)]
    bar = progress.add_task(f"held-out eval (greedy{f' + {k} sampled' if k else ''})", total=len(params)) \
        if progress else None
    outs = rollouts.generate(prompts + [p for p in prompts for _ in range(k)], params, seed=0,
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
    names = [t.name for t in kinds]
    if len(set(names)) > 1:
        for name in sorted(set(names)):
            hits = [r for r, t in zip(right, names, strict=True) if t == name]
            out[f"accuracy/{name}"] = sum(hits) / len(hits)
    return out
