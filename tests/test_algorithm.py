"""The K1.5 loss and its gradient against an independent computation, and learning on a toy reward."""

import random
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from engines.inference.native import InferenceEngine
from engines.inference.sampling import SamplingParams
from engines.model.native.attention import padded_causal_mask, positions_from_valid
from engines.training.engine import TrainingEngine
from engines.training.optim import build_optimizers
from rl.algo.batches import PtxBatch, informative_groups, plan_micro_batches, plan_update, ptx_shares
from rl.algo.objectives import Objective, group_advantages
from rl.algo.update import Measures, accumulate, ptx_accumulate, rl_update, score_all, to_device
from rl.settings import UpdateSettings
from tests.conftest import make_sample


def settings(tau: float = 1.0, minibatches: int = 1, token_budget: int = 4096, max_items: int | None = None,
             drop_equal_groups: bool = True, recompute_old: bool = False, correction=None,
             objective: Objective | None = None) -> UpdateSettings:
    """An update's settings as a run resolves them (``rl.settings.UpdateSettings``)."""
    return UpdateSettings(objective=objective or Objective("k15", tau=tau), minibatches=minibatches,
                          micro_batch_tokens=token_budget, micro_batch=max_items, drop_equal_groups=drop_equal_groups,
                          recompute_old=recompute_old or correction is not None, correction=correction, ptx_coef=0.0)


def backward(engine, samples, s: UpdateSettings, world: int = 1) -> float:
    """Accumulate the gradient of the first optimizer step's loss over every rank's share of ``samples`` in one
    process (summed over ranks, as FSDP's reduce-scatter does); returns the loss."""
    loss = 0.0
    for batch in plan_update(samples, s, world, seed=0):
        steps = to_device(engine, batch)
        measures = Measures(engine.device)
        accumulate(engine, steps[0], batch.passes[0], s.objective, batch.tokens[0], measures)
        loss += measures.read()["loss"]
    return loss


def update(engine, samples, s: UpdateSettings, seed: int = 0) -> list[dict]:
    """Every optimizer step of one update of ``samples`` on one rank (what ``rl_update`` yields)."""
    return [m for batch in plan_update(samples, s, 1, seed) for m in rl_update(engine, batch, s)]


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
            ids = torch.tensor([s.prompt_ids.tolist() + s.response_ids.tolist()])
            valid = torch.ones_like(ids, dtype=torch.bool)
            logits = model(ids, positions_from_valid(valid), padded_causal_mask(valid))[0]
            logp = F.log_softmax(logits.float() / s.temperature, dim=-1)
            # multi-turn: only the model's own tokens count
            mask = [1] * len(s.response_ids) if s.loss_mask is None else s.loss_mask.tolist()
            new = sum(logp[len(s.prompt_ids) - 1 + t, tok] for t, tok in enumerate(s.response_ids.tolist()) if mask[t])
            ratio = new - sum(lp for lp, m in zip(s.logprobs.tolist(), mask, strict=True) if m)
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
            samples.append(make_sample(g, prompt, resp, [rng.uniform(-3, -0.1) for _ in resp],
                                       float(rng.random() < 0.5), temperature=rng.choice([0.7, 1.0, 1.3]),
                                       loss_mask=mask))
    return samples


