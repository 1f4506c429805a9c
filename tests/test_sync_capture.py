"""What a CUDA graph captures and what the host waits for, checked on a CPU.

The decode step ``DecodeGraphs`` captures must make no op that needs the host (a capture fails on the
first one), the sampler and the rest of a step read the device once per step, and a capture that fails
anyway leaves the engine decoding eagerly with the same tokens. ``tests.sync_check`` sees the ops at
the dispatcher, so a CPU run finds what a GPU run would trip over.
"""

import logging

import pytest
import torch

from engines.inference import kv_cache, native
from engines.inference.cuda_graphs import MIN_WIDTH, DecodeGraphs, bucket
from engines.inference.native import InferenceEngine
from engines.inference.sampling import RowParams, SamplingParams, filter_kind, sample
from engines.model.native.arch import make_config
from engines.model.native.causal_lm import build_model
from tests.sync_check import HostSyncChecker, HostSyncError, no_host_sync, unwatched

TEXTS = ["Question: Mia has 3 apples.", "Q", "Answer: 1+2=3, 3*2=6. The", "Question: Leo has 5 pens."]

x = torch.arange(12.0).view(3, 4)
mask = x > 4

PLANTED = {
    "nonzero": lambda: torch.nonzero(mask),
    "boolean mask read": lambda: x[mask],
    "boolean mask write": lambda: x.clone().__setitem__(mask, 0.0),
    "item": lambda: x.sum().item(),
    "int()": lambda: int(x[0, 1]),
    "masked_select": lambda: x.masked_select(mask),
    "unique": lambda: torch.unique(x),
    "tolist": lambda: x.tolist(),
    "upload of python data": lambda: torch.tensor([1, 2], device="cpu"),
    "repeat_interleave by counts": lambda: x.repeat_interleave(torch.tensor([1, 2, 3]), dim=0),
}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_sync_checker_catches_each_planted_sync(name):
    with HostSyncChecker(compute_device="cpu") as c:
        PLANTED[name]()
    assert len(c.found) >= 1, name
    with pytest.raises(HostSyncError), no_host_sync("cpu"):
        PLANTED[name]()


def test_sync_checker_passes_device_only_code_and_counts_copies_only_to_the_compute_device():
    with no_host_sync("cpu"):  # nothing here needs the host
        idx = torch.arange(3)
        y = (x @ x.T).index_select(0, idx).masked_fill(mask[:, :3], 0.0)
        torch.where(mask, x, -x).index_copy_(0, idx, x)
        y.topk(2).indices.gather(1, idx[:2, None].expand(2, 2) % 2)
    with HostSyncChecker() as c:  # by default only non-CPU devices count, so a host tensor is no upload
        torch.tensor([1, 2], device="cpu")
    assert c.found == []


def engine(model, tok, **kw):
    return InferenceEngine(model, tok.eos_id, tok.pad_id, detokenize=tok.decode, **kw)


def decoding_engine(eng, prompts, params):
    """``eng`` stepped until every request decodes (no prefill left): the state a captured step starts from."""
    for p, s in zip(prompts, params, strict=True):
        eng.add_request(p, s)
    while eng.waiting:
        eng.step()
    assert len(eng.running) == len(prompts)
    return eng


