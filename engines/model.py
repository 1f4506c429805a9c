"""A decoder-only transformer of the Llama/Qwen2 family (RMSNorm, RoPE, GQA, SwiGLU).

Both engines run this one definition, so that for the same weights and tokens they compute the
same log-probabilities. Parameter names follow Hugging Face's ``LlamaForCausalLM`` so checkpoints
load in ``transformers`` unchanged.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelConfig:
    """Architecture hyper-parameters, named as in a Hugging Face ``config.json``."""

    vocab_size: int = 256
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be divisible by num_key_value_heads")

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` contents that ``transformers`` reads as a ``LlamaConfig``."""
        d = asdict(self)
        d.update(
            architectures=["LlamaForCausalLM"],
            model_type="llama",
            hidden_act="silu",
            head_dim=self.head_dim,
            attention_bias=False,
            mlp_bias=False,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            torch_dtype="float32",
        )
        return d

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Read the fields this model supports from a Hugging Face ``config.json`` dict."""
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known}
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        if "rope_theta" not in kwargs and "rope_theta" in rope:
            kwargs["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"unsupported rope_type {rope.get('rope_type')!r}; only 'default'")
        if d.get("head_dim") not in (None, d["hidden_size"] // d["num_attention_heads"]):
            raise ValueError("head_dim other than hidden_size // num_attention_heads is unsupported")
        if isinstance(kwargs.get("eos_token_id"), list):
            kwargs["eos_token_id"] = kwargs["eos_token_id"][0]
        return cls(**kwargs)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in float32, scale in the model's dtype (as transformers' Llama does)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class Rotary:
    """RoPE tables for every position of the context, computed once per device in float32."""

    def __init__(self, cfg: ModelConfig) -> None:
        d = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        freqs = torch.arange(cfg.max_position_embeddings).float()[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        # rotate_half(x) = roll(x, d/2) * sign, so the sign is folded into the sine table
        sign = torch.cat((-torch.ones(d // 2), torch.ones(d // 2)))
        self._tables = {torch.device("cpu"): (emb.cos(), emb.sin() * sign)}

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [B, T, head_dim] for integer positions [B, T]."""
        dev = positions.device
        if dev not in self._tables:
            cpu = self._tables[torch.device("cpu")]
            self._tables[dev] = (cpu[0].to(dev), cpu[1].to(dev))
        cos, sin = self._tables[dev]
        return cos[positions].to(dtype), sin[positions].to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, D] by the tables [B, T, D] (sin carries rotate_half's sign)."""
    return x * cos[:, None] + x.roll(x.shape[-1] // 2, dims=-1) * sin[:, None]


class AttentionCache(Protocol):
    """Where an inference engine keeps keys/values: it stores this call's k/v and attends."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention output [B, H, T, D] for queries q [B, H, T, D] and the new k/v [B, KVH, T, D]."""
        ...


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(d, cfg.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, cfg.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, cfg.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, d, bias=False)
        # QK-Clip's signal: plain attributes, not buffers, so the state dict is unchanged
        self.track_logits = False
        self.max_logits: torch.Tensor | None = None  # running max pre-softmax logit per query head [H]

    def forward(self, x, cos, sin, mask, layer: int, cache: AttentionCache | None):
        b, t, _ = x.shape
        hd = self.cfg.head_dim
        q = self.q_proj(x).view(b, t, -1, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is None:
            if self.track_logits:
                self._record_max_logits(q, k, mask)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        else:
            out = cache.attend(layer, q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    @torch.no_grad()
    def _record_max_logits(self, q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> None:
        """Fold this call's per-head max of q·kᵀ/√d over the pairs ``mask`` allows into ``max_logits``."""
        heads = head_max_logits(q, k, mask)
        self.max_logits = heads if self.max_logits is None else torch.maximum(self.max_logits, heads)


#: Elements of one block of logits in ``head_max_logits``, to bound its memory on long sequences.
_LOGIT_BLOCK = 1 << 24


@torch.no_grad()
def head_max_logits(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Per query head max of q·kᵀ/√d [H] (float32) for q [B, H, T, D], k [B, KVH, S, D].

    Query head h reads kv head h // (H / KVH), as SDPA's ``enable_gqa``. ``mask`` as SDPA's
    ``attn_mask`` (boolean True = attend, or additive float with -inf = masked); None allows every pair.
    """
    b, h, t, d = q.shape
    kvh, s = k.shape[1], k.shape[2]
    g = h // kvh
    # group the query heads of each kv head so the shared keys are never repeated
    qg = q.float().unflatten(1, (kvh, g))
    kt = k.float().transpose(-1, -2)[:, :, None]
    if mask is not None:
        allowed = mask if mask.dtype == torch.bool else mask > float("-inf")
        allowed = allowed.expand(b, h, t, s).unflatten(1, (kvh, g))
    best = torch.full((b, kvh, g), float("-inf"), device=q.device)
    step = max(1, _LOGIT_BLOCK // max(1, b * h * s))
    for i in range(0, t, step):
        logits = torch.matmul(qg[:, :, :, i:i + step], kt) * (1.0 / math.sqrt(d))
        if mask is not None:
            logits.masked_fill_(~allowed[:, :, :, i:i + step], float("-inf"))
        best = torch.maximum(best, logits.amax(dim=(-2, -1)))
    return best.amax(dim=0).reshape(h)


def track_max_logits(model: nn.Module, enabled: bool = True) -> None:
    """Switch per-head max-logit tracking of every attention layer in ``model`` (training forwards only)."""
    for m in model.modules():
        if isinstance(m, Attention):
            m.track_logits = enabled


def reset_max_logits(model: nn.Module) -> None:
    """Forget the tracked maxima of every attention layer in ``model``."""
    for m in model.modules():
        if isinstance(m, Attention):
            m.max_logits = None


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, layer, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, layer, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """The language model. ``forward`` serves full-sequence training and cached decoding alike."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.rotary = Rotary(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: AttentionCache | None = None,
        select: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, V] for tokens [B, T] at RoPE positions [B, T].

        ``mask`` is a boolean [B, 1, T, T] (True = may attend) used when there is no ``cache``;
        a cache attends itself. ``select`` [B] picks one position per row: logits are then [B, V],
        and the vocabulary projection runs only there.
        """
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, mask, i, cache)
        if select is not None:
            x = x[torch.arange(x.shape[0], device=x.device), select]
        return self.lm_head(self.model.norm(x))


def padded_causal_mask(valid: torch.Tensor) -> torch.Tensor:
    """Boolean [B, 1, T, T] mask: causal, and padding keys (valid == False) hidden.

    Fully padded query rows keep their own diagonal so softmax never sees an empty row.
    """
    t = valid.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=valid.device).tril()
    mask = causal[None] & valid[:, None, :]
    mask |= torch.eye(t, dtype=torch.bool, device=valid.device)[None]
    return mask[:, None]


def positions_from_valid(valid: torch.Tensor) -> torch.Tensor:
    """RoPE positions that count only valid tokens, so padding never shifts a sequence."""
    return (valid.long().cumsum(-1) - 1).clamp(min=0)
