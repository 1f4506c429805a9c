"""Per-GPU memory of training + inference colocation for a large model, on paper (``rl memory-plan``).

The trainer is this project's: FSDP2 over ``gpus`` ranks (master weights, gradients and optimizer state sharded), one
decoder layer gathered at a time in the compute dtype, activations of one packed micro-batch (``rl.setup.memory``).
With ``expert_parallel`` e > 1 (``trainer.expert_parallel``) each GPU computes E/e of every MoE layer's E routed
experts and stores whole experts, at most ⌈E/gpus⌉ of them (the gpus/e GPUs computing the same ones split them), and
1/gpus of the rest; FSDP gathers a layer without its experts, and the all-to-all buffers and each MoE layer's E/e
experts, gathered over those GPUs and kept for the backward, come instead. The inference side holds one replica per
``inference_gpus`` GPUs (1: a full replica on every GPU, what this project's engine does today; more: weights and KV
cache split over a tensor- or expert-parallel group, which the engine does not do yet). Three phases take turns on
each GPU: rollout (replica + KV cache, the trainer offloaded), training (trainer state + working set, the KV cache
freed and, at ``sleep_level`` 2, the replica too) and the weight update (replica + KV cache + the checkpoint engine's
three bucket buffers). The KV cache gets what the rollout phase leaves of the usable memory, reported as tokens per
replica.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engines.inference.kv_cache import bytes_per_token
from engines.model.native.arch import ModelConfig, make_config
from rl.setup.memory import (
    GiB,
    ModelShape,
    check_expert_layout,
    run_dir_bytes,
    stored_experts,
    trainer_bytes,
    training_working_set,
)

#: Model shapes by name, as their Hugging Face configs give them (random weights are never built).
PRESETS = {
    # Llama 2 7B
    "llama-7b": ("llama", dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096)),
    # Qwen2.5 7B
    "qwen2.5-7b": ("qwen2", dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                 num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768)),
    # Kimi K2 (DeepSeek-V3 architecture: 61 layers, 384 experts of which 8 per token plus one shared, MLA)
    "kimi-k2": ("deepseek_v3", dict(vocab_size=163840, hidden_size=7168, intermediate_size=18432,
                                    moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=64,
                                    num_key_value_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                                    qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=384, n_shared_experts=1,
                                    num_experts_per_tok=8, n_group=1, topk_group=1, first_k_dense_replace=1,
                                    routed_scaling_factor=2.827, max_position_embeddings=131072)),
}
#: usable share of a GPU's memory (the allocator's fragmentation, the CUDA context, NCCL buffers)
USABLE = 0.9


def preset(name: str) -> ModelConfig:
    """The architecture of a preset (``PRESETS``)."""
    family, kw = PRESETS[name]
    return make_config(family, bos_token_id=None, eos_token_id=None, pad_token_id=None, **kw)


@dataclass(kw_only=True)
class ColocationPlan:
    model: str
    params: int
    gpus: int
    gpu_bytes: int
    inference_gpus: int
    parts: dict[str, int] = field(default_factory=dict)     # per GPU
    phases: dict[str, int] = field(default_factory=dict)    # per GPU, the sum of what each phase holds
    kv_tokens: int = 0                                      # KV-cache tokens per replica that fit
    checkpoint: int = 0                                     # one checkpoint on disk
    run_dir: int = 0                                        # the run directory at its fullest
    expert_parallel: int = 1                                # trainer ranks splitting each MoE layer's experts
    experts: int = 0                                        # routed experts per MoE layer

    @property
    def fits(self) -> bool:
        return max(self.phases.values()) <= USABLE * self.gpu_bytes and self.kv_tokens > 0

    def table(self) -> str:
        lines = [f"{self.model}: {self.params / 1e9:,.1f} B parameters on {self.gpus} GPUs of "
                 f"{self.gpu_bytes / GiB:.0f} GiB, one inference replica per {self.inference_gpus} GPU(s)",
                 "per GPU:"]
        if self.expert_parallel > 1:
            ep, r = self.expert_parallel, self.gpus // self.expert_parallel
            stored = stored_experts(self.experts, ep, self.gpus)
            where = "stores them whole" if r == 1 else f"stores at most {stored} of them, whole (the {r} GPUs " \
                f"computing the same {self.experts // ep} split them, gathered a layer at a time)"
            lines.insert(1, f"expert parallel {ep}: each GPU computes {self.experts // ep} of every MoE layer's "
                            f"{self.experts} experts and {where}; the rest sharded over {self.gpus}; tokens travel "
                            "to their experts (all-to-all)")
        width = max(map(len, [*self.parts, *self.phases])) + 2
        lines += [f"  {k:<{width}}{v / GiB:>10.2f} GiB" for k, v in self.parts.items()]
        lines.append("phases (each holds its parts at once):")
        lines += [f"  {k:<{width}}{v / GiB:>10.2f} GiB" for k, v in self.phases.items()]
        lines.append(f"usable ({USABLE:.0%} of the GPU): {USABLE * self.gpu_bytes / GiB:.1f} GiB; KV cache for "
                     f"{self.kv_tokens:,} tokens per replica; {'fits' if self.fits else 'does NOT fit'}")
        if self.run_dir:
            lines.append(f"run directory (shared storage): {self.checkpoint / GiB:,.1f} GiB per checkpoint, "
                         f"{self.run_dir / GiB:,.1f} GiB at most with run.keep_checkpoints 2 (one more being written, "
                         "best/, final/)")
        return "\n".join(lines)


@dataclass(frozen=True)
class Colocation:
    """How a run colocates training and inference on its GPUs (what ``rl memory-plan`` asks)."""

    gpus: int
    gpu_bytes: int
    inference_gpus: int = 1
    master_dtype: str = "float32"
    compute_dtype: str = "bfloat16"
    rollout_dtype: str = "bfloat16"
    optimizer: str = "muon"
    micro_batch_tokens: int = 16384
    activation_checkpointing: bool = True
    offload: bool = True
    sleep_level: int = 2
    bucket_bytes: int = 512 << 20
    expert_parallel: int = 1
    lora_rank: int = 0  # > 0: LoRA adapters of this rank (alpha 2·rank) on the default targets, AdamW; base frozen
    quantize_base: str | None = None  # QLoRA ("nf4", "int8"): the adapted weights quantized (one GPU)


def colocation_plan(arch: ModelConfig, setup: Colocation, name: str = "model",
                    shape: ModelShape | None = None) -> ColocationPlan:
    """The per-GPU memory of each phase of a colocated run of ``arch`` (see the module's docstring)."""
    gpus, gpu_bytes, inference_gpus, expert_parallel = setup.gpus, setup.gpu_bytes, setup.inference_gpus, \
        setup.expert_parallel
    master_dtype, compute_dtype, rollout_dtype = setup.master_dtype, setup.compute_dtype, setup.rollout_dtype
    optimizer, micro_batch_tokens, offload, sleep_level = setup.optimizer, setup.micro_batch_tokens, setup.offload, \
        setup.sleep_level
    check_expert_layout(arch, expert_parallel, gpus, lora=setup.lora_rank > 0)
    if gpus % inference_gpus:
        raise ValueError(f"{gpus} GPUs do not split into groups of {inference_gpus} (inference)")
    if setup.lora_rank:
        from engines.model.lora.adapters import LoraSpec, default_targets

        lora = LoraSpec(setup.lora_rank, 2.0 * setup.lora_rank, target_modules=default_targets(arch))
        shape, optimizer = shape or ModelShape.of(arch, lora), "adamw"
    shape = shape or ModelShape.of(arch)
    # the frozen base as rl.loop.workers keeps it: on one rank in the serving dtype (all of it in the compute dtype
    # when that is not the master's), sharded over several in the master dtype
    base, frozen = (None, None) if gpus > 1 else (compute_dtype, compute_dtype) if compute_dtype != master_dtype \
        else (rollout_dtype, None)
    if setup.quantize_base is not None:
        if not setup.lora_rank or gpus > 1:
            raise ValueError("a quantized base (QLoRA) needs LoRA (--lora RANK) on one GPU (--gpus 1)")
        base = setup.quantize_base
    weights, grads, opt = trainer_bytes(shape, gpus, master_dtype, optimizer, base, frozen, expert_parallel)
    work = training_working_set(shape, micro_batch_tokens, compute_dtype, setup.activation_checkpointing, gpus > 1,
                                expert_parallel, master_dtype, gpus)
    replica = -(-shape.params * getattr(torch, rollout_dtype).itemsize // inference_gpus)
    trainer = weights + grads + opt
    buffers = 3 * setup.bucket_bytes
    usable = int(USABLE * gpu_bytes)
    kv_room = max(0, usable - replica - buffers - (0 if offload else trainer))
    per_token = -(-bytes_per_token(arch, getattr(torch, rollout_dtype)) // inference_gpus)
    kv_tokens = kv_room // per_token
    kv = kv_tokens * per_token
    checkpoint, run_dir = run_dir_bytes(shape, rollout_dtype, master_dtype, optimizer, 2)
    plan = ColocationPlan(model=name, params=shape.params, gpus=gpus, gpu_bytes=gpu_bytes,
                          inference_gpus=inference_gpus, kv_tokens=kv_tokens,
                          checkpoint=checkpoint, run_dir=run_dir, expert_parallel=expert_parallel,
                          experts=shape.num_experts)
    weights_row = "frozen base + adapters (shard)" if setup.lora_rank else "master weights (shard)"
    plan.parts = {weights_row: weights, "gradients (shard)": grads, "optimizer state (shard)": opt,
                  f"training working set ({micro_batch_tokens} tokens)": work,
                  "inference replica (share)": replica, "KV cache (what is left)": kv,
                  "checkpoint-engine buffers": buffers}
    plan.phases = {"rollout": replica + kv + (0 if offload else trainer),
                   "training": trainer + work + (replica if sleep_level < 2 else 0) + (kv if sleep_level == 0 else 0),
                   "weight update": replica + kv + buffers + (0 if offload else trainer)}
    return plan
