"""Build a rollout engine from resolved settings, so callers name an engine kind instead of importing engines.

``EngineSettings`` holds every choice already made (no "auto" left: the caller resolves the engine kind, the
device and the decode attention, e.g. with ``decode_attention``); ``build_engine`` loads the model directory's
tokenizer (EOS and pad ids, and the text of stop strings) and builds the native engine over an empty replica in
the fused inference layout, or a vLLM engine over the directory. ``replica_model`` is that empty replica, which
the trainer side also builds on the meta device to plan the weight update.

    settings = EngineSettings(kind="native", model_dir="runs/demo/warmstart", device="cpu", dtype="float32",
                              fp8=False, max_seq_len=None, max_num_seqs=64, kv_cache_bytes=64 << 20,
                              max_batch_tokens=8192, attention=decode_attention("auto", "cpu"), seed=0)
    engine = build_engine(settings, load_checkpoint=True)
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Literal

import torch

from engines.inference.base import RolloutEngine
from engines.inference.capabilities import CAPABILITIES, EngineCapabilities, capabilities_of, kinds_with
from engines.inference.kv_cache import BACKENDS, decode_attention
from engines.inference.vllm_engine import VllmUnavailableError, vllm_available
from engines.inference.vllm_setup import vllm_build
from engines.model.io.hf_io import load_pretrained, read_config
from engines.model.layout import hub_state
from engines.model.lora.adapters import check_adapter, read_adapter
from engines.model.native.arch import ModelConfig
from engines.model.native.causal_lm import CausalLM, build_model
from engines.model.native.fp8 import BLOCK, checkpoint_block, to_fp8
from engines.model.text.tokenizer import TextTokenizer

__all__ = ["DTYPES", "EngineSettings", "VllmUnavailableError", "build_engine", "decode_attention", "replica_model",
           "vllm_available", "vllm_build", "vllm_installed"]

#: The weight dtypes a replica may have, by their torch names.
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """One rollout replica, every choice resolved.

    ``kind``: the engine; ``model_dir``: a Hugging Face-format directory (config, tokenizer, and for vLLM or
    ``load_checkpoint`` the weights); ``device``: "cpu" or "cuda"; ``dtype``: the replica's weights (a torch
    dtype name), block-FP8 with ``fp8`` (native only); ``max_seq_len``: prompt + response tokens one sequence may
    hold (None: the model's context); at most ``max_num_seqs`` sequences decode at once, and a native step
    computes at most ``max_batch_tokens`` tokens; ``kv_cache_bytes``: the KV cache's budget; ``attention``: the
    native decode backend ("torch", "flex" or "paged"; ``decode_attention`` resolves "auto"); ``seed``: what
    requests without a seed derive theirs from; ``tensor_parallel_size``, ``expert_parallel``,
    ``memory_fraction`` (of device memory vLLM may take) and ``prefix_caching`` (off for hybrid models on vLLM's CPU
    build, which caches their recurrent states only with chunked prefill) are vLLM's, and so is ``ipc_views``: updates
    load from views of the checkpoint engine's IPC buffers on the replica's device, no host copy of the weights kept
    (``rl.settings`` turns it on for vLLM on a GPU; ``engines.inference.vllm_engine`` says what it changes).
    ``self_check``: a run's replica checks itself as it starts (``engines.inference.replica_check``: it can run the
    model, and on a CPU vLLM replica whose layers an update rebuilds, in-place updates reach them as the trainer's
    weights), and any failure of its start-up is one line naming the model (``ReplicaCheckError``).
    ``record_routes``: an MoE replica reports each token's experts with its completions (routing replay).
    ``decode_steps``: the native engine's decode forwards per host read (multi-step decoding); ``compiled``: its
    decoder layers compiled (``engines.model.native.compile``).
    ``adapter``: a PEFT LoRA adapter directory served on top of ``model_dir``'s weights (with ``load_checkpoint``):
    the native engine merges it into its weights (``merge_adapters``), vLLM applies it to every request (its LoRA).
    (A LoRA run's adapter updates, merged or as low-rank deltas, are what the replica's sink does with them:
    ``checkpoint_engine.sinks.make_sink``.)
    """

    kind: Literal["native", "vllm"]
    model_dir: str
    device: str
    dtype: str
    fp8: bool
    max_seq_len: int | None
    max_num_seqs: int
    kv_cache_bytes: int
    max_batch_tokens: int
    attention: str
    seed: int
    tensor_parallel_size: int = 1
    expert_parallel: bool = False
    memory_fraction: float = 0.2
    prefix_caching: bool = True
    ipc_views: bool = False
    self_check: bool = False
    adapter: str | None = None
    record_routes: bool = False
    decode_steps: int = 1
    compiled: bool = False

    def __post_init__(self) -> None:
        problems = []
        try:
            caps = capabilities_of(self.kind)
        except ValueError:
            caps = None
            problems.append(f"kind must be {' or '.join(CAPABILITIES)}, got {self.kind!r}")
        if self.device not in ("cpu", "cuda"):
            problems.append(f"device must be cpu or cuda, got {self.device!r}")
        if self.dtype not in DTYPES:
            problems.append(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.attention not in BACKENDS:
            problems.append(f"attention must be resolved to one of {', '.join(BACKENDS)} (decode_attention picks "
                            f"for auto), got {self.attention!r}")
        elif self.attention == "paged" and self.device != "cpu":
            problems.append(f"attention 'paged' is the CPU decode kernel; on {self.device} use torch or flex")
        if self.decode_steps > 1 and caps is not None and not caps.multi_step_decode:
            problems.append(f"decode_steps {self.decode_steps}: the {self.kind} engine schedules its own steps "
                            "(multi-step decoding is the native engine's)")
        if self.compiled and caps is not None and not caps.compiled_layers:
            problems.append(f"compiled: the {self.kind} engine compiles its own model (compiled layers are the "
                            "native engine's)")
        for name in ("max_num_seqs", "kv_cache_bytes", "max_batch_tokens", "tensor_parallel_size", "decode_steps"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_seq_len is not None and self.max_seq_len < 1:
            problems.append(f"max_seq_len must be at least 1 or None, got {self.max_seq_len}")
        if not 0 < self.memory_fraction <= 1:
            problems.append(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.adapter is not None and self.fp8:
            problems.append("a LoRA adapter is merged into unquantized weights; serve it without fp8")
        if self.adapter is not None and self.ipc_views:
            problems.append("a LoRA adapter is served on the model directory's weights, not on ipc_views updates")
        if caps is not None:  # what the engine declares it supports (engines.inference.capabilities)
            problems += _unsupported(self, caps)
        if problems:
            raise ValueError("engine settings: " + "; ".join(problems))


def _unsupported(s: EngineSettings, caps: EngineCapabilities) -> list[str]:
    """What ``s`` asks of its engine kind that the kind's declaration lacks, one phrase each."""
    problems = []
    if not caps.tensor_parallel and (s.tensor_parallel_size > 1 or s.expert_parallel):
        problems.append(f"tensor and expert parallel replicas need the {' or '.join(kinds_with('tensor_parallel'))} "
                        "engine")
    if not caps.fp8 and s.fp8:
        problems.append(f"fp8 replicas are served by the {' or '.join(kinds_with('fp8'))} engine only")
    if not caps.routing_capture and s.record_routes:
        problems.append(f"MoE routes are recorded by the {' or '.join(kinds_with('routing_capture'))} engine only")
    if not caps.ipc_views and s.ipc_views:
        problems.append("ipc_views is vLLM's (the native engine's receiver writes into its tensors on the device)")
    return problems


