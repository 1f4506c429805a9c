"""Attention over the paged KV cache in Triton, reading each sequence's blocks in place (attention "triton"): one
kernel for decode rows (``paged_decode``), one for prompt chunks (``paged_prefill``).

Contract of ``paged_decode`` (the same computation as ``PagedPass``'s torch path for decode rows, one query per
sequence, without its gather into a padded temporary):

- ``q`` [S, H, D]: one query per sequence; ``keys`` [KVH, rows, D] and ``values`` [KVH, rows, Dv]: one layer's pool
  (row ``block * block_size + offset`` is one token), last dimension contiguous, any row/head strides, so the
  values may be a view of the keys' first Dv dimensions (MLA's latent);
- ``table`` [S, B]: each sequence's block ids (integers; entries past its last block are never read);
- ``positions`` [S]: sequence s attends to its keys 0..positions[s] (its context is positions[s] + 1 tokens),
  the last ``window`` of them when ``window`` is given (a sliding window, as the torch path counts it);
- ``scale``: the softmax scale, applied to the query. Returns [S, H, Dv] in ``q``'s dtype.

Supported: GQA (H a multiple of KVH; the query heads of one key head are done together, so each key/value row is
read once per head group), any block size, ragged contexts, sliding windows, float32/float16/bfloat16 caches, key
and value dims up to 256. The softmax is online (running max and sum per query head) in float32, as is the
accumulator; float32 products run in IEEE precision (no TF32), so float32 results match the torch path to rounding.
Nothing here syncs with the host, so a CUDA graph can capture it. Not supported (``unsupported`` names the reason,
``paged_decode`` raises it): head dims over 256 (MLA's 576-wide latent), other dtypes, H not a multiple of KVH,
CPU tensors unless Triton's interpreter is on (``TRITON_INTERPRET=1`` before triton is imported, what the tests use).
Soft-capping and attention sinks are not features of the torch path, so there is nothing of theirs to match.

Contract of ``paged_prefill`` (the torch path's computation for a ``Ragged`` group of prompt chunks, without the
gather nor the float32 [queries, keys] scores): ``q`` [N, H, D] is the step's flat query axis; ``q_index`` [S, Q] and
``q_pos`` [S, Q] are the places in it and the positions of each chunk's queries (a padding query repeats a real one of
its chunk, as ``Ragged`` says); each query attends to its sequence's cached keys 0..its position (the chunk's own keys
included: the step writes them first), within ``window``; the output rows ``out[q_index]`` are written in place.
Query heads sharing a key head and several queries of a chunk fill one tile (``PREFILL_M`` rows), so each key/value
tile is read once per tile of queries. Supported and refused as ``paged_decode``.

This module imports triton: import it only where the "triton" attention was chosen.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

#: Widest key or value head the kernel tiles in one piece: past it the tiles outgrow a GPU's registers.
MAX_HEAD_DIM = 256
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Positions per step of the online softmax (spanning several cache blocks when they are small).
BLOCK_N = 32
#: The window passed for "no window": longer than any context, and within int32 for the kernel's arithmetic.
NO_WINDOW = 2**31 - 1
#: Most query heads one program holds; larger groups are split over programs.
MAX_BLOCK_G = 64


def interpreting() -> bool:
    """Whether Triton's CPU interpreter is on (it runs kernels on CPU tensors through numpy)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _online_tile(q, k_base, v_base, table, stride_tb, stride_kr, stride_vr, block_size, t, t_ok, seen, m, total, acc,
                 d, dv, D: tl.constexpr, DV: tl.constexpr, PRECISION: tl.constexpr):
    """One step of the online softmax over positions ``t`` (``t_ok``: within the pool's range to read; ``seen``:
    what each query row may attend to, broadcast to [rows, positions]): ``(m, total, acc)`` updated."""
    # each position's pool row through its sequence's block table: the blocks are read where they lie
    block = tl.load(table + (t // block_size) * stride_tb, mask=t_ok, other=0).to(tl.int64)
    row = block * block_size + t % block_size
    k = tl.load(k_base + row[:, None] * stride_kr + d[None, :], mask=t_ok[:, None] & (d[None, :] < D), other=0.0)
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [rows, BLOCK_N], float32
    scores = tl.where(seen, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    # a row that has seen no key yet keeps -inf: subtract 0 instead, so that its exps are 0, not NaN
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_use)
    p = tl.exp(scores - m_use[:, None])
    total = total * alpha + tl.sum(p, 1)
    v = tl.load(v_base + row[:, None] * stride_vr + dv[None, :], mask=t_ok[:, None] & (dv[None, :] < DV), other=0.0)
    # probabilities in the values' dtype, as the torch path casts its softmax before the second matmul
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, total, acc


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, table_ptr, pos_ptr, out_ptr,
                   stride_qs, stride_qh, stride_kh, stride_kr, stride_vh, stride_vr, stride_ts, stride_tb, stride_p,
                   stride_os, stride_oh, scale, window, block_size,
                   G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    g = tl.program_id(2) * BLOCK_G + tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    g_ok = g < G
    heads = h * G + g
    q = tl.load(q_ptr + s * stride_qs + heads[:, None] * stride_qh + d[None, :], mask=g_ok[:, None] & (d[None, :] < D),
                other=0.0)
    # scaled, then rounded to the cache's dtype before the product, as the torch path's matmul of q·scale does
    q = (q.to(tl.float32) * scale).to(k_ptr.dtype.element_ty)
    n = tl.load(pos_ptr + s * stride_p).to(tl.int32) + 1  # keys 0..n-1 are this sequence's context
    lo = tl.maximum(n - window, 0)  # no window: the caller passes one longer than any context
    k_base = k_ptr + h * stride_kh
    v_base = v_ptr + h * stride_vh
    table = table_ptr + s * stride_ts
    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_DV), tl.float32)
    for start in range(lo, n, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        t_ok = t < n
        # every step holds at least one visible position (start < n), so the maxima are finite
        m, total, acc = _online_tile(q, k_base, v_base, table, stride_tb, stride_kr, stride_vr, block_size, t, t_ok,
                                     t_ok[None, :], m, total, acc, d, dv, D, DV, PRECISION)
    out = acc / total[:, None]
    tl.store(out_ptr + s * stride_os + heads[:, None] * stride_oh + dv[None, :], out.to(out_ptr.dtype.element_ty),
             mask=g_ok[:, None] & (dv[None, :] < DV))


def unsupported(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> str | None:
    """Why the kernel cannot compute this decode step (one line), or None when it can."""
    heads, kv_heads = q.shape[1], keys.shape[0]
    if q.device.type != "cuda" and not interpreting():
        return f"the triton decode kernel needs a CUDA device (or TRITON_INTERPRET=1), got {q.device}"
    if keys.dtype not in DTYPES or values.dtype != keys.dtype:
        return f"the triton decode kernel supports float32/float16/bfloat16 caches, got {keys.dtype}/{values.dtype}"
    if heads % kv_heads:
        return f"the triton decode kernel needs query heads ({heads}) to be a multiple of key heads ({kv_heads})"
    if max(q.shape[-1], values.shape[-1]) > MAX_HEAD_DIM:
        return (f"the triton decode kernel supports head dims up to {MAX_HEAD_DIM}, got keys {q.shape[-1]}, values "
                f"{values.shape[-1]} (e.g. MLA's latent)")
    if keys.stride(-1) != 1 or values.stride(-1) != 1:
        return "the triton decode kernel needs the pool's last dimension contiguous"
    return None


def _checked(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, window: int | None) -> dict:
    """Raise ValueError where ``unsupported`` refuses or the window is empty; else the launch arguments both kernels
    share: the key/value dims' tiles (``tl.dot`` wants every tile side at least 16; padding is masked off) and the
    products' precision (IEEE float32, not TF32's 10-bit mantissas; half inputs take the target's default)."""
    reason = unsupported(q, keys, values)
    if reason is not None:
        raise ValueError(reason)
    if window is not None and window < 1:
        raise ValueError(f"a sliding window must hold at least one key, got {window}")
    dim, dv = q.shape[-1], values.shape[-1]
    return dict(D=dim, DV=dv, BLOCK_D=max(16, triton.next_power_of_2(dim)),
                BLOCK_DV=max(16, triton.next_power_of_2(dv)), PRECISION="ieee" if keys.dtype == torch.float32 else None)


def paged_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, table: torch.Tensor,
                 positions: torch.Tensor, block_size: int, scale: float, window: int | None,
                 block_n: int = BLOCK_N) -> torch.Tensor:
    """Attention [S, H, Dv] of one query per sequence over one layer's pool, read in place (see the module's
    docstring); raises ValueError naming the feature when ``unsupported`` says the kernel cannot."""
    tiles = _checked(q, keys, values, window)
    s, heads, _ = q.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    q = q.contiguous() if q.stride(-1) != 1 else q
    out = q.new_empty(s, heads, tiles["DV"])
    if s == 0:
        return out
    # tl.dot wants every tile side at least 16; padded query heads and dims are masked off
    block_g = min(max(16, triton.next_power_of_2(group)), MAX_BLOCK_G)
    grid = (s, kv_heads, triton.cdiv(group, block_g))
    _decode_kernel[grid](
        q, keys, values, table, positions, out,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1), table.stride(0),
        table.stride(1), positions.stride(0), out.stride(0), out.stride(1),
        float(scale), int(window or NO_WINDOW), int(block_size),
        G=group, BLOCK_G=block_g, BLOCK_N=max(16, block_n), **tiles)
    return out


