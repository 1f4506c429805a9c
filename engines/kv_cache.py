"""The inference engine's KV cache: preallocated slots, one per running sequence.

The running batch always occupies slots 0..n-1 (a finished sequence's slot is refilled by moving
the last one into it), so a decode step attends over a view of the cache, never a gathered copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engines.arch import ModelConfig
from engines.attention import window_mask


def cache_dims(cfg: ModelConfig) -> tuple[int, int, int]:
    """(heads, key dim, value dim) cached per token and layer. MLA caches its keys and values
    expanded per head (qk = nope + rope dims; the compressed-latent cache is not built yet)."""
    if cfg.is_mla:
        return cfg.num_attention_heads, cfg.qk_head_dim, cfg.v_head_dim
    return cfg.num_key_value_heads, cfg.head_dim, cfg.head_dim


def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """KV-cache bytes of one token (all layers)."""
    heads, dk, dv = cache_dims(cfg)
    return cfg.num_hidden_layers * heads * (dk + dv) * dtype.itemsize


def bytes_per_slot(cfg: ModelConfig, max_seq_len: int, dtype: torch.dtype) -> int:
    """KV-cache bytes of one sequence of ``max_seq_len`` tokens."""
    return bytes_per_token(cfg, dtype) * max_seq_len


class SlotKVCache:
    """Keys [layers, slots, heads, max_seq_len, key dim] and values [..., value dim]."""

    def __init__(self, cfg: ModelConfig, slots: int, max_seq_len: int, dtype: torch.dtype,
                 device: torch.device | str | None = None) -> None:
        heads, dk, dv = cache_dims(cfg)
        shape = (cfg.num_hidden_layers, slots, heads, max_seq_len)
        # zeros, not empty: masked positions get probability 0, and 0 * NaN garbage would be NaN
        self.k = torch.zeros((*shape, dk), dtype=dtype, device=device)
        self.v = torch.zeros((*shape, dv), dtype=dtype, device=device)

    def store_prefill(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Copy prefill keys/values k, v [len(slots), kv_heads, T, head_dim] into ``slots``."""
        t = k.shape[2]
        self.k[layer, slots, :, :t] = k
        self.v[layer, slots, :, :t] = v

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` to slot ``dst`` (all layers)."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]


class PrefillPass:
    """Attention for a right-padded prefill batch; keeps each layer's keys/values for the slots."""

    def __init__(self, mask: torch.Tensor, positions: torch.Tensor) -> None:
        self.masks, self.positions = {None: mask}, positions
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: int | None) -> torch.Tensor:
        self.k.append(k)
        self.v.append(v)
        if window not in self.masks:
            self.masks[window] = window_mask(self.masks[None], self.positions, window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.masks[window], scale=scale, enable_gqa=True)


class DecodePass:
    """One decode step for slots 0..n-1: writes each new key at its row's position, then attends
    to that row's positions [0, pos].

    Attention is two batched matmuls over a view of the cache with grouped-query heads folded
    into the query axis; for one query per row this beats the fused CPU kernel, which is built for
    long query blocks.
    """

    def __init__(self, cache: SlotKVCache, positions: torch.Tensor, width: int | None = None) -> None:
        n = positions.shape[0]
        self.cache, self.n = cache, n
        # a given width (≥ every position + 1) keeps shapes static for a captured CUDA graph
        self.width = int(positions.max()) + 1 if width is None else width
        self.positions, self.cols = positions, torch.arange(self.width, device=positions.device)
        self.hidden = {None: (self.cols[None] > positions[:, None])[:, None, None, :]}  # [n, 1, 1, W]
        kv_heads, max_len = cache.k.shape[2], cache.k.shape[3]
        rows = torch.arange(n * kv_heads, device=positions.device)
        # (slot, head, pos) in [S*KVH*L]; expand, not repeat_interleave, which may sync with the host
        self.flat = rows * max_len + positions[:, None].expand(n, kv_heads).reshape(-1)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: int | None) -> torch.Tensor:
        n, w = self.n, self.width
        heads, kv_heads, dk, dv = q.shape[1], k.shape[1], k.shape[3], v.shape[3]
        self.cache.k[layer].view(-1, dk).index_copy_(0, self.flat, k.reshape(-1, dk))
        self.cache.v[layer].view(-1, dv).index_copy_(0, self.flat, v.reshape(-1, dv))
        kc, vc = self.cache.k[layer, :n], self.cache.v[layer, :n]
        qg = q.reshape(n, kv_heads, heads // kv_heads, dk) * scale  # query heads sharing a key head
        scores = torch.matmul(qg, kc[:, :, :w].transpose(-1, -2))
        if window not in self.hidden:  # also hide keys that slid out of the window
            old = self.cols[None] <= self.positions[:, None] - window
            self.hidden[window] = self.hidden[None] | old[:, None, None, :]
        probs = torch.softmax(scores.masked_fill(self.hidden[window], float("-inf")), dim=-1)
        return torch.matmul(probs, vc[:, :, :w]).reshape(n, heads, 1, dv)
