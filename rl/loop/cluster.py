"""The workers' placement: start (or join) the Ray cluster, place the trainer ranks and rollout replicas, wire them
through the checkpoint engine and fill them from the checkpoint; the loop then talks to the two handles it builds,
``trainers`` (``rl.loop.trainer_group.TrainerGroup``) and ``rollouts`` (``rl.loop.rollout_manager.RolloutManager``).

Colocated (``cluster.placement``): each worker's trainer rank(s) and replica share one bundle and take turns.
Disaggregated: each trainer worker and each replica has a bundle of its own and they run at once; every trainer rank
sends its buckets straight to every replica (``checkpoint_engine.p2p``: shared memory on one node, gloo between
nodes), which loads them into a spare copy while it generates and swaps them in when the loop says.
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import replace

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engines.device import CPU_TRAINER_MALLOC
from rl.errors import UserError
from rl.loop.placement import (
    ROLLOUT_SLOT,
    probe_bundles,
    reachable_model_dirs,
    unplaceable,
    worker_bundle,
    worker_threads,
)
from rl.loop.recovery import Restarts
from rl.loop.rollout_manager import RolloutManager
from rl.loop.trainer_group import TrainerGroup
from rl.loop.workers import RolloutWorker, TrainerWorker
from rl.settings import RunSettings

# Both actors of a colocated worker share one bundle: they alternate, never compute at the same time.
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
        restarts = restarts or Restarts(c.max_restarts)
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
        # replica i: its bundle, and the trainer worker that updates it
        replicas_n = c.rollout_workers if c.disaggregated else n
        self.bundle_of = (lambda i: n + i) if c.disaggregated else (lambda i: i)
        self.owner = (lambda i: i % n) if c.disaggregated else (lambda i: i)
        # a tensor-parallel replica holds all of its bundle's GPUs (Ray hands out whole GPUs above one), and the
        # worker's trainer is as many ranks, one on each of them (FSDP2 over every GPU of the run); otherwise one
        # trainer and one replica, half the bundle's GPUs each: Ray then shows both actors the same device(s)
        spans = settings.rollout.engine.tensor_parallel_size > 1 and gpus > 0
        # one worker slot each where the pods offer them
        if c.disaggregated:
            bundles = [worker_bundle(dims.ranks_per_worker * ACTOR_CPUS, gpus)] * n + \
                [worker_bundle(ACTOR_CPUS, gpus, ROLLOUT_SLOT)] * replicas_n  # on the rollout pods, where there are
        else:
            bundles = [worker_bundle((1 + dims.ranks_per_worker) * ACTOR_CPUS, gpus)] * n
        self.pg = placement_group(bundles, strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=PLACEMENT_WAIT_S)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.pg)
            raise UserError(unplaceable(bundles[0], len(bundles), PLACEMENT_WAIT_S)) from None
        prefix = f"rl-{uuid.uuid4().hex[:8]}"
        # each worker's threads from its own pod's CPUs, and the model where its node can read it
        sites = probe_bundles(self.pg, len(bundles), model_dir)
        threads, dirs = worker_threads(sites, c.threads_per_worker), reachable_model_dirs(model_dir, sites)
        def placed(cls, i):
            strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i)
            share = (gpus if cls is RolloutWorker else 0) if spans else gpus / 2
            # a CPU trainer reuses freed host memory instead of faulting it in again (engines.device)
            env = {"env_vars": CPU_TRAINER_MALLOC} if cls is TrainerWorker and not gpus else None
            # a replica takes a point-to-point update on a thread of its own while it generates
            groups = {"concurrency_groups": {"update": 1}} if cls is RolloutWorker else {}
            return ray.remote(num_cpus=ACTOR_CPUS, num_gpus=share, scheduling_strategy=strategy,
                              runtime_env=env, **groups)(cls)

        self._placed = placed
        self._rollout_args = [(replace(settings.rollout.engine, model_dir=dirs[b]), threads[b], gpus)
                              for b in map(self.bundle_of, range(replicas_n))]
        replicas = [placed(RolloutWorker, self.bundle_of(i)).remote(*self._rollout_args[i]) for i in range(replicas_n)]
        devices = ray.get([r.visible_devices.remote() for r in replicas]) if spans else [None] * replicas_n
        # trainer rank r: on its worker's devices, the local_index(r)-th GPU of that worker's replica
        at = dims.worker_of
        self.trainers = TrainerGroup([placed(TrainerWorker, at(r)).remote(
            settings.trainer, settings.update, threads[at(r)], devices[at(r)].split(",")[dims.local_index(r)]
            if spans else None) for r in range(dims.world)], c.step_timeout_s)
        self.rollouts = RolloutManager(settings, replicas, self.trainers, restarts, self._respawn)
        address = ray.get(self.trainers[0].rendezvous.remote(c.ray_address is None))
        ray.get([t.setup.remote(dirs[at(r)], r, dims.world, address, f"{prefix}-w{r}")
                 for r, t in enumerate(self.trainers)])
        # one plan for all (every rank computed the same); each replica maps its worker's first rank's IPC buffers,
        # and that rank updates it (the worker's other ranks take part in every broadcast)
        plans = ray.get([t.weight_plan.remote() for t in self.trainers])
        self._plans = plans
        self.num_buckets = len(plans[0][0].buckets)
        if c.disaggregated:
            self._endpoints = ray.get([t.p2p_endpoint.remote(c.ray_address is None) for t in self.trainers])
            self._links: dict[int, int] = {}  # replica -> its links' incarnation
            ray.get([call for i in range(replicas_n) for call in self._link(i)])
            self._startup_p2p([dirs[at(r)] for r in range(dims.world)])
        else:
            if spans and settings.rollout.engine.ipc_views:  # each replica rank loads from its own GPU's trainer rank
                ray.get([t.share_replica.remote(dims.ranks_per_worker) for t in self.trainers])
            ray.get([self._attach(i) for i in range(replicas_n)])
            ray.get([t.connect.remote(self._replicas_of(at(r)) if dims.is_lead(r) else [])
                     for r, t in enumerate(self.trainers)])
            self._startup([dirs[at(r)] for r in range(dims.world)])
        if settings.trainer.reference:  # the reference policy: one more collective read, of the starting model
            refs = reachable_model_dirs(reference_dir or model_dir, sites)
            ray.get([t.load_reference.remote(refs[at(r)]) for r, t in enumerate(self.trainers)])

    def _replicas_of(self, worker: int) -> list:
        """The replicas trainer worker ``worker``'s lead rank updates."""
        return [r for i, r in enumerate(self.rollouts) if self.owner(i) == worker]

    def _link(self, i: int) -> list:
        """Replica ``i`` takes point-to-point updates: every trainer rank links to it (in rank order, as each rank
        links to the replicas in replica order, so no two wait on each other). Returns the calls to wait for."""
        node = ray.get(self.rollouts[i].p2p_attach.remote(self._plans[0][0], self.settings.adapters))
        self._links[i] = self._links.get(i, -1) + 1  # a replacement's links rendezvous under keys of their own
        key = f"{i}.{self._links[i]}"
        replica = self.rollouts[i]
        return [call for r, t in enumerate(self.trainers) for call in
                (t.p2p_connect.remote(i, node, key), replica.p2p_connect.remote(r, self._endpoints[r], i, key))]

    def _startup_p2p(self, dirs: list[str]) -> None:
        """Disaggregated start-up: the trainers read the checkpoint collectively into their shards, then send it to
        the replicas as update 0 (a LoRA run's replicas read the base from the checkpoint first)."""
        reads = ray.get([t.startup.remote(d) for t, d in zip(self.trainers, dirs, strict=True)])
        self.startup_reads = [r["reads"] for r in reads]
        ray.get([r.prepare_refill.remote() for r in self.rollouts])
        self.rollouts.push(0)

    def _respawn(self, i: int) -> None:
        """A new, empty replica in place of replica ``i``, attached to its trainer worker's IPC buffers and lead
        (disaggregated: linked to every trainer rank)."""
        ray.kill(self.rollouts[i])
        self.rollouts.actors[i] = self._placed(RolloutWorker, self.bundle_of(i)).remote(*self._rollout_args[i])
        if self.settings.cluster.disaggregated:
            ray.get(self._link(i))
            return
        ray.get(self._attach(i))
        w = self.owner(i)
        ray.get(self.trainers[self.dims.lead(w)].connect.remote(self._replicas_of(w)))

    def _attach(self, i: int):
        """Engine ``i`` maps its trainer worker's IPC buffers: the lead rank's, and every rank's of the worker for
        a replica whose ranks load from their own GPU's (vLLM's ipc_views)."""
        handles = [self._plans[r][1] for r in self.dims.ranks_of(self.owner(i))]
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

    def close(self) -> None:
        self.trainers.close()  # a broken group's ranks may never answer (a stopped process): they are killed
        for a in [*self.trainers, *self.rollouts]:
            ray.kill(a)
        remove_placement_group(self.pg)
        if self._own_ray:
            ray.shutdown()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
