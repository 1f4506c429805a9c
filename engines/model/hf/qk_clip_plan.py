"""Which weights QK-Clip scales in a transformers model, per decoder layer, read from the modules' layout.

QK-Clip (MuonClip) scales head h by γ_h = τ / S_max,h so that its largest pre-softmax logit comes back to τ. The
logit of head h is scale·q_h·k_hᵀ, so what is scaled must scale q_h (or k_h) linearly:
- separate q/k projections (Llama, Mistral, Granite, SmolLM3, Phi-3's fused ``qkv_proj`` alike): MHA scales
  the head's W_q and W_k rows (and biases) by √γ each; GQA scales only the query rows, by the whole γ, since a
  key head serves several query heads (as the native ``Attention.clip_heads``);
- MLA (DeepSeek-V3 layout): the head's q_C and k_C rows by √γ, its rotary query rows q_R by γ; the rotary key is
  shared by every head and never scaled (as the native ``LatentAttention.clip_heads``);
- q/k RMSNorm after the projection (Qwen3, Qwen3-Next, Gemma 3, Exaone 4, GLM-4.5 with ``use_qk_norm``, LFM2):
  RMSNorm(γ·x) = RMSNorm(x), so scaling W_q or W_k does nothing. Where the norm's gain spans all heads of
  the projection (OLMo-2: one RMSNorm over the H·d query features) its slice of head h multiplies that head's
  normalised query alone, and scaling the slice is exact: the rule scales those gains instead (√γ on q and k
  for MHA, γ on q for GQA). Where one gain of d entries is shared by every head (Qwen3, Gemma 3, …) no weight
  scales one head alone: not applied (the norm bounds the logits by the gains);
- attention sinks (gpt-oss): a sink is a learned logit per head that is not a q·k product; scaling q_h scales
  the key logits but not the sink's, shifting mass towards the sink: not applied;
- linear attention, state-space and convolution layers (Qwen3-Next's Gated DeltaNet, Nemotron-H's Mamba-2,
  LFM2's short convolutions): no softmax logits at all; not applicable.

``qk_clip_plan(layers, hf_config)`` returns one ``QKClipRule`` per decoder layer. Rules name parameters by
(module, attribute) and look them up when clipping, so they hold after FSDP2 swapped the parameters for shards.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from engines.model.native.attention import scale_rows

#: Attribute names of a softmax attention module's query projection (separate, fused, or MLA's).
QUERY_PROJECTIONS = ("q_proj", "qkv_proj", "q_b_proj")
#: Attribute names of per-head query / key norms applied after the projection.
QUERY_NORMS = ("q_norm", "q_layernorm", "query_layernorm")
KEY_NORMS = ("k_norm", "k_layernorm", "key_layernorm")


@dataclass(frozen=True, kw_only=True)
class HeadRows:
    """Rows [first + h·stride, first + h·stride + rows) of ``owner.<name>`` belong to head h; QK-Clip multiplies
    them by γ_h ** power."""

    owner: nn.Module
    name: str
    first: int
    rows: int
    stride: int
    power: float

    def scale(self, gammas: dict[int, float]) -> None:
        """Scale head h's rows by ``gammas[h] ** power`` (only this rank's shard of a sharded parameter)."""
        lo = lambda h: self.first + h * self.stride  # noqa: E731
        scale_rows(getattr(self.owner, self.name),
                   {(lo(h), lo(h) + self.rows): g ** self.power for h, g in gammas.items()})


@dataclass(kw_only=True)
class QKClipRule:
    """What QK-Clip does to one decoder layer: scale ``targets`` per head, or nothing, for ``reason``."""

    layer: int
    module: nn.Module | None       # the softmax attention module (its forward records ``max_logits``), or None
    num_heads: int
    layout: str                    # "mha", "gqa", "mla", "norm_gain", or what the layer is when not clipped
    targets: tuple[HeadRows, ...] = field(default=())
    reason: str | None = None      # why the layer is not clipped

    @property
    def applies(self) -> bool:
        return bool(self.targets)

    @torch.no_grad()
    def clip(self, gammas: dict[int, float]) -> bool:
        """Scale head h by ``gammas[h]`` (< 1) as the rule says; False (nothing done) where it does not apply."""
        if not self.targets:
            return False
        for t in self.targets:
            t.scale(gammas)
        return True


def _linear(m: nn.Module, name: str) -> nn.Linear | None:
    sub = getattr(m, name, None)
    return sub if isinstance(sub, nn.Linear) else None


def attention_module(layer: nn.Module) -> nn.Module | None:
    """The softmax attention module inside a decoder layer (the first module with a query projection)."""
    for m in layer.modules():
        if m is not layer and any(_linear(m, n) is not None for n in QUERY_PROJECTIONS):
            return m
    return None


def _mixer_name(layer: nn.Module) -> str:
    """The class of the layer's sequence mixer when it has no softmax attention (or "none")."""
    for m in layer.children():
        name = type(m).__name__
        if not any(s in name for s in ("Norm", "MLP", "MoE", "Moe", "Experts", "FeedForward", "Sparse")):
            return name
    return "none"


