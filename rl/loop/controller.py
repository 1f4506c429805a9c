"""The central controller: one RL iteration is rollout → reward → train → weight update.

Rollout generates the iteration's new prompt groups and the samples paused by the last iteration's token budget
(``rl.rollout.phase``); the groups whose every sample ended are rewarded (``rl.rollout.rewards``) and trained on —
the driver plans the update, each trainer rank runs its share (``rl.algo``); the trainer is on the device only
between its onload and offload; the checkpoint engine then moves the new weights.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from engines.model.text.tokenizer import TextTokenizer
from rl.algo.batches import plan_update
from rl.config import Config, dump_config
from rl.errors import CommandFailed, TrainingStopped, UserError, worker_startup_error
from rl.loop.checkpoint import (
    LoopState,
    checkpoint_dir,
    copy_tokenizer,
    latest_checkpoint,
    list_checkpoints,
    remove_stale,
    save_checkpoint,
    tree_bytes,
    write_aside,
)
from rl.loop.cluster import Cluster
from rl.loop.guards import Budget, check_cluster_fits, check_max_tokens, check_writable
from rl.loop.health import CollapseGuard, HealthMonitor
from rl.loop.held_out import finite, held_out_line, make_guard, save_responses, start_line, summary_figures
from rl.loop.metrics import MetricsLog, plot_curves
from rl.loop.recovery import Restarts, WorkerFailed
from rl.loop.stop import STOP_FILE, StopRequested, StopWatch
from rl.loop.stream import RolloutStream, collect, eligible, timed
from rl.rollout.data import TaskSets, check_renderable, load_task_sets, rollout_seq_len
from rl.rollout.episodes import env_class
from rl.rollout.evaluate import evaluate, evaluated
from rl.rollout.multiturn import Episodes
from rl.rollout.partial import PartialRolloutBuffer
from rl.rollout.ptx import load_ptx, ptx_batches
from rl.seeds import train_seed
from rl.settings import RunSettings, model_arch, resolve
from rl.setup.memory import check_fits, estimate
from rl.setup.warmstart import prepare_model

BEST_DIR = "best"


class RunStopped(CommandFailed):
    """The run saved a checkpoint and ended because it was asked to (``run.checkpoint_on_stop``)."""


@dataclass(kw_only=True)
class Run:
    """One attempt of a run: its settings, data and workers, and the loop's state between iterations."""

    cfg: Config
    settings: RunSettings
    run_dir: Path
    start_dir: Path
    tasks: TaskSets
    tok: TextTokenizer
    ptx: list
    cluster: Cluster
    buffer: PartialRolloutBuffer
    episodes: Episodes
    progress: Progress
    console: Console
    checkpoint_bytes: int = 0  # what one checkpoint takes, estimated (a first save onto a full disk says it)
    stream: RolloutStream | None = None  # disaggregated: the batches made ahead of the trainer


def train(cfg: Config, run_dir: Path, resume: bool = False, console: Console | None = None) -> dict:
    """Run (or resume) an RL run in ``run_dir``; returns the summary also written to summary.json.

    A worker that fails and cannot be replaced in place (a trainer rank, a lost node) tears the workers down and
    the run goes on from the last complete checkpoint (from the start when there is none yet), at most
    ``run.max_restarts`` recoveries in all."""
    console = console or Console()
    restarts = Restarts(cfg.run.max_restarts, lambda line: console.print(f"[bold yellow]{line}[/]"))
    while True:
        try:
            return _attempt(cfg, run_dir, resume, console, restarts)
        except WorkerFailed as failure:
            ckpts = list_checkpoints(run_dir)
            restarts.take(failure, "the workers restart from " + (f"checkpoint {ckpts[-1].name}" if ckpts else
                                                                  "the start (no complete checkpoint yet)"))
            resume = bool(ckpts)


