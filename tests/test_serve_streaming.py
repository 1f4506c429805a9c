"""Streaming from ``rl serve`` costs the same per token however long the stream: incremental detokenization that adds
up to the whole decode, top log-probs that come from the engine's own decode steps (equal to a scoring forward), and
a 2,000-token stream whose decode work and scoring forwards are counted."""

from __future__ import annotations

import random

import pytest
import torch

from engines.inference.detokenizer import IncrementalText
from engines.inference.kv_cache import bytes_per_token
from engines.inference.native import InferenceEngine
from engines.inference.requests import check_request
from engines.inference.sampling import InvalidRequestError, SamplingParams
from engines.inference.server import ServedModel
from engines.model.io.hf_io import save_pretrained
from engines.model.native.attention import padded_causal_mask, positions_from_valid
from tests.conftest import sharp_model, tiny_config
from tests.test_server import _joined, running

PROMPT = "Question: Mia has 3 apples."


def _decode(tokenizer):
    return lambda ids: tokenizer.hf.decode(ids, skip_special_tokens=True)


def test_incremental_text_adds_up_to_the_whole_decode_at_every_boundary(tokenizer):
    """Random streams of ordinary tokens, single bytes (characters cut in two, invalid sequences) and special tokens
    the decode skips: the text read equals decoding all the tokens, every boundary's text is the decode of the tokens
    before it, and a stop string is cut back to the last boundary before it."""
    decode = _decode(tokenizer)
    rng = random.Random(0)
    specials = [tokenizer.eos_id, tokenizer.pad_id]
    # the byte-level alphabet's tokens are single bytes: non-ASCII ones cut characters in two
    byte_ids = [i for i in range(tokenizer.vocab_size) if len(tokenizer.hf.convert_ids_to_tokens(i)) == 1]
    euro = tokenizer.encode("€ é")  # whole multi-byte characters, as several byte tokens
    assert len(euro) > 2
    for _ in range(150):
        ids: list[int] = []
        while len(ids) < rng.randint(1, 120):
            pick = rng.random()
            ids += euro if pick < 0.1 else [rng.choice(specials)] if pick < 0.25 else \
                [rng.choice(byte_ids)] if pick < 0.45 else [rng.randrange(tokenizer.vocab_size)]
        text = IncrementalText(decode)
        for i in range(0, len(ids), 3):  # a few tokens per step, as a batched engine gives them
            text.extend(ids[i:i + 3])
        text.finish()
        whole = decode(ids)
        assert text.text == whole and text.length == len(whole)
        assert text.boundary(-1) == 0 and text.boundary(len(whole)) == len(ids)
        for k in range(len(ids) + 1):
            try:
                chars = text.chars(k)
            except ValueError:
                continue  # inside a character: not a boundary
            assert decode(ids[:k]) == whole[:chars] == text.between(0, k)
        stop = whole[len(whole) // 2:][:2]
        if stop:
            keep = text.cut(stop)
            assert stop not in decode(ids[:keep]) and whole.startswith(decode(ids[:keep]))
            assert len(decode(ids[:keep])) <= whole.find(stop)


def _reference_tops(model, prompt: list[int], tokens: list[int], k: int) -> list[list[tuple[int, float]]]:
    """The k likeliest tokens (log softmax of the logits at temperature 1) at each generated position, from a plain
    forward of the whole sequence (no engine, no KV cache)."""
    x = torch.tensor([prompt + tokens])
    valid = torch.ones_like(x, dtype=torch.bool)
    with torch.no_grad():
        logits = model(x, positions_from_valid(valid), padded_causal_mask(valid))[0, len(prompt) - 1:-1]
    values, ids = torch.log_softmax(logits.float(), -1).topk(k, dim=-1)
    return [list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]


def test_engine_steps_report_the_models_top_logprobs(tiny_model, tokenizer):
    """``SamplingParams.top_logprobs``: each step's alternatives are the model's own (temperature 1, no filters)
    whatever the request's temperature and filters and whatever else is in the batch; the sampled tokens and their
    log-probs are the same as without them."""
    model = tiny_model.eval()
    prompts = [tokenizer.encode(t) for t in (PROMPT, "Q", "Answer: 1+2=3, 3*2=6. The")]
    params = [SamplingParams(0.0, 12, ignore_eos=True, top_logprobs=3),
              SamplingParams(0.7, 12, ignore_eos=True, seed=4, top_k=5, top_p=0.9, top_logprobs=1),
              SamplingParams(1.3, 12, ignore_eos=True, seed=9)]  # asks none: its batch mates still get theirs
    outs = InferenceEngine(model, tokenizer.eos_id, tokenizer.pad_id, max_num_seqs=2).generate(prompts, params)
    plain = InferenceEngine(model, tokenizer.eos_id, tokenizer.pad_id).generate(
        prompts, [SamplingParams(p.temperature, 12, ignore_eos=True, seed=p.seed, top_k=p.top_k, top_p=p.top_p)
                  for p in params])
    for out, ref, p, prompt in zip(outs, plain, params, prompts, strict=True):
        assert out.token_ids == ref.token_ids and out.logprobs == pytest.approx(ref.logprobs, abs=1e-5)
        if not p.top_logprobs:
            assert out.top_logprobs is None
            continue
        want = _reference_tops(model, prompt, out.token_ids, p.top_logprobs)
        assert len(out.top_logprobs) == len(out.token_ids)
        for got, w in zip(out.top_logprobs, want, strict=True):
            assert [t for t, _ in got] == [t for t, _ in w]
            assert [v for _, v in got] == pytest.approx([v for _, v in w], abs=1e-5)
    # preempted and recomputed for want of blocks: still one entry per token, the same ones
    many = [SamplingParams(1.0, 40, ignore_eos=True, seed=i, top_logprobs=2) for i in range(6)]
    roomy = InferenceEngine(model, tokenizer.eos_id, tokenizer.pad_id).generate(prompts * 2, many)
    tight = InferenceEngine(model, tokenizer.eos_id, tokenizer.pad_id, block_size=4, max_seq_len=64,
                            kv_cache_bytes=20 * 4 * bytes_per_token(model.config, torch.float32))
    squeezed = tight.generate(prompts * 2, many)
    assert tight.stats()["preemptions"] > 0
    for a, b in zip(squeezed, roomy, strict=True):
        assert a.token_ids == b.token_ids and len(a.top_logprobs) == len(a.token_ids) == 40
        assert [[t for t, _ in x] for x in a.top_logprobs] == [[t for t, _ in x] for x in b.top_logprobs]
        assert [v for x in a.top_logprobs for _, v in x] == pytest.approx([v for x in b.top_logprobs for _, v in x],
                                                                          abs=1e-5)
    with pytest.raises(InvalidRequestError, match="top_logprobs"):
        SamplingParams(top_logprobs=-1)
    with pytest.raises(InvalidRequestError, match="top_logprobs: this engine reports no alternatives"):
        check_request([1, 2], SamplingParams(top_logprobs=2), [], [], vocab=10, context=64, max_seq_len=64,
                      detokenizes=True, step_top_logprobs=False)


STREAMED = 2000


@pytest.fixture(scope="module")
def long_server(tokenizer, tmp_path_factory):
    """The tiny model with a context long enough for a 2,000-token completion, served by the native engine."""
    cfg = tiny_config(tokenizer.vocab_size, eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id,
                      max_position_embeddings=STREAMED + 64)
    d = tmp_path_factory.mktemp("served_long") / "tiny"
    save_pretrained(sharp_model(cfg), tokenizer, d)
    served = ServedModel(d, max_num_seqs=2, kv_cache_bytes=16 << 20, device="cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 4,000 one-row steps: a second thread only waits on the first (and on a busy machine)
    try:
        with running(served) as (client, _):
            yield served, client
    finally:
        torch.set_num_threads(threads)


def test_a_long_stream_costs_the_same_per_token(long_server, monkeypatch):
    """2,000 tokens streamed with top log-probs: the tokens handed to the tokenizer's decode stay within a few per
    token (decoding every prefix again would be about a thousand per token here), no scoring forward runs, and the
    stream adds up to the completion served unstreamed with the same seed."""
    served, client = long_server
    hf = served.tokenizer.hf
    decode, score = hf.decode, served.engine.prompt_logprobs
    work = {"decoded": 0, "scored": 0}

    def counted_decode(ids, *a, **kw):
        work["decoded"] += len(ids)
        return decode(ids, *a, **kw)

    def counted_score(ids, *a, **kw):
        work["scored"] += 1
        return score(ids, *a, **kw)

    monkeypatch.setattr(hf, "decode", counted_decode)
    monkeypatch.setattr(served.engine, "prompt_logprobs", counted_score)
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=STREAMED, temperature=1.0, seed=3, logprobs=2,
              extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(stream=True, **kw))
    streamed = dict(work)
    whole = client.completions.create(**kw).choices[0]
    got = _joined(chunks, 0)
    assert len(whole.logprobs.tokens) == STREAMED and whole.finish_reason == "length"
    assert got["pieces"] > STREAMED // 2  # streamed as it went, not in one piece at the end
    assert got["text"] == whole.text and got["tokens"] == whole.logprobs.tokens
    assert got["token_logprobs"] == whole.logprobs.token_logprobs
    assert got["text_offset"] == whole.logprobs.text_offset
    assert [list(t) for t in got["top_logprobs"]] == [list(t) for t in whole.logprobs.top_logprobs]
    # the window decodes (a few tokens each) plus each token's and its 2 alternatives' own text for the logprobs
    assert streamed["scored"] == 0, streamed
    assert streamed["decoded"] <= 10 * STREAMED, streamed
