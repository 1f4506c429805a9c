"""Sampling-temperature schedules: high early (exploration), lower late (exploitation)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal


def temperature_at(schedule: str, start: float, end: float, iteration: int, total: int) -> float:
    """Temperature for ``iteration`` (0-based) of ``total``, moving from ``start`` to ``end``."""
    frac = min(1.0, iteration / max(1, total - 1))
    if schedule == "constant":
        return start
    if schedule == "linear":
        return start + (end - start) * frac
    if schedule == "cosine":
        return end + (start - end) * 0.5 * (1 + math.cos(math.pi * frac))
    if schedule == "exponential":
        return start * (end / start) ** frac
    raise ValueError(f"unknown temperature schedule {schedule!r}")


@dataclass(frozen=True)
class Schedule:
    """A temperature schedule over a run of ``iterations``."""

    kind: Literal["constant", "linear", "cosine", "exponential"]
    start: float
    end: float
    iterations: int

    def at(self, iteration: int) -> float:
        """The temperature of ``iteration``."""
        return temperature_at(self.kind, self.start, self.end, iteration, self.iterations)
