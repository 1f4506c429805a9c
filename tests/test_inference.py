"""The inference engine: trainer-consistent logprobs, continuous batching, prefix sharing,
sampling controls, stop conditions, pause/resume, sleep/wake and per-request errors."""

import copy
import math
import mmap
import struct

import pytest
import torch

from engines.inference.colocation import fit_kv_budget
from engines.inference.kv_cache import bytes_per_token
from engines.inference.native import InferenceEngine
from engines.inference.sampling import InvalidRequestError, RowParams, SamplingParams, sample
from engines.model.native.arch import make_config
from engines.model.native.attention import padded_causal_mask, positions_from_valid
from engines.model.native.causal_lm import build_model
from engines.training.engine import TrainingEngine

TEXTS = ["Question: Mia has 3 apples.", "Q", "Answer: 1+2=3, 3*2=6. The", "Question: Leo has 5 pens."]


def engine(model, tok, **kw):
    return InferenceEngine(model, tok.eos_id, tok.pad_id, detokenize=tok.decode, **kw)


def trainer_logprobs(model, prompts, responses, temperature):
    with torch.no_grad():
        lp, mask = TrainingEngine(model, [], 0).response_logprobs(prompts, responses, temperature)
    return [lp[i][mask[i]] for i in range(len(prompts))]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_trainer_whatever_the_batch(tiny_model, tokenizer, temperature):
    prompts = [tokenizer.encode(t) for t in TEXTS]
    params = [SamplingParams(temperature, 24, seed=100 + i) for i in range(len(prompts))]
    alone = [engine(tiny_model, tokenizer).generate([p], [s])[0] for p, s in zip(prompts, params, strict=True)]
    # two slots for four requests: requests join mid-way, rows move between slots as others finish
    mixed = engine(tiny_model, tokenizer, max_num_seqs=2).generate(prompts[::-1], params[::-1])[::-1]
    big = engine(tiny_model, tokenizer).generate(prompts * 3, params * 3)[:4]
    for runs in (mixed, big):
        assert [c.token_ids for c in runs] == [c.token_ids for c in alone]
    ref = trainer_logprobs(tiny_model, prompts, [c.token_ids for c in alone], temperature)
    for runs in (alone, mixed, big):
        for c, r in zip(runs, ref, strict=True):
            assert len(c.token_ids) > 0
            torch.testing.assert_close(torch.tensor(c.logprobs), r, atol=1e-5, rtol=0)


def test_greedy_matches_argmax_of_full_forward(tiny_model, tokenizer):
    prompt = tokenizer.encode("Question: Leo has 5 pens.")
    out = engine(tiny_model, tokenizer).generate([prompt], SamplingParams(0.0, 6))[0]
    ids = list(prompt)
    for _ in range(len(out.token_ids)):
        x = torch.tensor([ids])
        valid = torch.ones_like(x, dtype=torch.bool)
        ids.append(int(tiny_model(x, positions_from_valid(valid), padded_causal_mask(valid))[0, -1].argmax()))
    assert ids[len(prompt):] == out.token_ids


def test_continuous_batching_never_exceeds_slots_and_refills(tiny_model, tokenizer):
    eng = engine(tiny_model, tokenizer, max_num_seqs=3)
    budgets = [2, 9, 4, 7, 3, 5, 8]
    for i, b in enumerate(budgets):
        eng.add_request(tokenizer.encode(TEXTS[i % 4]), SamplingParams(1.0, b, ignore_eos=True, seed=i))
    done, admitted_while_running = {}, False
    while eng.has_unfinished():
        before = {r.id for r in eng.running}
        for c in eng.step():
            done[c.request_id] = c
        after = {r.id for r in eng.running}
        admitted_while_running |= bool(after - before) and bool(before & after)
        assert len(eng.running) <= 3
    assert admitted_while_running
    assert [len(done[i].token_ids) for i in range(len(budgets))] == budgets
    assert all(c.finish_reason == "length" for c in done.values())


