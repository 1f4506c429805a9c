"""Families the native code lacks, each trained for three RL iterations through ``rl.api.train`` on the
transformers backend, rolled out by vLLM's CPU build, the weights moved in place between iterations.

Per family, the run's own records are the checks, each against something computed apart:
* every iteration's ``logprob_diff`` (|π_vLLM − π_trainer| over the sampled tokens, before any optimizer step):
  iterations 1 and 2 (of 0, 1, 2) are sampled by vLLM after an in-place update, scored by the trainer on the weights it
  trained, so their agreement to float32 rounding is the update reaching vLLM's kernels as a fresh load would
  (an update that missed a tensor shows as differences of order 1, as MoE layers did: docs/models.md);
* the saved ``final/`` loads with transformers' own ``from_pretrained``, under the names and bits it wrote, and
  differs from the start (the optimizer stepped).
Rewards: a plain function of the response (the share of digits), and -0.5 for a response cut at the budget (a
random model rarely ends its turn), so that the groups get rewards that differ and each step moves the weights.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from engines.model.io.hf_io import read_tensors
from rl.api import train
from rl.config import parse_config
from tests.vllm_check import save_tiny_model

vllm_engine = pytest.importorskip("engines.inference.vllm_engine")
if not vllm_engine.vllm_available():
    pytest.skip("vLLM is not installed here (make setup installs it)", allow_module_level=True)

#: (family, what it brings that no native family has); Gemma 3's served weights are compared bit for bit in
#: tests/test_hf_run.py
FAMILIES = {
    "gemma3_text": "local/global layers, q/k norm, sandwich norms, scaled embeddings",
    "gpt_oss": "MoE with biases, attention sinks, alternating sliding window",
    "phi3": "fused qkv and gate/up projections",
    "granite": "embedding, residual, attention and logit multipliers",
    "exaone4": "local/global layers, norms after the sub-layers",
    "nemotron_h-dense": "hybrid Mamba-2 / attention / MLP layers",
    # an MoE family no list names: its replica checks at start that in-place updates reach its experts
    # (engines.inference.replica_check), and the run's logprob_diff confirms it on every iteration
    "qwen2_moe": "MoE with a gated shared expert, a dense first layer, q/k/v biases",
}
#: float32 on both engines, different kernels (the survey of docs/models.md: at most 2.1e-5, Mamba layers)
ROUNDING = 1e-4
def run_config(model_dir, reward_file, iterations: int = 3, **sections):
    """Three iterations of 2 prompts x 4 samples of the model in ``model_dir`` on the transformers backend and vLLM."""
    raw = {"run": {"iterations": iterations, "eval_every": 4, "eval_samples": 0, "save_every": 1},
           "model": {"path": str(model_dir), "backend": "transformers"},
           "env": {"name": "arithmetic", "num_train": 16, "num_eval": 4,
                   "reward": {"function": f"{reward_file}:digits"}},
           "rollout": {"engine": "vllm", "kv_cache_mb": 64, "max_seq_len": 128, "prompts_per_iteration": 2,
                       "samples_per_prompt": 4, "max_tokens": 24, "max_batch": 8, "truncation_penalty": -0.5},
           "algorithm": {"minibatches": 1, "micro_batch": 8, "drop_equal_reward_groups": False},
           "optimizer": {"lr": 1e-2},
           "checkpoint_engine": {"bucket_mb": 0.01}}  # ~10 KiB: many buckets, tensors split across them
    for k, v in sections.items():
        raw.setdefault(k, {}).update(v)
    return parse_config(raw)


#: in the default tier: MoE with biases and sinks (loaded around vLLM's weight loaders), and an MoE family taken on its
#: replica's own check; the other five run in the slow tier
DEFAULT_TIER = ("gpt_oss", "qwen2_moe")


@pytest.mark.parametrize("family", [f if f in DEFAULT_TIER else pytest.param(f, marks=pytest.mark.slow)
                                    for f in FAMILIES])
def test_three_iterations_on_vllm_with_in_place_updates(ray_cluster, tokenizer, reward_file, tmp_path, family):
    model_dir = save_tiny_model(family, tmp_path / "model", tokenizer)
    start = read_tensors(model_dir)
    cfg = run_config(model_dir, reward_file)
    train(cfg, tmp_path / "run")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "logprob_diff_max" in r]
    print(json.dumps({"family": family, "logprob_diff_mean": [r["logprob_diff_mean"] for r in steps],
                      "logprob_diff_max": [r["logprob_diff_max"] for r in steps]}), file=sys.stderr)
    assert [r["iteration"] for r in steps] == [0, 1, 2]
    assert all(r["logprob_diff_max"] < ROUNDING for r in steps), steps
    # final/ is a Hugging Face checkpoint transformers loads as it is, and training moved it
    from transformers import AutoModelForCausalLM

    final = tmp_path / "run" / "final"
    saved = read_tensors(final)
    AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).save_pretrained(tmp_path / "resaved")
    resaved = read_tensors(tmp_path / "resaved")
    assert set(saved) == set(start) == set(resaved)
    assert all(torch.equal(resaved[k], v) for k, v in saved.items())
    assert any(not torch.equal(saved[k], start[k]) for k in start)


def test_a_family_the_rollout_engine_cannot_run_stops_at_start_in_one_line(ray_cluster, tokenizer, reward_file,
                                                                            tmp_path):
    """Mamba-1: transformers trains it and vLLM builds it, but vLLM's CPU build has no kernel for its selective scan.
    The replica's start-up check scores a probe, fails, and the run ends with one line naming the model and the
    cause (rl.loop.controller.start_cluster), before any iteration; nothing is saved as a result."""
    from rl.errors import CommandFailed

    model_dir = save_tiny_model("mamba", tmp_path / "model", tokenizer)
    with pytest.raises(CommandFailed) as failed:
        train(run_config(model_dir, reward_file), tmp_path / "run")
    line = str(failed.value)
    print(line, file=sys.stderr)
    assert "\n" not in line and line.startswith("a worker failed to start: ReplicaCheckError: vLLM on cpu cannot "
                                                "run mamba (MambaForCausalLM)") and "selective_scan_fwd" in line
    assert not (tmp_path / "run" / "final").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_a_resumed_run_with_ptx_and_partial_rollout_ends_bit_exactly(ray_cluster, tokenizer, reward_file, tmp_path):
    """Gemma 3 on the transformers backend and vLLM, with PTX and partial rollout: four iterations straight, and two
    then a resume to four, end with the same weights and rewards, bit for bit."""
    from safetensors.torch import load_file

    from envs.arithmetic import ArithmeticEnv
    from rl.config import load_config

    model_dir = save_tiny_model("gemma3_text", tmp_path / "model", tokenizer)
    ptx = tmp_path / "ptx.jsonl"
    ptx.write_text("".join(json.dumps({"prompt": t.prompt, "response": t.meta["solution"]}) + "\n"
                           for t in ArithmeticEnv.generate_tasks(20, seed=5)))
    features = {"rollout": {"partial": {"token_budget": 150, "max_age": 1}},
                "algorithm": {"ptx": {"data": str(ptx), "coef": 0.1, "batch_size": 4}}}
    full, split = tmp_path / "full", tmp_path / "split"
    train(run_config(model_dir, reward_file, iterations=4, **features), full)
    train(run_config(model_dir, reward_file, iterations=2, **features), split)
    (split / "config.yaml").write_text((split / "config.yaml").read_text().replace("iterations: 2", "iterations: 4"))
    train(load_config(split / "config.yaml"), split, resume=True)
    records = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    resumed = [json.loads(x) for x in (split / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if r["trained_samples"]]
    # steps with PTX before the resume and after it (the budget pauses every other iteration's groups)
    assert {r["iteration"] >= 2 for r in trained} == {True, False} and all(r["ptx_loss"] > 0 for r in trained)
    assert sum(r["partial_paused"] for r in records) > 0
    assert [r["reward_mean"] for r in resumed] == [r["reward_mean"] for r in records]
    a, b = load_file(str(full / "final" / "model.safetensors")), load_file(str(split / "final" / "model.safetensors"))
    start = read_tensors(model_dir)
    assert any(not torch.equal(a[k], start[k]) for k in a)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