def vllm_installed() -> bool:
    """Whether vLLM is installed here, found without importing it (its import sets process-wide state, such as
    single-threaded inductor compiles, in a process that may only train); ``vllm_build`` says which build."""
    return importlib.util.find_spec("vllm") is not None


def replica_model(arch: ModelConfig, dtype: str | torch.dtype, fp8: bool, device: str | torch.device) -> CausalLM:
    """An empty inference model of ``arch`` in the fused layout and ``dtype`` on ``device`` ("meta": no memory),
    block-FP8 with ``fp8`` (blocks as the checkpoint's when it is FP8, else 128)."""
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    model = build_model(arch, device=device, dtype=dtype, fused=True)
    return to_fp8(model, checkpoint_block(arch) or BLOCK) if fp8 else model


def build_engine(settings: EngineSettings, *, load_checkpoint: bool = False) -> RolloutEngine:
    """The rollout engine ``settings`` describe. A native one starts from an empty replica (the trainers' start-up
    read or the first update fills it) unless ``load_checkpoint`` reads ``model_dir``'s weights into it; so does
    vLLM with ``ipc_views`` (placeholder weights), which otherwise loads them from ``model_dir``. With an
    ``adapter`` the engine serves base + adapter (ValueError in one line for an adapter the model cannot take)."""
    s = settings
    adapter = None
    if s.adapter is not None:
        if not load_checkpoint:
            raise ValueError("a LoRA adapter is served on the model directory's weights: build with load_checkpoint")
        adapter = read_adapter(s.adapter)
        # checked on the meta model, by checkpoint names, before any weight is read
        check_adapter(adapter, hub_state(build_model(read_config(s.model_dir), device="meta")), s.model_dir)
    tok = TextTokenizer.load(s.model_dir)  # the same stop ids as the controller's

    def detokenize(ids: list[int]) -> str:
        return tok.hf.decode(ids, skip_special_tokens=True)

    if s.kind == "vllm":
        return _vllm_engine(s, tok, adapter, load_checkpoint)
    from engines.inference.native import InferenceEngine

    if load_checkpoint:  # the same replica, filled (an FP8 one quantised from a checkpoint that is not)
        model = load_pretrained(s.model_dir, getattr(torch, s.dtype), s.device, fused=True, fp8=s.fp8)
    else:
        model = replica_model(read_config(s.model_dir), s.dtype, s.fp8, s.device)
    engine = InferenceEngine(model, tok.eos_ids, tok.pad_id, max_num_seqs=s.max_num_seqs,
                             max_seq_len=s.max_seq_len, kv_cache_bytes=s.kv_cache_bytes,
                             max_batch_tokens=s.max_batch_tokens, seed=s.seed, detokenize=detokenize,
                             attention=s.attention, record_routes=s.record_routes, decode_steps=s.decode_steps,
                             compiled=s.compiled)
    if adapter is not None:  # W0 + (alpha/r)·B·A, as PEFT computes it; served for good, so no base copy is kept
        engine.merge_adapters(adapter.tensors, adapter.spec.scaling, keep_base=False)
    return engine


