"""Which optimizer takes each parameter (engines.training.param_roles), on the native families and on transformers
families, by shape and role: the same rule for both backends."""

from __future__ import annotations

import pytest
import torch

from engines.model.hf.spec import meta_model
from engines.model.native.arch import make_config
from engines.model.native.causal_lm import build_model
from engines.model.native.moe import Router
from engines.training.param_roles import MUON_ROLES, muon_params, param_roles
from tests.hf_families import FAMILIES, hf_config
from tests.test_families import BASE as NATIVE_BASE
from tests.test_families import FAMILIES as NATIVE_FAMILIES

NATIVE = sorted(name for name in NATIVE_FAMILIES if "-rope-" not in name)


def native_muon_params(model) -> set[int]:
    """The rule the native families had before roles (an independent reference): 2-D and stacked 3-D weights inside
    the decoder layers, routers excepted."""
    routers = {id(p) for m in model.modules() if isinstance(m, Router) for p in m.parameters()}
    return {id(p) for n, p in model.named_parameters()
            if p.ndim in (2, 3) and ".layers." in f".{n}" and id(p) not in routers}


def _native_config(name: str):
    cls_name, kw = NATIVE_FAMILIES[name]
    import transformers

    model_type = getattr(transformers, cls_name).model_type
    return make_config(model_type, **{**NATIVE_BASE, **kw})


@pytest.mark.parametrize("name", NATIVE)
def test_native_families_get_the_native_split(name):
    model = build_model(_native_config(name), device="meta")
    assert muon_params(model) == native_muon_params(model)


@pytest.mark.parametrize("name", ["llama", "qwen3_moe", "deepseek_v3"])
def test_a_native_family_built_by_transformers_gives_muon_the_same_elements(name):
    cfg = _native_config(name)
    native, hf = build_model(cfg, device="meta"), meta_model(cfg.hf_config())
    count = lambda m: sum(p.numel() for p in m.parameters() if id(p) in muon_params(m))  # noqa: E731
    assert count(hf) == count(native) > 0
    if name == "llama":  # the same names, so the same parameters
        names = lambda m: {n for n, p in m.named_parameters() if id(p) in muon_params(m)}  # noqa: E731
        assert names(hf) == names(native)


#: family -> {parameter name suffix: role} checked on layer 0/1/3 of the tiny models
EXPECTED = {
    "gpt_oss": {"layers.0.self_attn.sinks": "sink", "layers.0.self_attn.q_proj.weight": "matrix",
                "layers.0.self_attn.q_proj.bias": "bias", "layers.0.mlp.router.weight": "router",
                "layers.0.mlp.router.bias": "bias", "layers.0.mlp.experts.gate_up_proj": "experts",
                "layers.0.mlp.experts.gate_up_proj_bias": "bias", "layers.0.mlp.experts.down_proj": "experts",
                "layers.0.input_layernorm.weight": "norm", "model.embed_tokens.weight": "embedding",
                "lm_head.weight": "head", "model.norm.weight": "head"},
    "qwen3_next": {"layers.0.linear_attn.conv1d.weight": "conv", "layers.0.linear_attn.A_log": "vector",
                   "layers.0.linear_attn.dt_bias": "bias", "layers.0.linear_attn.in_proj_qkvz.weight": "matrix",
                   "layers.0.linear_attn.norm.weight": "norm", "layers.0.mlp.gate.weight": "router",
                   "layers.0.mlp.shared_expert_gate.weight": "router", "layers.0.mlp.experts.gate_up_proj": "experts",
                   "layers.1.self_attn.q_norm.weight": "norm", "layers.1.self_attn.q_proj.weight": "matrix"},
    "lfm2": {"layers.0.conv.conv.weight": "conv", "layers.0.conv.in_proj.weight": "matrix",
             "layers.0.feed_forward.w1.weight": "matrix", "layers.1.self_attn.q_layernorm.weight": "norm",
             "model.embedding_norm.weight": "head"},
    "nemotron_h": {"layers.0.mixer.D": "vector", "layers.0.mixer.A_log": "vector", "layers.0.mixer.conv1d.bias": "bias",
                   "layers.0.mixer.conv1d.weight": "conv", "layers.0.mixer.in_proj.weight": "matrix",
                   "layers.3.mixer.gate.weight": "router", "layers.3.mixer.experts.up_proj": "experts",
                   "layers.3.mixer.shared_experts.up_proj.weight": "matrix", "model.embeddings.weight": "embedding"},
    "phi3": {"layers.0.self_attn.qkv_proj.weight": "matrix", "layers.0.mlp.gate_up_proj.weight": "matrix"},
    "glm4_moe": {"layers.1.mlp.gate.weight": "router", "layers.1.mlp.experts.gate_up_proj": "experts",
                 "layers.1.mlp.shared_experts.gate_proj.weight": "matrix", "layers.0.mlp.gate_proj.weight": "matrix"},
    "olmo2": {"layers.0.self_attn.q_norm.weight": "norm", "layers.0.post_feedforward_layernorm.weight": "norm"},
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_transformers_families_split_by_shape_and_role(name):
    model = meta_model(hf_config(name))
    roles = param_roles(model)
    for suffix, role in EXPECTED.get(name, {}).items():
        (hit,) = [n for n in roles if n.endswith(suffix)]
        assert roles[hit] == role, hit
    for n, p in model.named_parameters():
        if roles[n] in MUON_ROLES:
            assert p.ndim in (2, 3) and min(p.shape[-2:]) > 1 and ".layers." in n, n
        else:
            assert roles[n] != "matrix"
    assert any(roles[n] in MUON_ROLES for n in roles)
    if model.config.tie_word_embeddings:
        assert "lm_head.weight" not in roles  # one parameter, counted once, as the embedding
    assert isinstance(next(iter(model.parameters())), torch.nn.Parameter)
