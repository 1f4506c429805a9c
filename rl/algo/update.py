"""The K1.5 objective (report 3.2.3) and the update loops that apply it (GRPO and DAPO: ``rl.algo.objectives``).

For each prompt x with K samples: L = 1/K Σ_i (r_i − r̄ − τ·(log π_θ(y_i|x) − log π_old(y_i|x)))²,
averaged over prompts; log π is the sum over the response's tokens. The SFT/PTX loss is the
token-mean negative log-likelihood of reference responses. Total loss of a step: L_RL + λ_ptx·L_PTX.
With several ranks every rank sees the same batch and trains on its share; loss weights are
normalised over the whole batch and gradients are summed across ranks (FSDP), so the update does
not depend on how the batch is split over ranks or packed into micro-batches (formed by tokens).
Groups whose K rewards are all equal carry no signal and are left out of the loss (by default).
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import torch

from engines.training.distributed import all_reduce_max, all_reduce_sum
from engines.training.engine import TokenScores, TrainingEngine
from rl.algo.mismatch import Correction, apply
from rl.algo.objectives import (
    Objective,
    clip_fraction,
    clipped_surrogate,
    group_stats,
    kl_to_reference,
    normalized_advantages,
    overlong_penalty,
    token_weights,
)


@dataclass
class Sample:
    """One trajectory as the trainer sees it."""

    group: int                 # index of the prompt it answers; K samples share a group
    prompt_ids: list[int]
    response_ids: list[int]
    old_logprobs: list[float]  # per token, from the sampler (π_old)
    reward: float
    temperature: float = 1.0   # what it was sampled at; the recompute uses the same
    # Multi-turn: 1 for the model's own tokens, 0 for what the environment inserted (tool results, user turns),
    # which are context only; None = every response token is the model's.
    loss_mask: list[int] | None = None
    ref_logprobs: list[float] | None = None  # per token, of the reference policy (a KL penalty's); None: none

    def policy_logprob(self) -> float:
        """log π_old of the model's own tokens (the masked-in ones)."""
        if self.loss_mask is None:
            return sum(self.old_logprobs)
        return sum(lp for lp, m in zip(self.old_logprobs, self.loss_mask, strict=True) if m)


@dataclass
class PtxBatch:
    """Curated (prompt, response) token ids for the PTX loss of one optimizer step."""

    prompts: list[list[int]]
    responses: list[list[int]]


def k15_loss(new_logp: torch.Tensor, old_logp: torch.Tensor, advantage: torch.Tensor,
             weight: torch.Tensor, tau: float) -> torch.Tensor:
    """Σ_i w_i (A_i − τ(log π_θ − log π_old)_i)² over sequences; w sums to 1 over a minibatch."""
    return (weight * (advantage - tau * (new_logp - old_logp)) ** 2).sum()


def group_advantages(samples: Sequence[Sample]) -> list[float]:
    """r − r̄(x): each reward minus the mean reward of its prompt's samples."""
    stats = group_stats(samples)
    return [s.reward - stats[s.group][0] for s in samples]


def _minibatches(groups: list[int], n: int, rng: random.Random) -> list[list[int]]:
    groups = groups[:]
    rng.shuffle(groups)
    n = max(1, min(n, len(groups)))
    return [groups[i::n] for i in range(n)]


def informative_groups(samples: Sequence[Sample]) -> list[int]:
    """The groups whose rewards are not all equal, sorted: the only ones whose advantages are not all zero.

    A group of equal rewards adds only −τ·log(π_θ/π_old) terms, zero at the start of a step; with Muon
    even that noise becomes a full-size orthogonalised step, so such groups are left out of the loss.
    """
    rewards: dict[int, set[float]] = defaultdict(set)
    for s in samples:
        rewards[s.group].add(s.reward)
    return sorted(g for g, r in rewards.items() if len(r) > 1)


