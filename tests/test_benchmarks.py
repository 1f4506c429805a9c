"""The optimizer, offload and sandbox benchmarks run and print the JSON record docs/benchmarks.md documents."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _last_json(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", *args, "--json"], capture_output=True, text=True, cwd=ROOT,
                         timeout=300, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_optimizer_benchmark_reports_muon_against_adamw():
    rec = _last_json("benchmarks.optimizer", "--repeats", "2", "--warmup", "1")
    assert rec["model"] == "demo" and rec["params"] == 918656
    assert abs(rec["ratio"] - rec["muon_step_s"] / rec["adamw_step_s"]) < 0.01 * rec["ratio"]
    assert rec["qk_clipped_heads"] > 0  # the timed MuonClip step really clipped


def test_offload_benchmark_reports_both_directions_against_a_copy():
    rec = _last_json("benchmarks.offload", "--repeats", "2")
    assert rec["bytes"] > 4 * rec["params"]  # parameters plus optimizer state
    for k in ("offload_s", "onload_s", "copy_s"):
        assert rec[k] > 0
    assert abs(rec["offload_ratio"] - rec["offload_s"] / rec["copy_s"]) < 0.01 * rec["offload_ratio"] + 1e-3


def test_sandbox_benchmark_runs_both_sides_without_failures():
    rec = _last_json("benchmarks.sandbox", "--n", "12", "--concurrency", "4", "--rounds", "1")
    assert rec["failures"] == 0 and rec["baseline_failures"] == 0 and rec["concurrency"] == 4
    assert abs(rec["overhead"] - rec["baseline_execs_per_s"] / rec["execs_per_s"]) < 0.01 * rec["overhead"] + 0.01
    assert rec["p99_s"] > 0 and rec["baseline_p99_s"] > 0
    assert rec["cpu_ms"] > 0 and rec["baseline_cpu_ms"] > 0
    assert abs(rec["cpu_overhead"] - rec["cpu_ms"] / rec["baseline_cpu_ms"]) < 0.02 * rec["cpu_overhead"] + 0.01


@pytest.mark.slow
def test_rl_iteration_benchmark_runs_the_k2_layout_at_toy_size():
    """The GPU benchmark of one RL iteration on real shapes, here on the toy K2 layout on CPU."""
    rec = _last_json("benchmarks.rl_iteration", "--model", "tiny-k2", "--prompts", "2", "--samples", "2",
                     "--max-tokens", "6", "--iterations", "1")
    assert rec["model"] == "tiny-k2" and rec["sequences"] == 4
    assert rec["rollout_tokens"] == 4 * 6  # a random model never says EOS: every response runs to its budget
    assert all(rec[k] > 0 for k in ("time_rollout", "time_train", "time_weight_update"))
    assert rec["mem_rollout_peak_gib"] > 0 and rec["mem_train_peak_gib"] > 0


def test_train_step_benchmark_reports_throughput_mfu_and_memory_of_each_variant():
    rec = _last_json("benchmarks.train_step", "--tokens", "768", "--repeats", "1", "--warmup", "0")
    assert rec["model"] == "demo" and rec["tokens"] >= 700 and rec["matmul_peak_tflops"] > 0
    for v in ("base", "checkpointing", "no_smax", "full_logits"):
        r = rec[v]
        assert abs(r["tokens_per_s"] - rec["tokens"] / r["step_s"]) < 0.01 * r["tokens_per_s"] + 0.1
        assert abs(r["mfu"] - rec["model_tflop"] / r["step_s"] / rec["matmul_peak_tflops"]) < 0.02 * r["mfu"] + 1e-3
        assert r["peak_mem_mib"] > 0
    # live tensor memory is counted exactly: checkpointing keeps each layer's input only
    assert rec["checkpointing"]["peak_mem_mib"] < rec["base"]["peak_mem_mib"]
    assert "smax_overhead" in rec and "peak_mem_chunked_over_full" in rec


@pytest.mark.slow
def test_train_step_with_lora_keeps_a_frozen_base_and_the_adapters_state():
    """--lora: only the adapters train, so what the trainer keeps is the weights plus AdamW's two moments (and step
    count) of the adapters alone, counted here from the demo model's shapes, and a step's growth (gradients of the
    adapters, not of the weights) stays below full training's."""
    from benchmarks.rollout import MODELS
    from engines.model.native.causal_lm import build_model

    args = ("--tokens", "512", "--repeats", "1", "--warmup", "1", "--variants", "base")
    full = _last_json("benchmarks.train_step", *args)
    lora = _last_json("benchmarks.train_step", *args, "--lora", "4")
    cfg, r = MODELS["demo"], 4
    h, i = cfg.hidden_size, cfg.intermediate_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    # r·(in + out) for q, o (h→h), k, v (h→kv), gate, up, down (h↔i), in every layer
    adapters = cfg.num_hidden_layers * r * (2 * (h + h) + 2 * (h + kv) + 3 * (h + i))
    base = sum(p.numel() for p in build_model(cfg, device="meta").parameters())
    assert lora["lora_rank"] == r and lora["trainable_params"] == adapters
    steps = cfg.num_hidden_layers * 7 * 2  # AdamW's step count: one scalar per adapter tensor
    assert abs(lora["kept_mib"] - 4 * (base + 3 * adapters + steps) / 2**20) <= 0.06
    assert lora["base"]["peak_mem_mib"] < full["base"]["peak_mem_mib"]
    assert lora["base"]["total_peak_mib"] < full["base"]["total_peak_mib"]
