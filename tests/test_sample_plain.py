"""``sampling.sample_plain``, the sampler a decode graph captures after the forward, checked against
``sampling.sample``, which samples every step that no graph replays: for rows without top-k, top-p or a grammar both
must give the same tokens and log-probs bit for bit, from the same counter-based draws, whatever the logits' dtype,
the temperatures (greedy included), the seeds and the counters, and a row's draw must not depend on the rows around
it (a graph samples its padding rows too)."""

import pytest
import torch

from engines.inference.sampling import RowParams, sample, sample_plain

N = 33


def batch(vocab, scale, dtype, seed=0):
    """Logits [N, vocab] (some entries -inf), per-row temperatures (greedy, tiny, plain, hot), seeds over the
    whole range and counters small and large."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, vocab, generator=g) * scale
    logits[::4, ::3] = float("-inf")  # column 1 stays finite: every row has mass
    temps = torch.tensor([0.0, 0.05, 1.0, 2.5, 0.7, 1.3])[torch.randint(0, 6, (N,), generator=g)]
    seeds = torch.randint(0, 2**63 - 1, (N,), generator=g)
    seeds[:2] = torch.tensor([0, 2**63 - 1])
    counters = torch.randint(0, 2**31, (N,), generator=g)
    counters[::3] = torch.arange(0, N, 3)
    return logits.to(dtype), temps, seeds, counters


def reference(logits, temps, seeds, counters):
    n = len(temps)
    rows = RowParams(temps, torch.zeros(n, dtype=torch.long), torch.ones(n), seeds)
    return sample(logits, rows, counters, [0] * n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab,scale", [(2, 1.0), (64, 0.3), (64, 8.0), (3001, 3.0), (3001, 60.0)])
def test_sample_plain_draws_the_tokens_and_logprobs_of_sample(dtype, vocab, scale):
    """Flat and peaked distributions (at scale 60 most probabilities underflow to 0, so the CDF has flat runs the
    draw must step over as ``sample``'s binary search does)."""
    for seed in range(3):
        logits, temps, seeds, counters = batch(vocab, scale, dtype, seed)
        tokens, logprobs = sample_plain(logits, temps, seeds, counters)
        want = reference(logits, temps, seeds, counters)
        assert tokens.dtype == want[0].dtype and logprobs.dtype == want[1].dtype == torch.float32
        assert torch.equal(tokens, want[0]) and torch.equal(logprobs, want[1])
        assert (logprobs > float("-inf")).all()  # never a token without mass


def test_greedy_rows_take_the_argmax_and_the_rest_follow_their_counters():
    logits, temps, seeds, counters = batch(500, 2.0, torch.float32)
    temps[:5] = 0.0
    tokens, logprobs = sample_plain(logits, temps, seeds, counters)
    assert torch.equal(tokens[:5], logits[:5].argmax(-1))
    torch.testing.assert_close(logprobs[:5], torch.log_softmax(logits[:5], -1).max(-1).values)
    moved = sample_plain(logits, temps, seeds, counters + 1)[0]
    assert torch.equal(moved[:5], tokens[:5]) and not torch.equal(moved[5:], tokens[5:])


def test_a_rows_draw_is_the_same_alone_and_beside_padding_rows():
    """What lets a graph sample a padded batch: each live row draws as it would alone, whatever the padding rows
    (stale logits, greedy or hot, any seed) hold."""
    logits, temps, seeds, counters = batch(700, 4.0, torch.bfloat16)
    full = sample_plain(logits, temps, seeds, counters)
    pad, ptemps, pseeds, pcounters = batch(700, 9.0, torch.bfloat16, seed=5)
    padded = sample_plain(torch.cat((logits, pad[:7])), torch.cat((temps, ptemps[:7])),
                          torch.cat((seeds, pseeds[:7])), torch.cat((counters, pcounters[:7])))
    assert torch.equal(padded[0][:N], full[0]) and torch.equal(padded[1][:N], full[1])
    for i in (0, 1, 17, N - 1):
        alone = sample_plain(logits[i:i + 1], temps[i:i + 1], seeds[i:i + 1], counters[i:i + 1])
        assert torch.equal(alone[0], full[0][i:i + 1]) and torch.equal(alone[1], full[1][i:i + 1])


def test_sample_plain_leaves_its_inputs_alone():
    """It exponentiates and sums in place, on its own buffers only: float32 logits (which ``float()`` does not copy)
    come back unchanged."""
    logits, temps, seeds, counters = batch(300, 2.0, torch.float32)
    before = [t.clone() for t in (logits, temps, seeds, counters)]
    sample_plain(logits, temps, seeds, counters)
    assert all(torch.equal(a, b) for a, b in zip(before, (logits, temps, seeds, counters), strict=True))