def _attempt(cfg: Config, run_dir: Path, resume: bool, console: Console, restarts: Restarts) -> dict:
    """One attempt of ``train``: the run is checked and resolved, its workers start, and a fault they cannot
    recover from in place ends it."""
    check_cluster_fits(cfg)
    check_max_tokens(cfg)
    check_writable(run_dir)
    tasks = load_task_sets(cfg, console)  # validates task files and the env name before any work
    if (line := held_out_line(cfg, tasks)) is not None:  # what held-out metrics cannot cover, said once
        console.print(f"[bold yellow]note:[/] {line}")
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
        arch, backend_why = model_arch(cfg, start_dir)  # native or transformers (model.backend), and why
        settings = resolve(cfg, arch, str(start_dir), rollout_seq_len(cfg, tasks, tok, arch.max_position_embeddings),
                           backend_why)
        est = estimate(cfg, arch, settings.context, settings.rollout.engine)
        check_fits(cfg, est)
        kind = settings.rollout.engine.kind
        console.print(f"rollout engine: {kind}" + (" (rollout.engine: auto)" if cfg.rollout.engine == "auto" else ""))
        # a KL penalty's reference: the model the run started from, also after a resume (prepare_model: cached)
        reference = str(prepare_model(cfg, progress)) if settings.trainer.reference and resume else None
        # where the updates carry no base (LoRA), a checkpoint holds the merged policy: a resumed run reads the base
        # it started from (the trainer state brings the adapters back)
        base = str(start_dir) if settings.updates_carry_base or not resume else str(prepare_model(cfg, progress))
        with start_cluster(settings, base, restarts, reference) as cluster:
            r = settings.rollout
            episodes = Episodes(None, tok, r.tool_format, r.max_turns, settings.context, cfg.run.seed)
            run = Run(cfg=cfg, settings=settings, run_dir=run_dir, start_dir=start_dir, tasks=tasks, tok=tok, ptx=ptx,
                      cluster=cluster, buffer=PartialRolloutBuffer(r.max_age), episodes=episodes, progress=progress,
                      console=console, checkpoint_bytes=est.checkpoint)
            try:
                return _loop(run, state, restarts)
            finally:
                if run.stream is not None:
                    run.stream.stop()
                episodes.close_all()


def start_cluster(*args) -> Cluster:
    """The run's workers, started; a worker that dies in its constructor (a replica that cannot serve the model:
    ``engines.inference.replica_check``) ends the run in one line naming the cause, its traceback in the worker's
    log."""
    try:
        return Cluster(*args)
    except Exception as e:
        failed = next((f for f in (worker_startup_error(x) for x in (e, e.__cause__, e.__context__) if x) if f), None)
        if failed is None:
            raise
        raise failed from None


def save_line(saved: Path, seconds: float, console: Console) -> None:
    """Say how fast a checkpoint went to the run storage: what a stop must wait for (the chart's
    disruption.saveGBps sizes the pods' grace period by it)."""
    gb = tree_bytes(saved) / 1e9
    console.print(f"checkpoint {saved.name}: {gb:.2f} GB saved in {seconds:.1f} s ({gb / max(seconds, 1e-9):.3f} GB/s)")


