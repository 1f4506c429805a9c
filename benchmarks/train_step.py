"""Training-step benchmark: tokens/s, model FLOPs utilisation and peak memory of one packed micro-batch.

    python -m benchmarks.train_step --json                      # the demo model on CPU
    python -m benchmarks.train_step --model 100m --json         # the ~88M-parameter model
    python -m benchmarks.train_step --model 1b --device cuda --dtype bfloat16 --json   # Qwen3-shaped ~1 B (GPU)
    python -m benchmarks.train_step --model qwen3-1.7b --device cuda --dtype bfloat16 --variants base \
        --tokens 16384 32768 --json        # Qwen3-1.7B's shape: one JSON line per token count, one process

One step is the trainer's: a micro-batch of variable-length sequences packed by tokens with document
masking (``--tokens`` in all, lengths drawn between ``--min-len`` and ``--max-len``), response
log-probabilities scored in vocabulary chunks, max-logit tracking on, backward, Muon + AdamW step.
Variants, timed in alternation after warm-up so that load from other processes hits them alike:
``base``; ``checkpointing`` (activation checkpointing per decoder layer); ``no_smax`` (max-logit
tracking off: its cost is the ratio to ``base``); ``full_logits`` (today's loss layout: the [tokens, V]
logits materialised, for the memory comparison). Model FLOPs are ``engines.training.flops.model_flops``:
6·N·tokens (N the decoder layers' matmul weights) + attention on the document mask's causal pairs + the output
head on the scored (response) tokens; recomputation is not counted. ``mfu`` divides them by the whole step's
time, ``mfu_fwd_bwd`` by the forward and backward's alone (``fwd_bwd_s``, timed by the training engine: CUDA
events on a GPU), each against the matmul peak measured in the same run (a square GEMM in the compute dtype);
beside them the optimizer step (``optimizer_s``) with the Newton–Schulz FLOPs of its Muon step (``ns_tflop``,
``engines.training.flops.muon_flops``) per second of it. ``--compile`` compiles each decoder layer
(``engines.model.native.compile``; auto: on CUDA) and ``--dtype bfloat16`` runs FSDP2's mixed precision on one rank,
the layers kept gathered from forward to backward unless ``--reshard-after-forward true``.
Peak memory is the peak growth of live tensor memory during one step (on CPU from the profiler's
allocation records, on CUDA ``max_memory_allocated``), measured in a separate step of each variant;
``total_peak_mib`` adds what the trainer keeps between steps (weights and optimizer state, ``kept_mib``).
``--lora RANK`` trains LoRA adapters on the frozen model (AdamW), for the memory against full training;
``--lora-base-dtype bfloat16`` keeps the adapted projections' frozen weights in bfloat16, as a LoRA run does when
the checkpoint (and so the replicas) is bfloat16. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from benchmarks.rollout import MODELS, QWEN3_8B
from benchmarks.roofline import gemm_flops
from benchmarks.timing import say
from engines.device import synchronize
from engines.inference.sampling import token_logprobs
from engines.model.native.arch import ModelConfig, make_config
from engines.model.native.causal_lm import build_model, track_max_logits
from engines.model.native.compile import compile_layers
from engines.training.engine import TrainingEngine
from engines.training.flops import model_flops, muon_flops
from engines.training.optim import build_optimizers
from engines.training.packing import pack
from rl.setup.memory import ModelShape, activation_bytes, logprob_bytes

#: a Qwen3-shaped model of about 1 B parameters (Qwen3-1.7B's width, fewer layers), for the GPU case
QWEN3_1B = make_config("qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=16,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
                       tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
#: Qwen3-1.7B's shape: the issue's MFU target (0.45 of the GPU's bf16 peak at 32 K tokens)
QWEN3_1_7B = ModelConfig(model_type="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                         num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                         tie_word_embeddings=True, rope_theta=1_000_000.0, max_position_embeddings=40960)
CONFIGS = {**MODELS, "1b": QWEN3_1B, "qwen3-1.7b": QWEN3_1_7B, "qwen3-8b": QWEN3_8B}
#: tokens per micro-batch and the sequence lengths drawn, per model (every model --model accepts has one)
WORKLOADS = {"demo": (8192, 40, 120), "100m": (2048, 128, 512), "qwen3-0.6b": (8192, 256, 1024),
             "1b": (16384, 512, 4096), "qwen3-1.7b": (32768, 512, 4096), "qwen3-8b": (4096, 512, 4096)}
VARIANTS = ("base", "checkpointing", "no_smax", "full_logits")


def make_batch(tokens: int, min_len: int, max_len: int, vocab: int, seed: int = 0):
    """Prompts and responses (half each, at least one token) of lengths in [min_len, max_len], ``tokens`` in all."""
    rng = random.Random(seed)
    prompts, responses, total = [], [], 0
    while total < tokens:
        n = min(rng.randint(min_len, max_len), tokens - total)
        if n < 2:
            break
        p = max(1, n // 2)
        prompts.append([rng.randrange(2, vocab) for _ in range(p)])
        responses.append([rng.randrange(2, vocab) for _ in range(n - p)])
        total += n
    return prompts, responses


def batch_flops(cfg: ModelConfig, prompts, responses) -> int:
    """Model FLOPs of training on the batch (``engines.training.flops.model_flops``): every token through the
    layers, the head on the response tokens, which are all the step scores."""
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    return model_flops(cfg, lengths, scored=sum(map(len, responses)))


def _step(engine: TrainingEngine, prompts, responses, variant: str) -> None:
    model = engine.model
    model.activation_checkpointing = variant == "checkpointing"
    track_max_logits(model, variant != "no_smax")
    n = sum(map(len, responses))
    if variant == "full_logits":
        batch = pack(prompts, responses, engine.pad_id, engine.attention).to(engine.device)
        engine.mark_forward()  # the engine times the forwards it runs; this one runs the model itself
        logits = model(batch.ids, batch.positions, batch.mask)
        lp = token_logprobs(logits, 1.0).gather(-1, batch.targets.clamp(min=0)[..., None]).squeeze(-1)
        loss = -(lp * (batch.targets >= 0)).sum() / n
    else:
        loss = -engine.score(prompts, responses, 1.0).logprobs.sum() / n
    loss.backward()
    engine.step()


def peak_tensor_bytes(fn, *args) -> int:
    """Peak growth of live tensor memory while ``fn(*args)`` runs on CPU: every allocation and free the profiler
    records, summed in time order (the allocator's caching and the process's RSS do not enter)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn(*args)
    live = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def _timed(engine: TrainingEngine, prompts, responses, variant: str) -> tuple[float, dict[str, float]]:
    """The step's wall time between device synchronisations, and the engine's own timing of its parts
    (``fwd_bwd_s``, ``optimizer_s``)."""
    synchronize(engine.device)
    t0 = time.perf_counter()
    _step(engine, prompts, responses, variant)
    synchronize(engine.device)
    return time.perf_counter() - t0, engine.step_metrics.seconds()


