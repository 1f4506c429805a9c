"""Parity of every supported model family with transformers, the reference implementation.

For each family a tiny random model is built with transformers' own config class and saved with
its ``save_pretrained`` (no download). Then: prefill logits equal transformers' forward; token-by-
token decode through the inference engine's KV cache (fused layout) equals transformers' logits at
every step; the trainer's log-probs equal the inference engine's; our ``save_pretrained`` loads back
in ``AutoModelForCausalLM`` with the same logits; MoE routers pick the same experts for every token.
All in float32 within 1e-5.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

from engines.inference.native import InferenceEngine
from engines.inference.sampling import SamplingParams
from engines.model.io.hf_io import ModelDirError, checkpoint_index, load_pretrained, read_config, save_pretrained
from engines.model.native.attention import padded_causal_mask, positions_from_valid
from engines.model.native.moe import Router
from engines.training.engine import TrainingEngine
from tests.ranks import rank_body, run_ranks

VOCAB = 128
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, bos_token_id=None, eos_token_id=None,
            pad_token_id=None)
MLA = dict(num_key_value_heads=4, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
           moe_intermediate_size=16, first_k_dense_replace=1, num_experts_per_tok=2)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "llama-rope-llama3": ("LlamaConfig", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "llama-rope-yarn": ("LlamaConfig", dict(rope_parameters=YARN)),
    "llama-rope-linear": ("LlamaConfig", dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                               "factor": 2.0})),
    "llama-rope-dynamic": ("LlamaConfig", dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                                                "factor": 2.0})),
    "llama-tied-biases-head-dim": ("LlamaConfig", dict(tie_word_embeddings=True, attention_bias=True,
                                                       mlp_bias=True, head_dim=12)),
    "qwen2": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1)),
    "qwen3": ("Qwen3Config", dict(head_dim=16, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(sliding_window=6, head_dim=16)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8,
                                         norm_topk_prob=False, mlp_only_layers=[1])),
    "deepseek_v3": ("DeepseekV3Config", dict(MLA, q_lora_rank=16, n_routed_experts=8, n_shared_experts=1, n_group=4,
                                             topk_group=2, routed_scaling_factor=2.5,
                                             rope_parameters=dict(YARN, mscale=1.0, mscale_all_dim=1.0))),
    "deepseek_v3-no-q-lora": ("DeepseekV3Config", dict(MLA, q_lora_rank=None, n_routed_experts=6, n_shared_experts=2,
                                                       num_experts_per_tok=3, n_group=1, topk_group=1,
                                                       norm_topk_prob=False, rope_interleave=False)),
}
#: families saved as several safetensors files with an index, or in bfloat16
SHARDED = {"qwen3_moe", "deepseek_v3"}
BF16_FILES = {"mixtral", "deepseek_v3-no-q-lora"}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, directory saved by transformers, the transformers model in float32)."""
    name = request.param
    cls_name, kw = FAMILIES[name]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls_name)(**{**BASE, **kw})).eval()
    # weights well above their init scale (0.02), so that errors show in the logits; at 0.25 the logits
    # reach |5| and fp32 summation order alone differs by 2e-5 between a decode step and a full forward
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.15 if p.ndim > 1 else 0.1)
        for n, b in hf.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    d = tmp_path_factory.mktemp(name)
    if name in BF16_FILES:
        hf = hf.to(torch.bfloat16)
    hf.save_pretrained(d, max_shard_size="40KB" if name in SHARDED else "5GB")
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return name, d, hf


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 24), generator=g)
    valid = torch.arange(24)[None] < torch.tensor([24, 17, 9])[:, None]  # right-padded rows
    return ids.masked_fill(~valid, 0), valid


def _ours(model, ids, valid):
    with torch.no_grad():
        return model(ids, positions_from_valid(valid), padded_causal_mask(valid))


def _theirs(hf, ids, valid):
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=valid.long()).logits


def test_prefill_logits_equal_transformers(family):
    name, d, hf = family
    model = load_pretrained(d)
    ids, valid = _batch()
    ours, theirs = _ours(model, ids, valid), _theirs(hf, ids, valid)
    torch.testing.assert_close(ours[valid], theirs[valid], atol=1e-5, rtol=1e-5)
    if name in SHARDED:
        assert (d / "model.safetensors.index.json").exists()
        assert len({f for f, _, _ in checkpoint_index(d).values()}) > 1


