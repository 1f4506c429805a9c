"""KV length from the run's prompts, and the per-worker memory estimate of `rl check-config`."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

from engines.model.io.hf_io import read_config
from engines.model.native.arch import make_config
from engines.model.text.tokenizer import train_tokenizer
from envs.arithmetic import ArithmeticEnv
from rl.cli import main
from rl.config import load_config, parse_config
from rl.errors import UserError
from rl.rollout.data import load_task_sets, rollout_seq_len
from rl.setup.memory import check_fits, estimate

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
    with pytest.raises(UserError, match="do not fit the model's context of 50 tokens .*; lower rollout.max_tokens"):
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
    assert est.replica == est.params * 2  # the bf16 replica
    assert est.trainer_weights == est.params * 4 // 2  # float32 master weights, half on each of 2 workers
    bf16_master = estimate(parse_config({"model": {"dtype": "bfloat16"}, "cluster": {"workers": 2},
                                         "trainer": {"master_dtype": "bfloat16"}}), arch, 4096)
    assert bf16_master.trainer_weights == est.params


def test_activations_follow_tokens_and_checkpointing():
    """Activations of one micro-batch: linear in its tokens; with activation checkpointing each layer keeps only
    its input (hidden size per token) plus one layer's working set; independent of workers."""
    arch = make_config("llama", **LLAMA8B)

    def act(tokens, ckpt, workers=1):
        cfg = parse_config({"model": {"dtype": "bfloat16"}, "cluster": {"workers": workers},
                            "algorithm": {"micro_batch_tokens": tokens}, "trainer": {"activation_checkpointing": ckpt},
                            "rollout": {"max_seq_len": 64}})
        return estimate(cfg, arch, 64).activations

    # per token and layer without checkpointing, by hand: 3 hidden-size vectors, q and attention output (4096
    # each), k and v (1024 each), gate, up and their product (14336 each), in bfloat16; plus the log-prob blocks
    per_token = 32 * (3 * 4096 + 2 * 4096 + 2 * 1024 + 3 * 14336) * 2
    logprob_blocks = 2 * 4096 * 16384 * 4  # two float32 [tokens, chunk] blocks, chunk = 64 Mi / tokens
    # bf16 compute over float32 master weights goes through FSDP, which gathers two decoder layers (one computing,
    # one prefetched) and the root (embeddings, head, final norm) in bf16
    layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    gathered = (2 * layer + 2 * 128256 * 4096 + 4096) * 2
    assert act(4096, False) == 4096 * per_token + logprob_blocks + gathered
    assert act(8192, False) - act(4096, False) == 4096 * per_token  # same log-prob blocks (2 x 64 Mi elements)
    with_ckpt = act(4096, True)
    assert with_ckpt == 32 * 4096 * 4096 * 2 + 2 * 4096 * per_token // 32 + logprob_blocks + gathered
    assert with_ckpt < act(4096, False) / 3
    assert act(4096, True, 2) == with_ckpt  # per worker: the micro-batch is the same whatever the worker count


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


def test_the_one_node_qwen3_config_fits_and_the_32_worker_one_on_a_node_is_warned_about(tmp_path, capsys):
    """A4: configs/qwen3-8b-1node.yaml (8 workers) fits an 80 GB GPU per worker with a KV cache that holds what
    each worker decodes at once; the 32-worker config on 8 workers leaves each worker 256 sequences for a cache
    of 68, and check-config says so, naming the setting. By hand: 36 layers x 8 KV heads x 128 x (k, v) x 2 bytes
    = 144 KiB a token, x 2560 tokens = 360 MiB a sequence, 24 GiB / 360 MiB = 68."""
    from rl.setup.memory import kv_shortfall

    transformers.Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                             num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                             max_position_embeddings=40960).save_pretrained(tmp_path)
    seq = 512 + 2048
    one = load_config("configs/qwen3-8b-1node.yaml", [f"model.path={tmp_path}"])
    est = estimate(one, read_config(tmp_path), seq)
    assert est.kv_per_sequence == 36 * 8 * 128 * 2 * 2 * seq and est.kv_sequences == 68
    assert est.device_peak < 80e9 * 0.9 and kv_shortfall(one, est) is None
    crowded = load_config("configs/qwen3-8b-gpu.yaml", [f"model.path={tmp_path}", "cluster.workers=8"])
    warning = kv_shortfall(crowded, estimate(crowded, read_config(tmp_path), seq))
    assert warning is not None and "holds 68 sequences" in warning and "up to 256 at once" in warning
    assert "raise rollout.kv_cache_mb toward 92160 MiB" in warning  # 256 x 360 MiB
    # and check-config prints it (a model too large for this machine: the estimate is what is asked)
    assert main(["check-config", "configs/qwen3-8b-gpu.yaml", "--set", f"model.path={tmp_path}", "--set",
                 "cluster.workers=8", "--set", f"rollout.max_seq_len={seq}", "--set", "cluster.ray_address=auto"]) == 0
    out = capsys.readouterr().out
    assert "# warning: rollout.kv_cache_mb: 24576 MiB holds 68 sequences" in out


