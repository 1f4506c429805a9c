"""``model.lora`` as a run resolves it: the targets checked against the model, what cannot run refused in one line
each, and the memory plan (``rl check-config``, ``rl memory-plan --lora``) counting gradients and optimizer state of
the adapters only. Models are config.json files written by transformers' config classes (meta-device shapes only).
"""

from __future__ import annotations

import json

import pytest

from engines.model.io.hf_io import read_config
from engines.model.lora.adapters import LoraSpec
from rl.cli import main
from rl.config import parse_config
from rl.errors import UserError
from rl.settings import for_model
from rl.setup.memory import ModelShape, estimate_run, trainer_bytes
from tests.hf_families import hf_config

LAYERS, HIDDEN, INTER, HEADS, KV = 2, 64, 96, 4, 2


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tokenizer):
    """A llama, a mixtral, a deepseek_v3, a gemma3_text and a dense nemotron_h model directory (config and tokenizer
    only)."""
    out = {}
    common = dict(vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id,
                  bos_token_id=None)
    for name in ("llama", "mixtral", "deepseek_v3", "gemma3_text", "nemotron_h-dense"):
        d = tmp_path_factory.mktemp(name)
        kw = dict(common)
        if name in ("llama", "mixtral"):
            kw.update(hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HIDDEN // HEADS)
        hf_config(name, **kw).save_pretrained(d)
        tokenizer.save(d)
        out[name] = d
    return out


def _cfg(model_dir, **lora):
    raw = {"model": {"path": str(model_dir), "lora": lora}, "env": {"num_train": 20, "num_eval": 8}}
    return raw


def _resolve(model_dir, overrides=(), **lora):
    return for_model(parse_config(_cfg(model_dir, **lora), overrides=list(overrides)), str(model_dir))


def _description(model_dir):
    """transformers' description of the model in ``model_dir`` (the transformers backend's ``arch``)."""
    from engines.model.hf.backend import read_hf_config
    from engines.model.hf.spec import describe, meta_model

    hf = read_hf_config(model_dir)
    return describe(hf, meta_model(hf))


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


def test_defaults_adapt_every_projection_and_turn_qk_clip_to_reporting(dirs):
    s = _resolve(dirs["llama"], rank=4)
    spec = s.trainer.lora
    assert (spec.rank, spec.alpha, spec.dropout, spec.init) == (4, 16.0, 0.0, "kaiming")
    assert spec.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert s.trainer.optimizer.kind == "adamw" and s.trainer.optimizer.qk_clip_tau is None
    assert any(k == "optimizer.qk_clip_tau" and "frozen base" in why for k, _, why in s.choices)
    # without LoRA nothing changes: Muon and QK-Clip at its threshold
    plain = for_model(parse_config({"model": {"path": str(dirs["llama"])}, "env": {"num_train": 20, "num_eval": 8}}),
                      str(dirs["llama"]))
    assert plain.trainer.lora is None and plain.trainer.optimizer.kind == "muon"
    assert plain.trainer.optimizer.qk_clip_tau == 100.0


def test_the_transformers_backend_adapts_a_family_the_native_code_lacks(dirs, tmp_path, capsys):
    """Gemma 3 runs on transformers' own modeling code: its projections are adapted by the same names, and the
    memory plan counts its adapters' gradients and optimizer state only."""
    s = _resolve(dirs["gemma3_text"], rank=4)
    assert (s.trainer.backend, s.trainer.rollout_engine) == ("transformers", "vllm")
    assert s.trainer.lora.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj")
    arch = _description(dirs["gemma3_text"])
    shape = ModelShape.of(arch, s.trainer.lora)
    h, q, kv, i = arch.hidden_size, arch.num_attention_heads * arch.head_dim, \
        arch.num_key_value_heads * arch.head_dim, arch.intermediate_size
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + i) + (i + h)  # r·(in + out) per projection, over r
    assert shape.adapter_params == arch.num_hidden_layers * 4 * per_layer
    assert shape.params == ModelShape.of(arch).params  # the frozen base: every weight of the model
    (tmp_path / "run.yaml").write_text(json.dumps(_cfg(dirs["gemma3_text"], rank=4)))
    assert main(["check-config", str(tmp_path / "run.yaml")]) == 0
    out = capsys.readouterr().out
    assert "#  LoRA adapters (trained)" in out and f"{shape.adapter_params / 1e6:,.3f} M" in out


