"""Expert-parallel training: the MoE layers' experts split over ``ep`` ranks, everything else sharded by FSDP2.

The ranks form an (``ep`` × ``dp_mod_ep``) grid (``ParallelDims.build_expert_mesh``). Each expert-parallel group of
``ep`` consecutive ranks splits every layer's experts, E/ep apiece, and tokens travel to them
(``engines.model.native.expert_dispatch``). The world/ep ranks that compute the same experts (one per group) store
them sharded between them, whole experts apiece: the stacked expert parameters are ``Shard(0)``, ``Shard(0)``
DTensors on the grid, so a rank stores about E/world experts, gathers its group's E/ep for a forward and
reduce-scatters their gradients in the backward (summed: the RL losses are weighted by global counts), as FSDP2 does
with everything else, which it shards over all the ranks (the experts are ``ignored_params`` to it). Muon
orthogonalises each stored expert whole, with no communication (``engines.training.muon``); checkpoints and the
weight-update plan read the experts through ``engines.model.sharded`` as any other row shard, so a replica receives
each expert from the one rank that stores it.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from engines.model.native.expert_dispatch import ExpertShard, routed_forward
from engines.model.native.moe import Experts
from engines.model.sharded import chunk_rows, local_tensor


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
    """Split every experts block of ``model`` over ``mesh`` (``ParallelDims.build_expert_mesh``): along "ep" each rank
    computes E/ep experts, stored sharded over "dp_mod_ep" (``Shard(0)``, ``Shard(0)`` DTensors), computing in
    ``dtype``; returns the expert parameters, for FSDP2 to ignore. The model is on the meta device or holds the same
    weights on every rank."""
    ep_mesh, replica_mesh = mesh["ep"], mesh["dp_mod_ep"]
    ep, me = ep_mesh.size(), ep_mesh.get_local_rank()
    n, mine = replica_mesh.size(), replica_mesh.get_local_rank()
    check_experts(model, ep)
    params: set[nn.Parameter] = set()
    for block in expert_blocks(model):
        per = block.num_experts // ep
        counts = chunk_rows(per, n)
        first = me * per + sum(counts[:mine])
        for name, p in list(block.named_parameters(recurse=False)):
            local = p.detach()[first:first + counts[mine]].clone()
            d = DTensor.from_local(local, mesh, [Shard(0), Shard(0)], run_check=False, shape=p.shape,
                                   stride=p.stride())
            setattr(block, name, nn.Parameter(d, requires_grad=p.requires_grad))
            params.add(getattr(block, name))
        block.shard = ExpertShard(group=ep_mesh.get_group(), size=ep, rank=me, per_rank=per, dtype=dtype,
                                  replicas=replica_mesh.get_group() if n > 1 else None)
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
