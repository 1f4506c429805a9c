"""Rollout benchmark: the native inference engine against Hugging Face ``generate`` on one workload.

    python -m benchmarks.rollout --workload rl --json    # RL-shaped: varied prompts, K samples, long tail
    python -m benchmarks.rollout --json                  # fixed lengths, the demo model
    python -m benchmarks.rollout --model 100m --json     # a ~100M-parameter model
    python -m benchmarks.rollout --model qwen3-0.6b --device cuda --dtype bfloat16 --hf-static --json  # the GPU peer

Both generate the same workload in one run, with the same weights and dtype (the model is saved in
Hugging Face format and loaded by ``transformers``). The fixed workload: ``--prompts`` prompts x
``--samples`` samples, fixed prompt and output lengths (EOS ignored), the same sampling parameters.
The RL workload is described in ``benchmarks.rollout_rl``. Throughput counts generated tokens per
second of wall time, prefill included. ``--hf-static``: ``generate`` with a static KV cache, which on a GPU it
compiles (``torch.compile``, CUDA graphs: transformers' own automatic compile of the decoding forward): the
strongest same-GPU peer ``transformers`` offers. The engine is timed step by step (``benchmarks.engine_steps``):
the record gives its read roofline, whole and by ramp, body and tail, and the check that no CUDA graph was captured
in the timed window; ``--step-log PATH`` appends every step as a JSON line. Memory (fixed workload) is the peak
RSS growth during generation divided by the tokens in flight at the peak (prompt + output of every sequence), in MiB
per 1k tokens. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch

from benchmarks.engine_steps import TimedRun, run_record, timed_generate, write_step_log
from benchmarks.rollout_rl import KV_MEMORY_FRACTION, measure_rl
from benchmarks.roofline import device_name, read_bandwidth
from benchmarks.timing import say
from engines.device import peak_memory_bytes, reset_peak_memory, synchronize
from engines.inference.kv_cache import bytes_per_slot
from engines.inference.native import InferenceEngine
from engines.inference.sampling import SamplingParams
from engines.model.io.hf_io import save_pretrained
from engines.model.native.arch import ModelConfig
from engines.model.native.causal_lm import CausalLM, build_model

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
#: Qwen3-8B's shape, for the rollout and decode benchmarks (a GPU's): not in MODELS, which the training benchmarks
#: import as the shapes they each have a workload for
QWEN3_8B = ModelConfig(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                       num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       tie_word_embeddings=False, rope_theta=1_000_000.0, max_position_embeddings=40960)
ROLLOUT_MODELS = {**MODELS, "qwen3-8b": QWEN3_8B}
DEFAULT_LENGTHS = {"demo": (32, 64), "100m": (128, 128), "qwen3-0.6b": (512, 512), "qwen3-8b": (512, 512)}


def peak_rss_growth(fn: Callable[..., Any], *args: Any) -> tuple[Any, int]:
    """Run ``fn(*args)``; returns (its result, peak RSS above the RSS before the call, in bytes)."""
    cpu = torch.device("cpu")
    reset_peak_memory(cpu)
    before = peak_memory_bytes(cpu)  # right after a reset: the current RSS
    result = fn(*args)
    return result, max(0, peak_memory_bytes(cpu) - before)


def workload(n_prompts: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``n_prompts`` random prompts of ``prompt_len`` tokens (the fixed workload's)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n_prompts, prompt_len), generator=g).tolist()


def build(model_name: str, device: str, dtype: torch.dtype, save_to: str | None = None) -> CausalLM:
    """A random-weight model of ``model_name`` built in place on ``device`` (an 8 B shape never passes through
    host memory in float32), saved in Hugging Face format to ``save_to`` when ``generate`` will load it."""
    torch.manual_seed(0)
    model = build_model(ROLLOUT_MODELS[model_name], device, dtype, init=True)
    if save_to:
        save_pretrained(model, None, save_to)
    say("rollout", f"{model_name} built on {device}" + (", saved for generate" if save_to else ""))
    return model


def run_engine(model: CausalLM, prompts, samples: int, output_len: int, temperature: float,
               cuda_graphs: bool = True, attention: str = "auto") -> tuple[TimedRun, InferenceEngine]:
    """The engine's timed run of the fixed workload (``benchmarks.engine_steps``) and the engine."""
    seq, n = len(prompts[0]) + output_len, len(prompts) * samples
    p = next(model.parameters())
    # every sequence at its full length in whole blocks (of flex's 128 tokens, the largest), and the graphs' scratch
    # block: a fixed workload that must preempt measures the preemptions, not the batch
    per_seq = bytes_per_slot(model.config, -(-seq // 128) * 128, p.dtype)
    engine = InferenceEngine(model, eos_id=1, pad_id=0, max_seq_len=seq, max_num_seqs=n,
                             kv_cache_bytes=per_seq * (n + 1),
                             cuda_graphs=cuda_graphs, kv_memory_fraction=KV_MEMORY_FRACTION, attention=attention)
    params = SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=True)
    # warm-up: first-call allocations, the prefill shapes, a decode of the whole batch
    engine.generate([q for q in prompts for _ in range(samples)], replace(params, max_tokens=2))
    engine.generate(prompts[:2], params)
    engine.weights_loaded()  # forget the warm-up's cached prefixes: the timed run prefills as a first one would
    run = timed_generate(engine, [q for q in prompts for _ in range(samples)], [params] * n)
    assert all(len(o) == output_len for o in run.outputs)
    return run, engine


def run_hf(model_dir: str, dtype: torch.dtype, prompts, samples: int, output_len: int, temperature: float,
           device: str = "cpu", static: bool = False) -> tuple[float, bool]:
    """``generate``'s seconds on the fixed workload, and whether it compiled its decoding forward. ``static``: a
    static KV cache, which transformers compiles on a GPU; warmed up on the whole batch, since a compiled step is
    specialised to the batch and the cache's length."""
    from transformers import AutoModelForCausalLM

    say("rollout", "loading the model for generate")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval().to(device)
    ids = torch.tensor(prompts, device=device)
    kw = dict(do_sample=temperature > 0, temperature=temperature if temperature > 0 else None, top_k=0, top_p=1.0,
              max_new_tokens=output_len, min_new_tokens=output_len, pad_token_id=0, eos_token_id=1)
    if static:
        kw.update(cache_implementation="static", max_cache_len=ids.shape[1] + output_len)
    # static: the whole batch for a few decoding steps (the compile, then CUDA graph trees record on their first
    # replays); dynamic: two prompts, as before
    first, warm = (ids, dict(kw, max_new_tokens=4, min_new_tokens=4)) if static else (ids[:2], kw)
    with torch.no_grad():
        model.generate(first, attention_mask=torch.ones_like(first), num_return_sequences=samples if static else 1,
                       **warm)
        synchronize(ids.device)
        say("rollout", "generate warmed up" + (" (static cache)" if static else ""))
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), num_return_sequences=samples, **kw)
        synchronize(ids.device)
        elapsed = time.perf_counter() - t0
    assert out.shape == (len(prompts) * samples, ids.shape[1] + output_len)
    return elapsed, hasattr(model, "_compiled_call")  # transformers keeps its compiled forward there


