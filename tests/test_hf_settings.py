"""Which backend and rollout engine a model gets (``model.backend: auto | native | transformers``), what
``rl check-config`` prints of the choice and why, and the one line a model neither backend runs gets.

Each model is a config.json (and the tests' tokenizer) written by transformers' own config classes: the choice and
the memory plan read only the config, building the modules on the meta device.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from engines.model.native.arch import FAMILIES
from rl.cli import main
from rl.config import parse_config
from rl.errors import UserError
from rl.settings import for_model, model_arch
from tests.hf_families import hf_config


def _model_dir(tmp_path, tokenizer, config, name="m"):
    d = tmp_path / name
    config.save_pretrained(d)
    tokenizer.save(d)
    return d


def _check_config(tmp_path, capsys, model_dir, **model):
    (tmp_path / "run.yaml").write_text(json.dumps({"model": {"path": str(model_dir), **model},
                                                   "env": {"num_train": 20, "num_eval": 8}}))
    code = main(["check-config", str(tmp_path / "run.yaml")])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _family(name, tokenizer):
    return hf_config(name, vocab_size=tokenizer.vocab_size, eos_token_id=tokenizer.eos_id,
                     pad_token_id=tokenizer.pad_id, bos_token_id=None)


def test_check_config_prints_the_transformers_backend_and_vllm_for_a_family_the_native_code_lacks(
        tmp_path, capsys, tokenizer):
    cfg = _family("gemma3_text", tokenizer)
    code, out, err = _check_config(tmp_path, capsys, _model_dir(tmp_path, tokenizer, cfg))
    assert code == 0, err
    assert (f"# model.backend: transformers (auto: gemma3_text is not one of the native families "
            f"({', '.join(FAMILIES)}))") in out
    assert ("# rollout.engine: vllm (auto: the transformers backend rolls out on vLLM (the native engine runs the "
            "native families only))") in out
    # the memory plan counts transformers' own model: every parameter once, as built on the meta device
    with torch.device("meta"):
        params = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(cfg).parameters())
    assert f"{params / 1e6:,.1f} M" in out and "# memory per worker" in out


def test_a_native_family_stays_native_under_auto_and_crosses_over_when_asked(tmp_path, capsys, tokenizer):
    d = _model_dir(tmp_path, tokenizer, _family("llama", tokenizer))
    code, out, err = _check_config(tmp_path, capsys, d)
    assert code == 0, err
    assert "# model.backend: native (auto: llama is a native family)" in out
    code, out, err = _check_config(tmp_path, capsys, d, backend="transformers", trust_remote_code=False)
    assert code == 0, err
    assert "# model.backend: transformers (set in model.backend)" in out and "# rollout.engine: vllm" in out
    # the native engine takes a native family's weights under the same names: allowed, and said so
    settings = for_model(parse_config({"model": {"path": str(d), "backend": "transformers"},
                                       "rollout": {"engine": "native"}}), str(d))
    assert (settings.trainer.backend, settings.rollout.engine.kind) == ("transformers", "native")


def test_a_hybrid_model_rolls_out_on_vllm_without_prefix_caching_on_cpu(tmp_path, tokenizer):
    d = _model_dir(tmp_path, tokenizer, _family("nemotron_h-dense", tokenizer))
    settings = for_model(parse_config({"model": {"path": str(d)}}), str(d))
    assert settings.rollout.engine.kind == "vllm" and settings.rollout.engine.prefix_caching is False
    assert any(key == "vLLM prefix caching" and value == "off" for key, value, _ in settings.choices)
    dense = _model_dir(tmp_path, tokenizer, _family("phi3", tokenizer), "dense")
    assert for_model(parse_config({"model": {"path": str(dense)}}), str(dense)).rollout.engine.prefix_caching


def _one_line(cfg, d, match: str) -> None:
    with pytest.raises(UserError, match=match) as err:
        for_model(cfg, str(d))
    assert "\n" not in str(err.value)


def test_models_a_backend_cannot_run_are_one_line(tmp_path, tokenizer):
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "my_new_arch", "hidden_size": 64}))
    _one_line(parse_config({"model": {"path": str(unknown)}}), unknown,
              "model_type 'my_new_arch' is run by neither backend: the native code runs llama")
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "config.json").write_text(json.dumps({"model_type": "my_new_arch",
                                                    "auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}}))
    _one_line(parse_config({"model": {"path": str(remote)}}), remote,
              r"needs the checkpoint's own code \(auto_map\): set model.trust_remote_code: true")
    gemma = _model_dir(tmp_path, tokenizer, _family("gemma3_text", tokenizer))
    _one_line(parse_config({"model": {"path": str(gemma), "backend": "native"}}), gemma,
              "model.backend transformers runs any model transformers implements")
    _one_line(parse_config({"model": {"path": str(gemma)}, "rollout": {"engine": "native"}}), gemma,
              "rollout.engine native runs the native families")
    arch, why = model_arch(parse_config({"model": {"path": str(gemma), "backend": "transformers"}}), gemma)
    assert (arch.model_type, arch.architecture, why) == ("gemma3_text", "Gemma3ForCausalLM", "set in model.backend")


def test_rl_train_accepts_a_family_only_transformers_runs_and_refuses_an_unknown_one_before_starting(
        tmp_path, tokenizer):
    """``prepare_model`` and the context guard read the model as its backend does: a Gemma 3 directory is the run's
    model (the native reading alone refused it), its context is transformers' reading, an unknown type is one line."""
    from rl.loop.guards import check_max_tokens
    from rl.setup.warmstart import prepare_model

    gemma = _model_dir(tmp_path, tokenizer, _family("gemma3_text", tokenizer))
    cfg = parse_config({"model": {"path": str(gemma)}})
    assert prepare_model(cfg) == gemma
    context = json.loads((gemma / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(UserError, match=f"the model's context of {context} tokens"):
        check_max_tokens(parse_config({"model": {"path": str(gemma)}, "rollout": {"max_tokens": context}}))
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "my_new_arch", "hidden_size": 64}))
    (unknown / "tokenizer.json").write_text("{}")
    with pytest.raises(UserError, match="model_type 'my_new_arch' is run by neither backend"):
        prepare_model(parse_config({"model": {"path": str(unknown)}}))