def plan_micro_batches(lengths: Sequence[int], token_budget: int, world: int = 1,
                       max_items: int | None = None) -> list[list[list[int]]]:
    """Per rank, its micro-batches of item indices, formed by tokens: every rank computes the same plan.

    Items go longest first to the rank with the fewest tokens so far, then into the first of that rank's
    micro-batches with room for them (``token_budget`` tokens, at most ``max_items`` items); an item longer
    than the budget gets a micro-batch of its own. With FSDP each forward/backward is collective, so every
    rank runs as many passes as the rank with the most (``max(len(plan[r]))``), padding with dummy passes.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be positive, got {token_budget}")
    load = [0] * world
    shares: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += lengths[i]
    plans = []
    for share in shares:
        bins: list[list[int]] = []
        room: list[int] = []
        for i in share:
            b = next((b for b in range(len(bins)) if lengths[i] <= room[b]
                      and (max_items is None or len(bins[b]) < max_items)), None)
            if b is None:
                bins.append([])
                room.append(token_budget)
                b = len(bins) - 1
            bins[b].append(i)
            room[b] -= lengths[i]
        plans.append(bins)
    return plans


def _lengths(samples: Sequence[Sample]) -> list[int]:
    return [len(s.prompt_ids) + len(s.response_ids) for s in samples]


@dataclass
class Measures:
    """Diagnostics gathered while training, as sums; ``metrics`` reduces them over ranks (collective).

    ``logprob_diff``: |log π_trainer − log π_sampler| per token (the model's own tokens), measured before
    any optimizer step of the iteration; ``entropy``: of the policy at each token's sampling temperature,
    same tokens; ``residual``: the K1.5 residual A − τ·(log π_θ − log π_old) per sequence, every minibatch.
    """

    diff_sum: float = 0.0
    diff_max: float = 0.0
    entropy_sum: float = 0.0
    tokens: float = 0.0
    residual_sum: float = 0.0
    residual_sq: float = 0.0
    residual_absmax: float = 0.0
    sequences: float = 0.0
    clipped: float = 0.0   # GRPO/DAPO: own tokens whose gradient the clip stopped
    scored: float = 0.0    # GRPO/DAPO: own tokens of the surrogate
    kl_sum: float = 0.0    # GRPO/DAPO with a KL penalty: D summed over own tokens
    kl_tokens: float = 0.0

    def add_tokens(self, samples: Sequence[Sample], scores: TokenScores) -> None:
        mask = scores.mask & _own_tokens(samples, scores.mask)
        old = _per_token(samples, scores.mask)
        diff = (scores.logprobs.detach() - old).abs()[mask]
        self.diff_sum += float(diff.sum())
        self.diff_max = max(self.diff_max, float(diff.max()) if diff.numel() else 0.0)
        self.entropy_sum += float(scores.entropy[mask].sum())
        self.tokens += int(mask.sum())

    def add_residuals(self, residuals: torch.Tensor) -> None:
        r = residuals.detach().double()
        self.residual_sum += float(r.sum())
        self.residual_sq += float((r * r).sum())
        self.residual_absmax = max(self.residual_absmax, float(r.abs().max()) if r.numel() else 0.0)
        self.sequences += r.numel()

    def metrics(self, tokens: bool, residuals: bool) -> dict[str, float]:
        sums = all_reduce_sum([self.diff_sum, self.entropy_sum, self.tokens, self.residual_sum, self.residual_sq,
                               self.sequences, self.clipped, self.scored, self.kl_sum, self.kl_tokens])
        maxima = all_reduce_max([self.diff_max, self.residual_absmax])
        out: dict[str, float] = {}
        if tokens and sums[2]:
            out.update(logprob_diff_mean=sums[0] / sums[2], logprob_diff_max=maxima[0], entropy=sums[1] / sums[2])
        if residuals and sums[5]:
            mean = sums[3] / sums[5]
            out.update(k15_residual_mean=mean, k15_residual_std=max(0.0, sums[4] / sums[5] - mean * mean) ** 0.5,
                       k15_residual_absmax=maxima[1])
        if residuals and sums[7]:
            out["clip_fraction"] = sums[6] / sums[7]
        if residuals and sums[9]:
            out["kl_ref"] = sums[8] / sums[9]
        return out


def _own_tokens(samples: Sequence[Sample], layout: torch.Tensor) -> torch.Tensor:
    """[B, longest response] bool: the model's own tokens (a multi-turn loss mask leaves the environment's out)."""
    out = torch.zeros(layout.shape, dtype=torch.bool, device=layout.device)
    for b, s in enumerate(samples):
        row = s.loss_mask if s.loss_mask is not None else [1] * len(s.response_ids)
        out[b, :len(row)] = torch.as_tensor(row, device=layout.device).bool()
    return out


def _per_token(samples: Sequence[Sample], layout: torch.Tensor) -> torch.Tensor:
    """The sampler's per-token log-probs laid out like ``TrainingEngine.score``'s [B, longest response]."""
    out = torch.zeros(layout.shape, dtype=torch.float32, device=layout.device)
    for b, s in enumerate(samples):
        out[b, :len(s.old_logprobs)] = torch.as_tensor(s.old_logprobs, dtype=torch.float32, device=layout.device)
    return out


def _per_token_ref(samples: Sequence[Sample], layout: torch.Tensor) -> torch.Tensor:
    """The reference policy's per-token log-probs laid out like ``TrainingEngine.score``'s [B, longest response]."""
    out = torch.zeros(layout.shape, dtype=torch.float32, device=layout.device)
    for b, s in enumerate(samples):
        assert s.ref_logprobs is not None, "a KL penalty needs the reference's log-probs"
        out[b, :len(s.ref_logprobs)] = torch.as_tensor(s.ref_logprobs, dtype=torch.float32, device=layout.device)
    return out


def _scored_parts(engine: TrainingEngine, samples: Sequence[Sample], token_budget: int, rank: int, world: int,
                  max_items: int | None) -> Iterator[tuple[list[int], list[Sample], TokenScores]]:
    """This rank's micro-batches (``plan_micro_batches``), each scored by ``engine``: (indices, samples, scores).
    The caller backpropagates each; once they are done, dummy passes pad this rank to its peers' count."""
    plans = plan_micro_batches(_lengths(samples), token_budget, world, max_items)
    for part in plans[rank]:
        chosen = [samples[i] for i in part]
        yield part, chosen, engine.score([s.prompt_ids for s in chosen], [s.response_ids for s in chosen],
                                         [s.temperature for s in chosen])
    for _ in range(max(len(p) for p in plans) - len(plans[rank])):
        engine.dummy_backward()