def test_check_config_of_a_remote_run_needs_no_local_model_directory(tmp_path, capsys):
    """`rl launch` validates a cluster run here, where the cluster's model directory does not exist."""
    (tmp_path / "run.yaml").write_text(json.dumps({"model": {"path": "/models/not-here"}}))
    assert main(["check-config", str(tmp_path / "run.yaml"), "--set", "cluster.ray_address=auto"]) == 0
    assert "not estimated, /models/not-here is not on this machine" in capsys.readouterr().out
    assert main(["check-config", str(tmp_path / "run.yaml")]) == 2  # a local run: the directory must exist
    assert "model.path: model directory /models/not-here does not exist" in capsys.readouterr().err


def test_check_config_warns_loudly_about_bfloat16_master_weights(tmp_path, capsys):
    (tmp_path / "run.yaml").write_text(json.dumps({"trainer": {"master_dtype": "bfloat16"},
                                                   "cluster": {"ray_address": "auto"}, "model": {"path": "/x"}}))
    assert main(["check-config", str(tmp_path / "run.yaml")]) == 0
    assert "# warning: trainer.master_dtype is bfloat16" in capsys.readouterr().out
    (tmp_path / "bad.yaml").write_text(json.dumps({"trainer": {"master_dtype": "bfloat16", "param_dtype": "float32"}}))
    assert main(["check-config", str(tmp_path / "bad.yaml")]) == 2
    assert "compute cannot be wider than the master weights" in capsys.readouterr().err


def _k2_params_by_hand(c: dict) -> int:
    """Kimi K2's parameter count from its config, written out layer by layer."""
    d, h, v = c["hidden_size"], c["num_attention_heads"], c["vocab_size"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    attn = (d * c["q_lora_rank"] + c["q_lora_rank"] + c["q_lora_rank"] * h * qk
            + d * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) + c["kv_lora_rank"]
            + c["kv_lora_rank"] * h * (c["qk_nope_head_dim"] + c["v_head_dim"]) + h * c["v_head_dim"] * d)
    dense = 3 * d * c["intermediate_size"]
    experts = c["n_routed_experts"] + c["n_shared_experts"]
    moe = c["n_routed_experts"] * d + experts * 3 * d * c["moe_intermediate_size"]
    layers = c["num_hidden_layers"]
    first = c["first_k_dense_replace"]
    return 2 * v * d + d + layers * (attn + 2 * d) + first * dense + (layers - first) * moe


def test_memory_plan_of_a_7b_dense_model_and_of_kimi_k2(capsys):
    from rl.setup.colocation import PRESETS, Colocation, colocation_plan, preset

    gib80 = 80 * 2**30
    llama = colocation_plan(preset("llama-7b"), Colocation(gpus=8, gpu_bytes=gib80), name="llama-7b")
    with torch.device("meta"):
        n = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**PRESETS["llama-7b"][1])) \
            .num_parameters()
    assert llama.params == n == 6_738_415_616
    assert llama.parts["master weights (shard)"] == n * 4 // 8 == llama.parts["gradients (shard)"]
    assert llama.parts["inference replica (share)"] == n * 2  # a full bf16 replica on every GPU
    assert llama.fits and llama.kv_tokens > 100_000
    assert llama.phases["rollout"] <= 0.9 * gib80

    # expert parallel as the trainer does it: each GPU computes 24 of each layer's 384 experts (EP 16) and stores 2
    # of them whole (the 16 GPUs computing the same 24 split them), bf16 master weights
    k2 = colocation_plan(preset("kimi-k2"), Colocation(gpus=256, gpu_bytes=gib80, inference_gpus=32,
                                                       expert_parallel=16, master_dtype="bfloat16",
                                                       micro_batch_tokens=4096), name="kimi-k2")
    assert k2.params == _k2_params_by_hand(PRESETS["kimi-k2"][1]) and 1.0e12 < k2.params < 1.05e12
    assert k2.fits
    # as the trainer is today (FSDP2 gathers a whole layer of 384 experts) and with a replica per GPU, it does not
    today = colocation_plan(preset("kimi-k2"), Colocation(gpus=256, gpu_bytes=gib80, micro_batch_tokens=4096),
                            name="kimi-k2")
    assert not today.fits and today.parts["inference replica (share)"] == k2.params * 2
    assert main(["memory-plan", "llama-7b", "--gpus", "8"]) == 0
    assert "fits" in capsys.readouterr().out
    assert main(["memory-plan", "no-such-model"]) == 2
    assert "neither a preset" in capsys.readouterr().err