def test_moe_experts_vllms_cpu_build_cannot_run_are_refused_in_one_line(tmp_path, tokenizer):
    """Nemotron-H's experts are non-gated (relu²), which vLLM's CPU fused-MoE kernel does not run at all
    (docs/models.md): refused before any worker starts, in one line."""
    d = _model_dir(tmp_path, tokenizer, _family("nemotron_h", tokenizer))
    _one_line(parse_config({"model": {"path": str(d)}, "rollout": {"engine": "vllm"}}), d,
              "rollout.engine vllm on CPU workers cannot run the MoE layers of nemotron_h: vLLM's CPU fused-MoE "
              r"kernel has no non-gated \(relu²\) experts; this model rolls out on GPU workers only")
    # without its MoE layers (Nemotron-H 8B's kinds) the same family is taken
    dense = _model_dir(tmp_path, tokenizer, _family("nemotron_h-dense", tokenizer), "dense")
    assert for_model(parse_config({"model": {"path": str(dense)}, "rollout": {"engine": "vllm"}}),
                     str(dense)).rollout.engine.kind == "vllm"


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss", "qwen2_moe"])
def test_moe_models_roll_out_on_vllms_cpu_build_whose_replicas_check_their_updates(tmp_path, tokenizer, family):
    """No list of MoE families measured by hand: rollout.engine vllm on CPU workers is taken for any MoE model whose
    experts the CPU build runs, and each replica checks as it starts that its in-place updates reach them
    (engines.inference.replica_check; tests/test_replica_check.py, tests/test_hf_families_run.py)."""
    d = _model_dir(tmp_path, tokenizer, _family(family, tokenizer))
    engine = for_model(parse_config({"model": {"path": str(d)}, "rollout": {"engine": "vllm"}}), str(d)).rollout.engine
    assert engine.kind == "vllm" and engine.self_check
    # the native engine's replica is the trainer's own code: nothing to check
    if family in FAMILIES:
        assert not for_model(parse_config({"model": {"path": str(d)}}), str(d)).rollout.engine.self_check


def test_memory_plan_takes_a_family_only_transformers_runs(tmp_path, capsys, tokenizer):
    """``rl memory-plan`` of a model directory the native code cannot read: the transformers backend's description
    (meta device) gives the plan, with transformers' own parameter count."""
    from rl.setup.colocation import Colocation, colocation_plan

    config = _family("gemma3_text", tokenizer)
    d = _model_dir(tmp_path, tokenizer, config)
    assert main(["memory-plan", str(d), "--gpus", "1"]) == 0
    out = capsys.readouterr().out
    assert "master weights (shard)" in out and "fits" in out
    with torch.device("meta"):
        n = transformers.AutoModelForCausalLM.from_config(config).num_parameters()
    arch, _ = model_arch(parse_config({}), d)
    plan = colocation_plan(arch, Colocation(gpus=1, gpu_bytes=80 * 2**30))
    assert plan.params == n and plan.parts["master weights (shard)"] == 4 * n
