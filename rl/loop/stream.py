"""An iteration's batch: its rollout phase and rewards (``collect``), made in turn with training (colocated) or ahead
of it on a thread of the driver (``RolloutStream``, the disaggregated placement).

Disaggregated, the rollout replicas and the trainers are separate workers that run at once. The stream generates
iteration ``j``'s batch — its new groups drawn, generated round by round — as soon as the trainer has trained
iterations up to ``j − k − 1`` (``k``: ``algorithm.max_staleness``), so the replicas work at most ``k`` iterations
ahead; its finished groups are rewarded on a thread of their own while the replicas go on to batch ``j + 1`` (a
verifier that waits, a sandbox, a judge, overlap generation; up to ``k`` batches are rewarded at once), and the
trainer takes batch ``j`` when it is rewarded. A weight update and a generation round
never overlap (``lock``): an update waits for the round in flight to end, and the responses still generating go on
under the new weights, their tokens tagged with each version (or start again, ``rollout.on_update: abort``). With
``k = 0`` nothing overlaps and the batches are the colocated loop's.

When the trainer takes a batch it keeps only groups whose every sample's oldest token is at most ``k`` versions
behind the weights it trains (``eligible``): a sample paused over several updates (partial rollout) can be older.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rl.loop.guards import check_error_rate
from rl.loop.stop import STOP_POLL_S
from rl.rollout.critic_loop import critic_training_batch
from rl.rollout.phase import draw_groups, run_rollout
from rl.rollout.rewards import episode_runner, reward_phase
from rl.sample import Sample

if TYPE_CHECKING:
    from rl.loop.controller import Run


@dataclass(kw_only=True)
class Collected:
    """What an iteration's rollout phase and rewards made: its training samples and their metrics."""

    samples: list[Sample]
    stats: dict[str, Any]            # reward metrics (rl.rollout.rewards.settle)
    temps: dict[str, float]          # the sampling temperature of each task type drawn
    generated: int                   # tokens generated
    engine: dict[str, Any]           # the engines' counters (rl.rollout.phase.engine_metrics)
    partial: dict[str, int]          # the partial-rollout buffer's counters after the phase
    times: dict[str, float] = field(default_factory=dict)  # time_rollout, time_reward


@contextmanager
def timed(times: dict[str, float], phase: str):
    """``times["time_" + phase]``: the seconds the block took."""
    t = time.time()
    yield
    times[f"time_{phase}"] = time.time() - t


@dataclass(kw_only=True)
class Generated:
    """An iteration's rollout phase, before its rewards: the groups that finished and what ``Collected`` keeps."""

    it: int
    groups: list[list[Sample]]
    runner: Any                      # the iteration's environment runner (rl.rollout.rewards.episode_runner)
    template_errors: int
    temps: dict[str, float]
    generated: int
    engine: dict[str, Any]
    partial: dict[str, int]
    times: dict[str, float]


def generate(run: Run, it: int, rollouts) -> Generated:
    """Iteration ``it``'s rollout phase on ``rollouts``: new groups drawn, every running sample generated under the
    token budget; the groups that finished are taken out of the buffer."""
    cfg, s, times = run.cfg, run.settings, {}
    runner = episode_runner(rollouts, cfg, run.tasks, run.tok, s.rollout.task_types, it)
    run.episodes.runner = runner
    try:
        with timed(times, "rollout"):
            temps = draw_groups(run.buffer, run.tasks, run.tok, s.rollout, it, cfg.run.seed)
            generated, engine = run_rollout(rollouts, run.buffer, run.episodes, run.tasks, it,
                                            s.rollout.token_budget, run.progress)
    except BaseException:
        runner.close()
        raise
    groups = run.buffer.pop_complete()
    partial = run.buffer.stats()  # after pop_complete: waiting_groups are the groups carried over
    return Generated(it=it, groups=groups, runner=runner, template_errors=run.episodes.take_template_errors(),
                     temps=temps, generated=generated, engine=engine, partial=partial, times=times)


def reward(run: Run, gen: Generated, rollouts) -> Collected:
    """The rewards of ``gen``'s finished groups (and a critic's judged pairs, generated on ``rollouts``)."""
    cfg, s, times = run.cfg, run.settings, dict(gen.times)
    try:
        with timed(times, "reward"):  # the engines sleep only after rewards: a critic may run the policy on them
            samples, stats = reward_phase(gen.groups, run.tasks, run.tok, s.rollout.task_types, gen.runner,
                                          gen.template_errors)
            if cfg.algorithm.critic_training.enabled:  # the policy's own judgments of verifiable pairs
                judged, critic_stats = critic_training_batch(rollouts, run.tok, cfg, samples, gen.it)
                samples += judged
                stats.update(critic_stats, trained_samples=len(samples))
    finally:
        gen.runner.close()
    check_error_rate(stats, cfg.run.max_env_error_rate)
    return Collected(samples=samples, stats=stats, temps=gen.temps, generated=gen.generated, engine=gen.engine,
                     partial=gen.partial, times=times)


def collect(run: Run, it: int, rollouts) -> Collected:
    """Iteration ``it``'s rollout phase on ``rollouts`` and the rewards of the groups that finished."""
    return reward(run, generate(run, it, rollouts), rollouts)


