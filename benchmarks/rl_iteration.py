"""One full RL iteration (rollout, reward, train step, weight update) of a real-size model shape.

    python -m benchmarks.rl_iteration --model qwen3-0.6b --device cuda --json
    python -m benchmarks.rl_iteration --model llama-3.2-1b --device cuda --json
    python -m benchmarks.rl_iteration --model k2-1b --device cuda --json
    python -m benchmarks.rl_iteration --model tiny-k2 --json        # the same code at toy size, on CPU

The model is built with random weights in the named shape (transformers' config class of its family,
the real vocabulary size) and saved as a Hugging Face directory with a small BPE tokenizer; then
``rl train`` runs on it with ``model.path`` for ``--iterations`` iterations (the first pays one-time
costs: compilation, CUDA graphs, the first weight update's set-up). The record gives the last
iteration's time per phase and the peak memory of the rollout and trainer processes in their phases
(on one GPU both processes share it). A random model never says EOS, so every response runs to
``--max-tokens``: the rollout is the worst case of its budget.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml

from engines.model.arch import make_config
from engines.model.causal_lm import build_model
from engines.model.hf_io import save_pretrained
from engines.model.tokenizer import train_tokenizer
from envs.arithmetic import ArithmeticEnv

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


def run(shape: str, *, device: str = "cpu", dtype: str = "bfloat16", iterations: int = 2, prompts: int = 64,
        samples: int = 8, max_tokens: int = 1024, workdir: Path | None = None) -> dict:
    """Build the model, run ``rl train`` on it, return the last iteration's record."""
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        tmp = Path(tmp)
        params = build(shape, tmp / "model", getattr(torch, dtype))
        config = {
            "run": {"name": f"iteration-{shape}", "iterations": iterations, "eval_every": 10**6,
                    "save_every": 10**6},
            "cluster": {"workers": 1, "gpus_per_worker": 1 if device == "cuda" else 0},
            "model": {"path": str(tmp / "model"), "dtype": "float32"},
            "env": {"name": "arithmetic", "num_train": 2000, "num_eval": 8},
            "rollout": {"prompts_per_iteration": prompts, "samples_per_prompt": samples, "max_tokens": max_tokens,
                        "dtype": dtype, "kv_cache_mb": 16384 if device == "cuda" else 512},
            "trainer": {"param_dtype": dtype},
            # a random model's rewards are all equal: keep those groups, or nothing would be trained
            "algorithm": {"minibatches": 1, "micro_batch": 64, "drop_equal_reward_groups": False},
        }
        (tmp / "run.yaml").write_text(yaml.safe_dump(config))
        cmd = [sys.executable, "-m", "rl.cli", "train", str(tmp / "run.yaml"), "--run-dir", str(tmp / "run")]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"rl train failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        records = [json.loads(x) for x in (tmp / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    last = records[-1]
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
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    cuda = a.device == "cuda"
    rec = run(a.model, device=a.device, dtype=a.dtype or ("bfloat16" if cuda else "float32"),
              iterations=a.iterations, prompts=a.prompts, samples=a.samples,
              max_tokens=a.max_tokens or (1024 if cuda else 16))
    if not a.json:
        print(f"{a.model} ({rec['params']:,} parameters) on {a.device}: one iteration {rec['iteration_s']} s; "
              f"peak {rec['mem_rollout_peak_gib']} GiB rollout, {rec['mem_train_peak_gib']} GiB train")
    print(json.dumps(rec))


if __name__ == "__main__":
    main()