def test_samples_of_one_prompt_share_one_prefill(tiny_model, tokenizer):
    computed = []
    forward = tiny_model.forward

    def spy(ids, *a, **kw):
        computed.append(ids.shape[1])  # tokens of one step's flat batch
        return forward(ids, *a, **kw)

    tiny_model.forward = spy
    prompts = [tokenizer.encode(t) for t in TEXTS[:3] for _ in range(5)]
    eng = engine(tiny_model, tokenizer)
    outs = eng.generate(prompts, SamplingParams(1.0, 8))
    distinct = sum(map(len, {tuple(p) for p in prompts}))
    # each distinct prompt is computed once; then one token per sample per step (its previous token)
    assert sum(computed) == distinct + sum(len(c.token_ids) - 1 for c in outs)
    stats = eng.stats()
    assert stats["prefix_miss_tokens"] == distinct and stats["prefix_hit_tokens"] == 4 * distinct
    assert len({tuple(c.token_ids) for c in outs}) > 3  # the samples still differ


def test_samples_share_the_prompt_blocks_and_copy_the_block_they_write(tiny_model, tokenizer):
    prompt = tokenizer.encode(TEXTS[2])
    assert len(prompt) % 4 != 0  # the prompt ends inside a block
    eng = engine(tiny_model, tokenizer, block_size=4)
    for i in range(3):
        eng.add_request(prompt, SamplingParams(1.0, 6, ignore_eos=True, seed=i))
    eng.step()  # one prefill, three rows sharing its blocks
    tables = [r.seq.blocks for r in eng.running]
    assert len(eng.running) == 3 and tables[0] == tables[1] == tables[2]
    full = len(prompt) // 4
    eng.step()  # each writes its first token into the shared partial block: two copies, one in place
    tables = [r.seq.blocks for r in eng.running]
    assert all(t[:full] == tables[0][:full] for t in tables)
    assert len({t[full] for t in tables}) == 3
    assert eng.stats()["kv_blocks_used"] == full + 3


def test_sampler_matches_the_distribution_and_filters():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    n = 20000
    rows = RowParams(torch.full((n,), 1.0), torch.zeros(n, dtype=torch.long), torch.ones(n),
                     torch.arange(n, dtype=torch.long))
    tok, lp = sample(logits.expand(n, -1), rows, torch.zeros(n, dtype=torch.long))
    freq = torch.bincount(tok, minlength=6).float() / n
    probs = torch.softmax(logits[0], -1)
    assert (freq - probs).abs().max() < 4 * math.sqrt(0.25 / n)  # 4 sigma
    torch.testing.assert_close(lp, probs.log()[tok])
    # top-k 2: only the two best tokens, renormalised; logprobs stay those of the full softmax
    rows.top_k[:] = 2
    tok, lp = sample(logits.expand(n, -1), rows, torch.zeros(n, dtype=torch.long))
    assert set(tok.tolist()) == {0, 1}
    assert abs((tok == 0).float().mean() - probs[0] / probs[:2].sum()) < 4 * math.sqrt(0.25 / n)
    torch.testing.assert_close(lp, probs.log()[tok])
    # top-p: the smallest set whose mass reaches p
    rows.top_k[:] = 0
    rows.top_p[:] = float(probs[0] + probs[1] / 2)
    tok, _ = sample(logits.expand(n, -1), rows, torch.zeros(n, dtype=torch.long))
    assert set(tok.tolist()) == {0, 1}


def test_top_k_one_is_greedy_and_seeds_reproduce(tiny_model, tokenizer):
    prompt = [tokenizer.encode(TEXTS[0])]
    eng = engine(tiny_model, tokenizer)
    greedy = eng.generate(prompt, SamplingParams(0.0, 10))[0].token_ids
    assert eng.generate(prompt, SamplingParams(1.0, 10, top_k=1, seed=3))[0].token_ids == greedy
    assert eng.generate(prompt, SamplingParams(1.0, 10, top_p=1e-6, seed=4))[0].token_ids == greedy
    a = eng.generate(prompt * 4, SamplingParams(1.0, 10, seed=9))
    assert len({tuple(c.token_ids) for c in a}) == 1  # same seed, same tokens
    b = engine(tiny_model, tokenizer, seed=1).generate(prompt * 4, SamplingParams(1.0, 10))
    c = engine(tiny_model, tokenizer, seed=1).generate(prompt * 4, SamplingParams(1.0, 10))
    assert [x.token_ids for x in b] == [x.token_ids for x in c]
    assert len({tuple(x.token_ids) for x in b}) > 1  # unseeded requests differ from each other