def _peak_memory(engine: TrainingEngine, prompts, responses, variant: str) -> int:
    dev = engine.device
    if dev.type == "cuda":
        synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        _step(engine, prompts, responses, variant)
        synchronize(dev)
        return torch.cuda.max_memory_allocated(dev) - base
    return peak_tensor_bytes(_step, engine, prompts, responses, variant)


def build(model_name: str, device: str = "cpu", dtype: str = "float32", seed: int = 0, lora: int = 0,
          lora_base_dtype: str = "float32", compile: bool = False,
          reshard_after_forward: bool | None = None) -> TrainingEngine:
    """The model of ``model_name`` on ``device`` in a training engine (Muon + AdamW; with ``lora``, AdamW on LoRA
    adapters of that rank on the frozen model, alpha 2·rank, default targets, their projections' weights in
    ``lora_base_dtype``): float32 master weights, a ``dtype`` of bfloat16 computing through FSDP2's mixed precision
    on one rank as the trainer does; ``compile``: each decoder layer compiled first."""
    dev = torch.device(device)
    cfg = CONFIGS[model_name]
    torch.manual_seed(seed)
    model = build_model(cfg, device=dev, init=True)  # drawn where it lives: an 8 B model never passes the host
    if compile:
        compile_layers(model)
    if dtype != "float32":  # float32 master weights, bf16 compute: FSDP's mixed precision, as the trainer
        from checkpoint_engine.topology import free_port
        from engines.training.distributed import init_distributed, shard_model

        init_distributed(0, 1, f"tcp://127.0.0.1:{free_port()}", device=device)
        model = shard_model(model, param_dtype=dtype, reshard_after_forward=reshard_after_forward)
    if lora:
        from engines.model.lora.adapters import LoraSpec, apply_lora, default_targets

        apply_lora(model, LoraSpec(lora, 2.0 * lora, target_modules=default_targets(cfg)), torch.float32,
                   torch.Generator(device=dev).manual_seed(seed), base_dtype=getattr(torch, lora_base_dtype))
    return TrainingEngine(model, build_optimizers(model, "adamw" if lora else "muon", 1e-4, 0.0), pad_id=0)


def measure(model_name: str, repeats: int = 3, warmup: int = 1, device: str = "cpu", dtype: str = "float32",
            tokens: int | None = None, seed: int = 0, variants: tuple[str, ...] = VARIANTS, lora: int = 0,
            lora_base_dtype: str = "float32", compile: bool = False,
            reshard_after_forward: bool | None = None) -> dict:
    """Build the model, time every variant ``repeats`` times in alternation; returns the JSON record (``measure_all``
    of one token count)."""
    return measure_all(model_name, repeats, warmup, device, dtype, [tokens], seed, variants, lora, lora_base_dtype,
                       compile, reshard_after_forward)[0]


