"""Tiny random models of families the native code does not implement, made with transformers' own config classes,
for the transformers backend's tests and the vLLM survey (``tests/vllm_check.py``).

Every model has head_dim 32 (vLLM's CPU attention has no kernel for smaller heads), 4 layers that cover each
family's layer kinds, and sliding windows shorter than the test documents so that windows matter.
"""

from __future__ import annotations

import torch

VOCAB = 128
#: Shared by every family: hidden 64, 2 query heads of 32, one key/value head (GQA), ids 0/1/2 = pad/bos/eos.
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, tie_word_embeddings=False)
WINDOW = 6
ALTERNATING = ["sliding_attention", "full_attention"] * 2

#: model_type -> (what it exercises, config overrides)
FAMILIES: dict[str, tuple[str, dict]] = {
    "gpt_oss": ("MoE, attention sinks, alternating sliding window, biases",
                # its own YaRN RoPE (factor 32 over 4096 positions), which vLLM's implementation requires
                dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW, layer_types=ALTERNATING,
                     max_position_embeddings=131072)),
    "gemma3_text": ("local/global layers, q/k norm, sandwich norms, scaled embeddings",
                    dict(sliding_window=WINDOW, layer_types=ALTERNATING, query_pre_attn_scalar=32)),
    "gemma2": ("soft-capped attention and final logits, local/global layers",
               dict(sliding_window=WINDOW, layer_types=ALTERNATING, query_pre_attn_scalar=32,
                    attn_logit_softcapping=4.0, final_logit_softcapping=3.0, tie_word_embeddings=True)),
    "qwen3_next": ("hybrid Gated DeltaNet / gated attention, MoE with a shared expert",
                   dict(layer_types=["linear_attention", "full_attention"] * 2, num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=32, shared_expert_intermediate_size=32, linear_num_value_heads=2,
                        linear_num_key_heads=1, linear_key_head_dim=32, linear_value_head_dim=32)),
    # conv_dim and block_dim: fields of LiquidAI's config.json that vLLM reads (transformers ignores them)
    "lfm2": ("hybrid short convolutions / attention",
             dict(layer_types=["conv", "full_attention"] * 2, conv_dim=64, block_dim=64, tie_word_embeddings=True)),
    "nemotron_h": ("hybrid Mamba-2 / attention / MLP / MoE layers",
                   dict(hybrid_override_pattern="M*-E", n_routed_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=32, moe_shared_expert_intermediate_size=32, mamba_num_heads=4,
                        mamba_head_dim=16, ssm_state_size=16, n_groups=1)),
    "phi3": ("fused qkv and gate/up projections, MHA", dict(num_key_value_heads=2)),
    "granite": ("embedding, residual, attention and logit multipliers",
                dict(logits_scaling=2.0, residual_multiplier=0.5, embedding_multiplier=3.0, attention_multiplier=0.1)),
    "olmo2": ("norms after the sub-layers, q/k norm over all heads", dict()),
    "smollm3": ("no RoPE on every fourth layer, tied embeddings", dict(tie_word_embeddings=True)),
    "exaone4": ("local/global layers, norms after the sub-layers",
                dict(sliding_window=WINDOW, layer_types=ALTERNATING)),
    "glm4_moe": ("MoE with shared experts, a sigmoid router, q/k norm, partial RoPE",
                 dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                      n_group=1, topk_group=1, use_qk_norm=True)),
    "qwen2_moe": ("MoE with a gated shared expert, a dense layer among MoE ones, q/k/v biases",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32, mlp_only_layers=[0], norm_topk_prob=False)),
}

#: Other layouts of a family: name -> (model_type, overrides on top of the family's)
VARIANTS: dict[str, tuple[str, dict]] = {
    "nemotron_h-dense": ("nemotron_h", dict(hybrid_override_pattern="M*-M")),  # Nemotron-H 8B's kinds, no MoE
    # Qwen3-Next's own linear-attention head size (vLLM's CPU Gated DeltaNet kernel takes no head of 32)
    "qwen3_next-128": ("qwen3_next", dict(linear_key_head_dim=128, linear_value_head_dim=128)),
}


def hf_config(name: str, **overrides):
    """transformers' config of the tiny model ``name`` (a model_type of ``FAMILIES``, a ``VARIANTS`` name, or
    any other model_type with ``BASE``), ``overrides`` on top."""
    from transformers import CONFIG_MAPPING

    model_type, extra = VARIANTS.get(name, (name, {}))
    kw = dict(BASE)
    kw.update(FAMILIES[model_type][1] if model_type in FAMILIES else {})
    kw.update(extra)
    kw.update(overrides)
    return CONFIG_MAPPING[model_type](**kw)


@torch.no_grad()
def sharpen(model: torch.nn.Module, seed: int = 0, std: float = 0.15) -> torch.nn.Module:
    """Redraw every matrix (and stacked expert matrix, and embedding) as N(0, ``std``), so that logits are far from
    uniform and errors would show (transformers' init, N(0, 0.02), leaves them nearly flat; at 0.2 the hybrid
    models' log-probs reach -11, where float32 rounding of a padded row alone differs by 1.2e-5)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.ndim in (2, 3) and "conv" not in name:
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


def documents(seed: int = 0, lengths=((5, 7), (3, 6), (9, 2), (4, 10))) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, responses) of random token ids (no pad/bos/eos), documents longer than ``WINDOW``."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, VOCAB, (p,), generator=g).tolist() for p, _ in lengths]
    responses = [torch.randint(3, VOCAB, (r,), generator=g).tolist() for _, r in lengths]
    return prompts, responses