@pytest.mark.parametrize("attention", ["torch", "flex"])
def test_captured_decode_step_has_no_host_sync(tiny_model, tokenizer, attention, monkeypatch):
    """``decode_logits`` at a fixed width, as ``DecodeGraphs`` captures it: no op may need the host (the
    flex kernel itself, compiled on a GPU, is left unwatched; its block mask is checked)."""
    flex = kv_cache._flex_attention

    def unwatched_flex(*args, **kw):
        with unwatched():
            return flex(*args, **kw)

    monkeypatch.setattr(kv_cache, "_flex_attention", unwatched_flex)
    prompts = [tokenizer.encode(t) for t in TEXTS]
    params = [SamplingParams(1.0, 30, ignore_eos=True, seed=i) for i in range(4)]
    # a small pool: the eager flex reference on a CPU reads the whole pool (a GPU kernel skips empty blocks)
    eng = decoding_engine(engine(tiny_model, tokenizer, attention=attention, kv_cache_bytes=4 << 20), prompts, params)
    n = len(eng.running)
    width = bucket(max(r.context_len for r in eng.running), eng.max_blocks * eng.block_size, MIN_WIDTH)
    want = eng.decode_logits(n)  # the eager step's own width, outside the checker
    with no_host_sync("cpu"):
        got = eng.decode_logits(bucket(n, eng.max_num_seqs), width)[:n]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_captured_decode_step_of_latent_attention_has_no_host_sync():
    cfg = make_config("deepseek_v3", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=8,
                      qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=0,
                      max_position_embeddings=64, first_k_dense_replace=2)
    torch.manual_seed(0)
    # the torch path: what a GPU captures (the CPU kernel is not a dispatched op)
    eng = InferenceEngine(build_model(cfg, init=True, fused=True), eos_id=None, max_seq_len=64, kv_cache_bytes=1 << 16,
                          attention="torch")
    eng = decoding_engine(eng, [[3, 4, 5, 6, 7], [8, 9]], [SamplingParams(1.0, 20, ignore_eos=True, seed=1)] * 2)
    with no_host_sync("cpu"):
        eng.decode_logits(2, MIN_WIDTH)


def test_sampler_has_no_host_sync():
    """Greedy, plain, top-k and top-p rows in one batch: drawn with no read back and no blocking upload,
    and the same tokens as outside the checker."""
    torch.manual_seed(0)
    logits = torch.randn(6, 300) * 3
    rows = RowParams(torch.tensor([0.0, 1.0, 0.8, 1.2, 1.0, 0.5]), torch.tensor([0, 0, 5, 0, 2000, 40]),
                     torch.tensor([1.0, 1.0, 1.0, 0.9, 1.0, 0.7]), torch.arange(6) + 11)
    counters = torch.arange(6) * 3
    kinds = [filter_kind(k, p, 300) for k, p in zip(rows.top_k.tolist(), rows.top_p.tolist(), strict=True)]
    assert set(kinds) == {0, 1, 2}
    want = sample(logits, rows, counters, kinds)
    with no_host_sync("cpu"):
        got = sample(logits, rows, counters, kinds)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_the_step_a_graph_captures_samples_with_no_host_sync(tiny_model, tokenizer):
    """``DecodeGraphs._step``: the decode forward at a fixed width, then the plain sampler reading each row's
    temperature, seed and counter in place: no op may need the host, and the rows draw what ``sample`` draws
    from the same logits."""
    prompts = [tokenizer.encode(t) for t in TEXTS]
    params = [SamplingParams(t, 30, ignore_eos=True, seed=i) for i, t in enumerate((0.0, 1.0, 0.6, 1.4))]
    eng = decoding_engine(engine(tiny_model, tokenizer, attention="torch", kv_cache_bytes=4 << 20), prompts, params)
    n, r = len(eng.running), eng.runner
    width = bucket(max(q.context_len for q in eng.running), eng.max_blocks * eng.block_size, MIN_WIDTH)
    with no_host_sync("cpu"):
        logits, tokens, logprobs = DecodeGraphs(r)._step(n, width)
    want = sample(logits, r.rows[:n], r.gen[:n].clone(), [q.filter_kind for q in eng.running])
    assert torch.equal(tokens, want[0]) and torch.equal(logprobs, want[1])


