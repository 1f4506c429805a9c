"""Checks that stop a run with one clear line instead of letting it carry on wrong, and the wall-clock budget.

Before the run: the machine can hold the workers, the run directory can be written. During the run: an iteration
whose episodes mostly failed stops the run with the first error; ``run.max_minutes`` ends it after the iteration that
reaches it. (A non-finite reward is stopped in the reward phase, ``rl.rollout.rewards.check_reward``; non-finite
losses and gradients in the trainer's optimizer step, ``engines.training.engine.NonFiniteError``.)
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

from rl.config import Config
from rl.errors import TrainingStopped, UserError
from rl.settings import check_context, task_types


def check_error_rate(stats: dict, max_rate: float) -> None:
    """Stop when more than ``max_rate`` of an iteration's episodes failed in their environment."""
    errors = stats.get("env_errors", 0)
    total = errors + stats.get("trained_samples", 0)
    if errors and total and errors / total > max_rate:
        raise TrainingStopped(f"{errors} of {total} episodes failed in their environment this iteration (more than "
                              f"run.max_env_error_rate={max_rate:g}); the first: {stats.get('first_env_error')}")


def check_cluster_fits(cfg: Config) -> None:
    """A local cluster needs one CPU core per worker (its trainer and inference actors share it), and the GPUs
    asked for; refuse up front instead of waiting for Ray's placement to time out."""
    if cfg.cluster.ray_address is not None:
        return
    cores = os.cpu_count() or 1
    slots = max(2, cores)  # what the local Ray cluster is started with
    if cfg.cluster.workers > slots:
        raise UserError(f"cluster.workers={cfg.cluster.workers} needs {cfg.cluster.workers} CPU cores on this "
                        f"machine, which has {cores}; lower cluster.workers or join a cluster (cluster.ray_address)")
    gpus = cfg.cluster.workers * cfg.cluster.gpus_per_worker
    if gpus:
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus > have:
            raise UserError(f"cluster.workers x cluster.gpus_per_worker = {gpus:g} GPUs; this machine has {have}")


def check_max_tokens(cfg: Config) -> None:
    """Refuse a response budget that leaves no room for a prompt in the model's context, before any warm start (the
    prompts themselves are checked once the tokenizer exists: ``rl.rollout.data.rollout_seq_len``)."""
    if cfg.model.path is not None:
        from rl.settings import model_arch
        from rl.setup.warmstart import model_dir_here

        if (here := model_dir_here(cfg)) is None:
            return  # a hub repository or bucket not fetched yet: rl.rollout.data.rollout_seq_len checks it once it is
        try:
            context = model_arch(cfg, here)[0].max_position_embeddings  # either backend's reading
        except UserError:
            return  # named by prepare_model
    else:
        context = cfg.warmstart.architecture.max_position_embeddings
    check_context(task_types(cfg).max_tokens, context, f"the model's context of {context} tokens")


def check_writable(run_dir: Path) -> None:
    """The run directory exists (made if needed) and takes a file; else a UserError naming the problem."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{uuid.uuid4().hex[:8]}"
        probe.write_bytes(b"x" * 4096)
        probe.unlink()
    except OSError as e:
        raise UserError(f"cannot write the run directory {run_dir}: {e.strerror or e}") from None


class Budget:
    """``run.max_minutes`` of wall-clock time for the RL loop, counting the time of earlier attempts."""

    def __init__(self, max_minutes: float | None, spent_s: float = 0.0):
        self.limit_s = None if max_minutes is None else max_minutes * 60.0
        self.start, self.spent_s = time.time(), spent_s

    def elapsed(self) -> float:
        """Seconds of RL loop so far, this attempt and earlier ones."""
        return self.spent_s + time.time() - self.start

    def reached(self) -> bool:
        return self.limit_s is not None and self.elapsed() >= self.limit_s
