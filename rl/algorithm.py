"""The K1.5 objective (report 3.2.3) and the update loops that apply it.

For each prompt x with K samples: L = 1/K Σ_i (r_i − r̄ − τ·(log π_θ(y_i|x) − log π_old(y_i|x)))²,
averaged over prompts; log π is the sum over the response's tokens. The SFT/PTX loss is the
token-mean negative log-likelihood of reference responses. Total loss of a step: L_RL + λ_ptx·L_PTX.
With several ranks every rank sees the same batch and trains on its share; loss weights are
normalised over the whole batch and gradients are summed across ranks (FSDP), so the update does
not depend on how the batch is split over ranks or micro-batches.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
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
    temperature: float = 1.0   # what it was sampled at; the recompute uses the same
    # Multi-turn: 1 for the model's own tokens, 0 for what the environment inserted (tool results, user turns),
    # which are context only; None = every response token is the model's.
    loss_mask: list[int] | None = None

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


def micro_batches(n_items: int, micro_batch: int, rank: int, world: int) -> tuple[list[range], int]:
    """This rank's micro-batches of its share (items rank, rank+world, ...) and how many passes
    every rank must run: with FSDP each forward/backward is collective, so ranks pad to the most."""
    mine = list(range(rank, n_items, world))
    share = -(-n_items // world)  # rank 0 holds the most: ceil(n / world) items
    passes = -(-share // micro_batch)
    return [mine[i : i + micro_batch] for i in range(0, len(mine), micro_batch)], passes


def k15_backward(engine: TrainingEngine, samples: Sequence[Sample], advantages: Sequence[float],
                 weights: Sequence[float], *, tau: float, micro_batch: int, rank: int = 0, world: int = 1) -> float:
    """Accumulate the gradient of Σ_i w_i·(A_i − τ·δ_i)² in micro-batches; returns this rank's loss.

    The loss is a weighted sum over sequences with weights normalised over the whole minibatch
    (all ranks), so any micro-batch split and any number of ranks give the same gradient.
    """
    total = 0.0
    parts, passes = micro_batches(len(samples), micro_batch, rank, world)
    for part in parts:
        chosen = [samples[i] for i in part]
        lp, target = engine.response_logprobs([s.prompt_ids for s in chosen], [s.response_ids for s in chosen],
                                              [s.temperature for s in chosen])
        if any(s.loss_mask is not None for s in chosen):
            lp = lp * _token_mask(chosen, target)
        loss = k15_loss(
            lp.sum(-1),
            torch.tensor([s.policy_logprob() for s in chosen], device=lp.device),
            torch.tensor([advantages[i] for i in part], dtype=torch.float32, device=lp.device),
            torch.tensor([weights[i] for i in part], dtype=torch.float32, device=lp.device),
            tau,
        )
        loss.backward()
        total += float(loss.detach())
    for _ in range(passes - len(parts)):
        engine.dummy_backward()
    return total


def _token_mask(samples: Sequence[Sample], target: torch.Tensor) -> torch.Tensor:
    """Each sample's loss mask laid over the response positions of ``response_logprobs``' [B, T-1] layout."""
    mask = torch.zeros(target.shape, dtype=torch.float32, device=target.device)
    for b, s in enumerate(samples):
        row = s.loss_mask if s.loss_mask is not None else [1] * len(s.response_ids)
        mask[b, target[b].bool()] = torch.as_tensor(row, dtype=torch.float32, device=target.device)
    return mask


def ptx_backward(engine: TrainingEngine, batch: PtxBatch, coef: float, *, micro_batch: int, rank: int = 0,
                 world: int = 1) -> float:
    """Accumulate the gradient of coef · (token-mean NLL over the whole batch); returns this rank's share.

    Normalised by the batch's total response tokens (over all ranks), so the split does not matter.
    """
    n_tokens = sum(len(r) for r in batch.responses)
    total = 0.0
    parts, passes = micro_batches(len(batch.prompts), micro_batch, rank, world)
    for part in parts:
        loss = coef * nll_loss(engine, [batch.prompts[i] for i in part], [batch.responses[i] for i in part], n_tokens)
        loss.backward()
        total += float(loss.detach())
    for _ in range(passes - len(parts)):
        engine.dummy_backward()
    return total


def rl_update(engine: TrainingEngine, samples: Sequence[Sample], *, tau: float, minibatches: int, micro_batch: int,
              seed: int, ptx: Sequence[PtxBatch] = (), ptx_coef: float = 0.0, rank: int = 0, world: int = 1,
              after_step: Callable[[], dict[str, float]] | None = None) -> Iterator[dict[str, float]]:
    """Several optimizer steps on one rollout batch, one per minibatch of whole prompt groups.

    Every rank gets the same ``samples`` and trains on its share of each minibatch. ``ptx[j]``
    is mixed into step j with weight ``ptx_coef``. ``after_step`` runs after each optimizer step
    (QK-Clip). Yields each step's metrics (losses are this rank's shares) as it completes.
    """
    adv = group_advantages(samples)
    by_group: dict[int, list[int]] = defaultdict(list)
    for i, s in enumerate(samples):
        by_group[s.group].append(i)
    for j, mb in enumerate(_minibatches(sorted(by_group), minibatches, random.Random(seed))):
        idx = [i for g in mb for i in by_group[g]]
        # w = 1/(K_g · G): mean over each prompt's samples, then over the minibatch's prompts
        weights = [1.0 / (len(by_group[samples[i].group]) * len(mb)) for i in idx]
        loss = k15_backward(engine, [samples[i] for i in idx], [adv[i] for i in idx], weights,
                            tau=tau, micro_batch=micro_batch, rank=rank, world=world)
        metrics = {"loss": loss}
        if ptx_coef > 0 and j < len(ptx):
            metrics["ptx_loss"] = ptx_backward(engine, ptx[j], ptx_coef, micro_batch=micro_batch, rank=rank,
                                               world=world) / ptx_coef
        metrics["grad_norm"] = engine.step()
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