def k15_backward(engine: TrainingEngine, samples: Sequence[Sample], advantages: Sequence[float],
                 weights: Sequence[float], *, tau: float, token_budget: int, rank: int = 0, world: int = 1,
                 max_items: int | None = None, measures: Measures | None = None, measure_tokens: bool = False) -> float:
    """Accumulate the gradient of Σ_i w_i·(A_i − τ·δ_i)² in micro-batches of at most ``token_budget`` tokens;
    returns this rank's loss.

    The loss is a weighted sum over sequences with weights normalised over the whole minibatch
    (all ranks), so any packing into micro-batches and any number of ranks give the same gradient.
    ``measures`` collects the residuals (and, with ``measure_tokens``, the per-token diagnostics).
    """
    total = 0.0
    for part, chosen, scores in _scored_parts(engine, samples, token_budget, rank, world, max_items):
        lp = scores.logprobs
        if any(s.loss_mask is not None for s in chosen):
            lp = lp * _own_tokens(chosen, scores.mask)
        new = lp.sum(-1)
        old = torch.tensor([s.policy_logprob() for s in chosen], device=lp.device)
        adv = torch.tensor([advantages[i] for i in part], dtype=torch.float32, device=lp.device)
        loss = k15_loss(new, old, adv, torch.tensor([weights[i] for i in part], dtype=torch.float32,
                                                    device=lp.device), tau)
        loss.backward()
        total += float(loss.detach())
        if measures is not None:
            measures.add_residuals(adv - tau * (new.detach() - old))
            if measure_tokens:
                measures.add_tokens(chosen, scores)
    return total


