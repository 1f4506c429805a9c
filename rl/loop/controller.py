"""The central controller: one RL iteration is rollout → reward → train → weight update.

Rollout runs new prompt groups and the trajectories paused by the last iteration's token budget;
the groups whose every trajectory finished are rewarded and trained on; the trainer is on the
device only between its onload and offload; the checkpoint engine then moves the new weights.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from engines.inference import cpu_kernel
from engines.inference.sampling import SamplingParams
from engines.model.hf_io import read_config
from engines.model.tokenizer import TextTokenizer
from envs import Task
from rl.config import Config, EnvConfig, dump_config
from rl.errors import UserError
from rl.loop.checkpoint import LoopState, copy_tokenizer, latest_checkpoint, remove_stale, save_checkpoint, write_aside
from rl.loop.cluster import Cluster
from rl.loop.guards import (
    Budget,
    TrainingStopped,
    check_cluster_fits,
    check_error_rate,
    check_max_tokens,
    check_sample_rewards,
    check_writable,
)
from rl.loop.health import CollapseGuard, HealthMonitor
from rl.loop.metrics import MetricsLog, plot_curves
from rl.loop.recovery import Restarts, WorkerFailed
from rl.rollout.data import GROUPS_PER_ITERATION, check_renderable, load_task_sets, rollout_seq_len, sample_mix
from rl.rollout.episodes import env_class, task_type_of
from rl.rollout.multiturn import play_episodes
from rl.rollout.partial import PartialRolloutBuffer, Trajectory
from rl.rollout.ptx import load_ptx, ptx_batches
from rl.rollout.rewards import collect_samples, episode_runner, evaluate
from rl.seeds import episode_seed, sampling_seed, train_seed
from rl.setup.memory import check_fits, estimate
from rl.setup.warmstart import prepare_model


def train(cfg: Config, run_dir: Path, resume: bool = False, console: Console | None = None) -> dict:
    """Run (or resume) an RL run in ``run_dir``; returns the summary also written to summary.json.

    A worker that fails and cannot be replaced in place (a trainer rank, a lost node) tears the workers down and
    the run goes on from the last complete checkpoint (from the start when there is none yet), at most
    ``run.max_restarts`` recoveries in all."""
    from rl.loop.checkpoint import list_checkpoints

    console = console or Console()
    restarts = Restarts(cfg.run.max_restarts, lambda line: console.print(f"[bold yellow]{line}[/]"))
    while True:
        try:
            return _run(cfg, run_dir, resume, console, restarts)
        except WorkerFailed as failure:
            ckpts = list_checkpoints(run_dir)
            restarts.take(failure, "the workers restart from " + (f"checkpoint {ckpts[-1].name}" if ckpts else
                                                                  "the start (no complete checkpoint yet)"))
            resume = bool(ckpts)


def _run(cfg: Config, run_dir: Path, resume: bool, console: Console, restarts: Restarts) -> dict:
    """One attempt of ``train``: its workers start, and a fault they cannot recover from in place ends it."""
    check_cluster_fits(cfg)
    check_max_tokens(cfg)
    check_writable(run_dir)
    tasks = load_task_sets(cfg, console)  # validates task files and the env name before any work
    ptx = load_ptx(cfg.algorithm.ptx.data) if cfg.algorithm.ptx.coef > 0 else []
    progress = Progress(TextColumn("{task.description:<34}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, transient=True)
    with progress:
        if resume:
            start_dir, state = latest_checkpoint(run_dir, report=console.print)  # says which, and what it skipped
            remove_stale(run_dir)  # .tmp directories of saves that did not finish
        else:
            start_dir, state = prepare_model(cfg, progress), None
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(dump_config(cfg))
        tok = load_tokenizer(start_dir, cfg)
        check_renderable(tasks, tok, str(start_dir))
        for warning in cfg.warnings():
            console.print(f"[bold yellow]warning:[/] {warning}")
        log = MetricsLog(run_dir, console, cfg.metrics.prometheus_port, resume_at=state and state.iteration + 1)
        budget, stopped = Budget(cfg.run.max_minutes, state.wall_s if state else 0.0), None
        health = HealthMonitor()
        health.replay(log.records)
        buffer = PartialRolloutBuffer(cfg.rollout.partial.max_age)
        arch = read_config(start_dir)
        seq_len = rollout_seq_len(cfg, tasks, tok, arch.max_position_embeddings)
        check_fits(cfg, estimate(cfg, arch, seq_len))
        if cfg.cluster.gpus_per_worker == 0 and cfg.rollout.engine != "vllm" and cfg.rollout.attention in ("auto",
                                                                                                         "paged"):
            cpu_kernel.available()  # the CPU decode kernel built here, once: the workers then only load it
        # a KL penalty's reference: the model the run started from, also after a resume (prepare_model: cached)
        reference = str(prepare_model(cfg, progress)) if cfg.algorithm.kl_coef > 0 and resume else None
        with Cluster(cfg, str(start_dir), seq_len, restarts, reference) as cluster:
            auto = " (rollout.engine: auto)" if cfg.rollout.engine == "auto" else ""
            console.print(f"rollout engine: {cluster.engine_kind()}{auto}")
            if state:
                cluster.load_state(str(start_dir))
                cluster.weights_version = state.weights_version
                buffer.load_state_dict(state.partial)
                initial, initial_sampled = state.initial_accuracy, state.initial_accuracy_sampled
            else:
                start = evaluate(cluster, tasks, tok, cfg, progress, it=0)
                initial, initial_sampled = start["accuracy"], start.get("accuracy_sampled")
                sampled = "" if initial_sampled is None else \
                    f", sampled {initial_sampled:.3f} (mean of {cfg.run.eval_samples} at the rollout temperature)"
                console.print(f"warm start: held-out accuracy {initial:.3f} on {len(tasks.eval)} prompts{sampled}")
            rollbacks = state.rollbacks if state else 0
            guard = CollapseGuard(cfg.run.collapse_drop, state.best_accuracy if state else None,
                                  cfg.run.collapse_drop_relative, len(tasks.eval)) if cfg.run.collapse_guard else None
            if guard is not None and guard.improved({"accuracy": initial}):  # the warm start is the first best
                save_best(cluster, run_dir, start_dir, -1, initial)
            cluster.offload_trainers()
            first = state.iteration + 1 if state else 0
            for it in range(first, cfg.run.iterations):
                rec = iteration(cluster, cfg, tasks, tok, it, progress, buffer, ptx)
                for warning in health.check(rec):
                    console.print(f"[bold yellow]warning:[/] iter {it}: {warning}")
                if guard is not None and guard.improved(rec):
                    save_best(cluster, run_dir, start_dir, it, rec["accuracy"])
                elif guard is not None and (why := guard.verdict(rec)):
                    if rollbacks >= cfg.run.max_rollbacks:
                        log.record({**rec, "rollbacks": rollbacks})
                        raise TrainingStopped(f"iteration {it}: {why}, and {rollbacks} rollback(s) already "
                                              f"(run.max_rollbacks); the best weights are in {run_dir / BEST_DIR}")
                    rollbacks, lr = roll_back(cluster, cfg, run_dir, it, why, rollbacks, console)
                    buffer = PartialRolloutBuffer(cfg.rollout.partial.max_age)  # sampled by the collapsed policy
                    health.rolled_back()
                    rec.update(rollback=1, lr_after_rollback=lr)
                rec["rollbacks"], rec["recoveries"] = rollbacks, restarts.used
                if budget.reached() and it + 1 < cfg.run.iterations:
                    stopped = "max_minutes"
                    if rec["accuracy"] is None:  # end on a measured model, as a run that ran out of iterations
                        rec.update(eval_metrics(cluster, tasks, tok, cfg, progress, it))
                log.record(rec)
                if (it + 1) % cfg.run.save_every == 0 or it + 1 == cfg.run.iterations or stopped:
                    loop = LoopState(it, initial, budget.elapsed(), cluster.weights_version, buffer.state_dict(),
                                     cfg.cluster.workers, initial_sampled, rollbacks, guard and guard.best)
                    save_checkpoint(run_dir, loop, cluster.save, start_dir, cfg.run.keep_checkpoints)
                if stopped:
                    console.print(f"run.max_minutes={cfg.run.max_minutes:g} reached after iteration {it} "
                                  f"({budget.elapsed() / 60:.1f} min): checkpoint, final model and summary saved")
                    break
            final_dir = run_dir / "final"
            cluster.save(str(final_dir), trainer_state=False)
            copy_tokenizer(start_dir, final_dir)
    accs = [r["accuracy"] for r in log.records if r.get("accuracy") is not None]
    sampled = [r["accuracy_sampled"] for r in log.records if r.get("accuracy_sampled") is not None]
    summary = {
        "initial_accuracy": initial,
        "final_accuracy": accs[-1] if accs else initial,
        "best_accuracy": max([*accs, initial]),
        **({"initial_accuracy_sampled": initial_sampled,
            "final_accuracy_sampled": sampled[-1] if sampled else initial_sampled} if initial_sampled is not None
           else {}),
        "iterations": len(log.records),
        "rollbacks": sum(r.get("rollback", 0) for r in log.records),
        **({"best_model": str(run_dir / BEST_DIR)} if (run_dir / BEST_DIR).is_dir() else {}),
        "wall_s": round(budget.elapsed(), 2),
        "final_model": str(final_dir),
        **({"stopped_by": stopped} if stopped else {}),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_curves(log.records, run_dir / "curves.png", initial, initial_sampled)
    return summary


BEST_DIR = "best"


def save_best(cluster: Cluster, run_dir: Path, start_dir: Path, it: int, accuracy: float) -> None:
    """``best/``: the best evaluated weights (Hugging Face format, as ``final/``) with their trainer state, which
    a rollback returns to; written aside and renamed into place (``write_aside``: a full disk is one line)."""
    def fill(tmp: Path) -> None:
        cluster.save(str(tmp), trainer_state=True)
        copy_tokenizer(start_dir, tmp)
        (tmp / "best.json").write_text(json.dumps({"iteration": it, "accuracy": accuracy}))

    best = run_dir / BEST_DIR
    write_aside(best, fill, "best model", best if (best / "best.json").is_file() else None, "the previous best",
                "")


def roll_back(cluster: Cluster, cfg: Config, run_dir: Path, it: int, why: str, done: int,
              console: Console) -> tuple[int, float]:
    """Return the trainers and every inference engine to ``best/``, scale the learning rate; returns the rollbacks
    so far and the new rate."""
    best = run_dir / BEST_DIR
    if not (best / "best.json").is_file():
        raise TrainingStopped(f"iteration {it}: {why}, and no best/ to roll back to (run.collapse_guard was off)")
    cluster.load_state(str(best))
    lr = cluster.scale_lr(cfg.run.rollback_lr_factor)
    cluster.update_weights()
    came_from = json.loads((best / "best.json").read_text())["iteration"]
    console.print(f"[bold yellow]rollback:[/] iter {it}: {why}; back to best/ (iteration {came_from}), learning rate "
                  f"now {lr:.3g} (rollback {done + 1} of at most {cfg.run.max_rollbacks})")
    return done + 1, lr


def new_groups(cfg: Config, tasks, tok: TextTokenizer, it: int,
               buffer: PartialRolloutBuffer) -> tuple[dict[str, float], list[tuple[int, EnvConfig, Task]]]:
    """Add this iteration's new single-turn prompt groups (K trajectories each) to the buffer, so that
    ``prompts_per_iteration`` groups are in flight; returns the temperature of each task type and the
    new multi-turn groups, which are played out separately."""
    r, temps, multi = cfg.rollout, {}, []
    for g, index in enumerate(sample_mix(tasks, r.prompts_per_iteration - buffer.in_flight_groups(),
                                         cfg.run.seed, it)):
        task, entry = tasks.train[index], tasks.train_entry(index)
        ttype = task_type_of(task, entry)
        max_tokens = cfg.task_type(ttype)[0]
        temps[ttype] = cfg.temperature(ttype, it)
        group, prompt = it * GROUPS_PER_ITERATION + g, tok.prompt_ids(task)
        if env_class(entry).multi_turn:
            multi.append((group, entry, task))
            continue
        keys = [group * r.samples_per_prompt + j for j in range(r.samples_per_prompt)]
        buffer.add_group([Trajectory(key=k, group=group, task_index=index, prompt_ids=prompt, started=it,
                                     params=SamplingParams(temps[ttype], max_tokens,
                                                           seed=sampling_seed(cfg.run.seed, it, k)))
                          for k in keys])
    return temps, multi


def iteration(cluster: Cluster, cfg: Config, tasks, tok: TextTokenizer, it: int, progress: Progress,
              buffer: PartialRolloutBuffer, ptx: list) -> dict:
    """One RL iteration; returns its metrics record."""
    times: dict[str, float] = {}

    runner = episode_runner(cluster, cfg, tasks, tok, it)
    try:
        t = time.time()
        temps, multi = new_groups(cfg, tasks, tok, it, buffer)
        pending, _ = buffer.pending(it)  # trajectories past rollout.partial.max_age are dropped here
        bar = progress.add_task(f"iter {it} rollout", total=len(pending))
        results, engine_stats = cluster.rollout(pending, cfg.rollout.partial.token_budget,
                                                on_worker=lambda n: progress.advance(bar, n))
        progress.remove_task(bar)
        prior = {t.key: len(t.token_ids) for t in pending}
        generated = sum(len(r.token_ids) - prior[r.key] for r in results)
        buffer.record(results, it)
        episodes = play_episodes(cluster, cfg, tok, runner, multi, temps, episode_seed(cfg.run.seed, it),
                                 cluster.max_context)
        generated += sum(sum(e.loss_mask) for e in episodes)
        times["time_rollout"] = time.time() - t

        t = time.time()
        # The inference engines sleep only after rewards: a critic may run the policy on them.
        samples, stats = collect_samples(cluster, cfg, tasks, tok, it, buffer.pop_complete(), episodes, runner)
    finally:
        runner.close()
    check_error_rate(stats, cfg.run.max_env_error_rate)
    check_sample_rewards(samples)
    partial_stats = buffer.stats()  # after pop_complete: waiting_groups are the groups carried over
    cluster.sleep_rollouts()
    times["time_reward"] = time.time() - t

    t = time.time()
    times["time_onload"] = cluster.onload_trainers().get("seconds", 0.0)
    a = cfg.algorithm
    ptx_steps = ptx_batches(ptx, tok, a.ptx.batch_size, a.minibatches, cfg.run.seed, it) if ptx else []
    bar = progress.add_task(f"iter {it} train", total=a.minibatches)
    steps = cluster.train(samples, ptx_steps, seed=train_seed(cfg.run.seed, it),
                          on_step=lambda _: progress.advance(bar)) if samples else []
    progress.remove_task(bar)
    train_peak = cluster.train_peak_gib() if steps else None
    times["time_offload"] = cluster.offload_trainers().get("seconds", 0.0)
    times["time_train"] = time.time() - t

    t = time.time()
    bar = progress.add_task(f"iter {it} weight update ({cluster.num_buckets} buckets)", total=1)
    cluster.wake_rollouts()
    if steps:
        cluster.update_weights()
    progress.remove_task(bar)
    times["time_weight_update"] = time.time() - t

    held_out = {"accuracy": None}
    if (it + 1) % cfg.run.eval_every == 0 or it + 1 == cfg.run.iterations:
        held_out = eval_metrics(cluster, tasks, tok, cfg, progress, it)
        times["time_eval"] = held_out.pop("time_eval")
    return {
        "iteration": it,
        **stats,
        **held_out,
        "temperature": cfg.temperature(cfg.env_entries[0].task_type or env_class(cfg.env_entries[0]).task_type, it),
        **({f"temperature/{k}": v for k, v in temps.items()} if len(temps) > 1 else {}),
        "rollout_tokens": generated,
        **engine_stats,
        "mem_train_peak_gib": train_peak,
        **{f"partial_{k}": v for k, v in partial_stats.items()},
        **step_metrics(steps),
        **{k: round(v, 3) for k, v in times.items()},
    }


def eval_metrics(cluster: Cluster, tasks, tok: TextTokenizer, cfg: Config, progress: Progress, it: int) -> dict:
    """Held-out accuracy (greedy, per task type, sampled at iteration ``it``'s temperature) and the time it took."""
    t = time.time()
    out = evaluate(cluster, tasks, tok, cfg, progress, it=it)
    return {"accuracy": out["accuracy"], **{k: v for k, v in out.items() if k.startswith("accuracy")},
            "time_eval": round(time.time() - t, 3)}


def load_tokenizer(model_dir: Path, cfg: Config) -> TextTokenizer:
    """The run's tokenizer, or a UserError naming what is missing (files, the EOS token a response ends with)."""
    try:
        return TextTokenizer.load(model_dir, cfg.model.chat_template)
    except (OSError, ValueError) as e:
        raise UserError(f"the tokenizer in {model_dir} cannot be used: {e}") from None


def step_metrics(steps: list[dict[str, float]]) -> dict[str, float]:
    """Losses, gradient norms and diagnostics averaged over the optimizer steps; maxima as their maximum."""
    out: dict[str, float] = {"optimizer_steps": len(steps)}
    for key in sorted({k for s in steps for k in s}):
        values = [s[key] for s in steps if key in s]
        if key.startswith("max_logit") or key.endswith("_max") or key.endswith("_absmax"):
            out[key] = max(values)
        elif key == "qk_clipped_heads":
            out[key] = sum(values)
        else:
            out[key] = sum(values) / len(values)
    return out
