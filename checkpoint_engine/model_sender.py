"""The bucket plan of a model's weight update, from the trainer's shards to replicas of another layout.

The plan names tensors as a Hugging Face checkpoint does (``engines.model.layout``), which both sides can
resolve: the trainer holds stacked experts as FSDP2 row shards, an inference replica may fuse q/k/v
and gate/up and keep bf16 or block-FP8 weights. Each plan tensor is sent in the replica's dtype
(the trainer casts, or quantises to FP8, while staging); the trainer rank that holds a run of its
elements stages those bytes. ``ModelSender`` is what a trainer keeps: the plan, computed once, and
the sources of each update; ``startup`` fills the trainer (and replicas that hold the checkpoint's
dtypes) from one collective read of the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from checkpoint_engine.buckets import BucketPlan, TensorSpec, plan_buckets
from checkpoint_engine.quantize import scale_owners
from engines.model.layout import model_tensors, placements
from engines.model.native.fp8 import BLOCK, FP8, SCALE_SUFFIX, Fp8Experts, Fp8Linear

#: per model tensor name: this rank's part as a flat tensor and the index of its first element
LocalParts = dict[str, tuple[torch.Tensor, int]]


def local_parts(shards: dict[str, tuple[torch.Tensor, int]]) -> LocalParts:
    """``engines.model.sharded.local_shards`` (or a trainer's host shards) as flat parts and first elements."""
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
    specs, owners, fp8 = [], {}, {}
    load = [0] * len(everyone)  # bytes each rank sends so far: a run several ranks hold goes to the least loaded
    for name, p in placements(model).items():
        if name not in theirs:
            raise ValueError(f"the inference model has no tensor {name}")
        dtype = their_tensors[theirs[name].target].dtype
        el = dtype.itemsize
        specs.append(TensorSpec(name, p.shape, str(dtype).removeprefix("torch."), p.numel * el))
        ranges, covered = [], p.offset
        # FSDP shards are disjoint runs in rank order. Some runs are held by several ranks: a tensor FSDP leaves
        # whole (the router's score-correction bias) by every rank, an expert by each of its expert-parallel
        # replicas; the least loaded of them sends it (ties: the lowest rank), so no few ranks send all the experts
        holders: dict[tuple[int, int], list[int]] = {}
        for rank, held in enumerate(everyone):
            holders.setdefault(tuple(held[p.target]), []).append(rank)
        for (lo, hi), ranks in sorted(holders.items()):
            a, b = max(lo, covered), min(hi, p.offset + p.numel)
            if a < b:
                rank = min(ranks, key=lambda r: (load[r], r))
                load[rank] += (b - a) * el
                ranges.append((rank, (a - p.offset) * el, (b - p.offset) * el))
                covered = b
        owners[name] = ranges
        if dtype == FP8:  # its block scales: each block row sent by the rank holding the row's first row
            scale = theirs[name + SCALE_SUFFIX]
            rows, cols = p.shape
            if any(lo % cols or hi % cols for _, lo, hi in ranges):
                raise ValueError(f"{name}: FP8 needs whole rows on each trainer rank")
            specs.append(TensorSpec(name + SCALE_SUFFIX, scale.shape, "float32", scale.numel * 4))
            owners[name + SCALE_SUFFIX] = scale_owners([(r, lo // cols, hi // cols) for r, lo, hi in ranges], rows,
                                                       cols, fp8_block(replica))
            fp8[name] = name + SCALE_SUFFIX
    return plan_buckets(specs, bucket_bytes, owners, fp8, fp8_block(replica) if fp8 else BLOCK)


def plan_adapter_update(adapters: dict[str, torch.Tensor], bucket_bytes: int,
                        dtype: torch.dtype | None = None) -> BucketPlan:
    """The plan of a LoRA run's updates: the adapters only, by the trainer's names, all sent by rank 0
    (``adapters``: full tensors; a replica merges them into the base it keeps), in ``dtype`` (the replicas', as a
    full update casts the master weights; default their own)."""
    specs = [TensorSpec(n, tuple(t.shape), str(dtype or t.dtype).removeprefix("torch."),
                        t.numel() * (dtype or t.dtype).itemsize) for n, t in adapters.items()]
    return plan_buckets(specs, bucket_bytes)


def fp8_block(replica: nn.Module) -> int:
    """The FP8 block size of a replica (``engines.model.native.fp8.to_fp8``); the default when it has none."""
    return next((m.block for m in replica.modules() if isinstance(m, (Fp8Linear, Fp8Experts))), BLOCK)


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


class ModelSender:
    """A trainer rank's side of its model's weight updates: the plan to ``replica``'s layout (computed
    once, collectively) and, per update, this rank's sources."""

    def __init__(self, model: nn.Module, replica: nn.Module, bucket_bytes: int) -> None:
        from engines.model import sharded

        self.model, self.replica, self.bucket_bytes = model, replica, bucket_bytes
        self.plan = plan_model_update(model, local_parts(sharded.local_shards(model)), bucket_bytes, replica)

    carries_base = True  # every weight: a replica needs nothing else (``adapter_sender.AdapterSender`` does)

    def check_filled(self, replicas: bool) -> None:
        """Whole-weight updates fill replicas the start-up read left empty: nothing to check."""

    def send(self, ckpt, engine, version: int, reloader) -> None:
        """Push this rank's shard of the weights of ``engine`` (a ``TrainingEngine``) to every replica through the
        checkpoint engine ``ckpt``; while offloaded the shards are read from host memory (stage 1 is the H2D copy)."""
        tensors, offsets = self.sources(engine.weight_shards())
        ckpt.update(self.plan, tensors, version, reloader, offsets=offsets)

    def sources(self, shards: dict[str, tuple[torch.Tensor, int]]) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """(tensors, offsets) of ``CheckpointEngine.update`` from this rank's shards (live or offloaded)."""
        return plan_sources(self.model, local_parts(shards))

    def startup_plan(self, model_dir: str | Path, world: int) -> tuple[BucketPlan, bool]:
        """The start-up plan of the checkpoint in ``model_dir`` (its own tensors, dtypes and files), and
        whether the replicas can load it as it is (same tensors and dtypes); if not, they wait for the
        first update from the trainers, whose weights the start-up fills in any case."""
        from checkpoint_engine.startup import plan_startup

        block = checkpoint_fp8_block(model_dir)
        plan, _, _ = plan_startup(model_dir, world, self.bucket_bytes, set(placements(self.model)), block)
        return plan, _same_layout(plan, self.plan)

    def startup(self, engine, model_dir: str | Path, reloader, version: int = 0) -> dict:
        """Fill this rank's trainer shard, and the replicas when they hold the checkpoint's dtypes, from
        one collective read of ``model_dir`` (each file read by one rank). Collective; returns whether the
        replicas were filled ("replicas") and the tensors this rank read, per file ("reads")."""
        from checkpoint_engine.startup import SafetensorsShare, ShardTap, plan_startup
        from engines.model import sharded

        world, rank = sharded.world_size(), sharded.rank()
        block = checkpoint_fp8_block(model_dir)
        plan, owner, index = plan_startup(model_dir, world, self.bucket_bytes, set(placements(self.model)), block)
        replicas = _same_layout(plan, self.plan)
        tap = ShardTap(*plan_sources(self.model, local_parts(sharded.local_shards(self.model)))).bind(plan)
        share = SafetensorsShare(index, [f for f, w in owner.items() if w == rank])
        with torch.no_grad():
            engine.update(plan, share, version, reloader if replicas else None, tap=tap)
            tap.finish()
        return {"replicas": replicas, "reads": dict(share.reads)}


def checkpoint_fp8_block(model_dir: str | Path) -> int:
    """The FP8 block size of the checkpoint in ``model_dir`` (its config.json's ``quantization_config``; the default
    when it has none), read from the file itself: any model type, native or transformers-only."""
    from engines.model.native.fp8 import checkpoint_block

    config = json.loads((Path(model_dir) / "config.json").read_text()) if Path(model_dir).is_dir() else {}
    return checkpoint_block(SimpleNamespace(extra=config)) or BLOCK


def _same_layout(startup: BucketPlan, update: BucketPlan) -> bool:
    """Whether a replica made for ``update`` can load ``startup``'s buckets (same tensors, same dtypes)."""
    return {n: (s.shape, s.dtype) for n, s in startup.tensors.items()} == \
        {n: (s.shape, s.dtype) for n, s in update.tensors.items()}
