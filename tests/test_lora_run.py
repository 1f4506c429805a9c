"""``model.lora`` through the RL loop on a real local Ray cluster (native backend and engine; Gemma 3 on the
transformers backend and vLLM): the trainer trains the adapters on a frozen base, each update carries the adapters
only and the replica merges them onto the base it keeps, a checkpoint and ``final/`` are the merged policy with the
adapters beside it in PEFT's format, and a resume continues exactly. The run sleeps at level 2 (``LEVEL_2``): the
replica discards its weights while the trainer runs, and each update of adapters alone refills them from the base the
replica keeps on the host (the bfloat16 run sleeps at level 1, auto's choice on CPU workers)."""

from __future__ import annotations

import json

import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file

from engines.model.lora.adapters import ADAPTER_CONFIG, ADAPTER_DIR, ADAPTER_WEIGHTS
from rl.config import load_config
from rl.loop.checkpoint import latest_checkpoint
from rl.loop.controller import train
from rl.setup.warmstart import prepare_model
from tests.test_run import tiny

RANK, ALPHA = 4, 8.0
LEVEL_2 = {"sleep_level": 2}
LORA = {"model": {"lora": {"rank": RANK, "alpha": ALPHA}}, "optimizer": {"lr": 2e-2},
        "algorithm": {"drop_equal_reward_groups": False}}
#: the module's run and its resume: the native replica adds the adapters as low-rank deltas (model.lora.unmerged)
UNMERGED = {**LORA, "model": {"lora": {**LORA["model"]["lora"], "unmerged": True}}}


def _records(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def lora_run(ray_cluster, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    cfg = tiny(run={"iterations": 3, "eval_every": 3, "save_every": 1}, rollout=LEVEL_2, **UNMERGED)
    train(cfg, run_dir)
    return cfg, run_dir


def test_the_replica_serves_base_plus_adapters_exactly_after_every_update(lora_run):
    """The trainer scores the replica's samples with its own (adapted) model before each step: after the updates of
    iterations 0 and 1 the replica must serve W0·x + s·B·A·x (its unmerged deltas; after each level-2 sleep over the
    base it keeps on the host), or the two disagree (float32 on both sides: exact)."""
    _, run_dir = lora_run
    steps = [r for r in _records(run_dir) if "logprob_diff_max" in r]
    assert len(steps) == 3
    assert max(r["logprob_diff_max"] for r in steps) <= 1e-5, [r["logprob_diff_max"] for r in steps]


def test_only_low_rank_updates_reach_the_adapted_weights(lora_run):
    """final/ is the merged policy: each adapted projection moved by a matrix of rank at most ``RANK`` from the
    starting model, every other tensor (embeddings, norms, the output head) is the starting model's bit for bit."""
    cfg, run_dir = lora_run
    start = load_file(str(prepare_model(cfg) / "model.safetensors"))
    final = load_file(str(run_dir / "final" / "model.safetensors"))
    assert set(final) == set(start)
    moved = 0
    for name, w in final.items():
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
                          "up_proj.weight", "down_proj.weight")):
            delta = (w - start[name]).double()
            assert torch.linalg.matrix_rank(delta, rtol=1e-6).item() <= RANK, name
            moved += bool(delta.abs().max() > 0)
        else:
            assert torch.equal(w, start[name]), name
    assert moved > 0  # it trained


