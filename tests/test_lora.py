"""LoRA on the native model (engines.model.lora.adapters): the adapted forward is the merged model's, a training step
moves only the adapters, saved adapters load with peft on top of the transformers model and give the trainer's
log-probs, and the native inference engine merges received adapters into an exact base."""

import copy
import json

import peft
import pytest
import torch
import torch.nn.functional as F
import transformers

import engines.model.lora.adapters as lora_module
from engines.inference.native import InferenceEngine
from engines.inference.sampling import SamplingParams
from engines.model.io.hf_io import load_pretrained, save_pretrained
from engines.model.layout import hub_state
from engines.model.lora.adapters import (
    DEFAULT_TARGETS,
    LoraSpec,
    adapter_state,
    apply_lora,
    check_lora,
    merge_into,
    merged_state,
    read_adapter,
    save_adapters,
)
from engines.model.native.arch import make_config
from engines.model.native.attention import padded_causal_mask, positions_from_valid
from engines.model.native.causal_lm import build_model
from engines.training.engine import TrainingEngine
from engines.training.optim import build_optimizers
from tests.conftest import sharp_model, tiny_config

VOCAB = 64
SPEC = LoraSpec(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A sharp tiny Llama saved in Hugging Face format: the base every test adapts."""
    d = tmp_path_factory.mktemp("lora_base")
    save_pretrained(sharp_model(tiny_config(VOCAB)), None, d)
    return d


@pytest.fixture(scope="module")
def block_dir(tmp_path_factory):
    """The tiny Llama widened so that every adapted projection's rows are whole NF4 blocks (in_features a multiple
    of 64): the shapes bitsandbytes' CPU kernels compute right on every CPU, for the comparison with its 4-bit model."""
    d = tmp_path_factory.mktemp("lora_block_base")
    save_pretrained(sharp_model(tiny_config(VOCAB, hidden_size=64, intermediate_size=128)), None, d)
    return d


def merged_weight(base, a, b, scaling):
    """W0 + scaling·B·A into a new tensor of the base's dtype (``merge_into`` from the base itself)."""
    out = torch.empty_like(base)
    merge_into(out, base, a, b, scaling)
    return out


def adapted(base_dir, spec=SPEC, seed=1, nonzero_b=True):
    """The base with ``spec``'s adapters; B drawn nonzero (as after training) unless ``nonzero_b`` is False."""
    model = load_pretrained(base_dir)
    apply_lora(model, spec, generator=torch.Generator().manual_seed(seed))
    if nonzero_b:
        g = torch.Generator().manual_seed(seed + 100)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def logits(model, ids):
    valid = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        return model(ids, positions_from_valid(valid), padded_causal_mask(valid))


IDS = torch.randint(2, VOCAB, (2, 13), generator=torch.Generator().manual_seed(5))


def test_adapters_wrap_the_default_targets_and_freeze_the_base(base_dir):
    model = adapted(base_dir)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    # 2 layers x 7 projections x (A, B), nothing else
    assert len(trainable) == 2 * len(DEFAULT_TARGETS) * 2
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    a = model.model.layers[0].self_attn.q_proj.lora_A.weight
    b = model.model.layers[0].mlp.down_proj.lora_B.weight
    assert a.shape == (4, 32) and b.shape == (32, 4)  # PEFT's [r, in] and [out, r]
    fresh = adapted(base_dir, nonzero_b=False)  # B = 0: the adapted model starts as the base
    torch.testing.assert_close(logits(fresh, IDS), logits(load_pretrained(base_dir), IDS), atol=0, rtol=0)


def test_adapter_forward_equals_the_merged_model(base_dir):
    model = adapted(base_dir)
    ours = logits(model, IDS)
    merged = load_pretrained(base_dir)
    merged.load_state_dict(merged_state(model.state_dict(), SPEC.scaling))
    base = logits(load_pretrained(base_dir), IDS)
    assert (ours - base).abs().max() > 1e-2  # the adapters change the output
    torch.testing.assert_close(ours, logits(merged, IDS), atol=1e-5, rtol=0)


