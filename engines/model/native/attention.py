"""Attention of every family: grouped-query attention (Llama, Qwen, Mistral, Mixtral) and DeepSeek's
multi-head latent attention (MLA), with per-head max-logit tracking and QK-Clip's weight scaling.

Each attention module knows which rows of its weights belong to a head, so QK-Clip (``engines.training.qk_clip``)
asks the module to scale its own heads (``clip_heads``); each also says how its fused inference
layout holds the checkpoint's tensors (``hub_placements``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engines.model.native.arch import ModelConfig
from engines.model.native.document_mask import FLEX_BLOCK, DocumentMask
from engines.model.native.layers import RMSNorm
from engines.model.native.rope import apply_rope, apply_rope_interleaved
from engines.model.sharded import local_rows


class AttentionCache(Protocol):
    """Where an inference engine keeps keys/values: it stores this call's k/v and attends."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, scale: float,
               window: int | None) -> torch.Tensor:
        """Attention output [B, H, T, Dv] for queries q [B, H, T, D] and the new k [B, KVH, T, D],
        v [B, KVH, T, Dv] (None: the values are the keys' first Dv dimensions, MLA's latent);
        ``window``: keys older than that many positions are hidden."""
        ...


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


def window_mask(mask: torch.Tensor, positions: torch.Tensor, window: int) -> torch.Tensor:
    """``mask`` [B, 1, T, T] further limited to keys less than ``window`` positions behind the query."""
    near = positions[:, :, None] - positions[:, None, :] < window
    return mask & near[:, None]


#: Elements of one block of logits in ``head_max_logits``, to bound its memory on long sequences.
_LOGIT_BLOCK = 1 << 24


