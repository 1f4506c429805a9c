"""The RL-shaped rollout workload: varied prompts, K samples each, long-tailed output lengths.

    python -m benchmarks.rollout --workload rl --json                 # the quick-start model
    python -m benchmarks.rollout --workload rl --model 100m --json    # ~88 M parameters
    python -m benchmarks.rollout --workload rl --model qwen3-0.6b --device cuda --dtype bfloat16 --json

Prompt lengths are uniform in a range, every prompt gets K samples, and each sample's output length
is drawn in advance from a log-normal tail (median an eighth of the longest, clipped to it), as RL
rollouts look: most responses short, a few very long. Both generators produce exactly the same
tokens: decoding is greedy and each sequence stops after its drawn length (the engine: ``max_tokens``
per request; ``generate``: a per-row stopping criterion), EOS not treated specially by either. The
record says how many sequences came out identical (near-ties of the logits can flip a greedy token
between two implementations). ``generate`` runs the whole batch at once, left-padded, as an RL loop
built on it does; rows that have stopped are carried until the longest ends.

The RL scale (``--prompts 64 --samples 8`` on ``qwen3-0.6b``): 512 sequences, prompts uniform in 128..512 tokens,
outputs log-normal with median 256 (σ = 1: a quarter under 130, a quarter over 505) clipped to 2048 tokens, from
seed 0: about 2 × 10^5 generated tokens, and 2048 steps at least (the longest response).

Besides throughput and the speedup, the record gives the KV capacity of the paged cache against a
slot cache (a full-length row per sequence) at equal bytes for this workload's lengths, the prefix
hit rate, and the read roofline of the engine's steps, whole and split into ramp, body and tail, with the CUDA-graph
check (``benchmarks.engine_steps``; ``step_log``: every step as a JSON line).
"""

from __future__ import annotations

import time

import torch

from benchmarks.engine_steps import TimedRun, run_record, timed_generate, write_step_log
from benchmarks.roofline import device_name, read_bandwidth
from benchmarks.timing import say
from engines.device import synchronize
from engines.inference.kv_cache import BLOCK_SIZE, bytes_per_slot, paged_pool
from engines.inference.native import InferenceEngine
from engines.inference.sampling import SamplingParams
from engines.model.native.causal_lm import CausalLM

#: (shortest prompt, longest prompt, longest output) per model.
RL_LENGTHS = {"demo": (16, 48, 64), "100m": (64, 192, 256), "qwen3-0.6b": (128, 512, 2048),
              "qwen3-8b": (128, 512, 2048)}
#: On a GPU the KV cache takes at most this fraction of the memory free after the weights (the slot-cache
#: budget of the qwen3-0.6b workload, 512 x 2560 tokens x 114,688 B = 140 GiB, fits no single GPU); the
#: rest holds the decode step's gathered keys/values, the CUDA graphs' pool and the sampler's logits.
KV_MEMORY_FRACTION = 0.7


