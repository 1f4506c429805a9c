"""The trainer's process group and FSDP2 sharding of the model.

Every worker's trainer is one rank of the default torch.distributed group (gloo on CPU, NCCL on
CUDA); the checkpoint engine reuses that group. ``shard_model`` shards each decoder layer and the
root with ``fully_shard`` (dim-0 shards, torch.chunk sizes) and makes gradient reduction a plain
SUM, because the RL losses are already weighted by global (all-rank) counts. On a mesh of one rank (mixed
precision on one GPU) a layer keeps its gathered compute-dtype copy from the forward to its backward instead of
casting it again (``reshard_after_forward``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from engines.model import sharded
from engines.model.hf.spec import decoder_layers

if TYPE_CHECKING:
    from engines.model.native.causal_lm import CausalLM

#: the default group's size and this process's rank; defined beside the shards, where the checkpoint engine reads them
world_size, rank = sharded.world_size, sharded.rank

PARAM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def init_distributed(rank: int, world: int, init_method: str, device: str = "cpu", timeout_s: float = 300) -> None:
    """Initialise the default process group (gloo on CPU, NCCL on CUDA) unless it already exists."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is not None:  # NCCL's collectives run on the current device
        torch.cuda.set_device(dev)
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, world):
            raise RuntimeError(f"the process group is already initialised as rank {dist.get_rank()} of "
                               f"{dist.get_world_size()}, not {rank} of {world}")
        return
    backend = "nccl" if dev.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))


def all_reduce_tensor(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """``t`` reduced over all ranks in place ("sum" or "max"), on its own device (no host read); itself when not
    distributed. Every rank passes a tensor of the same shape."""
    if world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` went through ``fully_shard`` (its parameters are DTensors)."""
    return isinstance(model, FSDPModule)


def keeps_gathered(model: nn.Module) -> bool:
    """Whether sharded ``model``'s layers stay gathered after a forward: a mesh of one rank (``shard_model``)."""
    if not is_sharded(model):
        return False
    p = next(model.parameters())
    return isinstance(p, DTensor) and p.device_mesh.size() == 1


def reshard_all(model: nn.Module) -> None:
    """Free every gathered (unsharded) parameter copy of a sharded ``model``, leaving only the shards; a no-op for
    modules already resharded and for a plain model. A copy left by a no-grad forward would otherwise outlive the
    next optimizer step, stale."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def shard_model(model: CausalLM, param_dtype: str = "float32", device: torch.device | str | None = None,
                mesh=None, reshard_after_forward: bool | None = None, expert_mesh=None) -> CausalLM:
    """Shard ``model`` in place over ``mesh`` (a ``ParallelDims``' mesh; default: the whole default group, one
    dimension): each decoder layer, then the root.

    Master weights stay in the model's dtype and gradients are reduced in float32; ``param_dtype``
    "bfloat16" runs forward/backward in bf16. Gradients are summed over ranks, never averaged. Either
    the model is on this rank's device with identical weights on every rank, or it is on the meta
    device: it is then moved to ``device`` with uninitialised local shards, for the caller to load (buffers built
    off the meta device, such as a transformers model's rotary tables, keep their values).

    ``reshard_after_forward`` (None: whether the mesh has more than one rank) frees each layer's gathered copy after
    its forward. On one rank there is nothing to gather, only the cast to the compute dtype, so the copy is kept
    until the layer's backward (which frees it) rather than cast again there: the same numbers, the whole model in
    the compute dtype held through the forward (a no-grad forward leaves it gathered until ``reshard_all``).

    ``expert_mesh`` (``ParallelDims.build_expert_mesh``): the MoE experts are split over its "ep" ranks instead
    (``engines.training.expert_parallel``) and FSDP2 shards the rest.
    """
    if param_dtype not in PARAM_DTYPES:
        raise ValueError(f"param_dtype must be one of {sorted(PARAM_DTYPES)}, got {param_dtype!r}")
    if not dist.is_initialized():
        raise RuntimeError("shard_model needs an initialised process group (init_distributed)")
    dev = next(model.parameters()).device
    on_meta = dev.type == "meta"
    kept = {n: b.detach().clone() for n, b in model.named_buffers() if b.device.type != "meta"} if on_meta else {}
    if on_meta:
        if device is None:
            raise ValueError("shard_model of a meta-device model needs the device its shards go to")
        dev = torch.device(device)
    if mesh is None:
        mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
    compute = PARAM_DTYPES[param_dtype]
    policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.promote_types(compute, torch.float32))
    if reshard_after_forward is None:
        reshard_after_forward = mesh.size() > 1
    experts = None
    if expert_mesh is not None:
        from engines.training.expert_parallel import shard_experts

        experts = shard_experts(model, expert_mesh, PARAM_DTYPES[param_dtype])
    for layer in decoder_layers(model):  # the native model's layers, or a transformers model's _no_split_modules
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward,
                    ignored_params=experts)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward,
                ignored_params=experts)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            # factor 1 with sum-only collectives: a SUM reduce-scatter and no division afterwards
            # (gloo has no PREMUL_SUM, which a factor alone would ask for)
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    if on_meta:
        model.to_empty(device=dev)
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n in kept:
                    b.copy_(kept[n])
    return model
