"""The Ray side of the controller: start (or join) the cluster, place colocated workers, and run
each phase across them."""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engines.inference import Completion
from rl.algorithm import Sample
from rl.config import Config
from rl.workers import RolloutWorker, TrainerWorker

# Both actors of a worker share one bundle: they alternate, never compute at the same time.
ACTOR_CPUS = 0.5


class Cluster:
    """Colocated workers (one trainer and one inference actor per placement-group bundle)."""

    def __init__(self, cfg: Config, model_dir: str) -> None:
        self.cfg = cfg
        self._own_ray = not ray.is_initialized()
        if self._own_ray:
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            ray.init(
                address=cfg.cluster.ray_address,
                num_cpus=None if cfg.cluster.ray_address else max(2, os.cpu_count() or 2),
                include_dashboard=False,
                logging_level=logging.ERROR,
                log_to_driver=False,
                object_store_memory=None if cfg.cluster.ray_address else 256 * 2**20,
            )
        n = cfg.cluster.workers
        self.pg = placement_group([{"CPU": 2 * ACTOR_CPUS}] * n, strategy="PACK")
        ray.get(self.pg.ready(), timeout=120)
        prefix = f"rl-{uuid.uuid4().hex[:8]}"

        def placed(cls, i):
            strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i)
            return ray.remote(num_cpus=ACTOR_CPUS, scheduling_strategy=strategy)(cls)

        self.trainers = [placed(TrainerWorker, i).remote(model_dir, cfg, f"{prefix}-w{i}") for i in range(n)]
        self.rollouts = [placed(RolloutWorker, i).remote(model_dir, cfg) for i in range(n)]
        plan, handles = ray.get(self.trainers[0].weight_plan.remote())
        ray.get([r.attach.remote(plan, handles) for r in self.rollouts])
        ray.get([t.connect.remote([r]) for t, r in zip(self.trainers, self.rollouts, strict=True)])
        self.num_buckets = len(plan.buckets)
        self.weights_version = 0

    def generate(self, prompts: list[list[int]], temperature: float, max_tokens: int, seed: int,
                 on_chunk: Callable[[int], None] | None = None) -> list[Completion]:
        """Spread prompts over the inference engines in chunks; results keep the prompts' order."""
        size = self.cfg.rollout.max_batch
        chunks = [prompts[i : i + size] for i in range(0, len(prompts), size)]
        refs = [self.rollouts[i % len(self.rollouts)].generate.remote(c, temperature, max_tokens, seed * 7919 + i)
                for i, c in enumerate(chunks)]
        index = {ref: i for i, ref in enumerate(refs)}
        results: list[list[Completion] | None] = [None] * len(refs)
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            results[index[done[0]]] = ray.get(done[0])
            if on_chunk:
                on_chunk(len(chunks[index[done[0]]]))
        return [c for r in results for c in r]  # type: ignore[union-attr]

    def train(self, samples: list[Sample], temperature: float, seed: int,
              on_step: Callable[[dict], None] | None = None) -> list[dict[str, float]]:
        """One K1.5 update; returns the metrics of each optimizer step."""
        steps = []
        for ref in self.trainers[0].train.remote(samples, temperature, seed):
            steps.append(ray.get(ref))
            if on_step:
                on_step(steps[-1])
        return steps

    def sleep_rollouts(self) -> None:
        """Free inference memory (per ``rollout.sleep_level``) before the trainer runs."""
        ray.get([r.sleep.remote(self.cfg.rollout.sleep_level) for r in self.rollouts])

    def wake_rollouts(self) -> None:
        ray.get([r.wake_up.remote() for r in self.rollouts])

    def update_weights(self) -> None:
        """Checkpoint-engine update of every inference engine from the trainers."""
        self.weights_version += 1
        ray.get([t.update_weights.remote(self.weights_version) for t in self.trainers])

    def save(self, directory: str) -> None:
        ray.get(self.trainers[0].save.remote(directory))

    def load_optimizer(self, directory: str) -> None:
        ray.get(self.trainers[0].load_optimizer.remote(directory))

    def close(self) -> None:
        try:
            ray.get([t.close.remote() for t in self.trainers], timeout=30)
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