def _vllm_engine(s: EngineSettings, tok: TextTokenizer, adapter, load_checkpoint: bool) -> RolloutEngine:
    """A vLLM replica of ``s``; with ``s.self_check`` checked as it starts (``engines.inference.replica_check``),
    and any start-up failure one line naming the model (``ReplicaCheckError``)."""
    from engines.inference.replica_check import ReplicaCheckError, check_updates, served_by_vllm
    from engines.inference.vllm_engine import VllmEngine

    try:
        engine = VllmEngine(s.model_dir, tok.eos_ids, max_seq_len=s.max_seq_len, max_num_seqs=s.max_num_seqs,
                            dtype=s.dtype, seed=s.seed, kv_cache_bytes=s.kv_cache_bytes,
                            memory_fraction=s.memory_fraction, tensor_parallel_size=s.tensor_parallel_size,
                            expert_parallel=s.expert_parallel, prefix_caching=s.prefix_caching, device=s.device,
                            ipc_views=s.ipc_views, fill_later=not load_checkpoint,
                            adapter=None if adapter is None else (s.adapter, adapter.spec.rank),
                            record_routes=s.record_routes)
    except Exception as e:
        if not s.self_check:
            raise
        model_type, architecture = model_names(s.model_dir)
        text = (str(e).strip().splitlines() or ["(no message)"])[0]
        raise ReplicaCheckError(f"vLLM on {s.device} cannot start {model_type} ({architecture}): "
                                f"{type(e).__name__}: {text}") from e
    if s.self_check and not s.ipc_views:  # placeholder weights (ipc_views) are not served before the first update
        model_type, architecture = model_names(s.model_dir)
        served_by_vllm(engine, model_type, architecture)
        if engine.weight_load == "reload":  # layers an update rebuilds: MoE, latent attention
            check_updates(engine, s.model_dir, model_type)
    return engine


def model_names(model_dir: str) -> tuple[str, str]:
    """(model_type, first architecture) of the config.json in ``model_dir`` ("unknown" where it has none)."""
    import json
    from pathlib import Path

    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    return str(config.get("model_type", "unknown")), str((config.get("architectures") or ["unknown"])[0])