@torch.no_grad()
def head_max_logits(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float,
                    query_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Per query head max of scale·q·kᵀ [H] (float32) for q [B, H, T, D], k [B, KVH, S, D], over the pairs
    ``mask`` allows whose query is valid.

    Query head h reads kv head h // (H / KVH), as SDPA's ``enable_gqa``. ``mask`` as SDPA's
    ``attn_mask`` (boolean True = attend, or additive float with -inf = masked); None allows every pair.
    ``query_valid`` [B, T] leaves out the rows of padding or filler queries (None: every row counts).
    """
    b, h, t, _ = q.shape
    kvh, s = k.shape[1], k.shape[2]
    g = h // kvh
    # group the query heads of each kv head so the shared keys are never repeated
    qg = q.float().unflatten(1, (kvh, g))
    kt = k.float().transpose(-1, -2)[:, :, None]
    if mask is not None:
        allowed = mask if mask.dtype == torch.bool else mask > float("-inf")
        allowed = allowed.expand(b, h, t, s).unflatten(1, (kvh, g))
    rows = torch.empty((b, kvh, g, t), device=q.device)
    step = max(1, _LOGIT_BLOCK // max(1, b * h * s))
    for i in range(0, t, step):
        logits = torch.matmul(qg[:, :, :, i:i + step], kt) * scale
        if mask is not None:
            logits.masked_fill_(~allowed[:, :, :, i:i + step], float("-inf"))
        rows[..., i:i + step] = logits.amax(dim=-1)
    return heads_over_valid(rows.flatten(1, 2), query_valid)


def heads_over_valid(row_max: torch.Tensor, query_valid: torch.Tensor | None) -> torch.Tensor:
    """Per head max [H] of per-query-row maxima [B, H, T] over the valid query rows (``query_valid`` [B, T])."""
    if query_valid is not None:
        row_max = row_max.masked_fill(~query_valid[:, None, :], float("-inf"))
    return row_max.float().amax(dim=(0, 2))


#: Devices where the training path compiles flex_attention into a fused kernel; elsewhere flex runs its
#: unfused reference (CPU tests), which materialises every score.
FLEX_COMPILED_DEVICES: set[str] = {"cuda"}
#: Flex's Triton kernel multiplies tiles with ``tl.dot``, which takes no head dimension below 16.
FLEX_MIN_HEAD_DIM = 16
#: The largest tile (BLOCK_M, BLOCK_N) of flex's Triton configs: a block mask's block must hold whole tiles.
FLEX_MAX_TILE = 128

log = logging.getLogger(__name__)


def why_not_flex(qk_dim: int, v_dim: int, block: int = FLEX_BLOCK) -> str | None:
    """Why flex_attention's compiled GPU kernel cannot take these head dimensions and mask block, or None."""
    if min(qk_dim, v_dim) < FLEX_MIN_HEAD_DIM:
        return (f"flex_attention's GPU kernel needs head dimensions of at least {FLEX_MIN_HEAD_DIM} "
                f"(query/key {qk_dim}, value {v_dim})")
    if block % FLEX_MAX_TILE:
        return f"flex_attention's block mask block {block} is not a multiple of its kernel's tile {FLEX_MAX_TILE}"
    return None


def attention_dims(cfg: ModelConfig) -> tuple[int, int]:
    """(query/key, value) head dimensions of the training path's attention for ``cfg``."""
    if cfg.is_mla:
        return cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    return cfg.head_dim, cfg.head_dim


@dataclass
class FlexFallback:
    """Process-wide record of the compiled flex path failing: the dense path runs from then on."""

    count: int = 0              # compiled flex calls that failed and ran the dense path instead
    reason: str | None = None   # the first failure


#: Read by the training engine's ``attention_fallback``; tests reset it.
FLEX_FALLBACK = FlexFallback()


def _flex_body(q, k, v, block_mask, scale: float, with_max: bool, aligned: bool):
    """flex_attention with the row maxima when ``with_max`` (output, maxima or None), traced by torch.compile."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    if aligned:  # rows are whole blocks: a width-generic kernel keeps its unmasked loads (IS_DIVISIBLE)
        torch._check(q.shape[-2] % FLEX_BLOCK == 0)
        torch._check(k.shape[-2] % FLEX_BLOCK == 0)
    if not with_max:
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True), None
    out, aux = flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True,
                              return_aux=AuxRequest(max_scores=True))
    return out, aux.max_scores


# Two functions with one body: torch.compile keeps its cache, and counts recompiles against
# ``recompile_limit``, per code object, so training and no-grad scoring each get a budget of their own.
def _flex_grad(q, k, v, block_mask, scale: float, with_max: bool, aligned: bool):
    """The compiled entry for forwards that build a graph (training, activation-checkpoint recompute)."""
    return _flex_body(q, k, v, block_mask, scale, with_max, aligned)


def _flex_no_grad(q, k, v, block_mask, scale: float, with_max: bool, aligned: bool):
    """The compiled entry for no-grad forwards (log-prob recompute, reference scoring)."""
    return _flex_body(q, k, v, block_mask, scale, with_max, aligned)


_compiled: dict[bool, Callable] = {}


def _compiled_flex(grad: bool) -> Callable:
    """The compiled flex entry for this grad mode (compiled on first use)."""
    if grad not in _compiled:
        # dynamic=None (automatic): the first width compiles static, the next one width-generic, so any number
        # of row widths costs two entries per (grad mode, window); dynamic=False took one per width
        _compiled[grad] = torch.compile(_flex_grad if grad else _flex_no_grad, dynamic=None)
    return _compiled[grad]


def _flex_failed(err: Exception) -> None:
    """Count a compiled flex failure; the first one logs one warning."""
    if FLEX_FALLBACK.reason is None:
        lines = str(err).strip().splitlines()
        FLEX_FALLBACK.reason = f"{type(err).__name__}: {lines[0] if lines else ''}"
        log.warning("compiled flex_attention failed (%s); training attention runs the dense SDPA path from now on",
                    FLEX_FALLBACK.reason)
    FLEX_FALLBACK.count += 1


def flex_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask,
                scale: float) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """flex_attention over ``mask``'s ``BlockMask``: (output [B, H, T, Dv], per-query-row max logit [B, H, T] or
    None), or None when the compiled kernel failed (now or before): the caller then runs the dense path.

    Compiled (``FLEX_COMPILED_DEVICES``) the kernel returns the row maxima alongside the output (no second
    Q·Kᵀ) on CUDA; elsewhere flex runs its unfused reference (no gradients, no maxima: the caller computes those).
    """
    from torch.nn.attention.flex_attention import flex_attention

    if q.device.type not in FLEX_COMPILED_DEVICES:
        return flex_attention(q, k, v, block_mask=_block_mask(mask), scale=scale, enable_gqa=True), None
    if FLEX_FALLBACK.reason is not None:
        FLEX_FALLBACK.count += 1
        return None
    aligned = q.shape[-2] % FLEX_BLOCK == 0 and k.shape[-2] % FLEX_BLOCK == 0
    # the same request on CUDA whether this layer tracks maxima or not: one compile instead of two
    # (CPU kernels cannot return maxima)
    with_max = q.device.type == "cuda"
    try:
        # past the recompile limit torch would run flex unfused, every score in float32 (out of memory at 16 K
        # tokens): fail instead, and take the dense path below
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            return _compiled_flex(torch.is_grad_enabled())(q, k, v, _block_mask(mask), scale, with_max, aligned)
    except torch.OutOfMemoryError:
        raise
    except Exception as err:  # any compile or lowering failure: keep the run alive on the dense path
        _flex_failed(err)
        return None


def _block_mask(mask: DocumentMask):
    """``mask``'s BlockMask, built without a graph: one grad mode halves create_block_mask's compiles."""
    with torch.no_grad():
        return mask.block_mask()


@torch.no_grad()
def scale_rows(w: torch.Tensor, scales: dict[tuple[int, int], float]) -> None:
    """Multiply rows [lo, hi) of ``w`` by ``scales[(lo, hi)]``, touching only this rank's shard."""
    local, start = local_rows(w)
    end = start + local.shape[0]
    for (lo, hi), s in scales.items():
        lo, hi = max(lo, start), min(hi, end)
        if lo < hi:
            local[lo - start:hi - start].mul_(s)


