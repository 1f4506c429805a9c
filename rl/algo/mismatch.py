"""Correcting the train–inference mismatch: samples drawn by the sampler, trained as if drawn by π_old.

Another engine's kernels (vLLM's) give the sampler probabilities π_s that differ from those the trainer
computes for the same weights, π_old. The K1.5 objective is an expectation over y ~ π_old, so a sample
is reweighted by its importance ratio, from per-token log-ratios Δ_t = log π_old,t − log π_s,t over the
model's own tokens:

    ρ = π_old(y|x) / π_s(y|x) = exp Σ_t Δ_t

- TIS, truncated importance sampling (F. Yao et al., "Your Efficient RL Framework Secretly Brings You
  Off-Policy RL Training", 2025): the sequence's loss weight × min(ρ, C) (sequence level), or
  × Π_t min(exp Δ_t, C) (token level: each token's ratio truncated before the product).
- MIS, masked importance sampling (J. Liu et al., "When Speed Kills Stability: Demystifying RL Collapse
  from the Training-Inference Mismatch", 2025): a sequence whose ρ leaves [1/C, C] is left out
  (weight 0; sequence level), or a token whose exp Δ_t leaves [1/C, C] is left out of the sequence's
  log-probabilities, both π_θ's and π_old's (loss mask 0; token level).

Ratios are computed in log space (a long response's ρ overflows a float). Every rank computes the same
corrections from the same (all-reduced) recompute, so sharded training stays exact.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal


@dataclass(frozen=True)
class Correction:
    """How to correct: ``kind`` tis or mis, at ``level`` token or sequence, with cap C > 1."""

    kind: Literal["tis", "mis"]
    level: Literal["token", "sequence"]
    cap: float

    def __post_init__(self) -> None:
        if not self.cap > 1:
            raise ValueError(f"the importance-ratio cap must be > 1, got {self.cap}")


def own_log_ratios(old: Sequence[float], sampler: Sequence[float], mask: Sequence[int] | None) -> list[float]:
    """Δ_t = log π_old,t − log π_s,t for each of the model's own tokens (``mask`` 1; None: every token)."""
    own = mask if mask is not None else [1] * len(old)
    return [o - s for o, s, m in zip(old, sampler, own, strict=True) if m]


def correct(old: Sequence[Sequence[float]], sampler: Sequence[Sequence[float]],
            masks: Sequence[Sequence[int] | None], how: Correction
            ) -> tuple[list[float], list[Sequence[int] | None], dict[str, float]]:
    """Per sequence: its loss-weight factor and its loss mask after the correction (token-level MIS masks
    tokens out; otherwise the mask is as given), and the metrics: the sequence ratio's mean, min and max,
    and the share of sequences (or tokens, at token level) truncated (TIS) or masked out (MIS)."""
    log_c = math.log(how.cap)
    factors, new_masks, log_rhos = [], [], []
    hit = units = 0
    for o, s, m in zip(old, sampler, masks, strict=True):
        deltas = own_log_ratios(o, s, m)
        log_rho = sum(deltas)
        log_rhos.append(log_rho)
        if how.level == "sequence":
            units += 1
            out_of_range = log_rho > log_c if how.kind == "tis" else abs(log_rho) > log_c
            hit += out_of_range
            factor = math.exp(min(log_rho, log_c)) if how.kind == "tis" else float(not out_of_range)
            factors.append(factor)
            new_masks.append(m)
            continue
        units += len(deltas)
        if how.kind == "tis":
            hit += sum(d > log_c for d in deltas)
            factors.append(math.exp(sum(min(d, log_c) for d in deltas)))
            new_masks.append(m)
        else:
            row = list(m) if m is not None else [1] * len(o)
            for t, (ot, st) in enumerate(zip(o, s, strict=True)):
                if row[t] and abs(ot - st) > log_c:
                    row[t] = 0
                    hit += 1
            factors.append(1.0)
            new_masks.append(row)
    rhos = [math.exp(min(x, 50.0)) for x in log_rhos]
    metrics = {"is_ratio_mean": sum(rhos) / len(rhos), "is_ratio_min": min(rhos), "is_ratio_max": max(rhos),
               f"is_{'truncated' if how.kind == 'tis' else 'masked'}_share": hit / max(units, 1)} if rhos else {}
    return factors, new_masks, metrics


def apply(samples: Sequence, sampler: Sequence[Sequence[float]], how: Correction) -> tuple[list, list[float], dict]:
    """``samples`` (their ``old_logprobs`` the trainer's recompute) with token-level MIS masks applied, each one's
    loss-weight factor, and the metrics (``correct``); ``sampler`` is each sample's sampler log-probs."""
    factors, masks, metrics = correct([s.old_logprobs for s in samples], sampler, [s.loss_mask for s in samples],
                                      how)
    if how.kind == "mis" and how.level == "token":
        samples = [replace(s, loss_mask=m) for s, m in zip(samples, masks, strict=True)]
    return list(samples), factors, metrics