def _loop(run: Run, state: LoopState | None, restarts: Restarts) -> dict:
    """The iterations of one attempt, from the start or ``state`` (a checkpoint's), to the summary."""
    cfg, cluster, console = run.cfg, run.cluster, run.console
    log = MetricsLog(run.run_dir, console, cfg.metrics.prometheus_port, resume_at=state and state.iteration + 1)
    budget, stopped = Budget(cfg.run.max_minutes, state.wall_s if state else 0.0), None
    health = HealthMonitor()
    health.replay(log.records)
    if state:
        cluster.trainers.load_state(str(run.start_dir))
        cluster.rollouts.adopt_version(state.weights_version)
        if not run.settings.updates_carry_base:  # the replicas hold the base: serve the checkpoint's adapters on it
            cluster.rollouts.refill()
        run.buffer.load_state_dict(state.partial, lambda i: run.settings.rollout.task_types.get(run.tasks.type_of(i)))
        initial = {"accuracy": state.initial_accuracy, "accuracy_sampled": state.initial_accuracy_sampled,
                   "eval_reward": state.initial_eval_reward}
    else:
        start = save_responses(run.run_dir, "warm_start", evaluate(cluster.rollouts, run.tasks, run.tok, cfg,
                                                                   run.settings.rollout.task_types, run.progress))
        initial = {k: start.get(k) for k in ("accuracy", "accuracy_sampled", "eval_reward")}
        if start:
            console.print(start_line(start, len(evaluated(run.tasks)), cfg.run.eval_samples))
    rollbacks = state.rollbacks if state else 0
    guard = make_guard(cfg, run.tasks, state.best_accuracy if state else None)
    if guard is not None and guard.improved(initial):  # the warm start is the first best
        save_best(run, -1, guard)
    first = state.iteration + 1 if state else 0
    watch = cluster.rollouts.stop = StopWatch(run.run_dir if cfg.run.checkpoint_on_stop else None)

    def after(i: int, partial: dict) -> LoopState:
        """What a checkpoint after iteration ``i`` holds besides the workers' state."""
        return LoopState(iteration=i, initial_accuracy=initial["accuracy"], wall_s=budget.elapsed(),
                         weights_version=cluster.rollouts.weights_version(), partial=partial,
                         workers=cfg.cluster.workers, initial_accuracy_sampled=initial["accuracy_sampled"],
                         rollbacks=rollbacks, best_accuracy=guard and guard.best,
                         initial_eval_reward=initial["eval_reward"])

    if cfg.staleness is None:  # colocated: the trainers leave the devices to the replicas between updates
        cluster.trainers.offload()
    else:
        run.stream = RolloutStream(run, first, cfg.staleness, cluster.rollouts.weights_version())
    saved_after = state.iteration if state else None  # the newest checkpoint's iteration
    for it in range(first, cfg.run.iterations):
        # what a stop during this iteration's rollout would save, where no checkpoint holds it yet
        unsaved = bool(watch.path) and it > 0 and saved_after != it - 1
        at_start = run.buffer.state_dict() if unsaved and run.stream is None else None
        try:
            rec = iteration(run, it)
        except StopRequested:  # asked during the rollout phase: the trainers hold iteration it − 1's state
            stop_mid_iteration(run, it, after, at_start, unsaved)
        for warning in health.check(rec):
            console.print(f"[bold yellow]warning:[/] iter {it}: {warning}")
        if guard is not None and guard.improved(rec):
            save_best(run, it, guard)
        elif guard is not None and (why := guard.verdict(rec)):
            if rollbacks >= cfg.run.max_rollbacks:
                log.record({**rec, "rollbacks": rollbacks})
                raise TrainingStopped(f"iteration {it}: {why}, and {rollbacks} rollback(s) already "
                                      f"(run.max_rollbacks); the best weights are in {run.run_dir / BEST_DIR}")
            rollbacks, lr = roll_back(run, it, why, rollbacks)
            rec.update(rollback=1, lr_after_rollback=lr)
            health.rolled_back()
        rec["rollbacks"], rec["recoveries"] = rollbacks, restarts.used
        if budget.reached() and it + 1 < cfg.run.iterations:
            stopped = "max_minutes"
            if rec.get("accuracy") is None:  # end on a measured model, as a run that ran out of iterations
                rec.update(eval_metrics(run, it))
        stop_requested = watch.asked()
        log.record(rec)
        if (it + 1) % cfg.run.save_every == 0 or it + 1 == cfg.run.iterations or stopped or stop_requested:
            checkpoint(run, after(it, partial_state(run)))
            saved_after = it
        if stop_requested:
            watch.answered()
            raise RunStopped(f"stopped on request after iteration {it} ({STOP_FILE} in {run.run_dir}): checkpoint "
                             f"saved; rl train --auto-resume (the chart's retry) continues from it")
        if stopped:
            console.print(f"run.max_minutes={cfg.run.max_minutes:g} reached after iteration {it} "
                          f"({budget.elapsed() / 60:.1f} min): checkpoint, final model and summary saved")
            break
    if run.stream is not None:
        run.stream.stop()
    final_dir = run.run_dir / "final"
    cluster.trainers.save(str(final_dir), trainer_state=False)
    copy_tokenizer(run.start_dir, final_dir)
    if cfg.run.export_uri:
        export(final_dir, f"{cfg.run.export_uri}/final", console)
    return summarize(run.run_dir, log.records, initial, budget.elapsed(), stopped)


def partial_state(run: Run, snapshot: dict | None = None) -> dict:
    """The partial-rollout buffer as a checkpoint holds it: now, or as it was in ``snapshot`` (its ``state_dict``).
    Colocated: its samples, less the multi-turn episodes in flight (no environment fits a checkpoint).
    Disaggregated: none, as the stream is making later iterations' batches with it; a resumed run draws and
    generates those again, under the checkpoint's weights."""
    if run.stream is not None:
        return PartialRolloutBuffer(run.cfg.rollout.partial.max_age).state_dict()
    buffer = run.buffer
    if snapshot is not None:
        buffer = PartialRolloutBuffer(run.cfg.rollout.partial.max_age)
        buffer.load_state_dict(snapshot)
    run.episodes.close([s.key for s in buffer.drop_in_flight_episodes()])
    return buffer.state_dict()


def checkpoint(run: Run, loop: LoopState) -> None:
    """Save the workers' state and ``loop`` as ``checkpoints/iter_N`` (N: ``loop.iteration``), and export it."""
    cfg, t_save = run.cfg, time.perf_counter()
    saved = save_checkpoint(run.run_dir, loop, run.cluster.trainers.save, run.start_dir, cfg.run.keep_checkpoints,
                            run.checkpoint_bytes)
    save_line(saved, time.perf_counter() - t_save, run.console)
    if cfg.run.export_uri and cfg.run.export_checkpoints:
        export(saved, f"{cfg.run.export_uri}/checkpoints/{saved.name}", run.console)