def test_cached_decode_equals_transformers_at_every_step(family):
    """Token by token through the engine's KV cache (the fused inference layout), one request at a
    time so each captured logits row belongs to one position; then a batch, by its log-probs."""
    _, d, hf = family
    engine = InferenceEngine(load_pretrained(d, fused=True), eos_id=None, pad_id=0, max_seq_len=48,
                             kv_cache_bytes=1 << 22)
    captured: list[torch.Tensor] = []
    hook = engine.model.lm_head.register_forward_hook(lambda m, i, out: captured.append(out.detach().clone()))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (11, 4, 7)]
    try:
        for prompt in prompts[:2]:
            captured.clear()
            out = engine.generate([prompt], SamplingParams(temperature=1.0, max_tokens=14, seed=3))[0]
            seq = torch.tensor([prompt + out.token_ids[:-1]])
            with torch.no_grad():
                ref = hf(input_ids=seq).logits[0, len(prompt) - 1:]
            steps = torch.cat([c.reshape(-1, VOCAB) for c in captured])
            assert steps.shape == ref.shape == (14, VOCAB)
            torch.testing.assert_close(steps, ref, atol=1e-5, rtol=1e-5)
    finally:
        hook.remove()
    outs = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=14), seed=5)
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([prompt + out.token_ids])).logits[0].log_softmax(-1)
        want = ref[len(prompt) - 1:-1].gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.logprobs), want, atol=1e-5, rtol=1e-5)


def test_trainer_logprobs_equal_inference_logprobs(family):
    _, d, _ = family
    engine = InferenceEngine(load_pretrained(d, fused=True), eos_id=None, pad_id=0, max_seq_len=48,
                             kv_cache_bytes=1 << 22)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (9, 3, 14, 6)]
    temps = [1.0, 0.7, 1.3, 1.0]
    outs = engine.generate(prompts, [SamplingParams(temperature=t, max_tokens=16) for t in temps], seed=6)
    trainer = TrainingEngine(load_pretrained(d), [], pad_id=0)
    with torch.no_grad():
        lp, mask = trainer.response_logprobs(prompts, [o.token_ids for o in outs], temps)
    for i, out in enumerate(outs):
        torch.testing.assert_close(lp[i][mask[i]], torch.tensor(out.logprobs), atol=1e-5, rtol=1e-5)


def test_our_save_loads_in_transformers_with_the_same_logits(family, tmp_path):
    _, d, hf = family
    model = load_pretrained(d)
    save_pretrained(model, None, tmp_path, max_shard_bytes=50_000)
    assert set(checkpoint_index(tmp_path)) == set(checkpoint_index(d))  # the checkpoint's own tensor names
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(again) is type(hf)
    ids, valid = _batch()
    torch.testing.assert_close(_theirs(again, ids, valid)[valid], _ours(model, ids, valid)[valid], atol=1e-5,
                               rtol=1e-5)
    reloaded = load_pretrained(tmp_path)
    for (n, a), b in zip(model.state_dict().items(), reloaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), n


def test_moe_routing_matches_token_for_token(family):
    name, d, hf = family
    model = load_pretrained(d)
    routers = [m for m in model.modules() if isinstance(m, Router)]
    theirs_mods = [m for n, m in hf.named_modules() if n.endswith("mlp.gate") and hasattr(m, "top_k")]
    if not routers:
        pytest.skip(f"{name} has no mixture-of-experts layers")
    assert len(routers) == len(theirs_mods) > 0
    ours_out, theirs_out = [], []
    hooks = [m.register_forward_hook(lambda m, i, o: ours_out.append(o)) for m in routers]
    hooks += [m.register_forward_hook(lambda m, i, o: theirs_out.append(o)) for m in theirs_mods]
    ids, valid = _batch()
    try:
        _ours(model, ids, valid)
        _theirs(hf, ids, valid)
    finally:
        [h.remove() for h in hooks]
    keep = valid.reshape(-1)  # padding positions route garbage in both (their outputs are never used)
    for (w, idx), (_, tw, tidx) in zip(ours_out, theirs_out, strict=True):
        w, idx, tw, tidx = w[keep], idx[keep], tw[keep], tidx[keep]
        order, torder = idx.argsort(-1), tidx.argsort(-1)
        assert torch.equal(idx.gather(-1, order), tidx.gather(-1, torder))  # same experts, every token
        torch.testing.assert_close(w.gather(-1, order), tw.float().gather(-1, torder), atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------------------ bad input
def test_unsupported_model_type_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(ModelDirError, match=r"model_type 'gpt2' is not supported; supported: llama, qwen2, qwen3"):
        read_config(tmp_path)


def test_unsupported_rope_and_quantised_checkpoints_are_refused(tmp_path):
    base = transformers.LlamaConfig(**BASE).to_dict()
    (tmp_path / "config.json").write_text(json.dumps({**base, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 4, "long_factor": [1.0] * 4,
        "original_max_position_embeddings": 16}}))
    with pytest.raises(ModelDirError, match="rope type 'longrope' is not supported; supported: default, linear"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**base, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(ModelDirError, match=r"quantised checkpoints \(fp8\) are not supported"):
        read_config(tmp_path)


def test_missing_or_misshaped_tensor_names_the_tensor_and_file(tmp_path):
    from safetensors.torch import load_file, save_file

    cfg = transformers.Qwen3Config(**BASE, head_dim=8)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    state = load_file(str(path))
    state["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(7, 32)
    save_file(state, str(path))
    with pytest.raises(ModelDirError, match=r"model.safetensors: tensor model.layers.1.self_attn.k_proj.weight has "
                                            r"shape \(7, 32\), the config implies \(16, 32\)"):
        load_pretrained(tmp_path)
    del state["model.layers.1.self_attn.k_proj.weight"]
    save_file(state, str(path))
    with pytest.raises(ModelDirError, match=r"missing tensors \['model.layers.1.self_attn.k_proj.weight'\]"):
        load_pretrained(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "gone.safetensors"}}))
    with pytest.raises(ModelDirError, match="names gone.safetensors, which is not in"):
        load_pretrained(tmp_path)