def test_an_moe_model_adapts_attention_by_default_and_refuses_experts_by_name(dirs):
    s = _resolve(dirs["mixtral"], rank=2)
    assert s.trainer.lora.target_modules == ("q_proj", "k_proj", "v_proj", "o_proj")
    with pytest.raises(UserError) as e:
        _resolve(dirs["mixtral"], rank=2, target_modules=["q_proj", "gate_proj"])
    assert _one_line(e).startswith("model.lora: LoRA target module(s) 'gate_proj' match no linear layer of this "
                                   "mixtral model (the MoE layers' experts are stacked tensors, not adapted)")


@pytest.mark.parametrize("model, lora, overrides, says", [
    ("llama", dict(target_modules=["q_proj", "attn"]), (),
     "model.lora: LoRA target module(s) 'attn' match no linear layer of this llama model; its decoder layers have: "
     "down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"),
    ("llama", {}, ("rollout.fp8=true",), "model.lora with rollout.fp8 is not supported"),
    ("llama", {}, ("rollout.engine=vllm", "rollout.tensor_parallel_size=2"),
     "model.lora with vLLM: the merged weights reach a replica of one rank only"),
    ("deepseek_v3", {}, (), "model.lora: LoRA on deepseek_v3 is not supported: its latent attention (MLA)"),
    ("nemotron_h-dense", {}, (), "model.lora: LoRA on nemotron_h: its checkpoint stores model.layers.1.mixer.q_proj."
     "weight under another name or layout"),
    ("llama", dict(unmerged=True), ("rollout.engine=vllm",), "model.lora.unmerged needs the native rollout "
     "engine: vLLM's replicas merge the adapters into their weights"),
    ("llama", dict(quantize_base="nf4"), ("cluster.workers=2",), "model.lora.quantize_base runs on one trainer "
     "rank: FSDP2 does not shard bitsandbytes' packed weights"),
    ("llama", {}, ("trainer.param_dtype=bfloat16",), "model.lora keeps the frozen model in the compute dtype "
     "(bfloat16), which must then be the checkpoint's and the replicas' (float32)"),
])
def test_settings_that_cannot_run_are_one_line(dirs, model, lora, overrides, says):
    with pytest.raises(UserError) as e:
        _resolve(dirs[model], overrides, **lora)
    assert says in _one_line(e)


@pytest.mark.parametrize("field, value, says", [
    ("rank", 0, "model.lora.rank: Input should be greater than or equal to 1 (got 0)"),
    ("rank", -4, "model.lora.rank: Input should be greater than or equal to 1 (got -4)"),
    ("alpha", 0, "model.lora.alpha: Input should be greater than 0 (got 0)"),
    ("dropout", 1.0, "model.lora.dropout: Input should be less than 1 (got 1.0)"),
    ("dropout", -0.1, "model.lora.dropout: Input should be greater than or equal to 0 (got -0.1)"),
    ("init", "zeros", "model.lora.init: Input should be 'kaiming' or 'gaussian' (got 'zeros')"),
])
def test_bad_values_name_the_key(dirs, field, value, says):
    with pytest.raises(UserError) as e:
        parse_config(_cfg(dirs["llama"], **{field: value}))
    lines = str(e.value).splitlines()
    assert lines[1:] == [f"  {says}"]