def test_a_request_draws_the_same_tokens_whatever_filters_its_batch_mates_use(tiny_model, tokenizer):
    prompt = tokenizer.encode(TEXTS[0])
    params = [SamplingParams(1.0, 12, seed=1), SamplingParams(1.0, 12, top_k=5, seed=2),
              SamplingParams(1.0, 12, top_p=0.8, seed=3), SamplingParams(0.0, 12)]
    eng = engine(tiny_model, tokenizer)
    alone = [eng.generate([prompt], [p])[0].token_ids for p in params]
    together = [c.token_ids for c in eng.generate([prompt] * 4, params)]
    assert together == alone


def test_latent_attention_caches_only_the_latent_and_rotary_key():
    cfg = make_config("deepseek_v3", vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                      qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                      num_experts_per_tok=2, n_group=1, topk_group=1, max_position_embeddings=64)
    # per token and layer: kv_lora_rank + rope dims, not heads x (nope + rope + v) = 4 x 40
    assert bytes_per_token(cfg, torch.bfloat16) == 2 * (16 + 8) * 2
    torch.manual_seed(0)
    eng = InferenceEngine(build_model(cfg, init=True, fused=True), eos_id=None, max_seq_len=64,
                          kv_cache_bytes=1 << 16)
    assert eng.kv_cache_bytes // bytes_per_token(cfg, torch.float32) == eng.num_blocks * eng.block_size
    out = eng.generate([[1, 2, 3, 4, 5]], SamplingParams(1.0, 8, seed=0))[0]
    assert eng.kv.v is None and eng.kv.k.shape[-1] == 24 and len(out.token_ids) == 8


@pytest.mark.parametrize("family", ["llama", "mistral", "deepseek_v3"])
def test_flex_and_paged_paths_give_the_torch_paths_results(family):
    """flex_attention over the pool through block masks (the GPU path, eager here) and the CPU decode kernel
    against the gathering path, with prefill chunks, decode rows, shared prompt blocks, a sliding window and MLA's
    latent cache."""
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
    if family == "mistral":
        kw["sliding_window"] = 5
    if family == "deepseek_v3":
        kw.update(num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4,
                  v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1)
    torch.manual_seed(0)
    model = build_model(make_config(family, **kw), init=True, fused=True)
    prompts = [[3, 4, 5, 6, 7, 8, 9, 10, 11], [3, 4, 5, 6, 7, 8, 9, 10, 11], [12, 13], [20, 21, 22, 23, 24, 25]]
    params = [SamplingParams(1.0, 14, ignore_eos=True, seed=i) for i in range(4)]
    outs = {}
    for backend in ("torch", "flex", "paged"):
        eng = InferenceEngine(model, eos_id=None, max_seq_len=32, kv_cache_bytes=1 << 16, block_size=4,
                              max_batch_tokens=8, attention=backend)
        outs[eng.attention] = eng.generate(prompts, params)  # paged is torch where the kernel cannot be built
    for other in ("flex", "paged"):
        for a, b in zip(outs["torch"], outs.get(other, outs["torch"]), strict=True):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def test_stop_reasons(tiny_model, tokenizer):
    prompt = tokenizer.encode(TEXTS[2])
    eng = engine(tiny_model, tokenizer)
    free = eng.generate([prompt], SamplingParams(1.0, 30, ignore_eos=True, seed=5))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 30 and free.stop_reason is None
    stop_tok = free.token_ids[6]
    first = free.token_ids.index(stop_tok)
    by_id = eng.generate([prompt], SamplingParams(1.0, 30, ignore_eos=True, seed=5, stop_token_ids=(stop_tok,)))[0]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == stop_tok
    assert by_id.token_ids == free.token_ids[: first + 1]
    text = tokenizer.decode(free.token_ids)
    needle = text[10:13]
    by_str = eng.generate([prompt], SamplingParams(1.0, 30, ignore_eos=True, seed=5, stop=needle))[0]
    assert by_str.finish_reason == "stop" and by_str.stop_reason == needle
    assert needle in tokenizer.decode(by_str.token_ids)
    assert needle not in tokenizer.decode(by_str.token_ids[:-1])
    eos = free.token_ids[4]  # an engine whose EOS is a token this sample draws stops there
    eos_eng = InferenceEngine(tiny_model, eos, tokenizer.pad_id)
    by_eos = eos_eng.generate([prompt], SamplingParams(1.0, 30, seed=5))[0]
    assert by_eos.finish_reason == "stop" and by_eos.stop_reason == eos
    assert by_eos.token_ids == free.token_ids[: free.token_ids.index(eos) + 1]