def measure_all(model_name: str, repeats: int = 3, warmup: int = 1, device: str = "cpu", dtype: str = "float32",
                token_counts: list[int | None] | None = None, seed: int = 0, variants: tuple[str, ...] = VARIANTS,
                lora: int = 0, lora_base_dtype: str = "float32", compile: bool = False,
                reshard_after_forward: bool | None = None) -> list[dict]:
    """One model built once (``build``), then for each of ``token_counts`` (None: the model's workload) a batch of
    that many tokens whose variants are timed ``repeats`` times in alternation after ``warmup``; one JSON record
    per token count."""
    engine = build(model_name, device, dtype, seed, lora, lora_base_dtype, compile, reshard_after_forward)
    model = engine.model
    say("train_step", f"{model_name} built on {device}" + (" (layers compiled)" if compile else ""))
    peak_flops = gemm_flops(engine.device, getattr(torch, dtype))
    head = {"model": model_name, "device": device, "dtype": dtype, "threads": torch.get_num_threads(),
            "compile": compile, "reshard_after_forward": _resharded(model), "lora_rank": lora,
            "lora_base_dtype": lora_base_dtype if lora else None}
    return [_measure_tokens(engine, head, n, repeats, warmup, seed, variants, peak_flops)
            for n in (token_counts or [None])]


def _resharded(model) -> bool | None:
    """Whether a sharded ``model``'s layers free their gathered copies after the forward (None: not sharded)."""
    from engines.training.distributed import is_sharded

    if not is_sharded(model):
        return None
    return bool(model.model.layers[0]._get_fsdp_state()._fsdp_param_group._reshard_after_forward)


