"""Inference and training engines agree on per-token log-probabilities for the same weights."""

import pytest
import torch

from engines.inference import InferenceEngine, SamplingParams
from engines.training import TrainingEngine


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampler_logprobs_equal_training_recompute(tiny_model, tokenizer, temperature):
    inf = InferenceEngine(tiny_model, tokenizer.eos_id, tokenizer.pad_id, max_batch=4)
    prompts = [tokenizer.encode(p) for p in ["Question: Mia has 3 apples.", "Q", "Answer: 1+2=3, 3*2=6. The"]]
    prompts = prompts + prompts[:2]  # chunks of 4 and 1: batch composition varies
    outs = inf.generate(prompts, SamplingParams(temperature, 24), seed=5)
    assert all(len(o.token_ids) > 0 for o in outs)
    train = TrainingEngine(tiny_model, [], tokenizer.pad_id)
    with torch.no_grad():
        lp, mask = train.response_logprobs(prompts, [o.token_ids for o in outs], temperature)
    for i, o in enumerate(outs):
        recomputed = lp[i][mask[i]]
        assert recomputed.shape[0] == len(o.logprobs)
        torch.testing.assert_close(recomputed, torch.tensor(o.logprobs), atol=1e-5, rtol=0)


def test_generation_is_reproducible_and_reports_finish_reason(tiny_model, tokenizer):
    inf = InferenceEngine(tiny_model, tokenizer.eos_id, tokenizer.pad_id)
    prompts = [tokenizer.encode("Question: a b c")] * 6
    a = inf.generate(prompts, SamplingParams(1.0, 8), seed=1)
    b = inf.generate(prompts, SamplingParams(1.0, 8), seed=1)
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    for o in a:
        if o.finish_reason == "length":
            assert len(o.token_ids) == 8 and tokenizer.eos_id not in o.token_ids
        else:
            assert o.finish_reason == "stop" and o.token_ids[-1] == tokenizer.eos_id


def test_greedy_matches_argmax_of_full_forward(tiny_model, tokenizer):
    inf = InferenceEngine(tiny_model, tokenizer.eos_id, tokenizer.pad_id)
    prompt = tokenizer.encode("Question: Leo has 5 pens.")
    out = inf.generate([prompt], SamplingParams(0.0, 6))[0]
    ids = list(prompt)
    for _ in range(len(out.token_ids)):
        x = torch.tensor([ids])
        from engines.model import padded_causal_mask, positions_from_valid

        valid = torch.ones_like(x, dtype=torch.bool)
        logits = tiny_model(x, positions_from_valid(valid), padded_causal_mask(valid))[0, -1]
        ids.append(int(logits.argmax()))
        if ids[-1] == tokenizer.eos_id:
            break
    assert ids[len(prompt):] == out.token_ids


def test_prompt_longer_than_context_is_rejected(tiny_model, tokenizer):
    inf = InferenceEngine(tiny_model, tokenizer.eos_id, tokenizer.pad_id)
    with pytest.raises(ValueError, match="exceeds the context of 128"):
        inf.generate([[5] * 120], SamplingParams(1.0, 16))
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        SamplingParams(-1.0, 4)