def test_saved_adapters_load_with_peft_on_the_base_and_give_the_merged_model(lora_run):
    """final/adapter/ is PEFT's format: peft puts it on the starting model, and that model computes what the merged
    final/ computes (the trainer's own merge), up to float32 rounding."""
    cfg, run_dir = lora_run
    adapter = run_dir / "final" / ADAPTER_DIR
    assert (adapter / ADAPTER_CONFIG).is_file() and (adapter / ADAPTER_WEIGHTS).is_file()
    config = json.loads((adapter / ADAPTER_CONFIG).read_text())
    assert config["r"] == RANK and config["lora_alpha"] == ALPHA
    base = transformers.AutoModelForCausalLM.from_pretrained(prepare_model(cfg), torch_dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(base, adapter).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "final", torch_dtype=torch.float32).eval()
    ids = torch.randint(3, merged.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = with_adapter(input_ids=ids).logits, merged(input_ids=ids).logits
    assert (a - b).abs().max().item() <= 1e-4
    # a checkpoint is the same: the merged policy with its adapters beside it
    ckpt, _ = latest_checkpoint(run_dir)
    assert (ckpt / ADAPTER_DIR / ADAPTER_WEIGHTS).is_file()


def test_a_lora_run_resumes_exactly(lora_run, tmp_path):
    """Stop after 2 iterations, resume to 3: the resumed run reads the base it started from (a checkpoint holds the
    merged policy), its trainer state brings the adapters and their optimizer back, the replicas merge them, and the
    run ends bit for bit as the straight one."""
    _, full = lora_run
    split = tmp_path / "split"
    train(tiny(run={"iterations": 2, "eval_every": 3, "save_every": 1}, rollout=LEVEL_2, **UNMERGED), split)
    (split / "config.yaml").write_text((split / "config.yaml").read_text().replace("iterations: 2", "iterations: 3"))
    train(load_config(split / "config.yaml"), split, resume=True)
    a = load_file(str(full / "final" / "model.safetensors"))
    b = load_file(str(split / "final" / "model.safetensors"))
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert [r["reward_mean"] for r in _records(split)] == [r["reward_mean"] for r in _records(full)]
    assert _records(split)[-1]["logprob_diff_max"] <= 1e-5  # the resumed replica merged the adapters


@pytest.mark.slow
def test_a_bfloat16_checkpoint_trains_adapters_in_float32_over_a_bfloat16_model(ray_cluster, tmp_path):
    """The GPU shape of a LoRA run on one rank: a bfloat16 checkpoint computed in bfloat16 (model.dtype) with float32
    master adapters and AdamW state. The frozen model stays bfloat16 in the trainer (no FSDP, nothing rounded: it is
    the checkpoint's own dtype), the replica serves the same bfloat16 base plus the adapters, and final/ is the
    bfloat16 checkpoint with nothing but the adapted projections changed, its adapters float32."""
    start_dir = tmp_path / "bf16"
    fp32 = tiny(**LORA)
    src = prepare_model(fp32)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, torch_dtype=torch.bfloat16)
    model.save_pretrained(start_dir)
    for f in src.iterdir():  # the tokenizer and anything else beside the weights
        if f.is_file() and not (start_dir / f.name).exists():
            (start_dir / f.name).write_bytes(f.read_bytes())
    run_dir = tmp_path / "run"
    lora = {"path": str(start_dir), "dtype": "bfloat16", "lora": {"rank": RANK, "alpha": ALPHA}}
    cfg = tiny(run={"iterations": 2, "eval_every": 3, "save_every": 2}, **{**LORA, "model": lora})
    assert cfg.compute_dtype == "bfloat16" and cfg.trainer.master_dtype == "float32"
    train(cfg, run_dir)
    steps = [r for r in _records(run_dir) if "logprob_diff_max" in r]
    assert len(steps) == 2 and all(r["logprob_diff_max"] < 0.1 for r in steps)  # bfloat16 on both sides
    start = load_file(str(start_dir / "model.safetensors"))
    final = load_file(str(run_dir / "final" / "model.safetensors"))
    assert {t.dtype for t in final.values()} == {torch.bfloat16}
    for name, w in final.items():
        if not name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
                              "up_proj.weight", "down_proj.weight")):
            assert torch.equal(w, start[name]), name  # embeddings, norms, the head: the checkpoint's bits
    # (this 15-step warm start samples no reward in bfloat16 here, so the adapters may not move: that a bfloat16
    # model with float32 adapters trains is tests/test_lora.py's)
    adapters = load_file(str(run_dir / "final" / ADAPTER_DIR / ADAPTER_WEIGHTS))
    assert {t.dtype for t in adapters.values()} == {torch.float32}


@pytest.mark.slow
def test_two_sharded_trainer_ranks_train_the_adapters_and_resume_exactly(ray_cluster, tmp_path):
    """Two workers: FSDP2 shards the frozen base and the adapters over two trainer ranks and reduces the adapters'
    gradients alone. Each worker's replica serves exactly what the trainer holds after every update (it scores the
    replica's samples before each step), final/ moved the adapted projections by low-rank matrices only, its
    adapter/ holds whole tensors that peft loads, and a run stopped after 2 iterations and resumed ends bit for bit
    as the straight one."""
    cfg = tiny(run={"iterations": 3, "eval_every": 3, "save_every": 1}, cluster={"workers": 2}, **LORA)
    straight, split = tmp_path / "straight", tmp_path / "split"
    train(cfg, straight)
    steps = [r for r in _records(straight) if "logprob_diff_max" in r]
    assert len(steps) == 3 and max(r["logprob_diff_max"] for r in steps) <= 1e-5, steps
    start = load_file(str(prepare_model(cfg) / "model.safetensors"))
    final = load_file(str(straight / "final" / "model.safetensors"))
    adapters = load_file(str(straight / "final" / ADAPTER_DIR / ADAPTER_WEIGHTS))
    moved = 0
    for name, w in final.items():
        owner = name.removesuffix(".weight")
        a = adapters.get(f"base_model.model.{owner}.lora_A.weight")
        if a is None:
            assert torch.equal(w, start[name]), name
            continue
        b = adapters[f"base_model.model.{owner}.lora_B.weight"]
        assert a.shape == (RANK, w.shape[1]) and b.shape == (w.shape[0], RANK), name  # gathered, not one shard
        delta = (w - start[name]).double()
        assert torch.linalg.matrix_rank(delta, rtol=1e-6).item() <= RANK, name
        moved += bool(delta.abs().max() > 0)
    assert moved > 0  # it trained
    hf = transformers.AutoModelForCausalLM.from_pretrained(prepare_model(cfg), dtype=torch.float32)
    peft.PeftModel.from_pretrained(hf, straight / "final" / ADAPTER_DIR)  # raises on a shard's shapes
    train(tiny(run={"iterations": 2, "eval_every": 3, "save_every": 1}, cluster={"workers": 2}, **LORA), split)
    (split / "config.yaml").write_text((split / "config.yaml").read_text().replace("iterations: 2", "iterations: 3"))
    train(load_config(split / "config.yaml"), split, resume=True)
    b = load_file(str(split / "final" / "model.safetensors"))
    for k in final:
        assert torch.equal(final[k], b[k]), k


