"""The transformers backend (engines.model.hf.backend) on families the native code lacks, against transformers' own
forward on each document alone, and on Llama against the native model with the same weights."""

from __future__ import annotations

import sys

import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from engines.model.hf.backend import build_hf_model
from engines.model.hf.spec import decoder_layers, describe
from engines.model.logprobs import selected_logprobs
from engines.model.native.arch import UnsupportedModelError
from engines.model.native.causal_lm import track_max_logits
from engines.training.packing import pack
from engines.training.qk_clip import qk_clip
from tests.conftest import sharp_model, tiny_config
from tests.hf_families import FAMILIES, WINDOW, documents, hf_config, sharpen

TEMPERATURE = 0.7
#: per family, the QK-Clip layouts of its layers (engines.model.hf.qk_clip_plan)
LAYOUTS = {
    "gpt_oss": {"sinks"}, "gemma2": {"gqa"}, "gemma3_text": {"qk_norm"},
    "qwen3_next": {"no_softmax_attention", "qk_norm"},
    "lfm2": {"no_softmax_attention", "qk_norm"}, "nemotron_h": {"no_softmax_attention", "gqa"}, "phi3": {"mha"},
    "granite": {"gqa"}, "olmo2": {"norm_gain"}, "smollm3": {"gqa"}, "exaone4": {"qk_norm"}, "glm4_moe": {"qk_norm"},
    "qwen2_moe": {"gqa"},
}
STATEFUL = {"qwen3_next", "lfm2", "nemotron_h"}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    """(model_type, the backend's model, transformers' eager model with the same weights)."""
    cfg = hf_config(request.param)
    torch.manual_seed(0)
    model = sharpen(build_hf_model(cfg))
    ref = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    ref.load_state_dict(model.hf_model.state_dict())
    return request.param, model, ref


def _packed(model, prompts, responses, temperature=TEMPERATURE):
    """(per-sequence log-probs [S, longest], entropies, the packed batch), rows 24 wide (several documents each)."""
    batch = pack(prompts, responses, 0, "sdpa", width=24)
    inv = torch.full((int(batch.target_seq.numel()),), 1.0 / temperature)
    lp, ent = model(batch.ids, batch.positions, batch.mask, select=batch.target_flat, targets=batch.targets,
                    inv_temp=inv)
    return batch.per_sequence(lp), batch.per_sequence(ent), batch


def _grads(model, prompts, responses, checkpointing: bool):
    model.activation_checkpointing = checkpointing
    model.zero_grad(set_to_none=True)
    track_max_logits(model, True)
    for m in model.attention_modules():
        m.max_logits = None
    try:
        lp, _, _ = _packed(model, prompts, responses)
        lp.sum().backward()
    finally:
        model.activation_checkpointing = False
        track_max_logits(model, False)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    maxima = [m.max_logits.clone() for m in model.attention_modules()]
    model.zero_grad(set_to_none=True)
    return grads, maxima