def _adapters(rank: int) -> int:
    """LoRA parameters of the test llama, counted from its shapes: r·(in + out) per adapted projection."""
    hd = HIDDEN // HEADS
    shapes = [(HIDDEN, HEADS * hd), (HIDDEN, KV * hd), (HIDDEN, KV * hd), (HEADS * hd, HIDDEN),
              (HIDDEN, INTER), (HIDDEN, INTER), (INTER, HIDDEN)]
    return LAYERS * sum(rank * (i + o) for i, o in shapes)


def test_check_config_counts_the_adapters_gradients_and_optimizer_state(dirs, tmp_path, capsys):
    (tmp_path / "run.yaml").write_text(json.dumps(_cfg(dirs["llama"], rank=8)))
    assert main(["check-config", str(tmp_path / "run.yaml")]) == 0
    out = capsys.readouterr().out
    n = _adapters(8)
    assert "#  LoRA adapters (trained)" in out and f"{n / 1e6:,.3f} M" in out
    assert "# model.lora.target_modules: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj" in out
    est, _ = estimate_run(parse_config(_cfg(dirs["llama"], rank=8)))
    full, _ = estimate_run(parse_config({"model": {"path": str(dirs["llama"])}, "env": {"num_train": 20,
                                                                                        "num_eval": 8}}))
    assert est.adapters == n and est.params == full.params  # the base is every parameter of the model
    assert est.trainer_grads == n * 4  # float32 master adapters only
    assert est.optimizer == n * 2 * 4  # AdamW's two moments of the adapters
    assert est.trainer_weights == full.params * 4 + n * 4  # the frozen base (float32 here) and the adapters
    # a bfloat16 serving dtype: the adapted projections' frozen weights are kept in it, the rest in float32
    shape = ModelShape.of(read_config(dirs["llama"]), LoraSpec(8, 16.0))
    hd = HIDDEN // HEADS
    adapted = LAYERS * (HIDDEN * HEADS * hd * 2 + HIDDEN * KV * hd * 2 + HIDDEN * INTER * 3)
    assert shape.adapted_params == adapted
    weights, grads, _ = trainer_bytes(shape, 1, "float32", "adamw", "bfloat16")
    assert weights == adapted * 2 + (full.params - adapted) * 4 + n * 4 and grads == n * 4


def test_a_bfloat16_model_trains_lora_on_one_unsharded_rank(dirs):
    """model.dtype bfloat16: compute in bfloat16 over float32 master adapters, no FSDP; the plan counts the frozen
    model in bfloat16 and the adapters, their gradients and AdamW's moments in float32."""
    cfg = parse_config({**_cfg(dirs["llama"], rank=8), "model": {"path": str(dirs["llama"]), "dtype": "bfloat16",
                                                                "lora": {"rank": 8}}})
    s = for_model(cfg, str(dirs["llama"]))
    assert (s.trainer.compute_dtype, s.trainer.master_dtype, s.trainer.replica_dtype) == \
        ("bfloat16", "float32", "bfloat16")
    est, _ = estimate_run(cfg)
    n = _adapters(8)
    assert est.trainer_weights == est.params * 2 + n * 4 and est.trainer_grads == n * 4


def test_memory_plan_with_lora_counts_adapters_only(capsys):
    assert main(["memory-plan", "llama-7b", "--gpus", "1", "--lora", "8"]) == 0
    out = capsys.readouterr().out
    # Llama 2 7B: 32 layers of q/k/v/o 4096x4096 and gate/up/down 4096x11008, r·(in + out) each
    n = 32 * 8 * (4 * 2 * 4096 + 3 * (4096 + 11008))
    grads = next(line for line in out.splitlines() if "gradients" in line).split()[-2]
    assert grads == f"{n * 4 / 2**30:.2f}"
    assert main(["memory-plan", "kimi-k2", "--lora", "8"]) == 2
    assert "latent attention (MLA)" in capsys.readouterr().err


