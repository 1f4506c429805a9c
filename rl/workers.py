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

from checkpoint_engine.transfer import WeightReceiver, WeightSender
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
        self.sender = WeightSender(lambda: dict(self.engine.model.state_dict()),
                                   cfg.checkpoint_engine.bucket_bytes, shm_prefix)
        self.cfg = cfg

    def weight_plan(self):
        """The bucket plan and the IPC buffer names the receivers attach to."""
        return self.sender.plan, self.sender.buffer_names

    def fill(self, bucket: int, buffer: int) -> None:
        self.sender.fill(bucket, buffer)

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
        self.sender.close()


class RolloutWorker:
    """Holds the inference engine and the receiving end of the checkpoint engine."""

    def __init__(self, model_dir: str, cfg: Config) -> None:
        _set_threads(cfg.cluster.threads_per_worker)
        model = load_pretrained(model_dir, getattr(torch, cfg.model.dtype))
        c = model.config
        self.engine = InferenceEngine(model, c.eos_token_id, c.pad_token_id, cfg.rollout.max_batch)
        self.receiver: WeightReceiver | None = None

    def attach(self, plan, buffer_names: list[str]) -> None:
        """Map the sender's IPC buffers; checks that the plan matches this engine's tensors."""
        self.receiver = WeightReceiver(self.engine.named_tensors(), plan, buffer_names)

    def load_bucket(self, bucket: int, buffer: int) -> None:
        assert self.receiver is not None, "attach() before load_bucket()"
        self.receiver.load(bucket, buffer)

    def generate(self, prompts: list[list[int]], temperature: float, max_tokens: int, seed: int) -> list[Completion]:
        return self.engine.generate(prompts, SamplingParams(temperature, max_tokens), seed)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.engine.named_tensors().items()}
