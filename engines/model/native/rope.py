"""Rotary position embeddings: the frequencies of every RoPE variant the families use, and their application.

The inverse frequencies and the cos/sin scaling of the scaled variants (linear, dynamic, YaRN,
Llama 3) come from transformers' own initialisers, so a checkpoint rotates here exactly as it does
there. cos/sin are computed per call from the integer positions (cheap next to the attention), so
no table bounds the context and any position costs the same.
"""

from __future__ import annotations

import torch

from engines.model.native.arch import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [rope_dim / 2] float32, attention scaling of cos/sin) for ``cfg``'s RoPE variant."""
    if cfg.rope_type == "default":
        d = cfg.rope_dim
        return 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[cfg.rope_type](cfg.hf_config(), torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class Rotary:
    """cos and sin [B, T, rope_dim] for integer positions [B, T]; the frequencies are kept per device."""

    def __init__(self, cfg: ModelConfig) -> None:
        inv_freq, self.scaling = inverse_frequencies(cfg)
        self._inv_freq = {torch.device("cpu"): inv_freq}

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        dev = positions.device
        if dev not in self._inv_freq:
            self._inv_freq[dev] = self._inv_freq[torch.device("cpu")].to(dev)
        freqs = positions[..., None].float() * self._inv_freq[dev]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, D] by cos/sin [B, T, D]: dimension i pairs with i + D/2."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's layout: dimensions (2i, 2i+1) form a pair. The result is in the half-split layout
    (pair i at i and i + D/2); queries and keys are rotated alike, so their dot products are unchanged."""
    half = cos.shape[-1] // 2
    c, s = cos[:, None, :, :half], sin[:, None, :, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