def test_gpu_workers_with_lora_sleep_at_level_two_as_without_and_say_why(dirs):
    """auto picks sleep level 2 on GPU workers with LoRA too (the replica's host copy of the base and the adapters
    refill the discarded weights), and 1 on CPU workers, for the run and for the memory plan alike."""
    from rl.settings import sleep_level

    s = _resolve(dirs["llama"], ("cluster.gpus_per_worker=1", "rollout.engine=native"))
    assert s.rollout.sleep_level == 2
    assert ("rollout.sleep_level", "2") in [c[:2] for c in s.choices]
    cfg = parse_config(_cfg(dirs["llama"]), overrides=["cluster.gpus_per_worker=1"])
    assert sleep_level(cfg)[0] == 2
    assert sleep_level(parse_config(_cfg(dirs["llama"])))[0] == 1
    assert sleep_level(parse_config({"cluster": {"gpus_per_worker": 1}}))[0] == 2


def test_sharded_lora_keeps_the_frozen_base_in_the_master_dtype_for_the_run_and_the_plan(dirs, capsys):
    """Over two trainer ranks FSDP2 shards the frozen base with the adapters in the master dtype (float32), so the
    plans count the whole model at 4 bytes split over the ranks; on one rank a bfloat16 compute keeps it at 2."""
    cfg = parse_config({**_cfg(dirs["llama"], rank=8), "model": {"path": str(dirs["llama"]), "dtype": "bfloat16",
                                                                "lora": {"rank": 8}}, "cluster": {"workers": 2}})
    est, _ = estimate_run(cfg)
    n = _adapters(8)
    assert est.trainer_weights == -(-(est.params * 4 + n * 4) // 2) and est.trainer_grads == -(-n * 4 // 2)
    rows = {}
    for gpus in ("1", "8"):
        assert main(["memory-plan", "llama-7b", "--gpus", gpus, "--lora", "8"]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if "frozen base + adapters" in x)
        rows[gpus] = float(line.split()[-2])
    assert rows["8"] == pytest.approx(rows["1"] * 2 / 8, rel=0.02)  # float32 over 8 against bfloat16 on 1


def test_qlora_counts_the_adapted_weights_at_their_quantized_bytes(dirs, capsys):
    """model.lora.quantize_base: the plan keeps the adapted projections at NF4's half byte plus a float32 scale per
    64 weights (int8: a byte), the rest of the frozen model as before; ``rl memory-plan --qlora`` says the same."""
    plain, _ = estimate_run(parse_config(_cfg(dirs["llama"], rank=8)))
    shape = ModelShape.of(read_config(dirs["llama"]), LoraSpec(8, 16.0))
    for kind, per_weight in (("nf4", 0.5 + 4 / 64), ("int8", 1.0)):
        est, settings = estimate_run(parse_config(_cfg(dirs["llama"], rank=8, quantize_base=kind)))
        assert settings.trainer.lora.quantize_base == kind
        assert settings.update.correction is not None  # auto: TIS for the quantized base's mismatch
        # float32 base (this checkpoint's dtype): each adapted weight's 4 bytes become per_weight
        assert plain.trainer_weights - est.trainer_weights == int(shape.adapted_params * (4 - per_weight))
    assert main(["memory-plan", "qwen2.5-7b", "--gpus", "1", "--lora", "8"]) == 0
    lora = capsys.readouterr().out
    assert main(["memory-plan", "qwen2.5-7b", "--gpus", "1", "--lora", "8", "--qlora", "nf4"]) == 0
    qlora = capsys.readouterr().out
    row = lambda out: float(next(x for x in out.splitlines() if "frozen base + adapters" in x).split()[-2])  # noqa: E731
    assert row(qlora) < 0.45 * row(lora)
    assert main(["memory-plan", "qwen2.5-7b", "--gpus", "2", "--lora", "8", "--qlora", "nf4"]) != 0
    assert capsys.readouterr().err.strip() == "error: rl memory-plan: a quantized base (QLoRA) needs LoRA (--lora " \
        "RANK) on one GPU (--gpus 1)"
