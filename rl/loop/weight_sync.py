"""The controller's side of a weight update: the checkpoint engine asks Ray actors to load or pack a bucket.

``checkpoint_engine`` knows inference engines only through its ``Reloader`` and ``Packer`` interfaces;
here those are the rollout workers of the run's Ray cluster.
"""

from __future__ import annotations

import ray


class RayReloader:
    """Inference engines are Ray actors with ``load_bucket(bucket, buffer, version)``."""

    def __init__(self, actors: list) -> None:
        self.actors = actors
        self.pending: dict[int, list] = {}

    def start(self, bucket: int, buffer: int, version: int) -> None:
        self.pending[bucket] = [a.load_bucket.remote(bucket, buffer, version) for a in self.actors]

    def wait(self, bucket: int) -> None:
        ray.get(self.pending.pop(bucket, []))

    def abort(self, version: int) -> None:
        self.pending.clear()
        ray.get([a.abort_update.remote(version) for a in self.actors])


class RayPacker:
    """A live inference engine, a Ray actor with ``pack_bucket(bucket, buffer)``: the source of a catch-up."""

    def __init__(self, actor) -> None:
        self.actor = actor

    def pack(self, bucket: int, buffer: int) -> int:
        return ray.get(self.actor.pack_bucket.remote(bucket, buffer))
