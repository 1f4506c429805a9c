"""The inference engine's paged KV cache and the attention that reads it.

Keys and values of every layer live in one pool of fixed-size blocks (``engines.inference.blocks`` decides who
holds which block); row ``block * block_size + offset`` of a layer's pool is one token. A step of the
engine runs one forward over a flat batch of tokens: one query per decoding sequence, plus chunks of
prompts being prefilled. ``PagedPass`` is the ``AttentionCache`` of that forward: it writes the new
tokens' keys/values into their rows, then lets each query attend to its own sequence's rows, found
through its block table, up to its own position (and within a sliding window where the layer has one).
Multi-head latent attention (DeepSeek-V3, Kimi K2) caches only its compressed latent and rotary key per
token, one "head" whose first ``kv_lora_rank`` dimensions double as the values.

Four ways to attend, same results up to rounding: ``torch`` gathers each sequence's rows and runs two matmuls
(every device; the reference), ``flex`` runs PyTorch's flex_attention over the whole pool with a block mask
built from the block tables, so a query reads only its own blocks and nothing is gathered (the GPU
path, compiled there; eager elsewhere, which the tests use to check it against ``torch``), ``paged`` (CPU)
runs decode queries through a C++ kernel that reads each sequence's blocks in place
(``engines.inference.cpu_kernel``), prompt chunks as ``torch`` does, and ``triton`` (CUDA, opt-in only) runs both
decode queries and prompt chunks through Triton kernels that read the blocks in place with an online softmax
(``engines.inference.triton_attention``, imported only when chosen); a layer those kernels cannot compute (e.g.
MLA's 576-wide latent) goes the torch way after one warning.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import warnings
from dataclasses import dataclass

import torch

from engines.inference import cpu_kernel
from engines.inference.uploads import upload_rows
from engines.model.native.arch import ModelConfig

log = logging.getLogger(__name__)

#: Tokens per block.
BLOCK_SIZE = 16
#: The ways to attend over the pool (see the module's docstring).
BACKENDS = ("torch", "flex", "paged", "triton")


def decode_attention(attention: str | None, device: torch.device | str) -> str:
    """The backend a native engine on ``device`` attends with for ``attention`` ("auto"/None picks): "paged"
    needs a CPU and its kernel; where the kernel cannot be built it falls back to "torch" (one warning, at the
    build)."""
    device = torch.device(device)
    if attention not in (None, "auto", *BACKENDS):
        raise ValueError(f"attention must be auto, {', '.join(BACKENDS)}; got {attention!r}")
    if attention == "paged" and device.type != "cpu":
        raise ValueError(f"attention 'paged' is the CPU decode kernel; on {device} use torch or flex")
    if attention == "triton":
        # never picked by auto; on a CPU only under Triton's interpreter (the tests')
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise ValueError(f"attention 'triton' is the CUDA decode kernel; on {device} use torch, flex or paged")
        if importlib.util.find_spec("triton") is None:
            raise ValueError("attention 'triton' needs the triton package, which is not installed")
    if attention in (None, "auto", "paged"):
        return "paged" if device.type == "cpu" and cpu_kernel.available() else "torch"
    return attention


def decode_reads_in_place(backend: str, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether ``backend``'s decode attention over this model reads each row's keys up to its own position only,
    whatever the width it is given: the triton kernel, where it can attend over the model's layers."""
    if backend != "triton":
        # torch gathers (and masks) every key of the width, flex sizes its block mask by it; "paged" never graphs
        return False
    from engines.inference import triton_attention  # triton is importable: decode_attention checked it

    heads, dk, dv = cache_dims(cfg)
    # empty stand-ins of one layer's query, keys and values: the kernel's checks read only shapes, dtypes, devices
    q = torch.empty(0, cfg.num_attention_heads, dk, dtype=dtype, device=device)
    keys = torch.empty(heads, 0, dk, dtype=dtype, device=device)
    values = torch.empty(heads, 0, dv if dv is not None else cfg.kv_lora_rank, dtype=dtype, device=device)
    return triton_attention.unsupported(q, keys, values) is None


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