def _bfloat16_values(base_dir):
    """The base in float32 holding values bfloat16 can hold: a bfloat16 checkpoint's."""
    model = load_pretrained(base_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    return model


def _same_nonzero_b(wide, narrow) -> None:
    """Give both models the same nonzero B (as after training), so the adapters change their outputs."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for (name, pw), pn in zip(wide.named_parameters(), narrow.parameters(), strict=True):
            if ".lora_B." in name:
                pw.copy_(torch.randn(pw.shape, generator=g) * 0.1)
                pn.copy_(pw)


def test_a_narrow_base_computes_what_its_widened_copy_does_and_keeps_no_wide_copy(base_dir):
    """The frozen base kept in bfloat16 (a bfloat16 checkpoint's own values) under float32 compute: the same
    log-probs and adapter gradients as the float32 copy of those values, half the base bytes, and autograd saves
    no float32 copy of a base weight."""
    rounded = _bfloat16_values(base_dir)
    wide, narrow = copy.deepcopy(rounded), copy.deepcopy(rounded)
    apply_lora(wide, SPEC, generator=torch.Generator().manual_seed(1))
    paths = apply_lora(narrow, SPEC, generator=torch.Generator().manual_seed(1), base_dtype=torch.bfloat16)
    _same_nonzero_b(wide, narrow)
    for path in paths:
        assert narrow.get_submodule(path).weight.dtype == torch.bfloat16
        assert narrow.get_submodule(path).lora_A.weight.dtype == torch.float32
    wide_shapes = {tuple(narrow.get_submodule(p).weight.shape) for p in paths}
    params = {p.data_ptr() for m in (wide, narrow) for p in m.parameters()}
    saved_wide = []

    def pack(t):  # a float32 tensor of a base weight's shape that is no parameter: a widened copy
        if t.dtype == torch.float32 and tuple(t.shape) in wide_shapes and t.data_ptr() not in params:
            saved_wide.append(tuple(t.shape))
        return t

    grads = {}
    for name, model in (("wide", wide), ("narrow", narrow)):
        engine = TrainingEngine(model, [], pad_id=0, attention="sdpa")
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            s = engine.score([[3, 4, 5, 6]], [[7, 8, 9]], 1.0)
            if name == "narrow":
                narrow_saved = list(saved_wide)
            saved_wide.clear()
        (-(s.logprobs * s.mask).sum()).backward()
        grads[name] = ({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
                       s.logprobs.detach())
    assert narrow_saved == []
    assert torch.equal(grads["narrow"][1], grads["wide"][1])
    assert grads["narrow"][0].keys() == grads["wide"][0].keys() and len(grads["wide"][0]) == 2 * len(paths)
    for n, gw in grads["wide"][0].items():
        torch.testing.assert_close(grads["narrow"][0][n], gw, atol=1e-6, rtol=1e-6)
    size = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
    base_bytes = sum(narrow.get_submodule(p).weight.numel() for p in paths) * 2
    assert size(wide) - size(narrow) == base_bytes


@pytest.mark.parametrize("init", ["kaiming", "gaussian"])
def test_a_training_step_moves_only_the_adapters(base_dir, init):
    spec = LoraSpec(rank=2, alpha=4.0, init=init)
    model = adapted(base_dir, spec, nonzero_b=False)
    opts = build_optimizers(model, "adamw", lr=1e-2, weight_decay=0.0)
    assert [type(o).__name__ for o in opts] == ["AdamW"]
    assert {id(p) for o in opts for g in o.param_groups for p in g["params"]} == \
        {id(p) for n, p in model.named_parameters() if ".lora_" in n}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = TrainingEngine(model, opts, pad_id=0, attention="sdpa")
    for _ in range(2):  # B starts at zero, so A has no gradient until B has moved once
        s = engine.score([[3, 4, 5, 6]], [[7, 8, 9]], 1.0)
        (-(s.logprobs * s.mask).sum()).backward()
        engine.step()
    for n, p in model.named_parameters():
        if ".lora_" in n:
            assert not torch.equal(p, before[n]), f"{n} did not move"
        else:
            assert torch.equal(p, before[n]), f"frozen {n} moved"


def test_float32_adapters_train_over_a_bfloat16_model(base_dir):
    """A LoRA run computing in bfloat16 on one rank keeps the frozen model in bfloat16 and the adapters (and AdamW's
    state) in float32: gradients reach the adapters through the bfloat16 layers and only they move."""
    model = load_pretrained(base_dir).to(torch.bfloat16)
    apply_lora(model, LoraSpec(rank=2, alpha=4.0), torch.float32, torch.Generator().manual_seed(1))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = TrainingEngine(model, build_optimizers(model, "adamw", lr=1e-2, weight_decay=0.0), pad_id=0,
                            attention="sdpa")
    for _ in range(2):
        s = engine.score([[3, 4, 5, 6]], [[7, 8, 9]], 1.0)
        (-(s.logprobs * s.mask).sum()).backward()
        engine.step()
    for n, p in model.named_parameters():
        if ".lora_" in n:
            assert p.dtype == torch.float32 and not torch.equal(p, before[n]), n
        else:
            assert p.dtype == torch.bfloat16 and torch.equal(p, before[n]), n


def test_saved_adapters_load_with_peft_and_give_the_trainers_logprobs(base_dir, tmp_path):
    model = adapted(base_dir)
    save_adapters(SPEC, adapter_state(model), tmp_path, str(base_dir))
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 8.0
    read = read_adapter(tmp_path)  # as an engine given the adapter reads it (engines.inference.factory)
    assert read.spec == SPEC and all(torch.equal(read.tensors[n], t) for n, t in adapter_state(model).items())

    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(hf, tmp_path).eval()
    # every adapter was loaded (a misnamed key would load nothing and leave B at zero)
    loaded = {n for n, _ in with_adapter.named_parameters() if "lora_B" in n}
    assert len(loaded) == len(adapter_state(model)) // 2
    with torch.no_grad():
        theirs = torch.log_softmax(with_adapter(input_ids=IDS).logits.float(), -1)
    ours = torch.log_softmax(logits(model, IDS), -1)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)

    # final/ as a merged Hugging Face model: transformers alone gives the adapted model's log-probs
    merged_dir = tmp_path / "merged"
    save_pretrained(build_model(model.config, device="meta"), None, merged_dir,
                    state=merged_state(model.state_dict(), SPEC.scaling))
    plain = transformers.AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(torch.log_softmax(plain(input_ids=IDS).logits, -1), theirs, atol=1e-5, rtol=0)


def _engine(model) -> InferenceEngine:
    return InferenceEngine(model, eos_id=None, max_seq_len=64, kv_cache_bytes=1 << 18, block_size=4)


def test_the_engine_merges_adapter_updates_onto_an_exact_base(base_dir, tmp_path):
    base = load_pretrained(base_dir)
    replica = build_model(base.config, fused=True)
    eng = _engine(replica)
    eng.load_weights(hub_state(base).items())
    prompts = [[3, 4, 5, 6, 7], [9, 10]]
    params = SamplingParams(0.0, 12, ignore_eos=True)
    base_tokens = [c.token_ids for c in eng.generate(prompts, params)]
    exact_base = {n: t.clone() for n, t in hub_state(base).items()}
    ref_eng = _engine(build_model(base.config, fused=True))  # serves the merged weights, loaded whole
    for seed in (1, 2, 3):  # successive updates: each merged from the base, never from the previous merge
        trained = adapted(base_dir, seed=seed)
        update = adapter_state(trained)
        eng.merge_adapters(update, SPEC.scaling)
        # hub_state is the checkpoint's tensors (the base); the adapters come beside it
        ref_eng.load_weights(merged_state({**hub_state(trained), **update}, SPEC.scaling).items())
        assert [c.token_ids for c in eng.generate(prompts, params)] == \
            [c.token_ids for c in ref_eng.generate(prompts, params)]
        served = eng.served_weights()
        q = "model.layers.1.self_attn.q_proj"
        assert torch.equal(served[f"{q}.weight"], merged_weight(exact_base[f"{q}.weight"], update[f"{q}.lora_A.weight"],
                                                                update[f"{q}.lora_B.weight"], SPEC.scaling))
        assert torch.equal(served["model.embed_tokens.weight"], exact_base["model.embed_tokens.weight"])
    assert [c.token_ids for c in eng.generate(prompts, params)] != base_tokens  # the adapters changed the samples
    # the replica's log-probs are those of peft's base + adapter (the last update)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(hf, save_adapters(SPEC, update, tmp_path)).eval()
    seq = [3, 4, 5, 6, 7, 11, 12, 13]
    with torch.no_grad():
        lp = torch.log_softmax(with_adapter(input_ids=torch.tensor([seq])).logits[0], -1)
    theirs = [lp[i - 1, seq[i]].item() for i in range(1, len(seq))]
    ours = [t.logprob for t in eng.prompt_logprobs(seq)[1:]]
    assert ours == pytest.approx(theirs, abs=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_blockwise_merge_computes_the_merged_weight(monkeypatch, dtype):
    g = torch.Generator().manual_seed(3)
    base = torch.randn(37, 24, generator=g).to(dtype)
    a, b = torch.randn(4, 24, generator=g), torch.randn(37, 4, generator=g)
    exact = (base.double() + 0.75 * (b.double() @ a.double())).to(dtype)
    monkeypatch.setattr(lora_module, "MERGE_BLOCK_BYTES", 5 * 4 * 24)  # blocks of 5 rows, a short last one
    merged = merged_weight(base, a, b, 0.75)
    assert merged.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(merged, exact, rtol=0, atol=1e-5)
    else:  # the float32 sum rounds to the float64 sum's bfloat16 neighbour or next to it
        assert ((merged.float() - exact.float()).abs() <= exact.float().abs() * 2 ** -8 + 1e-6).all()
    in_place = base.clone()
    merge_into(in_place, in_place, a, b, 0.75)  # the served weight as its own base (rl serve --adapter)
    assert torch.equal(in_place, merged) and not torch.equal(in_place, base)


def test_targets_are_checked_against_the_model():
    cfg = tiny_config(VOCAB)
    assert len(check_lora(cfg, LoraSpec(4, 8.0, target_modules=("q_proj", "v_proj")))) == 4
    with pytest.raises(ValueError, match=r"'qproj' match no linear layer of this llama model; its decoder layers "
                                         r"have: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"):
        check_lora(cfg, LoraSpec(4, 8.0, target_modules=("q_proj", "qproj")))
    moe = make_config("mixtral", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    assert len(check_lora(moe, LoraSpec(4, 8.0, target_modules=("q_proj", "o_proj")))) == 2
    with pytest.raises(ValueError, match="experts are stacked tensors, not adapted"):
        check_lora(moe, LoraSpec(4, 8.0))
    mla = make_config("deepseek_v3", vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                      qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                      num_experts_per_tok=2, n_group=1, topk_group=1)
    with pytest.raises(ValueError, match="latent attention"):
        check_lora(mla, LoraSpec(4, 8.0))
    for bad, match in ((dict(rank=0), "rank must be at least 1"), (dict(alpha=0.0), "alpha must be > 0"),
                       (dict(dropout=1.0), r"dropout must be in \[0, 1\)"), (dict(init="zeros"), "init must be")):
        with pytest.raises(ValueError, match=match):
            LoraSpec(**{"rank": 4, "alpha": 8.0, **bad})


def test_the_update_benchmark_moves_only_the_adapters_bytes():
    from benchmarks.weight_update_lora import measure_lora

    rec = measure_lora("demo", 2, "float32", repeats=1)
    # the quick-start model: 4 layers, hidden 128, 4 heads of 32 (2 kv heads), MLP 384; r·(in + out) per projection
    per_layer = 2 * ((128 + 128) * 2 + (128 + 64) * 2 + 3 * (128 + 384))
    assert rec["lora_bytes"] == 4 * per_layer * 4  # float32 adapters
    assert rec["full_bytes"] == rec["params"] * 4 and rec["bitwise_equal"]
    # a bfloat16 replica gets them in bfloat16, as a run's plan casts them (plan_adapter_update's dtype)
    rec = measure_lora("demo", 2, "bfloat16", repeats=1)
    assert rec["lora_bytes"] == 4 * per_layer * 2 and rec["full_bytes"] == rec["params"] * 2 and rec["bitwise_equal"]


def test_bfloat16_compute_keeps_no_float32_copy_of_an_adapted_input(base_dir):
    """Under bfloat16 compute the float32 adapters are cast to the input's dtype, not the input to theirs: autograd
    keeps no float32 activation of an adapted projection's input width (the H200 lease measured 1.9 GiB of them on
    the 0.6 B shape), and the adapter gradients still follow the float32 computation of the same values."""
    rounded = _bfloat16_values(base_dir)
    wide, narrow = copy.deepcopy(rounded), copy.deepcopy(rounded).to(torch.bfloat16)
    apply_lora(wide, SPEC, torch.float32, torch.Generator().manual_seed(1))
    paths = apply_lora(narrow, SPEC, torch.float32, torch.Generator().manual_seed(1))
    _same_nonzero_b(wide, narrow)
    params = {p.data_ptr() for m in (wide, narrow) for p in m.parameters()}
    inside, kept = [], []  # inside: the adapted projection whose forward is running

    def pack(t):  # a float32 non-parameter saved by an adapted projection: an activation copy
        if inside and t.dtype == torch.float32 and t.data_ptr() not in params:
            kept.append(tuple(t.shape))
        return t

    for model in (wide, narrow):
        for p in paths:
            m = model.get_submodule(p)
            m.register_forward_pre_hook(lambda *_: inside.append(1))
            m.register_forward_hook(lambda *_: inside.clear())

    grads = {}
    for name, model in (("wide", wide), ("narrow", narrow)):
        engine = TrainingEngine(model, [], pad_id=0, attention="sdpa")
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            s = engine.score([[3, 4, 5, 6, 7, 8]], [[9, 10, 11, 12]], 1.0)
        (-(s.logprobs * s.mask).sum()).backward()
        grads[name] = torch.cat([p.grad.flatten() for n, p in model.named_parameters() if ".lora_" in n])
        if name == "wide":
            assert kept  # the float32 model keeps its float32 inputs: the hook sees what it looks for
            kept.clear()
    assert kept == []
    assert F.cosine_similarity(grads["narrow"], grads["wide"], dim=0) > 0.99


@pytest.mark.parametrize("kept", [True, False])
def test_a_lora_replica_sleeps_at_level_two_and_the_adapters_refill_it(base_dir, kept):
    """A replica that keeps its base (``keep_adapter_base``, as a LoRA run's rollout worker sets) discards its
    weights at sleep level 2, before its first merge as after one, and the next adapter update alone brings back
    every weight, bitwise those of a replica that never slept. Without it the unadapted weights are lost (kept=False:
    what this test would see if the base copy were missing)."""
    base = load_pretrained(base_dir)
    eng, ref = _engine(build_model(base.config, fused=True)), _engine(build_model(base.config, fused=True))
    for e in (eng, ref):
        e.load_weights(hub_state(base).items())
    if kept:
        eng.keep_adapter_base()
    prompts, params = [[3, 4, 5, 6, 7], [9, 10]], SamplingParams(0.0, 12, ignore_eos=True)
    for seed in (1, 2):  # the first sleep comes before any merge (a run's first rollout), the second after one
        update = adapter_state(adapted(base_dir, seed=seed))
        eng.sleep(2)
        eng.wake_up(kv_cache=False)  # the two-step wake: weights, the update, then the KV cache
        eng.merge_adapters(update, SPEC.scaling)
        eng.wake_up()
        ref.merge_adapters(update, SPEC.scaling)
        mine, theirs = eng.served_weights(), ref.served_weights()
        same = all(torch.equal(mine[n], theirs[n]) for n in theirs)
        if not kept:
            assert not same and not torch.equal(mine["model.embed_tokens.weight"], theirs["model.embed_tokens.weight"])
            return
        assert same
        assert [c.token_ids for c in eng.generate(prompts, params)] == \
            [c.token_ids for c in ref.generate(prompts, params)]
    assert eng.adapter_base_bytes == sum(t.numel() * t.element_size() for t in hub_state(base).values())


def test_an_unmerged_replica_serves_the_adapted_model_and_its_updates_write_only_the_deltas(base_dir):
    """``load_adapter_deltas`` (model.lora.unmerged): the fused replica adds the adapters' low-rank products
    beside its q/k/v and gate/up blocks; it computes the trainer's adapted model (float32, ≤ 1e-5) and samples what a
    merging replica samples, its served weights stay the base bit for bit through updates, and after a level-2 sleep
    the next update brings the base back from the host copy."""
    base = load_pretrained(base_dir)
    eng, merging = _engine(build_model(base.config, fused=True)), _engine(build_model(base.config, fused=True))
    for e in (eng, merging):
        e.load_weights(hub_state(base).items())
        e.keep_adapter_base()
    start = {n: t.clone() for n, t in eng.served_weights().items()}
    prompts, params = [[3, 4, 5, 6, 7], [9, 10]], SamplingParams(0.0, 12, ignore_eos=True)
    for seed, sleep in ((1, False), (2, False), (3, True)):
        trainer = adapted(base_dir, seed=seed)
        if sleep:
            eng.sleep(2)
            eng.wake_up(kv_cache=False)
        eng.load_adapter_deltas(adapter_state(trainer), SPEC.scaling)
        merging.merge_adapters(adapter_state(trainer), SPEC.scaling)
        torch.testing.assert_close(logits(eng.model, IDS), logits(trainer, IDS), atol=1e-5, rtol=0)
        assert all(torch.equal(t, start[n]) for n, t in eng.served_weights().items())
        assert [c.token_ids for c in eng.generate(prompts, params)] == \
            [c.token_ids for c in merging.generate(prompts, params)]
    # per fused layer of P adapted blocks: A [P·r, in] and a block-diagonal B [out, P·r] (float32 here)
    c, r = base.config, SPEC.rank
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    h, i = c.hidden_size, c.intermediate_size
    per_layer = 3 * r * h + (q + 2 * kv) * 3 * r + r * q + h * r + 2 * r * h + 2 * i * 2 * r + r * i + h * r
    assert eng._delta.nbytes == c.num_hidden_layers * per_layer * 4


def test_the_transformers_backend_adapts_its_own_modules_as_peft_does(tmp_path):
    """LoRA on ``HFCausalLM`` (transformers' own Gemma 3, a family the native code lacks): the adapted projections
    are transformers' modules under their own names, the adapted forward's log-probs are those of the merged model
    (float32, ≤ 1e-5), and the saved adapters put on transformers' base model by peft give the same log-probs."""
    from engines.model.hf.backend import load_hf_model
    from engines.training.packing import pack
    from tests.hf_families import hf_config, sharpen

    cfg = hf_config("gemma3_text", vocab_size=VOCAB, eos_token_id=1, pad_token_id=0, bos_token_id=None)
    torch.manual_seed(0)
    sharpen(transformers.AutoModelForCausalLM.from_config(cfg)).save_pretrained(tmp_path / "base")
    model = load_hf_model(tmp_path / "base")
    paths = apply_lora(model, SPEC, generator=torch.Generator().manual_seed(1))
    assert "model.layers.0.self_attn.q_proj" in paths and len(paths) == cfg.num_hidden_layers * len(DEFAULT_TARGETS)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    prompts = [IDS[0, :5].tolist(), IDS[1, :4].tolist()]
    responses = [IDS[0, 5:].tolist(), IDS[1, 4:].tolist()]
    batch = pack(prompts, responses, 0, "sdpa")

    def scored(m):
        with torch.no_grad():
            lp, _ = m(batch.ids, batch.positions, batch.mask, select=batch.target_flat, targets=batch.targets)
        return lp

    ours = scored(model)
    merged = load_hf_model(tmp_path / "base")
    merged.load_state_dict(merged_state(model.state_dict(), SPEC.scaling))
    assert (ours - scored(load_hf_model(tmp_path / "base"))).abs().max() > 1e-2  # the adapters change the output
    torch.testing.assert_close(ours, scored(merged), atol=1e-5, rtol=0)

    save_adapters(SPEC, adapter_state(model), tmp_path / "adapter", str(tmp_path / "base"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    assert len({n for n, _ in with_adapter.named_parameters() if "lora_B" in n}) == len(paths)
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    res = plain.load_state_dict(merged_state(model.state_dict(), SPEC.scaling), strict=False)
    assert not res.unexpected_keys and set(res.missing_keys) <= {"lm_head.weight"}  # tied to the embeddings
    with torch.no_grad():
        theirs = torch.log_softmax(with_adapter(input_ids=IDS).logits.float(), -1)
        torch.testing.assert_close(torch.log_softmax(plain(input_ids=IDS).logits, -1), theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_a_quantized_base_computes_what_peft_on_bitsandbytes_does(block_dir, tmp_path, kind):
    """QLoRA (engines.model.lora.quant): the adapted projections' weights become bitsandbytes' packed bytes (NF4:
    about a sixth of their float32 bytes, int8 about a quarter), and the adapted model's log-probs are those of
    transformers' 4-bit model (bitsandbytes) with the same adapters put on by peft, exactly for NF4; for int8 (which
    transformers runs through another kernel) those of the dequantized weights merged with the adapters. A training
    step moves the adapters only and leaves the packed base as it was."""
    from engines.model.lora.quant import _dequantized, quantize_base

    model = adapted(block_dir)
    save_adapters(SPEC, adapter_state(model), tmp_path / "adapter", str(block_dir))
    before = sum(t.numel() * t.element_size() for n, t in model.state_dict().items() if n.endswith("_proj.weight"))
    names = quantize_base(model, kind)
    assert len(names) == 2 * len(DEFAULT_TARGETS) and all(model.get_submodule(n[:-7]).weight is None
                                                          for n in names)
    after = sum(t.numel() * t.element_size() for n, t in model.state_dict().items() if ".base_" in n)
    assert after < before * (0.2 if kind == "nf4" else 0.3)
    ours = torch.log_softmax(logits(model, IDS), -1)
    if kind == "nf4":
        import bitsandbytes as bnb

        quant = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                bnb_4bit_compute_dtype=torch.float32)
        hf = transformers.AutoModelForCausalLM.from_pretrained(block_dir, quantization_config=quant, device_map="cpu",
                                                               dtype=torch.float32)
        with_adapter = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
        # the QLoRA training path: in eval mode, on CPUs with AVX512-BF16, Linear4bit repacks its weight for a
        # bfloat16 inference kernel (other numbers than a trainer's float32 ones, and it fails on these sizes)
        bnb_layers = [m for m in with_adapter.modules() if isinstance(m, bnb.nn.Linear4bit)]
        assert len(bnb_layers) == len(names)
        for m in bnb_layers:
            m.train()
        with torch.no_grad():
            theirs = torch.log_softmax(with_adapter(input_ids=IDS).logits.float(), -1)
        assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in bnb_layers)
    else:
        state = {n: t for n, t in model.state_dict().items() if ".base_" not in n}
        state.update({n: _dequantized(model.get_submodule(n[:-7]), torch.float32) for n in names})
        ref = load_pretrained(block_dir)
        ref.load_state_dict(merged_state(state, SPEC.scaling))
        theirs = torch.log_softmax(logits(ref, IDS), -1)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    assert (ours - torch.log_softmax(logits(load_pretrained(block_dir), IDS), -1)).abs().max() > 1e-2

    packed = {n: t.clone() for n, t in model.state_dict().items() if ".base_" in n}
    adapters = {n: t.clone() for n, t in adapter_state(model).items()}
    engine = TrainingEngine(model, build_optimizers(model, "adamw", lr=1e-2, weight_decay=0.0), pad_id=0,
                            attention="sdpa")
    s = engine.score([[3, 4, 5, 6]], [[7, 8, 9]], 1.0)
    (-(s.logprobs * s.mask).sum()).backward()
    engine.step()
    assert all(torch.equal(packed[n], t) for n, t in model.state_dict().items() if ".base_" in n)
    assert all(not torch.equal(adapters[n], t) for n, t in adapter_state(model).items())  # B nonzero: A moves too


def test_nf4_dequantizes_blocks_of_64_of_the_flattened_weight_on_any_cpu(base_dir):
    """NF4's scales cover 64 consecutive elements of the flattened weight, so with in_features 32 a block spans two
    rows: the base the trainer computes with is each packed nibble's NF4 value (high nibble first) times its block's
    scale, decoded here by hand (bitsandbytes 0.49-0.50's AVX-512 CPU kernel, asked for the weight's own shape,
    scales each row as if it began a block)."""
    import bitsandbytes.functional as bf

    from engines.model.lora.quant import BLOCK, _dequantized, quantize_base

    model = adapted(base_dir)
    names = quantize_base(model, "nf4")
    table = bf.get_4bit_type("nf4", device="cpu").float()
    straddle = 0
    for name in names:
        m = model.get_submodule(name[:-7])
        straddle += m.in_features % BLOCK != 0
        q = m.base_packed.reshape(-1)
        nibbles = torch.stack([q >> 4, q & 0xF], 1).reshape(-1)[: m.out_features * m.in_features].long()
        scales = m.base_absmax.repeat_interleave(BLOCK)[: nibbles.numel()]
        want = (table[nibbles] * scales).reshape(m.out_features, m.in_features)
        torch.testing.assert_close(_dequantized(m, torch.float32), want, atol=0, rtol=0)
    assert straddle == len(names) - 2  # all but down_proj (in_features 64) of both layers: blocks across rows
