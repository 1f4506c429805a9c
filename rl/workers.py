"""The two engines of one colocated worker, each in its own process (a Ray actor).

Both actors of a worker sit in the same placement-group bundle, so they share its devices; the
weights cross from the trainer process to the inference process only through the checkpoint
engine's shared IPC buffers.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import torch

from checkpoint_engine.buckets import plan_buckets, spec_of
from checkpoint_engine.engine import CheckpointEngine
from checkpoint_engine.transfer import WeightReceiver
from checkpoint_engine.update import RayReloader, free_port
from engines.hf_io import load_pretrained, save_pretrained
from engines.inference import Completion, InferenceEngine, SamplingParams
from engines.training import TrainingEngine
from rl.algorithm import Sample, rl_update
from rl.config import Config
from rl.optim import build_optimizers

OPTIMIZER_FILE = "optimizer.pt"


def _set_threads(threads: int | None) -> None:
    torch.set_num_threads(threads or os.cpu_count() or 1)


class TrainerWorker:
    """Holds the training engine and the sending end of the checkpoint engine."""

    def __init__(self, model_dir: str, cfg: Config, shm_prefix: str) -> None:
        _set_threads(cfg.cluster.threads_per_worker)
        model = load_pretrained(model_dir, getattr(torch, cfg.model.dtype))
        o = cfg.optimizer
        opts = build_optimizers(model, o.kind, o.lr, o.weight_decay, o.momentum)
        self.engine = TrainingEngine(model, opts, model.config.pad_token_id, o.max_grad_norm)
        bucket = cfg.checkpoint_engine.bucket_bytes
        self.plan = plan_buckets([spec_of(n, t) for n, t in model.state_dict().items()], bucket)
        self.ckpt = CheckpointEngine(0, 1, f"tcp://127.0.0.1:{free_port()}", bucket, shm_prefix)
        self.reloader: RayReloader | None = None
        self.cfg = cfg

    def weight_plan(self):
        """The bucket plan and the IPC buffer handles the inference engines map."""
        return self.plan, self.ckpt.ipc_handles()

    def connect(self, rollouts: list) -> None:
        """The local inference engines that this worker's checkpoint engine updates."""
        self.reloader = RayReloader(rollouts)

    def update_weights(self, version: int) -> None:
        """Push the current weights to the connected inference engines (checkpoint engine)."""
        self.ckpt.update(self.plan, dict(self.engine.model.state_dict()), version, self.reloader)

    def train(self, samples: list[Sample], temperature: float, seed: int) -> Iterator[dict[str, float]]:
        """Run the K1.5 update on a rollout batch; yields metrics after each optimizer step."""
        a = self.cfg.algorithm
        yield from rl_update(self.engine, samples, tau=a.tau, temperature=temperature,
                             minibatches=a.minibatches, micro_batch=a.micro_batch, seed=seed)

    def save(self, directory: str) -> None:
        """Weights in Hugging Face format plus the optimizer state."""
        save_pretrained(self.engine.model, None, directory)
        torch.save(self.engine.state_dict(), Path(directory) / OPTIMIZER_FILE)

    def load_optimizer(self, directory: str) -> None:
        self.engine.load_state_dict(torch.load(Path(directory) / OPTIMIZER_FILE, weights_only=False))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.engine.model.state_dict().items()}

    def close(self) -> None:
        self.ckpt.close()


class RolloutWorker:
    """Holds the inference engine and the receiving end of the checkpoint engine."""

    def __init__(self, model_dir: str, cfg: Config) -> None:
        _set_threads(cfg.cluster.threads_per_worker)
        model = load_pretrained(model_dir, getattr(torch, cfg.model.dtype))
        c, r = model.config, cfg.rollout
        self.engine = InferenceEngine(model, c.eos_token_id, c.pad_token_id, max_num_seqs=r.max_batch,
                                      kv_cache_bytes=r.kv_cache_mb << 20)
        self.receiver: WeightReceiver | None = None
        self._ipc: tuple | None = None

    def attach(self, plan, handles: list) -> None:
        """Map the checkpoint engine's IPC buffers; checks the plan against this engine's tensors."""
        self._ipc = (plan, handles)
        self.receiver = WeightReceiver(plan, handles, self.engine.named_tensors(), on_commit=self._rebind)

    def sleep(self, level: int) -> None:
        """Free the KV cache (1) and the weights (2) while the trainer uses the device."""
        if level:
            self.engine.sleep(level)
            if level == 2:
                self.receiver = None  # its spare copy goes too; a new one is made at wake-up

    def wake_up(self) -> None:
        """Reallocate; after a level-2 sleep the next weight update refills the weights."""
        if self.engine.sleeping:
            self.engine.wake_up()
            if self.receiver is None and self._ipc is not None:
                self.attach(*self._ipc)

    def load_bucket(self, bucket: int, buffer: int, version: int) -> None:
        assert self.receiver is not None, "attach() before load_bucket()"
        self.receiver.load(bucket, buffer, version)

    def abort_update(self, version: int) -> bool:
        """The update failed on the trainer side: go back to the previous weights."""
        return self.receiver is None or self.receiver.rollback()

    def _rebind(self, tensors: dict[str, torch.Tensor]) -> None:
        """Serve with the tensors of the update just committed (the receiver loaded them aside)."""
        model = self.engine.model
        for name, t in tensors.items():
            owner, _, attr = name.rpartition(".")
            getattr(model.get_submodule(owner), attr).data = t
        self.engine.weights_loaded()

    def generate(self, prompts: list[list[int]], temperature: float, max_tokens: int, seed: int) -> list[Completion]:
        if self.receiver is not None and not self.receiver.consistent:
            raise RuntimeError("weights are partly updated (an update failed midway and could not be rolled "
                               "back); refusing to generate until a complete update arrives")
        return self.engine.generate(prompts, SamplingParams(temperature, max_tokens), seed=seed)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.engine.named_tensors().items()}
