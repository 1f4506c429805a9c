"""What each rollout engine supports is declared once (engines.inference.capabilities), read without importing the
engine, and a run's config is refused from that declaration in one place (rl.config.engines.check_engine)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from engines.inference.base import RolloutEngine
from engines.inference.capabilities import CAPABILITIES, NATIVE, VLLM, capabilities_of, kinds_with
from engines.inference.factory import EngineSettings
from engines.model.native.arch import make_config
from rl.config import RolloutConfig, parse_config
from rl.errors import UserError
from rl.settings import resolve
from tests.test_fp8 import K2_TINY

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)


def test_each_engine_class_points_at_its_kinds_entry_and_every_engine_choice_has_one():
    from engines.inference.native import InferenceEngine
    from engines.inference.vllm_engine import VllmEngine

    assert "capabilities" in RolloutEngine.__annotations__
    assert InferenceEngine.capabilities is capabilities_of(InferenceEngine.kind) is NATIVE
    assert VllmEngine.capabilities is capabilities_of(VllmEngine.kind) is VLLM
    # rollout.engine's choices, read from the config schema: every one but auto has a declaration
    choices = set(typing.get_args(RolloutConfig.model_fields["engine"].annotation)) - {"auto"}
    assert set(CAPABILITIES) == choices and all(c.kind == k for k, c in CAPABILITIES.items())
    assert kinds_with("multimodal_inputs") == ["vllm"]  # the native engine runs text-only models
    assert kinds_with("routing_capture") == ["native", "vllm"]  # vLLM: its own capture, where its build runs it
    with pytest.raises(dataclasses.FrozenInstanceError):
        NATIVE.fp8 = False  # type: ignore[misc]
    with pytest.raises(ValueError, match="no rollout engine 'sglang': the engines are native, vllm"):
        capabilities_of("sglang")


def test_a_config_is_checked_against_vllms_declaration_without_importing_vllm_or_torch():
    """The controller reads vLLM's declaration and refuses a config by it where importing vLLM would be wrong or
    impossible: neither vllm nor torch is imported by the check."""
    code = ("import sys\n"
            "from engines.inference.capabilities import capabilities_of\n"
            "from rl.config import parse_config\n"
            "from rl.config.engines import check_engine\n"
            "from rl.errors import UserError\n"
            "assert capabilities_of('vllm').tensor_parallel and not capabilities_of('vllm').fp8\n"
            "try:\n"
            "    check_engine(parse_config({'rollout': {'fp8': True}}), 'vllm', 'auto', backend='native')\n"
            "except UserError as e:\n"
            "    assert 'rollout.fp8 is served by the native engine only' in str(e), e\n"
            "else:\n"
            "    raise SystemExit('not refused')\n"
            "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_replica_over_several_devices_is_refused_as_the_config_is_read():
    """The replica's devices are the config's alone: a config naming an engine that cannot span them is refused by
    ``parse_config``; what needs the model or the backend is left to resolve."""
    with pytest.raises(UserError) as e:
        parse_config({"rollout": {"engine": "native", "tensor_parallel_size": 2}})
    assert "rollout.tensor_parallel_size=2 needs rollout.engine: vllm (a native replica is one device)" in str(e.value)
    parse_config({"rollout": {"engine": "vllm", "tensor_parallel_size": 2, "expert_parallel": True}})
    parse_config({"rollout": {"engine": "vllm", "fp8": True}, "model": {"lora": {"rank": 2, "unmerged": True}}})


@pytest.mark.parametrize("config, says", [
    ({"rollout": {"tensor_parallel_size": 2}},
     "rollout.tensor_parallel_size=2 needs vLLM, and rollout.engine resolved to native (auto: CPU workers"),
    ({"rollout": {"engine": "vllm", "fp8": True}},
     "rollout.fp8 is served by the native engine only; set rollout.engine: native"),
    ({"model": {"lora": {"rank": 2, "unmerged": True}}, "rollout": {"engine": "vllm"}},
     "model.lora.unmerged needs the native rollout engine: vLLM's replicas merge the adapters into their weights"),
    ({"model": {"lora": {"rank": 2}}, "rollout": {"engine": "vllm", "tensor_parallel_size": 2}},
     "model.lora with vLLM: the merged weights reach a replica of one rank only"),
    ({"model": {"lora": {"rank": 2, "unmerged": True}}, "rollout": {"engine": "native"}}, None),
    ({"rollout": {"engine": "native", "fp8": True}}, None),
    ({"rollout": {"engine": "vllm", "tensor_parallel_size": 2}}, None),
])
def test_resolve_refuses_what_the_chosen_engine_does_not_declare(config, says):
    """With rollout.engine auto the engine is chosen first (native on CPU workers), then checked; each refusal is
    one line."""
    arch = make_config("llama", **TINY)
    if says is None:
        s = resolve(parse_config(config), arch, "unused", 64)
        assert s.rollout.engine.kind == config["rollout"]["engine"] and not s.rollout.engine.ipc_views
        return
    with pytest.raises(UserError) as e:
        resolve(parse_config(config), arch, "unused", 64)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_moe_models_on_cpu_are_refused_only_where_the_experts_cannot_run():
    """No MoE family is refused for its updates (each vLLM replica checks them as it starts): kimi_k2 and mixtral are
    taken on CPU workers; a CPU build that runs no non-gated experts is declared, and so refused, for nemotron_h
    only, and only on CPU."""
    for moe in (make_config("mixtral", **TINY, num_local_experts=4, num_experts_per_tok=2),
                make_config("kimi_k2", **K2_TINY)):
        assert resolve(parse_config({"rollout": {"engine": "vllm"}}), moe, "unused", 64).rollout.engine.kind == "vllm"
    assert "non-gated" in VLLM.moe_unsupported("nemotron_h", "cpu")
    assert VLLM.moe_unsupported("nemotron_h", "cuda") is None and VLLM.moe_unsupported("kimi_k2", "cpu") is None
    assert NATIVE.moe_unsupported("nemotron_h", "cpu") is None


def test_every_refusal_follows_the_declaration(monkeypatch, tmp_path):
    """The run's check and the replica's settings read the same declaration: an engine declared able to do
    something is no longer refused it, anywhere."""
    with pytest.raises(UserError):
        parse_config({"rollout": {"engine": "native", "tensor_parallel_size": 2}})
    base = dict(model_dir=str(tmp_path), device="cpu", dtype="float32", fp8=False, max_seq_len=None, max_num_seqs=4,
                kv_cache_bytes=1 << 20, max_batch_tokens=64, attention="torch", seed=0)
    with pytest.raises(ValueError, match="tensor and expert parallel replicas need the vllm engine"):
        EngineSettings(kind="native", tensor_parallel_size=2, **base)
    with pytest.raises(ValueError, match="fp8 replicas are served by the native engine only"):
        EngineSettings(kind="vllm", **{**base, "fp8": True})
    arch = make_config("llama", **TINY)
    unmerged = {"model": {"lora": {"rank": 2, "unmerged": True}}, "rollout": {"engine": "vllm"}}
    with pytest.raises(UserError, match="model.lora.unmerged needs the native rollout engine"):
        resolve(parse_config(unmerged), arch, "unused", 64)
    monkeypatch.setitem(CAPABILITIES, "native", dataclasses.replace(NATIVE, tensor_parallel=True))
    monkeypatch.setitem(CAPABILITIES, "vllm", dataclasses.replace(VLLM, fp8=True, lora_updates=("merged", "unmerged")))
    parse_config({"rollout": {"engine": "native", "tensor_parallel_size": 2}})
    EngineSettings(kind="native", tensor_parallel_size=2, **base)
    EngineSettings(kind="vllm", **{**base, "fp8": True})
    assert resolve(parse_config({"rollout": {"engine": "vllm", "fp8": True}}), arch, "unused", 64).rollout.engine.fp8
    assert resolve(parse_config(unmerged), arch, "unused", 64).adapters.unmerged


def test_each_refusal_is_written_once():
    """The messages of what an engine cannot do come from one module each: no second copy of a check."""
    fragments = ["needs vLLM, and rollout.engine resolved to", "needs rollout.engine: vllm (a native replica",
                 "rollout.fp8 is served by the native engine only", "needs the native rollout engine",
                 "reach a replica of one rank only", "cannot run the MoE layers of"]
    sources = {p: p.read_text() for d in ("rl", "engines") for p in sorted((ROOT / d).rglob("*.py"))}
    for fragment in fragments:
        assert [str(p.relative_to(ROOT)) for p, text in sources.items() if fragment in text] == \
            ["rl/config/engines.py"], fragment
