"""Faults of the run's workers: find them within a time limit and bound what is done about them.

Every call the controller makes on the workers is awaited through ``gather`` with ``run.step_timeout_s``: a worker
whose process died (SIGKILL, the OOM killer, a lost node) surfaces as Ray's ``RayActorError`` on its call, one that
stopped answering (SIGSTOP, a hung collective) as the time limit passing; either becomes a ``WorkerFailed`` naming
the worker and the phase. An inference engine is replaced in place (``Cluster``); a trainer rank cannot be (its
shards of the model and optimizer are gone), so the controller tears the workers down and starts them again from
the last complete checkpoint. ``Restarts`` counts both against ``run.max_restarts`` and writes one line for each.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import ray

from rl.loop.guards import TrainingStopped


class WorkerFailed(Exception):
    """A worker died or did not answer within the step timeout."""

    def __init__(self, role: str, index: int, phase: str, how: str, detect_s: float) -> None:
        self.role, self.index, self.phase, self.how, self.detect_s = role, index, phase, how, detect_s
        super().__init__(f"{role} {index} {how} during {phase}")

    @property
    def stalled(self) -> bool:
        return self.how.startswith("stalled")


def _died(err: BaseException) -> str | None:
    """How ``err`` says a worker went away: its own process ("died"), or one it called (an inference engine a
    trainer updates); None for any other error."""
    if isinstance(err, ray.exceptions.RayActorError):
        return "died"
    if isinstance(err, ray.exceptions.RayTaskError) and isinstance(err.cause, ray.exceptions.RayActorError):
        return "failed: a worker it called died"
    return None


def gather(refs: Sequence[Any], role: str, phase: str, timeout_s: float,
           indices: Sequence[int] | None = None) -> list[Any]:
    """``ray.get`` of one call per worker of ``role`` (``indices[k]`` made ``refs[k]``), waiting at most
    ``timeout_s`` for all of them; a worker that died or did not answer is a ``WorkerFailed``. Another error on
    a worker is raised as it is, unless a peer's death caused it (a collective broken by a rank that went away):
    that is the peer's ``WorkerFailed``."""
    indices = list(range(len(refs))) if indices is None else list(indices)
    start, results = time.monotonic(), [None] * len(refs)
    where = {ref: k for k, ref in enumerate(refs)}
    pending = list(refs)
    while pending:
        left = timeout_s - (time.monotonic() - start)
        done, pending = ray.wait(pending, num_returns=1, timeout=max(left, 0))
        if not done:
            k = where[pending[0]]
            raise WorkerFailed(role, indices[k], phase, f"stalled (no answer in run.step_timeout_s={timeout_s:g} s)",
                               time.monotonic() - start)
        k = where[done[0]]
        try:
            results[k] = ray.get(done[0])
        except Exception as e:
            if how := _died(e):
                raise WorkerFailed(role, indices[k], phase, how, time.monotonic() - start) from None
            culprit = _dead_peer(pending, where, indices, e)
            if culprit is not None:
                raise WorkerFailed(role, culprit, phase, "died", time.monotonic() - start) from None
            raise
    return results


def _dead_peer(pending: list, where: dict, indices: list[int], err: Exception, wait_s: float = 5.0) -> int | None:
    """The worker among ``pending`` whose death broke this call, if one died within ``wait_s``."""
    if not isinstance(err, ray.exceptions.RayTaskError) or not pending:
        return None
    done, _ = ray.wait(pending, num_returns=len(pending), timeout=wait_s)
    for ref in done:
        try:
            ray.get(ref)
        except Exception as e:
            if _died(e) == "died":
                return indices[where[ref]]
    return None


def next_item(gen: Any, role: str, index: int, phase: str, timeout_s: float) -> Any:
    """The next value of a streaming actor call (``ObjectRefGenerator``) within ``timeout_s``; raises
    ``StopIteration`` at its end and ``WorkerFailed`` as ``gather`` does."""
    start = time.monotonic()
    ready, _ = ray.wait([gen], timeout=timeout_s)
    if not ready:
        raise WorkerFailed(role, index, phase, f"stalled (no answer in run.step_timeout_s={timeout_s:g} s)",
                           time.monotonic() - start)
    ref = next(gen)
    return gather([ref], role, phase, max(timeout_s - (time.monotonic() - start), 1.0), [index])[0]


class Restarts:
    """The run's recoveries (engines replaced in place, workers restarted from a checkpoint), at most
    ``limit`` of them; each is one line through ``report``."""

    def __init__(self, limit: int, report: Callable[[str], Any] = print) -> None:
        self.limit, self.report, self.used = limit, report, 0

    def take(self, failure: WorkerFailed, action: str) -> None:
        """Count one recovery of ``failure`` by ``action``, or stop the run when ``run.max_restarts`` are spent."""
        what = f"{failure} (detected in {failure.detect_s:.1f} s)"
        if self.used >= self.limit:
            raise TrainingStopped(f"{what}, and {self.used} recoveries already (run.max_restarts={self.limit}); "
                                  "the last complete checkpoint is intact")
        self.used += 1
        self.report(f"recovery {self.used} of at most {self.limit}: {what}; {action}")
