"""The policy objectives (``algorithm.objective``): Kimi K1.5's squared residual (report 3.2.3), GRPO and DAPO.

K1.5, for each prompt x with K samples: L = 1/K Σ_i (r_i − r̄ − τ·(log π_θ(y_i|x) − log π_old(y_i|x)))², averaged over
prompts; log π is the sum over the response's (own) tokens, r̄ the mean reward of the K samples. There is no KL to a
reference model: the τ term holds each update near the sampling policy.

Both score each response token against the sampler's (or the trainer's recomputed) log π_old with the ratio
ρ_{i,t} = π_θ(y_{i,t} | x, y_{i,<t}) / π_old(y_{i,t} | x, y_{i,<t}), and a group-normalised advantage
Â_i = (r_i − mean_K(r)) / (std_K(r) + ε) over the K samples of each prompt.

GRPO (Shao et al., DeepSeekMath, 2024), each response's tokens averaged, then the responses:
    L = −1/G Σ_x 1/K Σ_i 1/|y_i| Σ_t [min(ρ_{i,t}·Â_i, clip(ρ_{i,t}, 1 − ε, 1 + ε)·Â_i) − β·D_{i,t}]
with its optional KL penalty against a reference policy π_ref (the model the run started from), GRPO's unbiased
per-token estimator D_{i,t} = π_ref/π_θ − log(π_ref/π_θ) − 1 ≥ 0 (the "k3" estimator of KL(π_θ ‖ π_ref)), weighted
as the surrogate's tokens are; β = ``algorithm.kl_coef``, 0 (off) by default, as DAPO and most recent recipes do.

DAPO (Yu et al., 2025): the same surrogate with clip-higher (ε_low < ε_high, so unlikely tokens can gain
probability), averaged over every token of the minibatch at once (long responses weigh by their length):
    L = −1/Σ_i |y_i| · Σ_i Σ_t min(ρ_{i,t}·Â_i, clip(ρ_{i,t}, 1 − ε_low, 1 + ε_high)·Â_i),
dynamic sampling (groups whose rewards are all equal carry no advantage and are dropped:
``algorithm.drop_equal_reward_groups``) and overlong reward shaping with a buffer of L_c tokens before the
budget L_max: R_len(L) = 0 for L ≤ L_max − L_c, ((L_max − L_c) − L) / L_c for L_max − L_c < L ≤ L_max, −1 beyond.

Only the model's own tokens count (a multi-turn loss mask leaves the environment's out); a mismatch
correction's per-sequence factor multiplies each response's weight.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rl.sample import Sample

OBJECTIVES = ("k15", "grpo", "dapo")
STD_EPS = 1e-6  # keeps Â finite for a group of nearly equal rewards


@dataclass(frozen=True)
class Objective:
    """Which loss an update minimises and its constants (``AlgorithmConfig.objective_settings``)."""

    kind: str = "k15"
    tau: float = 1.0               # K1.5
    clip_low: float = 0.2          # GRPO/DAPO: ε, ε_low
    clip_high: float = 0.2         # DAPO: ε_high
    overlong_buffer: int = 0       # DAPO: L_c (0: no length shaping)
    max_tokens: int | None = None  # DAPO: L_max, the response budget
    kl_coef: float = 0.0           # GRPO/DAPO: β of the KL penalty against the reference policy (0: none)

    def __post_init__(self) -> None:
        if self.kind not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.kind!r}")
        if self.kl_coef and self.kind == "k15":
            raise ValueError("a KL penalty (kl_coef) is for grpo and dapo; K1.5's τ term holds its update near π_old")


def group_stats(samples: Sequence[Sample]) -> dict[int, tuple[float, float]]:
    """Per prompt group, (mean, population std) of its samples' rewards."""
    by_group: dict[int, list[float]] = defaultdict(list)
    for s in samples:
        by_group[s.group].append(s.reward)
    stats = {}
    for g, r in by_group.items():
        mean = sum(r) / len(r)
        stats[g] = (mean, math.sqrt(sum((x - mean) ** 2 for x in r) / len(r)))
    return stats


def group_advantages(samples: Sequence[Sample]) -> list[float]:
    """K1.5's r − r̄(x): each reward minus the mean reward of its prompt's samples."""
    stats = group_stats(samples)
    return [s.reward - stats[s.group][0] for s in samples]


def normalized_advantages(samples: Sequence[Sample]) -> list[float]:
    """Â = (r − mean) / (std + ε) within each prompt's group (population std, as GRPO's reference code)."""
    stats = group_stats(samples)
    return [(s.reward - stats[s.group][0]) / (stats[s.group][1] + STD_EPS) for s in samples]


def k15_loss(new_logp: torch.Tensor, old_logp: torch.Tensor, advantage: torch.Tensor,
             weight: torch.Tensor, tau: float) -> torch.Tensor:
    """Σ_i w_i (A_i − τ(log π_θ − log π_old)_i)² over sequences; w sums to 1 over a minibatch."""
    return (weight * (advantage - tau * (new_logp - old_logp)) ** 2).sum()


def overlong_penalty(length: int, max_tokens: int, buffer: int) -> float:
    """DAPO's soft length penalty R_len of a response of ``length`` tokens under a budget of ``max_tokens``."""
    if buffer <= 0 or length <= max_tokens - buffer:
        return 0.0
    if length <= max_tokens:
        return ((max_tokens - buffer) - length) / buffer
    return -1.0


def token_weights(kind: str, own: torch.Tensor, seq_weights: torch.Tensor,
                  total_tokens: torch.Tensor | int) -> torch.Tensor:
    """c_{i,t} [B, T] such that the loss is −Σ c·min(...), over the model's own tokens (``own``). GRPO: each
    response's tokens averaged, times ``seq_weights`` (1/(K·G), times any mismatch correction). DAPO: every own
    token of the minibatch (``total_tokens``, all ranks; a device tensor or a number) alike, times ``seq_weights``
    (the correction alone)."""
    own = own.float()
    if kind == "grpo":
        return own * (seq_weights / own.sum(-1).clamp(min=1))[:, None]
    total = total_tokens.clamp(min=1) if isinstance(total_tokens, torch.Tensor) else max(total_tokens, 1)
    return own * (seq_weights / total)[:, None]


def clipped_surrogate(new: torch.Tensor, old: torch.Tensor, advantage: torch.Tensor, coef: torch.Tensor,
                      clip_low: float, clip_high: float) -> torch.Tensor:
    """−Σ_{i,t} c_{i,t} · min(ρ·Â_i, clip(ρ, 1 − ε_low, 1 + ε_high)·Â_i), ρ = exp(new − old); all [B, T] but Â [B]."""
    ratio = torch.exp(new - old)
    a = advantage[:, None]
    surrogate = torch.minimum(ratio * a, ratio.clamp(1 - clip_low, 1 + clip_high) * a)
    return -(coef * surrogate).sum()


def clip_fraction(new: torch.Tensor, old: torch.Tensor, advantage: torch.Tensor, own: torch.Tensor,
                  clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens whose gradient the clip stopped, own tokens), on the device: the share PPO-style runs watch."""
    ratio = torch.exp(new.detach() - old)
    a = advantage[:, None]
    clipped = ((ratio > 1 + clip_high) & (a > 0)) | ((ratio < 1 - clip_low) & (a < 0))
    return (clipped & own).sum(), own.sum()


def kl_to_reference(new: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """D = π_ref/π_θ − log(π_ref/π_θ) − 1 per token (k3: unbiased for KL(π_θ ‖ π_ref), never negative); all [B, T]."""
    delta = ref - new
    return torch.exp(delta) - delta - 1
