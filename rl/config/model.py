"""The config's `model` section: the policy model, its warm-start architecture and LoRA."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from engines.model.io.sources import parse_source
from rl.config.base import Strict


class MoEArchitecture(Strict):
    """The Kimi K2 / DeepSeek-V3 parts of the embedded model (``family: deepseek_v3``)."""

    q_lora_rank: int | None = Field(64, ge=1, description="rank of the query compression; None = full q_proj")
    kv_lora_rank: int = Field(32, ge=1, description="rank of the compressed key/value latent")
    qk_nope_head_dim: int = Field(32, ge=1)
    qk_rope_head_dim: int = Field(16, ge=2, multiple_of=2)
    v_head_dim: int = Field(32, ge=1)
    n_routed_experts: int = Field(8, ge=1)
    num_experts_per_tok: int = Field(2, ge=1)
    n_shared_experts: int = Field(1, ge=0)
    moe_intermediate_size: int = Field(128, ge=1)
    first_k_dense_replace: int = Field(1, ge=0, description="leading layers with a dense MLP instead of experts")
    routed_scaling_factor: float = Field(1.0, gt=0)


class Architecture(Strict):
    family: Literal["llama", "qwen2", "qwen3", "mixtral", "deepseek_v3"] = Field(
        "llama", description="layout of the embedded model: llama (GQA), qwen2 (GQA + q/k/v biases), qwen3 (GQA + "
                             "q/k RMSNorm), mixtral (GQA + softmax top-k experts: moe.n_routed_experts, "
                             "moe.num_experts_per_tok), deepseek_v3 (Kimi K2: latent attention + mixture of "
                             "experts with a shared expert)")
    hidden_size: int = Field(128, ge=8)
    intermediate_size: int = Field(384, ge=8)
    num_hidden_layers: int = Field(4, ge=1)
    num_attention_heads: int = Field(4, ge=1)
    num_key_value_heads: int = Field(2, ge=1, description="GQA key/value heads (llama, qwen3)")
    max_position_embeddings: int = Field(128, ge=16)
    moe: MoEArchitecture = MoEArchitecture()

    def hf_kwargs(self) -> dict[str, Any]:
        """Arguments of transformers' config class for ``family`` (vocabulary and special ids apart)."""
        common = self.model_dump(exclude={"family", "moe"})
        if self.family in ("llama", "qwen2"):
            return common
        if self.family == "qwen3":
            return {**common, "head_dim": self.hidden_size // self.num_attention_heads}
        m = self.moe
        if self.family == "mixtral":
            return {**common, "num_local_experts": m.n_routed_experts, "num_experts_per_tok": m.num_experts_per_tok}
        if m.num_experts_per_tok > m.n_routed_experts:
            raise ValueError("warmstart.architecture.moe: num_experts_per_tok exceeds n_routed_experts")
        return {**common, **m.model_dump(), "num_key_value_heads": self.num_attention_heads, "n_group": 1,
                "topk_group": 1, "rope_interleave": False}


class VisionTower(Strict):
    """The vision side of the warm start built for an environment whose tasks carry images (a tiny Qwen2-VL whose
    language model is ``warmstart.architecture``'s sizes: rl.setup.vision_warmstart)."""

    image_size: int = Field(56, ge=28, multiple_of=28, description="pixels a side every picture is resized to: "
                                                                    "(image_size / 28)^2 image tokens")
    depth: int = Field(1, ge=1, description="transformer blocks of the vision tower")
    hidden_size: int = Field(128, ge=8, description="width of the vision tower")
    num_heads: int = Field(4, ge=1)


class WarmStartConfig(Strict):
    """SFT of the embedded tiny model on reference solutions, cached by these settings."""

    steps: int = Field(300, ge=0)
    batch_size: int = Field(64, ge=1)
    lr: float = Field(3e-3, gt=0)
    num_examples: int = Field(20000, ge=1)
    vocab_size: int = Field(512, ge=300)
    tokenizer: Literal["k2", "chatml", "llama3", "mistral"] = Field(
        "k2", description="special tokens and chat template of the trained tokenizer, as a family ships them: k2 "
                          "(Kimi K2), chatml (Qwen), llama3, mistral; EOS is the family's end of turn")
    architecture: Architecture = Architecture()
    vision: VisionTower = VisionTower()
    seed: int = 0


class LoraConfig(Strict):
    """Low-rank adapters (LoRA) trained instead of the whole model (engines.model.lora.adapters, PEFT's conventions)."""

    rank: int = Field(8, ge=1, description="r: each adapted W [out, in] gains A [r, in] and B [out, r]")
    alpha: float = Field(16.0, gt=0, description="the update is (alpha / rank)·B·A; 2·rank is the common choice")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input in training forwards "
                           "(log π_old's recompute included): 0 keeps the trainer's log-probs deterministic")
    target_modules: list[str] | None = Field(
        None, description="names of the decoder layers' projections to adapt (q_proj, k_proj, v_proj, o_proj, "
                          "gate_proj, up_proj, down_proj), checked against the model; None = all of these the "
                          "model has as linear layers (MoE experts are stacked tensors and are not adapted)")
    init: Literal["kaiming", "gaussian"] = Field("kaiming", description="A's initialisation: kaiming (PEFT's "
                                                 "default uniform) or gaussian N(0, 1/rank); B starts at zero")
    quantize_base: Literal["nf4", "int8"] | None = Field(
        None, description="QLoRA: keep the adapted projections' frozen weights quantized in the trainer by "
                          "bitsandbytes (nf4: QLoRA's 4-bit NormalFloat, about 0.53 bytes per weight; int8: row-wise, "
                          "about 1.02); the replicas still serve the exact base plus the adapters, so the trainer's "
                          "log-probs differ from the sampler's by the quantization error (logprob_diff). One trainer "
                          "rank; pip install 'colocated-rl[qlora]'. None = the base as the checkpoint stores it")
    unmerged: bool = Field(
        False, description="the native rollout engine adds the adapters' low-rank product to each adapted layer's "
                           "output instead of merging them into its weights: an update copies the adapters alone "
                           "(megabytes) and never rewrites the base, at the cost of two small products per adapted "
                           "layer in every forward; false merges W0 + s·B·A on receipt (decode at the base's speed). "
                           "vLLM always merges")
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw", description="the adapters' optimizer (optimizer.kind is not used with LoRA): AdamW, as LoRA's "
                             "published recipes train it; Muon orthogonalises each factor's update on its own, "
                             "which does not orthogonalise the product B·A that changes the model, and a rank-r "
                             "factor's update has only r singular values to equalise")


