"""Expert-parallel training: the MoE layers' experts split over ``ep`` ranks, everything else sharded by FSDP2.

The ranks form a (``dp_mod_ep`` × ``ep``) grid (``ParallelDims.build_expert_mesh``). Along ``ep`` each rank holds
whole experts, E/ep of every layer: the stacked expert parameters become ``Shard(0)`` DTensors on the ``ep`` mesh,
FSDP2 leaves them alone (``ignored_params``) and tokens travel to them (``engines.model.native.expert_dispatch``).
The ``dp_mod_ep`` ranks that hold the same experts (world / ep of them) sum those experts' gradients before a step,
as FSDP2's reduce-scatter sums the rest; the RL losses are weighted by global counts, so a sum is the whole gradient.
Muon orthogonalises each local expert whole, with no communication (``engines.training.muon``), and checkpoints and
the weight-update plan read the experts through ``engines.model.sharded`` as any other row shard: a replica receives
each expert from the rank that holds it.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from engines.model.native.expert_dispatch import ExpertShard, routed_forward
from engines.model.native.moe import Experts
from engines.model.sharded import local_tensor


def _transformers_experts(m: nn.Module) -> bool:
    """transformers' stacked experts (its ``use_experts_implementation`` classes: Qwen2/3-MoE, Mixtral, GLM-4.5, …)."""
    return hasattr(m, "is_concatenated") and hasattr(m, "gate_up_proj") and hasattr(m, "down_proj")


def expert_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's stacked-experts blocks (native ``Experts``, or transformers' own), in layer order."""
    return [m for m in model.modules() if isinstance(m, Experts) or _transformers_experts(m)]


def check_experts(model: nn.Module, ep: int) -> None:
    """Refuse an expert-parallel size the model cannot take, in one line."""
    blocks = expert_blocks(model)
    if not blocks:
        raise ValueError(f"expert parallel (ep={ep}) needs a mixture-of-experts model; this one has no experts")
    odd = next((b for b in blocks if _transformers_experts(b) and (
        b.has_bias or b.is_transposed or not b.is_concatenated or not b.has_gate)), None)
    if odd is not None:  # gpt-oss: biases and interleaved gate/up, another expert function
        raise ValueError(f"expert parallel: transformers' {type(odd).__name__} (biases, transposed or interleaved "
                         f"weights) is not supported; set it to 1")
    if blocks[0].num_experts % ep:
        raise ValueError(f"expert parallel: ep={ep} does not divide the model's {blocks[0].num_experts} experts")


def shard_experts(model: nn.Module, mesh, dtype: torch.dtype | None = None) -> set[nn.Parameter]:
    """Split every ``Experts`` block of ``model`` over ``mesh``'s "ep" dimension (this rank keeps its E/ep experts,
    ``Shard(0)`` DTensors), computing in ``dtype``; returns the expert parameters, for FSDP2 to ignore. The model is
    on the meta device or holds the same weights on every rank."""
    ep_mesh = mesh["ep"]
    ep, me = ep_mesh.size(), ep_mesh.get_local_rank()
    check_experts(model, ep)
    replicas = mesh["dp_mod_ep"].get_group() if mesh["dp_mod_ep"].size() > 1 else None
    params: set[nn.Parameter] = set()
    for block in expert_blocks(model):
        per = block.num_experts // ep
        for name, p in list(block.named_parameters(recurse=False)):
            local = p.detach()[me * per:(me + 1) * per].clone()
            d = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=p.shape, stride=p.stride())
            setattr(block, name, nn.Parameter(d, requires_grad=p.requires_grad))
            params.add(getattr(block, name))
        block.shard = ExpertShard(ep_mesh.get_group(), ep, me, per, dtype, replicas=replicas)
        if _transformers_experts(block):  # its forward(hidden_states, top_k_index, top_k_weights), routed instead
            block.forward = functools.partial(_transformers_forward, block)
    return params


def _transformers_forward(block: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    return routed_forward(block, hidden_states, top_k_weights, top_k_index, slot_major=True)


def expert_shards(model: nn.Module) -> list[ExpertShard]:
    """The ``ExpertShard`` of each split experts block (their all-to-all byte counters, say)."""
    return [b.shard for b in expert_blocks(model) if getattr(b, "shard", None) is not None]


def is_expert_parallel(model: nn.Module) -> bool:
    """Whether ``model``'s experts are split over ranks (``shard_experts``)."""
    return any(getattr(b, "shard", None) is not None for b in expert_blocks(model))


def reduce_expert_grads(model: nn.Module) -> None:
    """Sum each expert's gradient over the ranks that hold the same experts (none when ep is the whole world)."""
    for block in expert_blocks(model):
        if getattr(block, "shard", None) is None or block.shard.replicas is None:
            continue
        grads = [local_tensor(p.grad) for p in block.parameters(recurse=False) if p.grad is not None]
        for g in grads:
            dist.all_reduce(g, group=block.shard.replicas)


def clip_grad_norm(model: nn.Module, params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over parameters on several meshes (FSDP2's and the experts'): the global
    pre-clip norm as a plain tensor, the same on every rank, and the gradients scaled by min(1, max_norm / norm)."""
    experts = {id(p) for b in expert_blocks(model) for p in b.parameters(recurse=False)}
    groups = ([p for p in params if id(p) not in experts], [p for p in params if id(p) in experts])
    square = None
    for group in groups:
        if not group:
            continue
        n = torch.nn.utils.get_total_norm([p.grad for p in group], 2.0)
        n = (n.full_tensor() if isinstance(n, DTensor) else n).float().square()
        square = n if square is None else square + n
    norm = square.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for group in groups:
        grads = [local_tensor(p.grad) for p in group]
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].device))
    return norm
