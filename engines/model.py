"""A decoder-only transformer of the Llama/Qwen2 family (RMSNorm, RoPE, GQA, SwiGLU).

Both engines run this one definition, so that for the same weights and tokens they compute the
same log-probabilities. Parameter names follow Hugging Face's ``LlamaForCausalLM`` so checkpoints
load in ``transformers`` unchanged.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

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
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin tables of shape [B, T, head_dim] for integer positions [B, T]."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim)
    )
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, D] by the tables [B, T, D]."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


class KVCache:
    """Preallocated keys/values [layers, B, kv_heads, max_len, head_dim] written by column."""

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, dtype: torch.dtype, device=None):
        shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0  # columns [0, length) are filled

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        end = start + k.shape[2]
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(d, cfg.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, cfg.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, cfg.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, d, bias=False)

    def forward(self, x, cos, sin, mask, layer: int, cache: KVCache | None, start: int):
        b, t, _ = x.shape
        hd = self.cfg.head_dim
        q = self.q_proj(x).view(b, t, -1, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.write(layer, start, k, v)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


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

    def forward(self, x, cos, sin, mask, layer, cache, start):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, layer, cache, start)
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
        mask: torch.Tensor,
        cache: KVCache | None = None,
        start: int = 0,
    ) -> torch.Tensor:
        """Logits [B, T, V] for tokens [B, T] at RoPE positions [B, T].

        ``mask`` is a boolean [B, 1, T, S] (True = may attend) over the S keys visible to these
        queries; with a cache, the new keys are written at columns [start, start + T).
        """
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, mask, i, cache, start)
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
