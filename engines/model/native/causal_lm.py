"""The decoder-only transformer both engines run, for every supported family.

Both engines run this one definition, so that for the same weights and tokens they compute the
same log-probabilities. Which blocks a layer has follows its config (``engines.model.native.arch``): grouped-query
or latent attention, a dense SwiGLU block or a mixture of experts. Parameter names follow
transformers' in-memory layout (``model.layers.N.self_attn.q_proj.weight``, stacked
``mlp.experts.gate_proj``); ``engines.model.layout`` maps them to a checkpoint's tensor names.
``fused=True`` builds the inference layout: q/k/v and gate/up as one matrix each.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from engines.model.logprobs import selected_logprobs
from engines.model.native import routing
from engines.model.native.arch import ModelConfig, make_config
from engines.model.native.attention import (
    Attention,
    AttentionCache,
    LatentAttention,
    head_max_logits,
    padded_causal_mask,
    positions_from_valid,
    window_mask,
)
from engines.model.native.document_mask import DocumentMask
from engines.model.native.layers import MLP, RMSNorm
from engines.model.native.moe import MoE, Router
from engines.model.native.rope import Rotary

__all__ = ["Attention", "AttentionCache", "CausalLM", "DocumentMask", "LatentAttention", "ModelConfig", "build_model",
           "head_max_logits", "make_config", "padded_causal_mask", "positions_from_valid", "reset_max_logits",
           "track_max_logits"]

ATTENTION_TYPES = (Attention, LatentAttention)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, fused: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = (LatentAttention if cfg.is_mla else Attention)(cfg, layer, fused)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # numbered among the MoE layers alone: routes are [tokens, MoE layers, k]
        self.mlp = MoE(cfg, fused, sum(map(cfg.is_moe_layer, range(layer)))) if cfg.is_moe_layer(layer) else \
            MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, fused)

    def forward(self, x, cos, sin, mask, layer: int, cache: AttentionCache | None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, layer, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, fused: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, fused) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """The language model. ``forward`` serves full-sequence training and cached decoding alike."""

    def __init__(self, cfg: ModelConfig, fused: bool = False) -> None:
        super().__init__()
        self.config, self.fused = cfg, fused
        #: keep only each decoder layer's input during training forwards, recomputing the rest in the backward
        self.activation_checkpointing = False
        self.model = Backbone(cfg, fused)
        with torch.device("cpu"):  # the frequencies are real numbers even when the weights are on meta
            self.rotary = Rotary(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Random initialisation: N(0, std) matrices, zero biases, unit norms."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)
            elif isinstance(m, Router):
                nn.init.normal_(m.weight, std=std)
                if m.kind == "sigmoid":
                    m.e_score_correction_bias.zero_()
        for name, p in self.named_parameters():
            if ".experts." in name:
                nn.init.normal_(p, std=std)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor | DocumentMask | None = None,
        cache: AttentionCache | None = None,
        select: torch.Tensor | None = None,
        *,
        targets: torch.Tensor | None = None,
        inv_temp: torch.Tensor | float = 1.0,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits [B, T, V] for tokens [B, T] at RoPE positions [B, T].

        ``mask`` is a boolean [B, 1, T, T] (True = may attend), or the ``DocumentMask`` of a packed batch
        (the training path: document masking, and S_max over real queries only), used when there is no
        ``cache`` (sliding-window layers narrow it by position); a cache attends itself. ``select`` [M] picks
        positions of the flattened B·T token axis: logits are then [M, V], and the vocabulary projection runs
        only there. ``targets`` [B, T] (token ids, -1 = none) returns instead (log-prob, entropy) [N] of each
        target under softmax(logits · ``inv_temp``) (one number, or one per target), in the row-major order of
        ``targets >= 0``, scored in vocabulary chunks (``engines.model.logprobs``) so the [N, V] logits never exist;
        ``select`` (their flat positions) spares the boolean mask, whose ``nonzero`` waits for the device.
        """
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        masks = {None: mask}
        checkpointing = self.activation_checkpointing and cache is None and torch.is_grad_enabled()
        for i, layer in enumerate(self.model.layers):
            w = layer.self_attn.window
            if w is not None and w not in masks and mask is not None:
                masks[w] = mask.with_window(w) if isinstance(mask, DocumentMask) else window_mask(mask, positions, w)
            if checkpointing:
                x = _checkpointed(layer, x, cos, sin, masks.get(w, mask), i)
            else:
                x = layer(x, cos, sin, masks.get(w, mask), i, cache)
        if targets is not None:
            if select is None:
                select = (targets >= 0).flatten().nonzero().squeeze(1)
            hidden, chosen = x.flatten(0, 1)[select], targets.flatten()[select]
            return selected_logprobs(self.model.norm(hidden), self.lm_head.weight, chosen, inv_temp)
        if select is not None:
            x = x.flatten(0, 1)[select]
        return self.lm_head(self.model.norm(x))


def _checkpointed(layer: DecoderLayer, x, cos, sin, mask, index: int) -> torch.Tensor:
    """``layer`` under activation checkpointing: only its input is kept; the backward recomputes the rest.
    The recompute does not fold its (identical) attention logits into the tracked maxima again."""
    calls = [0]
    tape = routing.active()  # the backward's recompute runs outside the caller's replay: it replays the same routes

    def run(x, cos, sin):
        calls[0] += 1
        attn = layer.self_attn
        tracking = attn.track_logits
        attn.track_logits = tracking and calls[0] == 1
        try:
            with routing.using(tape):
                return layer(x, cos, sin, mask, index, None)
        finally:
            attn.track_logits = tracking

    return checkpoint(run, x, cos, sin, use_reentrant=False)


def build_model(cfg: ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                fused: bool = False, init: bool = False) -> CausalLM:
    """The model with uninitialised weights on ``device`` (``init``: random ones), built on the meta
    device first so no memory is touched until the weights' final place is known; "meta" stays there."""
    with torch.device("meta"):
        model = CausalLM(cfg, fused)
    model = model.to(dtype)
    if torch.device(device).type != "meta":
        model = model.to_empty(device=device)
        if cfg.tie_word_embeddings:  # to_empty gives each name fresh storage: tie them again
            model.lm_head.weight = model.model.embed_tokens.weight
        if init:
            model.init_weights()
    return model


def attention_layers(model: nn.Module) -> list[nn.Module]:
    """The attention modules of ``model``, in layer order (a transformers-backed model lists its own:
    ``HFCausalLM.attention_modules``)."""
    if hasattr(model, "attention_modules"):
        return model.attention_modules()
    return [m for m in model.modules() if isinstance(m, ATTENTION_TYPES)]


def track_max_logits(model: nn.Module, enabled: bool = True) -> None:
    """Switch per-head max-logit tracking of every attention layer in ``model`` (training forwards only)."""
    for m in attention_layers(model):
        m.track_logits = enabled


def reset_max_logits(model: nn.Module) -> None:
    """Forget the tracked maxima of every attention layer in ``model``."""
    for m in attention_layers(model):
        m.max_logits = None
