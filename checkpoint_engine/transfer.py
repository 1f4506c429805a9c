"""The two ends of a weight update: the sender packs buckets into shared IPC buffers, the
receiver (inside the inference engine's process) copies them into its own parameters.

Two IPC buffers alternate, so the receiver reloads bucket k−1 from one while the sender fills
bucket k into the other (``push_weights``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from checkpoint_engine.buckets import BucketPlan, as_bytes, plan_buckets, spec_of
from checkpoint_engine.shm import SharedBuffer

NUM_IPC_BUFFERS = 2


class WeightSender:
    """Owns the IPC buffers and fills them from the trainer's current tensors."""

    def __init__(self, tensors: Callable[[], dict[str, torch.Tensor]], bucket_bytes: int, prefix: str) -> None:
        self.tensors = tensors
        self.plan = plan_buckets([spec_of(n, t) for n, t in tensors().items()], bucket_bytes)
        self.buffers = [SharedBuffer.create(f"{prefix}-ipc{i}", bucket_bytes) for i in range(NUM_IPC_BUFFERS)]

    @property
    def buffer_names(self) -> list[str]:
        return [b.name for b in self.buffers]

    def fill(self, bucket: int, buffer: int) -> None:
        """Copy bucket ``bucket`` of the current tensors into IPC buffer ``buffer``."""
        src = self.tensors()
        dst = self.buffers[buffer].tensor
        for p in self.plan.buckets[bucket]:
            dst[p.offset : p.offset + p.length].copy_(as_bytes(src[p.name])[p.start : p.start + p.length])

    def close(self) -> None:
        for b in self.buffers:
            b.close()


class PlanMismatchError(ValueError):
    """The sender's tensors do not match what the inference engine holds."""


class WeightReceiver:
    """Maps the sender's IPC buffers and loads buckets into the inference engine's tensors."""

    def __init__(self, targets: dict[str, torch.Tensor], plan: BucketPlan, buffer_names: list[str]) -> None:
        for name, spec in plan.tensors.items():
            if name not in targets:
                raise PlanMismatchError(f"inference engine has no tensor {name}")
            if spec_of(name, targets[name]) != spec:
                have = spec_of(name, targets[name])
                raise PlanMismatchError(f"{name}: sender has {spec}, inference engine has {have}")
        missing = sorted(set(targets) - set(plan.tensors))
        if missing:
            raise PlanMismatchError(f"update does not cover inference tensors {missing[:5]}")
        self.targets = {n: as_bytes(t) for n, t in targets.items()}
        self.plan = plan
        self.buffers = [SharedBuffer.attach(n, plan.bucket_bytes) for n in buffer_names]

    def load(self, bucket: int, buffer: int) -> None:
        """Copy bucket ``bucket`` from IPC buffer ``buffer`` into the target tensors."""
        src = self.buffers[buffer].tensor
        for p in self.plan.buckets[bucket]:
            self.targets[p.name][p.start : p.start + p.length].copy_(src[p.offset : p.offset + p.length])