def measure(model_name: str, prompts_n: int, samples: int, prompt_len: int, output_len: int, *,
            dtype: str = "float32", temperature: float = 1.0, threads: int | None = None,
            skip_hf: bool = False, device: str = "cpu", attention: str = "auto", hf_static: bool = False,
            eager: bool = True, step_log: str | None = None) -> dict:
    """The fixed-workload record (also printed as the JSON line): the engine's figures (``engine_steps``), and
    ``generate``'s beside them unless ``skip_hf`` (``hf_static``: with a static cache, compiled on a GPU);
    ``eager``: on a GPU also time the engine without CUDA graphs; ``step_log``: a file to append each step to."""
    torch.set_num_threads(threads or os.cpu_count() or 1)
    cfg = ROLLOUT_MODELS[model_name]
    if prompt_len + output_len > cfg.max_position_embeddings:
        raise SystemExit(f"prompt_len + output_len = {prompt_len + output_len} exceeds the {model_name} model's "
                         f"context of {cfg.max_position_embeddings}")
    if min(prompts_n, samples, prompt_len, output_len) < 1:
        raise SystemExit("--prompts, --samples, --prompt-len and --output-len must be >= 1")
    tdtype = getattr(torch, dtype)
    prompts = workload(prompts_n, prompt_len, cfg.vocab_size)
    tokens = prompts_n * samples * output_len
    in_flight = prompts_n * samples * (prompt_len + output_len)
    graphs = device == "cuda"
    with tempfile.TemporaryDirectory() as d:
        model = build(model_name, device, tdtype, None if skip_hf else d)
        params = sum(p.numel() for p in model.parameters())
        (run, engine), engine_rss = peak_rss_growth(run_engine, model, prompts, samples, output_len, temperature,
                                                    True, attention)
        dev = torch.device(device)
        figures = run_record(engine, run, read_bandwidth(dev), device_name(dev), graphs)
        if step_log:
            write_step_log(step_log, run.steps, workload="fixed", model=model_name, attention=engine.attention)
        kv_bytes, backend = engine.kv_cache_bytes, engine.attention
        del engine
        # on a GPU the same engine without CUDA graphs, as the graphs' peer
        eager_s = run_engine(model, prompts, samples, output_len, temperature, False, attention)[0].seconds \
            if graphs and eager else None
        del model  # HF loads its own copy
        if graphs:
            torch.cuda.empty_cache()
        (hf_s, compiled), hf_rss = ((None, False), None) if skip_hf else peak_rss_growth(
            run_hf, d, tdtype, prompts, samples, output_len, temperature, device, hf_static)
    return {
        "workload": "fixed",
        "model": model_name,
        "params": params,
        **figures,
        "hf_generate_tok_s": None if hf_s is None else round(tokens / hf_s, 1),
        "speedup": None if hf_s is None else round(hf_s / run.seconds, 3),
        "hf_generate_s": None if hf_s is None else round(hf_s, 3),
        "hf_cache": None if skip_hf else "static" if hf_static else "dynamic",
        "hf_compiled": compiled,
        "engine_peak_rss_mib_per_1k_tokens": round(engine_rss / 2**20 / (in_flight / 1000), 3),
        "hf_peak_rss_mib_per_1k_tokens": None if hf_rss is None else round(hf_rss / 2**20 / (in_flight / 1000), 3),
        "kv_cache_mib": round(kv_bytes / 2**20, 1),
        "attention": backend,
        "prompts": prompts_n,
        "samples": samples,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "tokens": tokens,
        "dtype": dtype,
        "temperature": temperature,
        "threads": torch.get_num_threads(),
        "device": device,
        **({"engine_eager_tok_s": round(tokens / eager_s, 1), "cuda_graph_speedup": round(eager_s / run.seconds, 3)}
           if eager_s else {}),
    }


