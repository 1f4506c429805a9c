"""benchmarks.train_step: several token counts in one process, forward+backward timed apart from the optimizer
step, MFU on the model's FLOPs and the Newton–Schulz FLOPs beside the optimizer's seconds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks import train_step
from engines.model.native.causal_lm import build_model
from engines.training.flops import muon_flops
from engines.training.optim import build_optimizers

ROOT = Path(__file__).resolve().parents[1]


def _records(*args: str) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "benchmarks.train_step", *args, "--json"], capture_output=True,
                         text=True, cwd=ROOT, timeout=300, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_several_token_counts_each_get_a_record_with_the_step_split_and_its_flops():
    recs = _records("--tokens", "256", "384", "--variants", "base", "full_logits", "--repeats", "1", "--warmup", "0")
    assert [r["tokens"] for r in recs] == [256, 384]
    ns = muon_flops(build_optimizers(build_model(train_step.CONFIGS["demo"], device="meta"), "muon", 1e-4, 0.0))
    for rec in recs:
        assert rec["model"] == "demo" and rec["compile"] is False and rec["reshard_after_forward"] is None
        assert rec["ns_tflop"] == round(ns / 1e12, 4) and 0 < rec["scored_tokens"] < rec["tokens"]
        peak, flops = rec["matmul_peak_tflops"], rec["model_tflop"]
        for v in ("base", "full_logits"):
            r = rec[v]
            # the fields a GPU check reads, as before
            assert abs(r["mfu"] - flops / r["step_s"] / peak) < 0.02 * r["mfu"] + 1e-3
            assert abs(r["tokens_per_s"] - rec["tokens"] / r["step_s"]) < 0.01 * r["tokens_per_s"] + 0.1
            # the step's parts, each inside the step, and the MFU of forward and backward alone
            assert 0 < r["fwd_bwd_s"] and 0 < r["optimizer_s"]
            assert r["fwd_bwd_s"] + r["optimizer_s"] <= r["step_s"] * 1.01 + 1e-3
            assert abs(r["mfu_fwd_bwd"] - flops / r["fwd_bwd_s"] / peak) < 0.02 * r["mfu_fwd_bwd"] + 1e-3
            assert r["mfu_fwd_bwd"] > r["mfu"]
            assert abs(r["ns_tflops_per_s"] - rec["ns_tflop"] / r["optimizer_s"]) < \
                0.02 * r["ns_tflops_per_s"] + 1e-4


def test_one_rank_bfloat16_keeps_layers_gathered_unless_told_otherwise():
    args = ("--dtype", "bfloat16", "--tokens", "128", "--variants", "base", "--repeats", "1", "--warmup", "0")
    (kept,) = _records(*args)
    (recast,) = _records(*args, "--reshard-after-forward", "true")
    assert kept["reshard_after_forward"] is False and recast["reshard_after_forward"] is True
    assert kept["base"]["fwd_bwd_s"] > 0 and recast["base"]["fwd_bwd_s"] > 0


def test_the_issue_s_qwen3_shapes_have_workloads():
    """Qwen3-1.7B's shape (the MFU target's) and 8B's, each with the token budget it is measured at."""
    cfg = train_step.CONFIGS["qwen3-1.7b"]
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == (2048, 28, 16, 8, 128, 6144, 151936)
    assert train_step.WORKLOADS["qwen3-1.7b"][0] == 32768 and set(train_step.WORKLOADS) == set(train_step.CONFIGS)