def gather_bytes(cfg: ModelConfig, rows: int, width: int, dtype: torch.dtype) -> int:
    """Temporary bytes of the torch path's decode step over ``rows`` sequences whose keys span ``width``
    positions: one layer's gathered keys and values (the next layer reuses them) and its float32 scores and
    probabilities. A captured graph keeps them in its pool, the CPU path in its scratch buffers."""
    heads, dk, dv = cache_dims(cfg)
    gathered = rows * width * heads * (dk + (dv or 0)) * dtype.itemsize
    return gathered + 2 * rows * cfg.num_attention_heads * width * 4


def paged_pool(cfg: ModelConfig, budget_bytes: int, dtype: torch.dtype, block_size: int = BLOCK_SIZE
               ) -> tuple[int, int]:
    """(blocks, bytes) of the paged pool a budget of ``budget_bytes`` buys: as many whole blocks as fit."""
    per_block = bytes_per_token(cfg, dtype) * block_size
    blocks = budget_bytes // per_block
    return blocks, blocks * per_block


class PagedKVCache:
    """The block pool: keys [layers, heads, blocks·block_size, key dim], values likewise (or none)."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str | None = None, storage: torch.Tensor | None = None) -> None:
        """``storage``: zeroed bytes (at least the pool's, as ``paged_pool`` counts them) to lay the pool in,
        e.g. an arena's, whose addresses survive the engine's sleep; by default the pool is allocated."""
        heads, dk, dv = cache_dims(cfg)
        rows = num_blocks * block_size
        self.block_size, self.num_blocks = block_size, num_blocks
        shapes = [(cfg.num_hidden_layers, heads, rows, d) for d in (dk, dv) if d is not None]
        if storage is None:
            # zeros, not empty: a masked key gets probability 0, and 0 * NaN garbage would be NaN
            pools = [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
        else:
            sizes = [math.prod(shape) * dtype.itemsize for shape in shapes]
            if sum(sizes) > storage.numel():
                raise ValueError(f"KV storage of {storage.numel()} bytes is smaller than the pool ({sum(sizes)})")
            pools = [b.view(dtype).view(shape) for b, shape in zip(storage[: sum(sizes)].split(sizes), shapes,
                                                                   strict=True)]
        self.k, self.v = pools[0], (pools[1] if dv is not None else None)
        self.value_dim = dv if dv is not None else cfg.kv_lora_rank
        self._scratch: dict[str, torch.Tensor] = {}

    def scratch(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """A reusable host buffer of ``shape`` for the gathered keys or values (``name``), or None on a device.

        On a CPU a fresh multi-megabyte tensor per layer and step comes from ``mmap`` and faults its pages in
        one by one, which took ~60 % of a gather's time; a buffer kept across steps does not. On a GPU the
        caching allocator already reuses memory (and a captured graph takes its own from its pool)."""
        if self.k.device.type != "cpu":
            return None
        n = math.prod(shape)
        buf = self._scratch.get(name)
        if buf is None or buf.numel() < n:
            buf = self._scratch[name] = torch.empty(n, dtype=self.k.dtype)
        return buf[:n].view(shape)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy block ``src`` to block ``dst`` in every layer (copy-on-write of a shared block)."""
        if not pairs:
            return
        bs = self.block_size
        src, dst = upload_rows([[s * bs + i for s, _ in pairs for i in range(bs)],
                                [d * bs + i for _, d in pairs for i in range(bs)]], [], self.k.device)
        for t in (self.k, self.v):
            if t is not None:
                t[:, :, dst] = t[:, :, src]


def rows_of(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Pool rows of ``positions`` [..., P] of sequences whose block tables are ``block_table`` [..., B]."""
    return block_table.gather(-1, positions // block_size) * block_size + positions % block_size


@dataclass
class Ragged:
    """Queries of several sequences, padded to one batch, each attending to its own cached keys.

    ``q_index`` [S, Q]: the queries' places in the flat token axis; ``q_pos`` [S, Q]: their positions in
    their sequence; ``table`` [S, B]: each sequence's block table (unused entries any valid block);
    ``width``: keys 0..width-1 cover every query's sequence. A padding query repeats a real query of its
    sequence in both ``q_index`` and ``q_pos``: it computes that query's output again, bit for bit, and
    writing it to the same place changes nothing (so no mask of the real ones is needed)."""

    q_index: torch.Tensor
    q_pos: torch.Tensor
    table: torch.Tensor
    width: int
    leading: bool = False  # one query per sequence, at the first S places of the flat token axis

    @classmethod
    def decode(cls, block_table: torch.Tensor, positions: torch.Tensor, width: int) -> Ragged:
        """One query per sequence at ``positions`` [n] (device ops only: a CUDA graph can capture it)."""
        q_index = torch.arange(positions.shape[0], device=positions.device)[:, None]
        return cls(q_index, positions[:, None], block_table, width, leading=True)


class PagedPass:
    """``AttentionCache`` of one engine step: ``write_rows`` [N] are the pool rows of the step's N new
    tokens; ``groups`` are the queries (decode rows, prefill chunks) and the keys each may see;
    ``backend`` is "torch", "flex", "paged" or "triton" (see the module's docstring)."""

    def __init__(self, cache: PagedKVCache, write_rows: torch.Tensor, groups: list[Ragged],
                 backend: str = "torch") -> None:
        if backend not in BACKENDS:
            raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self.cache, self.write_rows, self.groups, self.backend = cache, write_rows, groups, backend
        self._memo: dict[tuple, object] = {}  # per group: masks or block masks, shared by every layer

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, scale: float,
               window: int | None) -> torch.Tensor:
        """Store k, v [1, heads, N, d] of the new tokens, then attention [1, H, N, Dv] of q [1, H, N, D].
        ``v`` None: the values are the first dimensions of the keys (MLA's latent)."""
        c = self.cache
        kc = c.k[layer]
        k, v = k[0].to(kc.dtype), None if v is None else v[0].to(kc.dtype)  # [KVH, N, D]
        # the CPU kernel writes the decode rows' keys/values itself, next to its reads of their last blocks
        fused = self.backend == "paged" and self.groups[0].leading
        first = self.groups[0].q_pos.shape[0] if fused else 0
        if first < self.write_rows.shape[0]:
            kc.index_copy_(1, self.write_rows[first:], k[:, first:])
            if v is not None:
                c.v[layer].index_copy_(1, self.write_rows[first:], v[:, first:])
        qf = q[0].transpose(0, 1)  # [N, H, D]
        out = qf.new_empty(qf.shape[0], qf.shape[1], c.value_dim)
        attend = self._flex if self.backend == "flex" else self._torch  # paged: prompt chunks go the torch way
        for i, g in enumerate(self.groups):
            if g.leading:  # decode rows: their queries and outputs are the first S rows, no index needed
                s = g.q_pos.shape[0]
                if self.backend == "paged":
                    out[:s] = cpu_kernel.paged_decode(
                        qf[:s], kc, self._values(layer), g.table, g.q_pos[:, 0], c.block_size, scale, window,
                        k[:, :s].transpose(0, 1), None if v is None else v[:, :s].transpose(0, 1))
                elif self.backend == "triton" and (kernel := _triton_kernels(qf, kc, self._values(layer))):
                    out[:s] = kernel.paged_decode(qf[:s], kc, self._values(layer), g.table, g.q_pos[:, 0],
                                                  c.block_size, scale, window)
                else:
                    out[:s] = attend(i, g, layer, qf[:s, None], scale, window)[:, 0]
                continue
            if self.backend == "triton" and (kernel := _triton_kernels(qf, kc, self._values(layer))):
                # prompt chunks read in place too, written straight to their rows of the output
                kernel.paged_prefill(qf, kc, self._values(layer), g.q_index, g.q_pos, g.table, c.block_size, scale,
                                     window, out)
                continue
            res = attend(i, g, layer, qf[g.q_index], scale, window)  # [S, Q, H, Dv]
            # unmasked: a padding query wrote its real twin's values to its twin's place (see Ragged), and a
            # boolean mask would make the host wait on a nonzero, which a captured decode step cannot do
            out.index_copy_(0, g.q_index.flatten(), res.flatten(0, 1))
        return out.transpose(0, 1)[None]

    def _values(self, layer: int) -> torch.Tensor:
        c = self.cache
        return c.k[layer][..., : c.value_dim] if c.v is None else c.v[layer]

    def _torch(self, i: int, g: Ragged, layer: int, q: torch.Tensor, scale: float,
               window: int | None) -> torch.Tensor:
        """Gather each sequence's keys/values by its block table, then two matmuls."""
        c = self.cache
        nq, heads, kv_heads = q.shape[1], q.shape[2], c.k.shape[1]
        group = heads // kv_heads
        blocks = g.table[:, : -(-g.width // c.block_size)]  # [S, B]: the blocks holding keys 0..width-1
        s, width = blocks.shape[0], blocks.shape[1] * c.block_size
        flat = blocks.reshape(-1)
        # whole blocks gathered as [KVH, S, B·block, D]: contiguous runs to copy, and contiguous for the
        # matmuls below; keys past each query's position are masked
        keys = _gather_blocks(c.k[layer], flat, c.block_size, c.scratch("k", (kv_heads, s * width, c.k.shape[-1])))
        keys = keys.view(kv_heads, s, width, -1)
        values = keys[..., : c.value_dim] if c.v is None else _gather_blocks(
            c.v[layer], flat, c.block_size, c.scratch("v", (kv_heads, s * width, c.v.shape[-1]))
        ).view(kv_heads, s, width, -1)
        # query heads sharing a key head side by side: [KVH, S, Q·G, D]
        qg = q.unflatten(2, (kv_heads, group)).permute(2, 0, 1, 3, 4).flatten(2, 3)
        scores = torch.matmul(qg * scale, keys.transpose(-1, -2))
        scores = scores.masked_fill(self._hidden(i, g, window, group), float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
        out = torch.matmul(probs, values)  # [KVH, S, Q·G, Dv]
        return out.unflatten(2, (nq, group)).permute(1, 2, 0, 3, 4).flatten(2, 3)

    def _hidden(self, i: int, g: Ragged, window: int | None, group: int) -> torch.Tensor:
        """[S, Q·G, K] True where a key lies beyond its query's position (or out of its window); K is the
        width rounded up to whole blocks."""
        key = ("hidden", i, window, group)
        if key not in self._memo:
            bs = self.cache.block_size
            kpos = torch.arange(-(-g.width // bs) * bs, device=g.q_pos.device)
            hide = kpos[None, None] > g.q_pos[..., None]  # [S, Q, K]
            if window is not None:
                hide |= kpos[None, None] <= g.q_pos[..., None] - window
            self._memo[key] = hide.repeat_interleave(group, dim=1)
        return self._memo[key]

    def _flex(self, i: int, g: Ragged, layer: int, q: torch.Tensor, scale: float,
              window: int | None) -> torch.Tensor:
        """flex_attention of the group's queries over the whole pool, through a block mask of their blocks."""
        c = self.cache
        s = q.shape[0]
        key = ("block_mask", i, window)
        if key not in self._memo:
            self._memo[key] = _paged_block_mask(g, c.num_blocks, c.block_size, window)
        keys = c.k[layer][None].expand(s, -1, -1, -1)
        values = self._values(layer)[None].expand(s, -1, -1, -1)
        out = _flex_attention(q.transpose(1, 2), keys, values, block_mask=self._memo[key], scale=scale,
                              enable_gqa=True)
        return out.transpose(1, 2)  # [S, Q, H, Dv]


_TRITON_REFUSED: set[str] = set()


def _triton_kernels(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
    """The Triton attention module when its kernels can attend over this layer, else None (the torch path then
    computes the same attention), saying why once per reason."""
    from engines.inference import triton_attention  # imports triton: only where the "triton" attention was chosen

    reason = triton_attention.unsupported(q, keys, values)
    if reason is None:
        return triton_attention
    if reason not in _TRITON_REFUSED:
        _TRITON_REFUSED.add(reason)
        log.warning("%s; those steps gather each sequence's blocks instead", reason)
    return None


def _gather_blocks(pool: torch.Tensor, blocks: torch.Tensor, block_size: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of ``blocks`` (whole blocks, in order) of one layer's pool [heads, rows, D]: [heads, n·block, D]
    (written into ``out`` of that shape when given)."""
    h, rows, d = pool.shape
    src = pool.view(h, rows // block_size, block_size * d)
    if out is None:
        return src.index_select(1, blocks).view(h, -1, d)
    torch.index_select(src, 1, blocks, out=out.view(h, blocks.numel(), block_size * d))
    return out


def _paged_block_mask(g: Ragged, num_blocks: int, block_size: int, window: int | None):
    """A flex_attention block mask over the pool's rows: query (s, q) may read physical row r when r's block
    is block j of sequence s's table and j·block_size + offset ≤ its position (and within its window)."""
    from torch.nn.attention.flex_attention import BlockMask

    s, nq = g.q_pos.shape
    used = -(-g.width // block_size)
    table = g.table[:, :used]
    cols = torch.arange(used, device=table.device)
    last = g.q_pos.max(dim=1).values // block_size  # the last block each sequence reads
    logical = torch.where(cols[None] <= last[:, None], cols[None], -1).expand(s, used)
    # physical block -> its index in the sequence's table (-1: not the sequence's)
    to_logical = torch.full((s, num_blocks), -1, dtype=torch.long, device=table.device)
    to_logical.scatter_reduce_(1, table, logical, reduce="amax")
    q_pos = g.q_pos

    def mask_mod(b, h, q_idx, kv_idx):
        j = to_logical[b, kv_idx // block_size]
        pos = j * block_size + kv_idx % block_size
        ok = (j >= 0) & (pos <= q_pos[b, q_idx])
        if window is not None:
            ok &= pos > q_pos[b, q_idx] - window
        return ok

    q_blocks = -(-nq // 128)
    kv_num = (last + 1).to(torch.int32)[:, None, None].expand(s, 1, q_blocks).contiguous()
    # as wide as the pool: the indices are physical blocks, and flex sizes its dense view by this width
    kv_indices = torch.zeros(s, 1, q_blocks, num_blocks, dtype=torch.int32, device=table.device)
    kv_indices[..., :used] = table.to(torch.int32)[:, None, None, :]
    return BlockMask.from_kv_blocks(kv_num, kv_indices, BLOCK_SIZE=(128, block_size), mask_mod=mask_mod,
                                    seq_lengths=(nq, num_blocks * block_size))


_COMPILED = {}


def _flex_attention(q, k, v, **kw):
    """flex_attention, compiled on an accelerator; eager (the reference implementation) on CPU."""
    from torch.nn.attention.flex_attention import flex_attention

    if q.device.type == "cpu":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # eager flex warns that it is not fused: known, used to test the path
            return flex_attention(q, k, v, **kw)
    if "fn" not in _COMPILED:
        _COMPILED["fn"] = torch.compile(flex_attention, dynamic=True)
    return _COMPILED["fn"](q, k, v, **kw)