class _Tracked(nn.Module):
    """What both attention kinds share: the attention call, max-logit tracking (QK-Clip's signal)."""

    scale: float
    window: int | None
    num_heads: int

    def _init_tracking(self) -> None:
        # plain attributes, not buffers, so the state dict is unchanged
        self.track_logits = False
        self.max_logits: torch.Tensor | None = None  # running max pre-softmax logit per query head [H]

    def _fold(self, heads: torch.Tensor) -> None:
        heads = heads.detach()
        self.max_logits = heads if self.max_logits is None else torch.maximum(self.max_logits, heads)

    def _attend(self, q, k, v, mask, layer: int, cache: AttentionCache | None) -> torch.Tensor:
        if cache is not None:
            return cache.attend(layer, q, k, v, self.scale, self.window)
        if isinstance(mask, DocumentMask):
            return self._attend_packed(q, k, v, mask.with_window(self.window))
        if self.track_logits:  # a plain mask says nothing of padded queries: every allowed pair counts
            self._fold(head_max_logits(q, k, mask, self.scale))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)

    def _attend_packed(self, q, k, v, mask: DocumentMask) -> torch.Tensor:
        """The training path: packed rows with document masking; S_max over valid queries' allowed keys.
        A flex mask whose compiled kernel failed runs the dense path (the same pairs)."""
        done = flex_attend(q, k, v, mask, self.scale) if mask.backend == "flex" else None
        if done is None:
            out, rows = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense(), scale=self.scale,
                                                       enable_gqa=True), None
        else:
            out, rows = done
        if self.track_logits:
            if rows is not None:
                self._fold(heads_over_valid(rows, mask.query_valid))
            else:
                self._fold(head_max_logits(q, k, mask.dense(), self.scale, mask.query_valid))
        return out

    def clip_heads(self, gammas: dict[int, float]) -> bool:
        """Scale the weights of each head h by QK-Clip's γ_h < 1; False if this attention cannot be clipped."""
        raise NotImplementedError


