"""An update planned on the driver: who trains which sample in which optimizer step, and with what weight.

Everything that needs the whole batch is decided here, once: DAPO's length shaping, the advantages (per prompt
group), which groups carry signal, the split of the groups into minibatches (one optimizer step each), each
sample's loss weight (normalised over the whole minibatch, so the update does not depend on how it is split over
ranks or packed into micro-batches) and every rank's micro-batches, formed by tokens. Each trainer rank then
receives only its share (``RankBatch``) and never sees the rest.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from rl.algo.objectives import Objective, group_advantages, normalized_advantages, overlong_penalty
from rl.sample import Sample
from rl.settings import UpdateSettings


@dataclass
class PtxBatch:
    """Curated (prompt, response) token ids for the PTX loss of one optimizer step."""

    prompts: list[list[int]]
    responses: list[list[int]]


@dataclass(kw_only=True)
class PtxShare:
    """One rank's part of a step's PTX batch: its sequences, their micro-batches, the passes of the busiest rank and
    the batch's response tokens over all ranks (the token mean's denominator)."""

    prompts: list[list[int]]
    responses: list[list[int]]
    parts: list[list[int]]
    passes: int
    tokens: int


@dataclass(kw_only=True)
class RankBatch:
    """One trainer rank's share of an update. ``steps[j]``: this rank's micro-batches of optimizer step j, as indices
    into ``samples``; ``passes[j]``: the micro-batches of step j's busiest rank (every rank runs as many, padding
    with dummy passes: FSDP's collectives must match); ``tokens[j]``: the own tokens of step j's minibatch over all
    ranks (DAPO's token mean)."""

    samples: list[Sample]
    advantages: list[float]
    weights: list[float]
    steps: list[list[list[int]]]
    passes: list[int]
    tokens: list[int]
    ptx: list[PtxShare | None] = field(default_factory=list)
    counts: dict[str, float] = field(default_factory=dict)

    @property
    def scoring_passes(self) -> int:
        """No-grad passes every rank runs to score all its micro-batches once (the recompute, the reference)."""
        return sum(self.passes)


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


def shape_lengths(samples: Sequence[Sample], objective: Objective) -> list[Sample]:
    """DAPO's overlong shaping: each reward plus R_len of its response's length (unchanged otherwise)."""
    if objective.kind != "dapo" or not objective.overlong_buffer or objective.max_tokens is None:
        return list(samples)
    return [replace(s, reward=s.reward + overlong_penalty(s.own_tokens(), objective.max_tokens,
                                                          objective.overlong_buffer)) for s in samples]


def _minibatches(groups: list[int], n: int, rng: random.Random) -> list[list[int]]:
    groups = groups[:]
    rng.shuffle(groups)
    n = max(1, min(n, len(groups)))
    return [groups[i::n] for i in range(n)]


def _lengths(samples: Sequence[Sample]) -> list[int]:
    return [len(s.prompt_ids) + len(s.response_ids) for s in samples]


def ptx_shares(batch: PtxBatch, world: int, token_budget: int, max_items: int | None) -> list[PtxShare]:
    """Each rank's part of a step's PTX batch, its micro-batches formed by tokens as the RL samples' are."""
    lengths = [len(p) + len(r) for p, r in zip(batch.prompts, batch.responses, strict=True)]
    plans = plan_micro_batches(lengths, token_budget, world, max_items)
    passes, tokens = max(len(p) for p in plans), sum(len(r) for r in batch.responses)
    out = []
    for plan in plans:
        mine = sorted(i for part in plan for i in part)
        where = {i: k for k, i in enumerate(mine)}
        out.append(PtxShare(prompts=[batch.prompts[i] for i in mine], responses=[batch.responses[i] for i in mine],
                            parts=[[where[i] for i in part] for part in plan], passes=passes, tokens=tokens))
    return out


def plan_update(samples: Sequence[Sample], settings: UpdateSettings, world: int, seed: int,
                ptx: Sequence[PtxBatch] = ()) -> list[RankBatch]:
    """Every rank's share of the update of ``samples`` (plus ``ptx[j]`` mixed into step j), or [] when there is
    nothing to step: no group with signal (``drop_equal_groups``) and no PTX."""
    objective = settings.objective
    samples = shape_lengths(samples, objective)
    adv = group_advantages(samples) if objective.kind == "k15" else normalized_advantages(samples)
    by_group: dict[int, list[int]] = defaultdict(list)
    for i, s in enumerate(samples):
        by_group[s.group].append(i)
    groups = informative_groups(samples) if settings.drop_equal_groups else sorted(by_group)
    counts = {"groups_trained": float(len(groups)), "groups_equal_reward": float(len(by_group) - len(groups))}
    use_ptx = settings.ptx_coef > 0 and len(ptx) > 0
    if not groups and not use_ptx:
        return []
    steps = _minibatches(groups, settings.minibatches, random.Random(seed)) if groups else \
        [[]] * min(settings.minibatches, len(ptx))
    ranks = [RankBatch(samples=[], advantages=[], weights=[], steps=[], passes=[], tokens=[], counts=counts)
             for _ in range(world)]
    owner: list[dict[int, int]] = [{} for _ in range(world)]  # sample index -> its index in the rank's list
    for j, mb in enumerate(steps):
        idx = [i for g in mb for i in by_group[g]]
        chosen = [samples[i] for i in idx]
        plans = plan_micro_batches(_lengths(chosen), settings.micro_batch_tokens, world, settings.micro_batch)
        tokens = sum(s.own_tokens() for s in chosen)
        for r, rank in enumerate(ranks):
            parts = []
            for part in plans[r]:
                mine = []
                for k in part:
                    i = idx[k]
                    if i not in owner[r]:
                        owner[r][i] = len(rank.samples)
                        rank.samples.append(samples[i])
                        rank.advantages.append(adv[i])
                        # K1.5/GRPO: 1/(K_g · G), the mean over each prompt's samples, then over the minibatch's
                        # prompts; DAPO weighs every token of the minibatch alike (tokens[j])
                        rank.weights.append(1.0 if objective.kind == "dapo" else
                                            1.0 / (len(by_group[samples[i].group]) * len(mb)))
                    mine.append(owner[r][i])
                parts.append(mine)
            rank.steps.append(parts)
            rank.passes.append(max(len(p) for p in plans))
            rank.tokens.append(tokens)
            rank.ptx.append(None)
        if use_ptx and j < len(ptx):
            for rank, share in zip(ranks, ptx_shares(ptx[j], world, settings.micro_batch_tokens,
                                                      settings.micro_batch), strict=True):
                rank.ptx[j] = share
    return ranks
