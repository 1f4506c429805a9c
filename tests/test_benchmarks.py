"""The optimizer, offload and sandbox benchmarks run and print the JSON record docs/benchmarks.md documents."""

import json
import os
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


def test_decode_sweep_times_each_batch_against_the_bytes_its_step_must_read():
    """benchmarks.decode_sweep: per (backend, batch) the step's seconds and its read roofline, whose bytes are the
    weights once plus every row's context of keys and values; a backend this device lacks is a skipped point."""
    import torch

    from benchmarks.decode_sweep import sweep_model
    from benchmarks.rollout import MODELS
    from engines.inference.kv_cache import bytes_per_token

    cfg, read_bps = MODELS["demo"], 1e10
    with torch.no_grad():
        recs = list(sweep_model("demo", torch.device("cpu"), torch.float32, ["torch", "triton"], [1, 3], 20, read_bps,
                                tries=1))
    measured = [r for r in recs if "skipped" not in r]
    # the CUDA kernel runs on a CPU only in Triton's interpreter (what tests/conftest.py picks without a GPU)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    assert [(r["backend"], r["batch"]) for r in measured] == \
        [("torch", 1), ("torch", 3)] + ([("triton", 1), ("triton", 3)] if interpreted else [])
    assert [r["backend"] for r in recs if "skipped" in r] == ([] if interpreted else ["triton"])
    weights = 4 * sum(p.numel() for p in {id(p): p for p in build_demo().parameters()}.values())
    emb = 4 * cfg.vocab_size * cfg.hidden_size  # untied: a step reads the rows of its own tokens only
    for r in measured:
        b = r["batch"]
        want = weights - emb + b * 4 * cfg.hidden_size + b * 20 * bytes_per_token(cfg, torch.float32)
        assert r["read_bytes"] == want and r["mode"] == "eager" and r["step_s"] > 0
        assert abs(r["roofline_fraction"] - want / read_bps / r["step_s"]) < 1e-3
        assert r["tok_s"] == pytest.approx(b / r["step_s"], rel=1e-3, abs=0.1)


def build_demo():
    from benchmarks.rollout import MODELS
    from engines.model.native.causal_lm import build_model

    return build_model(MODELS["demo"], device="meta")


def test_a_run_splits_into_ramp_body_and_tail_by_its_rows():
    from benchmarks.engine_steps import StepRecord, parts

    rows = [0, 40, 100, 95, 91, 60, 100, 30, 2]  # prefill, filling, the full batch (with a dip), the tail
    steps = [StepRecord(decode=n, sampled=n or 10, chunks=int(n < 100), prefill_tokens=0, context_tokens=10 * n,
                        seconds=0.5) for n in rows]
    p = parts(steps, (1000, 0), 2, 1e6, "cpu")
    assert [p[k]["steps"] for k in ("ramp", "body", "tail")] == [2, 4, 3]
    assert p["body"]["tokens"] == 100 + 95 + 91 + 100 and p["body"]["mean_rows"] == 96.5
    assert p["ramp"]["tokens"] == 10 + 40 and p["tail"]["tokens"] == 60 + 30 + 2
    # the body's read roofline: 4 steps of weights plus their contexts' keys and values, over 2 s
    assert p["body"]["read_bytes"] == 4 * 1000 + 2 * 10 * 386 and p["body"]["seconds"] == 2.0
    assert p["body"]["roofline_fraction"] == round(p["body"]["read_bytes"] / 1e6 / 2.0, 4)


def test_a_timed_run_logs_every_step_and_checks_for_captures_in_its_window(tmp_path, capsys):
    import torch

    from benchmarks.engine_steps import capture_check, run_record, timed_generate, write_step_log
    from benchmarks.rollout import MODELS
    from engines.inference.native import InferenceEngine
    from engines.inference.sampling import SamplingParams
    from engines.model.native.causal_lm import build_model

    torch.manual_seed(0)
    engine = InferenceEngine(build_model(MODELS["demo"], init=True), eos_id=1, max_seq_len=64, max_num_seqs=8,
                             kv_cache_bytes=2**20)
    prompts = [[5 + i] * (10 + 7 * i) for i in range(6)]
    run = timed_generate(engine, prompts, [SamplingParams(0.0, 3 + 2 * i, ignore_eos=True) for i in range(6)])
    assert [len(o) for o in run.outputs] == [3 + 2 * i for i in range(6)]
    assert sum(s.sampled for s in run.steps) == sum(3 + 2 * i for i in range(6))
    assert sum(s.prefill_tokens for s in run.steps) == sum(10 + 7 * i for i in range(6))
    assert abs(sum(s.seconds for s in run.steps) - run.seconds) < 0.05 * run.seconds + 0.01
    # a decode step attends to each row's whole context: its prompt and the tokens it has so far
    last = run.steps[-1]
    assert last.decode == 1 and last.context_tokens == 10 + 7 * 5 + (3 + 2 * 5) - 1
    rec = run_record(engine, run, 1e10, "cpu", graphs=False)
    assert rec["captures_in_window"] == 0 and "checks_failed" not in rec and rec["preemptions"] == 0
    assert rec["parts"]["body"]["steps"] + rec["parts"]["ramp"]["steps"] + rec["parts"]["tail"]["steps"] == \
        rec["engine_steps"] == len(run.steps)
    write_step_log(tmp_path / "steps.jsonl", run.steps, model="demo")
    lines = [json.loads(x) for x in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(len(run.steps))) and lines[0]["model"] == "demo"
    assert capture_check(2, graphs=False) == {"captures_in_window": 2}  # eager: nothing to check
    assert capture_check(2, graphs=True)["checks_failed"] == ["captures_in_window"]
    assert "CHECK FAILED: 2 CUDA graph(s) captured inside the timed window" in capsys.readouterr().err
