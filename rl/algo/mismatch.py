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

Ratios are computed in log space (a long response's ρ overflows a float), on the device, for the samples a trainer
rank holds: each rank corrects its own share, and the metrics are reduced over ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class Correction:
    """How to correct: ``kind`` tis or mis, at ``level`` token or sequence, with cap C > 1."""

    kind: Literal["tis", "mis"]
    level: Literal["token", "sequence"]
    cap: float

    def __post_init__(self) -> None:
        if not self.cap > 1:
            raise ValueError(f"the importance-ratio cap must be > 1, got {self.cap}")


def correct(old: torch.Tensor, sampler: torch.Tensor, own: torch.Tensor, how: Correction
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sequence of [B, T] per-token log-probs (the trainer's ``old``, the sampler's; ``own`` the model's own
    tokens): its loss-weight factor [B] and its own-token mask after the correction (token-level MIS masks tokens
    out; otherwise it is ``own``), and the partial sums of the metrics, in this order: Σρ, sequences, out-of-range
    units, units, min ρ, max ρ (``metrics`` reads them once reduced over ranks). Nothing here reads the device."""
    log_c = math.log(how.cap)
    delta = torch.where(own, old.double() - sampler.double(), 0.0)  # Δ_t on the model's own tokens
    log_rho = delta.sum(-1)
    if how.level == "sequence":
        out_of_range = log_rho > log_c if how.kind == "tis" else log_rho.abs() > log_c
        hit, units = out_of_range.sum(), torch.tensor(float(len(log_rho)), device=old.device)
        factor = torch.exp(log_rho.clamp(max=log_c)) if how.kind == "tis" else (~out_of_range).double()
        new_own = own
    elif how.kind == "tis":
        hit, units = ((delta > log_c) & own).sum(), own.sum()
        factor, new_own = torch.exp(delta.clamp(max=log_c).sum(-1)), own
    else:
        outside = (delta.abs() > log_c) & own
        hit, units, factor, new_own = outside.sum(), own.sum(), torch.ones_like(log_rho), own & ~outside
    rho = torch.exp(log_rho.clamp(max=50.0))
    inf = torch.tensor(float("inf"), dtype=torch.float64, device=old.device)
    stats = torch.stack([rho.sum(), torch.tensor(float(len(rho)), dtype=torch.float64, device=old.device),
                         hit.double(), units.double(), rho.min() if len(rho) else inf,
                         rho.max() if len(rho) else -inf])
    return factor.float(), new_own, stats


def metrics(stats: list[float], how: Correction) -> dict[str, float]:
    """The correction's metrics from partial sums reduced over ranks: the sequence ratio's mean, min and max, and
    the share of sequences (or tokens, at token level) truncated (TIS) or masked out (MIS)."""
    rho_sum, n, hit, units, rho_min, rho_max = stats
    if not n:
        return {}
    return {"is_ratio_mean": rho_sum / n, "is_ratio_min": rho_min, "is_ratio_max": rho_max,
            f"is_{'truncated' if how.kind == 'tis' else 'masked'}_share": hit / max(units, 1)}
