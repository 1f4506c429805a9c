"""The FLOP counts MFU is taken on (``engines.training.flops``), against numbers worked out by hand for tiny
configs, and Newton–Schulz's against torch's own count of the matmuls Muon runs."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from engines.model.native.arch import make_config
from engines.model.native.causal_lm import build_model
from engines.training.flops import (
    attention_flops,
    attention_pairs,
    flops_per_token,
    matmul_params,
    model_flops,
    muon_flops,
    newton_schulz_flops,
)
from engines.training.muon import newton_schulz_
from engines.training.optim import build_optimizers
from tests.conftest import tiny_config

BASE = dict(vocab_size=37, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, bos_token_id=None, eos_token_id=None,
            pad_token_id=None)


def test_dense_model_flops_by_hand():
    """hidden 32, 4 heads of 8, 2 kv heads, SwiGLU 64, 2 layers, vocabulary 37. Per layer q 32·32 = 1024, k and v
    32·16 = 512 each, o 1024, gate/up/down 3·32·64 = 6144: 9216, so N = 18432. Documents of 3 and 5 tokens: 8
    tokens, causal pairs 3·4/2 + 5·6/2 = 21 (none across the two). Training FLOPs: 6·18432·8 = 884736 for the
    layers, 6 · 4 heads · (8 + 8) · 21 = 8064 per layer for attention, 6·32·37 = 7104 per scored token for the
    head."""
    cfg = tiny_config(37)
    assert matmul_params(cfg) == 18432
    assert attention_pairs([3, 5]) == 21
    assert attention_flops(cfg, [3, 5]) == 2 * 8064
    assert model_flops(cfg, [3, 5], scored=4) == 884736 + 16128 + 4 * 7104
    assert model_flops(cfg, [3, 5]) == 884736 + 16128 + 8 * 7104  # every token scored
    # N is the layers' matrices: the same count from the built model's 2-D weights inside its layers
    model = build_model(cfg, device="meta")
    assert matmul_params(cfg) == sum(p.numel() for n, p in model.named_parameters() if ".layers." in n and p.ndim == 2)


def test_packed_documents_count_their_own_pairs_and_a_window_caps_them():
    """A document of 5 tokens: 15 causal pairs; under a window of 2 each query sees at most 2 keys, 1+2+2+2+2 = 9.
    Packing changes nothing: pairs are per document. A Qwen3 model with a sliding layer and a full one counts each
    layer's own: 6 · 4 · 16 · (9 + 15) = 9216."""
    assert attention_pairs([5]) == 15 and attention_pairs([5], window=2) == 9
    assert attention_pairs([5], window=8) == 15 and attention_pairs([1, 1, 1]) == 3
    assert attention_pairs([2, 5], window=2) == 3 + 9
    assert attention_pairs([7], window=3) == sum(min(i + 1, 3) for i in range(7))
    cfg = tiny_config(37, model_type="qwen3", sliding_window=2, layer_types=["sliding_attention", "full_attention"])
    assert attention_flops(cfg, [5]) == 9216


def test_per_token_flops_are_6n_plus_the_head_plus_12_l_h_d_ctx():
    """One document of n tokens, every token scored, d_qk = d_v = d: per token 6·(N + d·V) + 12·L·H·d·ctx with ctx
    = (n + 1)/2, the mean keys a causal query sees."""
    cfg = tiny_config(37)
    n, layers, heads, d = 9, 2, 4, 8
    want = 6 * (18432 + 32 * 37) + 12 * layers * heads * d * (n + 1) / 2
    assert flops_per_token(cfg, n) == pytest.approx(want, rel=1e-12)


def test_moe_and_latent_attention_count_the_weights_a_token_meets():
    """Qwen3-MoE, 6 experts of 16, 2 per token: per layer attention 3072, the router 32·6 = 192 and 2 experts'
    3·32·16 = 1536 each, so 6336 a layer and 12672 in all (not the 6 experts' 9216). DeepSeek-V3's MLA (q through a
    rank-16 down-projection, kv rank 8, 4 heads of 8 + 4 rope dims, values of 6): q 32·16 + 16·4·12 = 1280,
    kv 32·12 + 8·4·14 = 832, o 4·6·32 = 768, so 2880 of attention; layer 0 dense (3·32·48 = 4608), layer 1 a router
    over 8 experts (256) and 2 routed plus 1 shared expert of 16 (3·3·32·16 = 4608). Attention: q·k over 12 dims,
    values of 6."""
    moe = make_config("qwen3_moe", **BASE, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
                      head_dim=8)
    assert matmul_params(moe) == 2 * (3072 + 192 + 2 * 1536)
    mla = make_config("deepseek_v3", **{**BASE, "num_key_value_heads": 4}, q_lora_rank=16, kv_lora_rank=8,
                      qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, moe_intermediate_size=16,
                      first_k_dense_replace=1, num_experts_per_tok=2, n_routed_experts=8, n_shared_experts=1,
                      n_group=4, topk_group=2)
    assert matmul_params(mla) == (2880 + 4608) + (2880 + 256 + 4608)
    assert attention_flops(mla, [4]) == 2 * 6 * 4 * (12 + 6) * 10
    # MLA's layers hold exactly those attention weights
    model = build_model(mla, device="meta")
    attn = model.model.layers[0].self_attn
    assert sum(p.numel() for p in attn.parameters() if p.ndim == 2) == 2880


def test_newton_schulz_flops_by_hand_and_as_torch_counts_them():
    """Per matrix r×c, n = min, m = max, 5 steps of X·Xᵀ (2n²m), A·A (2n³), B·X (2n²m): [32, 32] 5·(131072 + 65536)
    = 983040; [16, 32] 5·(32768 + 8192) = 204800; [64, 32] (tall: the iteration runs on its transpose) and
    [32, 64] 5·(262144 + 65536) = 1638400. torch's FLOP counter sees the same in Muon's own iteration."""
    assert newton_schulz_flops([(32, 32)]) == 983040
    assert newton_schulz_flops([(16, 32)]) == newton_schulz_flops([(32, 16)]) == 204800
    assert newton_schulz_flops([(64, 32)]) == newton_schulz_flops([(32, 64)]) == 1638400
    assert newton_schulz_flops([(3, 16, 32)]) == 3 * 204800  # a stack: each matrix on its own
    assert newton_schulz_flops([(16, 32)], steps=2) == 2 * 40960
    for shape in [(2, 16, 32), (3, 32, 16), (1, 24, 24)]:
        for emulate in (True, False):
            with FlopCounterMode(display=False) as counter:
                newton_schulz_(torch.randn(shape).bfloat16(), (3.4445, -4.7750, 2.0315), 5, 1e-7, emulate=emulate)
            assert counter.get_total_flops() == newton_schulz_flops([shape]), (shape, emulate)


def test_muon_flops_are_the_matrices_muon_steps():
    """The tiny model's Muon takes per layer q, o [32, 32], k, v [16, 32], gate, up [64, 32], down [32, 64]:
    2·983040 + 2·204800 + 3·1638400 = 7290880 per layer, two layers; AdamW's parameters count nothing."""
    model = build_model(tiny_config(37), device="meta")
    assert muon_flops(build_optimizers(model, "muon", 1e-3, 0.0)) == 2 * 7290880
    assert muon_flops(build_optimizers(model, "adamw", 1e-3, 0.0)) == 0
