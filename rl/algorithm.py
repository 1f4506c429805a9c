"""The K1.5 objective (report 3.2.3) and the update loops that apply it.

For each prompt x with K samples: L = 1/K Σ_i (r_i − r̄ − τ·(log π_θ(y_i|x) − log π_old(y_i|x)))²,
averaged over prompts; log π is the sum over the response's tokens. The SFT/PTX loss is the
token-mean negative log-likelihood of reference responses.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from engines.training import TrainingEngine


@dataclass
class Sample:
    """One trajectory as the trainer sees it."""

    group: int                 # index of the prompt it answers; K samples share a group
    prompt_ids: list[int]
    response_ids: list[int]
    old_logprobs: list[float]  # per token, from the sampler (π_old)
    reward: float


def k15_loss(new_logp: torch.Tensor, old_logp: torch.Tensor, advantage: torch.Tensor,
             weight: torch.Tensor, tau: float) -> torch.Tensor:
    """Σ_i w_i (A_i − τ(log π_θ − log π_old)_i)² over sequences; w sums to 1 over a minibatch."""
    return (weight * (advantage - tau * (new_logp - old_logp)) ** 2).sum()


def group_advantages(samples: Sequence[Sample]) -> list[float]:
    """r − r̄(x): each reward minus the mean reward of its prompt's samples."""
    by_group: dict[int, list[float]] = defaultdict(list)
    for s in samples:
        by_group[s.group].append(s.reward)
    mean = {g: sum(r) / len(r) for g, r in by_group.items()}
    return [s.reward - mean[s.group] for s in samples]


def _minibatches(groups: list[int], n: int, rng: random.Random) -> list[list[int]]:
    groups = groups[:]
    rng.shuffle(groups)
    n = max(1, min(n, len(groups)))
    return [groups[i::n] for i in range(n)]


def k15_backward(engine: TrainingEngine, samples: Sequence[Sample], advantages: Sequence[float],
                 weights: Sequence[float], *, tau: float, temperature: float, micro_batch: int) -> float:
    """Accumulate the gradient of Σ_i w_i·(A_i − τ·δ_i)² in micro-batches; returns the loss.

    The loss is a weighted sum over sequences, so any micro-batch split gives the same gradient.
    """
    total = 0.0
    for start in range(0, len(samples), micro_batch):
        part = samples[start : start + micro_batch]
        lp, _ = engine.response_logprobs([s.prompt_ids for s in part], [s.response_ids for s in part], temperature)
        loss = k15_loss(
            lp.sum(-1),
            torch.tensor([sum(s.old_logprobs) for s in part]),
            torch.tensor(advantages[start : start + micro_batch], dtype=torch.float32),
            torch.tensor(weights[start : start + micro_batch], dtype=torch.float32),
            tau,
        )
        loss.backward()
        total += float(loss.detach())
    return total


def rl_update(engine: TrainingEngine, samples: Sequence[Sample], *, tau: float, temperature: float,
              minibatches: int, micro_batch: int, seed: int) -> Iterator[dict[str, float]]:
    """Several optimizer steps on one rollout batch, one per minibatch of whole prompt groups.

    Yields each step's loss and gradient norm as it completes.
    """
    adv = group_advantages(samples)
    by_group: dict[int, list[int]] = defaultdict(list)
    for i, s in enumerate(samples):
        by_group[s.group].append(i)
    for mb in _minibatches(sorted(by_group), minibatches, random.Random(seed)):
        idx = [i for g in mb for i in by_group[g]]
        # w = 1/(K_g · G): mean over each prompt's samples, then over the minibatch's prompts
        weights = [1.0 / (len(by_group[samples[i].group]) * len(mb)) for i in idx]
        loss = k15_backward(engine, [samples[i] for i in idx], [adv[i] for i in idx], weights,
                            tau=tau, temperature=temperature, micro_batch=micro_batch)
        yield {"loss": loss, "grad_norm": engine.step()}


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