def draw_workload(n_prompts: int, samples: int, prompt_range: tuple[int, int], max_output: int, vocab: int,
                  seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """(prompts, output lengths per prompt's samples): uniform prompt lengths, log-normal output lengths
    with median ``max_output / 8`` clipped to [1, max_output]."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = prompt_range
    plens = torch.randint(lo, hi + 1, (n_prompts,), generator=g).tolist()
    prompts = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in plens]
    z = torch.randn(n_prompts, samples, generator=g, dtype=torch.float64)
    out = (max_output / 8 * torch.exp(z)).round().clamp(1, max_output).long().tolist()
    return prompts, out


def run_engine_rl(model: CausalLM, prompts, lengths, kv_bytes: int, max_seq_len: int, cuda_graphs: bool = True,
                  attention: str = "auto", decode_steps: int = 1) -> tuple[TimedRun, InferenceEngine, dict]:
    """The engine's timed run of the workload (outputs in prompt-major order, ``benchmarks.engine_steps``), the
    engine, and its counters' growth over the run."""
    engine = InferenceEngine(model, eos_id=1, pad_id=0, max_seq_len=max_seq_len, kv_cache_bytes=kv_bytes,
                             max_num_seqs=sum(map(len, lengths)), cuda_graphs=cuda_graphs,
                             kv_memory_fraction=KV_MEMORY_FRACTION, attention=attention, decode_steps=decode_steps)
    reqs = [(p, SamplingParams(0.0, n, ignore_eos=True)) for p, ns in zip(prompts, lengths, strict=True) for n in ns]
    mode = "graphs" if cuda_graphs and next(model.parameters()).is_cuda else "eager"
    say("rollout", f"engine up ({attention} attention, {mode}, KV {engine.kv_cache_bytes / 2**30:.1f} GiB)")
    engine.generate([p for p, _ in reqs[:4]], [SamplingParams(0.0, 2, ignore_eos=True)] * 4)  # warm-up
    engine.weights_loaded()  # forget the warm-up's cached prefixes
    say("rollout", f"warm-up done; timing {len(reqs)} sequences, {sum(map(sum, lengths))} tokens")
    start = engine.stats()
    run = timed_generate(engine, [p for p, _ in reqs], [s for _, s in reqs])
    say("rollout", f"{mode}: {run.seconds:.2f} s, {len(run.steps)} steps")
    stats = {k: v - start.get(k, 0) for k, v in engine.stats().items()
             if isinstance(v, (int, float)) and k != "prefix_hit_rate"}
    return run, engine, stats


def run_vllm_rl(model_dir: str, dtype: torch.dtype, prompts, lengths, max_seq_len: int, graphs: bool = True
                ) -> tuple[float, list[list[int]], str]:
    """vLLM's wall time, outputs (prompt-major order) and mode ("graphs": decode-only CUDA graphs, or "eager") on
    the workload, through the same rollout engine interface as the native engine: the same requests, greedy, each
    stopping after its drawn length. ``graphs``: on a GPU, as the native engine runs there (a CPU is eager)."""
    from engines.inference.vllm_engine import VllmEngine

    engine = VllmEngine(model_dir, [], max_seq_len=max_seq_len, max_num_seqs=min(256, sum(map(len, lengths))),
                        dtype=str(dtype).removeprefix("torch."), kv_cache_bytes=512 << 20, tokenizer=False,
                        graphs=graphs)
    mode = "eager" if engine.args["enforce_eager"] else "graphs"
    reqs = [(p, SamplingParams(0.0, n, ignore_eos=True)) for p, ns in zip(prompts, lengths, strict=True) for n in ns]
    engine.generate([p for p, _ in reqs[:4]], [SamplingParams(0.0, 2, ignore_eos=True)] * 4)  # warm-up
    engine.weights_loaded()  # forget the warm-up's cached prefixes
    t0 = time.perf_counter()
    outs = engine.generate([p for p, _ in reqs], [s for _, s in reqs])
    return time.perf_counter() - t0, [o.token_ids for o in outs], mode


def run_hf_rl(model_dir: str, dtype: torch.dtype, prompts, lengths, device: str) -> tuple[float, list[list[int]]]:
    """``generate`` on the whole batch (left-padded), each row stopping after its own length."""
    from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval().to(device)
    rows = [(p, n) for p, ns in zip(prompts, lengths, strict=True) for n in ns]
    width = max(len(p) for p, _ in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (p, _) in enumerate(rows):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    want = torch.tensor([n for _, n in rows], device=device)

    class PerRowLength(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return input_ids.shape[1] - width >= want

    kw = dict(do_sample=False, max_new_tokens=int(want.max()), pad_token_id=0, eos_token_id=None,
              stopping_criteria=StoppingCriteriaList([PerRowLength()]))
    ids, mask = ids.to(device), mask.to(device)
    with torch.no_grad():
        model.generate(ids[:2], attention_mask=mask[:2], **{**kw, "max_new_tokens": 2,
                                                             "stopping_criteria": None})
        synchronize(ids.device)
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kw)
        synchronize(ids.device)
        elapsed = time.perf_counter() - t0
    return elapsed, [out[i, width:width + n].tolist() for i, (_, n) in enumerate(rows)]


def kv_capacity(cfg, dtype: torch.dtype, prompts, lengths, kv_bytes: int) -> tuple[float, int]:
    """Sequences of this workload a paged cache of ``kv_bytes`` holds (prompt blocks shared by the K samples,
    each sample's own blocks after them) against a slot cache that reserves the longest sequence per row."""
    blocks, _ = paged_pool(cfg, kv_bytes, dtype)
    used = 0.0
    for p, ns in zip(prompts, lengths, strict=True):
        shared = len(p) // BLOCK_SIZE
        used += shared + sum(-(-(len(p) + n) // BLOCK_SIZE) - shared for n in ns)
    per_seq = used / sum(map(len, lengths))
    longest = max(len(p) + n for p, ns in zip(prompts, lengths, strict=True) for n in ns)
    return blocks / per_seq, kv_bytes // bytes_per_slot(cfg, longest, dtype)


def measure_rl(model: CausalLM, model_dir: str | None, name: str, prompts_n: int, samples: int, *,
               dtype: torch.dtype, device: str, seed: int = 0, attention: str = "auto", longest: int | None = None,
               eager: bool = True, step_log: str | None = None, decode_steps: int = 1) -> dict:
    """The RL-workload record for ``model`` (already on ``device``), saved in ``model_dir`` for ``generate`` (None:
    no ``generate``); ``attention``: the native engine's attention backend (auto, torch, flex, paged or triton; the
    record names the one run); ``longest``: the longest output (default: the model's in ``RL_LENGTHS``); ``eager``:
    on a GPU also time the engine without CUDA graphs; ``step_log``: a file to append each step to;
    ``decode_steps``: the engine's forwards per host read (multi-step decoding)."""
    lo, hi, default_longest = RL_LENGTHS[name]
    longest = longest or default_longest
    cfg = model.config
    prompts, lengths = draw_workload(prompts_n, samples, (lo, hi), longest, cfg.vocab_size, seed)
    tokens = sum(map(sum, lengths))
    max_seq = hi + longest
    # a budget that holds every sequence of the workload at once at its full length, as a slot cache would need
    # (on a GPU capped at a fraction of its free memory: the capacities below compare equal bytes either way)
    kv_bytes = bytes_per_slot(cfg, max_seq, dtype) * prompts_n * samples
    graphs = device == "cuda"
    run, engine, stats = run_engine_rl(model, prompts, lengths, kv_bytes, max_seq, attention=attention,
                                       decode_steps=decode_steps)
    dev = torch.device(device)
    read_bps = read_bandwidth(dev)
    figures = run_record(engine, run, read_bps, device_name(dev), graphs)
    if step_log:
        write_step_log(step_log, run.steps, workload="rl", model=name, attention=engine.attention,
                       decode_steps=decode_steps)
    kv_bytes, backend = engine.kv_cache_bytes, engine.attention
    del engine  # its KV pool and graphs go back before the eager engine takes its own
    if device == "cuda":
        torch.cuda.empty_cache()
    paged, slots = kv_capacity(cfg, dtype, prompts, lengths, kv_bytes)
    eager_s = run_engine_rl(model, prompts, lengths, kv_bytes, max_seq, cuda_graphs=False, attention=attention,
                            decode_steps=decode_steps)[0].seconds if graphs and eager else None
    hf_s, same = None, None
    if model_dir is not None:
        hf_s, hf_out = run_hf_rl(model_dir, dtype, prompts, lengths, device)
        same = sum(a == b for a, b in zip(run.outputs, hf_out, strict=True)) / len(hf_out)
    looked = stats["prefix_hit_tokens"] + stats["prefix_miss_tokens"]
    return {
        "workload": "rl",
        "model": name,
        "params": sum(p.numel() for p in model.parameters()),
        **figures,
        "hf_generate_tok_s": None if hf_s is None else round(tokens / hf_s, 1),
        "speedup": None if hf_s is None else round(hf_s / run.seconds, 3),
        "same_tokens": same,
        "hf_generate_s": None if hf_s is None else round(hf_s, 3),
        "tokens": tokens,
        "sequences": prompts_n * samples,
        "prompt_len_range": [lo, hi],
        "output_len_max": longest,
        "output_len_mean": round(tokens / (prompts_n * samples), 1),
        "kv_cache_mib": round(kv_bytes / 2**20, 1),
        "kv_capacity_paged_seqs": round(paged, 1),
        "kv_capacity_slot_seqs": slots,
        "kv_capacity_ratio": round(paged / max(slots, 1), 2),
        "prefix_hit_rate": round(stats["prefix_hit_tokens"] / looked, 3) if looked else 0.0,
        "attention": backend,
        "decode_steps": decode_steps,
        "host_reads": stats["host_reads"],
        "dtype": str(dtype).removeprefix("torch."),
        "device": device,
        "threads": torch.get_num_threads(),
        **({"engine_eager_tok_s": round(tokens / eager_s, 1), "cuda_graph_speedup": round(eager_s / run.seconds, 3)}
           if eager_s else {}),
    }
