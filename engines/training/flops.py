"""Model FLOPs of a training pass and Newton–Schulz FLOPs of a Muon step: what MFU is counted on.

Model FLOPs are the matmul work the model needs, whatever the kernels do (a recomputed forward under activation
checkpointing, masked blocks a kernel computes anyway and element-wise work are not counted):

    training FLOPs = 6 · N · T  +  6 · Σ_layers H · (d_qk + d_v) · pairs_layer  +  6 · d · V · S

* 6 · N · T: N weights multiply each of the T tokens (prompts and responses) in every matrix product, 2 FLOPs per
  weight forward and 4 backward (the gradients of the input and of the weight). N counts the decoder layers'
  projections: attention's q, k, v and o (MLA's down- and up-projections), a dense SwiGLU block's gate, up and
  down, an MoE layer's router, the k experts each token is routed to and the shared experts. It leaves out the
  input embedding (a lookup), norms and biases (element-wise), and the output head, counted apart.
* Attention: per layer, per (query, key) pair the attention mask allows and per head, q·k is 2·d_qk FLOPs and the
  value sum 2·d_v forward, twice that backward. Packed documents attend only inside themselves, causally: a
  document of n tokens has n(n+1)/2 pairs (Σ_i min(i + 1, w) under a sliding window w), and pairs never cross
  documents. For one document of n tokens with d_qk = d_v = d this is the usual 12·L·H·d·ctx per token with ctx
  the mean number of keys a query sees, (n + 1)/2.
* Output head: the trainer scores only the S response tokens, so the d × V head multiplies those alone.

Newton–Schulz (Muon's orthogonalisation) on an r × c matrix works on its wide orientation, n = min(r, c) rows and
m = max(r, c) columns; each quintic step is X Xᵀ (2n²m), b·A + c·A·A (2n³) and a·X + B·X (2n²m):

    Newton–Schulz FLOPs = steps · (4·n²·m + 2·n³) per matrix, every matrix of every stack (MoE experts) alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from engines.model.native.arch import ModelConfig
from engines.model.native.attention import attention_dims


def layer_params(cfg: ModelConfig, layer: int) -> int:
    """Weights of decoder layer ``layer`` that multiply each token (module docstring: N's share of one layer)."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    if cfg.is_mla:
        qk, v = attention_dims(cfg)
        q = h * heads * qk if cfg.q_lora_rank is None else h * cfg.q_lora_rank + cfg.q_lora_rank * heads * qk
        kv = h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + v)
        attn = q + kv + heads * v * h
    else:
        d = cfg.head_dim
        attn = h * heads * d + 2 * h * cfg.num_key_value_heads * d + heads * d * h
    if cfg.is_moe_layer(layer):
        inter = cfg.moe_intermediate_size or cfg.intermediate_size
        mlp = h * cfg.num_experts + 3 * h * inter * (cfg.num_experts_per_tok + cfg.n_shared_experts)
    else:
        mlp = 3 * h * cfg.intermediate_size
    return attn + mlp


def matmul_params(cfg: ModelConfig) -> int:
    """N: the decoder layers' weights that multiply each token (module docstring)."""
    return sum(layer_params(cfg, i) for i in range(cfg.num_hidden_layers))


def attention_pairs(lengths: Iterable[int], window: int | None = None) -> int:
    """(query, key) pairs causal attention computes over documents of ``lengths``, each on its own: n(n+1)/2 per
    document, or with a sliding ``window`` Σ_{i<n} min(i + 1, window)."""
    total = 0
    for n in lengths:
        if window is None or n <= window:
            total += n * (n + 1) // 2
        else:  # the first `window` queries see i + 1 keys, the rest `window` each
            total += window * (window + 1) // 2 + (n - window) * window
    return total


def attention_flops(cfg: ModelConfig, lengths: Sequence[int]) -> int:
    """Training FLOPs of the attention scores and value sums over documents of ``lengths`` (module docstring)."""
    qk, v = attention_dims(cfg)
    pairs: dict[int | None, int] = {}
    total = 0
    for layer in range(cfg.num_hidden_layers):
        w = cfg.window(layer)
        if w not in pairs:
            pairs[w] = attention_pairs(lengths, w)
        total += 6 * cfg.num_attention_heads * (qk + v) * pairs[w]
    return total


def model_flops(cfg: ModelConfig, lengths: Sequence[int], scored: int | None = None) -> int:
    """Training FLOPs (forward and backward) of one pass over documents of ``lengths`` tokens, packed or not, whose
    output head scores ``scored`` tokens (None: every token): 6·N·T + attention + 6·d·V·scored (module docstring)."""
    tokens = sum(lengths)
    scored = tokens if scored is None else scored
    head = 6 * cfg.hidden_size * cfg.vocab_size * scored
    return 6 * matmul_params(cfg) * tokens + attention_flops(cfg, lengths) + head


def flops_per_token(cfg: ModelConfig, length: int) -> float:
    """Training FLOPs per token of documents of ``length`` tokens, every token scored by the head:
    6·(N + d·V) + 6·Σ_layers H·(d_qk + d_v)·pairs/length."""
    return model_flops(cfg, [length]) / length


def newton_schulz_flops(shapes: Iterable[Sequence[int]], steps: int = 5) -> int:
    """FLOPs of ``steps`` quintic Newton–Schulz iterations on matrices of ``shapes`` ([r, c], or [batch, r, c] for a
    stack whose every matrix is orthogonalised): steps · (4·n²·m + 2·n³), n = min(r, c), m = max(r, c)."""
    total = 0
    for shape in shapes:
        *batch, r, c = shape
        n, m = min(r, c), max(r, c)
        count = 1
        for b in batch:
            count *= b
        total += count * steps * (4 * n * n * m + 2 * n ** 3)
    return total


def muon_flops(optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """Newton–Schulz FLOPs of one step of the Muon optimizers among ``optimizers`` (``torch.optim.Muon`` and its
    subclass ``ShardedMuon``): each parameter's full shape (a sharded matrix is orthogonalised whole, once, by its
    owner rank: this counts all ranks' work together) at its group's ``ns_steps``."""
    total = 0
    for opt in optimizers:
        if not isinstance(opt, torch.optim.Muon):
            continue
        for group in opt.param_groups:
            total += newton_schulz_flops([tuple(p.shape) for p in group["params"]], group["ns_steps"])
    return total