def surrogate_backward(engine: TrainingEngine, samples: Sequence[Sample], advantages: Sequence[float],
                       weights: Sequence[float], objective: Objective, *, total_tokens: int, token_budget: int,
                       rank: int = 0, world: int = 1, max_items: int | None = None,
                       measures: Measures | None = None, measure_tokens: bool = False) -> float:
    """Accumulate the gradient of GRPO's or DAPO's clipped surrogate (``rl.algo.objectives``) in micro-batches;
    returns this rank's loss. ``weights``: per response, 1/(K·G) (GRPO) or 1 (DAPO), times any mismatch
    correction; ``total_tokens``: the minibatch's own tokens over all ranks (DAPO's token mean)."""
    total = 0.0
    for part, chosen, scores in _scored_parts(engine, samples, token_budget, rank, world, max_items):
        own = scores.mask & _own_tokens(chosen, scores.mask)
        old = _per_token(chosen, scores.mask)
        dev = scores.logprobs.device
        adv = torch.tensor([advantages[i] for i in part], dtype=torch.float32, device=dev)
        w = torch.tensor([weights[i] for i in part], dtype=torch.float32, device=dev)
        coef = token_weights(objective.kind, own, w, total_tokens)
        loss = clipped_surrogate(scores.logprobs, old, adv, coef, objective.clip_low, objective.clip_high)
        if objective.kl_coef:
            kl = kl_to_reference(scores.logprobs, _per_token_ref(chosen, scores.mask)) * own
            loss = loss + objective.kl_coef * (coef * kl).sum()
            if measures is not None:
                measures.kl_sum += float(kl.detach().sum())
                measures.kl_tokens += float(own.sum())
        loss.backward()
        total += float(loss.detach())
        if measures is not None:
            clipped, scored = clip_fraction(scores.logprobs, old, adv, own, objective.clip_low, objective.clip_high)
            measures.clipped += clipped
            measures.scored += scored
            if measure_tokens:
                measures.add_tokens(chosen, scores)
    return total


def _own_count(s: Sample) -> int:
    """The model's own tokens in a response."""
    return len(s.response_ids) if s.loss_mask is None else sum(s.loss_mask)


def shape_lengths(samples: Sequence[Sample], objective: Objective) -> list[Sample]:
    """DAPO's overlong shaping: each reward plus R_len of its response's length (unchanged otherwise)."""
    if objective.kind != "dapo" or not objective.overlong_buffer or objective.max_tokens is None:
        return list(samples)
    return [replace(s, reward=s.reward + overlong_penalty(_own_count(s), objective.max_tokens,
                                                          objective.overlong_buffer)) for s in samples]


@torch.no_grad()
def score_samples(engine: TrainingEngine, samples: Sequence[Sample], *, token_budget: int, rank: int = 0,
                  world: int = 1, max_items: int | None = None, measures: Measures | None = None) -> list[list[float]]:
    """Each sample's per-token log-probs under ``engine``'s weights, at its sampling temperature; each rank scores
    its share and the ranks exchange the results."""
    plans = plan_micro_batches(_lengths(samples), token_budget, world, max_items)
    offsets = [0]
    for s in samples:
        offsets.append(offsets[-1] + len(s.response_ids))
    flat = torch.zeros(offsets[-1], dtype=torch.float64)
    for part in plans[rank]:
        chosen = [samples[i] for i in part]
        scores = engine.score([s.prompt_ids for s in chosen], [s.response_ids for s in chosen],
                              [s.temperature for s in chosen])
        if measures is not None:
            measures.add_tokens(chosen, scores)
        lp = scores.logprobs.double().cpu()
        for row, i in enumerate(part):
            flat[offsets[i]:offsets[i + 1]] = lp[row, :len(samples[i].response_ids)]
    for _ in range(max(len(p) for p in plans) - len(plans[rank])):
        engine.dummy_forward()
    flat = torch.tensor(all_reduce_sum(flat.tolist()), dtype=torch.float64) if world > 1 else flat
    return [flat[offsets[i]:offsets[i + 1]].tolist() for i in range(len(samples))]


