"""The training forward at scale: packed rows with document masks, log-probs scored in vocabulary chunks,
activation checkpointing, and the per-head max logit over valid (query, key) pairs only.

References are written from first principles: pairs enumerated by explicit loops over each sequence on
its own, logits from the weights in float64, log-probabilities from the full logits.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import TorchDispatchMode

import engines.model.logprobs
from engines.model.logprobs import selected_logprobs
from engines.model.native.attention import Attention, padded_causal_mask, positions_from_valid
from engines.model.native.causal_lm import CausalLM, track_max_logits
from engines.model.native.document_mask import DocumentMask
from engines.training.engine import TrainingEngine
from engines.training.packing import first_fit_rows, pack
from tests.conftest import tiny_config

VOCAB = 61
KINDS = {"mha": dict(num_attention_heads=3, num_key_value_heads=3, hidden_size=24),
         "gqa": dict(num_attention_heads=4, num_key_value_heads=2, hidden_size=32),
         "mqa": dict(num_attention_heads=4, num_key_value_heads=1, hidden_size=32),
         "window": dict(num_attention_heads=4, num_key_value_heads=2, hidden_size=32, model_type="mistral",
                        sliding_window=4)}


def _model(kind: str = "gqa", std: float = 0.5, layers: int = 2, **kw) -> CausalLM:
    torch.manual_seed(1)
    model = CausalLM(tiny_config(VOCAB, intermediate_size=40, num_hidden_layers=layers, **{**KINDS[kind], **kw}))
    with torch.no_grad():  # weights large enough that attention logits spread over tens
        for p in model.parameters():
            if p.ndim == 2:
                p.normal_(0, std)
    return model


def _sequences(n: int = 7, seed: int = 3) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 9))] for _ in range(n)]
    responses = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 8))] for _ in range(n)]
    return prompts, responses


# ---------------------------------------------------------------------------------------- packing
def test_pack_lays_out_each_sequence_once_with_its_own_positions_and_targets():
    prompts, responses = _sequences()
    batch = pack(prompts, responses, pad_id=0)
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses, strict=True)]
    assert batch.ids.shape[1] == max(lengths) and batch.ids.shape[0] < len(prompts)  # rows share sequences
    assert batch.tokens == sum(lengths)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        where = (batch.mask.doc == i).nonzero()
        row = int(where[0, 0])
        assert (where[:, 0] == row).all() and len(where) == lengths[i]
        cols = where[:, 1]
        assert cols.tolist() == list(range(int(cols[0]), int(cols[0]) + lengths[i]))  # contiguous
        assert batch.ids[row, cols].tolist() == p + r
        assert batch.positions[row, cols].tolist() == list(range(lengths[i]))  # RoPE restarts per sequence
        # the logits at prompt end .. second-to-last token predict the response
        assert batch.targets[row, cols].tolist() == [-1] * (len(p) - 1) + r + [-1]
    assert (batch.ids[batch.mask.doc < 0] == 0).all()
    assert first_fit_rows([5, 3, 3, 2, 1], 6) == [[0, 4], [1, 2], [3]]
    with pytest.raises(ValueError, match="does not fit"):
        first_fit_rows([7], 6)


def _allowed_by_loops(doc: torch.Tensor, window: int | None) -> torch.Tensor:
    rows, width = doc.shape
    out = torch.zeros(rows, width, width, dtype=torch.bool)
    for r in range(rows):
        for q in range(width):
            for k in range(q + 1):
                if doc[r, q] >= 0 and doc[r, k] == doc[r, q] and (window is None or q - k < window):
                    out[r, q, k] = True
    return out


@pytest.mark.parametrize("window", [None, 3])
def test_document_mask_allows_exactly_the_pairs_of_one_document(window):
    prompts, responses = _sequences(5)
    for backend in ("sdpa", "flex"):
        mask = pack(prompts, responses, 0, backend).mask.with_window(window)
        want = _allowed_by_loops(mask.doc, window)
        filler = ~mask.query_valid
        dense = mask.dense()[:, 0]
        assert torch.equal(dense & ~torch.diag_embed(filler), want)  # filler keeps only its own diagonal
        if backend == "flex":  # its block mask's rule gives the same pairs (filler: none at all)
            from torch.nn.attention.flex_attention import create_mask

            r, w = mask.doc.shape
            assert torch.equal(create_mask(mask.block_mask().mask_mod, r, 1, w, w)[:, 0], want)


def test_flex_layout_scores_like_the_dense_path_with_sliding_windows():
    """The GPU layout (one wide row per micro-batch, flex_attention block masks) against the CPU one; flex runs
    here without gradients, so this compares log-probabilities only (the CUDA test below does the rest)."""
    model = _model("window")
    prompts, responses = _sequences()
    engine = TrainingEngine(model, [], 0, attention="sdpa")
    with torch.no_grad():
        dense = engine.score(prompts, responses, 0.8)
        engine.attention = "flex"
        flex = engine.score(prompts, responses, 0.8)
    assert pack(prompts, responses, 0, "flex").ids.shape[0] == 1
    torch.testing.assert_close(flex.logprobs, dense.logprobs, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------- chunked log-probs
@pytest.mark.parametrize("chunk", [7, 64, VOCAB * 4])
def test_chunked_logprobs_equal_full_logits_values_and_gradients(chunk):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, 16, generator=g, requires_grad=True)
    weight = (torch.randn(VOCAB * 4, 16, generator=g) * 0.7).requires_grad_()
    targets = torch.randint(0, VOCAB * 4, (40,), generator=g)
    inv = 1.0 / torch.tensor([0.5, 1.0, 1.7, 1.0] * 10)
    upstream = torch.randn(40, generator=g)
    logp, ent = selected_logprobs(hidden, weight, targets, inv, chunk=chunk)
    (logp * upstream).sum().backward()
    got = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    full = F.log_softmax((hidden @ weight.T).float() * inv[:, None], dim=-1)
    ref = full.gather(-1, targets[:, None]).squeeze(-1)
    (ref * upstream).sum().backward()
    torch.testing.assert_close(logp, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, -(full.exp() * full).sum(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[0], hidden.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], weight.grad, atol=1e-5, rtol=1e-5)
    assert not ent.requires_grad


class _LargestTensor(TorchDispatchMode):
    """Records the element count of the largest tensor any operation produces (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_training_pass_never_holds_tokens_times_vocabulary(monkeypatch):
    """A micro-batch of 1.6k response tokens and a 4k vocabulary: no tensor of the chunked forward/backward comes
    near tokens × vocabulary elements, while the full-logits computation of the same numbers makes one."""
    monkeypatch.setattr(engines.model.logprobs, "CHUNK_ELEMENTS", 1 << 18)
    vocab = 4096
    torch.manual_seed(0)
    model = CausalLM(tiny_config(vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1))
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(4)] for _ in range(100)]
    responses = [[rng.randrange(vocab) for _ in range(16)] for _ in range(100)]
    n_targets = sum(map(len, responses))
    engine = TrainingEngine(model, [], 0)
    with _LargestTensor() as chunked:
        engine.score(prompts, responses, 1.0).logprobs.sum().backward()
    batch = pack(prompts, responses, 0)
    with _LargestTensor() as full:
        logits = model(batch.ids, batch.positions, batch.mask)
        F.log_softmax(logits.float(), -1).amax(-1).sum().backward()
    assert full.largest >= n_targets * vocab  # the detector sees the logits when they exist
    # the largest is one [tokens, chunk] block of logits; weight gradients [vocab, hidden] are smaller here
    assert chunked.largest == n_targets * engines.model.logprobs.vocab_chunk(n_targets, vocab) < n_targets * vocab / 8


