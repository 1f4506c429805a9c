"""What one training step sends between trainer ranks, predicted from the model's shape and the parallel layout.

Per rank, for one forward and backward over ``tokens`` tokens on that rank (bytes this rank puts on the wire, ring
collectives):

- ``fsdp_all_gather``: FSDP2 gathers each unit's sharded parameters (every decoder layer, and the root: embeddings,
  head, final norm) in the compute dtype for its forward and again for its backward (resharded in between): a rank
  sends its shard to the world − 1 others; under expert parallel the routed experts are not among them.
- ``fsdp_reduce_scatter``: each unit's gradients once, in float32 (float64 for a float64 model): (world − 1) / world
  of the unit's bytes.
- ``all_to_all``: per MoE layer, the dispatch and the combine each carry tokens · top_k rows of ``hidden`` values in the
  compute dtype, of which (ep − 1) / ep leave the rank when routes spread evenly over the experts; the backward sends
  as much again, and activation checkpointing's recompute a forward's worth more.
- ``expert_all_gather`` / ``expert_reduce_scatter``: with r = world / ep > 1 the r ranks computing the same E/ep
  experts store ⌈E/ep/r⌉ of them apiece (whole experts): each MoE layer's forward gathers them in the master dtype
  (a rank sends its padded share to the r − 1 others; activation checkpointing's recompute gathers again), its
  backward reduce-scatters their gradients ((r − 1) / r of the r padded shares).

Routing is not even in practice (the measured all-to-all of ``benchmarks.expert_parallel`` shows by how much).
"""

from __future__ import annotations

from engines.model.native.arch import ModelConfig


def _counts(arch: ModelConfig) -> tuple[list[int], list[int], int]:
    """Per decoder layer: parameters without the routed experts, and the routed experts'; the root's parameters."""
    from engines.model.native.causal_lm import build_model

    model = build_model(arch, device="meta")
    dense = [0] * arch.num_hidden_layers
    experts = [0] * arch.num_hidden_layers
    root = 0
    for name, p in model.named_parameters():
        if ".layers." not in name:
            root += p.numel()
            continue
        layer = int(name.split(".layers.")[1].split(".")[0])
        routed = ".experts." in name and ".shared_experts." not in name
        (experts if routed else dense)[layer] += p.numel()
    return dense, experts, root


def step_traffic(arch: ModelConfig, tokens: int, world: int, ep: int = 1, compute_bytes: int = 4,
                 checkpointing: bool = False, master_bytes: int = 4) -> dict[str, int]:
    """Bytes one rank sends in one forward + backward of ``tokens`` tokens, by collective (see the module)."""
    dense, experts, root = _counts(arch)
    others = world - 1
    units = [d + (e if ep == 1 else 0) for d, e in zip(dense, experts, strict=True)]
    gather = sum(2 * u * compute_bytes * others // world for u in [*units, root])
    reduce = sum(u * max(4, compute_bytes) * others // world for u in [*units, root])
    out = {"fsdp_all_gather": gather, "fsdp_reduce_scatter": reduce, "all_to_all": 0, "expert_all_gather": 0,
           "expert_reduce_scatter": 0}
    if ep > 1:
        moe = [e for e in experts if e]
        passes = 6 if checkpointing else 4  # dispatch + combine, forward and backward (+ the recompute)
        row = arch.hidden_size * compute_bytes
        out["all_to_all"] = len(moe) * passes * tokens * arch.num_experts_per_tok * row * (ep - 1) // ep
        r = world // ep
        if r > 1:
            share = -(-(arch.num_experts // ep) // r)  # experts a rank stores, padded to the largest share
            per_expert = [e // arch.num_experts * master_bytes for e in moe]
            out["expert_all_gather"] = (2 if checkpointing else 1) * sum(share * b * (r - 1) for b in per_expert)
            out["expert_reduce_scatter"] = sum(share * b * (r - 1) for b in per_expert)
    out["total"] = sum(out.values())
    return out
