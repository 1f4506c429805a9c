"""Multi-step decoding (``decode_steps``): a step of decoding rows runs several forwards back to back, each sampling
on the device from the one before, and the host reads them once. What a user relies on: the very tokens of one step
at a time (each row's draw is seeded by its request and token index, so the batch around it changes nothing), the
same finish reasons where rows stop early (EOS, stop tokens, stop strings, budgets, the sequence length), top-k/p
and top log-probs alike, with preemption under a tight KV cache, and one host read for all the forwards."""

import pytest
import torch

from engines.inference import model_runner, scheduler
from engines.inference.native import InferenceEngine
from engines.inference.sampling import SamplingParams
from tests.conftest import sharp_model, tiny_config
from tests.sync_check import HostSyncChecker

VOCAB = 50


def text(ids):
    """A detokenizer for stop strings: one letter per token."""
    return "".join(chr(97 + t % 26) for t in ids)


def requests():
    """Prompts of several lengths (two alike, sharing a prefill), budgets from 2 to 40 tokens, EOS on for most,
    a stop token, a stop string, top-k, top-p and top log-probs."""
    out = []
    for i in range(14):
        prompt = [2 + (7 * i + j) % 40 for j in range(1 + (5 * i) % 11)] if i != 1 else out[0][0]
        kw = dict(seed=i, ignore_eos=i % 4 == 0)
        if i % 5 == 1:
            kw["stop_token_ids"] = (7, 8)
        if i % 5 == 2:
            kw["stop"] = ("k",)
        if i % 6 == 3:
            kw["top_k"] = 5
        if i % 6 == 4:
            kw["top_p"] = 0.8
        if i % 7 == 5:
            kw["top_logprobs"] = 3
        out.append((prompt, SamplingParams(1.0, 2 + (9 * i) % 39, **kw)))
    return out


def run(model, decode_steps, kv_cache_bytes=1 << 20, max_seq_len=48):
    eng = InferenceEngine(model, eos_id=1, max_seq_len=max_seq_len, kv_cache_bytes=kv_cache_bytes, block_size=4,
                          max_num_seqs=6, max_batch_tokens=12, decode_steps=decode_steps, detokenize=text)
    done = {}
    for prompt, p in requests():
        eng.add_request(prompt, p)
    while eng.has_unfinished():
        done.update((c.request_id, c) for c in eng.step())
    return eng, [done[i] for i in sorted(done)]


@pytest.fixture(scope="module")
def model():
    return sharp_model(tiny_config(VOCAB, eos_token_id=1, pad_token_id=0))


@pytest.fixture(scope="module")
def one_at_a_time(model):
    return run(model, 1)[1]


def same(got, want):
    assert len(got) == len(want) == 14
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        assert (a.finish_reason, a.stop_reason) == (b.finish_reason, b.stop_reason)
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
        if b.top_logprobs is None:
            assert a.top_logprobs is None
        else:
            assert [[t for t, _ in x] for x in a.top_logprobs] == [[t for t, _ in x] for x in b.top_logprobs]


@pytest.mark.parametrize("decode_steps", [3, 8])
def test_multistep_decoding_gives_the_tokens_of_one_step_at_a_time(model, one_at_a_time, decode_steps, monkeypatch):
    calls, real = [], model_runner.ModelRunner.execute_ahead
    monkeypatch.setattr(model_runner.ModelRunner, "execute_ahead",
                        lambda self, plan, steps: calls.append(steps) or real(self, plan, steps))
    eng, got = run(model, decode_steps)
    same(got, one_at_a_time)
    # the case is not vacuous: rows stopped early in it (EOS, stop tokens and strings), and multi-step ran
    assert {c.finish_reason for c in one_at_a_time} == {"stop", "length"}
    assert {type(c.stop_reason) for c in one_at_a_time if c.finish_reason == "stop"} == {int, str}
    assert calls and max(calls) == decode_steps and sum(calls) > eng.stats()["steps"] / 2


