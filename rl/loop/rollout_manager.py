"""The loop's handle on the rollout replicas: generation, rollout rounds, sleep and wake, the version of the weights
they hold, taking an update from the trainers, and replacing a replica that fails.

A replica that dies or stalls (no answer in ``run.step_timeout_s``) is replaced in place, counted in
``run.max_restarts``: a live peer sends the new one its weights point to point where it keeps the policy's whole
weights (``RunSettings.peer_catch_up``), else the trainers refill it; its requests go again with their own seeds, so
the run's samples are the same. The manager is a sequence of its Ray actors, worker order; where a new actor is
placed and wired to its worker's trainer is the placement's (``respawn``: ``rl.loop.cluster.Cluster``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import ray

from engines.inference.requests import Completion
from engines.inference.sampling import SamplingParams
from rl.loop.recovery import Restarts, WorkerFailed, gather
from rl.loop.stop import STOP_POLL_S, StopWatch
from rl.loop.trainer_group import TrainerGroup
from rl.rollout.turns import WorkerContexts
from rl.sample import Sample, TurnRequest, TurnResult
from rl.seeds import chunk_seed
from rl.settings import RunSettings


class RolloutManager:
    """The rollout replicas of a run (``actors``, one per worker) and what the loop asks of them."""

    def __init__(self, settings: RunSettings, actors: list, trainers: TrainerGroup, restarts: Restarts,
                 respawn: Callable[[int], None]) -> None:
        """``trainers``: the group that fills and updates the replicas; ``respawn(i)``: put a new, empty actor in
        place of replica ``i`` (in ``actors``), attached to its worker's IPC buffers and trainer."""
        self.settings, self.actors, self.trainers = settings, actors, trainers
        self.restarts, self.respawn = restarts, respawn
        self.timeout = settings.cluster.step_timeout_s
        self.lead = settings.cluster.parallel.lead  # worker -> the trainer rank that updates its replica
        self._stale: set[int] = set()  # replicas replaced while asleep: filled at wake-up
        self._version: int | None = None  # the weights the replicas serve, as last seen or sent
        self._staged: int | None = None   # disaggregated: an update waiting in the replicas' spare copies
        #: disaggregated: held by the loop while the trainers train and send their update, and while a replaced replica
        #: is filled, so that the fill knows which version the trainers' weights are
        self.weights_lock = threading.RLock()
        self.stop = StopWatch(None)  # the run's (rl.loop.stop): a stop asked while the loop waits on the replicas

    def __len__(self) -> int:
        return len(self.actors)

    def __getitem__(self, i: int):
        return self.actors[i]

    def __iter__(self) -> Iterator:
        return iter(self.actors)

    # --- generation ---------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: list[SamplingParams], seed: int,
                 on_chunk: Callable[[int], None] | None = None, images: list[tuple] | None = None) -> list[Completion]:
        """Spread requests over the replicas in chunks (``images``: each prompt's); results keep the prompts'
        order."""
        size = self.settings.rollout.chunk
        chunks = [range(i, min(i + size, len(prompts))) for i in range(0, len(prompts), size)]
        n = len(self.actors)
        images = images if images and any(images) else None

        def submit(i: int):
            c = chunks[i]
            extra = {"images": [images[j] for j in c]} if images else {}
            return self.actors[i % n].generate.remote([prompts[j] for j in c], [params[j] for j in c],
                                                      chunk_seed(seed, i), **extra)

        index = {submit(i): i for i in range(len(chunks))}
        results: list[list[Completion] | None] = [None] * len(chunks)
        while index:
            try:
                ref, got = self._first(list(index), [index[r] % n for r in index], "generate")
            except WorkerFailed as f:
                self.replace(f)  # its chunks go again, with their own seeds: the same completions
                index = {(submit(i) if i % n == f.index else r): i for r, i in index.items()}
                continue
            i = index.pop(ref)
            results[i] = got
            if on_chunk:
                on_chunk(len(chunks[i]))
        return [c for r in results for c in r]  # type: ignore[union-attr]

    def _first(self, refs: list, workers: list[int], phase: str) -> tuple:
        """The first of the replicas' calls ``refs`` (made on replicas ``workers``) to finish, and its value; a stop
        asked meanwhile is raised (``self.stop``, while the loop has it armed)."""
        t0 = time.monotonic()
        while True:
            self.stop.check()
            left = self.timeout - (time.monotonic() - t0)
            done, _ = ray.wait(refs, num_returns=1, timeout=max(min(left, STOP_POLL_S), 0))
            if done:
                break
            if left <= STOP_POLL_S:  # none of them answered: the first still busy is named (one call per replica)
                raise WorkerFailed("inference engine", workers[0], phase,
                                   f"stalled (no answer in run.step_timeout_s={self.timeout:g} s)",
                                   time.monotonic() - t0)
        k = refs.index(done[0])
        return refs[k], gather([refs[k]], "inference engine", phase, self.timeout, [workers[k]])[0]

    def rollout(self, samples: list[Sample], token_budget: int | None,
                on_worker: Callable[[int], None] | None = None, contexts: WorkerContexts | None = None
                ) -> tuple[list[TurnResult], list[dict[str, int]]]:
        """Run the current turn of ``samples`` (new and paused) on the replicas, whole prompt groups per replica
        (they share a prefill); each gets an equal share of the token budget. Returns each sample's ``TurnResult``
        (only its new tokens, tagged with the version of the weights its replica holds: the caller appends them)
        and each replica's counters (``rl.rollout.phase.engine_metrics`` sums them). A replica is sent only what it
        does not hold of a sample's context (``rl.rollout.turns``; ``contexts``: what each holds, kept by the caller
        over the rounds of a rollout phase; None: the whole contexts)."""
        n = len(self.actors)
        contexts = WorkerContexts() if contexts is None else contexts
        groups = sorted({s.group for s in samples})
        worker_of = {g: i % n for i, g in enumerate(groups)}
        shares: list[list[Sample]] = [[] for _ in range(n)]
        for s in samples:
            shares[worker_of[s.group]].append(s)
        budget = None if token_budget is None else max(1, token_budget // n)
        asked: dict[int, list[TurnRequest]] = {}

        def submit(i: int):
            asked[i] = contexts.requests(i, self.actors[i], shares[i])
            return self.actors[i].rollout.remote(asked[i], budget)

        pending = {submit(i): i for i in range(n)}
        out: list[TurnResult] = []
        counts: list[dict[str, int]] = []
        while pending:
            try:
                ref, (got, stats, missing) = self._first(list(pending), list(pending.values()), "rollout")
            except WorkerFailed as f:  # its groups are generated again, with their seeds: the same samples
                self.replace(f)
                contexts.forget(f.index)  # the new replica holds no context: they go whole
                pending = {r: i for r, i in pending.items() if i != f.index}
                pending[submit(f.index)] = f.index
                continue
            i = pending.pop(ref)
            if missing:  # it does not hold what it was sent on top of (nothing was generated): they go whole
                contexts.forget(i)
                pending[submit(i)] = i
                continue
            contexts.received(i, self.actors[i], asked[i], got)
            out += got
            counts.append(stats)
            if on_worker:
                on_worker(len(got))
        return out, counts

    def call_all(self, call: Callable, phase: str) -> list:
        """``call(actor)`` on every replica; one that fails is replaced in place (filled when they wake) and called
        again."""
        refs = [call(r) for r in self.actors]
        while True:
            try:
                return gather(refs, "inference engine", phase, self.timeout)
            except WorkerFailed as f:
                self.replace(f, stale=True)
                refs[f.index] = call(self.actors[f.index])

    # --- colocation: sleep and wake -------------------------------------------------------------------

    def sleep(self) -> None:
        """Free inference memory (per ``rollout.sleep_level``) before the trainers run."""
        self.call_all(lambda r: r.sleep.remote(self.settings.rollout.sleep_level), "sleep")

    def wake(self) -> None:
        """Reallocate the replicas' memory: at ``rollout.sleep_level`` 2 only their weights (``update_weights``,
        which fills them, then wakes the KV caches: a two-step wake, so the update never needs the KV cache's
        memory), else everything; replicas replaced while asleep get the current weights."""
        two_step = self.settings.rollout.sleep_level == 2
        self.call_all(lambda r: r.wake_up.remote(not two_step), "wake-up")
        if self._stale:
            stale, self._stale = self._stale, set()
            live = [j for j in range(len(self.actors)) if j not in stale]
            if live and not two_step and self.settings.peer_catch_up:  # a peer that kept its weights serves them
                for i in sorted(stale):
                    self._catch_up(i, live[0])
            else:  # (a base from the checkpoint where the updates carry none, see replace)
                ray.get([self.actors[i].prepare_refill.remote() for i in sorted(stale)])
                self.refill()

    # --- weights --------------------------------------------------------------------------------------

    def weights_version(self) -> int:
        """The version of the weights the replicas hold: their receivers' count of updates (the one owner)."""
        self._version = max(self.call_all(lambda r: r.weights_version.remote(), "weights version"))
        return self._version

    def adopt_version(self, version: int) -> None:
        """A resumed run: the replicas' start-up weights are the checkpoint's, of ``version``."""
        self.call_all(lambda r: r.adopt_version.remote(version), "weights version")
        self._version = version

    def update_weights(self, changed: bool = True) -> None:
        """The trainers' update of every replica (checkpoint engine): new weights (``changed``), or, where the
        replicas discarded theirs to sleep (level 2), the same ones again; then, at level 2, the replicas take their
        KV caches back (the second step of ``wake``)."""
        level = self.settings.rollout.sleep_level
        try:
            if changed:
                self.push(self.weights_version() + 1)
            elif level == 2:
                self.refill()
        finally:
            if level == 2:  # replicas that are awake already take nothing
                self.call_all(lambda r: r.wake_up.remote(), "wake-up")

    def refill(self) -> None:
        """Every replica gets the trainers' current weights again, as the same version (collective): a replaced
        replica's fill, or a resumed run whose updates carry no base (the start-up filled the base, this serves the
        checkpoint's adapters on it)."""
        self.push(self.weights_version())

    def push(self, version: int, staged: bool = False, replicas: list[int] | None = None) -> None:
        """The trainers' update ``version`` into every replica (collective). Disaggregated it goes point to point (to
        ``replicas`` only, where given), the replicas receiving it on a thread of their own while they generate, and
        served at once unless ``staged`` (then ``swap_weights`` serves it)."""
        if not self.settings.cluster.disaggregated:
            self.trainers.push_weights(version)
            return
        to = list(range(len(self.actors))) if replicas is None else replicas
        refs = [self.actors[i].receive_update.remote(version) for i in to]
        self.trainers.push_weights(version, replicas)
        gather(refs, "inference engine", "weight update", self.timeout, to)
        if replicas is not None:  # a replaced replica's fill: the others are left as they are
            gather([self.actors[i].commit_update.remote(version) for i in to], "inference engine", "weight update",
                   self.timeout, to)
        elif staged:
            self._staged = version
        else:
            self.call_all(lambda r: r.commit_update.remote(version), "weight update")
            self._version, self._staged = version, None

    def stage_weights(self) -> int | None:
        """Disaggregated: the trainers' next update into every replica's spare copy, while they keep generating;
        returns its version for ``swap_weights``, or None where a replica loads updates in place (a stream into
        vLLM's load): then the whole update waits for ``swap_weights``."""
        if not all(self.call_all(lambda r: r.stages_updates.remote(), "weight update")):
            return None
        version = self.weights_version() + 1
        self.push(version, staged=True)
        return version

    def swap_weights(self, staged: int | None) -> None:
        """Serve the update ``stage_weights`` staged (or, None, push one now, loaded in place); between two
        generation rounds."""
        if staged is None:
            self.push(self.weights_version() + 1)
            return
        self.call_all(lambda r: r.commit_update.remote(staged), "weight update")
        self._version, self._staged = staged, None

    # --- a replica that failed ------------------------------------------------------------------------

    def replace(self, failure: WorkerFailed, stale: bool = False) -> None:
        """A new replica in place of the failed one (counted in ``run.max_restarts``): it copies a live peer's
        weights through the checkpoint engine, or the trainers' when no peer can serve them; ``stale``: the replicas
        sleep, it is filled when they wake."""
        i, n = failure.index, len(self.actors)
        if self.settings.cluster.disaggregated:  # they never sleep: fill it now
            self._replace_apart(failure)
            return
        # a peer serves it where it keeps the policy's whole weights; else the trainers refill it (where their
        # updates carry no base, it reads the base from the checkpoint the run started from first)
        peer = n > 1 and self.settings.peer_catch_up
        how = "filled at wake-up" if stale else f"weights from engine {(i + 1) % n}" if peer else \
            self.settings.refill_source
        self.restarts.take(failure, f"inference engine {i} replaced in place ({how})")
        if not stale and peer:
            self.restart(i, (i + 1) % n)
            return
        self.respawn(i)
        if stale:
            self._stale.add(i)
        else:
            ray.get(self.actors[i].prepare_refill.remote())
            self.refill()

    def _replace_apart(self, failure: WorkerFailed) -> None:
        """A disaggregated replica's replacement, filled point to point by the trainers with the weights they hold,
        labelled with their version: the update waiting in the replicas' spare copies if one is, else the last one
        served (one more if the trainers trained since; ``weights_lock`` keeps them from training meanwhile). The
        other replicas keep generating and serving what they serve."""
        i = failure.index
        self.restarts.take(failure, f"inference engine {i} replaced in place ({self.settings.refill_source})")
        with self.weights_lock:
            version = self._staged if self._staged is not None else (self._version or 0) + int(self.trainers.ahead)
            self.respawn(i)
            ray.get(self.actors[i].prepare_refill.remote())
            self.push(version, replicas=[i])

    def restart(self, i: int, source: int) -> float:
        """Replace replica ``i`` by a fresh one that copies replica ``source``'s weights point to point (the others
        keep serving); returns the seconds the copy took."""
        if i == source or not (0 <= i < len(self.actors) and 0 <= source < len(self.actors)):
            raise ValueError(f"restart: need two different engines of {len(self.actors)}, got {i}, {source}")
        self.respawn(i)
        return self._catch_up(i, source)

    def _catch_up(self, i: int, source: int) -> float:
        """Replica ``i`` copies replica ``source``'s weights through the two workers' lead trainer ranks."""
        return self.trainers.catch_up(self.lead(source), self.lead(i))