def test_gradients_flow_and_activation_checkpointing_gives_the_same(family):
    _, model, _ = family
    prompts, responses = documents()
    plain, max_plain = _grads(model, prompts, responses, False)
    ckpt, max_ckpt = _grads(model, prompts, responses, True)
    # every layer's parameters get a gradient (routed experts not chosen by any token may get zeros)
    for i in range(model.config.num_hidden_layers):
        layer = {n: g for n, g in plain.items() if f".layers.{i}." in n}
        assert layer and any(float(g.abs().sum()) > 0 for g in layer.values()), f"layer {i}"
    assert all(torch.isfinite(g).all() for g in plain.values())
    assert plain.keys() == ckpt.keys()
    for n in plain:
        torch.testing.assert_close(ckpt[n], plain[n], atol=1e-6, rtol=1e-5, msg=n)
    for a, b in zip(max_plain, max_ckpt, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


# ---- S_max against q·k written out from the tensors transformers hands its attention ---------------------------

_captured: list[tuple] = []


def _capture(module, query, key, value, attention_mask, scaling=None, sliding_window=None, **kwargs):
    """Record q, k and the window, then attend as the family's own eager attention does (sinks included)."""
    _captured.append((module, query.detach(), key.detach(), scaling, sliding_window))
    eager = sys.modules[type(module).__module__].eager_attention_forward
    return eager(module, query, key, value, attention_mask, scaling=scaling, sliding_window=sliding_window, **kwargs)


def _reference(ref, prompts, responses):
    """transformers' eager forward of each document alone: (log-prob of each response token at TEMPERATURE, per
    attention module id the per-head max of scale·q·k over the document's causal (windowed) pairs, the windows
    its layers passed)."""
    AttentionInterface.register("test_capture", _capture)
    AttentionMaskInterface.register("test_capture", eager_mask)
    ref.set_attn_implementation("test_capture")
    logprobs, maxima, windows = [], {}, set()
    try:
        for p, r in zip(prompts, responses, strict=True):
            _captured.clear()
            with torch.no_grad():
                logits = ref(input_ids=torch.tensor([p + r])).logits[0].float() / TEMPERATURE
            logprobs.append(logits[len(p) - 1:-1].log_softmax(-1).gather(1, torch.tensor(r)[:, None])[:, 0])
            for module, q, k, scale, window in _captured:
                h, t, kv = q.shape[1], q.shape[2], k.shape[1]
                logits = q[0].double() @ k[0].double().repeat_interleave(h // kv, dim=0).transpose(1, 2) * scale
                i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
                allowed = (j <= i) if window is None else (j <= i) & (i - j < window)
                best = logits.masked_fill(~allowed, float("-inf")).amax(dim=(1, 2))
                maxima[id(module)] = torch.maximum(maxima.get(id(module), best), best)
                windows.add(window)
    finally:
        ref.set_attn_implementation("eager")
    return logprobs, maxima, windows


def test_packed_rows_give_transformers_logprobs_and_maxima_of_each_document_alone(family):
    """Several documents per row: each response token's log-prob equals transformers' eager forward on its document
    alone (float32, 1e-5), and the tracked S_max equal the maxima written out from the q and k transformers hands
    its attention."""
    name, model, ref = family
    prompts, responses = documents()
    track_max_logits(model, True)
    for m in model.attention_modules():
        m.max_logits = None
    try:
        with torch.no_grad():
            lp, _, batch = _packed(model, prompts, responses)
    finally:
        track_max_logits(model, False)
    assert batch.ids.shape[0] < len(prompts), "the rows must hold several documents"
    want, maxima, windows = _reference(ref, prompts, responses)
    for i, w in enumerate(want):
        torch.testing.assert_close(lp[i, :len(w)], w, atol=1e-5, rtol=0)
    assert float(torch.cat(want).std()) > 0.5, "the weights must make the log-probs far from uniform"
    assert model.config.packable == (name not in STATEFUL)
    ref_modules = [m for layer in decoder_layers(ref) for m in layer.modules() if id(m) in maxima]
    got = model.attention_modules()
    assert len(got) == len(ref_modules) > 0
    for m, r in zip(got, ref_modules, strict=True):
        torch.testing.assert_close(m.max_logits.double(), maxima[id(r)], atol=1e-4, rtol=1e-5)
    if name in ("gpt_oss", "gemma2", "gemma3_text", "exaone4"):
        assert WINDOW in windows, "the windowed layers must pass their window"


# ---- QK-Clip rules ----------------------------------------------------------------------------------------------

def test_qk_clip_rules_follow_each_familys_layout(family):
    name, model, _ = family
    rules = model.qk_clip_rules
    assert len(rules) == model.config.num_hidden_layers
    assert {r.layout for r in rules} == LAYOUTS[name]
    for r in rules:
        assert r.applies == (r.reason is None)


@pytest.mark.parametrize("name", ["phi3", "granite", "olmo2", "nemotron_h", "smollm3"])
def test_qk_clip_brings_each_offending_head_back_to_tau(name):
    # one attention layer (Nemotron-H's follows a Mamba layer): a clipped layer changes the inputs of the next
    torch.manual_seed(1)
    model = sharpen(build_hf_model(hf_config(name, **({} if name == "nemotron_h" else {"num_hidden_layers": 1}))),
                    seed=1)
    if name == "olmo2":  # gains away from 1, so that the clip scales something that matters
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "q_norm" in n or "k_norm" in n:
                    p.uniform_(0.5, 2.0)
    prompts, responses = documents(1)

    def maxima():
        track_max_logits(model, True)
        for m in model.attention_modules():
            m.max_logits = None
        with torch.no_grad():
            _packed(model, prompts, responses)
        track_max_logits(model, False)
        return [m.max_logits.clone() for m in model.attention_modules()]

    before = maxima()
    tau = 0.6 * float(torch.stack(before).max())
    metrics = qk_clip(model, tau)
    after = maxima()
    assert metrics["qk_clipped_heads"] == sum(int((b > tau).sum()) for b in before) > 0
    for b, a in zip(before, after, strict=True):
        over = b > tau
        torch.testing.assert_close(a[over], torch.full_like(a[over], tau), rtol=1e-5, atol=1e-5)
        # each head's own rows (or gains) are scaled: a head under τ is untouched
        torch.testing.assert_close(a[~over], b[~over], rtol=1e-6, atol=1e-6)


def test_qk_clip_leaves_unclippable_layers_alone():
    torch.manual_seed(0)
    model = sharpen(build_hf_model(hf_config("gpt_oss")))
    before = {n: p.clone() for n, p in model.named_parameters()}
    prompts, responses = documents()
    track_max_logits(model, True)
    with torch.no_grad():
        _packed(model, prompts, responses)
    track_max_logits(model, False)
    metrics = qk_clip(model, 1e-3)
    assert metrics["qk_clipped_heads"] == 0 and metrics["max_logit"] > 1e-3
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


# ---- the native model on the transformers backend ----------------------------------------------------------------

def test_llama_gives_the_same_logprobs_and_maxima_on_both_backends():
    cfg = tiny_config(128, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=3,
                      sliding_window=None)
    native = sharp_model(cfg, seed=3)
    hf = build_hf_model(cfg.hf_config())
    hf.load_state_dict(native.state_dict())
    prompts, responses = documents(3)
    got = {}
    for label, model in (("native", native), ("transformers", hf)):
        track_max_logits(model, True)
        with torch.no_grad():
            got[label] = _packed(model, prompts, responses)[0]
        track_max_logits(model, False)
    torch.testing.assert_close(got["transformers"], got["native"], atol=1e-5, rtol=0)
    from engines.model.native.causal_lm import attention_layers

    for a, b in zip(attention_layers(native), attention_layers(hf), strict=True):
        torch.testing.assert_close(b.max_logits, a.max_logits, atol=1e-5, rtol=1e-6)
    assert hf.config.num_parameters == sum(p.numel() for p in native.parameters())


# ---- the description and bad input -------------------------------------------------------------------------------

def test_description_on_the_meta_device_counts_what_the_model_holds(family):
    name, model, _ = family
    d = describe(hf_config(name))
    assert d.num_parameters == sum(p.numel() for p in model.parameters())
    assert d.largest_layer == max(sum(p.numel() for p in layer.parameters()) for layer in model.layers)
    assert d.root_params + sum(sum(p.numel() for p in layer.parameters()) for layer in model.layers) == \
        d.num_parameters
    assert (d.num_hidden_layers, d.hidden_size, d.vocab_size, d.head_dim) == (4, 64, 128, 32)
    assert d.is_moe == (name in ("gpt_oss", "qwen3_next", "nemotron_h", "glm4_moe", "qwen2_moe"))
    assert len(d.layer_types) == 4


def test_a_config_without_a_causal_lm_is_refused_in_one_line():
    from transformers import CONFIG_MAPPING

    with pytest.raises(UnsupportedModelError, match="no causal language model class") as err:
        build_hf_model(CONFIG_MAPPING["vit"]())
    assert "\n" not in str(err.value)


def test_chunked_logprobs_with_a_softcap_equal_the_full_logits():
    """Gemma 2's cap·tanh(logits / cap) before the temperature: values, entropies and both gradients."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(10, 16, requires_grad=True), torch.randn(300, 16, requires_grad=True)
    targets, inv = torch.randint(0, 300, (10,)), torch.rand(10) + 0.5
    coef = torch.randn(10)
    lp, ent = selected_logprobs(hidden, weight, targets, inv, chunk=64, softcap=3.0)
    (lp * coef).sum().backward()
    got = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    full = (torch.tanh(hidden @ weight.T / 3.0) * 3.0 * inv[:, None]).log_softmax(-1)
    want = full.gather(1, targets[:, None])[:, 0]
    (want * coef).sum().backward()
    torch.testing.assert_close(lp, want.detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, -(full.exp() * full).sum(-1).detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(got[0], hidden.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got[1], weight.grad, atol=1e-6, rtol=1e-5)


def test_the_training_engine_scores_and_steps_a_transformers_model():
    """TrainingEngine runs the backend as it runs the native model: packed scoring, Muon (by role) + AdamW step."""
    from engines.training.engine import TrainingEngine
    from engines.training.muon import ShardedMuon
    from engines.training.param_roles import muon_params

    torch.manual_seed(0)
    model = sharpen(build_hf_model(hf_config("gpt_oss")))
    muon = muon_params(model)
    opts = [ShardedMuon([p for p in model.parameters() if id(p) in muon], lr=1e-2, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW([p for p in model.parameters() if id(p) not in muon], lr=1e-2)]
    engine = TrainingEngine(model, opts, pad_id=0, attention="auto")
    prompts, responses = documents()
    scores = engine.score(prompts, responses, TEMPERATURE)
    want, _, _ = _packed(model, prompts, responses)  # rows of another width: the same to rounding
    torch.testing.assert_close(scores.logprobs, want, atol=1e-5, rtol=0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    (-(scores.logprobs * scores.mask).sum()).backward()
    assert engine.step() > 0
    assert set(engine.update_rms) == {"muon", "adamw"}
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert "model.layers.0.mlp.experts.gate_up_proj" in moved and "model.layers.0.self_attn.sinks" in moved
    with torch.no_grad():
        after = engine.score(prompts, responses, TEMPERATURE)
    assert float((after.logprobs * after.mask).sum()) > float((scores.logprobs * scores.mask).sum().detach())


@pytest.mark.parametrize("auto_map, match", [({"AutoModelForCausalLM": "modeling_x.XForCausalLM"}, "trust_remote_code"),
                                             (None, "not known to transformers")])
def test_a_model_type_transformers_lacks_is_refused_in_one_line(tmp_path, auto_map, match):
    import json

    from engines.model.hf.backend import load_hf_model

    cfg = {"model_type": "my_new_arch", "hidden_size": 64}
    if auto_map:
        cfg["auto_map"] = auto_map
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=match) as err:
        load_hf_model(tmp_path)
    assert "\n" not in str(err.value) and "my_new_arch" in str(err.value)