def test_gpu_runs_count_the_pinned_host_memory_and_refuse_more_than_the_ram(monkeypatch):
    """On a GPU the offloaded trainer, the replica asleep at level 1 and the rollback journal (the replica's
    size) wait in page-locked host memory; eight 8 B workers on one machine pin more than its RAM."""
    arch = make_config("llama", **LLAMA8B)
    over = {"model": {"dtype": "bfloat16"}, "rollout": {"max_seq_len": 4096, "kv_cache_mb": 3000, "sleep_level": 1}}
    gpu = estimate(parse_config({**over, "cluster": {"workers": 8, "gpus_per_worker": 1}}), arch, 4096)
    trainer = gpu.trainer_weights + gpu.trainer_grads + gpu.optimizer
    assert gpu.host_pinned == trainer + 2 * gpu.replica and "pinned host memory" in gpu.table()
    no_offload = estimate(parse_config({**over, "cluster": {"workers": 8, "gpus_per_worker": 1},
                                        "trainer": {"offload": False}, "rollout": {**over["rollout"],
                                                                                   "sleep_level": 2}}), arch, 4096)
    assert no_offload.host_pinned == gpu.replica  # the journal alone
    assert estimate(parse_config({**over, "cluster": {"workers": 8}}), arch, 4096).host_pinned == 0  # CPU
    monkeypatch.setattr("rl.setup.memory.torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("rl.setup.memory.available_per_worker", lambda cfg: None)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert gpu.host_pinned * 8 > ram  # eight workers pin more than this machine has
    with pytest.raises(UserError, match=r"pins about .* of host memory .* trainer.offload: false") as err:
        check_fits(parse_config({**over, "cluster": {"workers": 8, "gpus_per_worker": 1}}), gpu)
    assert "\n" not in str(err.value)


def test_the_torch_decode_path_counts_its_gathered_keys_and_scores():
    """The torch attention path gathers every decoding sequence's keys and values at the step's width (a power of
    two on a GPU, where a captured graph keeps them in its pool) and scores them in float32; flex reads the
    pool in place. By hand for Llama-8B: 256 rows, 3000 tokens -> width 4096 on a GPU."""
    arch = make_config("llama", **LLAMA8B)
    base = {"model": {"dtype": "bfloat16"}, "cluster": {"workers": 8, "gpus_per_worker": 1},
            "algorithm": {"micro_batch_tokens": 512}}  # a small training phase: the rollout phase is the peak
    roll = {"max_seq_len": 3000, "kv_cache_mb": 20000, "max_batch": 256}
    torch_path = estimate(parse_config({**base, "rollout": roll}), arch, 3000)
    flex = estimate(parse_config({**base, "rollout": {**roll, "attention": "flex"}}), arch, 3000)
    by_hand = 256 * 4096 * 8 * (128 + 128) * 2 + 2 * 256 * 32 * 4096 * 4  # rows·width·kv heads·(k+v)·bf16 + scores
    assert torch_path.decode_work == by_hand and flex.decode_work == 0
    assert torch_path.device_peak - flex.device_peak == by_hand
    cpu = estimate(parse_config({**base, "cluster": {"workers": 8}, "rollout": roll}), arch, 3000)
    assert cpu.decode_work == 256 * 3000 * 8 * 256 * 2 + 2 * 256 * 32 * 3000 * 4  # exact width on a CPU
    # the CPU decode kernel reads the pool in place (auto counts the gather it falls back to)
    kernel = estimate(parse_config({**base, "cluster": {"workers": 8}, "rollout": {**roll, "attention": "paged"}}),
                      arch, 3000)
    assert kernel.decode_work == 0
    # a 512 MiB pool holds 4096 tokens (128 KiB each): no row is wider, and at most 256 rows hold a block each
    small = estimate(parse_config({**base, "rollout": {**roll, "kv_cache_mb": 512, "max_seq_len": 131072}}), arch,
                     131072)
    assert small.decode_work == 256 * 4096 * 8 * 256 * 2 + 2 * 256 * 32 * 4096 * 4


def test_a_tensor_parallel_vllm_replica_counts_its_shard_per_device():
    """rollout.tensor_parallel_size 2: each of the worker's GPUs holds half the replica and a KV cache of its own,
    and a trainer rank; vLLM's attention reads its cache in place (no gathered copy as the native torch path
    counts)."""
    arch = make_config("llama", **LLAMA8B)
    base = {"model": {"dtype": "bfloat16"}, "rollout": {"max_seq_len": 4096, "kv_cache_mb": 3000}}
    one = estimate(parse_config({**base, "cluster": {"gpus_per_worker": 1}}), arch, 4096)
    tp = estimate(parse_config({**base, "cluster": {"gpus_per_worker": 2},
                                "rollout": {**base["rollout"], "engine": "vllm", "tensor_parallel_size": 2}}),
                  arch, 4096)
    assert one.replica == one.params * 2 and tp.replica == one.params  # bf16, split over two ranks
    # and the worker's trainer is two ranks, one on each GPU: each holds half the master weights
    assert one.trainer_weights == one.params * 4 and tp.trainer_weights == one.params * 2
    assert tp.kv_cache == one.kv_cache and tp.decode_work == 0 < one.decode_work
    with pytest.raises(UserError, match="tensor_parallel_size=2 needs rollout.engine: vllm"):
        parse_config({"rollout": {"engine": "native", "tensor_parallel_size": 2}})
    with pytest.raises(UserError, match="expert_parallel .* needs rollout.tensor_parallel_size of 2"):
        parse_config({"rollout": {"engine": "vllm", "expert_parallel": True}})
    with pytest.raises(UserError, match="set cluster.gpus_per_worker=2"):
        parse_config({"rollout": {"engine": "vllm", "tensor_parallel_size": 2}, "cluster": {"gpus_per_worker": 1}})


def test_vllm_memory_fraction_must_be_free_beside_a_resident_trainer(monkeypatch):
    """vLLM starts only when rollout.vllm_memory_fraction of its GPU is free; a replica replaced mid-run shares the
    GPU with the trainer, which holds its shard there unless trainer.offload. By hand for Llama-8B on 8 workers of
    one 80 GiB GPU: the trainer shard is weights + gradients + optimizer state."""
    arch = make_config("llama", **LLAMA8B)
    monkeypatch.setattr("rl.setup.memory.available_per_worker", lambda cfg: (80 * 2**30, "GPU memory"))
    base = {"model": {"dtype": "bfloat16"}, "cluster": {"workers": 8, "gpus_per_worker": 1},
            "algorithm": {"micro_batch_tokens": 2048},  # a training phase that fits: the start check is at stake
            "rollout": {"engine": "vllm", "max_seq_len": 4096, "kv_cache_mb": 3000, "vllm_memory_fraction": 0.9}}
    resident = parse_config({**base, "trainer": {"offload": False}})
    est = estimate(resident, arch, 4096)
    trainer = est.trainer_weights + est.trainer_grads + est.optimizer
    assert 0.9 * 80 * 2**30 > 80 * 2**30 - trainer  # the case at hand: 72 GiB cannot be free
    with pytest.raises(UserError, match=r"rollout.vllm_memory_fraction: 0.9 .* set it to at most 0\.\d\d") as err:
        check_fits(resident, est)
    assert "\n" not in str(err.value)
    bound = float(str(err.value).rsplit("at most ", 1)[1].split()[0])
    assert bound == pytest.approx(1 - trainer / (80 * 2**30), abs=0.005)
    check_fits(parse_config({**base, "trainer": {"offload": False},
                             "rollout": {**base["rollout"], "vllm_memory_fraction": bound - 0.01}}), est)
    offloaded = parse_config(base)  # the trainer waits in host memory while a replica starts
    check_fits(offloaded, estimate(offloaded, arch, 4096))


def test_a_kl_penalty_counts_the_reference_policys_copy():
    """algorithm.kl_coef > 0: each trainer rank also holds the reference policy's shard of the master weights."""
    arch = make_config("llama", **LLAMA8B)
    base = {"model": {"dtype": "bfloat16"}, "cluster": {"workers": 8, "gpus_per_worker": 1},
            "algorithm": {"objective": "grpo", "micro_batch_tokens": 2048},
            "rollout": {"max_seq_len": 4096, "kv_cache_mb": 3000}}
    plain = estimate(parse_config(base), arch, 4096)
    kl = estimate(parse_config({**base, "algorithm": {**base["algorithm"], "kl_coef": 0.04}}), arch, 4096)
    assert kl.host_pinned - plain.host_pinned == plain.trainer_weights  # offloaded with the trainer
    assert kl.host_total - plain.host_total == plain.trainer_weights


def test_a_vllm_replica_counts_its_graph_pool_forward_update_staging_and_host_copies():
    """B7: vLLM's own rows, by hand for Llama-8B in bfloat16 on 8 GPU workers (max_batch 256, 512 MiB buckets): a
    token's working set is the residual stream (2 x 4096) and the MLP's gate, up and product (3 x 14336, larger
    than q/k/v/o's (2 x 32 + 2 x 8) x 128); the sampled rows' logits are 2 + 4 + 4 bytes each. The graph pool
    (256 tokens) stays while vLLM sleeps, so the training phase counts it; the update is a phase of its own."""
    arch = make_config("llama", **LLAMA8B)
    base = {"model": {"dtype": "bfloat16"}, "cluster": {"workers": 8, "gpus_per_worker": 1},
            "checkpoint_engine": {"bucket_mb": 512},
            "rollout": {"engine": "vllm", "max_seq_len": 4096, "kv_cache_mb": 3000, "max_batch": 256}}
    gpu = estimate(parse_config(base), arch, 4096)
    per_token, logits = 2 * 4096 + 3 * 14336, 256 * 128256 * (2 + 8)
    v = gpu.vllm
    assert v.graphs == 256 * per_token * 2 + logits
    assert v.forward == 8192 * per_token * 2 + logits  # a prefill of max_num_batched_tokens (8192)
    assert v.host_copies == 0 and v.staging == 8 * 512 * 2**20  # a bucket per trainer rank, on the GPU
    assert "vLLM CUDA graph pool" in gpu.table() and "vLLM CUDA graph pool" not in estimate(
        parse_config({**base, "rollout": {**base["rollout"], "engine": "native", "attention": "flex"}}),
        arch, 4096).table()
    trainer = gpu.trainer_weights + gpu.trainer_grads + gpu.optimizer
    train = trainer + gpu.activations + v.graphs  # sleep level 2 (the GPU default): replica and KV cache freed
    update = gpu.replica + v.staging + 3 * 512 * 2**20 + v.graphs  # trainer offloaded, KV cache woken after
    rollout = gpu.replica + gpu.kv_cache + v.graphs + v.forward
    assert gpu.device_peak == max(train, update, rollout)
    assert gpu.host_pinned == trainer  # no rollback journal, no level-1 copy
    # vLLM's CPU build takes updates through host copies: the served one and the update's, both whole
    cpu = estimate(parse_config({**base, "cluster": {"workers": 8}}), arch, 4096)
    assert cpu.vllm.host_copies == 2 * cpu.params * 2 and cpu.vllm.graphs == cpu.vllm.staging == 0
    assert cpu.host_total == (cpu.trainer_weights + cpu.trainer_grads + cpu.optimizer + cpu.activations + cpu.replica
                              + cpu.kv_cache + cpu.vllm.host_copies + cpu.vllm.forward)


def test_disaggregated_runs_count_each_role_and_refuse_more_than_the_ram():
    """Disaggregated, the trainer and the replica are processes of their own: the trainer worker holds its shard,
    activations and two point-to-point slots; the rollout worker its replica twice (the spare copy an update loads
    into while it serves), its KV cache and two receive buffers. A Llama-8B run with four replicas beside the
    trainer needs more than this machine's RAM, and is refused in one line naming both roles."""
    arch = make_config("llama", **LLAMA8B)
    raw = {"model": {"dtype": "bfloat16"}, "rollout": {"max_seq_len": 4096, "kv_cache_mb": 3000},
           "cluster": {"placement": "disaggregated", "rollout_workers": 4}}
    est = estimate(parse_config(raw), arch, 4096)
    slots = 2 * parse_config(raw).checkpoint_engine.bucket_bytes
    assert est.roles == {"trainer worker": est.trainer_weights + est.trainer_grads + est.optimizer +
                         est.activations + slots,
                         "rollout worker": 2 * est.replica + est.kv_cache + est.decode_work + slots}
    assert "disaggregated: per rollout worker" in est.table()
    assert estimate(parse_config({k: v for k, v in raw.items() if k != "cluster"}), arch, 4096).roles is None
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert est.roles["trainer worker"] + 4 * est.roles["rollout worker"] > ram
    with pytest.raises(UserError, match=r"cluster.placement: disaggregated needs about .* \(1 trainer workers x "
                                        r".* \+ 4 rollout workers x .*\) but this machine has") as err:
        check_fits(parse_config(raw), est)
    assert "\n" not in str(err.value)
