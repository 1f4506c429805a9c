"""The K1.5 loss and its gradient against an independent computation, and learning on a toy reward."""

import random
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from engines.inference import InferenceEngine, SamplingParams
from engines.model import padded_causal_mask, positions_from_valid
from engines.training import TrainingEngine
from rl.algorithm import PtxBatch, Sample, group_advantages, k15_backward, micro_batches, ptx_backward, rl_update
from rl.optim import build_optimizers


def _reference_loss(model, samples, tau):
    """Straight from DESIGN.md: mean over prompts of 1/K Σ_i (r_i − r̄ − τ log(π_θ/π_old))²,
    with log π_θ computed one sequence at a time, without padding, at its sampling temperature."""
    groups = {}
    for s in samples:
        groups.setdefault(s.group, []).append(s)
    per_prompt = []
    for members in groups.values():
        mean_r = sum(s.reward for s in members) / len(members)
        terms = []
        for s in members:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            valid = torch.ones_like(ids, dtype=torch.bool)
            logits = model(ids, positions_from_valid(valid), padded_causal_mask(valid))[0]
            logp = F.log_softmax(logits.float() / s.temperature, dim=-1)
            mask = s.loss_mask or [1] * len(s.response_ids)  # multi-turn: only the model's own tokens count
            new = sum(logp[len(s.prompt_ids) - 1 + t, tok] for t, tok in enumerate(s.response_ids) if mask[t])
            ratio = new - sum(lp for lp, m in zip(s.old_logprobs, mask, strict=True) if m)
            terms.append((s.reward - mean_r - tau * ratio) ** 2)
        per_prompt.append(sum(terms) / len(terms))
    return sum(per_prompt) / len(per_prompt)


def _random_samples(rng, vocab, n_groups=3, k=4, masked=False):
    samples = []
    for g in range(n_groups):
        prompt = [rng.randrange(2, vocab) for _ in range(rng.randint(2, 6))]
        for _ in range(k - (g == 1)):  # one group with K-1 samples: weights must still be per prompt
            resp = [rng.randrange(2, vocab) for _ in range(rng.randint(1, 5))]
            mask = [1] + [int(rng.random() < 0.6) for _ in resp[1:]] if masked else None
            samples.append(Sample(g, prompt, resp, [rng.uniform(-3, -0.1) for _ in resp], float(rng.random() < 0.5),
                                  temperature=rng.choice([0.7, 1.0, 1.3]), loss_mask=mask))
    return samples


@pytest.mark.parametrize("masked", [False, True], ids=["single-turn", "multi-turn-loss-mask"])
def test_k15_loss_and_gradient_match_reference(tiny_model, tokenizer, masked):
    rng = random.Random(0)
    samples = _random_samples(rng, tokenizer.vocab_size, masked=masked)
    if masked:  # environment tokens are context only: their sampler logprobs must not matter
        assert any(0 in s.loss_mask for s in samples)
        samples = [replace(s, old_logprobs=[lp if m else 123.0
                                            for lp, m in zip(s.old_logprobs, s.loss_mask, strict=True)])
                   for s in samples]
    tau = 0.3

    tiny_model.zero_grad()
    ref = _reference_loss(tiny_model, samples, tau)
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in tiny_model.named_parameters()}

    tiny_model.zero_grad()
    engine = TrainingEngine(tiny_model, [], tokenizer.pad_id)
    adv = group_advantages(samples)
    sizes = {g: sum(s.group == g for s in samples) for g in {s.group for s in samples}}
    weights = [1.0 / (sizes[s.group] * len(sizes)) for s in samples]
    loss = k15_backward(engine, samples, adv, weights, tau=tau, micro_batch=3)

    assert abs(loss - ref.item()) < 1e-5 * max(1.0, abs(ref.item()))
    for n, p in tiny_model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n], atol=1e-5, rtol=1e-4, msg=n)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_k15_update_on_cuda_matches_cpu(tiny_model, tokenizer):
    """Samples come from the rollout side as Python lists; the loss must build its tensors on the
    model's device (it once mixed a CUDA log-ratio with CPU sampler logprobs)."""
    import copy

    samples = _random_samples(random.Random(1), tokenizer.vocab_size, masked=True)
    losses = {}
    for device in ("cpu", "cuda"):
        model = copy.deepcopy(tiny_model).to(device)
        engine = TrainingEngine(model, [], tokenizer.pad_id)
        adv = group_advantages(samples)
        weights = [1.0 / len(samples)] * len(samples)
        losses[device] = k15_backward(engine, samples, adv, weights, tau=0.3, micro_batch=4)
        assert all(p.grad is not None and p.grad.device.type == device for p in model.parameters())
    assert losses["cuda"] == pytest.approx(losses["cpu"], rel=1e-3)


