"""The inference engine's paged KV cache and the attention that reads it.

Keys and values of every layer live in one pool of fixed-size blocks (``engines.blocks`` decides who
holds which block); row ``block * block_size + offset`` of a layer's pool is one token. A step of the
engine runs one forward over a flat batch of tokens: one query per decoding sequence, plus chunks of
prompts being prefilled. ``PagedPass`` is the ``AttentionCache`` of that forward: it writes the new
tokens' keys/values into their rows, then lets each query attend to its own sequence's rows, gathered
through the block table, up to its own position (and within a sliding window where the layer has
one). Multi-head latent attention (DeepSeek-V3, Kimi K2) caches only its compressed latent and rotary
key per token, one "head" whose first ``kv_lora_rank`` dimensions double as the values.

This is the pure-torch path; it runs on every device and is the reference for faster kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engines.arch import ModelConfig

#: Tokens per block.
BLOCK_SIZE = 16


def cache_dims(cfg: ModelConfig) -> tuple[int, int, int | None]:
    """(heads, key dim, value dim) cached per token and layer; value dim None when the values are the
    first dimensions of the keys (MLA's latent: kv_lora_rank + rope dims, values = the latent part)."""
    if cfg.is_mla:
        return 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim, None
    return cfg.num_key_value_heads, cfg.head_dim, cfg.head_dim


def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """KV-cache bytes of one token (all layers)."""
    heads, dk, dv = cache_dims(cfg)
    return cfg.num_hidden_layers * heads * (dk + (dv or 0)) * dtype.itemsize


def bytes_per_slot(cfg: ModelConfig, max_seq_len: int, dtype: torch.dtype) -> int:
    """KV-cache bytes of one sequence of ``max_seq_len`` tokens (what a slot cache reserves per sequence)."""
    return bytes_per_token(cfg, dtype) * max_seq_len


class PagedKVCache:
    """The block pool: keys [layers, blocks·block_size, heads, key dim], values likewise (or none)."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str | None = None) -> None:
        heads, dk, dv = cache_dims(cfg)
        rows = num_blocks * block_size
        self.block_size, self.num_blocks = block_size, num_blocks
        # zeros, not empty: a masked key gets probability 0, and 0 * NaN garbage would be NaN
        self.k = torch.zeros((cfg.num_hidden_layers, rows, heads, dk), dtype=dtype, device=device)
        self.v = None if dv is None else torch.zeros((cfg.num_hidden_layers, rows, heads, dv), dtype=dtype,
                                                     device=device)
        self.value_dim = dv if dv is not None else cfg.kv_lora_rank

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy block ``src`` to block ``dst`` in every layer (copy-on-write of a shared block)."""
        if not pairs:
            return
        bs = self.block_size
        src = torch.tensor([s * bs + i for s, _ in pairs for i in range(bs)], device=self.k.device)
        dst = torch.tensor([d * bs + i for _, d in pairs for i in range(bs)], device=self.k.device)
        for t in (self.k, self.v):
            if t is not None:
                t[:, dst] = t[:, src]


def rows_of(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Pool rows of ``positions`` [..., P] of sequences whose block tables are ``block_table`` [..., B]."""
    return block_table.gather(-1, positions // block_size) * block_size + positions % block_size


@dataclass
class Ragged:
    """Queries of several sequences, padded to one batch, each attending to its own cached keys.

    ``q_index`` [S, Q]: the queries' places in the flat token axis; ``q_pos`` [S, Q]: their positions in
    their sequence (padding repeats a real one); ``key_rows`` [S, K]: the pool rows of key positions
    0..K-1 of each sequence; ``valid`` [S, Q]: which queries are real."""

    q_index: torch.Tensor
    q_pos: torch.Tensor
    key_rows: torch.Tensor
    valid: torch.Tensor

    @classmethod
    def decode(cls, block_table: torch.Tensor, positions: torch.Tensor, width: int, block_size: int) -> Ragged:
        """One query per sequence at ``positions`` [n], keys 0..width-1 (device ops only: a CUDA graph
        can capture it)."""
        n = positions.shape[0]
        cols = torch.arange(width, device=positions.device)
        keys = rows_of(block_table[:, : -(-width // block_size)], cols.expand(n, width), block_size)
        q_index = torch.arange(n, device=positions.device)[:, None]
        return cls(q_index, positions[:, None], keys, torch.ones(n, 1, dtype=torch.bool, device=positions.device))


class PagedPass:
    """``AttentionCache`` of one engine step: ``write_rows`` [N] are the pool rows of the step's N new
    tokens; ``groups`` are the queries (decode rows, prefill chunks) and the keys each may see."""

    def __init__(self, cache: PagedKVCache, write_rows: torch.Tensor, groups: list[Ragged]) -> None:
        self.cache, self.write_rows, self.groups = cache, write_rows, groups
        self._masks: dict[tuple[int, int | None], torch.Tensor] = {}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, scale: float,
               window: int | None) -> torch.Tensor:
        """Store k, v [1, heads, N, d] of the new tokens, then attention [1, H, N, Dv] of q [1, H, N, D].
        ``v`` None: the values are the first dimensions of the keys (MLA's latent)."""
        c = self.cache
        kc = c.k[layer]
        kc.index_copy_(0, self.write_rows, k[0].transpose(0, 1).to(kc.dtype))
        if v is not None:
            c.v[layer].index_copy_(0, self.write_rows, v[0].transpose(0, 1).to(kc.dtype))
        qf = q[0].transpose(0, 1)  # [N, H, D]
        out = qf.new_empty(qf.shape[0], qf.shape[1], c.value_dim)
        for i, g in enumerate(self.groups):
            res = self._attend_group(i, g, layer, qf, scale, window)
            out.index_copy_(0, g.q_index[g.valid], res[g.valid])
        return out.transpose(0, 1)[None]

    def _attend_group(self, i: int, g: Ragged, layer: int, qf: torch.Tensor, scale: float,
                      window: int | None) -> torch.Tensor:
        c = self.cache
        nq = g.q_index.shape[1]
        heads, kv_heads = qf.shape[1], c.k.shape[2]
        keys = c.k[layer][g.key_rows]  # [S, K, KVH, Dk]
        values = keys[..., : c.value_dim] if c.v is None else c.v[layer][g.key_rows]
        # query heads sharing a key head side by side: [S, KVH, Q·G, D]
        q = qf[g.q_index].unflatten(2, (kv_heads, heads // kv_heads)).permute(0, 2, 1, 3, 4).flatten(2, 3)
        scores = torch.matmul(q * scale, keys.permute(0, 2, 3, 1))
        scores = scores.masked_fill(self._hidden(i, g, window, heads // kv_heads), float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
        out = torch.matmul(probs, values.transpose(1, 2))  # [S, KVH, Q·G, Dv]
        return out.unflatten(2, (nq, heads // kv_heads)).permute(0, 2, 1, 3, 4).flatten(2, 3)  # [S, Q, H, Dv]

    def _hidden(self, i: int, g: Ragged, window: int | None, group: int) -> torch.Tensor:
        """[S, 1, Q·G, K] True where a key lies beyond its query's position (or out of its window)."""
        key = (i, window, group)
        if key not in self._masks:
            kpos = torch.arange(g.key_rows.shape[1], device=g.key_rows.device)
            hide = kpos[None, None] > g.q_pos[..., None]  # [S, Q, K]
            if window is not None:
                hide |= kpos[None, None] <= g.q_pos[..., None] - window
            self._masks[key] = hide.repeat_interleave(group, dim=1)[:, None]
        return self._masks[key]