class PolicyModelConfig(Strict):
    """The model the run trains (the policy): where it comes from, its dtype, its chat and tool-call format."""

    path: str | None = Field(None, description="Hugging Face model directory, or where to download one from: a hub "
                                               "id (org/name, hf://org/name@revision), s3://bucket/prefix or "
                                               "gs://bucket/prefix, fetched once into $RL_MODEL_CACHE when the run "
                                               "starts; None = embedded warm start")
    dtype: Literal["float32", "bfloat16"] = "float32"
    backend: Literal["auto", "native", "transformers"] = Field(
        "auto", description="the trainer's model code: native (this project's: the eight families of "
                            "engines.model.native.arch, exact against the native rollout engine), transformers "
                            "(Hugging Face's own code for any AutoModelForCausalLM type; rollouts on vLLM), or auto "
                            "(native for the native families, else transformers); rl check-config prints the choice "
                            "and why")
    trust_remote_code: bool = Field(False, description="let transformers run the model's own Python code from its "
                                                       "directory (config.json auto_map): only for models you trust")
    chat_template: bool = Field(False, description="render plain `prompt` tasks as one user message with the "
                                                   "model's chat template (tasks with `messages` always are)")
    tool_format: str = Field("auto", description="tool-call format of multi-turn tool environments: auto (from "
                                                 "the chat template), k2, hermes, llama3_json or mistral")
    lora: LoraConfig | None = Field(None, description="train low-rank adapters on the frozen model instead of every "
                                    "weight (docs/configuration.md, LoRA); None = full training")
    freeze_vision: bool = Field(False, description="a vision-language model: train the language model only (the "
                                                   "vision tower and its projector keep their weights); false = both")

    @field_validator("path", mode="before")
    @classmethod
    def _source(cls, v: Any) -> Any:
        if isinstance(v, Path):
            v = str(v)
        if isinstance(v, str):
            parse_source(v)  # a bad scheme or bucket: its ValueError is the field's error
        return v
