"""The Triton attention kernels (attention "triton"), run on the CPU by Triton's interpreter: equal to the torch
path's gather-and-matmul attention of decode rows and of prompt chunks for ragged contexts, GQA, block boundaries,
sliding windows and MLA-style value views, reading nothing outside each sequence's context, and giving the same
tokens and log-probabilities through an engine. (bfloat16 is left to GPU runs: the interpreter's bfloat16 ``tl.dot``
is wrong.)"""

import logging
import math
import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it
    pytest.skip("without a GPU the kernel runs only in Triton's interpreter (TRITON_INTERPRET=1 before triton is "
                "imported)", allow_module_level=True)

from engines.inference import kv_cache, triton_attention
from engines.inference.kv_cache import PagedKVCache, PagedPass, Ragged, decode_attention, rows_of
from engines.inference.native import InferenceEngine
from engines.inference.sampling import SamplingParams
from engines.model.native.arch import make_config
from engines.model.native.causal_lm import build_model


def pool(seed, positions, heads, kv_heads, dim, block_size, value_dim=None, dtype=torch.float32):
    """A one-layer pool of random keys/values whose blocks are handed out shuffled, a block table per sequence
    and a query per sequence. ``value_dim``: MLA's layout, one cached "head" whose first dims are the values."""
    cfg = SimpleNamespace(num_hidden_layers=1, is_mla=value_dim is not None, num_key_value_heads=kv_heads,
                          head_dim=dim, kv_lora_rank=value_dim, qk_rope_head_dim=dim - (value_dim or 0))
    positions = torch.tensor(positions)
    g = torch.Generator().manual_seed(seed)
    per_seq = int(positions.max()) // block_size + 1
    num_blocks = len(positions) * per_seq + 2  # two blocks no sequence holds
    cache = PagedKVCache(cfg, num_blocks, block_size, dtype)
    for t in (cache.k, cache.v):
        if t is not None:
            t.copy_(torch.randn(t.shape, generator=g))
    table = torch.randperm(num_blocks, generator=g)[: len(positions) * per_seq].view(len(positions), per_seq)
    q = torch.randn(len(positions), heads, dim, generator=g).to(dtype)
    return cache, table, positions, q


def counting(monkeypatch, kernel="paged_decode"):
    """Record each call of a kernel's wrapper: a test of the wiring must see the kernel run, not the fallback."""
    calls, real = [], getattr(triton_attention, kernel)
    monkeypatch.setattr(triton_attention, kernel, lambda *a, **kw: calls.append(a) or real(*a, **kw))
    return calls


def values_of(cache):
    return cache.k[0][..., : cache.value_dim] if cache.v is None else cache.v[0]


def torch_path(cache, table, positions, q, scale, window):
    """The reference: the torch path's decode computation over the same pool, [S, H, Dv]."""
    group = Ragged.decode(table, positions, int(positions.max()) + 1)
    step = PagedPass(cache, torch.empty(0, dtype=torch.long), [group], "torch")
    return step._torch(0, group, 0, q[:, None], scale, window)[:, 0]


def check(cache, table, positions, q, window=None, block_n=triton_attention.BLOCK_N, atol=1e-5):
    scale = 1 / math.sqrt(q.shape[-1])
    want = torch_path(cache, table, positions, q, scale, window)
    got = triton_attention.paged_decode(q, cache.k[0], values_of(cache), table, positions, cache.block_size, scale,
                                     window, block_n=block_n)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, atol=atol, rtol=0)
    return got


# contexts (positions + 1) around the block boundaries of blocks of 4 and the kernel's 16-position tiles: a lone
# first token, a block exactly full, one past it, one short of it, several blocks and tiles
RAGGED = [0, 2, 3, 4, 7, 8, 15, 16, 17, 30]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1), (6, 2)])  # GQA ratios 1, 2, 4 and 3
def test_ragged_decode_rows_match_the_torch_path_for_each_gqa_ratio(heads, kv_heads):
    check(*pool(0, RAGGED, heads, kv_heads, 8, 4), block_n=16)


@pytest.mark.parametrize("block_size,block_n,positions", [
    (16, 16, [0, 14, 15, 16, 31, 32, 47]),  # a tile is a block
    (32, 16, [0, 15, 16, 31, 32, 33, 63]),  # two tiles per block
    (3, 32, [0, 1, 2, 3, 5, 6, 35, 36]),    # blocks of a size no power of two, several per tile
])
def test_block_and_tile_boundaries(block_size, block_n, positions):
    check(*pool(1, positions, 4, 2, 8, block_size), block_n=block_n)


@pytest.mark.parametrize("window", [1, 2, 4, 5, 9, 31, 64])  # one key, within a block, a block, mid-block, all
def test_sliding_windows_match_the_torch_path(window):
    check(*pool(2, RAGGED, 4, 2, 8, 4), window=window, block_n=16)