def test_gradient_does_not_depend_on_micro_batch_or_rank_split(tiny_model, tokenizer):
    """Each rank's share, summed over ranks (what FSDP's reduce-scatter does), equals one process."""
    samples = _random_samples(random.Random(1), tokenizer.vocab_size)
    adv, weights = group_advantages(samples), [1 / len(samples)] * len(samples)
    engine = TrainingEngine(tiny_model, [], tokenizer.pad_id)
    grads = []
    for mb, world in ((1, 1), (5, 1), (len(samples), 1), (2, 2), (3, 3)):
        tiny_model.zero_grad()
        for rank in range(world):
            k15_backward(engine, samples, adv, weights, tau=1.0, micro_batch=mb, rank=rank, world=world)
        grads.append([p.grad.clone() for p in tiny_model.parameters()])
    for other in grads[1:]:
        for a, b in zip(grads[0], other, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_advantage_is_reward_minus_group_mean():
    s = [Sample(0, [1], [2], [0.0], r) for r in (1.0, 0.0, 0.0, 1.0)] + [Sample(1, [1], [2], [0.0], 1.0)]
    assert group_advantages(s) == [0.5, -0.5, -0.5, 0.5, 0.0]


def test_optimizers_split_muon_and_adamw(tiny_model):
    muon, adamw = build_optimizers(tiny_model, "muon", 1e-3, 0.0)
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    muon_ids = {id(p) for g in muon.param_groups for p in g["params"]}
    names = {n for n, p in tiny_model.named_parameters() if id(p) in muon_ids}
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert "model.layers.1.mlp.down_proj.weight" in names
    assert not any("embed" in n or "lm_head" in n or "norm" in n for n in names)


def test_rl_update_raises_reward_on_a_toy_task(tiny_model, tokenizer):
    """Reward 1 when the first response token is even: a few K1.5 updates must raise it."""
    torch.manual_seed(0)
    engine = TrainingEngine(tiny_model, build_optimizers(tiny_model, "muon", 2e-2, 0.0), tokenizer.pad_id)
    prompts = [tokenizer.encode(f"Question: {i}") for i in range(8)]
    rates = []
    for it in range(12):
        inf = InferenceEngine(tiny_model, tokenizer.eos_id, tokenizer.pad_id, seed=it)
        outs = inf.generate([p for p in prompts for _ in range(8)], SamplingParams(1.0, 3))
        samples = [Sample(j // 8, o.prompt_ids, o.token_ids, o.logprobs, float(o.token_ids[0] % 2 == 0))
                   for j, o in enumerate(outs)]
        rates.append(sum(s.reward for s in samples) / len(samples))
        tiny_model.train().requires_grad_(True)
        list(rl_update(engine, samples, tau=1.0, minibatches=2, micro_batch=64, seed=it))
    assert sum(rates[-3:]) / 3 > sum(rates[:3]) / 3 + 0.25, rates


def test_micro_batches_pad_every_rank_to_the_same_pass_count():
    for n, mb, world in ((10, 3, 2), (7, 2, 3), (1, 4, 2), (0, 2, 2), (9, 9, 4)):
        shares = [micro_batches(n, mb, r, world) for r in range(world)]
        assert len({p for _, p in shares}) == 1  # the same number of passes on every rank
        assert sorted(i for parts, _ in shares for part in parts for i in part) == list(range(n))
        assert all(len(parts) <= passes for parts, passes in shares)


def test_ptx_loss_is_token_mean_nll_whatever_the_split(tiny_model, tokenizer):
    rng = random.Random(3)
    prompts = [[rng.randrange(2, tokenizer.vocab_size) for _ in range(rng.randint(2, 6))] for _ in range(7)]
    responses = [[rng.randrange(2, tokenizer.vocab_size) for _ in range(rng.randint(1, 6))] for _ in range(7)]
    tiny_model.zero_grad()
    nll, count = 0.0, 0
    for p, r in zip(prompts, responses, strict=True):  # reference: one sequence at a time
        ids = torch.tensor([p + r])
        valid = torch.ones_like(ids, dtype=torch.bool)
        logp = F.log_softmax(tiny_model(ids, positions_from_valid(valid), padded_causal_mask(valid))[0], -1)
        nll = nll - sum(logp[len(p) - 1 + t, tok] for t, tok in enumerate(r))
        count += len(r)
    ref = 0.5 * nll / count
    ref.backward()
    ref_grads = [p.grad.clone() for p in tiny_model.parameters()]
    engine = TrainingEngine(tiny_model, [], tokenizer.pad_id)
    for mb, world in ((7, 1), (2, 2), (1, 3)):
        tiny_model.zero_grad()
        loss = sum(ptx_backward(engine, PtxBatch(prompts, responses), 0.5, micro_batch=mb, rank=r, world=world)
                   for r in range(world))
        assert abs(loss - ref.item()) < 1e-5
        for a, b in zip(ref_grads, [p.grad for p in tiny_model.parameters()], strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