def _measure_tokens(engine: TrainingEngine, head: dict, tokens: int | None, repeats: int, warmup: int,
                    seed: int, variants: tuple[str, ...], peak_flops: float) -> dict:
    """The record of one batch of ``tokens`` (``head``: the fields it starts with, the model's name first)."""
    model_name = head["model"]
    model, cfg = engine.model, CONFIGS[model_name]
    n_tok, lo, hi = WORKLOADS[model_name]
    prompts, responses = make_batch(tokens or n_tok, lo, hi, cfg.vocab_size, seed)
    say("train_step", f"{len(prompts)} sequences, {sum(map(len, prompts)) + sum(map(len, responses))} tokens")
    times: dict[str, list[float]] = {v: [] for v in variants}
    parts: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    first: dict[str, float] = {}  # the first step's seconds: compiles (flex_attention, on a GPU) included
    for i in range(warmup + repeats):
        for v in variants:
            t, part = _timed(engine, prompts, responses, v)
            say("train_step", f"{v} step {i + 1}/{warmup + repeats}: {t:.3f} s (forward+backward "
                f"{part.get('fwd_bwd_s', 0):.3f} s, optimizer {part['optimizer_s']:.3f} s)"
                + (" (warm-up)" if i < warmup else ""))
            if i >= warmup:
                times[v].append(t)
                parts[v].append(part)
            first.setdefault(v, t)
    peaks = {v: _peak_memory(engine, prompts, responses, v) for v in variants}  # apart: the profiler slows steps
    # what the trainer keeps between steps: weights and optimizer state (LoRA: a frozen base, the adapters' state)
    kept = sum(t.numel() * t.element_size() for t in model.parameters()) + sum(
        t.numel() * t.element_size() for opt in engine.optimizers for st in opt.state.values() for t in st.values()
        if isinstance(t, torch.Tensor))
    say("train_step", "peak memory measured")
    flops = batch_flops(cfg, prompts, responses)
    ns = muon_flops(engine.optimizers)
    total = sum(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    shape = ModelShape.of(cfg)
    out = {**head, "params": sum(p.numel() for p in model.parameters()), "tokens": total, "sequences": len(prompts),
           "scored_tokens": sum(map(len, responses)), "attention": engine.attention,
           "model_tflop": round(flops / 1e12, 4), "ns_tflop": round(ns / 1e12, 4),
           "matmul_peak_tflops": round(peak_flops / 1e12, 4), "repeats": repeats,
           "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
           "kept_mib": round(kept / 2**20, 1)}
    for v in variants:
        step = statistics.median(times[v])
        fwd_bwd = statistics.median(p.get("fwd_bwd_s", 0.0) for p in parts[v])
        opt = statistics.median(p["optimizer_s"] for p in parts[v])
        out[v] = {"step_s": round(step, 4), "tokens_per_s": round(total / step, 1),
                  "mfu": round(flops / step / peak_flops, 4), "peak_mem_mib": round(peaks[v] / 2**20, 1),
                  "total_peak_mib": round((kept + peaks[v]) / 2**20, 1),
                  "all_s": [round(t, 4) for t in times[v]], "first_step_s": round(first[v], 4),
                  "compile_s_est": round(max(first[v] - step, 0.0), 4),
                  "fwd_bwd_s": round(fwd_bwd, 4), "optimizer_s": round(opt, 4),
                  "mfu_fwd_bwd": round(flops / fwd_bwd / peak_flops, 4) if fwd_bwd > 0 else None,
                  "ns_tflops_per_s": round(ns / opt / 1e12, 4) if opt > 0 else None,
                  "ns_mfu": round(ns / opt / peak_flops, 4) if opt > 0 else None}
    # the ratios need the base variant measured beside them
    if "no_smax" in variants and "base" in out:
        out["smax_overhead"] = round(out["base"]["step_s"] / out["no_smax"]["step_s"] - 1, 4)
    if "full_logits" in variants and "base" in out and peaks["full_logits"]:
        out["peak_mem_chunked_over_full"] = round(peaks["base"] / peaks["full_logits"], 3)
    if "checkpointing" in variants and "base" in out and peaks["base"]:
        out["peak_mem_checkpointing_over_base"] = round(peaks["checkpointing"] / peaks["base"], 3)
    cb = getattr(torch, head["dtype"]).itemsize
    out["predicted_activations_mib"] = {
        "base": round((activation_bytes(shape, total, cb, False) + logprob_bytes(total, cfg.vocab_size)) / 2**20, 1),
        "checkpointing": round((activation_bytes(shape, total, cb, True) + logprob_bytes(total, cfg.vocab_size))
                               / 2**20, 1)}
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    """Command-line entry point; prints a summary and, with --json, one JSON record per token count (the last
    lines)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(CONFIGS), default="demo")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="compute dtype")
    ap.add_argument("--tokens", type=int, nargs="+", help="tokens per micro-batch, one record each, in one process "
                    f"(default per model: {WORKLOADS})")
    ap.add_argument("--repeats", type=int, default=3, help="timed steps per variant, median reported")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    ap.add_argument("--compile", choices=["auto", "true", "false"], default="auto",
                    help="compile each decoder layer (trainer.compile); auto: on CUDA")
    ap.add_argument("--reshard-after-forward", choices=["auto", "true", "false"], default="auto",
                    help="with --dtype bfloat16: free each layer's gathered copy after its forward (auto: not on one "
                         "rank, as the trainer)")
    ap.add_argument("--lora", type=int, default=0, metavar="RANK", help="train LoRA adapters of RANK on the frozen "
                    "model (AdamW) instead of every weight")
    ap.add_argument("--lora-base-dtype", choices=["float32", "bfloat16"], default="float32",
                    help="with --lora: the dtype the adapted projections' frozen weights are kept in")
    ap.add_argument("--json", action="store_true", help="print the JSON records as the last lines")
    args = ap.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        ap.error("--repeats must be >= 1 and --warmup >= 0")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here")
    if args.threads:
        torch.set_num_threads(args.threads)
    compiled = args.device.startswith("cuda") if args.compile == "auto" else args.compile == "true"
    reshard = None if args.reshard_after_forward == "auto" else args.reshard_after_forward == "true"
    recs = measure_all(args.model, args.repeats, args.warmup, args.device, args.dtype, args.tokens,
                       variants=tuple(args.variants), lora=args.lora, lora_base_dtype=args.lora_base_dtype,
                       compile=compiled, reshard_after_forward=reshard)
    for rec in recs:
        print(f"model {rec['model']}: {rec['params'] / 1e6:.1f}M params, {rec['tokens']} tokens in "
              f"{rec['sequences']} sequences ({rec['attention']}), matmul peak "
              f"{rec['matmul_peak_tflops'] * 1e3:.1f} GFLOP/s, Newton–Schulz {rec['ns_tflop'] * 1e3:.1f} GFLOP/step")
        for v in args.variants:
            r = rec[v]
            print(f"  {v:<14} {r['step_s']:8.3f} s/step  {r['tokens_per_s']:10.1f} tok/s  MFU {r['mfu']:.3f}  "
                  f"fwd+bwd {r['fwd_bwd_s']:.3f} s (MFU {r['mfu_fwd_bwd'] or 0:.3f})  optimizer "
                  f"{r['optimizer_s']:.3f} s (NS {(r['ns_tflops_per_s'] or 0) * 1e3:.1f} GFLOP/s)  "
                  f"peak {r['peak_mem_mib']:.0f} MiB")
    if args.json:
        for rec in recs:
            print(json.dumps(rec))
    return recs


if __name__ == "__main__":
    main()