def _rows(lin: nn.Linear, first: int, rows: int, stride: int, power: float) -> list[HeadRows]:
    out = [HeadRows(owner=lin, name="weight", first=first, rows=rows, stride=stride, power=power)]
    if lin.bias is not None:
        out.append(HeadRows(owner=lin, name="bias", first=first, rows=rows, stride=stride, power=power))
    return out


def _norm(m: nn.Module, names: tuple[str, ...]) -> nn.Module | None:
    return next((getattr(m, n) for n in names if isinstance(getattr(m, n, None), nn.Module)), None)


def rule_for(index: int, layer: nn.Module, hf_config) -> QKClipRule:
    """The ``QKClipRule`` of decoder layer ``index`` (see the module docstring for each layout)."""
    attn = attention_module(layer)
    heads = hf_config.num_attention_heads
    if attn is None:
        mixer = _mixer_name(layer)
        return QKClipRule(layer=index, module=None, num_heads=heads, layout="no_softmax_attention",
                          reason=f"{mixer}: no softmax attention in this layer, so no attention logits to clip")
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if isinstance(getattr(attn, "sinks", None), torch.Tensor):
        return QKClipRule(layer=index, module=attn, num_heads=heads, layout="sinks",
                          reason="attention sinks: a learned per-head logit that scaling W_q would not scale, so "
                          "clipping would move attention mass onto the sink")
    if _linear(attn, "kv_b_proj") is not None:
        return _mla_rule(index, attn, heads, hf_config)
    hd = getattr(attn, "head_dim", None) or getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    mha = kv_heads == heads
    q_norm, k_norm = _norm(attn, QUERY_NORMS), _norm(attn, KEY_NORMS)
    if q_norm is not None or k_norm is not None:
        q_gain = getattr(q_norm, "weight", None)
        k_gain = getattr(k_norm, "weight", None)
        if q_gain is not None and q_gain.numel() == heads * hd and (not mha or (
                k_gain is not None and k_gain.numel() == kv_heads * hd)):
            targets = [HeadRows(owner=q_norm, name="weight", first=0, rows=hd, stride=hd, power=0.5 if mha else 1.0)]
            if mha:
                targets.append(HeadRows(owner=k_norm, name="weight", first=0, rows=hd, stride=hd, power=0.5))
            return QKClipRule(layer=index, module=attn, num_heads=heads, layout="norm_gain", targets=tuple(targets))
        return QKClipRule(layer=index, module=attn, num_heads=heads, layout="qk_norm",
                          reason="q/k RMSNorm after the projection undoes any scaling of W_q/W_k, and its gain is "
                          "shared by all heads, so no weight scales one head: not clipped (the norm's gains bound the "
                          "logits)")
    power = 0.5 if mha else 1.0
    fused = _linear(attn, "qkv_proj")
    if fused is not None:  # rows: every query head, then every key head, then the values
        targets = _rows(fused, 0, hd, hd, power) + (_rows(fused, heads * hd, hd, hd, 0.5) if mha else [])
        return QKClipRule(layer=index, module=attn, num_heads=heads, layout="mha" if mha else "gqa",
                          targets=tuple(targets))
    q, k = _linear(attn, "q_proj"), _linear(attn, "k_proj")
    if k is None:
        return QKClipRule(layer=index, module=attn, num_heads=heads, layout="unknown",
                          reason=f"{type(attn).__name__}: no k_proj beside q_proj")
    stride = q.out_features // heads  # 2·hd where each head's query rows are followed by its output gate (Qwen3-Next)
    if stride not in (hd, 2 * hd):
        return QKClipRule(layer=index, module=attn, num_heads=heads, layout="unknown",
                          reason=f"{type(attn).__name__}: q_proj has {q.out_features} rows for {heads} heads of {hd}")
    targets = _rows(q, 0, hd, stride, power) + (_rows(k, 0, hd, hd, 0.5) if mha else [])
    return QKClipRule(layer=index, module=attn, num_heads=heads, layout="mha" if mha else "gqa", targets=tuple(targets))


def _mla_rule(index: int, attn: nn.Module, heads: int, hf_config) -> QKClipRule:
    nope, rope, v = hf_config.qk_nope_head_dim, hf_config.qk_rope_head_dim, hf_config.v_head_dim
    qk = nope + rope
    q = _linear(attn, "q_b_proj") or _linear(attn, "q_proj")
    targets = (HeadRows(owner=q, name="weight", first=0, rows=nope, stride=qk, power=0.5),
               HeadRows(owner=q, name="weight", first=nope, rows=rope, stride=qk, power=1.0),
               HeadRows(owner=attn.kv_b_proj, name="weight", first=0, rows=nope, stride=nope + v, power=0.5))
    return QKClipRule(layer=index, module=attn, num_heads=heads, layout="mla", targets=targets)


def qk_clip_plan(layers: list[nn.Module], hf_config) -> list[QKClipRule]:
    """One ``QKClipRule`` per decoder layer of a transformers model (``layers`` as ``hf_spec.decoder_layers``)."""
    cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    return [rule_for(i, layer, cfg) for i, layer in enumerate(layers)]

