"""QK-Clip (MuonClip, report Algorithm 1): rescale the query/key weights of heads whose max attention
logit exceeded τ.

The forward pass records each head's max pre-softmax logit (``engines.model.track_max_logits``);
after the optimizer step ``qk_clip`` reduces those maxima across ranks and, for a head with
S_max > τ, asks its attention module to scale that head by γ = τ / S_max (``clip_heads``):
- MHA: W_q and W_k rows of the head by √γ each;
- GQA: a key head serves several query heads and is never scaled; W_q rows take the whole γ;
- MLA: the head-specific q_C and k_C rows by √γ, the rotary query q_R by γ; the rotary key k_R is
  shared by every head and never scaled;
- q/k RMSNorm (Qwen3): the norm undoes any weight scaling, so nothing is clipped (the norm already
  bounds the logits); the maxima are still reported.
Works on plain tensors and on FSDP2 ``Shard(0)`` DTensors, whose local rows are scaled in place. The training engine
splits it: ``max_logit_table`` stays on the device until the step's one host read (with the gradient norm), then
``clip_from_maxima`` clips from the values on the host.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import Tensor, nn

from engines.model.native.causal_lm import attention_layers

log = logging.getLogger(__name__)


def max_logit_table(model: nn.Module, group: dist.ProcessGroup | None = None) -> Tensor | None:
    """Tracked max logit per layer and head [layers, H] (-inf where nothing was tracked), MAX-reduced across ranks,
    on the device (no host read); None for a model without attention layers."""
    layers = attention_layers(model)
    if not layers:
        return None
    # where the forward ran (the activations' device), so that e.g. NCCL reduces a CUDA tensor
    device = next((m.max_logits.device for m in layers if m.max_logits is not None),
                  next(layers[0].parameters()).device)
    rows = []
    for m in layers:
        s = m.max_logits
        rows.append(torch.full((m.num_heads,), float("-inf"), device=device) if s is None
                    else s.detach().float().to(device))
    table = torch.stack(rows)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        # every rank saw different data: the step's S_max is the max over all of them
        dist.all_reduce(table, op=dist.ReduceOp.MAX, group=group)
    return table


@torch.no_grad()
def qk_clip(model: nn.Module, tau: float | None, group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Clip heads whose tracked max logit exceeds ``tau`` (None: only report); resets the maxima.

    Returns ``max_logit_layer{i}`` and ``max_logit`` (before clipping) and ``qk_clipped_heads``. Collective
    when torch.distributed is initialised: every rank of ``group`` must call it.
    """
    check_tau(tau)
    table = max_logit_table(model, group)
    return clip_from_maxima(model, [] if table is None else table.tolist(), tau)


def check_tau(tau: float | None) -> None:
    """Refuse a threshold that is neither None nor positive."""
    if tau is not None and not tau > 0:
        raise ValueError(f"qk_clip tau must be a positive number or None, got {tau!r}")


@torch.no_grad()
def clip_from_maxima(model: nn.Module, maxima: list[list[float]], tau: float | None) -> dict[str, float]:
    """``qk_clip`` given the maxima already read to the host (``max_logit_table``'s rows): no host read and no
    collective; resets the tracked maxima."""
    check_tau(tau)
    layers = attention_layers(model)
    metrics: dict[str, float] = {}
    clipped = 0
    overall = float("-inf")
    for i, (attn, s_max) in enumerate(zip(layers, maxima, strict=True)):
        attn.max_logits = None
        top = max(s_max)
        if top == float("-inf"):
            continue  # no training forward reached this layer since the last reset
        metrics[f"max_logit_layer{i}"] = top
        overall = max(overall, top)
        if tau is None:
            continue
        gammas = {h: tau / v for h, v in enumerate(s_max) if v > tau}
        if gammas and attn.clip_heads(gammas):
            clipped += len(gammas)
        elif gammas and not getattr(attn, "_warned_unclippable", False):
            attn._warned_unclippable = True
            # a transformers model's layers say why their rule does not clip (engines.model.hf.qk_clip_plan)
            why = getattr(attn, "qk_clip_reason", None) or "its q/k RMSNorm undoes weight scaling (the norm bounds " \
                                                          "the logits)"
            log.warning("layer %d: %d heads exceed qk_clip_tau=%s, but QK-Clip leaves them: %s", i, len(gammas), tau,
                        why)
    if overall > float("-inf"):
        metrics["max_logit"] = overall
    metrics["qk_clipped_heads"] = float(clipped)
    return metrics
