"""Timing shared by the benchmarks: the best of a few synchronised runs of one operation."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch

from engines.device import synchronize

_T0 = time.perf_counter()


def say(tag: str, msg: str) -> None:
    """One progress line on stderr with the seconds since the process started: when a step is cut at its time
    limit (a leased GPU), its output shows where it was."""
    print(f"[{tag} {time.perf_counter() - _T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


def best_seconds(fn: Callable[[], object], device: torch.device, tries: int) -> float:
    """The shortest wall time of ``tries`` calls of ``fn``, each between two device synchronisations."""
    best = float("inf")
    for _ in range(tries):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best