def eligible(samples: list[Sample], version: int, k: int) -> tuple[list[Sample], dict[str, Any]]:
    """The samples of the groups whose every sample's oldest token was sampled by weights at most ``k`` versions
    behind ``version`` (the trainer's), and the staleness metrics of what is kept: ``staleness/S`` samples S versions
    old, ``staleness_max``, ``stale_token_share`` (the share of the kept tokens from versions before ``version``),
    ``stale_dropped`` (samples left out)."""
    too_old = {s.group for s in samples if (v := s.oldest_version()) is not None and version - v > k}
    kept = [s for s in samples if s.group not in too_old]
    ages = Counter(version - (s.oldest_version() if s.oldest_version() is not None else version) for s in kept)
    tokens = stale = 0
    for s in kept:
        for n, (start, v) in enumerate(s.segments.tolist()):
            end = s.segments[n + 1, 0] if n + 1 < len(s.segments) else len(s.response_ids)
            tokens += end - start
            stale += (end - start) * (v < version)
    out: dict[str, Any] = {f"staleness/{a}": n for a, n in sorted(ages.items())}
    out.update(staleness_max=max(ages, default=0), stale_token_share=round(stale / tokens, 4) if tokens else 0.0,
               stale_dropped=len(samples) - len(kept))
    return kept, out


class _Locked:
    """The rollout replicas as the stream uses them: each generation round (and a critic's generation) holds the
    stream's lock, so that no weight update lands in the middle of one (a replica between two buckets of an update
    serves no request); with ``rollout.on_update: abort`` a single-turn sample that has tokens of older weights than
    the replicas hold starts again first."""

    def __init__(self, stream: RolloutStream) -> None:
        self.stream, self.rollouts = stream, stream.run.cluster.rollouts

    def __getattr__(self, name: str) -> Any:  # everything else: as the manager does it
        return getattr(self.rollouts, name)

    def generate(self, *args, **kwargs):
        with self.stream.lock:
            return self.rollouts.generate(*args, **kwargs)

    def rollout(self, samples: list[Sample], *args, **kwargs):
        with self.stream.lock:
            if self.stream.run.settings.cluster.on_update == "abort":
                for s in samples:
                    if not s.multi_turn and (v := s.oldest_version()) is not None and v < self.stream.version:
                        s.restart()
            return self.rollouts.rollout(samples, *args, **kwargs)


class RolloutStream:
    """Makes iterations' batches on a thread of its own, up to ``k`` iterations ahead of the trainer (see the
    module docstring). The trainer thread calls ``take(it)``, then updates the weights inside ``lock`` and calls
    ``trained(it)``; ``stop()`` ends the thread after the batch it is making."""

    def __init__(self, run: Run, start: int, k: int, version: int) -> None:
        """``start``: the first iteration to make; ``version``: the weights the replicas hold now."""
        self.run, self.k, self.version = run, k, version
        self.lock = threading.Lock()  # a generation round or a weight update, never both
        self._cond = threading.Condition()
        self._trained = start  # iterations trained so far: batch j may start once this reaches j − k
        self._ready: dict[int, Collected] = {}
        self._error: BaseException | None = None
        self._stopping = False
        self._idle = 0.0  # seconds the stream waited for weights since the last take
        self._rollouts = _Locked(self)
        self._thread = threading.Thread(target=self._run, args=(start,), name="rollout-stream", daemon=True)
        self._thread.start()

    def _run(self, j: int) -> None:
        # the rewards of up to k batches at once (each with its own env_workers): a slow verifier's batch overlaps the
        # next ones' generation and rewards instead of holding the replicas k batches ahead of nothing
        rewarding = ThreadPoolExecutor(max(1, self.k), thread_name_prefix="rollout-rewards")
        try:
            while j < self.run.cfg.run.iterations:
                t = time.monotonic()
                with self._cond:
                    self._cond.wait_for(lambda j=j: self._stopping or self._error is not None
                                        or self._trained >= j - self.k)
                    if self._stopping or self._error is not None:
                        return
                    self._idle += time.monotonic() - t
                rewarding.submit(self._reward, generate(self.run, j, self._rollouts))  # the next batch generates
                j += 1
        except BaseException as e:  # the trainer thread raises it at its next take
            self._fail(e)
        finally:
            rewarding.shutdown(wait=True)

    def _reward(self, gen: Generated) -> None:
        """Batch ``gen.it``'s rewards, on the rewards' thread while the replicas generate the next batch."""
        try:
            made = reward(self.run, gen, self._rollouts)
        except BaseException as e:
            self._fail(e)
            return
        with self._cond:
            self._ready[gen.it] = made
            self._cond.notify_all()

    def _fail(self, e: BaseException) -> None:
        with self._cond:
            self._error = self._error or e
            self._cond.notify_all()

    def take(self, it: int) -> tuple[Collected, dict[str, float]]:
        """Batch ``it`` once it is made (an error of the stream is raised here), and how the two sides waited:
        ``time_trainer_idle`` (this wait), ``time_rollout_idle`` (the stream's waits for weights since the last
        take), ``queue_depth`` (batches made beyond this one). A stop asked while it waits is raised
        (``rl.loop.stop``)."""
        t = time.monotonic()
        with self._cond:
            while not self._cond.wait_for(lambda: it in self._ready or self._error is not None, STOP_POLL_S):
                self.run.cluster.rollouts.stop.check()  # the trainers hold the state after iteration it − 1
            if it not in self._ready:
                raise self._error  # type: ignore[misc]
            made = self._ready.pop(it)
            waits = {"time_trainer_idle": round(time.monotonic() - t, 3), "time_rollout_idle": round(self._idle, 3),
                     "queue_depth": len(self._ready)}
            self._idle = 0.0
        return made, waits

    def trained(self, it: int, version: int) -> None:
        """Iteration ``it`` is trained and its weights (``version``) are on the replicas: batches up to ``it + 1 + k``
        may start."""
        with self._cond:
            self._trained, self.version = it + 1, version
            self._cond.notify_all()

    def stop(self) -> None:
        """End the thread after the batch it is making, if any."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()
