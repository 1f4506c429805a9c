"""The attention function the transformers backend registers with transformers: document-masked attention
on packed rows, and the per-head max pre-softmax logit that QK-Clip reads.

transformers (5.x) calls ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, query, key, value,
attention_mask, dropout=, scaling=, **kwargs)`` from every softmax-attention layer, with the queries and keys
already projected, normalised (q/k norms) and rotated: query [B, H, T, D], key/value [B, KVH, T, D]. What a
family adds reaches it as keyword arguments: ``sliding_window`` (the layer's window, None on global layers:
Gemma 3, gpt-oss, Exaone 4, Mistral, SmolLM3), ``s_aux`` (gpt-oss's per-head attention sinks), ``softcap``
(Gemma 2's logit soft-capping), and whatever the caller passed to the model's forward. The name registered
here has no mask function in ``AttentionMaskInterface``, so transformers builds no mask (``attention_mask`` is
None); the packed batch's ``DocumentMask`` comes in through the forward's keyword arguments
(``PACKED_KWARG``) instead. A call without it raises rather than attending across documents.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engines.model.native.attention import flex_attend, head_max_logits, heads_over_valid
from engines.model.native.document_mask import DocumentMask

#: The ``attn_implementation`` name of ``document_attention`` in transformers' ``AttentionInterface``.
IMPLEMENTATION = "rl_document"
#: The keyword argument of the model's forward that carries ``PackedAttention`` down to each attention call.
PACKED_KWARG = "rl_packed"

#: True while activation checkpointing recomputes a layer in the backward: its (identical) logits are not
#: folded into the tracked maxima a second time.
recomputing: contextvars.ContextVar[bool] = contextvars.ContextVar("hf_attention_recomputing", default=False)


@dataclass
class PackedAttention:
    """What every attention call of one forward needs beyond its tensors: the document mask of the rows."""

    mask: DocumentMask


def _fold(module: torch.nn.Module, heads: torch.Tensor) -> None:
    """Keep the running per-head maximum [H] on ``module.max_logits`` (a plain attribute, as the native layers)."""
    heads = heads.detach()
    old = getattr(module, "max_logits", None)
    module.max_logits = heads if old is None else torch.maximum(old, heads)


def _eager(query, key, value, allowed: torch.Tensor, scale: float, softcap: float | None,
           sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax attention written out, for what SDPA cannot take: soft-capped logits, per-head sink logits.
    ``allowed`` [B, 1, T, S] bool. Output [B, H, T, Dv]."""
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1)
    v = value.repeat_interleave(groups, dim=1)
    logits = torch.matmul(query, k.transpose(-1, -2)) * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(logits, dim=-1), v)
    # a sink is one more logit per head that takes probability mass and contributes no value
    sink = sinks.to(logits.dtype).reshape(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
    both = torch.cat([logits, sink], dim=-1)
    probs = torch.softmax(both - both.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    return torch.matmul(probs, v)


def document_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       sliding_window: int | None = None, softcap: float | None = None,
                       s_aux: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of one layer over the packed rows' ``DocumentMask`` (narrowed to ``sliding_window``): output
    [B, T, H, Dv] as transformers expects. Dropout is never applied (RL scores tokens as they were sampled).
    With ``module.track_logits`` the per-head max of scale·q·kᵀ (before soft-capping) over the valid queries'
    allowed keys is folded into ``module.max_logits``."""
    packed = kwargs.get(PACKED_KWARG)
    if packed is None:
        raise RuntimeError(f"{type(module).__name__} ran {IMPLEMENTATION!r} attention without the packed batch's "
                           f"document mask ({PACKED_KWARG!r} keyword): this model's forward does not pass keyword "
                           "arguments down to its attention layers")
    mask = packed.mask.with_window(sliding_window)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = rows = None
    plain = softcap is None and s_aux is None
    if plain and mask.backend == "flex":
        done = flex_attend(query, key, value, mask, scale)
        if done is not None:
            out, rows = done
    if out is None:
        allowed = mask.dense()
        if plain:
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scale, enable_gqa=True)
        else:
            out = _eager(query, key, value, allowed, scale, softcap, s_aux)
    if getattr(module, "track_logits", False) and not recomputing.get():
        if rows is not None:  # the compiled flex kernel's row maxima
            _fold(module, heads_over_valid(rows, mask.query_valid))
        else:
            _fold(module, head_max_logits(query, key, mask.dense(), scale, mask.query_valid))
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register ``document_attention`` with transformers (idempotent); returns its implementation name."""
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, document_attention)
    return IMPLEMENTATION
