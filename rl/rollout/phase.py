"""The rollout phase: the iteration's new prompt groups are drawn, then every running sample is generated.

One path for every sample: the engines advance the current turn of each running sample — new ones, those paused
by the last iteration's token budget, multi-turn episodes between turns — together, whole prompt groups per engine
(they share a prefill), under the iteration's budget (``rollout.partial.token_budget``). A multi-turn sample whose
turn ended steps its environment (``rl.rollout.multiturn``) and, unless its episode ended, generates its next turn
in another round of the same phase; rounds go on while a sample has a turn to generate and budget is left. What is
unfinished then waits in the partial-rollout buffer for the next iteration.
"""

from __future__ import annotations

from typing import Any

from rich.progress import Progress

from engines.inference.sampling import SamplingParams
from engines.model.text.tokenizer import TextTokenizer
from rl.rollout.data import GROUPS_PER_ITERATION, TaskSets, sample_mix
from rl.rollout.episodes import env_class
from rl.rollout.multiturn import Episodes
from rl.rollout.partial import PartialRolloutBuffer
from rl.rollout.turns import WorkerContexts
from rl.sample import Sample
from rl.seeds import sampling_seed
from rl.settings import RolloutSettings


def draw_groups(buffer: PartialRolloutBuffer, tasks: TaskSets, tok: TextTokenizer, rollout: RolloutSettings,
                it: int, run_seed: int) -> dict[str, float]:
    """Add this iteration's new prompt groups (K samples each, their task type resolved now) to ``buffer``, so that
    ``prompts_per_iteration`` groups are in flight; returns the sampling temperature of each task type drawn."""
    temps: dict[str, float] = {}
    k = rollout.samples_per_prompt
    for g, index in enumerate(sample_mix(tasks, rollout.prompts_per_iteration - buffer.in_flight_groups(),
                                         run_seed, it)):
        kind = rollout.task_types.get(tasks.type_of(index))
        temps[kind.name] = temperature = kind.temperature.at(it)
        group = it * GROUPS_PER_ITERATION + g
        multi = env_class(tasks.train_entry(index)).multi_turn
        prompt = [] if multi else tok.prompt_ids(tasks.train[index])  # a multi-turn prompt comes from its env
        buffer.add_group([Sample(key, group, index, kind, prompt,
                                 SamplingParams(temperature, kind.max_tokens, seed=sampling_seed(run_seed, it, key)),
                                 it, loss_mask=[] if multi else None, multi_turn=multi,
                                 images=() if multi else tasks.train[index].images)
                          for key in range(group * k, group * k + k)])
    return temps


def engine_metrics(counts: list[dict[str, int]]) -> dict[str, float]:
    """The engines' counters over the phase: prefix-cache hit rate, preemptions, peak share of KV blocks held, peak
    memory of the rollout processes."""
    if not counts:
        return {}
    hits, misses = (sum(c[k] for c in counts) for k in ("prefix_hit_tokens", "prefix_miss_tokens"))
    return {"prefix_hit_rate": round(hits / (hits + misses), 4) if hits + misses else 0.0,
            "preemptions": sum(c["preemptions"] for c in counts),
            "kv_usage_peak": round(max(c["kv_blocks_peak"] / max(c["kv_blocks"], 1) for c in counts), 4),
            "mem_rollout_peak_gib": round(max(c["peak_bytes"] for c in counts) / 2**30, 3)}


def run_rollout(rollouts, buffer: PartialRolloutBuffer, episodes: Episodes, tasks: TaskSets, it: int,
                budget: int | None, progress: Progress) -> tuple[int, dict[str, Any]]:
    """Generate the iteration's running samples (dropping those past ``rollout.partial.max_age``) until each ends or
    ``budget`` tokens were generated; returns the tokens generated and the engines' metrics."""
    pending, dropped = buffer.pending(it)
    episodes.close([s.key for s in dropped])
    fresh = [s for s in pending if s.multi_turn and s.key not in episodes.live and len(s.response_ids) == 0]
    if fresh:
        episodes.start(fresh, [tasks.train_entry(s.task_index) for s in fresh], [tasks.train[s.task_index]
                                                                                 for s in fresh])
    running = [s for s in pending if not s.done]
    generated, counts, total = 0, [], len(running)
    contexts = WorkerContexts()  # what each engine holds of the contexts: a next turn sends only what is new
    bar = progress.add_task(f"iter {it} rollout", total=total)
    while running and (budget is None or generated < budget):
        results, round_counts = rollouts.rollout(running, None if budget is None else budget - generated,
                                                on_worker=lambda n: progress.advance(bar, n), contexts=contexts)
        counts += round_counts
        generated += sum(len(r.token_ids) for r in results)
        buffer.record(results)
        turns = [s for s in map(buffer.get, (r.key for r in results)) if s.multi_turn and s.status != "paused"]
        episodes.step(turns)  # a sample whose episode goes on is "running" again, with its next turn's sampling
        running = [s for s in turns if s.status == "running"]
        total += len(running)
        progress.update(bar, total=total)
    progress.remove_task(bar)
    return generated, engine_metrics(counts)