@pytest.mark.slow
def test_a_family_the_native_code_lacks_trains_adapters_and_vllm_serves_them(ray_cluster, tokenizer, tmp_path):
    """Gemma 3 on the transformers backend (transformers' own modeling code adapted in the trainer), rolled out by
    vLLM (its CPU build) at sleep level 2: each update carries the adapters only, the replica merges them onto its
    host copy of the base and loads the merged weights (every weight after the level-2 discard) through vLLM's
    loaders; the trainer scores vLLM's samples before each step, so their agreement to float32 rounding (different
    kernels) is the merge reaching vLLM (skipping the merge leaves 0.89 on the native family). The adapters moved,
    and peft puts final/adapter/ on the starting model to give what the merged final/ gives."""
    from engines.inference.vllm_engine import vllm_available
    from tests.vllm_check import save_tiny_model

    if not vllm_available():
        pytest.skip("vLLM is not installed here (make setup installs it)")
    base = save_tiny_model("gemma3_text", tmp_path / "gemma3", tokenizer)
    cfg = tiny(run={"iterations": 3, "eval_every": 3, "save_every": 3},
               model={"path": str(base), "backend": "transformers", **LORA["model"]},
               rollout={"engine": "vllm", "kv_cache_mb": 64, "max_seq_len": 128, "truncation_penalty": -0.5,
                        **LEVEL_2},
               **{k: v for k, v in LORA.items() if k != "model"})
    train(cfg, tmp_path / "run")
    records = _records(tmp_path / "run")
    assert "backend: transformers" in (tmp_path / "run" / "config.yaml").read_text()
    steps = [r for r in records if "logprob_diff_max" in r]
    assert len(steps) == 3 and max(r["logprob_diff_max"] for r in steps) <= 1e-4, steps
    final = tmp_path / "run" / "final"
    adapters = load_file(str(final / ADAPTER_DIR / ADAPTER_WEIGHTS))
    assert max(v.abs().max().item() for k, v in adapters.items() if ".lora_B." in k) > 1e-3  # it trained
    with_adapter = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), final / ADAPTER_DIR).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    ids = torch.randint(3, merged.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (with_adapter(input_ids=ids).logits - merged(input_ids=ids).logits).abs().max().item() <= 1e-4


@pytest.mark.slow
def test_qlora_trains_over_a_quantized_base_saves_the_exact_one_and_resumes_exactly(ray_cluster, tmp_path):
    """model.lora.quantize_base nf4 (bitsandbytes): the trainer computes with NF4 projections, so its log-probs
    differ from the replica's (which serves the exact base plus the adapters) by the quantization error, reported
    as logprob_diff, but the adapters still train; final/ is the checkpoint's exact base plus rank-r moves (what the
    replicas served); a resumed run reads the packed base back from its trainer state and ends bit for bit as the
    straight one."""
    qlora = {**LORA, "model": {"lora": {**LORA["model"]["lora"], "quantize_base": "nf4"}}}
    run = {"iterations": 2, "eval_every": 3, "save_every": 1}
    rollout = {**LEVEL_2, "truncation_penalty": -0.5}  # truncated responses differ in reward: advantages move B
    cfg = tiny(run=run, rollout=rollout, **qlora)
    train(cfg, tmp_path / "full")
    steps = [r for r in _records(tmp_path / "full") if "logprob_diff_max" in r]
    # NF4's error shows (1e-2 here, float32 merges give 1e-6) and stays an error, not a different policy
    assert all(1e-4 < r["logprob_diff_max"] < 0.5 for r in steps), [r["logprob_diff_max"] for r in steps]
    start = load_file(str(prepare_model(cfg) / "model.safetensors"))
    final = load_file(str(tmp_path / "full" / "final" / "model.safetensors"))
    moved = 0
    for name, w in final.items():
        if name.endswith("_proj.weight"):
            delta = (w - start[name]).double()
            assert torch.linalg.matrix_rank(delta, rtol=1e-6).item() <= RANK, name
            moved += bool(delta.abs().max() > 0)
        else:
            assert torch.equal(w, start[name]), name
    assert moved > 0
    split = tmp_path / "split"
    train(tiny(run={**run, "iterations": 1}, rollout=rollout, **qlora), split)
    (split / "config.yaml").write_text((split / "config.yaml").read_text().replace("iterations: 1", "iterations: 2"))
    train(load_config(split / "config.yaml"), split, resume=True)
    resumed = load_file(str(split / "final" / "model.safetensors"))
    for k in final:
        assert torch.equal(final[k], resumed[k]), k