def test_a_tight_kv_cache_preempts_and_still_gives_the_same_tokens(model, one_at_a_time, monkeypatch):
    """A pool of 16 blocks of 4 tokens for 6 rows of up to 48: rows are preempted, and lookahead often finds no
    blocks for every row (then one step is run, and the blocks some rows got are theirs for the next)."""
    short, real = [], scheduler.Scheduler.reserve_ahead
    monkeypatch.setattr(scheduler.Scheduler, "reserve_ahead",
                        lambda self, plan, steps: short.append(s := real(self, plan, steps) == 1) or s)
    per_block = 2 * 2 * 2 * 8 * 4 * 4  # layers · (k, v) · kv heads · head dim · 4 tokens · float32 bytes
    eng, got = run(model, 8, kv_cache_bytes=16 * per_block)
    assert eng.stats()["preemptions"] > 0 and sum(short) > 3
    same(got, one_at_a_time)


def test_rows_that_fill_their_whole_block_table_stop_there(model):
    """Every request's prompt + budget is max_seq_len (20 tokens, 5 blocks): no lookahead runs a row past the
    table's last block, and the tokens are those of one step at a time."""
    outs = []
    for steps in (1, 8):
        eng = InferenceEngine(model, eos_id=1, max_seq_len=20, kv_cache_bytes=1 << 20, block_size=4, max_num_seqs=6,
                              max_batch_tokens=12, decode_steps=steps)
        for i, (prompt, _) in enumerate(requests()):
            eng.add_request(prompt, SamplingParams(1.0, 20 - len(prompt), seed=i, ignore_eos=True))
        done = {}
        while eng.has_unfinished():
            done.update((c.request_id, c) for c in eng.step())
        outs.append([done[i] for i in sorted(done)])
    assert all(len(c.prompt_ids) + len(c.token_ids) == 20 for c in outs[0])
    assert [c.token_ids for c in outs[1]] == [c.token_ids for c in outs[0]]


def test_the_steps_of_one_read_read_the_host_once(model):
    eng = InferenceEngine(model, eos_id=None, max_seq_len=48, kv_cache_bytes=1 << 20, block_size=4, max_num_seqs=4,
                          decode_steps=5)
    for i in range(4):
        eng.add_request([3 + i, 4, 5], SamplingParams(1.0, 22, seed=i, top_k=3 * (i % 2)))
    reads = []
    while eng.has_unfinished():
        before = eng.stats()["steps"]
        with HostSyncChecker(compute_device="cpu") as c:
            eng.step()
        assert [s.op for s in c.found] == ["Tensor.tolist"], c.found
        reads.append(eng.stats()["steps"] - before)
    assert reads == [1, 5, 5, 5, 5, 1]  # the prefill; 20 tokens in four reads; the last token, its budget's


def test_the_config_takes_decode_steps_for_native_engines_only():
    from engines.inference.factory import EngineSettings
    from rl.config import parse_config
    from rl.errors import UserError

    assert parse_config({"rollout": {"decode_steps": 8}}).rollout.decode_steps == 8
    with pytest.raises(UserError, match=r"rollout.decode_steps=8 is the native engine's multi-step decoding, and "
                                        r"rollout.engine resolved to vllm \(set in rollout.engine\)"):
        parse_config({"rollout": {"decode_steps": 8, "engine": "vllm"}})
    base = dict(model_dir="m", device="cpu", dtype="float32", fp8=False, max_seq_len=None, max_num_seqs=4,
                kv_cache_bytes=1 << 20, max_batch_tokens=64, attention="torch", seed=0, decode_steps=8)
    assert EngineSettings(kind="native", **base).decode_steps == 8
    with pytest.raises(ValueError, match="decode_steps 8: the vllm engine schedules its own steps"):
        EngineSettings(kind="vllm", **base)
    with pytest.raises(ValueError, match="decode_steps must be at least 1, got 0"):
        EngineSettings(kind="native", **{**base, "decode_steps": 0})
