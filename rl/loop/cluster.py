"""The Ray side of the controller: start (or join) the cluster, place colocated workers, and run
each phase across them."""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import replace

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engines.device import CPU_TRAINER_MALLOC
from engines.inference.requests import Completion
from engines.inference.sampling import SamplingParams
from rl.algo.batches import RankBatch
from rl.errors import UserError
from rl.loop.placement import probe_bundles, reachable_model_dirs, unplaceable, worker_bundle, worker_threads
from rl.loop.recovery import Restarts, WorkerFailed, gather, next_item
from rl.loop.workers import RolloutWorker, TrainerWorker
from rl.rollout.turns import WorkerContexts
from rl.sample import Sample, TurnRequest, TurnResult
from rl.seeds import chunk_seed
from rl.settings import RunSettings

# Both actors of a worker share one bundle: they alternate, never compute at the same time.
ACTOR_CPUS = 0.5
PLACEMENT_WAIT_S = 120


class Cluster:
    """Colocated workers: per placement-group bundle one inference actor and one trainer rank, or, where the replica
    spans the bundle's GPUs (tensor parallel), one trainer rank per GPU."""

    def __init__(self, settings: RunSettings, model_dir: str, restarts: Restarts | None = None,
                 reference_dir: str | None = None) -> None:
        """``settings``: the run's, resolved (``rl.settings``); ``restarts``: the run's recoveries so far (an
        inference engine that dies or stalls is replaced in place, counted there); ``reference_dir``: the model the
        run started from, the reference policy of a KL penalty (``algorithm.kl_coef``; default ``model_dir``)."""
        self.settings, c = settings, settings.cluster
        self.timeout = c.step_timeout_s
        self.restarts = restarts or Restarts(c.max_restarts)
        self.broken = False  # a worker failed: close() does not wait on the workers
        self._stale: set[int] = set()  # engines replaced while asleep: filled at wake-up
        self._own_ray = not ray.is_initialized()
        if self._own_ray:
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            ray.init(
                address=c.ray_address,
                num_cpus=None if c.ray_address else max(2, os.cpu_count() or 2),
                include_dashboard=False,
                logging_level=logging.ERROR,
                log_to_driver=False,
                object_store_memory=None if c.ray_address else 256 * 2**20,
            )
        dims = self.dims = c.parallel  # the trainers' layout: ranks per worker, each worker's lead rank
        n, gpus = dims.workers, c.gpus_per_worker
        # a tensor-parallel replica holds all of its bundle's GPUs (Ray hands out whole GPUs above one), and the
        # worker's trainer is as many ranks, one on each of them (FSDP2 over every GPU of the run); otherwise one
        # trainer and one replica, half the bundle's GPUs each: Ray then shows both actors the same device(s)
        spans = settings.rollout.engine.tensor_parallel_size > 1 and gpus > 0
        # one worker slot each where the pods offer them
        bundle = worker_bundle((1 + dims.ranks_per_worker) * ACTOR_CPUS, gpus)
        self.pg = placement_group([bundle] * n, strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=PLACEMENT_WAIT_S)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.pg)
            raise UserError(unplaceable(bundle, n, PLACEMENT_WAIT_S)) from None
        prefix = f"rl-{uuid.uuid4().hex[:8]}"
        # each worker's threads from its own pod's CPUs, and the model where its node can read it
        sites = probe_bundles(self.pg, n, model_dir)
        threads, dirs = worker_threads(sites, c.threads_per_worker), reachable_model_dirs(model_dir, sites)

        def placed(cls, i):
            strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i)
            share = (gpus if cls is RolloutWorker else 0) if spans else gpus / 2
            # a CPU trainer reuses freed host memory instead of faulting it in again (engines.device)
            env = {"env_vars": CPU_TRAINER_MALLOC} if cls is TrainerWorker and not gpus else None
            return ray.remote(num_cpus=ACTOR_CPUS, num_gpus=share, scheduling_strategy=strategy,
                              runtime_env=env)(cls)

        self._placed = placed
        self._rollout_args = [(replace(settings.rollout.engine, model_dir=dirs[i]), threads[i], gpus) for i in range(n)]
        self.rollouts = [placed(RolloutWorker, i).remote(*self._rollout_args[i]) for i in range(n)]
        devices = ray.get([r.visible_devices.remote() for r in self.rollouts]) if spans else [None] * n
        # trainer rank r: on its worker's devices, the local_index(r)-th GPU of that worker's replica
        at = dims.worker_of
        self.trainers = [placed(TrainerWorker, at(r)).remote(
            settings.trainer, settings.update, threads[at(r)], devices[at(r)].split(",")[dims.local_index(r)]
            if spans else None) for r in range(dims.world)]
        address = ray.get(self.trainers[0].rendezvous.remote(c.ray_address is None))
        ray.get([t.setup.remote(dirs[at(r)], r, dims.world, address, f"{prefix}-w{r}")
                 for r, t in enumerate(self.trainers)])
        # one plan for all (every rank computed the same); each replica maps its worker's first rank's IPC buffers,
        # and that rank updates it (the worker's other ranks take part in every broadcast)
        plans = ray.get([t.weight_plan.remote() for t in self.trainers])
        self._plans = plans
        if spans and settings.rollout.engine.ipc_views:  # each replica rank loads from its own GPU's trainer rank
            ray.get([t.share_replica.remote(dims.ranks_per_worker) for t in self.trainers])
        ray.get([self._attach(i) for i in range(n)])
        ray.get([t.connect.remote([self.rollouts[at(r)]] if dims.is_lead(r) else [])
                 for r, t in enumerate(self.trainers)])
        self.num_buckets = len(plans[0][0].buckets)
        self._startup([dirs[at(r)] for r in range(dims.world)])
        if settings.trainer.reference:  # the reference policy: one more collective read, of the starting model
            refs = reachable_model_dirs(reference_dir or model_dir, sites)
            ray.get([t.load_reference.remote(refs[at(r)]) for r, t in enumerate(self.trainers)])

    def lead(self, i: int) -> int:
        """The trainer rank that updates worker ``i``'s inference engine (its first: ``ParallelDims.lead``)."""
        return self.dims.lead(i)

    def _attach(self, i: int):
        """Engine ``i`` maps its worker's IPC buffers: its lead trainer rank's, and every rank's of the worker for
        a replica whose ranks load from their own GPU's (vLLM's ipc_views)."""
        handles = [self._plans[r][1] for r in self.dims.ranks_of(i)]
        return self.rollouts[i].attach.remote(self._plans[0][0], handles[0], handles, self.settings.adapters)

    def _startup(self, dirs: list[str]) -> None:
        """Read the model once, collectively: each trainer reads some of its files and the checkpoint
        engine fills every trainer shard and, when they hold the checkpoint's dtypes, every inference
        engine; otherwise the first update from the trainers fills them."""
        plan, replicas = ray.get(self.trainers[0].startup_plan.remote(dirs[0]))
        if replicas:
            ray.get([r.use_plan.remote(plan) for r in self.rollouts])
        #: per trainer: the tensors it read from each file (each file is read by one trainer)
        reads = ray.get([t.startup.remote(d) for t, d in zip(self.trainers, dirs, strict=True)])
        self.startup_reads = [r["reads"] for r in reads]
        if replicas:
            ray.get([r.use_plan.remote() for r in self.rollouts])
        else:  # as update 0, which the next update_weights follows
            ray.get([t.update_weights.remote(0) for t in self.trainers])

    def generate(self, prompts: list[list[int]], params: list[SamplingParams], seed: int,
                 on_chunk: Callable[[int], None] | None = None) -> list[Completion]:
        """Spread requests over the inference engines in chunks; results keep the prompts' order."""
        size = self.settings.rollout.chunk
        chunks = [range(i, min(i + size, len(prompts))) for i in range(0, len(prompts), size)]
        n = len(self.rollouts)

        def submit(i: int):
            c = chunks[i]
            return self.rollouts[i % n].generate.remote([prompts[j] for j in c], [params[j] for j in c],
                                                        chunk_seed(seed, i))

        index = {submit(i): i for i in range(len(chunks))}
        results: list[list[Completion] | None] = [None] * len(chunks)
        while index:
            try:
                ref, got = self._first(list(index), [index[r] % n for r in index], "generate")
            except WorkerFailed as f:
                self.replace_rollout(f)  # its chunks go again, with their own seeds: the same completions
                index = {(submit(i) if i % n == f.index else r): i for r, i in index.items()}
                continue
            i = index.pop(ref)
            results[i] = got
            if on_chunk:
                on_chunk(len(chunks[i]))
        return [c for r in results for c in r]  # type: ignore[union-attr]

    def _first(self, refs: list, workers: list[int], phase: str) -> tuple:
        """The first of the engines' calls ``refs`` (made on engines ``workers``) to finish, and its value."""
        t0 = time.monotonic()
        done, _ = ray.wait(refs, num_returns=1, timeout=self.timeout)
        if not done:  # none of them answered: the first still busy is named (each engine has one call here)
            raise WorkerFailed("inference engine", workers[0], phase,
                               f"stalled (no answer in run.step_timeout_s={self.timeout:g} s)", time.monotonic() - t0)
        k = refs.index(done[0])
        return refs[k], gather([refs[k]], "inference engine", phase, self.timeout, [workers[k]])[0]

    def rollout(self, samples: list[Sample], token_budget: int | None,
                on_worker: Callable[[int], None] | None = None, contexts: WorkerContexts | None = None
                ) -> tuple[list[TurnResult], list[dict[str, int]]]:
        """Run the current turn of ``samples`` (new and paused) on the inference engines, whole prompt groups per
        engine (they share a prefill); each engine gets an equal share of the token budget. Returns each sample's
        ``TurnResult`` (only its new tokens, tagged with the version of the weights its replica holds: the caller
        appends them) and each engine's counters (``rl.rollout.phase.engine_metrics`` sums them). An engine is sent
        only what it does not hold of a sample's context (``rl.rollout.turns``; ``contexts``: what each holds, kept
        by the caller over the rounds of a rollout phase; None: the whole contexts)."""
        n = len(self.rollouts)
        contexts = WorkerContexts() if contexts is None else contexts
        groups = sorted({s.group for s in samples})
        worker_of = {g: i % n for i, g in enumerate(groups)}
        shares: list[list[Sample]] = [[] for _ in range(n)]
        for s in samples:
            shares[worker_of[s.group]].append(s)
        budget = None if token_budget is None else max(1, token_budget // n)
        asked: dict[int, list[TurnRequest]] = {}

        def submit(i: int):
            asked[i] = contexts.requests(i, self.rollouts[i], shares[i])
            return self.rollouts[i].rollout.remote(asked[i], budget)

        pending = {submit(i): i for i in range(n)}
        out: list[TurnResult] = []
        counts: list[dict[str, int]] = []
        while pending:
            try:
                ref, (got, stats, missing) = self._first(list(pending), list(pending.values()), "rollout")
            except WorkerFailed as f:  # its groups are generated again, with their seeds: the same samples
                self.replace_rollout(f)
                contexts.forget(f.index)  # the new engine holds no context: they go whole
                pending = {r: i for r, i in pending.items() if i != f.index}
                pending[submit(f.index)] = f.index
                continue
            i = pending.pop(ref)
            if missing:  # it does not hold what it was sent on top of (nothing was generated): they go whole
                contexts.forget(i)
                pending[submit(i)] = i
                continue
            contexts.received(i, self.rollouts[i], asked[i], got)
            out += got
            counts.append(stats)
            if on_worker:
                on_worker(len(got))
        return out, counts

    def train(self, batches: list[RankBatch], on_step: Callable[[dict], None] | None = None) -> list[dict[str, float]]:
        """One policy update (K1.5, GRPO or DAPO; + PTX): each trainer rank gets its own share (one object each,
        ``rl.algo.batches``); returns the metrics of each optimizer step (reduced over the ranks)."""
        from engines.training.engine import NonFiniteError
        from rl.errors import TrainingStopped

        gens = [t.train.remote(ray.put(b)) for t, b in zip(self.trainers, batches, strict=True)]
        steps = []
        try:
            while True:
                try:
                    steps.append(self._trainer_step(gens, 0))
                except StopIteration:
                    break
                if on_step:
                    on_step(steps[-1])
            for i in range(1, len(gens)):
                while True:
                    try:
                        self._trainer_step(gens, i)
                    except StopIteration:
                        break
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, NonFiniteError):
                raise TrainingStopped(str(e.cause)) from None
            raise
        return steps

    def _trainer_step(self, gens: list, i: int) -> dict:
        """Rank ``i``'s next training step; a rank broken by the death of another is that one's failure."""
        try:
            return next_item(gens[i], "trainer", i, "train", self.timeout)
        except ray.exceptions.RayTaskError as e:  # a rank broken by a peer that died: that peer is the fault
            for j in range(len(gens)):
                try:
                    if j != i:
                        next_item(gens[j], "trainer", j, "train", 5.0)
                except WorkerFailed as f:
                    if not f.stalled:
                        raise self._broken(f) from None
                except Exception:  # the peer's own error or end: not the cause looked for
                    pass
            raise e from None
        except WorkerFailed as f:
            raise self._broken(f) from None

    def _broken(self, failure: WorkerFailed) -> WorkerFailed:
        self.broken = True
        return failure

    def _trainers(self, refs: list, phase: str, ranks: list[int] | None = None) -> list:
        """The trainers' calls ``refs`` (of ``ranks``, default all), within the step timeout; a failed trainer
        marks the cluster broken."""
        try:
            return gather(refs, "trainer", phase, self.timeout, ranks)
        except WorkerFailed as f:
            raise self._broken(f) from None

    def _rollouts(self, call: Callable, phase: str) -> list:
        """``call(engine)`` on every inference engine; one that fails is replaced in place and called again."""
        refs = [call(r) for r in self.rollouts]
        while True:
            try:
                return gather(refs, "inference engine", phase, self.timeout)
            except WorkerFailed as f:
                self.replace_rollout(f, stale=True)
                refs[f.index] = call(self.rollouts[f.index])

    def replace_rollout(self, failure: WorkerFailed, stale: bool = False) -> None:
        """A new inference engine in place of the failed one (counted in ``run.max_restarts``): it copies a live
        peer's weights through the checkpoint engine, or the trainers' when it is the only one; ``stale``: the
        engines sleep, it is filled when they wake."""
        i, n = failure.index, len(self.rollouts)
        # a peer serves it where it keeps the policy's whole weights; else the trainers refill it (where their
        # updates carry no base, it reads the base from the checkpoint the run started from first)
        peer = n > 1 and self.settings.peer_catch_up
        how = "filled at wake-up" if stale else f"weights from engine {(i + 1) % n}" if peer else \
            self.settings.refill_source
        self.restarts.take(failure, f"inference engine {i} replaced in place ({how})")
        if not stale and peer:
            self.restart_rollout(i, (i + 1) % n)
            return
        ray.kill(self.rollouts[i])
        self.rollouts[i] = self._placed(RolloutWorker, i).remote(*self._rollout_args[i])
        ray.get(self._attach(i))
        ray.get(self.trainers[self.lead(i)].connect.remote([self.rollouts[i]]))
        if stale:
            self._stale.add(i)
        else:
            ray.get(self.rollouts[i].prepare_refill.remote())
            self._refill()

    def resend_weights(self) -> None:
        """Every inference engine gets the trainers' current weights again, as the same version (a resumed run whose
        updates carry no base: the start-up filled the base, this serves the checkpoint's adapters on it)."""
        self._refill()

    def _refill(self) -> None:
        """Every inference engine gets the trainers' current weights again (collective, same version)."""
        version = self.weights_version()
        self._trainers([t.update_weights.remote(version) for t in self.trainers], "weight update")

    def train_peak_gib(self) -> float:
        """The largest trainer process's peak memory over its last training phase (GiB)."""
        return round(max(self._trainers([t.peak_memory.remote() for t in self.trainers], "train")) / 2**30, 3)

    def offload_trainers(self) -> dict:
        """Trainer state to host memory (rank 0's figures)."""
        return self._trainers([t.offload.remote() for t in self.trainers], "offload")[0]

    def onload_trainers(self) -> dict:
        return self._trainers([t.onload.remote() for t in self.trainers], "onload")[0]

    def sleep_rollouts(self) -> None:
        """Free inference memory (per ``rollout.sleep_level``) before the trainer runs."""
        self._rollouts(lambda r: r.sleep.remote(self.settings.rollout.sleep_level), "sleep")

    def wake_rollouts(self) -> None:
        """Reallocate the engines' memory: at ``rollout.sleep_level`` 2 only their weights (``update_weights``, which
        fills them, then wakes the KV caches: a two-step wake, so the update never needs the KV cache's memory),
        else everything; engines replaced while asleep get the current weights."""
        two_step = self.settings.rollout.sleep_level == 2
        self._rollouts(lambda r: r.wake_up.remote(not two_step), "wake-up")
        if self._stale:
            stale, self._stale = self._stale, set()
            live = [j for j in range(len(self.rollouts)) if j not in stale]
            if live and not two_step and self.settings.peer_catch_up:  # a peer that kept its weights serves them
                for i in sorted(stale):
                    self._catch_up(i, live[0])
            else:  # (a base from the checkpoint where the updates carry none, see replace_rollout)
                ray.get([self.rollouts[i].prepare_refill.remote() for i in sorted(stale)])
                self._refill()

    def weights_version(self) -> int:
        """The version of the weights the replicas hold: their receivers' count of updates (the one owner)."""
        return max(self._rollouts(lambda r: r.weights_version.remote(), "weights version"))

    def adopt_version(self, version: int) -> None:
        """A resumed run: the replicas' start-up weights are the checkpoint's, of ``version``."""
        self._rollouts(lambda r: r.adopt_version.remote(version), "weights version")

    def update_weights(self, changed: bool = True) -> None:
        """Checkpoint-engine update of every inference engine from the trainers: new weights (``changed``), or,
        where the replicas discarded theirs to sleep (level 2), the same ones again; then, at level 2, the engines
        take their KV caches back (the second step of ``wake_rollouts``)."""
        level = self.settings.rollout.sleep_level
        try:
            if changed:
                version = self.weights_version() + 1
                self._trainers([t.update_weights.remote(version) for t in self.trainers], "weight update")
            elif level == 2:
                self._refill()
        finally:
            if level == 2:  # engines that are awake already take nothing
                self._rollouts(lambda r: r.wake_up.remote(), "wake-up")

    def restart_rollout(self, i: int, source: int) -> float:
        """Replace inference engine ``i`` by a fresh one that copies engine ``source``'s weights point to
        point (the other engines keep serving); returns the seconds the copy took."""
        if i == source or not (0 <= i < len(self.rollouts) and 0 <= source < len(self.rollouts)):
            raise ValueError(f"restart_rollout: need two different engines of {len(self.rollouts)}, got {i}, {source}")
        ray.kill(self.rollouts[i])
        self.rollouts[i] = self._placed(RolloutWorker, i).remote(*self._rollout_args[i])
        ray.get(self._attach(i))
        ray.get(self.trainers[self.lead(i)].connect.remote([self.rollouts[i]]))
        return self._catch_up(i, source)

    def _catch_up(self, i: int, source: int) -> float:
        """Engine ``i`` copies engine ``source``'s weights point to point; returns the seconds it took."""
        t0 = time.perf_counter()
        a, b = self.lead(source), self.lead(i)  # the two engines' trainer ranks, point to point
        self._trainers([self.trainers[a].serve_catch_up.remote(b), self.trainers[b].catch_up.remote(a)],
                       "catch-up", [a, b])
        return time.perf_counter() - t0

    def save(self, directory: str, trainer_state: bool = True) -> None:
        """Weights in Hugging Face format, and (``trainer_state``) every rank's shards of the trainer state."""
        self._trainers([t.save.remote(directory, trainer_state) for t in self.trainers], "save")

    def load_state(self, directory: str) -> None:
        """Master weights and optimizer state of a checkpoint (saved by any number of workers)."""
        self._trainers([t.load_state.remote(directory) for t in self.trainers], "load")

    def scale_lr(self, factor: float) -> float:
        """Multiply the trainers' learning rates by ``factor``; returns the new rate (of the first parameter group)."""
        return ray.get([t.scale_lr.remote(factor) for t in self.trainers])[0]

    def close(self) -> None:
        try:  # a broken cluster's workers may never answer (a stopped process): they are killed
            ray.get([t.close.remote() for t in self.trainers], timeout=2 if self.broken else 30)
        except Exception:
            pass
        for a in self.trainers + self.rollouts:
            ray.kill(a)
        remove_placement_group(self.pg)
        if self._own_ray:
            ray.shutdown()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
