"""The two backends on one family both run: trainer tokens/s of the native model against the transformers backend, and
rollout tokens/s of the native engine against vLLM, same weights, measured in alternation in one process.

    python -m benchmarks.backends --json                       # the quick-start model (Llama layout, 0.92 M)
    python -m benchmarks.backends --model 100m --json          # ~88 M parameters, Llama layout

One Llama checkpoint (random weights: throughput does not depend on them) is saved in Hugging Face format and loaded
four times: by the native model (``engines.model.io.hf_io.load_pretrained``) and by the transformers backend
(``engines.model.hf.backend.load_hf_model``) for training, by the native inference engine and by vLLM for rollouts.

Trainer: forward and backward of the K1.5 loss (``rl.algo.objectives.k15_loss``, sequence log-probs from the
chunked vocabulary scoring) on one packed micro-batch of variable-length documents (``benchmarks.train_step``'s
workload), max-logit tracking on, as the trainer worker runs them; the optimizer step is not timed. Tokens/s counts
every token of the packed batch. The first pass also checks that both backends give the same log-probs.

Rollout: the RL-shaped workload of ``benchmarks.rollout_rl`` (K samples per prompt, long-tailed forced output
lengths, greedy, EOS ignored) through the ``RolloutEngine`` interface; both engines are built once, and each timed
pass starts with an empty prefix cache. Tokens/s counts generated tokens, prefill included in the time.

Each repeat times native then transformers (trainer) and native then vLLM (rollout), the order swapped on every
other repeat, so that load from other processes on a shared machine falls on both; the medians and their ratios
are reported, with the load average before and after. The last line printed (``--json``) is one JSON object,
appended to ``benchmarks/results/backends-<machine>.jsonl`` with ``--record``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.rollout import MODELS
from benchmarks.rollout_rl import RL_LENGTHS, draw_workload
from benchmarks.timing import say
from benchmarks.train_step import WORKLOADS, make_batch
from engines.inference.native import InferenceEngine
from engines.inference.sampling import SamplingParams
from engines.model.hf.backend import load_hf_model
from engines.model.io.hf_io import load_pretrained, save_pretrained
from engines.model.native.causal_lm import CausalLM, track_max_logits
from engines.training.engine import TrainingEngine
from engines.training.optim import build_optimizers
from rl.algo.objectives import k15_loss

ROOT = Path(__file__).resolve().parents[1]
MODEL_CHOICES = ("demo", "100m")


def trainer_engine(model: torch.nn.Module) -> TrainingEngine:
    """A training engine over ``model`` as the trainer worker sets one up (Muon + AdamW, max logits tracked)."""
    track_max_logits(model, True)
    return TrainingEngine(model, build_optimizers(model, "muon", 1e-4, 0.0), pad_id=0)


def k15_pass(engine: TrainingEngine, prompts, responses, advantage: torch.Tensor) -> torch.Tensor:
    """Forward and backward of the K1.5 loss over the batch (old policy = the current one, τ = 1); returns the
    per-token log-probs (detached), the gradients left for the caller to drop."""
    s = engine.score(prompts, responses, 1.0)
    new = (s.logprobs * s.mask).sum(-1)
    weight = torch.full_like(new, 1.0 / len(prompts))
    k15_loss(new, new.detach(), advantage, weight, 1.0).backward()
    return s.logprobs.detach()[s.mask]


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def measure_trainers(model_dir: str, prompts, responses, repeats: int) -> dict:
    """Median seconds of one K1.5 forward+backward on each backend, alternating; the log-prob agreement."""
    engines = {"native": trainer_engine(load_pretrained(model_dir, torch.float32)),
               "transformers": trainer_engine(load_hf_model(model_dir))}
    advantage = torch.randn(len(prompts), generator=torch.Generator().manual_seed(0))
    first = {}
    for name, e in engines.items():  # warm-up, and the cross-check of the two paths
        first[name] = k15_pass(e, prompts, responses, advantage)
        e.model.zero_grad(set_to_none=True)
    diff = (first["native"] - first["transformers"]).abs()
    times: dict[str, list[float]] = {n: [] for n in engines}
    for i in range(repeats):
        for name in (list(engines) if i % 2 == 0 else list(engines)[::-1]):
            e = engines[name]
            times[name].append(timed(k15_pass, e, prompts, responses, advantage))
            e.model.zero_grad(set_to_none=True)
            say("backends", f"trainer {name} pass {i + 1}/{repeats}: {times[name][-1]:.3f} s")
    tokens = sum(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    out = {"tokens": tokens, "sequences": len(prompts), "logprob_diff_max": float(diff.max()),
           "logprob_diff_mean": float(diff.mean())}
    for name, ts in times.items():
        med = statistics.median(ts)
        out[name] = {"step_s": round(med, 4), "tokens_per_s": round(tokens / med, 1),
                     "all_s": [round(t, 4) for t in ts]}
    out["native_over_transformers"] = round(out["native"]["tokens_per_s"] / out["transformers"]["tokens_per_s"], 3)
    return out


def measure_rollouts(model_dir: str, prompts, lengths, max_seq: int, repeats: int) -> dict:
    """Median seconds of the workload on the native engine and on vLLM, alternating; identical sequences."""
    from engines.inference.vllm_engine import VllmEngine

    threads = torch.get_num_threads()
    n = sum(map(len, lengths))
    native = InferenceEngine(load_pretrained(model_dir, torch.float32), eos_id=1, pad_id=0, max_seq_len=max_seq,
                             kv_cache_bytes=512 << 20, max_num_seqs=n, cuda_graphs=False)
    vllm = VllmEngine(model_dir, [], max_seq_len=max_seq, max_num_seqs=min(256, n), dtype="float32",
                      kv_cache_bytes=512 << 20, tokenizer=False, graphs=False)
    torch.set_num_threads(threads)  # vLLM's CPU start-up may set the process's threads; both get the same
    reqs = [(p, SamplingParams(0.0, k, ignore_eos=True)) for p, ks in zip(prompts, lengths, strict=True) for k in ks]
    engines = {"native": native, "vllm": vllm}
    outputs: dict[str, list[list[int]]] = {}

    def run(name):
        e = engines[name]
        e.weights_loaded()  # an empty prefix cache: every pass prefills its prompts
        outputs[name] = [o.token_ids for o in e.generate([p for p, _ in reqs], [s for _, s in reqs])]

    for e in engines.values():  # warm-up
        e.generate([p for p, _ in reqs[:4]], [SamplingParams(0.0, 2, ignore_eos=True)] * 4)
    times: dict[str, list[float]] = {n_: [] for n_ in engines}
    for i in range(repeats):
        for name in (list(engines) if i % 2 == 0 else list(engines)[::-1]):
            times[name].append(timed(run, name))
            say("backends", f"rollout {name} pass {i + 1}/{repeats}: {times[name][-1]:.3f} s")
    vllm.close()
    tokens = sum(map(len, outputs["native"]))
    same = sum(a == b for a, b in zip(outputs["native"], outputs["vllm"], strict=True))
    out = {"tokens": tokens, "sequences": len(reqs), "identical_sequences": same, "threads": torch.get_num_threads()}
    for name, ts in times.items():
        got = sum(map(len, outputs[name]))
        out[name] = {"pass_s": round(statistics.median(ts), 4), "tokens_per_s": round(got / statistics.median(ts), 1),
                     "all_s": [round(t, 4) for t in ts]}
    out["native_over_vllm"] = round(out["native"]["tokens_per_s"] / out["vllm"]["tokens_per_s"], 3)
    return out


def measure(model_name: str, repeats: int, rollout_prompts: int, samples: int, train_tokens: int | None) -> dict:
    """Both comparisons on one checkpoint of ``model_name``; returns the JSON record."""
    cfg = MODELS[model_name]
    torch.manual_seed(0)
    load_before = os.getloadavg()
    n_tok, lo, hi = WORKLOADS[model_name]
    prompts, responses = make_batch(train_tokens or n_tok, lo, hi, cfg.vocab_size)
    r_lo, r_hi, max_out = RL_LENGTHS[model_name]
    r_prompts, lengths = draw_workload(rollout_prompts, samples, (r_lo, r_hi), max_out, cfg.vocab_size)
    with tempfile.TemporaryDirectory(prefix="backends-bench-") as d:
        save_pretrained(CausalLM(cfg), None, d)
        say("backends", f"{model_name} saved; trainer: {len(prompts)} sequences; rollout: {len(r_prompts)} x {samples}")
        trainer = measure_trainers(d, prompts, responses, repeats)
        rollout = measure_rollouts(d, r_prompts, lengths, r_hi + max_out, repeats)
    import vllm

    return {"date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), "benchmark": "backends", "model": model_name,
            "family": "llama",
            "params": sum(p.numel() for p in CausalLM(cfg).parameters()), "dtype": "float32",
            "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "vllm": vllm.__version__,
            "repeats": repeats, "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()], "trainer": trainer, "rollout": rollout}


def main(argv: list[str] | None = None) -> dict:
    """Command-line entry point; prints the ratios and, with --json, the record as the last line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=MODEL_CHOICES, default="demo")
    ap.add_argument("--repeats", type=int, default=5, help="timed passes per side, median reported")
    ap.add_argument("--prompts", type=int, default=64, help="rollout prompts")
    ap.add_argument("--samples", type=int, default=8, help="rollout samples per prompt")
    ap.add_argument("--tokens", type=int, help=f"trainer tokens per micro-batch (default per model: {WORKLOADS})")
    ap.add_argument("--threads", type=int, help="threads of every side: torch's, and the cores vLLM binds its "
                    "OpenMP threads to (VLLM_CPU_OMP_THREADS_BIND=0-<threads-1>); default: all cores")
    ap.add_argument("--json", action="store_true", help="print the JSON record as the last line")
    ap.add_argument("--record", action="store_true", help="append the record to benchmarks/results")
    ap.add_argument("--machine", default=f"cpu-{os.cpu_count()}core", help="names the results file")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.threads:
        if not 1 <= args.threads <= (os.cpu_count() or 1):
            ap.error(f"--threads must be between 1 and {os.cpu_count()}")
        torch.set_num_threads(args.threads)
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{args.threads - 1}"
    rec = measure(args.model, args.repeats, args.prompts, args.samples, args.tokens)
    t, r = rec["trainer"], rec["rollout"]
    print(f"{args.model} ({rec['params'] / 1e6:.2f} M, Llama layout), load {rec['loadavg_before'][0]} -> "
          f"{rec['loadavg_after'][0]}")
    print(f"  trainer: native {t['native']['tokens_per_s']} tok/s, transformers {t['transformers']['tokens_per_s']} "
          f"tok/s: native / transformers {t['native_over_transformers']} (log-prob max diff "
          f"{t['logprob_diff_max']:.2e})")
    print(f"  rollout: native {r['native']['tokens_per_s']} tok/s, vLLM {r['vllm']['tokens_per_s']} tok/s: "
          f"native / vLLM {r['native_over_vllm']} ({r['identical_sequences']} of {r['sequences']} identical)")
    if args.record:
        with (ROOT / "benchmarks" / "results" / f"backends-{args.machine}.jsonl").open("a") as f:
            f.write(json.dumps(rec) + "\n")
    if args.json:
        print(json.dumps(rec))
    return rec


if __name__ == "__main__":
    main()