def test_pause_resume_continues_the_same_sample(tiny_model, tokenizer):
    prompts = [tokenizer.encode(t) for t in TEXTS]
    params = SamplingParams(1.0, 20, ignore_eos=True)
    ref = engine(tiny_model, tokenizer, seed=7).generate(prompts, params)
    eng = engine(tiny_model, tokenizer, seed=7, max_num_seqs=3)
    for p in prompts:
        eng.add_request(p, params)
    finished = []
    for _ in range(6):
        finished += eng.step()
    paused = eng.pause()
    assert not eng.has_unfinished() and len(paused) == 4 and all(c.finish_reason is None for c in paused)
    assert {len(c.token_ids) for c in paused} - {0, 1, 2, 3, 4, 5, 6}  == set()
    eng.resume(paused)
    while eng.has_unfinished():
        finished += eng.step()
    by_id = {c.request_id: c for c in finished}
    for i, r in enumerate(ref):
        assert by_id[i].token_ids == r.token_ids
        torch.testing.assert_close(by_id[i].logprobs, r.logprobs, atol=1e-5, rtol=0)


def test_resume_after_weight_update_recomputes_with_new_weights(tiny_model, tokenizer):
    prompt = tokenizer.encode(TEXTS[0])
    eng = engine(tiny_model, tokenizer, block_size=4)  # small blocks: the paused prefix is cached
    eng.add_request(prompt, SamplingParams(1.0, 12, ignore_eos=True, seed=2))
    for _ in range(5):
        eng.step()
    (paused,) = eng.pause()
    old_lp = trainer_logprobs(tiny_model, [prompt], [paused.token_ids], 1.0)[0]
    with torch.no_grad():  # an update lands in place, as the checkpoint engine does, and is declared
        for t in eng.named_tensors().values():
            t.mul_(1.05)
    eng.weights_loaded()
    eng.resume([paused])
    (done,) = [c for _ in range(20) for c in eng.step()]
    n = len(paused.token_ids)
    assert done.token_ids[:n] == paused.token_ids and len(done.token_ids) == 12
    torch.testing.assert_close(torch.tensor(done.logprobs[:n]), old_lp, atol=1e-5, rtol=0)
    new_lp = trainer_logprobs(tiny_model, [prompt], [done.token_ids], 1.0)[0]
    torch.testing.assert_close(torch.tensor(done.logprobs[n:]), new_lp[n:], atol=1e-5, rtol=0)


def test_resume_with_unchanged_weights_reuses_the_cached_prefix(tiny_model, tokenizer):
    prompts = [tokenizer.encode(t) for t in TEXTS]
    params = SamplingParams(1.0, 20, ignore_eos=True)
    ref = engine(tiny_model, tokenizer, seed=5).generate(prompts, params)
    eng = engine(tiny_model, tokenizer, seed=5, block_size=4)
    for p in prompts:
        eng.add_request(p, params)
    for _ in range(9):
        eng.step()
    paused = eng.pause()
    held = sum(len(c.prompt_ids) + len(c.token_ids) for c in paused)
    before = eng.stats()
    eng.resume(paused)
    done = {c.request_id: c for c in eng.step()}  # the whole resumed batch is admitted at once
    after = eng.stats()
    missed = after["prefix_miss_tokens"] - before["prefix_miss_tokens"]
    # only what is past each request's last full block is computed again (under one block each)
    assert after["prefix_hit_tokens"] - before["prefix_hit_tokens"] + missed == held
    assert missed < 4 * len(paused)
    while eng.has_unfinished():
        done.update({c.request_id: c for c in eng.step()})
    for i, r in enumerate(ref):
        assert done[i].token_ids == r.token_ids
        torch.testing.assert_close(done[i].logprobs, r.logprobs, atol=1e-5, rtol=0)
    # declared new weights drop every cached prefix
    eng.weights_loaded()
    hits = eng.stats()["prefix_hit_tokens"]
    eng.generate(prompts[:1], params)
    assert eng.stats()["prefix_hit_tokens"] == hits


