"""What the rest of the system needs to know of a model that transformers implements, read from its config on
the meta device: sizes, per-layer kinds, whether packed rows are exact, how its logits are formed, and the
decoder layers that FSDP2 shards.

``describe(hf_config)`` builds the model's modules on the meta device (no memory, any size) and returns a
``ModelDescription``: the fields of the native ``ModelConfig`` that the trainer, the memory plan and the
checkpoint code read (``vocab_size``, ``hidden_size``, ``num_hidden_layers``, head counts and dims, ``is_mla``,
token ids), plus parameter counts and what the transformers backend decides from the architecture.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from engines.model.native.arch import UnsupportedModelError

#: Per-layer kinds (transformers' ``layer_types`` / ``layers_block_type`` names) whose layers mix tokens only
#: through softmax attention, or not at all: packed rows with a document mask are exact for them.
PACKABLE_KINDS = frozenset({"full_attention", "sliding_attention", "attention", "mlp", "moe"})
#: Module class-name fragments of sequence mixers that carry state along the row (state-space, linear
#: attention, short convolutions): the rows' documents would leak into each other.
STATEFUL_MIXERS = ("Mamba", "GatedDeltaNet", "ShortConv", "LinearAttention", "Recurrent", "Rwkv", "RWKV")


@dataclass
class ModelDescription:
    """A transformers model's shape and the backend's decisions about it (see the module docstring)."""

    model_type: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    layer_types: tuple[str, ...]       # per decoder layer: "full_attention", "sliding_attention", "linear_attention" …
    sliding_window: int | None
    tie_word_embeddings: bool
    num_experts: int                   # routed experts per MoE layer (0: dense)
    num_experts_per_tok: int
    num_parameters: int                # tied embeddings counted once
    largest_layer: int                 # parameters of the largest decoder layer (what FSDP gathers at once)
    largest_layer_experts: int         # of which routed experts
    root_params: int                   # outside the decoder layers: embeddings, final norm, output head
    packable: bool                     # packed rows with a document mask are exact
    unpacked_reason: str | None        # why not (then: one row per document)
    logit_scale: float = 1.0           # logits = lm_head(h) · logit_scale (Granite: 1 / logits_scaling)
    final_logit_softcapping: float | None = None  # logits = cap · tanh(logits / cap) (Gemma 2)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    is_mla: bool = False
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    moe_intermediate_size: int = 0     # each routed expert's (0: intermediate_size)
    n_shared_experts: int = 0
    first_dense_layers: int = 0        # leading dense layers of a MoE model (first_k_dense_replace)
    backend: str = "transformers"
    extra: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    hf_config: Any = field(default=None, repr=False, compare=False)  # the config it describes (to rebuild on meta)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` routes to experts (as ``ModelConfig.is_moe_layer``, for the memory plan)."""
        return self.is_moe and layer >= self.first_dense_layers

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim


def is_vision_language(hf_config) -> bool:
    """Whether ``hf_config`` describes a vision-language model (a vision tower beside the language model)."""
    return getattr(hf_config, "vision_config", None) is not None


def auto_class(hf_config) -> type:
    """transformers' auto class that builds ``hf_config``'s model: ``AutoModelForImageTextToText`` for a
    vision-language model, ``AutoModelForCausalLM`` otherwise."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_language(hf_config) else AutoModelForCausalLM


def causal_lm_class(hf_config) -> type:
    """transformers' causal-LM (or image-text-to-text) class for ``hf_config``, or UnsupportedModelError naming
    the model type."""
    auto = auto_class(hf_config)
    try:
        return auto._model_mapping[type(hf_config)]
    except KeyError:
        kind = "image-text-to-text" if is_vision_language(hf_config) else "causal language model"
        raise UnsupportedModelError(f"model_type {hf_config.model_type!r} has no {kind} class in transformers; the "
                                    "transformers backend runs AutoModelForCausalLM and AutoModelForImageTextToText "
                                    "models") from None


def check_supported(hf_config) -> None:
    """Raise UnsupportedModelError (one line) for what the backend cannot run exactly."""
    causal_lm_class(hf_config)
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    kinds = set(layer_types(text))
    if "chunked_attention" in kinds:
        raise UnsupportedModelError(f"model_type {hf_config.model_type!r}: chunked attention layers are not "
                                    "supported by the transformers backend's document-masked attention")
    if getattr(text, "unpadded_vocab_size", None):
        raise UnsupportedModelError(f"model_type {hf_config.model_type!r}: an unpadded vocabulary slice of the "
                                    "logits is not supported")
    softcap = getattr(text, "final_logit_softcapping", None)
    if softcap is not None and _logit_scale(text) != 1.0:
        raise UnsupportedModelError(f"model_type {hf_config.model_type!r}: scaled and soft-capped logits together "
                                    "are not supported")


def layer_types(hf_config) -> tuple[str, ...]:
    """Per decoder layer kind, as the config names it (every layer "full_attention" when it names none)."""
    n = hf_config.num_hidden_layers
    kinds = getattr(hf_config, "layer_types", None) or getattr(hf_config, "layers_block_type", None)
    if kinds:
        return tuple(kinds)[:n]
    window = getattr(hf_config, "sliding_window", None)
    return ("sliding_attention" if window else "full_attention",) * n


def _logit_scale(hf_config) -> float:
    """The factor transformers' causal-LM head applies to ``lm_head(h)`` (1 for most families)."""
    scale = 1.0
    if getattr(hf_config, "logits_scaling", None):
        scale /= float(hf_config.logits_scaling)
    if getattr(hf_config, "logit_scale", None):
        scale *= float(hf_config.logit_scale)
    return scale


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated decoder layers of ``model`` in order: the modules whose class transformers lists in
    ``_no_split_modules`` (the units it never splits across devices), or a native model's ``model.layers``."""
    names = getattr(model, "_no_split_modules", None)
    if names is None and hasattr(model, "hf_model"):
        names = model.hf_model._no_split_modules
    if not names:
        return list(model.model.layers)
    hf = getattr(model, "hf_model", model)
    if is_vision_language(getattr(hf, "config", None)):
        model = hf.get_decoder()  # the language model's layers, not the vision tower's blocks
    names = set(names)
    found: list[nn.Module] = []
    inside: set[int] = set()  # modules within a layer already found: a listed sub-block is not a layer
    for m in model.modules():
        # FSDP2 swaps a sharded module's class for a subclass of its own (FSDPQwen2MoeDecoderLayer): ask the bases too
        if any(c.__name__ in names for c in type(m).__mro__) and id(m) not in inside:
            found.append(m)
            inside.update(id(c) for c in m.modules())
    if not found:
        raise UnsupportedModelError(f"{type(model).__name__}: none of its modules is one of {sorted(names)} "
                                    "(transformers' _no_split_modules), so its decoder layers cannot be found")
    return found


