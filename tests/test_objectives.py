"""GRPO and DAPO (rl.algo.objectives) against the formulas computed by hand, one sequence and one token at a time."""

import math
import random
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from engines.model.native.attention import padded_causal_mask, positions_from_valid
from engines.training.engine import TrainingEngine
from rl.algo.batches import RankBatch, plan_micro_batches, plan_update, shape_lengths
from rl.algo.objectives import Objective, normalized_advantages, overlong_penalty
from rl.algo.update import Measures, accumulate, rl_update, to_device
from rl.config import parse_config
from rl.sample import Sample
from rl.settings import objective_of
from tests.conftest import make_sample
from tests.test_algorithm import settings, update


def surrogate_backward(engine, samples, advantages, weights, objective, *, total_tokens, token_budget,
                       refs=None) -> float:
    """Accumulate the gradient of one step of GRPO's or DAPO's surrogate over ``samples`` with these advantages and
    per-response weights (a rank's batch made by hand; ``refs``: the reference policy's per-token log-probs, by
    sample); returns the loss."""
    plan = plan_micro_batches([len(s.prompt_ids) + len(s.response_ids) for s in samples], token_budget)[0]
    batch = RankBatch(samples=list(samples), advantages=list(advantages), weights=list(weights), steps=[plan],
                      passes=[len(plan)], tokens=[total_tokens])
    steps = to_device(engine, batch)
    for micro in steps[0]:
        if refs is not None:
            micro.ref = torch.zeros_like(micro.old)
            for row, i in enumerate(micro.index):
                micro.ref[row, :len(refs[i])] = torch.tensor(refs[i])
    measures = Measures(engine.device)
    accumulate(engine, steps[0], batch.passes[0], objective, total_tokens, measures)
    return measures.read()["loss"]


def _token_logprobs(model, s: Sample) -> list[torch.Tensor]:
    """log π_θ of each response token, the sequence alone, at its sampling temperature."""
    ids = torch.tensor([s.prompt_ids.tolist() + s.response_ids.tolist()])
    valid = torch.ones_like(ids, dtype=torch.bool)
    logp = F.log_softmax(model(ids, positions_from_valid(valid), padded_causal_mask(valid))[0].float()
                         / s.temperature, dim=-1)
    return [logp[len(s.prompt_ids) - 1 + t, tok] for t, tok in enumerate(s.response_ids.tolist())]


def _reference(model, samples, kind: str, eps_low: float, eps_high: float, beta: float = 0.0,
               refs: dict | None = None) -> torch.Tensor:
    """GRPO: −mean over prompts of mean over samples of mean over own tokens of min(ρÂ, clip(ρ)Â) − β·D, with
    D = π_ref/π_θ − log(π_ref/π_θ) − 1; DAPO: −(sum over every own token of the batch) / (own tokens of the batch)."""
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group, []).append(s)
    per_prompt, all_terms = [], []
    for members in groups.values():
        rewards = [s.reward for s in members]
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        per_sample = []
        for s in members:
            adv = (s.reward - mean) / (std + 1e-6)
            mask = [1] * len(s.response_ids) if s.loss_mask is None else s.loss_mask.tolist()
            terms = []
            ref_row = (refs or {}).get(s.key) or [0.0] * len(s.response_ids)
            for new, old, ref, m in zip(_token_logprobs(model, s), s.logprobs.tolist(), ref_row, mask, strict=True):
                if m:
                    ratio = torch.exp(new - old)
                    term = torch.minimum(ratio * adv, ratio.clamp(1 - eps_low, 1 + eps_high) * adv)
                    if beta:
                        term = term - beta * (math.exp(ref) / torch.exp(new) - (ref - new) - 1)
                    terms.append(term)
            per_sample.append(sum(terms) / len(terms))
            all_terms += terms
        per_prompt.append(sum(per_sample) / len(per_sample))
    if kind == "grpo":
        return -sum(per_prompt) / len(per_prompt)
    return -sum(all_terms) / len(all_terms)