def stop_mid_iteration(run: Run, it: int, after: Callable[[int, dict], LoopState], snapshot: dict | None,
                       unsaved: bool) -> NoReturn:
    """Answer a stop asked during iteration ``it``'s rollout phase (``rl.loop.stop``): where ``unsaved``, the state the
    iteration started from is saved as iteration ``it − 1``'s checkpoint (``after(it − 1, partial)``, the
    partial-rollout buffer as in ``snapshot``); otherwise no iteration has ended or that checkpoint holds it already.
    Then the run ends."""
    saved = checkpoint_dir(run.run_dir, it - 1)
    if it == 0:
        what = "no iteration had ended, nothing to save"
    elif not unsaved:
        what = f"{saved.name} holds its state already"
    else:
        checkpoint(run, after(it - 1, partial_state(run, snapshot)))
        what = f"its state saved as {saved.name}"
    run.episodes.close(list(run.episodes.live))
    run.cluster.rollouts.stop.answered()
    raise RunStopped(f"stopped on request during iteration {it}'s rollout ({STOP_FILE} in {run.run_dir}): {what}; "
                     f"rl train --auto-resume (the chart's retry) repeats iteration {it} exactly")


def export(local: Path, uri: str, console: Console) -> None:
    """Upload ``local`` to object storage (``run.export_uri``); a failure is one line, the local copy stays."""
    from engines.model.io.sources import SourceError
    from engines.model.io.uploads import UploadError, upload_directory

    try:
        done = upload_directory(local, uri)
    except (UploadError, SourceError) as e:
        raise CommandFailed(f"run.export_uri: {e} ({local} is kept)") from None
    console.print(f"exported {local.name} to {uri} ({done.sent} files sent, {done.kept} already there)")


def iteration(run: Run, it: int) -> dict:
    """One RL iteration; returns its metrics record."""
    cfg, cluster, s, stream = run.cfg, run.cluster, run.settings, run.stream
    if stream is None:  # colocated: the replicas generate, then sleep while the trainers train
        with cluster.rollouts.stop.armed():  # a safe point to stop (rl.loop.stop): nothing of it trained yet
            made, extra = collect(run, it, cluster.rollouts), {}
            cluster.rollouts.stop.check()
        t = time.time()
        cluster.rollouts.sleep()
        made.times["time_reward"] += time.time() - t
    else:  # disaggregated: the stream made it ahead; what is older than max_staleness is left out
        with cluster.rollouts.stop.armed():
            made, extra = stream.take(it)
        made.samples, staleness = eligible(made.samples, stream.version, stream.k)
        extra.update(staleness, trained_samples=len(made.samples))
    samples, times = made.samples, made.times

    with contextlib.ExitStack() as fill_guard:
        if stream is not None:  # a replica replaced meanwhile is filled after the update goes out, at its version
            fill_guard.enter_context(cluster.rollouts.weights_lock)
        with timed(times, "train"):
            if stream is None:
                times["time_onload"] = cluster.trainers.onload().get("seconds", 0.0)
            a = cfg.algorithm
            ptx = ptx_batches(run.ptx, run.tok, a.ptx.batch_size, a.minibatches, cfg.run.seed, it) if run.ptx else []
            batches = plan_update(samples, s.update, len(cluster.trainers), train_seed(cfg.run.seed, it), ptx) \
                if samples else []
            bar = run.progress.add_task(f"iter {it} train", total=len(batches[0].steps) if batches else 0)
            steps = cluster.trainers.train(batches, on_step=lambda _: run.progress.advance(bar)) if batches else []
            run.progress.remove_task(bar)
            train_peak = cluster.trainers.peak_gib() if steps else None
            if stream is None:
                times["time_offload"] = cluster.trainers.offload().get("seconds", 0.0)

        with timed(times, "weight_update"):
            bar = run.progress.add_task(f"iter {it} weight update ({cluster.num_buckets} buckets)", total=1)
            if stream is None:
                cluster.rollouts.wake()
                cluster.rollouts.update_weights(changed=bool(steps))
            else:  # into the replicas' spare copies while they generate, swapped in between two generation rounds
                staged = cluster.rollouts.stage_weights() if steps else None
                fill_guard.close()  # before the rounds' lock, which a fill inside a round holds
                with stream.lock:
                    t = time.monotonic()
                    if steps:
                        cluster.rollouts.swap_weights(staged)
                    stream.trained(it, cluster.rollouts.weights_version())
                    extra["time_update_pause"] = round(time.monotonic() - t, 4)
            run.progress.remove_task(bar)

    held_out = {"accuracy": None}
    if (it + 1) % cfg.run.eval_every == 0 or it + 1 == cfg.run.iterations:
        held_out = eval_metrics(run, it)
        times["time_eval"] = held_out.pop("time_eval")
    first = cfg.env_entries[0]
    return {
        "iteration": it,
        **made.stats,
        **held_out,
        "temperature": s.rollout.task_types.get(first.task_type or env_class(first).task_type).temperature.at(it),
        **({f"temperature/{k}": v for k, v in made.temps.items()} if len(made.temps) > 1 else {}),
        "rollout_tokens": made.generated,
        **made.engine,
        "mem_train_peak_gib": train_peak,
        **{f"partial_{k}": v for k, v in made.partial.items()},
        **extra,
        **step_metrics(steps),
        **{k: round(v, 3) for k, v in times.items()},
    }


