"""QK-Clip (MuonClip, report Algorithm 1): rescale W_q / W_k of heads whose max attention logit exceeded τ.

The forward pass records each head's max pre-softmax logit (``engines.model.track_max_logits``);
after the optimizer step ``qk_clip`` reduces those maxima across ranks, scales the offending heads'
projection rows and resets the record. For a head with S_max > τ, γ = τ / S_max: with one key head per
query head (MHA) its W_q and W_k rows are each scaled by √γ; a key head shared by a group of query
heads (GQA) is never scaled, and the query head's W_q rows take the whole γ. Works on plain tensors
and on FSDP2 ``Shard(0)`` DTensors, whose local rows are scaled in place.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor, nn

from engines.distributed import local_rows
from engines.model import Attention


@torch.no_grad()
def _scale_rows(w: Tensor, head_dim: int, scales: dict[int, float]) -> None:
    """Multiply head h's rows [h·d, (h+1)·d) of ``w`` by ``scales[h]``, touching only the local shard."""
    local, start = local_rows(w)
    end = start + local.shape[0]
    for h, s in scales.items():
        lo, hi = max(h * head_dim, start), min((h + 1) * head_dim, end)
        if lo < hi:
            local[lo - start:hi - start].mul_(s)


def gathered_max_logits(model: nn.Module, group: dist.ProcessGroup | None = None) -> list[Tensor]:
    """Per-layer tracked max logit per head [H] (-inf where nothing was tracked), MAX-reduced across ranks."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if not layers:
        return []
    # where the forward ran (the activations' device), so that e.g. NCCL reduces a CUDA tensor
    device = next((m.max_logits.device for m in layers if m.max_logits is not None), layers[0].q_proj.weight.device)
    rows = []
    for m in layers:
        h = m.cfg.num_attention_heads
        s = m.max_logits
        rows.append(torch.full((h,), float("-inf"), device=device) if s is None else s.detach().float().to(device))
    table = torch.stack(rows)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        # every rank saw different data: the step's S_max is the max over all of them
        dist.all_reduce(table, op=dist.ReduceOp.MAX, group=group)
    return list(table.cpu().unbind(0))


@torch.no_grad()
def qk_clip(model: nn.Module, tau: float | None, group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Clip heads whose tracked max logit exceeds ``tau`` (None: only report); resets the maxima.

    Returns ``max_logit_layer{i}`` and ``max_logit`` (before clipping) and ``qk_clipped_heads``. Collective
    when torch.distributed is initialised: every rank of ``group`` must call it.
    """
    if tau is not None and not tau > 0:
        raise ValueError(f"qk_clip tau must be a positive number or None, got {tau!r}")
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    maxima = gathered_max_logits(model, group)
    metrics: dict[str, float] = {}
    clipped = 0
    overall = float("-inf")
    for i, (attn, s_max) in enumerate(zip(layers, maxima, strict=True)):
        attn.max_logits = None
        top = float(s_max.max())
        if top == float("-inf"):
            continue  # no training forward reached this layer since the last reset
        metrics[f"max_logit_layer{i}"] = top
        overall = max(overall, top)
        if tau is None:
            continue
        cfg = attn.cfg
        gammas = {h: tau / float(v) for h, v in enumerate(s_max.tolist()) if v > tau}
        if not gammas:
            continue
        clipped += len(gammas)
        if cfg.num_key_value_heads == cfg.num_attention_heads:
            roots = {h: math.sqrt(g) for h, g in gammas.items()}
            _scale_rows(attn.q_proj.weight, cfg.head_dim, roots)
            _scale_rows(attn.k_proj.weight, cfg.head_dim, roots)
        else:
            # a key head serves several query heads: scaling it would also shrink heads under tau
            _scale_rows(attn.q_proj.weight, cfg.head_dim, gammas)
    if overall > float("-inf"):
        metrics["max_logit"] = overall
    metrics["qk_clipped_heads"] = float(clipped)
    return metrics