def _samples(model, vocab: int, rng: random.Random, masked: bool = False) -> list[Sample]:
    """Three prompts (one with K − 1 samples), rewards with signal, and sampler log-probs within ±0.5 of the
    model's own so that some ratios fall inside the clip range and some outside it."""
    out = []
    for g in range(3):
        prompt = [rng.randrange(2, vocab) for _ in range(rng.randint(2, 6))]
        for k in range(4 - (g == 1)):
            resp = [rng.randrange(2, vocab) for _ in range(rng.randint(1, 7))]
            mask = [1] + [int(rng.random() < 0.6) for _ in resp[1:]] if masked else None
            s = make_sample(g, prompt, resp, [0.0] * len(resp), float(k % 2) + rng.random() * 0.1,
                            temperature=rng.choice([0.7, 1.0]), loss_mask=mask)
            with torch.no_grad():
                exact = [float(x) for x in _token_logprobs(model, s)]
            out.append(replace(s, logprobs=[x + rng.uniform(-0.5, 0.5) for x in exact]))
    return out


@pytest.mark.parametrize("kind,masked,beta", [("grpo", False, 0.0), ("dapo", False, 0.0), ("dapo", True, 0.0),
                                               ("grpo", False, 0.3), ("dapo", True, 0.3)])
def test_surrogate_loss_and_gradient_match_the_formula(tiny_model, tokenizer, kind, masked, beta):
    """The surrogate, and with β > 0 GRPO's KL penalty against a reference policy (its log-probs within ±0.3 of
    the model's), each token computed alone."""
    rng = random.Random(1)
    samples = _samples(tiny_model, tokenizer.vocab_size, rng, masked)
    refs = {s.key: [x + rng.uniform(-0.3, 0.3) for x in s.logprobs] for s in samples} if beta else None
    objective = Objective(kind, clip_low=0.2, clip_high=0.2 if kind == "grpo" else 0.28, kl_coef=beta)
    tiny_model.zero_grad()
    ref = _reference(tiny_model, samples, kind, objective.clip_low, objective.clip_high, beta, refs)
    ref.backward()
    want = {n: p.grad.clone() for n, p in tiny_model.named_parameters()}

    tiny_model.zero_grad()
    engine = TrainingEngine(tiny_model, [], tokenizer.pad_id)
    sizes = {g: sum(s.group == g for s in samples) for g in {s.group for s in samples}}
    weights = [1 / (sizes[s.group] * len(sizes)) if kind == "grpo" else 1.0 for s in samples]
    own = sum(len(s.response_ids) if s.loss_mask is None else int(s.loss_mask.sum()) for s in samples)
    loss = surrogate_backward(engine, samples, normalized_advantages(samples), weights, objective, total_tokens=own,
                              token_budget=20, refs=[refs[s.key] for s in samples] if refs else None)
    assert abs(loss - ref.item()) < 1e-5 * max(1.0, abs(ref.item()))
    for n, p in tiny_model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], atol=1e-5, rtol=1e-4, msg=n)


def test_clipped_tokens_give_no_gradient(tiny_model, tokenizer):
    """A ratio above 1 + ε_high with a positive advantage (or below 1 − ε_low with a negative one) is clipped:
    its token contributes nothing to the gradient."""
    s = make_sample(0, [5, 6, 7], [8, 9], [0.0, 0.0], 1.0)
    with torch.no_grad():
        exact = [float(x) for x in _token_logprobs(tiny_model, s)]
    good = replace(s, logprobs=[exact[0] - 1.0, exact[1] - 1.0])  # ρ = e > 1.28 on both tokens
    bad = replace(s, reward=0.0)
    engine = TrainingEngine(tiny_model, [], tokenizer.pad_id)
    tiny_model.zero_grad()
    surrogate_backward(engine, [good, bad], [1.0, -1.0], [1.0, 1.0], Objective("dapo", clip_high=0.28),
                       total_tokens=4, token_budget=64)  # the second: ρ = 1, A < 0, not clipped
    g_both = {n: p.grad.clone() for n, p in tiny_model.named_parameters() if p.grad is not None}
    tiny_model.zero_grad()
    surrogate_backward(engine, [bad], [-1.0], [1.0], Objective("dapo", clip_high=0.28), total_tokens=4,
                       token_budget=64)
    for n, p in tiny_model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(g_both[n], p.grad, msg=n)


