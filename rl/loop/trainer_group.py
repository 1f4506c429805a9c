"""The loop's handle on the trainer ranks: one object for everything asked of the trainers as a group.

Every call waits at most ``run.step_timeout_s`` (``rl.loop.recovery``); a trainer that fails marks the group broken
and raises ``WorkerFailed``: a trainer rank is not replaced in place (its shard lives only there), the run restarts
its workers from the last checkpoint (``rl.loop.controller.train``). The group is a sequence of its Ray actors,
rank order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import ray

from rl.algo.batches import RankBatch
from rl.loop.recovery import WorkerFailed, gather, next_item


class TrainerGroup:
    """The trainer ranks of a run (``actors``, rank order) and what the loop asks of them."""

    def __init__(self, actors: list, timeout_s: float) -> None:
        self.actors, self.timeout = actors, timeout_s
        self.broken = False  # a rank failed: closing does not wait on the ranks
        self.ahead = False   # trained since the last update went out to every replica

    def __len__(self) -> int:
        return len(self.actors)

    def __getitem__(self, rank: int):
        return self.actors[rank]

    def __iter__(self) -> Iterator:
        return iter(self.actors)

    # --- one policy update --------------------------------------------------------------------------

    def train(self, batches: list[RankBatch], on_step: Callable[[dict], None] | None = None) -> list[dict[str, float]]:
        """One policy update (K1.5, GRPO or DAPO; + PTX): each rank gets its own share (one object each,
        ``rl.algo.batches``); returns the metrics of each optimizer step (reduced over the ranks)."""
        from engines.training.engine import NonFiniteError
        from rl.errors import TrainingStopped

        self.ahead = True
        gens = [t.train.remote(ray.put(b)) for t, b in zip(self.actors, batches, strict=True)]
        steps = []
        try:
            while True:
                try:
                    steps.append(self._step(gens, 0))
                except StopIteration:
                    break
                if on_step:
                    on_step(steps[-1])
            for i in range(1, len(gens)):
                while True:
                    try:
                        self._step(gens, i)
                    except StopIteration:
                        break
        except ray.exceptions.RayTaskError as e:
            if isinstance(e.cause, NonFiniteError):
                raise TrainingStopped(str(e.cause)) from None
            raise
        return steps

    def _step(self, gens: list, i: int) -> dict:
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

    def call(self, refs: list, phase: str, ranks: list[int] | None = None) -> list:
        """The ranks' calls ``refs`` (of ``ranks``, default all), within the step timeout; a failed rank marks the
        group broken."""
        try:
            return gather(refs, "trainer", phase, self.timeout, ranks)
        except WorkerFailed as f:
            raise self._broken(f) from None

    # --- memory ---------------------------------------------------------------------------------------

    def offload(self) -> dict:
        """Trainer state to host memory (rank 0's figures)."""
        return self.call([t.offload.remote() for t in self.actors], "offload")[0]

    def onload(self) -> dict:
        return self.call([t.onload.remote() for t in self.actors], "onload")[0]

    def peak_gib(self) -> float:
        """The largest rank's peak memory over its last training phase (GiB)."""
        return round(max(self.call([t.peak_memory.remote() for t in self.actors], "train")) / 2**30, 3)

    # --- weights out ----------------------------------------------------------------------------------

    def push_weights(self, version: int, replicas: list[int] | None = None) -> None:
        """Every rank sends its part of update ``version`` to the replicas (collective: the checkpoint engine);
        disaggregated, to ``replicas`` only where given (a replaced one's fill)."""
        self.call([t.update_weights.remote(version, replicas) for t in self.actors], "weight update")
        if replicas is None:
            self.ahead = False

    def catch_up(self, source: int, target: int) -> float:
        """Rank ``target``'s replica copies rank ``source``'s, point to point (the two leads alone); returns the
        seconds it took."""
        import time

        t0 = time.perf_counter()
        self.call([self.actors[source].serve_catch_up.remote(target), self.actors[target].catch_up.remote(source)],
                  "catch-up", [source, target])
        return time.perf_counter() - t0

    # --- checkpoints ----------------------------------------------------------------------------------

    def save(self, directory: str, trainer_state: bool = True) -> None:
        """Weights in Hugging Face format, and (``trainer_state``) every rank's shards of the trainer state."""
        self.call([t.save.remote(directory, trainer_state) for t in self.actors], "save")

    def load_state(self, directory: str) -> None:
        """Master weights and optimizer state of a checkpoint (saved by any number of workers)."""
        self.call([t.load_state.remote(directory) for t in self.actors], "load")

    def scale_lr(self, factor: float) -> float:
        """Multiply the ranks' learning rates by ``factor``; returns the new rate (of the first parameter group)."""
        return ray.get([t.scale_lr.remote(factor) for t in self.actors])[0]

    def close(self) -> None:
        """Let each rank release its checkpoint engine (a broken group's ranks may never answer: brief wait)."""
        try:
            ray.get([t.close.remote() for t in self.actors], timeout=2 if self.broken else 30)
        except Exception:
            pass
