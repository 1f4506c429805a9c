"""Engines built from resolved settings (engines.inference.factory): the native replica and vLLM, checked against a
native engine built by hand over the same weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engines.inference.factory import EngineSettings, build_engine, decode_attention, replica_model
from engines.inference.native import InferenceEngine
from engines.inference.sampling import SamplingParams
from engines.model.io.hf_io import read_config, read_tensors, save_pretrained
from engines.model.native.fp8 import Fp8Linear
from tests.conftest import sharp_model, tiny_config

PROMPTS = ["Question: Mia has 3 apples.", "Q", "Answer: 1+2=3, 3*2=6. The"]


def settings(model_dir, **kw) -> EngineSettings:
    base = dict(kind="native", model_dir=str(model_dir), device="cpu", dtype="float32", fp8=False, max_seq_len=None,
                max_num_seqs=8, kv_cache_bytes=8 << 20, max_batch_tokens=256,
                attention=decode_attention("auto", "cpu"), seed=0)
    return EngineSettings(**{**base, **kw})


@pytest.fixture(scope="module")
def saved(tokenizer, tmp_path_factory):
    """A small model (head dim 32, which vLLM's CPU attention needs) saved with the project's tokenizer."""
    cfg = tiny_config(tokenizer.vocab_size, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=256, eos_token_id=tokenizer.eos_id,
                      pad_token_id=tokenizer.pad_id)
    model = sharp_model(cfg, 0).eval()
    d = tmp_path_factory.mktemp("factory_model")
    save_pretrained(model, tokenizer, d)
    return d, model


def reference(model, tokenizer, prompts, params):
    return InferenceEngine(model, tokenizer.eos_ids, tokenizer.pad_id).generate(prompts, params)


def test_native_engine_from_settings_serves_the_checkpoint(saved, tokenizer):
    d, model = saved
    engine = build_engine(settings(d), load_checkpoint=True)
    assert isinstance(engine, InferenceEngine) and engine.kind == "native" and engine.weight_update == "swap"
    assert engine.attention == decode_attention("auto", "cpu") and engine.eos_ids == tokenizer.eos_ids
    assert engine.max_num_seqs == 8 and engine.kv_cache_bytes <= 8 << 20 and engine.dtype == torch.float32
    prompts = [tokenizer.encode(t) for t in PROMPTS]
    params = [SamplingParams(0.0, 10), SamplingParams(1.0, 10, seed=3), SamplingParams(0.7, 10, seed=4, top_k=5)]
    got, want = engine.generate(prompts, params), reference(model, tokenizer, prompts, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0)
    # the tokenizer's text is there: stop strings are honoured (a replica built by hand refuses them)
    text = tokenizer.decode(want[0].token_ids)
    stop = text[len(text) // 2:][:2]
    assert stop.strip(), text
    cut = engine.generate([prompts[0]], SamplingParams(0.0, 10, stop=(stop,)))[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop and len(cut.token_ids) < len(want[0].token_ids)


def test_native_replica_starts_empty_and_its_seed_is_the_settings(saved, tokenizer):
    """Without ``load_checkpoint`` the replica is empty, in the fused layout, and serves what is loaded into it;
    a request without a seed draws from the settings' seed."""
    d, model = saved
    meta = replica_model(read_config(d), "bfloat16", False, "meta")
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in meta.parameters())
    assert any(name.endswith("qkv_proj.weight") for name, _ in meta.named_parameters())  # fused q/k/v
    fp8 = replica_model(read_config(d), "bfloat16", True, "meta")
    assert any(isinstance(m, Fp8Linear) for m in fp8.modules())
    assert not any(isinstance(m, Fp8Linear) for m in meta.modules())
    engine = build_engine(settings(d, seed=5))
    engine.load_weights(read_tensors(d).items())
    prompts = [tokenizer.encode(t) for t in PROMPTS]
    unseeded = SamplingParams(1.0, 12, ignore_eos=True)
    first = [c.token_ids for c in engine.generate(prompts, unseeded)]
    again = build_engine(settings(d, seed=5, decode_steps=4), load_checkpoint=True)  # multi-step: the same tokens
    assert again.decode_steps == 4
    other = build_engine(settings(d, seed=6), load_checkpoint=True)
    assert [c.token_ids for c in again.generate(prompts, unseeded)] == first
    assert [c.token_ids for c in other.generate(prompts, unseeded)] != first
    greedy = SamplingParams(0.0, 10)
    assert [c.token_ids for c in engine.generate(prompts, greedy)] == \
        [c.token_ids for c in reference(model, tokenizer, prompts, greedy)]


@pytest.mark.parametrize(("change", "message"), [
    (dict(attention="auto"), "decode_attention picks"),
    (dict(kind="sglang"), "kind must be native or vllm"),
    (dict(device="gpu"), "device must be cpu or cuda"),
    (dict(dtype="fp16"), "dtype must be one of"),
    (dict(tensor_parallel_size=2), "need the vllm engine"),
    (dict(kind="vllm", fp8=True), "native engine only"),
    (dict(device="cuda", attention="paged"), "CPU decode kernel"),
    (dict(max_num_seqs=0), "max_num_seqs must be at least 1"),
])
def test_settings_refuse_unresolved_or_contradictory_choices(tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        settings(tmp_path, **change)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings(tmp_path).seed = 1  # type: ignore[misc]


def test_vllm_engine_from_settings_answers_as_the_native_one(saved, tokenizer):
    from engines.inference import vllm_engine

    if not vllm_engine.vllm_available():
        pytest.skip("vLLM is not installed here (make setup installs it)")
    d, model = saved
    engine = build_engine(settings(d, kind="vllm", max_seq_len=256, kv_cache_bytes=32 << 20))
    try:
        assert isinstance(engine, vllm_engine.VllmEngine) and engine.weight_update == "stream"
        assert engine.max_seq_len == 256
        prompts = [tokenizer.encode(t) for t in PROMPTS]
        greedy = SamplingParams(0.0, 10)
        got, want = engine.generate(prompts, greedy), reference(model, tokenizer, prompts, greedy)
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4, rtol=0)
    finally:
        engine.close()