#: Query rows (queries × the query heads of one key head) of one program of the prefill kernel.
PREFILL_M = 64


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, table_ptr, index_ptr, pos_ptr, out_ptr,
                    stride_qn, stride_qh, stride_kh, stride_kr, stride_vh, stride_vr, stride_ts, stride_tb,
                    stride_is, stride_iq, stride_ps, stride_pq, stride_on, stride_oh,
                    n_queries, splits, scale, window, block_size,
                    G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_G: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    qb = tl.program_id(2) // splits
    m = tl.arange(0, BLOCK_Q * BLOCK_G)
    qi = qb * BLOCK_Q + m // BLOCK_G  # row m of the tile: query qi, head g of this key head's group
    g = (tl.program_id(2) % splits) * BLOCK_G + m % BLOCK_G
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q_ok = qi < n_queries
    ok = q_ok & (g < G)
    idx = tl.load(index_ptr + s * stride_is + qi * stride_iq, mask=q_ok, other=0).to(tl.int64)
    pos = tl.load(pos_ptr + s * stride_ps + qi * stride_pq, mask=q_ok, other=-1).to(tl.int32)
    heads = h * G + g
    q = tl.load(q_ptr + idx[:, None] * stride_qn + heads[:, None] * stride_qh + d[None, :],
                mask=ok[:, None] & (d[None, :] < D), other=0.0)
    q = (q.to(tl.float32) * scale).to(k_ptr.dtype.element_ty)  # as paged_decode: rounded as the torch path's
    # the tile's keys: from the earliest any of its queries sees to the last one any sees
    hi = tl.max(tl.where(ok, pos, -1), 0) + 1
    lo = tl.maximum(tl.min(tl.where(ok, pos, NO_WINDOW), 0) - window + 1, 0)
    k_base = k_ptr + h * stride_kh
    v_base = v_ptr + h * stride_vh
    table = table_ptr + s * stride_ts
    mx = tl.full((BLOCK_Q * BLOCK_G,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_Q * BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_Q * BLOCK_G, BLOCK_DV), tl.float32)
    for start in range(lo, hi, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        t_ok = t < hi
        # each query row sees its own causal span (and window): rows of one tile differ in position
        seen = t_ok[None, :] & (t[None, :] <= pos[:, None]) & (t[None, :] > pos[:, None] - window)
        mx, total, acc = _online_tile(q, k_base, v_base, table, stride_tb, stride_kr, stride_vr, block_size, t, t_ok,
                                      seen, mx, total, acc, d, dv, D, DV, PRECISION)
    out = acc / tl.where(total > 0, total, 1.0)[:, None]  # rows of no query (masked off below) saw nothing
    tl.store(out_ptr + idx[:, None] * stride_on + heads[:, None] * stride_oh + dv[None, :],
             out.to(out_ptr.dtype.element_ty), mask=ok[:, None] & (dv[None, :] < DV))


def paged_prefill(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_index: torch.Tensor,
                  q_pos: torch.Tensor, table: torch.Tensor, block_size: int, scale: float, window: int | None,
                  out: torch.Tensor, block_n: int = BLOCK_N) -> torch.Tensor:
    """Attention of a group of prompt chunks written into ``out`` [N, H, Dv] at rows ``q_index`` (see the module's
    docstring); returns ``out``. Raises ValueError as ``paged_decode`` does."""
    tiles = _checked(q, keys, values, window)
    s, n_queries = q_pos.shape
    heads, kv_heads = q.shape[1], keys.shape[0]
    group = heads // kv_heads
    if s == 0 or n_queries == 0:
        return out
    q = q.contiguous() if q.stride(-1) != 1 else q
    block_g = min(triton.next_power_of_2(group), MAX_BLOCK_G)
    block_q = max(PREFILL_M // block_g, 1)
    splits = triton.cdiv(group, block_g)
    grid = (s, kv_heads, triton.cdiv(n_queries, block_q) * splits)
    _prefill_kernel[grid](
        q, keys, values, table, q_index, q_pos, out,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1), table.stride(0),
        table.stride(1), q_index.stride(0), q_index.stride(1), q_pos.stride(0), q_pos.stride(1), out.stride(0),
        out.stride(1), n_queries, splits, float(scale), int(window or NO_WINDOW), int(block_size),
        G=group, BLOCK_Q=block_q, BLOCK_G=block_g, BLOCK_N=max(16, block_n), **tiles)
    return out
