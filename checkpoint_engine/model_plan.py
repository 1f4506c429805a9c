"""The bucket plan of a model's weight update, from the trainer's shards to replicas of another layout.

The plan names tensors as a Hugging Face checkpoint does (``engines.layout``), which both sides can
resolve: the trainer holds stacked experts as FSDP2 row shards, an inference replica may fuse q/k/v
and gate/up and keep bf16 weights. Each plan tensor is sent in the replica's dtype (the trainer
casts while staging); the trainer rank that holds a run of its elements stages those bytes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from checkpoint_engine.buckets import BucketPlan, TensorSpec, plan_buckets
from engines.layout import model_tensors, placements

#: per model tensor name: this rank's part as a flat tensor and the index of its first element
LocalParts = dict[str, tuple[torch.Tensor, int]]


def local_parts(shards: dict[str, tuple[torch.Tensor, int]]) -> LocalParts:
    """``engines.distributed.local_shards`` (or a trainer's host shards) as flat parts and first elements."""
    return {n: (t.reshape(-1), off // t.element_size()) for n, (t, off) in shards.items()}


def plan_model_update(model: nn.Module, parts: LocalParts, bucket_bytes: int, replica: nn.Module) -> BucketPlan:
    """The plan every rank computes alike, each tensor in the dtype ``replica`` (an inference model,
    e.g. built on the meta device) holds it in. Collective when torch.distributed is initialised
    (ranks share which elements of every model tensor they hold)."""
    mine = {n: (first, first + t.numel()) for n, (t, first) in parts.items()}
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    everyone: list = [mine]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
    theirs, their_tensors = placements(replica), model_tensors(replica)
    specs, owners = [], {}
    for name, p in placements(model).items():
        if name not in theirs:
            raise ValueError(f"the inference model has no tensor {name}")
        dtype = their_tensors[theirs[name].target].dtype
        el = dtype.itemsize
        specs.append(TensorSpec(name, p.shape, str(dtype).removeprefix("torch."), p.numel * el))
        ranges, covered = [], p.offset
        # FSDP shards are disjoint runs in rank order; a tensor FSDP leaves whole (a buffer such as the
        # router's score-correction bias) is held by every rank, and the lowest rank sends it
        for lo, hi, rank in sorted((*held[p.target], rank) for rank, held in enumerate(everyone)):
            a, b = max(lo, covered), min(hi, p.offset + p.numel)
            if a < b:
                ranges.append((rank, (a - p.offset) * el, (b - p.offset) * el))
                covered = b
        owners[name] = ranges
    return plan_buckets(specs, bucket_bytes, owners)


def plan_sources(model: nn.Module, parts: LocalParts) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """(plan tensor -> this rank's elements of it, plan tensor -> index of the first of them), for
    ``CheckpointEngine.update``; plan tensors this rank holds nothing of are left out."""
    tensors, offsets = {}, {}
    for name, p in placements(model).items():
        flat, first = parts[p.target]
        a, b = max(first, p.offset), min(first + flat.numel(), p.offset + p.numel)
        if a < b:
            tensors[name] = flat[a - first:b - first]
            offsets[name] = a - p.offset
    return tensors, offsets


def receiver_placements(model: nn.Module) -> dict[str, tuple[str, int]]:
    """Where an inference model keeps each plan tensor: (its own tensor, byte offset)."""
    sizes = {n: t.element_size() for n, t in model_tensors(model).items()}
    return {name: (p.target, p.offset * sizes[p.target]) for name, p in placements(model).items()}