def test_a_step_syncs_the_host_once(tiny_model, tokenizer):
    """Every step, with prefill chunks or without: one read of the step's tokens, logprobs and stop flags,
    no other sync and no blocking upload."""
    eng = engine(tiny_model, tokenizer, max_batch_tokens=8, max_num_seqs=3)
    for i, t in enumerate(TEXTS):
        eng.add_request(tokenizer.encode(t), SamplingParams(1.0, 6 + i, ignore_eos=True, seed=i, top_k=3 * (i % 2),
                                                            stop_token_ids=(5,)))
    steps = 0
    while eng.has_unfinished():
        with HostSyncChecker(compute_device="cpu") as c:
            eng.step()
        steps += 1
        assert [s.op for s in c.found] == ["Tensor.tolist"], c.found
    assert steps > 10


def _capture_fails(self, rows, width):
    raise RuntimeError("operation not permitted when stream is capturing")


def test_failed_capture_falls_back_to_eager_decoding_with_one_warning(tiny_model, tokenizer, monkeypatch, caplog):
    """A capture that raises: the engine warns once, counts it in stats(), and decodes eagerly with the
    tokens and logprobs of an engine without graphs."""
    prompts = [tokenizer.encode(t) for t in TEXTS] * 2
    params = [SamplingParams(1.0, 5 + 2 * i, ignore_eos=True, seed=i) for i in range(len(prompts))]
    want = engine(tiny_model, tokenizer, cuda_graphs=False).generate(prompts, params)
    monkeypatch.setattr(native, "graphs_supported", lambda device, cfg: True)  # as on a GPU
    monkeypatch.setattr(DecodeGraphs, "_capture", _capture_fails)
    eng = engine(tiny_model, tokenizer)
    assert eng.runner.graphs is not None and eng.stats()["cuda_graphs_fallback"] == 0
    with caplog.at_level(logging.WARNING):
        got = eng.generate(prompts, params)
        again = eng.generate(prompts, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want] == [c.token_ids for c in again]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.logprobs, w.logprobs, atol=1e-6, rtol=0)
    warnings = [r for r in caplog.records if "capture failed" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert eng.stats()["cuda_graphs_fallback"] == 1 and eng.stats()["cuda_graph_captures"] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_decode_step_and_sampler_have_no_host_sync_on_cuda(tiny_model, tokenizer):
    """The same checks where device→host copies and blocking uploads are real: on a GPU."""
    prompts = [tokenizer.encode(t) for t in TEXTS]
    params = [SamplingParams(1.0, 30, ignore_eos=True, seed=i, top_k=3 * (i % 2)) for i in range(4)]
    eng = decoding_engine(engine(tiny_model.cuda(), tokenizer, cuda_graphs=False), prompts, params)
    n = len(eng.running)
    with no_host_sync():
        logits = eng.decode_logits(bucket(n, eng.max_num_seqs), MIN_WIDTH)[:n]
        sample(logits, eng.runner.rows[:n], eng.runner.gen[:n].clone(), [r.filter_kind for r in eng.running])


def test_captured_graphs_are_dropped_when_an_fp8_weight_buffer_moves(tokenizer):
    """A graph replays the addresses it was captured with: FP8 weights and their scales are buffers, not
    parameters, so the key the graphs check before a replay must cover buffers too (or a replica whose FP8
    weights were rebound would replay reads of freed memory)."""
    import copy

    from engines.model.native.fp8 import to_fp8
    from tests.conftest import tiny_config

    torch.manual_seed(0)
    model = to_fp8(build_model(tiny_config(tokenizer.vocab_size, hidden_size=64, num_attention_heads=2,
                                           num_key_value_heads=1, intermediate_size=128)), block=32)
    eng = engine(model, tokenizer)
    graphs = DecodeGraphs(eng.runner)
    before = graphs._addresses()
    fp8 = next(name for name, b in model.named_buffers() if b.dtype == torch.float8_e4m3fn)
    owner, attr = model.get_submodule(fp8.rpartition(".")[0]), fp8.rpartition(".")[2]
    setattr(owner, attr, copy.deepcopy(getattr(owner, attr)))  # same values, new memory
    assert graphs._addresses() != before