@pytest.mark.parametrize("masked", [False, True], ids=["single-turn", "multi-turn-loss-mask"])
def test_k15_loss_and_gradient_match_reference(tiny_model, tokenizer, masked):
    rng = random.Random(0)
    samples = _random_samples(rng, tokenizer.vocab_size, masked=masked)
    if masked:  # environment tokens are context only: their sampler logprobs must not matter
        assert any(0 in s.loss_mask for s in samples)
        samples = [replace(s, logprobs=[lp if m else 123.0 for lp, m in zip(s.logprobs, s.loss_mask, strict=True)])
                   for s in samples]
    tau = 0.3

    tiny_model.zero_grad()
    ref = _reference_loss(tiny_model, samples, tau)
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in tiny_model.named_parameters()}

    tiny_model.zero_grad()
    engine = TrainingEngine(tiny_model, [], tokenizer.pad_id)
    # the plan's weights: 1/(K_g · G), the mean over each prompt's samples, then over the prompts
    loss = backward(engine, samples, settings(tau=tau, token_budget=24, drop_equal_groups=False))

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
        losses[device] = backward(engine, samples, settings(tau=0.3, token_budget=32, drop_equal_groups=False))
        assert all(p.grad is not None and p.grad.device.type == device for p in model.parameters())
    assert losses["cuda"] == pytest.approx(losses["cpu"], rel=1e-3)


def test_gradient_does_not_depend_on_packing_or_rank_split(tiny_model, tokenizer):
    """Each rank's share, summed over ranks (what FSDP's reduce-scatter does), equals one process, whatever the
    token budget packs together: one sequence per pass, a few per row, everything in one pass; also with the
    flex_attention layout (one wide row of documents) where it can run here (no gradients on CPU: its
    log-probabilities must equal the dense path's)."""
    samples = _random_samples(random.Random(1), tokenizer.vocab_size)
    engine = TrainingEngine(tiny_model, [], tokenizer.pad_id)
    longest = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    grads, losses = [], []
    for budget, world, cap in ((1, 1, None), (longest, 1, None), (2 * longest, 1, 3), (10_000, 1, None),
                               (longest, 2, None), (2 * longest, 3, None)):
        tiny_model.zero_grad()
        loss = backward(engine, samples, settings(token_budget=budget, max_items=cap, drop_equal_groups=False), world)
        losses.append(loss)
        grads.append([p.grad.clone() for p in tiny_model.parameters()])
    for loss, other in zip(losses[1:], grads[1:], strict=True):
        assert loss == pytest.approx(losses[0], rel=1e-5)
        for a, b in zip(grads[0], other, strict=True):
            # float32 sums in another order: each element within a few ulps of its tensor's largest (these
            # gradients reach ~40, where one ulp is 4e-6; a fixed 1e-5 failed on AMD EPYC, not on Intel)
            torch.testing.assert_close(a, b, atol=1e-6 * float(a.abs().max()), rtol=1e-4)
    with torch.no_grad():
        dense = engine.score([s.prompt_ids for s in samples], [s.response_ids for s in samples], 1.0)
        engine.attention = "flex"
        flex = engine.score([s.prompt_ids for s in samples], [s.response_ids for s in samples], 1.0)
    torch.testing.assert_close(flex.logprobs, dense.logprobs, atol=1e-5, rtol=1e-5)
    assert torch.equal(flex.mask, dense.mask)


def test_micro_batches_are_formed_by_tokens_and_every_rank_runs_as_many_passes():
    rng = random.Random(5)
    for n, budget, world, cap in ((10, 40, 2, None), (7, 25, 3, None), (1, 10, 2, None), (0, 10, 2, None),
                                  (30, 64, 4, 3), (9, 5, 1, None)):
        lengths = [rng.randint(2, 30) for _ in range(n)]
        plans = plan_micro_batches(lengths, budget, world, cap)
        assert len(plans) == world
        assert sorted(i for plan in plans for part in plan for i in part) == list(range(n))
        for plan in plans:
            for part in plan:
                # within the budget, unless a single sequence is longer than it
                assert sum(lengths[i] for i in part) <= budget or len(part) == 1
                assert cap is None or len(part) <= cap
        if n >= world:  # tokens balanced: no rank holds more than its share plus one sequence
            loads = [sum(lengths[i] for part in plan for i in part) for plan in plans]
            assert max(loads) - min(loads) <= max(lengths)
    assert plan_micro_batches([5, 5, 5, 5], 10, 1) == [[[0, 1], [2, 3]]]


