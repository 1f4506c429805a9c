"""The CPU decode-attention kernel (attention "paged"): equal to attention computed per sequence from its own
keys, for every layout the engines cache (GQA, MHA, MLA's latent values, sliding windows, bf16, large blocks),
chosen by "auto" on a CPU, and replaced by the torch path with one warning where it cannot be built."""

import logging
import math

import pytest
import torch

from engines.inference import cpu_kernel
from engines.inference.kv_cache import decode_attention
from engines.inference.native import InferenceEngine
from engines.inference.sampling import SamplingParams
from rl.config import parse_config
from rl.errors import UserError

needs_kernel = pytest.mark.skipif(not cpu_kernel.available(), reason="the CPU kernel could not be built here")


def by_sequence(q, keys, values, table, positions, block_size, scale, window):
    """The reference: each sequence's keys laid out in order from its table, one softmax in float64."""
    s, h, _ = q.shape
    group = h // keys.shape[0]
    out = torch.empty(s, h, values.shape[-1], dtype=torch.float64)
    for i in range(s):
        n = int(positions[i]) + 1
        rows = torch.tensor([int(table[i, t // block_size]) * block_size + t % block_size for t in range(n)])
        lo = max(0, n - window) if window else 0
        k = keys[:, rows[lo:]].double().repeat_interleave(group, 0)  # [H, n, D]
        v = values[:, rows[lo:]].double().repeat_interleave(group, 0)
        p = torch.softmax(torch.einsum("hd,hnd->hn", q[i].double() * scale, k), dim=-1)
        out[i] = torch.einsum("hn,hnd->hd", p, v)
    return out


def pool_case(seed, seqs, heads, kv_heads, dim, block_size, longest, dtype, value_dim=None):
    """A random pool of shuffled blocks, each sequence holding its own, and a query per sequence."""
    g = torch.Generator().manual_seed(seed)
    blocks_per = -(-longest // block_size)
    num_blocks = seqs * blocks_per + 3
    keys = torch.randn(kv_heads, num_blocks * block_size, dim, generator=g).to(dtype)
    values = keys[..., :value_dim] if value_dim else torch.randn(kv_heads, num_blocks * block_size, dim,
                                                                  generator=g).to(dtype)
    table = torch.randperm(num_blocks, generator=g)[: seqs * blocks_per].view(seqs, blocks_per)
    positions = torch.randint(0, longest, (seqs,), generator=g)
    positions[0], positions[-1] = 0, longest - 1  # a first token alone, and a sequence filling its last block
    q = torch.randn(seqs, heads, dim, generator=g).to(dtype)
    return q, keys, values, table, positions


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,dim,value_dim,block_size,window", [
    (4, 2, 32, None, 16, None),    # grouped-query attention, the quick-start model's shape
    (3, 3, 8, None, 16, None),     # multi-head, a tiny head
    (4, 1, 24, 16, 16, None),      # MLA: one latent "head" whose first dimensions are the values
    (4, 2, 16, None, 16, 21),      # a sliding window that starts mid-block
    (2, 1, 16, None, 128, None),   # flex-sized blocks
])
def test_kernel_equals_attention_per_sequence(heads, kv_heads, dim, value_dim, block_size, window):
    q, keys, values, table, positions = pool_case(0, 37, heads, kv_heads, dim, block_size, 150, torch.float32,
                                                  value_dim)
    scale = 1 / math.sqrt(dim)
    got = cpu_kernel.paged_decode(q, keys, values, table, positions, block_size, scale, window)
    want = by_sequence(q, keys, values, table, positions, block_size, scale, window)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("latent", [False, True])
def test_kernel_writes_each_sequences_new_key_and_value_before_attending(latent):
    """The engine hands the step's keys/values to the kernel: each lands at its sequence's position, nowhere else,
    and the attention sees it (MLA: the latent row is the key, its first dimensions the value)."""
    q, keys, values, table, positions = pool_case(2, 9, 4, 2, 16, 16, 70, torch.float32, 8 if latent else None)
    g = torch.Generator().manual_seed(3)
    new_k = torch.randn(2, 9, 16, generator=g).transpose(0, 1)  # [S, KVH, D], strided as the engine's are
    new_v = None if latent else torch.randn(2, 9, 16, generator=g).transpose(0, 1)
    before_k, before_v = keys.clone(), values.clone()
    got = cpu_kernel.paged_decode(q, keys, values, table, positions, 16, 0.25, None, new_k, new_v)
    rows = table.gather(1, positions[:, None] // 16)[:, 0] * 16 + positions % 16
    want_k = before_k.clone()
    want_k[:, rows] = new_k.transpose(0, 1)
    assert torch.equal(keys, want_k)
    if not latent:
        want_v = before_v.clone()
        want_v[:, rows] = new_v.transpose(0, 1)
        assert torch.equal(values, want_v)
    want = by_sequence(q, want_k, want_k[..., :8] if latent else want_v, table, positions, 16, 0.25, None)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=1e-5)


@needs_kernel
def test_kernel_in_bfloat16_rounds_like_its_inputs():
    q, keys, values, table, positions = pool_case(1, 16, 4, 2, 32, 16, 90, torch.bfloat16)
    got = cpu_kernel.paged_decode(q, keys, values, table, positions, 16, 32 ** -0.5, None)
    want = by_sequence(q, keys, values, table, positions, 16, 32 ** -0.5, None)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, atol=1e-2, rtol=1e-2)  # bf16's 8 mantissa bits


@needs_kernel
def test_loading_the_kernel_leaves_float_denormals_alone():
    """Its -ffast-math is a compile flag only: linked in, it would switch the whole process to flush-to-zero."""
    assert cpu_kernel.available()
    assert (torch.tensor([1e-39]) / 10).item() != 0.0


@needs_kernel
def test_engine_decodes_the_same_through_the_kernel_and_the_gather(tiny_model, tokenizer):
    prompts = [tokenizer.encode(t) for t in ("Question: Mia has 3 apples.", "Q", "Answer: 1+2=3, 3*2=6. The")]
    runs = {}
    for attention in ("paged", "torch"):
        eng = InferenceEngine(tiny_model, tokenizer.eos_id, tokenizer.pad_id, attention=attention)
        assert eng.attention == attention
        greedy = eng.generate(prompts, SamplingParams(0.0, 20))
        sampled = eng.generate(prompts * 2, SamplingParams(1.0, 20, seed=5))
        runs[attention] = greedy + sampled
    for a, b in zip(runs["paged"], runs["torch"], strict=True):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_auto_is_the_kernel_on_a_cpu_and_torch_without_it(monkeypatch, caplog):
    cpu = torch.device("cpu")
    assert decode_attention("auto", cpu) == ("paged" if cpu_kernel.available() else "torch")
    assert decode_attention("flex", cpu) == "flex"
    with pytest.raises(ValueError, match="CPU decode kernel"):
        decode_attention("paged", torch.device("cuda", 0))
    with pytest.raises(ValueError, match="attention must be"):
        decode_attention("gather", cpu)
    # a machine without a compiler: one warning, and the engines gather instead
    import torch.utils.cpp_extension as ext

    def no_compiler(*a, **k):
        raise RuntimeError("Error building extension 'colocated_rl_paged_decode_avx512': c++: not found")

    cpu_kernel._module.cache_clear()
    monkeypatch.setattr(ext, "load", no_compiler)
    try:
        with caplog.at_level(logging.WARNING, logger="engines.inference.cpu_kernel"):
            assert decode_attention("auto", cpu) == "torch" and decode_attention("paged", cpu) == "torch"
        warnings = [r for r in caplog.records if "could not be built" in r.getMessage()]
        assert len(warnings) == 1 and "c++: not found" in warnings[0].getMessage()
        with pytest.raises(RuntimeError, match="not available"):
            cpu_kernel.paged_decode(*pool_case(0, 2, 2, 1, 8, 16, 20, torch.float32), 16, 1.0, None)
    finally:
        cpu_kernel._module.cache_clear()


def test_config_refuses_the_cpu_kernel_on_gpus():
    with pytest.raises(UserError, match="paged is the CPU decode kernel"):
        parse_config({"cluster": {"workers": 1, "gpus_per_worker": 1}, "rollout": {"attention": "paged"}})
    assert parse_config({}).rollout.attention == "auto"
