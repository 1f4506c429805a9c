"""Rollout benchmark: the native inference engine against Hugging Face ``generate`` on one workload.

    python -m benchmarks.rollout --workload rl --json    # RL-shaped: varied prompts, K samples, long tail
    python -m benchmarks.rollout --json                  # fixed lengths, the demo model
    python -m benchmarks.rollout --model 100m --json     # a ~100M-parameter model

Both generate the same workload in one run, with the same weights and dtype (the model is saved in
Hugging Face format and loaded by ``transformers``). The fixed workload: ``--prompts`` prompts x
``--samples`` samples, fixed prompt and output lengths (EOS ignored), the same sampling parameters.
The RL workload is described in ``benchmarks.rollout_rl``. Throughput counts generated tokens per
second of wall time, prefill included. Memory (fixed workload) is the peak RSS growth during
generation divided by the tokens in flight at the peak (prompt + output of every sequence), in MiB
per 1k tokens. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from benchmarks.rollout_rl import KV_MEMORY_FRACTION, measure_rl
from benchmarks.timing import say
from engines.device import peak_memory_bytes, reset_peak_memory, synchronize
from engines.inference.kv_cache import bytes_per_slot
from engines.inference.native import InferenceEngine
from engines.inference.sampling import SamplingParams
from engines.model.io.hf_io import load_pretrained, save_pretrained
from engines.model.native.arch import ModelConfig
from engines.model.native.causal_lm import CausalLM

#: Architectures the benchmark builds (random weights: throughput does not depend on them).
MODELS = {
    # the quick-start model (configs/quickstart.yaml, warmstart.architecture)
    "demo": ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128),
    # about 100M parameters, Llama-style proportions
    "100m": ModelConfig(vocab_size=8192, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                        num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=1024),
    # Qwen3-0.6B's shape (a GPU workload)
    "qwen3-0.6b": ModelConfig(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                              num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                              tie_word_embeddings=True, rope_theta=1_000_000.0, max_position_embeddings=40960),
}
DEFAULT_LENGTHS = {"demo": (32, 64), "100m": (128, 128), "qwen3-0.6b": (512, 512)}


def peak_rss_growth(fn: Callable[..., Any], *args: Any) -> tuple[Any, int]:
    """Run ``fn(*args)``; returns (its result, peak RSS above the RSS before the call, in bytes)."""
    cpu = torch.device("cpu")
    reset_peak_memory(cpu)
    before = peak_memory_bytes(cpu)  # right after a reset: the current RSS
    result = fn(*args)
    return result, max(0, peak_memory_bytes(cpu) - before)


def workload(n_prompts: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n_prompts, prompt_len), generator=g).tolist()



def run_engine(model: CausalLM, prompts, samples: int, output_len: int, temperature: float,
               cuda_graphs: bool = True, attention: str = "auto"):
    seq, n = len(prompts[0]) + output_len, len(prompts) * samples
    p = next(model.parameters())
    per_seq = bytes_per_slot(model.config, seq, p.dtype)
    engine = InferenceEngine(model, eos_id=1, pad_id=0, max_seq_len=seq, max_num_seqs=n, kv_cache_bytes=per_seq * n,
                             cuda_graphs=cuda_graphs, kv_memory_fraction=KV_MEMORY_FRACTION, attention=attention)
    params = SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=True)
    # warm-up: first-call allocations, and on a GPU the graphs of every batch size the run meets
    engine.generate([q for q in prompts for _ in range(samples)], replace(params, max_tokens=2))
    engine.generate(prompts[:2], params)
    synchronize(p.device)
    t0 = time.perf_counter()
    outs = engine.generate([p for p in prompts for _ in range(samples)], params)
    synchronize(p.device)
    elapsed = time.perf_counter() - t0
    assert all(len(o.token_ids) == output_len for o in outs)
    return elapsed, engine.kv_cache_bytes, engine.attention


def run_hf(model_dir: str, dtype: torch.dtype, prompts, samples: int, output_len: int, temperature: float,
           device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval().to(device)
    ids = torch.tensor(prompts, device=device)
    kw = dict(do_sample=temperature > 0, temperature=temperature if temperature > 0 else None, top_k=0, top_p=1.0,
              max_new_tokens=output_len, min_new_tokens=output_len, pad_token_id=0, eos_token_id=1)
    with torch.no_grad():
        model.generate(ids[:2], attention_mask=torch.ones_like(ids[:2]), num_return_sequences=1, **kw)
        synchronize(ids.device)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), num_return_sequences=samples, **kw)
        synchronize(ids.device)
        elapsed = time.perf_counter() - t0
    assert out.shape == (len(prompts) * samples, ids.shape[1] + output_len)
    return elapsed


def measure(model_name: str, prompts_n: int, samples: int, prompt_len: int, output_len: int, *,
            dtype: str = "float32", temperature: float = 1.0, threads: int | None = None,
            skip_hf: bool = False, device: str = "cpu", attention: str = "auto") -> dict:
    """One benchmark record (also printed as the JSON line)."""
    torch.set_num_threads(threads or os.cpu_count() or 1)
    cfg = MODELS[model_name]
    if prompt_len + output_len > cfg.max_position_embeddings:
        raise SystemExit(f"prompt_len + output_len = {prompt_len + output_len} exceeds the {model_name} model's "
                         f"context of {cfg.max_position_embeddings}")
    if min(prompts_n, samples, prompt_len, output_len) < 1:
        raise SystemExit("--prompts, --samples, --prompt-len and --output-len must be >= 1")
    torch.manual_seed(0)
    tdtype = getattr(torch, dtype)
    prompts = workload(prompts_n, prompt_len, cfg.vocab_size)
    tokens = prompts_n * samples * output_len
    in_flight = prompts_n * samples * (prompt_len + output_len)
    with tempfile.TemporaryDirectory() as d:
        save_pretrained(CausalLM(cfg), None, d)
        model = load_pretrained(d, tdtype).to(device)
        params = sum(p.numel() for p in model.parameters())
        (engine_s, kv_bytes, backend), engine_rss = peak_rss_growth(run_engine, model, prompts, samples,
                                                                    output_len, temperature, True, attention)
        # on a GPU the same engine without CUDA graphs, as the graphs' peer
        eager_s = run_engine(model, prompts, samples, output_len, temperature, False, attention)[0] \
            if device == "cuda" else None
        del model  # HF loads its own copy
        hf_s, hf_rss = (None, None) if skip_hf else peak_rss_growth(run_hf, d, tdtype, prompts, samples,
                                                                     output_len, temperature, device)
    rec = {
        "model": model_name,
        "params": params,
        "engine_tok_s": round(tokens / engine_s, 1),
        "hf_generate_tok_s": None if hf_s is None else round(tokens / hf_s, 1),
        "speedup": None if hf_s is None else round(hf_s / engine_s, 3),
        "engine_s": round(engine_s, 3),
        "hf_generate_s": None if hf_s is None else round(hf_s, 3),
        "engine_peak_rss_mib_per_1k_tokens": round(engine_rss / 2**20 / (in_flight / 1000), 3),
        "hf_peak_rss_mib_per_1k_tokens": None if hf_rss is None else round(hf_rss / 2**20 / (in_flight / 1000), 3),
        "kv_cache_mib": round(kv_bytes / 2**20, 1),
        "attention": backend,
        "prompts": prompts_n,
        "samples": samples,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "dtype": dtype,
        "temperature": temperature,
        "threads": torch.get_num_threads(),
        "device": device,
        **({"engine_eager_tok_s": round(tokens / eager_s, 1), "cuda_graph_speedup": round(eager_s / engine_s, 3)}
           if eager_s else {}),
    }
    return rec


def rl_record(model_name: str, prompts_n: int, samples: int, *, dtype: str = "float32", threads: int | None = None,
              skip_hf: bool = False, device: str = "cpu", attention: str = "auto",
              longest: int | None = None) -> dict:
    """The RL-workload record (``benchmarks.rollout_rl``) of a random-weight model of ``model_name``."""
    torch.set_num_threads(threads or os.cpu_count() or 1)
    torch.manual_seed(0)
    tdtype = getattr(torch, dtype)
    with tempfile.TemporaryDirectory() as d:
        save_pretrained(CausalLM(MODELS[model_name]), None, d)
        model = load_pretrained(d, tdtype).to(device)
        say("rollout", f"{model_name} built, saved and loaded on {device}")
        return measure_rl(model, d, model_name, prompts_n, samples, dtype=tdtype, device=device, skip_hf=skip_hf,
                          attention=attention, longest=longest)


def engines_record(model_name: str, prompts_n: int, samples: int, *, dtype: str = "float32",
                   threads: int | None = None, device: str = "cpu") -> dict:
    """The RL workload on the native engine and on vLLM, same weights, prompts and forced output lengths, on the same
    device and alike: both with CUDA graphs of their decode steps on a GPU, both eager on a CPU (the record's
    ``native_mode`` and ``vllm_mode`` say which ran)."""
    from benchmarks.rollout_rl import RL_LENGTHS, draw_workload, run_engine_rl, run_vllm_rl

    torch.set_num_threads(threads or os.cpu_count() or 1)
    torch.manual_seed(0)
    tdtype = getattr(torch, dtype)
    cfg = MODELS[model_name]
    lo, hi, max_out = RL_LENGTHS[model_name]
    prompts, lengths = draw_workload(prompts_n, samples, (lo, hi), max_out, cfg.vocab_size)
    max_seq = hi + max_out
    with tempfile.TemporaryDirectory() as d:
        save_pretrained(CausalLM(cfg), None, d)
        model = load_pretrained(d, tdtype).to(device)
        graphs = device == "cuda"
        native_s, native_out, engine = run_engine_rl(model, prompts, lengths, 512 << 20, max_seq, cuda_graphs=graphs)
        native_captures = engine.run_stats.get("cuda_graph_captures", 0)
        del engine
        vllm_s, vllm_out, vllm_mode = run_vllm_rl(d, tdtype, prompts, lengths, max_seq, graphs=graphs)
    tokens = sum(map(len, native_out))
    same = sum(a == b for a, b in zip(native_out, vllm_out, strict=True))
    return {"benchmark": "rollout_engines", "model": model_name, "params": sum(p.numel() for p in model.parameters()),
            "dtype": dtype, "threads": torch.get_num_threads(), "prompts": prompts_n, "samples": samples,
            "tokens": tokens, "native_tok_s": round(tokens / native_s, 1),
            "vllm_tok_s": round(sum(map(len, vllm_out)) / vllm_s, 1),
            "native_over_vllm": round((tokens / native_s) / (sum(map(len, vllm_out)) / vllm_s), 3),
            "same_tokens": same == len(native_out), "identical_sequences": same, "sequences": len(native_out),
            "device": device, "native_mode": "graphs" if graphs else "eager", "native_graph_captures": native_captures,
            "vllm_mode": vllm_mode}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--workload", choices=["fixed", "rl"], default="fixed",
                    help="fixed lengths (default) or the RL shape: varied prompts, K samples, long-tailed outputs")
    ap.add_argument("--model", choices=sorted(MODELS), default="demo")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8, help="responses per prompt")
    ap.add_argument("--prompt-len", type=int, help="tokens per prompt (default: 32 demo, 128 for 100m)")
    ap.add_argument("--output-len", type=int, help="tokens per response (default: 64 demo, 128 for 100m); with "
                    "--workload rl the longest response (default: 64 demo, 256 100m, 2048 qwen3-0.6b)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, help="torch threads (default: all cores)")
    ap.add_argument("--skip-hf", action="store_true", help="time only the engine")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (on cuda the engine also runs without CUDA graphs)")
    ap.add_argument("--json", action="store_true", help="print only the JSON record")
    ap.add_argument("--attention", choices=["auto", "torch", "flex", "paged"], default="auto",
                    help="the native engine's attention over the paged KV cache (auto: the CPU kernel on a CPU)")
    ap.add_argument("--engine", choices=["native", "both"], default="native",
                    help="both: the RL workload on the native engine and on vLLM side by side (no HF generate)")
    a = ap.parse_args(argv)
    if a.engine == "both":
        if a.workload != "rl":
            ap.error("--engine both runs the RL workload: add --workload rl")
        rec = engines_record(a.model, a.prompts, a.samples, dtype=a.dtype, threads=a.threads, device=a.device)
        if not a.json:
            print(f"RL workload, {a.model} model: native {rec['native_tok_s']} tok/s, vLLM {rec['vllm_tok_s']} tok/s "
                  f"(native/vLLM {rec['native_over_vllm']}); {rec['identical_sequences']} of {rec['sequences']} "
                  "sequences identical")
        print(json.dumps(rec))
        return
    if a.workload == "rl":
        rec = rl_record(a.model, a.prompts, a.samples, dtype=a.dtype, threads=a.threads, skip_hf=a.skip_hf,
                        device=a.device, attention=a.attention, longest=a.output_len)
        if not a.json:
            print(f"RL workload, {a.model} model ({rec['params']:,} parameters): engine {rec['engine_tok_s']} tok/s, "
                  f"HF generate {rec['hf_generate_tok_s']} tok/s, speedup {rec['speedup']}; KV capacity "
                  f"{rec['kv_capacity_ratio']}x a slot cache; {rec['roofline_fraction']:.0%} of the decode roofline")
        print(json.dumps(rec))
        return
    plen, olen = DEFAULT_LENGTHS[a.model]
    rec = measure(a.model, a.prompts, a.samples, a.prompt_len or plen, a.output_len or olen, dtype=a.dtype,
                  temperature=a.temperature, threads=a.threads, skip_hf=a.skip_hf, device=a.device,
                  attention=a.attention)
    if not a.json:
        print(f"{a.model} model ({rec['params']:,} parameters), {a.prompts} prompts x {a.samples} samples, "
              f"{rec['prompt_len']} + {rec['output_len']} tokens, {a.dtype}")
        print(f"engine: {rec['engine_tok_s']} tok/s; HF generate: {rec['hf_generate_tok_s']} tok/s; "
              f"speedup {rec['speedup']}")
    print(json.dumps(rec))


if __name__ == "__main__":
    main()