def recompute_old_logprobs(engine: TrainingEngine, samples: Sequence[Sample], *, token_budget: int, rank: int = 0,
                           world: int = 1, max_items: int | None = None,
                           measures: Measures | None = None) -> list[Sample]:
    """``samples`` with ``old_logprobs`` recomputed by the trainer's current weights (π_old as the trainer
    computes it, as verl does)."""
    fresh = score_samples(engine, samples, token_budget=token_budget, rank=rank, world=world, max_items=max_items,
                          measures=measures)
    return [replace(s, old_logprobs=lp) for s, lp in zip(samples, fresh, strict=True)]


def ptx_backward(engine: TrainingEngine, batch: PtxBatch, coef: float, *, token_budget: int, rank: int = 0,
                 world: int = 1, max_items: int | None = None) -> float:
    """Accumulate the gradient of coef · (token-mean NLL over the whole batch); returns this rank's share.

    Normalised by the batch's total response tokens (over all ranks), so the split does not matter.
    """
    n_tokens = sum(len(r) for r in batch.responses)
    total = 0.0
    lengths = [len(p) + len(r) for p, r in zip(batch.prompts, batch.responses, strict=True)]
    plans = plan_micro_batches(lengths, token_budget, world, max_items)
    for part in plans[rank]:
        loss = coef * nll_loss(engine, [batch.prompts[i] for i in part], [batch.responses[i] for i in part], n_tokens)
        loss.backward()
        total += float(loss.detach())
    for _ in range(max(len(p) for p in plans) - len(plans[rank])):
        engine.dummy_backward()
    return total


