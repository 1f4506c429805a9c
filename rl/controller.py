"""The central controller: one RL iteration is rollout → reward → train → weight update."""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from engines.tokenizer import TextTokenizer
from rl.checkpoint import LoopState, copy_tokenizer, latest_checkpoint, save_checkpoint
from rl.cluster import Cluster
from rl.config import Config, dump_config
from rl.data import load_task_sets, sample_prompts
from rl.metrics import MetricsLog, plot_curves
from rl.rewards import evaluate, score
from rl.schedules import temperature_at
from rl.warmstart import prepare_model


def train(cfg: Config, run_dir: Path, resume: bool = False, console: Console | None = None) -> dict:
    """Run (or resume) an RL run in ``run_dir``; returns the summary also written to summary.json."""
    console = console or Console()
    tasks = load_task_sets(cfg)  # validates task files and the env name before any work
    progress = Progress(TextColumn("{task.description:<34}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, transient=True)
    with progress:
        if resume:
            start_dir, state = latest_checkpoint(run_dir)
        else:
            start_dir, state = prepare_model(cfg, progress), None
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(dump_config(cfg))
        tok = TextTokenizer.load(start_dir)
        log = MetricsLog(run_dir, console, cfg.metrics.prometheus_port, resume_at=state and state.iteration + 1)
        t0 = time.time()
        with Cluster(cfg, str(start_dir)) as cluster:
            if state:
                cluster.load_optimizer(str(start_dir))
                initial = state.initial_accuracy
            else:
                initial = evaluate(cluster, tasks.eval, tok, cfg, progress)["accuracy"]
                console.print(f"warm start: held-out accuracy {initial:.3f} on {len(tasks.eval)} prompts")
            first = state.iteration + 1 if state else 0
            for it in range(first, cfg.run.iterations):
                rec = iteration(cluster, cfg, tasks, tok, it, progress)
                log.record(rec)
                if (it + 1) % cfg.run.save_every == 0 or it + 1 == cfg.run.iterations:
                    loop = LoopState(it, initial, (state.wall_s if state else 0) + time.time() - t0)
                    save_checkpoint(run_dir, loop, cluster.save, start_dir, cfg.run.keep_checkpoints)
            final_dir = run_dir / "final"
            cluster.save(str(final_dir))
            (final_dir / "optimizer.pt").unlink()
            copy_tokenizer(start_dir, final_dir)
    accs = [r["accuracy"] for r in log.records if r.get("accuracy") is not None]
    summary = {
        "initial_accuracy": initial,
        "final_accuracy": accs[-1] if accs else initial,
        "best_accuracy": max([*accs, initial]),
        "iterations": len(log.records),
        "wall_s": round((state.wall_s if state else 0) + time.time() - t0, 2),
        "final_model": str(final_dir),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_curves(log.records, run_dir / "curves.png", initial)
    return summary


def iteration(cluster: Cluster, cfg: Config, tasks, tok: TextTokenizer, it: int, progress: Progress) -> dict:
    """One RL iteration; returns its metrics record."""
    r, times = cfg.rollout, {}
    temperature = temperature_at(r.temperature.schedule, r.temperature.start, r.temperature.end, it,
                                 cfg.run.iterations)
    batch = sample_prompts(tasks.train, r.prompts_per_iteration, cfg.run.seed, it)
    prompts = [tok.encode(t.prompt) for t in batch for _ in range(r.samples_per_prompt)]

    t = time.time()
    bar = progress.add_task(f"iter {it} rollout", total=len(prompts))
    completions = cluster.generate(prompts, temperature, r.max_tokens, seed=cfg.run.seed * 100_003 + it,
                                   on_chunk=lambda n: progress.advance(bar, n))
    progress.remove_task(bar)
    cluster.sleep_rollouts()
    times["time_rollout"] = time.time() - t

    t = time.time()
    samples, stats = score(batch, completions, tok, cfg)
    times["time_reward"] = time.time() - t

    t = time.time()
    bar = progress.add_task(f"iter {it} train", total=cfg.algorithm.minibatches)
    steps = cluster.train(samples, temperature, seed=cfg.run.seed * 100_003 + it,
                          on_step=lambda _: progress.advance(bar))
    progress.remove_task(bar)
    times["time_train"] = time.time() - t

    t = time.time()
    bar = progress.add_task(f"iter {it} weight update ({cluster.num_buckets} buckets)", total=1)
    cluster.wake_rollouts()
    cluster.update_weights()
    progress.remove_task(bar)
    times["time_weight_update"] = time.time() - t

    accuracy = None
    if (it + 1) % cfg.run.eval_every == 0 or it + 1 == cfg.run.iterations:
        t = time.time()
        accuracy = evaluate(cluster, tasks.eval, tok, cfg, progress)["accuracy"]
        times["time_eval"] = time.time() - t
    return {
        "iteration": it,
        **stats,
        "accuracy": accuracy,
        "temperature": temperature,
        "loss": sum(s["loss"] for s in steps) / max(1, len(steps)),
        "grad_norm": sum(s["grad_norm"] for s in steps) / max(1, len(steps)),
        "optimizer_steps": len(steps),
        **{k: round(v, 3) for k, v in times.items()},
    }