def test_advantages_and_overlong_shaping_by_hand():
    group = [make_sample(0, [1], [2], [0.0], r) for r in (1.0, 0.0, 0.0, 1.0)] + [make_sample(1, [1], [2], [0.0], 3.0)]
    adv = normalized_advantages(group)
    assert [round(a, 4) for a in adv[:4]] == [1.0, -1.0, -1.0, 1.0] and adv[4] == 0.0  # mean 0.5, std 0.5
    # L_max 40, L_c 8: no penalty up to 32 tokens, then a ramp to −1 at 40, −1 beyond
    assert [overlong_penalty(n, 40, 8) for n in (20, 32, 36, 40, 41)] == [0.0, 0.0, -0.5, -1.0, -1.0]
    assert overlong_penalty(39, 40, 0) == 0.0
    long = [make_sample(0, [1], list(range(36)), [0.0] * 36, 1.0), make_sample(0, [1], [3], [0.0], 1.0)]
    shaped = shape_lengths(long, Objective("dapo", overlong_buffer=8, max_tokens=40))
    assert [s.reward for s in shaped] == [0.5, 1.0]
    assert [s.reward for s in shape_lengths(long, Objective("grpo", overlong_buffer=8, max_tokens=40))] == [1.0, 1.0]


def test_config_resolves_each_objective_and_an_update_reports_its_clip_fraction(tiny_model, tokenizer):
    dapo = objective_of(parse_config({"algorithm": {"objective": "dapo"}, "rollout": {"max_tokens": 50}}))
    assert dapo == Objective("dapo", tau=1.0, clip_low=0.2, clip_high=0.28, overlong_buffer=10, max_tokens=50)
    grpo = objective_of(parse_config({"algorithm": {"objective": "grpo", "clip_low": 0.1}}))
    assert (grpo.clip_low, grpo.clip_high, grpo.overlong_buffer) == (0.1, 0.1, 0)
    with pytest.raises(Exception, match="objective"):
        parse_config({"algorithm": {"objective": "ppo"}})
    assert objective_of(parse_config({"algorithm": {"objective": "grpo", "kl_coef": 0.04}})) \
        == Objective("grpo", clip_high=0.2, kl_coef=0.04, max_tokens=40)
    with pytest.raises(Exception, match="kl_coef > 0 is a penalty of objective grpo or dapo"):
        parse_config({"algorithm": {"kl_coef": 0.04}})
    samples = _samples(tiny_model, tokenizer.vocab_size, random.Random(2))
    params = [p for p in tiny_model.parameters()]
    before = [p.detach().clone() for p in params]
    engine = TrainingEngine(tiny_model, [torch.optim.SGD(params, lr=0.1)], tokenizer.pad_id)
    steps = update(engine, samples, settings(minibatches=2, token_budget=64, objective=Objective("grpo")))
    assert len(steps) == 2 and all(0.0 <= m["clip_fraction"] <= 1.0 for m in steps)
    assert "k15_residual_mean" not in steps[0] and any(m["clip_fraction"] > 0 for m in steps)
    assert any(not torch.equal(a, p) for a, p in zip(before, params, strict=True))


def test_a_kl_penalty_scores_against_the_reference_engine(tiny_model, tokenizer):
    """rl_update with kl_coef: the reference engine (here a copy of the starting weights) scores the batch once;
    on the first step the policy is the reference (KL 0), after a step it has moved away (KL > 0)."""
    import copy

    samples = _samples(tiny_model, tokenizer.vocab_size, random.Random(3))
    reference = TrainingEngine(copy.deepcopy(tiny_model).requires_grad_(False), [], tokenizer.pad_id)
    params = list(tiny_model.parameters())
    engine = TrainingEngine(tiny_model, [torch.optim.SGD(params, lr=0.5)], tokenizer.pad_id)
    s = settings(minibatches=2, token_budget=64, objective=Objective("grpo", kl_coef=0.1))
    (batch,) = plan_update(samples, s, 1, seed=0)
    steps = list(rl_update(engine, batch, s, reference=reference))
    assert steps[0]["kl_ref"] == pytest.approx(0.0, abs=1e-6) and steps[1]["kl_ref"] > 1e-4
    with pytest.raises(ValueError, match="needs the reference policy's engine"):
        list(rl_update(engine, batch, s))
