"""The pod backend's client-side rate limit of pod creations (sandbox.kubernetes.max_creates_per_s)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class TokenBucket:
    """A client-side rate limit: ``acquire`` blocks so that calls average ``rate`` per second, bursts ≤ ``burst``."""

    def __init__(self, rate: float, burst: float | None = None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        if rate <= 0:
            raise ValueError("rate must be positive")
        self.rate, self.burst = float(rate), float(burst if burst is not None else max(1.0, rate))
        self._clock, self._sleep = clock, sleep
        self._tokens, self._last = self.burst, clock()
        self._lock = threading.Lock()

    def acquire(self) -> float:
        """Take one token, waiting for it if needed; returns the seconds waited."""
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= 1  # a reservation: waiters queue up behind each other instead of racing
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            self._sleep(wait)
        return wait