class Attention(_Tracked):
    """Grouped-query attention: q/k/v projections (optional biases), optional q/k RMSNorm per head
    (Qwen3), RoPE, optional sliding window. ``fused`` holds q, k and v as one matrix (inference)."""

    def __init__(self, cfg: ModelConfig, layer: int, fused: bool = False) -> None:
        super().__init__()
        self.num_heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        d, hd, self.fused = cfg.hidden_size, cfg.head_dim, fused
        if fused:
            self.qkv_proj = nn.Linear(d, (self.num_heads + 2 * self.kv_heads) * hd, bias=cfg.qkv_bias)
        else:
            self.q_proj = nn.Linear(d, self.num_heads * hd, bias=cfg.qkv_bias)
            self.k_proj = nn.Linear(d, self.kv_heads * hd, bias=cfg.qkv_bias)
            self.v_proj = nn.Linear(d, self.kv_heads * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias=cfg.o_bias)
        self.qk_norm = cfg.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.scale, self.window = hd ** -0.5, cfg.window(layer)
        self._init_tracking()

    def forward(self, x, cos, sin, mask, layer: int, cache: AttentionCache | None):
        b, t, _ = x.shape
        hd = self.head_dim
        if self.fused:
            q, k, v = self.qkv_proj(x).split([self.num_heads * hd, self.kv_heads * hd, self.kv_heads * hd], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = q.view(b, t, -1, hd), k.view(b, t, -1, hd), v.view(b, t, -1, hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self._attend(q, k, v, mask, layer, cache)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def clip_heads(self, gammas: dict[int, float]) -> bool:
        """MHA: W_q and W_k rows of head h by √γ_h each. GQA: a key head serves several query heads,
        so it is never scaled and the query head takes the whole γ_h. Biases scale with their rows.
        With q/k RMSNorm (Qwen3) the norm undoes any scaling of W_q/W_k: nothing to clip (False)."""
        if self.qk_norm:
            return False
        if self.fused:
            raise RuntimeError("QK-Clip runs on the trainer's layout, not the fused inference layout")
        hd = self.head_dim
        rows = lambda h: (h * hd, (h + 1) * hd)  # noqa: E731
        if self.kv_heads == self.num_heads:
            scales = {rows(h): math.sqrt(g) for h, g in gammas.items()}
            targets = [self.q_proj, self.k_proj]
        else:
            scales = {rows(h): g for h, g in gammas.items()}
            targets = [self.q_proj]
        for lin in targets:
            scale_rows(lin.weight, scales)
            if lin.bias is not None:
                scale_rows(lin.bias, scales)
        return True

    def hub_placements(self) -> list[tuple[str, str, int, tuple[int, ...]]]:
        """(checkpoint name, own parameter, element offset, shape) of q/k/v inside the fused ``qkv_proj``."""
        if not self.fused:
            return []
        d, hd = self.qkv_proj.in_features, self.head_dim
        sizes = {"q_proj": self.num_heads * hd, "k_proj": self.kv_heads * hd, "v_proj": self.kv_heads * hd}
        out, row = [], 0
        for name, n in sizes.items():
            out.append((f"{name}.weight", "qkv_proj.weight", row * d, (n, d)))
            if self.qkv_proj.bias is not None:
                out.append((f"{name}.bias", "qkv_proj.bias", row, (n,)))
            row += n
        return out


class LatentAttention(_Tracked):
    """DeepSeek-V3 / Kimi K2 multi-head latent attention.

    Queries: x → (q_a_proj → RMSNorm → q_b_proj, or q_proj) → per head [q_C (nope) | q_R (rope)].
    Keys/values: x → kv_a_proj_with_mqa → [latent c (kv_lora_rank) | k_R (rope, one for all heads)];
    RMSNorm(c) → kv_b_proj → per head [k_C | v]. Logit_h = scale·(q_C·k_C + q_R·k_R), scale with YaRN's mscale².
    """

    def __init__(self, cfg: ModelConfig, layer: int, fused: bool = False) -> None:
        super().__init__()  # ``fused`` is accepted for symmetry: MLA keeps the checkpoint's layout in both engines
        h, d = cfg.num_attention_heads, cfg.hidden_size
        self.num_heads, self.q_lora_rank, self.kv_lora_rank = h, cfg.q_lora_rank, cfg.kv_lora_rank
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        qk = self.nope + self.rope
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, self.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, h * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, self.kv_lora_rank + self.rope, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, h * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_dim, d, bias=cfg.attention_bias)
        self.rotate = apply_rope_interleaved if cfg.rope_interleave else apply_rope
        self.scale, self.window = cfg.softmax_scale, None
        self._init_tracking()

    @property
    def q_weight(self) -> nn.Linear:
        """The projection whose rows are per head [q_C | q_R]."""
        return self.q_proj if self.q_lora_rank is None else self.q_b_proj

    def forward(self, x, cos, sin, mask, layer: int, cache: AttentionCache | None):
        b, t, _ = x.shape
        h = self.num_heads
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rot = q.view(b, t, h, -1).transpose(1, 2).split([self.nope, self.rope], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_rot = self.rotate(q_rot, cos, sin)
        k_rot = self.rotate(k_rot.view(b, 1, t, self.rope), cos, sin)
        if cache is not None:
            out = self._attend_latent(q_nope, q_rot, latent, k_rot, layer, cache)
        else:
            kv = self.kv_b_proj(latent).view(b, t, h, -1).transpose(1, 2)
            k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
            q = torch.cat((q_nope, q_rot), dim=-1)
            k = torch.cat((k_nope, k_rot.expand(b, h, t, self.rope)), dim=-1)
            out = self._attend(q, k, v, mask, layer, cache)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def _attend_latent(self, q_nope, q_rot, latent, k_rot, layer: int, cache: AttentionCache) -> torch.Tensor:
        """Attention against the cached latent only (the absorbed form): W_UK folds into the query,
        q_C·k_C = (q_C W_UK)·c, and W_UV is applied after attending to c, so per token the cache holds
        kv_lora_rank + rope numbers instead of heads × (key + value dims)."""
        proj = self.kv_b_proj
        # an FP8 replica's projection is block-quantised: fold its dequantised matrix (the one it multiplies by)
        weight = proj.dequantized(q_nope.dtype) if hasattr(proj, "dequantized") else proj.weight
        w = weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w.split([self.nope, self.v_dim], dim=1)
        q_abs = torch.einsum("bhtd,hdc->bhtc", q_nope, w_uk)
        q = torch.cat((q_abs, q_rot), dim=-1)
        kv = torch.cat((latent[:, None], k_rot), dim=-1)  # [B, 1, T, kv_lora_rank + rope]: keys; values = c
        out = cache.attend(layer, q, kv, None, self.scale, None)  # [B, H, T, kv_lora_rank]
        return torch.einsum("bhtc,hvc->bhtv", out, w_uv)

    def clip_heads(self, gammas: dict[int, float]) -> bool:
        """Per head: q_C and k_C rows by √γ_h, q_R rows by γ_h; the shared rotary key k_R is never
        scaled (it serves every head), so q_R takes the whole factor of the rotary logit."""
        qk, kv = self.nope + self.rope, self.nope + self.v_dim
        q_scales, k_scales = {}, {}
        for h, g in gammas.items():
            q_scales[(h * qk, h * qk + self.nope)] = math.sqrt(g)
            q_scales[(h * qk + self.nope, (h + 1) * qk)] = g
            k_scales[(h * kv, h * kv + self.nope)] = math.sqrt(g)
        scale_rows(self.q_weight.weight, q_scales)
        scale_rows(self.kv_b_proj.weight, k_scales)
        return True
