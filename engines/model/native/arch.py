"""The architecture of a model: one normalised spec for every supported family.

A Hugging Face ``config.json`` is read through transformers' own config class for its
``model_type`` (so defaults and legacy ``rope_scaling`` keys are resolved exactly as transformers
resolves them), then reduced to the fields the shared model code (``engines.model``) needs. What the
spec does not model is kept in ``extra`` and written back unchanged when the model is saved.

Families: dense ``llama``, ``qwen2`` (q/k/v biases), ``qwen3`` (q/k RMSNorm), ``mistral`` (sliding
window); mixture-of-experts ``mixtral`` and ``qwen3_moe`` (softmax top-k router); ``deepseek_v3``
and ``kimi_k2`` (multi-head latent attention, sigmoid group-limited router, shared experts).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch

#: model_type -> the transformers class that loads a saved directory (kimi_k2 is saved as deepseek_v3).
FAMILIES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "kimi_k2": "DeepseekV3ForCausalLM",
}
#: RoPE variants whose frequencies never depend on the sequence being decoded, so that the trainer
#: (whole sequences) and the inference cache (one token at a time) rotate every token alike.
#: "dynamic" changes frequencies only past ``max_position_embeddings``, which the engines never reach.
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
MOE_FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3", "kimi_k2")
MLA_FAMILIES = ("deepseek_v3", "kimi_k2")


class UnsupportedModelError(ValueError):
    """A config the shared model code cannot run; the message names the field and what is supported."""


def hf_config_class(model_type: str):
    """transformers' config class for ``model_type`` (Kimi K2 uses DeepSeek-V3's)."""
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING["deepseek_v3" if model_type == "kimi_k2" else model_type]


@dataclass
class ModelConfig:
    """Architecture hyper-parameters, named as in a Hugging Face ``config.json`` of ``model_type``."""

    model_type: str = "llama"
    vocab_size: int = 256
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int | None = None
    max_position_embeddings: int = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_parameters: dict[str, Any] | None = None  # transformers' standardised form; None = default RoPE
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # attention
    attention_bias: bool = False     # biases of q/k/v (and of o_proj where the family puts one there)
    mlp_bias: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None  # qwen2/qwen3: per layer "full_attention" | "sliding_attention"
    # mixture of experts
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # multi-head latent attention (deepseek_v3 / kimi_k2)
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True
    #: the rest of the source config.json, written back unchanged by ``to_hf_dict``
    extra: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.model_type not in FAMILIES:
            raise UnsupportedModelError(f"model_type {self.model_type!r} is not supported; supported: "
                                        f"{', '.join(FAMILIES)}")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError("hidden_size must be divisible by num_attention_heads (or set head_dim)")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be divisible by num_key_value_heads")
        if self.rope_parameters is None:
            self.rope_parameters = {"rope_type": "default", "rope_theta": self.rope_theta}
        self.rope_theta = float(self.rope_parameters.get("rope_theta", self.rope_theta))
        rope_type = self.rope_parameters.get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(f"rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
        if self.layer_types is not None:
            self.layer_types = tuple(self.layer_types)
        self.mlp_only_layers = tuple(self.mlp_only_layers)
        if self.is_moe:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} must be in [1, {self.num_experts}]")
            if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
                raise ValueError(f"{self.num_experts} experts in {self.n_group} groups, {self.topk_group} chosen: "
                                 "experts must divide into the groups and topk_group be in [1, n_group]")
        if self.is_mla and not (self.kv_lora_rank and self.qk_rope_head_dim and self.v_head_dim):
            raise ValueError("MLA needs kv_lora_rank, qk_rope_head_dim and v_head_dim")

    # ---- what the model code asks ---------------------------------------------------------------

    @property
    def is_mla(self) -> bool:
        return self.model_type in MLA_FAMILIES

    @property
    def is_moe(self) -> bool:
        return self.model_type in MOE_FAMILIES and self.num_experts > 0

    @property
    def qk_norm(self) -> bool:
        """Qwen3's per-head RMSNorm of queries and keys before RoPE."""
        return self.model_type in ("qwen3", "qwen3_moe")

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias or self.model_type == "qwen2"

    @property
    def o_bias(self) -> bool:
        """Llama-style configs put ``attention_bias`` on the output projection too; Qwen2 does not."""
        return self.attention_bias and self.model_type in ("llama", "qwen3", "qwen3_moe", "deepseek_v3", "kimi_k2")

    @property
    def rope_type(self) -> str:
        return self.rope_parameters.get("rope_type", "default")

    @property
    def rope_dim(self) -> int:
        """Rotated dimensions per head: the whole head, or MLA's decoupled rotary part."""
        return self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def softmax_scale(self) -> float:
        """Scale of q·kᵀ before softmax: 1/√d, times DeepSeek's YaRN mscale² for MLA with scaled RoPE."""
        scale = self.qk_head_dim ** -0.5
        rp = self.rope_parameters
        if self.is_mla and self.rope_type != "default" and rp.get("mscale_all_dim"):
            factor = rp["factor"]
            m = 0.1 * rp["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
            scale *= m * m
        return scale

    def window(self, layer: int) -> int | None:
        """Sliding-window width of ``layer`` (keys within the last ``window`` positions), or None."""
        if self.model_type in ("qwen2", "qwen3"):
            if self.layer_types is None or self.layer_types[layer] != "sliding_attention":
                return None
        return self.sliding_window

    def is_moe_layer(self, layer: int) -> bool:
        """Whether ``layer`` has routed experts (each family's own rule)."""
        if not self.is_moe:
            return False
        if self.model_type in MLA_FAMILIES:
            return layer >= self.first_k_dense_replace
        if self.model_type == "qwen3_moe":
            return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        return True

    # ---- Hugging Face config.json ---------------------------------------------------------------

    def hf_config(self):
        """The transformers config object of this architecture (RoPE initialisation reads it)."""
        cached = self.__dict__.get("_hf")
        if cached is None:
            cached = hf_config_class(self.model_type).from_dict(self.to_hf_dict())
            self.__dict__["_hf"] = cached
        return cached

    def to_hf_dict(self, dtype: torch.dtype | None = None) -> dict[str, Any]:
        """``config.json`` contents that ``transformers`` loads as this family (``dtype``: of the weights)."""
        d = dict(self.extra)
        d.update(self._family_fields())
        model_type = "deepseek_v3" if self.model_type == "kimi_k2" else self.model_type
        d.update(model_type=model_type, architectures=[FAMILIES[self.model_type]], hidden_act="silu")
        d.pop("auto_map", None)  # Kimi K2's remote code: transformers' own class loads the saved directory
        if dtype is not None:  # the weights written with it are in ``dtype``, not the source's FP8
            d["dtype"] = str(dtype).removeprefix("torch.")
            d.pop("torch_dtype", None)
            d.pop("quantization_config", None)
        return d

    def _family_fields(self) -> dict[str, Any]:
        own = {f.name for f in fields(self)} - {"extra", "model_type", "rope_theta"}
        d = {k: v for k, v in asdict(self).items() if k in own}
        d["layer_types"] = list(self.layer_types) if self.layer_types is not None else None
        d["mlp_only_layers"] = list(self.mlp_only_layers)
        mt = self.model_type
        if mt in ("qwen2", "qwen3", "qwen3_moe"):
            d["use_sliding_window"] = self.sliding_window is not None
        if mt == "mixtral":
            d["num_local_experts"] = d.pop("num_experts")
        elif mt in MLA_FAMILIES:
            d["n_routed_experts"] = d.pop("num_experts")
            d.pop("head_dim")  # derived by transformers from the MLA dimensions
        drop = {
            "llama": _MOE | _MLA | {"sliding_window", "layer_types"},
            "qwen2": _MOE | _MLA | {"attention_bias", "mlp_bias"},
            "qwen3": _MOE | _MLA | {"mlp_bias"},
            "mistral": _MOE | _MLA | {"attention_bias", "mlp_bias", "layer_types"},
            "mixtral": (_MOE - {"num_experts_per_tok"}) | _MLA | {"attention_bias", "mlp_bias", "layer_types"},
            "qwen3_moe": (_MOE - {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                                  "decoder_sparse_step", "mlp_only_layers"}) | _MLA | {"mlp_bias", "layer_types"},
        }.get(mt, {"mlp_bias", "sliding_window", "layer_types", "decoder_sparse_step", "mlp_only_layers"})
        return {k: v for k, v in d.items() if k not in drop}

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Normalise a Hugging Face ``config.json`` dict (raises UnsupportedModelError naming the problem)."""
        model_type = d.get("model_type")
        if model_type not in FAMILIES:
            raise UnsupportedModelError(f"model_type {model_type!r} is not supported; supported: {', '.join(FAMILIES)}")
        qc = d.get("quantization_config")
        if qc:  # block-FP8 (DeepSeek-V3, Kimi K2) is read and dequantised (``engines.model.native.fp8``); nothing else
            block = qc.get("weight_block_size") or []
            if qc.get("quant_method") != "fp8" or qc.get("fmt", "e4m3") != "e4m3" or len(block) != 2 or \
                    block[0] != block[1]:
                raise UnsupportedModelError(f"quantised checkpoints ({qc.get('quant_method', '?')}) are not supported "
                                            "other than block-FP8 e4m3 with square blocks; use a bf16 or fp32 "
                                            "checkpoint")
        hf = hf_config_class(model_type).from_dict({k: v for k, v in d.items() if k != "model_type"})
        act = getattr(hf, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported; only 'silu'")
        if model_type in MLA_FAMILIES:
            for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
                if d.get(key, want) != want:
                    raise UnsupportedModelError(f"{key} {d[key]!r} is not supported; only {want!r}")
        g = lambda name, default=None: getattr(hf, name, default)  # noqa: E731
        kw: dict[str, Any] = dict(
            model_type=model_type, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size, num_hidden_layers=hf.num_hidden_layers,
            num_attention_heads=hf.num_attention_heads,
            num_key_value_heads=g("num_key_value_heads") or hf.num_attention_heads,
            max_position_embeddings=hf.max_position_embeddings, rms_norm_eps=hf.rms_norm_eps,
            rope_parameters=dict(hf.rope_parameters), tie_word_embeddings=bool(g("tie_word_embeddings", False)),
            bos_token_id=g("bos_token_id"), eos_token_id=g("eos_token_id"), pad_token_id=g("pad_token_id"),
            attention_bias=bool(g("attention_bias", False)), mlp_bias=bool(g("mlp_bias", False)),
            sliding_window=g("sliding_window"), layer_types=g("layer_types"),
        )
        if model_type not in MLA_FAMILIES:
            kw["head_dim"] = g("head_dim") or hf.hidden_size // hf.num_attention_heads
        if model_type in ("llama", "deepseek_v3", "kimi_k2"):
            kw["sliding_window"] = None
        if model_type == "mixtral":
            kw.update(num_experts=hf.num_local_experts, num_experts_per_tok=hf.num_experts_per_tok)
        elif model_type == "qwen3_moe":
            kw.update(num_experts=hf.num_experts, num_experts_per_tok=hf.num_experts_per_tok,
                      moe_intermediate_size=hf.moe_intermediate_size, norm_topk_prob=bool(hf.norm_topk_prob),
                      decoder_sparse_step=hf.decoder_sparse_step, mlp_only_layers=tuple(hf.mlp_only_layers or ()))
        elif model_type in MLA_FAMILIES:
            kw.update(num_experts=hf.n_routed_experts or 0, num_experts_per_tok=hf.num_experts_per_tok or 0,
                      moe_intermediate_size=hf.moe_intermediate_size, norm_topk_prob=bool(hf.norm_topk_prob),
                      n_group=hf.n_group or 1, topk_group=hf.topk_group or 1,
                      routed_scaling_factor=float(hf.routed_scaling_factor),
                      n_shared_experts=hf.n_shared_experts or 0, first_k_dense_replace=hf.first_k_dense_replace,
                      q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank, qk_nope_head_dim=hf.qk_nope_head_dim,
                      qk_rope_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim,
                      rope_interleave=bool(g("rope_interleave", True)))
        return cls(**kw, extra=dict(d))


_MOE = {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "n_group", "topk_group",
        "routed_scaling_factor", "n_shared_experts", "first_k_dense_replace", "decoder_sparse_step", "mlp_only_layers"}
_MLA = {"q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave"}


def make_config(model_type: str = "llama", **hf_kwargs: Any) -> ModelConfig:
    """A config built by transformers' own config class for ``model_type`` (its defaults filled in)."""
    hf = hf_config_class(model_type)(**hf_kwargs)
    d = hf.to_dict()
    d["model_type"] = model_type
    return ModelConfig.from_hf_dict(d)