def test_head_dims_that_are_no_power_of_two_and_values_that_view_the_keys():
    check(*pool(3, [0, 5, 12, 19], 4, 2, 24, 4))  # dims padded to 32 tiles, masked
    latent = pool(4, [0, 5, 12, 19], 4, 1, 24, 4, value_dim=16)  # MLA-like: values are the keys' first 16 dims
    assert latent[0].v is None
    out = check(*latent)
    assert out.shape == (4, 4, 16)


def test_a_large_head_group_is_split_over_programs(monkeypatch):
    monkeypatch.setattr(triton_attention, "MAX_BLOCK_G", 16)
    check(*pool(5, [0, 6, 13], 40, 1, 8, 4))  # 40 query heads on one key head: three programs, the last partly


def test_float16_matches_the_torch_path_to_its_rounding():
    got = check(*pool(6, RAGGED, 4, 2, 16, 4, dtype=torch.float16), atol=2e-3)
    assert got.dtype == torch.float16


def test_the_kernel_reads_nothing_outside_each_sequences_context():
    """NaN in every pool row no query may see, and block ids no valid block has past each sequence's last
    block: a read of either would turn its output into NaN or fault."""
    cache, table, positions, q = pool(7, [0, 3, 9, 17], 4, 2, 8, 4)
    want = torch_path(cache, table, positions, q, 0.5, 6)
    seen = torch.zeros(cache.k.shape[2], dtype=torch.bool)
    for s, p in enumerate(positions.tolist()):
        seen[rows_of(table[s], torch.arange(max(0, p - 5), p + 1), 4)] = True
    cache.k[:, :, ~seen] = float("nan")
    cache.v[:, :, ~seen] = float("nan")
    poisoned = table.clone()
    for s, p in enumerate(positions.tolist()):
        poisoned[s, p // 4 + 1:] = 10**9
    got = triton_attention.paged_decode(q, cache.k[0], cache.v[0], poisoned, positions, 4, 0.5, 6)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


# --- prompt chunks (paged_prefill) ---------------------------------------------------------------------------

# (start, end) of each sequence's chunk: a prompt's first chunk, a one-token chunk after a cached prefix, chunks
# across several blocks and tiles, a one-token prompt, a chunk starting mid-block
SPANS = [(0, 5), (3, 4), (8, 21), (0, 1), (14, 30)]


def chunks(seed, spans, heads, kv_heads, dim, block_size, value_dim=None, dtype=torch.float32, lead=2):
    """A pool as ``pool`` makes, holding each sequence up to its chunk's end, and the flat queries of a step whose
    first ``lead`` rows are other queries (decode rows), then each chunk's; the chunks' ``Ragged`` group."""
    ends = [e for _, e in spans]
    cache, table, _, _ = pool(seed, [e - 1 for e in ends], heads, kv_heads, dim, block_size, value_dim, dtype)
    n = lead + sum(e - b for b, e in spans)
    q = torch.randn(n, heads, dim, generator=torch.Generator().manual_seed(seed + 100)).to(dtype)
    index, positions, at = [], [], lead
    for b, e in spans:
        index.append(list(range(at, at + e - b)))
        positions.append(list(range(b, e)))
        at += e - b
    width = max(map(len, index))
    pad = [x + [x[-1]] * (width - len(x)) for x in index], [x + [x[-1]] * (width - len(x)) for x in positions]
    return cache, Ragged(torch.tensor(pad[0]), torch.tensor(pad[1]), table, max(ends)), q


def check_chunks(cache, group, q, window=None, block_n=triton_attention.BLOCK_N, atol=1e-5):
    """paged_prefill against the torch path's attention of the same group; rows outside the chunks stay untouched."""
    scale = 1 / math.sqrt(q.shape[-1])
    step = PagedPass(cache, torch.empty(0, dtype=torch.long), [group], "torch")
    res = step._torch(0, group, 0, q[group.q_index], scale, window)
    want = torch.full((q.shape[0], q.shape[1], cache.value_dim), 7.0, dtype=q.dtype)
    want.index_copy_(0, group.q_index.flatten(), res.flatten(0, 1))
    got = torch.full_like(want, 7.0)
    assert triton_attention.paged_prefill(q, cache.k[0], values_of(cache), group.q_index, group.q_pos, group.table,
                                          cache.block_size, scale, window, got, block_n=block_n) is got
    torch.testing.assert_close(got, want, atol=atol, rtol=0)
    return got


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (4, 1), (6, 2)])
def test_prompt_chunks_match_the_torch_path_for_each_gqa_ratio(heads, kv_heads):
    check_chunks(*chunks(20, SPANS, heads, kv_heads, 8, 4), block_n=16)