# ------------------------------------------------------------------------------ activation checkpointing
@pytest.mark.parametrize("kind", ["gqa", "window"])
def test_activation_checkpointing_gives_identical_gradients_and_maxima(kind):
    prompts, responses = _sequences()
    results = []
    for checkpointing in (False, True):
        model = _model(kind)
        model.activation_checkpointing = checkpointing
        track_max_logits(model)
        engine = TrainingEngine(model, [], 0)
        scores = engine.score(prompts, responses, [0.7, 1.0, 1.2, 1.0, 1.0, 0.9, 1.0])
        (scores.logprobs.sum() + 0.1 * (scores.logprobs ** 2).sum()).backward()
        results.append(({n: p.grad.clone() for n, p in model.named_parameters()},
                        [a.max_logits.clone() for a in model.modules() if isinstance(a, Attention)], scores.logprobs))
    (g0, m0, l0), (g1, m1, l1) = results
    assert torch.equal(l0.detach(), l1.detach())
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n
    for a, b in zip(m0, m1, strict=True):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------ exact S_max
def _rope(x: torch.Tensor, position: int, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    ang = position / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    x1, x2 = x[: d // 2], x[d // 2:]
    return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()])


@torch.no_grad()
def reference_max_logits(model: CausalLM, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Per layer and head, the max of q_i·k_j/√d over every valid pair of every sequence — j ≤ i, and i − j <
    window for sliding-window layers — enumerated by loops, each sequence run on its own (no packing, no
    padding), q and k from the weights in float64 with RoPE written out."""
    cfg = model.config
    d, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    best = torch.full((len(layers), nh), -math.inf, dtype=torch.float64)
    inputs: list[torch.Tensor] = []
    for seq in sequences:
        inputs.clear()
        hooks = [a.register_forward_hook(lambda m, args, out: inputs.append(args[0][0])) for a in layers]
        n = len(seq)
        model(torch.tensor([seq]), torch.arange(n)[None], torch.ones(n, n, dtype=torch.bool).tril()[None, None])
        [h.remove() for h in hooks]
        for li, (x, attn) in enumerate(zip(inputs, layers, strict=True)):
            q = x.double() @ attn.q_proj.weight.double().T
            k = x.double() @ attn.k_proj.weight.double().T
            for h in range(nh):
                kv = h // (nh // nkv)
                for i in range(n):
                    qi = _rope(q[i, h * d:(h + 1) * d], i, cfg.rope_theta)
                    for j in range(i + 1):
                        if attn.window is not None and i - j >= attn.window:
                            continue
                        kj = _rope(k[j, kv * d:(kv + 1) * d], j, cfg.rope_theta)
                        best[li, h] = max(best[li, h], float(qi @ kj) / math.sqrt(d))
    return [row.float() for row in best]


@pytest.mark.parametrize("kind", list(KINDS))
def test_tracked_max_logit_is_the_max_over_valid_pairs_only(kind):
    """The trainer's packed forward (rows shared by several sequences, filler at row ends) tracks exactly the
    max over valid pairs; a right-padded forward whose padding queries count — what the trainer did before —
    reports more than that for some head, so this comparison would catch it."""
    model = _model(kind)
    prompts, responses = _sequences(seed=4)  # padding queries reach 0.16 to 3.7 above the true max here
    seqs = [p + r for p, r in zip(prompts, responses, strict=True)]
    want = reference_max_logits(model, seqs)
    track_max_logits(model)
    engine = TrainingEngine(model, [], 0)
    with torch.no_grad():
        engine.score(prompts, responses, 1.0)
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    for attn, ref in zip(layers, want, strict=True):
        torch.testing.assert_close(attn.max_logits, ref, atol=1e-4, rtol=1e-5)
    # the old padded layout: padding queries attend every valid key before them, and counted
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    valid = torch.arange(width)[None] < torch.tensor([len(s) for s in seqs])[:, None]
    for attn in layers:
        attn.max_logits = None
    with torch.no_grad():
        model(ids, positions_from_valid(valid), padded_causal_mask(valid))
    assert any((a.max_logits > ref + 1e-3).any() for a, ref in zip(layers, want, strict=True))
    # the same padded batch through the training path's mask counts no padding query
    for attn in layers:
        attn.max_logits = None
    with torch.no_grad():
        model(ids, positions_from_valid(valid), DocumentMask.from_padded(valid))
    for attn, ref in zip(layers, want, strict=True):
        torch.testing.assert_close(attn.max_logits, ref, atol=1e-4, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (flex_attention's fused kernel)")
def test_cuda_flex_path_matches_the_dense_path_with_gradients_and_maxima():
    """On the GPU the flex kernel returns the row maxima with the output: same maxima, log-probs and gradients
    as the dense path."""
    prompts, responses = _sequences(12)
    out = []
    for backend in ("sdpa", "flex"):
        model = _model("window", head_dim=16).cuda()  # flex's kernel takes no head dimension below 16
        track_max_logits(model)
        engine = TrainingEngine(model, [], 0, attention=backend)
        scores = engine.score(prompts, responses, 1.0)
        scores.logprobs.sum().backward()
        assert engine.attention_fallback == 0  # the compiled kernel ran, not the dense fallback
        out.append((scores.logprobs.detach(), {n: p.grad for n, p in model.named_parameters()},
                    [a.max_logits for a in model.modules() if isinstance(a, Attention)]))
    (l0, g0, m0), (l1, g1, m1) = out
    torch.testing.assert_close(l1, l0, atol=1e-4, rtol=1e-4)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], atol=1e-4, rtol=1e-3, msg=n)
    for a, b in zip(m0, m1, strict=True):
        torch.testing.assert_close(b, a, atol=1e-3, rtol=1e-4)