def rl_update(engine: TrainingEngine, samples: Sequence[Sample], *, tau: float, minibatches: int, token_budget: int,
              seed: int, ptx: Sequence[PtxBatch] = (), ptx_coef: float = 0.0, rank: int = 0, world: int = 1,
              max_items: int | None = None, drop_equal_groups: bool = True, recompute_old: bool = False,
              correction: Correction | None = None, objective: Objective | None = None,
              after_step: Callable[[], dict[str, float]] | None = None,
              reference: TrainingEngine | None = None) -> Iterator[dict[str, float]]:
    """Several optimizer steps on one rollout batch, one per minibatch of whole prompt groups.

    Every rank gets the same ``samples`` and trains on its share of each minibatch. ``ptx[j]``
    is mixed into step j with weight ``ptx_coef``. ``after_step`` runs after each optimizer step
    (QK-Clip). Yields each step's metrics (losses are this rank's shares) as it completes; the first
    step's also carry the iteration's diagnostics (``Measures``). ``drop_equal_groups`` leaves groups
    whose rewards are all equal out; with none left (and no PTX) nothing is stepped at all.
    ``recompute_old`` replaces the sampler's log π_old by the trainer's before the first step; ``correction``
    does too, then reweights (or masks) each sample by its ratio trainer/sampler (``rl.algo.mismatch``).
    ``objective``: K1.5 with ``tau`` (None, the default) or GRPO/DAPO (``rl.algo.objectives``); with its ``kl_coef``,
    ``reference`` (the reference policy's engine) scores the trained samples once, before the first step.
    """
    objective = objective or Objective("k15", tau=tau)
    samples = shape_lengths(samples, objective)
    adv = group_advantages(samples) if objective.kind == "k15" else normalized_advantages(samples)
    by_group: dict[int, list[int]] = defaultdict(list)
    for i, s in enumerate(samples):
        by_group[s.group].append(i)
    groups = informative_groups(samples) if drop_equal_groups else sorted(by_group)
    counts = {"groups_trained": float(len(groups)), "groups_equal_reward": float(len(by_group) - len(groups))}
    if not groups and not (ptx_coef > 0 and ptx):
        return
    pre = Measures()
    recompute_old = recompute_old or correction is not None
    factor: dict[int, float] = {}
    kept = [i for g in groups for i in by_group[g]]  # the samples trained on
    samples = list(samples)
    if recompute_old and groups:
        fresh = recompute_old_logprobs(engine, [samples[i] for i in kept], token_budget=token_budget, rank=rank,
                                       world=world, max_items=max_items, measures=pre)
        if correction is not None:
            fresh, factors, is_metrics = apply(fresh, [samples[i].old_logprobs for i in kept], correction)
            factor = dict(zip(kept, factors, strict=True))
            counts.update(is_metrics)
        for i, s in zip(kept, fresh, strict=True):
            samples[i] = s
    if objective.kl_coef and groups:
        if reference is None:
            raise ValueError("a KL penalty (kl_coef) needs the reference policy's engine")
        refs = score_samples(reference, [samples[i] for i in kept], token_budget=token_budget, rank=rank,
                             world=world, max_items=max_items)
        for i, lp in zip(kept, refs, strict=True):
            samples[i] = replace(samples[i], ref_logprobs=lp)
    plan = _minibatches(groups, minibatches, random.Random(seed)) if groups else [[]] * min(minibatches, len(ptx))
    for j, mb in enumerate(plan):
        idx = [i for g in mb for i in by_group[g]]
        # w = 1/(K_g · G): mean over each prompt's samples, then over the minibatch's prompts
        weights = [factor.get(i, 1.0) / (len(by_group[samples[i].group]) * len(mb)) for i in idx]
        measures = pre if j == 0 else Measures()
        chosen, first = [samples[i] for i in idx], j == 0 and not recompute_old
        if not idx:
            loss = 0.0
        elif objective.kind == "k15":
            loss = k15_backward(engine, chosen, [adv[i] for i in idx], weights, tau=objective.tau,
                                token_budget=token_budget, rank=rank, world=world, max_items=max_items,
                                measures=measures, measure_tokens=first)
        else:
            if objective.kind == "dapo":  # every token of the minibatch alike: only the correction weighs
                weights = [factor.get(i, 1.0) for i in idx]
            loss = surrogate_backward(engine, chosen, [adv[i] for i in idx], weights, objective,
                                      total_tokens=sum(map(_own_count, chosen)), token_budget=token_budget,
                                      rank=rank, world=world, max_items=max_items, measures=measures,
                                      measure_tokens=first)
        metrics = {"loss": loss}
        if ptx_coef > 0 and j < len(ptx):
            metrics["ptx_loss"] = ptx_backward(engine, ptx[j], ptx_coef, token_budget=token_budget, rank=rank,
                                               world=world, max_items=max_items) / ptx_coef
        metrics.update(measures.metrics(tokens=j == 0, residuals=bool(idx)))
        if j == 0:
            metrics.update(counts)
        metrics["grad_norm"] = engine.step()
        metrics.update({f"update_rms/{k}": v for k, v in engine.update_rms.items()})
        if after_step is not None:
            metrics.update(after_step())
        yield metrics


def nll_loss(engine: TrainingEngine, prompts, responses, n_tokens: int) -> torch.Tensor:
    """Summed NLL of the response tokens divided by ``n_tokens`` (token-mean over a minibatch)."""
    lp, _ = engine.response_logprobs(prompts, responses, temperature=1.0)
    return -lp.sum() / n_tokens


def sft_update(engine: TrainingEngine, prompts: Sequence[list[int]], responses: Sequence[list[int]],
               micro_batch: int) -> dict[str, float]:
    """One optimizer step of supervised fine-tuning on reference responses."""
    n_tokens = sum(len(r) for r in responses)
    total = 0.0
    for start in range(0, len(prompts), micro_batch):
        loss = nll_loss(engine, prompts[start : start + micro_batch], responses[start : start + micro_batch],
                        n_tokens)
        loss.backward()
        total += float(loss.detach())
    return {"loss": total, "grad_norm": engine.step()}