def test_advantage_is_reward_minus_group_mean():
    s = [make_sample(0, [1], [2], [0.0], r) for r in (1.0, 0.0, 0.0, 1.0)] + [make_sample(1, [1], [2], [0.0], 1.0)]
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
        samples = [make_sample(j // 8, o.prompt_ids, o.token_ids, o.logprobs, float(o.token_ids[0] % 2 == 0))
                   for j, o in enumerate(outs)]
        rates.append(sum(s.reward for s in samples) / len(samples))
        tiny_model.train().requires_grad_(True)
        update(engine, samples, settings(minibatches=2), seed=it)
    assert sum(rates[-3:]) / 3 > sum(rates[:3]) / 3 + 0.25, rates


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
    for budget, world in ((1000, 1), (20, 2), (1, 3)):
        tiny_model.zero_grad()
        measures = Measures(engine.device)
        for share in ptx_shares(PtxBatch(prompts, responses), world, budget, None):
            ptx_accumulate(engine, share, 0.5, measures)
        loss = 0.5 * measures.read()["ptx_loss"]
        assert abs(loss - ref.item()) < 1e-5
        for a, b in zip(ref_grads, [p.grad for p in tiny_model.parameters()], strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def _snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_groups_of_equal_rewards_are_left_out_and_nothing_left_takes_no_step(tiny_model, tokenizer):
    """Equal rewards everywhere: no optimizer step at all (Muon would turn the zero-advantage terms' noise into a
    full-size step). One informative group: the update equals training on that group alone."""
    rng = random.Random(7)
    samples = _random_samples(rng, tokenizer.vocab_size, n_groups=4)
    flat = [replace(s, reward=1.0) for s in samples]
    engine = TrainingEngine(tiny_model, build_optimizers(tiny_model, "muon", 1e-2, 0.0), tokenizer.pad_id)
    before = _snapshot(tiny_model)
    assert update(engine, flat, settings(minibatches=2)) == []
    assert all(torch.equal(p, before[n]) for n, p in tiny_model.named_parameters())
    assert informative_groups(flat) == []

    mixed = [s if s.group == 2 else replace(s, reward=0.0) for s in samples]
    assert len({s.reward for s in mixed if s.group == 2}) > 1  # group 2 keeps its differing rewards
    assert informative_groups(mixed) == [2]
    steps = update(engine, mixed, settings(minibatches=2))
    assert len(steps) == 1 and steps[0]["groups_trained"] == 1 and steps[0]["groups_equal_reward"] == 3
    after_mixed = _snapshot(tiny_model)
    for n, p in tiny_model.named_parameters():  # back to the start, then train on group 2 alone
        p.data.copy_(before[n])
    engine = TrainingEngine(tiny_model, build_optimizers(tiny_model, "muon", 1e-2, 0.0), tokenizer.pad_id)
    alone = [s for s in mixed if s.group == 2]
    update(engine, alone, settings(minibatches=2))
    for n, p in tiny_model.named_parameters():
        assert not torch.equal(after_mixed[n], before[n]) or "norm" in n or "embed" in n, n
        torch.testing.assert_close(p.detach(), after_mixed[n], atol=1e-6, rtol=1e-5, msg=n)
    # kept on request: all four groups train (their zero-advantage terms included)
    for n, p in tiny_model.named_parameters():
        p.data.copy_(before[n])
    steps = update(engine, mixed, settings(minibatches=2, drop_equal_groups=False))
    assert len(steps) == 2


def test_update_reports_health_diagnostics_against_independent_sums(tiny_model, tokenizer):
    """logprob_diff_mean/max against the sampler's numbers, entropy of the policy, K1.5 residual statistics and the
    update RMS per optimizer, each recomputed here from first principles."""
    rng = random.Random(11)
    samples = _random_samples(rng, tokenizer.vocab_size, n_groups=3)
    model = tiny_model
    diffs, entropies, residuals = [], [], []
    adv = group_advantages(samples)
    with torch.no_grad():
        for s, a in zip(samples, adv, strict=True):
            ids = torch.tensor([s.prompt_ids.tolist() + s.response_ids.tolist()])
            valid = torch.ones_like(ids, dtype=torch.bool)
            logp = F.log_softmax(model(ids, positions_from_valid(valid), padded_causal_mask(valid))[0].float()
                                 / s.temperature, -1)
            rows = [logp[len(s.prompt_ids) - 1 + t] for t in range(len(s.response_ids))]
            new = [float(r[tok]) for r, tok in zip(rows, s.response_ids.tolist(), strict=True)]
            diffs += [abs(n - o) for n, o in zip(new, s.logprobs.tolist(), strict=True)]
            entropies += [float(-(r.exp() * r).sum()) for r in rows]
            residuals.append(a - (sum(new) - sum(s.logprobs.tolist())))
    before = _snapshot(model)
    engine = TrainingEngine(model, build_optimizers(model, "muon", 1e-2, 0.0), tokenizer.pad_id)
    (step,) = update(engine, samples, settings())
    assert step["logprob_diff_mean"] == pytest.approx(sum(diffs) / len(diffs), rel=1e-5)
    assert step["logprob_diff_max"] == pytest.approx(max(diffs), rel=1e-5)
    assert step["entropy"] == pytest.approx(sum(entropies) / len(entropies), rel=1e-5)
    mean = sum(residuals) / len(residuals)
    assert step["k15_residual_mean"] == pytest.approx(mean, rel=1e-4, abs=1e-6)
    assert step["k15_residual_std"] == pytest.approx((sum((r - mean) ** 2 for r in residuals) / len(residuals)) ** 0.5,
                                                     rel=1e-4)
    assert step["k15_residual_absmax"] == pytest.approx(max(map(abs, residuals)), rel=1e-5)
    muon = {id(p) for g in engine.optimizers[0].param_groups for p in g["params"]}
    for kind, chosen in (("muon", True), ("adamw", False)):
        deltas = [(p.detach() - before[n]).flatten() for n, p in model.named_parameters() if (id(p) in muon) == chosen]
        want = float(torch.cat(deltas).square().mean().sqrt())
        assert step[f"update_rms/{kind}"] == pytest.approx(want, rel=1e-4), kind


def test_recomputed_old_logprobs_are_the_trainers_and_zero_the_first_log_ratio(tiny_model, tokenizer):
    """With recompute, π_old is the trainer's own: the first step's residuals are the advantages exactly."""
    samples = _random_samples(random.Random(2), tokenizer.vocab_size, n_groups=3)
    engine = TrainingEngine(tiny_model, [], tokenizer.pad_id)
    (batch,) = plan_update(samples, settings(token_budget=30, drop_equal_groups=False), 1, seed=0)
    steps = to_device(engine, batch)
    score_all(engine, steps, batch.scoring_passes)
    with torch.no_grad():
        lp, mask = engine.response_logprobs([s.prompt_ids for s in batch.samples],
                                            [s.response_ids for s in batch.samples],
                                            [s.temperature for s in batch.samples])
    for micro in (m for step in steps for m in step):
        for row, i in enumerate(micro.index):
            n = len(batch.samples[i].response_ids)
            torch.testing.assert_close(micro.old[row, :n], lp[i][mask[i]], atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(micro.old_seq[row], lp[i][mask[i]].sum(), atol=1e-5, rtol=1e-5)
    engine.optimizers = build_optimizers(tiny_model, "muon", 1e-2, 0.0)
    adv = group_advantages(samples)
    (step,) = update(engine, samples, settings(recompute_old=True))
    assert step["k15_residual_absmax"] == pytest.approx(max(abs(a) for a in adv), rel=1e-5)
    assert step["logprob_diff_max"] > 0.1  # the sampler's numbers here are random: far from the trainer's