@pytest.mark.parametrize("block_size,block_n", [(16, 16), (32, 16), (3, 32)])
def test_prompt_chunks_across_block_and_tile_boundaries(block_size, block_n):
    check_chunks(*chunks(21, [(0, 17), (15, 33), (31, 64), (5, 6)], 4, 2, 8, block_size), block_n=block_n)


@pytest.mark.parametrize("window", [1, 3, 4, 9, 64])
def test_prompt_chunks_in_sliding_windows_match_the_torch_path(window):
    check_chunks(*chunks(22, SPANS, 4, 2, 8, 4), window=window, block_n=16)


def test_prompt_chunks_of_odd_head_dims_latent_values_large_groups_and_float16(monkeypatch):
    check_chunks(*chunks(23, SPANS, 4, 2, 24, 4))  # dims padded to 32 tiles, masked
    cache, group, q = chunks(24, SPANS, 4, 1, 24, 4, value_dim=16)  # values are the keys' first 16 dims
    assert check_chunks(cache, group, q).shape[-1] == 16
    assert check_chunks(*chunks(25, SPANS, 4, 2, 16, 4, dtype=torch.float16), atol=2e-3).dtype == torch.float16
    monkeypatch.setattr(triton_attention, "MAX_BLOCK_G", 16)
    check_chunks(*chunks(26, [(0, 3), (2, 9)], 40, 1, 8, 4))  # 40 query heads of one key head: three programs


