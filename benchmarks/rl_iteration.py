"""One full RL iteration (rollout, reward, train step, weight update) of a real-size model shape.

    python -m benchmarks.rl_iteration --model qwen3-0.6b --device cuda --json
    python -m benchmarks.rl_iteration --model llama-3.2-1b --device cuda --json
    python -m benchmarks.rl_iteration --model k2-1b --device cuda --json
    python -m benchmarks.rl_iteration --model tiny-k2 --json        # the same code at toy size, on CPU
    python -m benchmarks.rl_iteration --model qwen2-2.6m --max-tokens 8 --minibatches 2 --micro-batch 0 \
        --iterations 20 --warmup 5 --repeats 3 --against 3221c8f --json  # per-phase medians, this tree vs another

The model is built with random weights in the named shape (transformers' config class of its family,
the real vocabulary size) and saved as a Hugging Face directory with a small BPE tokenizer; then
``rl train`` runs on it with ``model.path`` for ``--iterations`` iterations (the first pays one-time
costs: compilation, CUDA graphs, the first weight update's set-up). The record gives the last
iteration's time per phase and the peak memory of the rollout and trainer processes in their phases
(on one GPU both processes share it). A random model never says EOS, so every response runs to
``--max-tokens``: the rollout is the worst case of its budget.

With ``--against REV`` the same model directory and config run in this tree and in REV (checked out in a
temporary ``git worktree``, its ``rl train`` with that tree's ``PYTHONPATH`` and cwd), ``--repeats`` times each,
interleaved (A B, B A, A B, ...) so that load on a shared machine hits both alike. Each run's iterations after
the first ``--warmup`` give per-phase medians; the record holds, per tree, the median over all their iterations
and the per-run medians (the spread), and the ratio this tree / REV of each phase. The config uses only keys
both trees know (the learning rate is set, since its default changed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml

from engines.model.io.hf_io import save_pretrained
from engines.model.native.arch import make_config
from engines.model.native.causal_lm import build_model
from engines.model.text.tokenizer import train_tokenizer
from envs.arithmetic import ArithmeticEnv

ROOT = Path(__file__).resolve().parents[1]

#: family and transformers config arguments of each shape
SHAPES = {
    "qwen3-0.6b": ("qwen3", dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                                 rope_theta=1_000_000.0, max_position_embeddings=40960)),
    "llama-3.2-1b": ("llama", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                                   rope_theta=500_000.0, max_position_embeddings=131072,
                                   rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    # the Kimi K2 layout (MLA, 1 shared + routed experts with a sigmoid router) scaled to about 1 B parameters
    "k2-1b": ("deepseek_v3", dict(vocab_size=32768, hidden_size=1024, intermediate_size=4096, num_hidden_layers=12,
                                  num_attention_heads=16, num_key_value_heads=16, q_lora_rank=384, kv_lora_rank=128,
                                  qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=64,
                                  num_experts_per_tok=6, n_shared_experts=1, moe_intermediate_size=384,
                                  first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                  max_position_embeddings=4096)),
    # a small Qwen2-format model (q/k/v biases) of 2.6 M parameters: the transfer suite's Qwen2 layers and a
    # vocabulary of 7168 (the task's 512-token tokenizer uses the first rows, as with a converted model's own
    # tokenizer); an RL task whose train phase is light enough that per-step overheads show
    "qwen2-2.6m": ("qwen2", dict(vocab_size=7168, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                 max_position_embeddings=512)),
    # toy versions of the same code paths, for a CPU
    "tiny-qwen3": ("qwen3", dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                                 max_position_embeddings=512)),
    "tiny-k2": ("deepseek_v3", dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                                    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                                    num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
                                    first_k_dense_replace=1, n_group=2, topk_group=1, max_position_embeddings=512)),
}
PHASES = ("time_rollout", "time_reward", "time_onload", "time_train", "time_offload", "time_weight_update")


def build(shape: str, directory: Path, dtype: torch.dtype) -> int:
    """Write a random-weight model of ``shape`` with a BPE tokenizer to ``directory``; returns its parameters."""
    family, kw = SHAPES[shape]
    tok = train_tokenizer([t.prompt + t.meta["solution"] for t in ArithmeticEnv.generate_tasks(500, seed=0)], 512)
    cfg = make_config(family, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id, bos_token_id=None, **kw)
    torch.manual_seed(0)
    model = build_model(cfg, dtype=dtype, init=True)
    save_pretrained(model, tok, directory)
    return sum(p.numel() for p in model.parameters())


def run_config(model_dir: Path, *, device: str, dtype: str, iterations: int, prompts: int, samples: int,
               max_tokens: int, minibatches: int = 1, micro_batch: int | None = 64, lr: float = 1e-4) -> dict:
    """The ``rl train`` config of a benchmark run on ``model_dir`` (keys that 3221c8f's schema knows too)."""
    return {
        "run": {"name": "iteration", "iterations": iterations, "eval_every": 10**6, "save_every": 10**6},
        "cluster": {"workers": 1, "gpus_per_worker": 1 if device == "cuda" else 0},
        "model": {"path": str(model_dir), "dtype": "float32"},
        "env": {"name": "arithmetic", "num_train": 2000, "num_eval": 8},
        "rollout": {"prompts_per_iteration": prompts, "samples_per_prompt": samples, "max_tokens": max_tokens,
                    "dtype": dtype, "kv_cache_mb": 16384 if device == "cuda" else 512},
        "trainer": {"param_dtype": dtype},
        # a random model's rewards are all equal: keep those groups, or nothing would be trained
        "algorithm": {"minibatches": minibatches, "drop_equal_reward_groups": False,
                      **({"micro_batch": micro_batch} if micro_batch else {})},
        "optimizer": {"kind": "muon", "lr": lr},
    }


def train_records(config: dict, workdir: Path, tree: Path = ROOT) -> list[dict]:
    """Run ``rl train`` of ``tree`` (its code, its cwd) on ``config``; the metrics record of each iteration."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "run.yaml").write_text(yaml.safe_dump(config))
    cmd = [sys.executable, "-m", "rl.cli", "train", str(workdir / "run.yaml"), "--run-dir", str(workdir / "run")]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tree, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"rl train ({tree}) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads(x) for x in (workdir / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]


def run(shape: str, *, device: str = "cpu", dtype: str = "bfloat16", iterations: int = 2, prompts: int = 64,
        samples: int = 8, max_tokens: int = 1024, minibatches: int = 1, micro_batch: int | None = 64,
        lr: float = 1e-4, workdir: Path | None = None) -> dict:
    """Build the model, run ``rl train`` on it, return the last iteration's record."""
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        tmp = Path(tmp)
        params = build(shape, tmp / "model", getattr(torch, dtype))
        config = run_config(tmp / "model", device=device, dtype=dtype, iterations=iterations, prompts=prompts,
                            samples=samples, max_tokens=max_tokens, minibatches=minibatches,
                            micro_batch=micro_batch, lr=lr)
        last = train_records(config, tmp)[-1]
    return {
        "model": shape,
        "params": params,
        "device": device,
        "dtype": dtype,
        "sequences": prompts * samples,
        "max_tokens": max_tokens,
        "rollout_tokens": last["rollout_tokens"],
        **{k: last[k] for k in PHASES if k in last},
        "iteration_s": round(sum(last.get(k, 0.0) for k in ("time_rollout", "time_reward", "time_train",
                                                              "time_weight_update")), 3),
        "mem_rollout_peak_gib": last.get("mem_rollout_peak_gib"),
        "mem_train_peak_gib": last.get("mem_train_peak_gib"),
        "kv_usage_peak": last.get("kv_usage_peak"),
    }


def phase_medians(records: list[dict]) -> dict[str, float]:
    """Median seconds of each phase over ``records`` (phases a record lacks are left out of its median)."""
    return {k: round(statistics.median(r[k] for r in records if k in r), 4)
            for k in PHASES if any(k in r for r in records)}


def compare(shape: str, against: str, *, repeats: int, warmup: int, device: str = "cpu", dtype: str = "float32",
            workdir: Path | None = None, **settings) -> dict:
    """Per-phase medians of this tree and of git revision ``against`` on one model and config, runs interleaved."""
    rev = subprocess.run(["git", "rev-parse", "--short", against], capture_output=True, text=True, cwd=ROOT,
                         check=True).stdout.strip()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                          check=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True, cwd=ROOT, check=True).stdout.strip())
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        tmp = Path(tmp)
        other = tmp / f"tree-{rev}"
        subprocess.run(["git", "worktree", "add", "--detach", str(other), rev], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            # the gRPC stubs are generated, not committed: REV's tree gets this tree's copies
            for stub in (ROOT / "sandbox" / "proto").glob("*_pb2*.py"):
                shutil.copy(stub, other / "sandbox" / "proto" / stub.name)
            params = build(shape, tmp / "model", getattr(torch, dtype))
            config = run_config(tmp / "model", device=device, dtype=dtype, **settings)
            trees = {"this": ROOT, "against": other}
            runs: dict[str, list[list[dict]]] = {"this": [], "against": []}
            for i in range(repeats):
                for name in (("this", "against") if i % 2 == 0 else ("against", "this")):
                    records = train_records(config, tmp / f"{name}-{i}", trees[name])[warmup:]
                    if not records:
                        raise SystemExit(f"no iteration left after --warmup {warmup}: raise --iterations")
                    runs[name].append(records)
                    print(f"{name} run {i}: {phase_medians(records)}", file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(other)], cwd=ROOT, capture_output=True)
    out: dict = {"model": shape, "params": params, "device": device, "dtype": dtype, "this": head + ("+" if dirty
                 else ""), "against": rev, "repeats": repeats, "warmup": warmup, "config": config}
    for name, rs in runs.items():
        out[name + "_median"] = phase_medians([r for records in rs for r in records])
        out[name + "_run_medians"] = [phase_medians(records) for records in rs]
        out[name + "_train_s"] = [[round(r["time_train"], 3) for r in records if "time_train" in r] for records in rs]
    a, b = out["this_median"], out["against_median"]
    out["ratio"] = {k: round(a[k] / b[k], 4) for k in a if k in b and b[k] > 0}
    # the pairs run back to back: their ratios show how much of the overall ratio is load that moved between pairs
    out["pair_train_ratios"] = [round(x["time_train"] / y["time_train"], 4) for x, y in
                                zip(out["this_run_medians"], out["against_run_medians"], strict=True)]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", choices=sorted(SHAPES), default="tiny-k2")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                    help="rollout and trainer compute dtype (default: bfloat16 on cuda, float32 on cpu)")
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=None, help="default 1024 on cuda, 16 on cpu")
    ap.add_argument("--minibatches", type=int, default=1, help="optimizer steps per iteration")
    ap.add_argument("--micro-batch", type=int, default=64,
                    help="most sequences per forward/backward (0: the schema's token budget alone)")
    ap.add_argument("--lr", type=float, default=1e-4, help="Muon's learning rate (set: its default changed)")
    ap.add_argument("--against", metavar="REV", help="also run git revision REV, interleaved; print both and ratios")
    ap.add_argument("--repeats", type=int, default=3, help="with --against: runs of each tree")
    ap.add_argument("--warmup", type=int, default=5, help="with --against: first iterations of each run left out")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    cuda = a.device == "cuda"
    settings = dict(iterations=a.iterations, prompts=a.prompts, samples=a.samples,
                    max_tokens=a.max_tokens or (1024 if cuda else 16), minibatches=a.minibatches,
                    micro_batch=a.micro_batch or None, lr=a.lr)
    dtype = a.dtype or ("bfloat16" if cuda else "float32")
    if a.against:
        rec = compare(a.model, a.against, repeats=a.repeats, warmup=a.warmup, device=a.device, dtype=dtype,
                      **settings)
        if not a.json:
            for k, v in rec["ratio"].items():
                print(f"{k}: {rec['this_median'][k]} s here, {rec['against_median'][k]} s at {rec['against']}: "
                      f"{v}x")
        print(json.dumps(rec))
        return
    rec = run(a.model, device=a.device, dtype=dtype, **settings)
    if not a.json:
        print(f"{a.model} ({rec['params']:,} parameters) on {a.device}: one iteration {rec['iteration_s']} s; "
              f"peak {rec['mem_rollout_peak_gib']} GiB rollout, {rec['mem_train_peak_gib']} GiB train")
    print(json.dumps(rec))


if __name__ == "__main__":
    main()
