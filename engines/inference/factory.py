"""Building a rollout engine from its settings, so the controller never imports a concrete engine.

``EngineSettings`` holds every choice already made (no "auto"); ``build_engine`` makes the native engine (an
empty replica in the fused inference layout, filled by the checkpoint engine) or vLLM from them.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Literal

import torch

from engines.inference.base import RolloutEngine
from engines.inference.native import resolve_attention
from engines.model.arch import ModelConfig
from engines.model.causal_lm import CausalLM, build_model
from engines.model.fp8 import BLOCK, checkpoint_block, to_fp8
from engines.model.hf_io import read_config, read_tensors
from engines.model.tokenizer import TextTokenizer


@dataclass(frozen=True)
class EngineSettings:
    """One rollout replica, every choice resolved."""

    kind: Literal["native", "vllm"]
    model_dir: str
    device: str                  # "cpu" or "cuda"
    dtype: str                   # the replica's weights
    fp8: bool
    max_seq_len: int | None
    max_num_seqs: int
    kv_cache_bytes: int
    max_batch_tokens: int
    attention: str               # the native engine's decode attention: "torch", "flex" or "paged"
    seed: int
    tensor_parallel_size: int = 1
    expert_parallel: bool = False
    memory_fraction: float = 0.2


def vllm_installed() -> bool:
    """Whether vLLM can be imported here, found without importing it (its import sets process-wide state)."""
    return importlib.util.find_spec("vllm") is not None


def decode_attention(requested: str, device: str) -> str:
    """The native engine's decode attention for ``requested`` on ``device`` (auto: paged on a CPU where the kernel
    builds, else torch)."""
    return resolve_attention(requested, torch.device(device))


def replica_model(arch: ModelConfig, dtype: str, fp8: bool, device: str = "cpu") -> CausalLM:
    """An empty inference model in the fused layout and ``dtype``, block-FP8 with ``fp8`` (blocks as the
    checkpoint's when it is FP8, else 128)."""
    model = build_model(arch, device=device, dtype=getattr(torch, dtype), fused=True)
    return to_fp8(model, checkpoint_block(arch) or BLOCK) if fp8 else model


def build_engine(settings: EngineSettings, load: bool = False) -> RolloutEngine:
    """The rollout engine ``settings`` describe, for the model in ``settings.model_dir``: a native replica is empty
    (the checkpoint engine fills it) unless ``load``, which reads the directory's weights into it."""
    s = settings
    tok = TextTokenizer.load(s.model_dir)  # the same stop ids as the controller's
    if s.kind == "vllm":
        from engines.inference.vllm_engine import VllmEngine

        return VllmEngine(s.model_dir, tok.eos_ids, max_seq_len=s.max_seq_len, max_num_seqs=s.max_num_seqs,
                          dtype=s.dtype, seed=s.seed, kv_cache_bytes=s.kv_cache_bytes,
                          memory_fraction=s.memory_fraction, tensor_parallel_size=s.tensor_parallel_size,
                          expert_parallel=s.expert_parallel)
    from engines.inference.native import InferenceEngine

    model = replica_model(read_config(s.model_dir), s.dtype, s.fp8, device=s.device)
    engine = InferenceEngine(model, tok.eos_ids, tok.pad_id, max_num_seqs=s.max_num_seqs, max_seq_len=s.max_seq_len,
                             kv_cache_bytes=s.kv_cache_bytes, max_batch_tokens=s.max_batch_tokens,
                             attention=s.attention)
    if load:
        engine.load_weights(read_tensors(s.model_dir).items())
        engine.weights_loaded()
    return engine
