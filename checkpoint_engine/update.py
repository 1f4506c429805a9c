"""Reloaders: how a checkpoint engine asks its local inference engine(s) to load a bucket.

Ray is imported only where Ray actors are used: the checkpoint engine itself runs without it."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A free TCP port on loopback, for a torch.distributed rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayReloader:
    """Inference engines are Ray actors with ``load_bucket(bucket, buffer, version)``."""

    def __init__(self, actors: list) -> None:
        self.actors = actors
        self.pending: dict[int, list] = {}

    def start(self, bucket: int, buffer: int, version: int) -> None:
        self.pending[bucket] = [a.load_bucket.remote(bucket, buffer, version) for a in self.actors]

    def wait(self, bucket: int) -> None:
        import ray

        ray.get(self.pending.pop(bucket, []))

    def abort(self, version: int) -> None:
        import ray

        self.pending.clear()
        ray.get([a.abort_update.remote(version) for a in self.actors])


class RayPacker:
    """A live inference engine, a Ray actor with ``pack_bucket(bucket, buffer)``: the source of a catch-up."""

    def __init__(self, actor) -> None:
        self.actor = actor

    def pack(self, bucket: int, buffer: int) -> int:
        import ray

        return ray.get(self.actor.pack_bucket.remote(bucket, buffer))