# ------------------------------------------------- 2 processes: each rank reads only its own rows
def _load_worker(rank: int, world: int, port: int, out_dir: str, model_dir: str) -> None:
    import safetensors
    import torch.distributed as dist

    from engines.model import sharded
    from engines.model.io import hf_io
    from engines.model.layout import hub_state
    from engines.model.native.causal_lm import build_model
    from engines.training import distributed

    torch.set_num_threads(1)
    with rank_body(rank, out_dir):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        read = {"elements": 0}
        real_open = safetensors.safe_open

        class Counting:  # counts the elements this rank reads out of the files
            def __init__(self, *a, **k):
                self.fh = real_open(*a, **k)

            def __enter__(self):
                self.fh.__enter__()
                return self

            def __exit__(self, *exc):
                return self.fh.__exit__(*exc)

            def __getattr__(self, attr):  # keys(), metadata(): no tensor data
                return getattr(self.fh, attr)

            def get_slice(self, name):
                fh = self.fh

                class Sliced:
                    def __getattr__(self, attr):  # get_shape(), get_dtype(): header only
                        return getattr(fh.get_slice(name), attr)

                    def __getitem__(self, key):
                        t = fh.get_slice(name)[key]
                        read["elements"] += t.numel()
                        return t
                return Sliced()

            def get_tensor(self, name):
                t = self.fh.get_tensor(name)
                read["elements"] += t.numel()
                return t

        hf_io.safe_open = Counting
        model = build_model(read_config(model_dir), device="meta")
        model = distributed.shard_model(model, device="cpu")
        hf_io.load_weights(model, model_dir)
        full = hub_state(model, sharded.full_state_dict(model))
        torch.save({"read": read["elements"], "state": {k: v.clone() for k, v in full.items()}},
                   os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("name", ["qwen3", "deepseek_v3"])
def test_sharded_start_up_reads_only_each_ranks_rows(name, tmp_path):
    """Built on the meta device and sharded over 2 ranks (FSDP2), each rank reads about half of the
    checkpoint's elements and the gathered weights equal the files bit for bit."""
    from safetensors.torch import load_file

    cls_name, kw = FAMILIES[name]
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls_name)(**{**BASE, **kw})).save_pretrained(
        tmp_path / "model")
    results = run_ranks(_load_worker, tmp_path, str(tmp_path / "model"))
    files = load_file(str(tmp_path / "model" / "model.safetensors"))
    total = sum(t.numel() for t in files.values())
    for res in results:
        assert res["read"] < 0.6 * total  # its own rows (1-D norms split too), not the whole checkpoint
        assert set(res["state"]) == set(files)
        for k, v in files.items():
            assert torch.equal(res["state"][k], v), k
    # together exactly the checkpoint, except buffers (the router's score-correction bias), which FSDP
    # does not shard: every rank reads those whole
    replicated = sum(v.numel() for k, v in files.items() if k.endswith("e_score_correction_bias"))
    assert sum(r["read"] for r in results) == total + replicated