def eval_metrics(run: Run, it: int) -> dict:
    """Held-out accuracy (greedy, per task type, sampled at iteration ``it``'s temperature), mean reward and the
    time it took; the greedy responses go to ``held_out/iter_N.jsonl``."""
    t = time.time()
    out = save_responses(run.run_dir, f"iter_{it:06d}", evaluate(run.cluster.rollouts, run.tasks, run.tok, run.cfg,
                                                                 run.settings.rollout.task_types, run.progress, it=it))
    return {"accuracy": out.get("accuracy"), **{k: v for k, v in out.items() if k.startswith(("accuracy", "eval_"))},
            "time_eval": round(time.time() - t, 3)}


def save_best(run: Run, it: int, guard: CollapseGuard) -> None:
    """``best/``: the best evaluated weights (Hugging Face format, as ``final/``) with their trainer state, which
    a rollback returns to; written aside and renamed into place (``write_aside``: a full disk is one line)."""
    def fill(tmp: Path) -> None:
        run.cluster.trainers.save(str(tmp), trainer_state=True)
        copy_tokenizer(run.start_dir, tmp)
        (tmp / "best.json").write_text(json.dumps({"iteration": it, guard.metric: guard.best}))

    best = run.run_dir / BEST_DIR
    write_aside(best, fill, "best model", best if (best / "best.json").is_file() else None, "the previous best",
                "", run.checkpoint_bytes)


def roll_back(run: Run, it: int, why: str, done: int) -> tuple[int, float]:
    """Return the trainers and every inference engine to ``best/``, scale the learning rate, forget the samples the
    collapsed policy drew; returns the rollbacks so far and the new rate."""
    best, cfg = run.run_dir / BEST_DIR, run.cfg
    if not (best / "best.json").is_file():
        raise TrainingStopped(f"iteration {it}: {why}, and no best/ to roll back to (run.collapse_guard was off)")
    stream = run.stream
    if stream is not None:  # its batches ahead were drawn by the collapsed policy too
        stream.stop()
    run.cluster.trainers.load_state(str(best))
    lr = run.cluster.trainers.scale_lr(cfg.run.rollback_lr_factor)
    run.cluster.rollouts.update_weights()
    run.episodes.close(list(run.episodes.live))
    run.buffer = PartialRolloutBuffer(cfg.rollout.partial.max_age)  # sampled by the collapsed policy
    if stream is not None:
        run.stream = RolloutStream(run, it + 1, stream.k, run.cluster.rollouts.weights_version())
    came_from = json.loads((best / "best.json").read_text())["iteration"]
    run.console.print(f"[bold yellow]rollback:[/] iter {it}: {why}; back to best/ (iteration {came_from}), learning "
                      f"rate now {lr:.3g} (rollback {done + 1} of at most {cfg.run.max_rollbacks})")
    return done + 1, lr


def summarize(run_dir: Path, records: list[dict], initial: dict, wall_s: float, stopped: str | None) -> dict:
    """The run's summary (also written to ``summary.json``, strict JSON: a metric never measured is null) and its
    ``curves.png``."""
    summary = {
        **summary_figures(records, initial),
        "iterations": len(records),
        "rollbacks": sum(r.get("rollback", 0) for r in records),
        **({"best_model": str(run_dir / BEST_DIR)} if (run_dir / BEST_DIR).is_dir() else {}),
        "wall_s": round(wall_s, 2),
        "final_model": str(run_dir / "final"),
        **({"stopped_by": stopped} if stopped else {}),
    }
    summary = finite(summary)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, allow_nan=False))
    plot_curves(records, run_dir / "curves.png", initial)
    return summary


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
