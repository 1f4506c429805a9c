"""An in-place weight update of an MoE model in vLLM (engines.inference.vllm_engine, vLLM's layer-wise reload):
the engine then samples exactly as a fresh load of the new weights would, against the trainer's recompute and the
native engine on them. One vLLM start-up for the file (tens of seconds), a tiny native Mixtral."""

from __future__ import annotations

import pytest
import torch

from engines.inference.native import InferenceEngine
from engines.inference.sampling import SamplingParams
from engines.model.causal_lm import CausalLM
from engines.model.hf_io import read_tensors, save_pretrained
from engines.training.engine import TrainingEngine
from tests.conftest import tiny_config

vllm_engine = pytest.importorskip("engines.inference.vllm_engine")
if not vllm_engine.vllm_available():
    pytest.skip("vLLM is not installed here (make setup installs it)", allow_module_level=True)

PROMPTS = ["Question: Mia has 3 apples.", "Q", "Answer: 1+2=3, 3*2=6. The", "Question: Leo has 5 pens and 2 more"]


def _mixtral(tokenizer, seed: int) -> CausalLM:
    # head_dim 32 (vLLM's CPU attention has no kernel for smaller heads); every matrix and stacked expert N(0, 0.2)
    # so that logits are far from uniform and a wrong expert would show
    cfg = tiny_config(tokenizer.vocab_size, model_type="mixtral", hidden_size=64, intermediate_size=96,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, num_experts=4,
                      num_experts_per_tok=2, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id)
    torch.manual_seed(seed)
    model = CausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.2)
    return model.eval()


def _trainer_logprobs(model, prompts, responses, temperature):
    with torch.no_grad():
        lp, mask = TrainingEngine(model, [], 0).response_logprobs(prompts, responses, temperature)
    return [lp[i][mask[i]] for i in range(len(prompts))]


def _sample(engine, prompts):
    return engine.generate(prompts, [SamplingParams(0.7, 24, seed=100 + i) for i in range(len(prompts))])


def _max_diff(got, model, prompts) -> float:
    ref = _trainer_logprobs(model, prompts, [c.token_ids for c in got], 0.7)
    return max(float((torch.tensor(c.logprobs) - r).abs().max()) for c, r in zip(got, ref, strict=True))


def test_vllm_moe_update_in_place_samples_as_a_fresh_load_of_the_new_weights(tokenizer, tmp_path):
    """vLLM's CPU build packs the experts for its fused-MoE kernel at start-up; an update must pack the new ones
    too (vLLM 0.32 alone copied them unpacked into the packed tensors: log-probs 3.2 apart on average)."""
    old, new = _mixtral(tokenizer, 0), _mixtral(tokenizer, 1)
    save_pretrained(old, tokenizer, tmp_path / "old")
    save_pretrained(new, tokenizer, tmp_path / "new")
    engine = vllm_engine.VllmEngine(tmp_path / "old", tokenizer.eos_ids, max_seq_len=256, max_num_seqs=8,
                                    dtype="float32", kv_cache_bytes=64 << 20)
    assert engine.weight_load == "reload"  # what auto picks for MoE layers
    prompts, greedy = [tokenizer.encode(t) for t in PROMPTS], SamplingParams(0.0, 24)
    before = _sample(engine, prompts)
    assert _max_diff(before, old, prompts) <= 1e-4  # a fresh load: the trainer's numbers to float32 rounding

    engine.load_weights(iter(read_tensors(tmp_path / "new").items()))  # the tensors as stored, as a trainer sends
    after = _sample(engine, prompts)
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    assert _max_diff(after, new, prompts) <= 1e-4
    want = InferenceEngine(new, tokenizer.eos_ids, tokenizer.pad_id).generate(prompts, greedy)
    assert [c.token_ids for c in engine.generate(prompts, greedy)] == [c.token_ids for c in want]

    engine.load_weights(iter(read_tensors(tmp_path / "old").items()))  # and back: a second update packs again
    assert [c.token_ids for c in _sample(engine, prompts)] == [c.token_ids for c in before]