def test_prompt_chunks_read_nothing_outside_their_context():
    """NaN in every pool row past each chunk's end (and outside the window of its first query), and block ids no
    valid block has past each sequence's last block: a read of either would give NaN or fault."""
    cache, group, q = chunks(27, SPANS, 4, 2, 8, 4)
    scale, window = 0.5, 6
    step = PagedPass(cache, torch.empty(0, dtype=torch.long), [group], "torch")
    want = torch.zeros(q.shape[0], 4, 8)
    want.index_copy_(0, group.q_index.flatten(), step._torch(0, group, 0, q[group.q_index], scale, window)
                     .flatten(0, 1))
    seen = torch.zeros(cache.k.shape[2], dtype=torch.bool)
    for s, (b, e) in enumerate(SPANS):
        seen[rows_of(group.table[s], torch.arange(max(0, b - window + 1), e), 4)] = True
    cache.k[:, :, ~seen] = float("nan")
    cache.v[:, :, ~seen] = float("nan")
    poisoned = group.table.clone()
    for s, (_, e) in enumerate(SPANS):
        poisoned[s, (e - 1) // 4 + 1:] = 10**9
    got = torch.zeros_like(want)
    triton_attention.paged_prefill(q, cache.k[0], cache.v[0], group.q_index, group.q_pos, poisoned, 4, scale, window,
                                   got)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_paged_pass_with_triton_writes_the_new_keys_then_attends_as_the_torch_path(monkeypatch):
    """Through ``PagedPass.attend``: the step's keys/values land at each sequence's position and its query sees
    them, in the same pool state and output as the torch backend."""
    calls = counting(monkeypatch)
    cache, table, positions, q = pool(8, [0, 4, 11], 4, 2, 8, 4)
    g = torch.Generator().manual_seed(9)
    new_k, new_v = (torch.randn(1, 2, 3, 8, generator=g) for _ in range(2))
    write = rows_of(table, positions[:, None], 4)[:, 0]
    outs, pools = {}, {}
    for backend in ("torch", "triton"):
        c = PagedKVCache.__new__(PagedKVCache)
        c.__dict__.update(cache.__dict__, k=cache.k.clone(), v=cache.v.clone(), _scratch={})
        step = PagedPass(c, write, [Ragged.decode(table, positions, 12)], backend)
        outs[backend] = step.attend(0, q.transpose(0, 1)[None], new_k, new_v, 0.3, None)
        pools[backend] = (c.k, c.v)
    assert torch.equal(pools["torch"][0], pools["triton"][0]) and torch.equal(pools["torch"][1], pools["triton"][1])
    assert torch.equal(pools["triton"][0][0][:, write], new_k[0])
    torch.testing.assert_close(outs["triton"], outs["torch"], atol=1e-5, rtol=0)
    assert len(calls) == 1


def test_an_unsupported_layer_falls_back_to_the_torch_path_saying_why(caplog, monkeypatch):
    monkeypatch.setattr(kv_cache, "_TRITON_REFUSED", set())  # each reason is logged once per process
    cache, table, positions, q = pool(10, [0, 5], 2, 1, 264, 4)  # head dim over the kernel's 256
    with pytest.raises(ValueError, match="head dims up to 256"):
        triton_attention.paged_decode(q, cache.k[0], cache.v[0], table, positions, 4, 0.1, None)
    k = torch.zeros(1, 1, 2, 264)
    outs = {}
    with caplog.at_level(logging.WARNING, logger="engines.inference.kv_cache"):
        for backend in ("torch", "triton"):
            step = PagedPass(cache, rows_of(table, positions[:, None], 4)[:, 0],
                             [Ragged.decode(table, positions, 6)], backend)
            outs[backend] = step.attend(0, q.transpose(0, 1)[None], k, k, 0.1, None)
    assert torch.equal(outs["triton"], outs["torch"])
    assert "head dims up to 256" in caplog.text


def test_triton_is_an_explicit_choice_for_cuda(monkeypatch):
    assert decode_attention("auto", "cuda") == "torch"  # auto never picks it
    assert decode_attention("triton", "cpu") == "triton"  # under the interpreter, as here
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA decode kernel"):
        decode_attention("triton", "cpu")


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_an_engine_decoding_with_triton_samples_the_torch_paths_tokens(family, monkeypatch):
    """Prefill chunks, decode rows of ragged lengths, a shared prompt and (mistral) a sliding window: the same
    tokens, log-probabilities within 1e-5."""
    calls, chunk_calls = counting(monkeypatch), counting(monkeypatch, "paged_prefill")
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
    if family == "mistral":
        kw["sliding_window"] = 5
    torch.manual_seed(0)
    model = build_model(make_config(family, **kw), init=True, fused=True)
    prompts = [[3, 4, 5, 6, 7, 8, 9, 10, 11], [3, 4, 5, 6, 7, 8, 9, 10, 11], [12], [20, 21, 22, 23, 24, 25]]
    params = [SamplingParams(1.0, 10, ignore_eos=True, seed=i) for i in range(4)]
    outs = {}
    for backend in ("torch", "triton"):
        eng = InferenceEngine(model, eos_id=None, max_seq_len=32, kv_cache_bytes=1 << 16, block_size=4,
                              max_batch_tokens=8, max_num_seqs=4, attention=backend)
        assert eng.attention == backend
        outs[backend] = eng.generate(prompts, params)
    for a, b in zip(outs["torch"], outs["triton"], strict=True):
        assert a.token_ids == b.token_ids and len(a.token_ids) == 10
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    assert len(calls) >= 2 * 9  # each layer of each decode step went through the kernel
    assert len(chunk_calls) >= 2 * 2  # and of each step with prompt chunks (two here: 8 tokens a step, 4 rows)


def test_the_run_config_takes_triton_on_gpu_workers_only():
    from rl.config import parse_config
    from rl.errors import UserError

    assert parse_config({"rollout": {"attention": "triton"}, "cluster": {"gpus_per_worker": 1}}).rollout.attention \
        == "triton"
    with pytest.raises(UserError, match=r"rollout.attention: triton is the GPU decode kernel; with CPU workers"):
        parse_config({"rollout": {"attention": "triton"}})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_of_an_engine_on_triton_are_captured_at_start_and_replay_the_eager_tokens():
    """Every capture size (1, 2, 4, 8, 12) captured at the table's full width as the engine starts, none while it
    decodes, sleeps and decodes again (the arenas keep every address), and the tokens of the engine without graphs,
    also decoding several steps a read (CPU proofs of the same: tests/test_decode_graphs.py,
    tests/test_multistep_decode.py)."""
    torch.manual_seed(0)
    model = build_model(make_config("llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
                        init=True, fused=True).cuda()
    prompts = [[3 + i, 4, 5 + i, 6][: 1 + i % 4] + [9] * (i % 3) for i in range(10)]
    params = [SamplingParams(1.0, 2 + (5 * i) % 9, ignore_eos=True, seed=i) for i in range(10)]

    def run(**kw):
        return InferenceEngine(model, eos_id=None, max_seq_len=32, kv_cache_bytes=1 << 16, block_size=4,
                               max_batch_tokens=64, max_num_seqs=12, attention="triton", **kw)

    want = run(cuda_graphs=False).generate(prompts, params)
    eng = run()
    g = eng.runner.graphs
    assert g is not None and g.in_place and g.failed is None
    assert eng.stats()["cuda_graph_captures"] == 5 and set(g.graphs) == set(g.plan())
    assert {width for _, width in g.graphs} == {eng.max_blocks * eng.block_size}
    for _ in range(2):
        got = eng.generate(prompts, params)
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)
        assert eng.stats()["cuda_graph_captures"] == 5 and eng.stats()["cuda_graphs_fallback"] == 0
        eng.sleep(1)
        eng.wake_up()
    # multi-step decoding replays the graphs back to back, one read for up to 4 of them: the same tokens again
    ahead = run(decode_steps=4)
    got = ahead.generate(prompts, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert ahead.stats()["host_reads"] < ahead.stats()["steps"] and ahead.stats()["cuda_graphs_fallback"] == 0