def test_out_of_blocks_preempts_and_recomputes_the_same_tokens(tiny_model, tokenizer):
    prompts = [tokenizer.encode(t) for t in TEXTS] * 2
    params = [SamplingParams(1.0, 40, ignore_eos=True, seed=i) for i in range(len(prompts))]
    ref = engine(tiny_model, tokenizer).generate(prompts, params)
    per_token = tiny_model.config.num_hidden_layers * 2 * 2 * 8 * 4  # layers x (k, v) x kv heads x dim x float32
    eng = engine(tiny_model, tokenizer, block_size=4, max_seq_len=64, kv_cache_bytes=24 * 4 * per_token)
    outs = eng.generate(prompts, params)
    assert eng.stats()["preemptions"] > 0 and eng.stats()["kv_blocks"] == 24
    for a, b in zip(outs, ref, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def test_long_prompts_in_a_tight_cache_all_finish_with_the_same_tokens(tiny_model, tokenizer):
    """Admitted prefills always have their blocks, even when several wait for chunks of a small budget."""
    prompts = [tokenizer.encode(" ".join(TEXTS[i:] + TEXTS[:i])) for i in range(4)] * 2
    params = [SamplingParams(1.0, 24, ignore_eos=True, seed=i) for i in range(len(prompts))]
    ref = engine(tiny_model, tokenizer).generate(prompts, params)
    per_token = tiny_model.config.num_hidden_layers * 2 * 2 * 8 * 4
    eng = engine(tiny_model, tokenizer, block_size=4, max_seq_len=80, kv_cache_bytes=40 * 4 * per_token,
                 max_batch_tokens=12, max_num_seqs=6)
    outs = eng.generate(prompts, params)
    for a, b in zip(outs, ref, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def test_a_long_prompt_is_prefilled_in_chunks_while_others_decode(tiny_model, tokenizer):
    long_prompt = tokenizer.encode(" ".join(TEXTS * 2))
    short = [tokenizer.encode(t) for t in TEXTS[:3]]
    params = SamplingParams(1.0, 30, ignore_eos=True, seed=1)
    ref = engine(tiny_model, tokenizer).generate([long_prompt, *short], params)
    eng = engine(tiny_model, tokenizer, max_num_seqs=4, max_batch_tokens=8)
    for p in short:
        eng.add_request(p, params)
    while len(eng.running) < 3:
        eng.step()
    eng.add_request(long_prompt, params)
    steps = 0
    while len(eng.running) < 4:
        lengths = [len(r.tokens) for r in eng.running]
        eng.step()
        steps += 1
        assert [len(r.tokens) for r in eng.running[:3]] == [n + 1 for n in lengths]  # nobody stalls
    assert steps >= len(long_prompt) // 5  # at most 8 - 3 prompt tokens per step
    outs = {}
    while eng.has_unfinished():
        outs.update({c.request_id: c for c in eng.step()})
    got = [outs[3], outs[0], outs[1], outs[2]]
    for a, b in zip(got, ref, strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


def resident_bytes(address: int, nbytes: int) -> int:
    """Bytes of host memory in ``[address, address + nbytes)`` held now (pages marked present in pagemap)."""
    page = mmap.PAGESIZE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(address // page * 8)
        entries = f.read(-(-nbytes // page) * 8)
    return sum(page for (e,) in struct.iter_unpack("<Q", entries) if e >> 63)


def test_sleep_gives_memory_back_and_keeps_addresses(tiny_model, tokenizer):
    """Sleep returns the KV pool's memory (level 1) and the weights' (level 2) to the system while every
    address stays, so a CUDA graph captured before the sleep still points at the right tensors."""
    prompts = [tokenizer.encode(t) for t in TEXTS]
    params = SamplingParams(1.0, 10, seed=1)
    eng = engine(copy.deepcopy(tiny_model), tokenizer, kv_cache_bytes=32 << 20)
    ref = eng.generate(prompts, params)
    weights = {k: v.detach().clone() for k, v in eng.named_tensors().items()}
    where = {k: v.data_ptr() for k, v in eng.named_tensors().items()}
    pool = eng.kv.k.data_ptr()
    kv_at = (eng.memory.kv_arena.base, eng.memory.kv_arena.nbytes)
    w_at = (eng.memory.weight_arena.base, eng.memory.weight_arena.nbytes)
    eng.kv.k.fill_(1.0)  # every page of the keys in memory
    assert resident_bytes(*kv_at) >= eng.kv.k.nbytes and resident_bytes(*w_at) >= w_at[1] - mmap.PAGESIZE
    held = resident_bytes(*w_at)
    eng.sleep(1)
    assert eng.kv is None and eng.sleeping == 1
    assert resident_bytes(*kv_at) == 0 and resident_bytes(*w_at) == held  # a host engine's weights stay put
    with pytest.raises(RuntimeError, match="asleep"):
        eng.generate(prompts, params)
    eng.wake_up()
    assert [c.token_ids for c in eng.generate(prompts, params)] == [c.token_ids for c in ref]
    assert eng.kv.k.data_ptr() == pool and {k: v.data_ptr() for k, v in eng.named_tensors().items()} == where
    eng.sleep(2)
    assert resident_bytes(*w_at) == 0 and resident_bytes(*kv_at) == 0
    eng.wake_up()
    assert all(not t.any() for t in eng.named_tensors().values())  # discarded: zeros until loaded
    with pytest.raises(RuntimeError, match="load weights"):
        eng.generate(prompts, params)
    eng.load_weights(weights.items())
    assert [c.token_ids for c in eng.generate(prompts, params)] == [c.token_ids for c in ref]
    assert {k: v.data_ptr() for k, v in eng.named_tensors().items()} == where
    eng.add_request(prompts[0], params)
    with pytest.raises(RuntimeError, match="pause"):
        eng.sleep(1)


def test_sleep_after_weights_moved_out_of_the_arena_frees_them_as_before(tiny_model, tokenizer):
    """An update that swaps in other tensors (rollback "swap") leaves the arena to the receiver's spare:
    sleep then frees the tensors served with, one by one, and leaves the arena alone."""
    prompts = [tokenizer.encode(t) for t in TEXTS]
    params = SamplingParams(1.0, 10, seed=1)
    eng = engine(copy.deepcopy(tiny_model), tokenizer)
    ref = eng.generate(prompts, params)
    weights = {k: v.detach().clone() for k, v in eng.named_tensors().items()}
    for t in eng.named_tensors().values():
        t.data = t.data.clone()  # what WeightReceiver's swap commit does
    eng.sleep(2)
    assert all(t.numel() == 0 for t in eng.named_tensors().values())
    assert eng.memory.weight_arena.mapped  # the spare in the arena is the receiver's, not freed
    eng.wake_up()
    eng.load_weights(weights.items())
    assert [c.token_ids for c in eng.generate(prompts, params)] == [c.token_ids for c in ref]


def test_bad_requests_fail_alone(tiny_model, tokenizer):
    good = [tokenizer.encode(t) for t in TEXTS[:2]]
    params = SamplingParams(1.0, 16, seed=3)
    eng = engine(tiny_model, tokenizer, max_seq_len=64)
    ref = eng.generate(good, params)
    outs = eng.generate([good[0], [5] * 120, [5] * 60, [], [10**6], good[1]], params)
    assert [c.token_ids for c in (outs[0], outs[5])] == [c.token_ids for c in ref]
    errors = [c.error for c in outs[1:5]]
    assert all(c.finish_reason == "error" for c in outs[1:5])
    assert "exceeds the model's context of 128" in errors[0]
    assert "does not fit the KV cache" in errors[1]
    assert "empty" in errors[2] and "outside the vocabulary" in errors[3]
    for bad, msg in [(dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_k=-2), "top_k"),
                     (dict(max_tokens=0), "max_tokens"), (dict(stop=("",)), "stop")]:
        with pytest.raises(InvalidRequestError, match=msg):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="holds no sequence"):
        engine(tiny_model, tokenizer, kv_cache_bytes=1000)


def test_kv_budget_is_capped_to_a_fraction_of_free_device_memory(tiny_model, tokenizer):
    """The GPU RL benchmark on qwen3-0.6b asked for a slot cache of 512 x 2560 tokens (140 GiB, over an 80 GB
    H100's memory): capped at a fraction of what is free it fits, and a cap below one sequence is a one-line
    error. On the CPU the fraction changes nothing."""
    from benchmarks.rollout import MODELS
    from benchmarks.rollout_rl import KV_MEMORY_FRACTION, RL_LENGTHS

    cfg, (_, longest_prompt, longest_output) = MODELS["qwen3-0.6b"], RL_LENGTHS["qwen3-0.6b"]
    per_token = bytes_per_token(cfg, torch.bfloat16)
    assert per_token == 28 * 8 * (128 + 128) * 2 == 114_688
    asked = per_token * (longest_prompt + longest_output) * 64 * 8
    h100_free = 78 * 2**30  # an 80 GB H100 with the weights and the CUDA context in place
    assert asked > h100_free
    got = fit_kv_budget(asked, per_token * 2560, h100_free, KV_MEMORY_FRACTION, "cuda:0")
    assert got == int(h100_free * KV_MEMORY_FRACTION) and got + 20 * 2**30 < h100_free
    assert fit_kv_budget(2**20, 2**10, h100_free, 0.5, "cuda:0") == 2**20  # a budget that fits is kept
    with pytest.raises(ValueError, match=r"needs at least 280 MiB .* free on cuda:0") as err:
        fit_kv_budget(asked, per_token * 2560, 300 * 2**20, 0.5, "cuda:0")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="kv_memory_fraction"):
        fit_kv_budget(asked, 1, h100_free, 1.5, "cuda:0")
    budget = 64 * 16 * bytes_per_token(tiny_model.config, torch.float32)
    cpu = engine(tiny_model, tokenizer, kv_cache_bytes=budget, kv_memory_fraction=1e-9)
    assert cpu.kv_cache_bytes == budget


def test_rollout_benchmark_runs_both_generators():
    from benchmarks.rollout import measure

    rec = measure("demo", 2, 3, 8, 5)
    assert rec["engine_tok_s"] > 0 and rec["hf_generate_tok_s"] > 0
    assert rec["speedup"] == pytest.approx(rec["engine_tok_s"] / rec["hf_generate_tok_s"], rel=1e-2)
    assert rec["kv_cache_mib"] > 0 and rec["engine_peak_rss_mib_per_1k_tokens"] >= 0


def test_rl_workload_benchmark_generates_the_same_tokens_as_generate():
    from benchmarks.rollout import rl_records
    from benchmarks.rollout_rl import draw_workload

    prompts, lengths = draw_workload(40, 8, (16, 48), 64, 512)
    flat = sorted(n for ns in lengths for n in ns)
    assert {len(p) for p in prompts} != {16} and flat[len(flat) // 2] < 16 and flat[-1] > 40  # a long tail
    rec, ahead = rl_records("demo", 3, 4, decode_steps=(1, 4))
    assert rec["same_tokens"] == 1.0 and rec["sequences"] == 12
    assert rec["speedup"] == pytest.approx(rec["engine_tok_s"] / rec["hf_generate_tok_s"], rel=1e-2)
    # the K samples share each prompt's prefill: 3 of every 4 samples' prompt tokens are hits
    assert rec["prefix_hit_rate"] >= 0.74 and rec["kv_capacity_ratio"] > 1
    assert 0 < rec["roofline_fraction"] and rec["engine_steps"] == rec["host_reads"] > 0
    # multi-step: the same workload with up to 4 forwards a read (the peer and the eager run are the first's)
    assert ahead["decode_steps"] == 4 and ahead["tokens"] == rec["tokens"] and ahead["hf_generate_tok_s"] is None
    assert ahead["host_reads"] < ahead["engine_steps"] / 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_engine_matches_trainer_and_sleeps(tiny_model, tokenizer):
    cpu_model = copy.deepcopy(tiny_model)
    model = tiny_model.cuda()
    prompts = [tokenizer.encode(t) for t in TEXTS]
    eng = engine(model, tokenizer)
    outs = eng.generate(prompts, SamplingParams(1.0, 16, seed=1))
    ref = trainer_logprobs(cpu_model, prompts, [c.token_ids for c in outs], 1.0)
    for c, r in zip(outs, ref, strict=True):  # TF32 and kernel choice differ from CPU: looser tolerance
        torch.testing.assert_close(torch.tensor(c.logprobs), r, atol=1e-3, rtol=0)
    torch.cuda.synchronize()
    free = torch.cuda.mem_get_info()[0]
    eng.sleep(1)  # weights to host memory, pool and weights given back to the device
    assert torch.cuda.mem_get_info()[0] - free >= eng.memory.weight_arena.nbytes + eng.memory.kv_arena.nbytes
    eng.wake_up()
    assert [c.token_ids for c in eng.generate(prompts, SamplingParams(1.0, 16, seed=1))] == [c.token_ids for c in outs]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_decode_matches_eager_decode(tiny_model, tokenizer):
    """Graph replays give the eager step's tokens while the batch shrinks through several buckets, and
    are kept through sleep/wake (the pool and weights come back at the same addresses)."""
    model = copy.deepcopy(tiny_model).cuda()
    prompts = [tokenizer.encode(t) for t in TEXTS] * 3  # 12 sequences
    params = [SamplingParams(1.0, 4 + 3 * i, seed=i, ignore_eos=True) for i in range(len(prompts))]
    eager = engine(model, tokenizer, cuda_graphs=False)
    assert eager.runner.graphs is None
    want = eager.generate(prompts, params)
    graphed = engine(copy.deepcopy(model), tokenizer)
    got = graphed.generate(prompts, params)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4, rtol=0)
    first = graphed.runner.graphs.captures
    assert first >= 4  # 12 rows shrinking one by one: buckets 16, 8, 4, 2, 1
    assert graphed.stats()["cuda_graphs_fallback"] == 0 and graphed.stats()["cuda_graph_captures"] == first
    graphs = dict(graphed.runner.graphs.graphs)
    for level in (1, 2):
        weights = {k: v.clone() for k, v in graphed.named_tensors().items()}
        graphed.sleep(level)
        graphed.wake_up()
        if level == 2:
            graphed.load_weights(weights.items())
        assert [c.token_ids for c in graphed.generate(prompts, params)] == [c.token_ids for c in want]
        assert graphed.runner.graphs.captures == first
        assert all(graphed.runner.graphs.graphs[k][0] is g for k, (g, _) in graphs.items())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_padding_rows_never_write_into_live_blocks(tiny_model, tokenizer):
    """Rows past the batch in a graph's bucket hold finished requests' block tables; with a small pool those
    blocks go to new requests, which must still get the eager engine's tokens."""
    model = copy.deepcopy(tiny_model).cuda()
    prompts = [tokenizer.encode(t) for t in TEXTS] * 6
    params = [SamplingParams(1.0, 3 + (7 * i) % 23, seed=i, ignore_eos=True) for i in range(len(prompts))]
    small = dict(max_num_seqs=7, kv_cache_bytes=48 * 16 * bytes_per_token(model.config, torch.float32),
                 max_seq_len=64)
    want = engine(model, tokenizer, cuda_graphs=False, **small).generate(prompts, params)
    graphed = engine(copy.deepcopy(model), tokenizer, **small)
    got = graphed.generate(prompts, params)
    assert graphed.runner.graphs.captures > 0
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
