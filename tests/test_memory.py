"""KV length from the run's prompts, and the per-worker memory estimate of `rl check-config`."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from engines.arch import make_config
from engines.hf_io import read_config
from engines.tokenizer import train_tokenizer
from envs.arithmetic import ArithmeticEnv
from rl.cli import main
from rl.config import load_config, parse_config
from rl.data import load_task_sets, rollout_seq_len
from rl.errors import UserError
from rl.memory import check_fits, estimate

LLAMA8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072)


def test_kv_length_is_longest_prompt_plus_largest_budget(tokenizer):
    cfg = parse_config({"env": {"num_train": 50, "num_eval": 20}, "rollout": {
        "max_tokens": 30, "task_types": {"arithmetic": {"max_tokens": 44}}}})
    sets = load_task_sets(cfg)
    longest = max(len(tokenizer.encode(t.prompt)) for t in sets.train + sets.eval)
    assert rollout_seq_len(cfg, sets, tokenizer, 4096) == longest + 44
    fixed = parse_config({"env": {"num_train": 50, "num_eval": 20}, "rollout": {"max_seq_len": 77}})
    assert rollout_seq_len(fixed, sets, tokenizer, 4096) == 77
    with pytest.raises(UserError, match="exceed the model's context of 50 tokens; lower rollout.max_tokens"):
        rollout_seq_len(cfg, sets, tokenizer, 50)


def test_estimate_counts_parameters_and_cache_like_an_independent_count():
    """Parameters as transformers counts them; KV bytes from the shapes by hand."""
    arch = make_config("llama", **LLAMA8B)
    cfg = parse_config({"model": {"dtype": "bfloat16"}, "cluster": {"workers": 2},
                        "rollout": {"max_seq_len": 4096, "kv_cache_mb": 3000, "max_batch": 64}})
    est = estimate(cfg, arch, 4096)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**LLAMA8B))
    assert est.params == hf.num_parameters() == 8_030_261_248
    per_seq = 32 * 8 * 128 * 2 * 2 * 4096  # layers · kv heads · head dim · (k, v) · bf16 bytes · tokens
    assert est.kv_per_sequence == per_seq and est.kv_sequences == 3000 * 2**20 // per_seq == 5
    per_block = per_seq // 4096 * 16  # the paged cache takes the whole budget, in blocks of 16 tokens
    assert est.kv_cache == 3000 * 2**20 // per_block * per_block
    assert est.replica == est.params * 2 and est.trainer_weights == est.params  # bf16, half on each of 2 workers


def test_a_cache_that_holds_no_sequence_is_refused_naming_the_knob():
    arch = make_config("llama", **LLAMA8B)
    cfg = parse_config({"model": {"dtype": "bfloat16"}})
    est = estimate(cfg, arch, arch.max_position_embeddings)  # sized by the model's context: 16 GiB a sequence
    assert est.kv_sequences == 0
    with pytest.raises(UserError, match="rollout.kv_cache_mb: 512 MiB holds no sequence of 131072 tokens"):
        check_fits(cfg, est)


def test_a_model_too_large_for_the_machine_is_refused():
    arch = make_config("llama", **{**LLAMA8B, "vocab_size": 50_000_000})  # about 400 B parameters
    cfg = parse_config({"rollout": {"max_seq_len": 64}})
    with pytest.raises(UserError, match=r"GiB of RAM; the largest part is .* set by cluster.workers"):
        check_fits(cfg, estimate(cfg, arch, 64))


def test_check_config_prints_the_estimate_for_a_model_directory(tmp_path, capsys):
    transformers.LlamaConfig(**{**LLAMA8B, "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
                                "num_attention_heads": 4, "num_key_value_heads": 2}).save_pretrained(tmp_path / "m")
    tok = train_tokenizer([t.prompt for t in ArithmeticEnv.generate_tasks(50, seed=1)], 300)
    tok.save(tmp_path / "m")
    (tmp_path / "run.yaml").write_text(json.dumps({"model": {"path": str(tmp_path / "m")},
                                                   "env": {"num_train": 30, "num_eval": 10}}))
    assert main(["check-config", str(tmp_path / "run.yaml")]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    sets = load_task_sets(parse_config(json.loads((tmp_path / "run.yaml").read_text())))
    seq = max(len(tok.encode(t.prompt)) for t in sets.train + sets.eval) + 40  # + rollout.max_tokens
    assert "# memory per worker" in out and f"seqs x {seq} tokens)" in out


def test_the_qwen3_8b_gpu_config_fits_an_80gb_gpu_per_worker(tmp_path):
    """configs/qwen3-8b-gpu.yaml (the chart's gpu-cluster example) on Qwen3-8B's real config.json shape."""
    transformers.Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                             num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                             max_position_embeddings=40960).save_pretrained(tmp_path)
    cfg = load_config("configs/qwen3-8b-gpu.yaml", [f"model.path={tmp_path}"])
    est = estimate(cfg, read_config(tmp_path), 512 + cfg.rollout.max_tokens)
    assert 8.1e9 < est.params < 8.3e9 and est.kv_sequences >= 64
    assert est.device_peak < 80e9 * 0.9  # room for activations on an 80 GB H100


def test_check_config_of_a_remote_run_needs_no_local_model_directory(tmp_path, capsys):
    """`rl launch` validates a cluster run here, where the cluster's model directory does not exist."""
    (tmp_path / "run.yaml").write_text(json.dumps({"model": {"path": "/models/not-here"}}))
    assert main(["check-config", str(tmp_path / "run.yaml"), "--set", "cluster.ray_address=auto"]) == 0
    assert "not estimated, /models/not-here is not on this machine" in capsys.readouterr().out
    assert main(["check-config", str(tmp_path / "run.yaml")]) == 2  # a local run: the directory must exist
    assert "model.path: model directory /models/not-here does not exist" in capsys.readouterr().err