def rl_records(model_name: str, prompts_n: int, samples: int, *, dtype: str = "float32", threads: int | None = None,
               skip_hf: bool = False, device: str = "cpu", attention: str = "auto", longest: int | None = None,
               eager: bool = True, step_log: str | None = None, decode_steps: tuple[int, ...] = (1,)
               ) -> Iterator[dict]:
    """The RL-workload records (``benchmarks.rollout_rl``) of a random-weight model of ``model_name``, one per value
    of ``decode_steps`` as each is measured: the first in full, the others the engine's run only (no ``generate``,
    no eager run), so that a run cut at its time limit keeps the first."""
    torch.set_num_threads(threads or os.cpu_count() or 1)
    with tempfile.TemporaryDirectory() as d:
        model = build(model_name, device, getattr(torch, dtype), None if skip_hf else d)
        for i, k in enumerate(decode_steps):
            yield measure_rl(model, None if skip_hf or i else d, model_name, prompts_n, samples,
                             dtype=getattr(torch, dtype), device=device, attention=attention, longest=longest,
                             eager=eager and not i, step_log=step_log, decode_steps=k)


def engines_record(model_name: str, prompts_n: int, samples: int, *, dtype: str = "float32",
                   threads: int | None = None, device: str = "cpu") -> dict:
    """The RL workload on the native engine and on vLLM, same weights, prompts and forced output lengths, on the same
    device and alike: both with CUDA graphs of their decode steps on a GPU, both eager on a CPU (the record's
    ``native_mode`` and ``vllm_mode`` say which ran)."""
    from benchmarks.rollout_rl import RL_LENGTHS, draw_workload, run_engine_rl, run_vllm_rl

    torch.set_num_threads(threads or os.cpu_count() or 1)
    tdtype = getattr(torch, dtype)
    cfg = ROLLOUT_MODELS[model_name]
    lo, hi, max_out = RL_LENGTHS[model_name]
    prompts, lengths = draw_workload(prompts_n, samples, (lo, hi), max_out, cfg.vocab_size)
    max_seq = hi + max_out
    with tempfile.TemporaryDirectory() as d:
        model = build(model_name, device, tdtype, d)
        graphs = device == "cuda"
        run, engine, _ = run_engine_rl(model, prompts, lengths, 512 << 20, max_seq, cuda_graphs=graphs)
        native_captures = engine.stats()["cuda_graph_captures"]
        del engine
        vllm_s, vllm_out, vllm_mode = run_vllm_rl(d, tdtype, prompts, lengths, max_seq, graphs=graphs)
    native_out = run.outputs
    tokens = sum(map(len, native_out))
    same = sum(a == b for a, b in zip(native_out, vllm_out, strict=True))
    return {"benchmark": "rollout_engines", "model": model_name, "params": sum(p.numel() for p in model.parameters()),
            "dtype": dtype, "threads": torch.get_num_threads(), "prompts": prompts_n, "samples": samples,
            "tokens": tokens, "native_tok_s": round(tokens / run.seconds, 1),
            "vllm_tok_s": round(sum(map(len, vllm_out)) / vllm_s, 1),
            "native_over_vllm": round((tokens / run.seconds) / (sum(map(len, vllm_out)) / vllm_s), 3),
            "same_tokens": same == len(native_out), "identical_sequences": same, "sequences": len(native_out),
            "device": device, "native_mode": "graphs" if graphs else "eager", "native_graph_captures": native_captures,
            "native_captures_in_window": run.captures_in_window, "vllm_mode": vllm_mode}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--workload", choices=["fixed", "rl"], default="fixed",
                    help="fixed lengths (default) or the RL shape: varied prompts, K samples, long-tailed outputs")
    ap.add_argument("--model", choices=sorted(ROLLOUT_MODELS), default="demo")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8, help="responses per prompt")
    ap.add_argument("--prompt-len", type=int, help="tokens per prompt (default: 32 demo, 128 for 100m)")
    ap.add_argument("--output-len", type=int, help="tokens per response (default: 64 demo, 128 for 100m); with "
                    "--workload rl the longest response (default: 64 demo, 256 100m, 2048 qwen3-0.6b)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, help="torch threads (default: all cores)")
    ap.add_argument("--skip-hf", action="store_true", help="time only the engine")
    ap.add_argument("--hf-static", action="store_true", help="fixed workload: generate with a static KV cache, "
                    "compiled by transformers on a GPU (the same-GPU peer)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (on cuda the engine also runs without CUDA graphs)")
    ap.add_argument("--no-eager", dest="eager", action="store_false",
                    help="on cuda, skip the engine's run without CUDA graphs")
    ap.add_argument("--step-log", metavar="PATH", help="append the engine's steps to PATH as JSON lines")
    ap.add_argument("--json", action="store_true", help="print only the JSON record")
    ap.add_argument("--attention", choices=["auto", "torch", "flex", "paged", "triton"], default="auto",
                    help="the native engine's attention over the paged KV cache (auto: the CPU kernel on a CPU)")
    ap.add_argument("--decode-steps", type=int, nargs="+", default=[1], metavar="K",
                    help="RL workload: the engine's decode forwards per host read, one record per value (the first "
                         "in full; the others time the engine only)")
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
    if a.decode_steps != [1] and a.workload != "rl":
        ap.error("--decode-steps is measured on the RL workload: add --workload rl")
    if a.workload == "rl":
        for rec in rl_records(a.model, a.prompts, a.samples, dtype=a.dtype, threads=a.threads, skip_hf=a.skip_hf,
                              device=a.device, attention=a.attention, longest=a.output_len, eager=a.eager,
                              step_log=a.step_log, decode_steps=tuple(a.decode_steps)):
            body, tail = rec["parts"]["body"], rec["parts"]["tail"]
            if not a.json:
                print(f"RL workload, {a.model} model ({rec['params']:,} parameters), {rec['decode_steps']} decode "
                      f"step(s) a read: engine {rec['engine_tok_s']} tok/s, HF generate {rec['hf_generate_tok_s']} "
                      f"tok/s, speedup {rec['speedup']}; KV capacity {rec['kv_capacity_ratio']}x a slot cache; "
                      f"{rec['roofline_fraction']:.0%} of the read roofline (body {body.get('roofline_fraction')}, "
                      f"tail {tail.get('roofline_fraction')})")
            print(json.dumps(rec), flush=True)
        return
    plen, olen = DEFAULT_LENGTHS[a.model]
    rec = measure(a.model, a.prompts, a.samples, a.prompt_len or plen, a.output_len or olen, dtype=a.dtype,
                  temperature=a.temperature, threads=a.threads, skip_hf=a.skip_hf, device=a.device,
                  attention=a.attention, hf_static=a.hf_static, eager=a.eager, step_log=a.step_log)
    if not a.json:
        print(f"{a.model} model ({rec['params']:,} parameters), {a.prompts} prompts x {a.samples} samples, "
              f"{rec['prompt_len']} + {rec['output_len']} tokens, {a.dtype}")
        print(f"engine: {rec['engine_tok_s']} tok/s ({rec['roofline_fraction']:.0%} of the read roofline); HF "
              f"generate ({rec['hf_cache']} cache, compiled: {rec['hf_compiled']}): {rec['hf_generate_tok_s']} tok/s; "
              f"speedup {rec['speedup']}")
    print(json.dumps(rec))


if __name__ == "__main__":
    main()