def vision_modules(model: nn.Module) -> list[nn.Module]:
    """A vision-language model's vision side: every child of its base model but the language model (the vision
    tower, the projector or merger into the language model's width); [] for a text-only model."""
    hf = getattr(model, "hf_model", model)
    if not is_vision_language(getattr(hf, "config", None)):
        return []
    base, language = getattr(hf, hf.base_model_prefix), hf.get_decoder()
    return [m for m in base.children() if m is not language]


def stateful_mixers(layers: list[nn.Module]) -> list[tuple[int, str]]:
    """(layer index, module class) of every sequence mixer that carries state along a row, or holds a
    convolution over the sequence (``nn.Conv1d``)."""
    out = []
    for i, layer in enumerate(layers):
        for m in layer.modules():
            name = type(m).__name__
            if isinstance(m, nn.Conv1d) or any(s in name for s in STATEFUL_MIXERS):
                out.append((i, name))
                break
    return out


def meta_model(hf_config, trust_remote_code: bool = False) -> nn.Module:
    """The causal LM of ``hf_config`` with every tensor on the meta device (shapes only)."""
    check_supported(hf_config)
    with torch.device("meta"):
        return auto_class(hf_config).from_config(hf_config, trust_remote_code=trust_remote_code)


def _experts_params(layer: nn.Module) -> int:
    return sum(p.numel() for n, p in layer.named_parameters() if ".experts." in f".{n}")


def describe(hf_config, model: nn.Module | None = None) -> ModelDescription:
    """The ``ModelDescription`` of ``hf_config`` (``model``: an instance already built, else one on meta)."""
    check_supported(hf_config)
    model = meta_model(hf_config) if model is None else model
    cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    layers = decoder_layers(model)
    params = sum(p.numel() for p in model.parameters())
    per_layer = [(sum(p.numel() for p in layer.parameters()), _experts_params(layer)) for layer in layers]
    largest = max(per_layer) if per_layer else (0, 0)
    kinds = layer_types(cfg)
    odd = sorted({k for k in kinds if k not in PACKABLE_KINDS})
    stateful = stateful_mixers(layers)
    reason = None
    if odd or stateful:
        what = ", ".join(odd) if odd else f"{stateful[0][1]} (layer {stateful[0][0]})"
        reason = (f"{what} layers carry state along the sequence, which a document mask cannot stop at a "
                  "document's end: each document runs in a row of its own")
    heads = cfg.num_attention_heads
    g = lambda name, default=None: getattr(cfg, name, default)  # noqa: E731
    is_mla = bool(g("kv_lora_rank")) and bool(g("qk_rope_head_dim"))
    experts = g("num_local_experts") or g("num_experts") or g("n_routed_experts") or 0
    return ModelDescription(
        model_type=hf_config.model_type, architecture=type(model).__name__ if model is not None else "",
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=g("intermediate_size") or 0, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=heads, num_key_value_heads=g("num_key_value_heads") or heads,
        head_dim=g("head_dim") or cfg.hidden_size // heads,
        max_position_embeddings=g("max_position_embeddings") or 0, layer_types=kinds,
        sliding_window=g("sliding_window"), tie_word_embeddings=bool(g("tie_word_embeddings", False)),
        num_experts=int(experts), num_experts_per_tok=int(g("num_experts_per_tok") or 0),
        num_parameters=params, largest_layer=largest[0], largest_layer_experts=largest[1],
        root_params=params - sum(n for n, _ in per_layer), packable=reason is None, unpacked_reason=reason,
        logit_scale=_logit_scale(cfg), final_logit_softcapping=g("final_logit_softcapping"),
        bos_token_id=g("bos_token_id"), eos_token_id=g("eos_token_id"), pad_token_id=g("pad_token_id"),
        is_mla=is_mla, qk_nope_head_dim=g("qk_nope_head_dim") or 0 if is_mla else 0,
        qk_rope_head_dim=g("qk_rope_head_dim") or 0 if is_mla else 0, v_head_dim=g("v_head_dim") or 0 if is_mla else 0,
        kv_lora_rank=g("kv_lora_rank"), q_lora_rank=g("q_lora_rank"),
        moe_intermediate_size=int(g("moe_intermediate_size") or 0),
        n_shared_experts=int(g("n_shared_experts") or (1 if g("shared_expert_intermediate_size") else 0)),
        first_dense_layers=int(g("first_k_dense_replace") or 0), extra=cfg.to_dict(), hf_config=hf_config)
