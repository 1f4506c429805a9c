"""Seconds between points of a training step, measured without making the host wait for the device.

On CUDA a mark is an event recorded on the current stream (no wait); the seconds between two marks are read once
both have run, which the step's next host read of a device value guarantees (``engines.training.readback``), so
reading them adds no wait of its own. Elsewhere (CPU: every op runs before the host moves on) a mark is the host's
clock.
"""

from __future__ import annotations

import time

import torch

#: the host clock of a mark off CUDA
clock = time.perf_counter


class Mark:
    """One point in the device's timeline (a CUDA event) or the host's (a perf_counter reading)."""

    def __init__(self, device: torch.device) -> None:
        if device.type == "cuda":
            self._event: torch.cuda.Event | None = torch.cuda.Event(enable_timing=True)
            self._event.record()
            self._t = 0.0
        else:
            self._event = None
            self._t = clock()

    def seconds_to(self, later: Mark) -> float:
        """Seconds from this mark to ``later``; on CUDA waits for ``later``'s event if it has not run yet (it has,
        once any value queued after it was read)."""
        if self._event is None or later._event is None:
            return later._t - self._t
        later._event.synchronize()
        return self._event.elapsed_time(later._event) / 1e3


class StepTiming:
    """A step's marks: its first differentiable forward (None: the step had none), the step's start (after the
    last backward was queued) and the end of its optimizer step."""

    def __init__(self, forward: Mark | None, start: Mark, end: Mark) -> None:
        self.forward, self.start, self.end = forward, start, end

    def seconds(self) -> dict[str, float]:
        """``fwd_bwd_s``: from the first differentiable forward to the step's start (the micro-batches' forwards
        and backwards, the gaps between them included); ``optimizer_s``: the step itself (gradient clipping,
        every optimizer, QK-Clip)."""
        out = {"optimizer_s": self.start.seconds_to(self.end)}
        if self.forward is not None:
            out["fwd_bwd_s"] = self.forward.seconds_to(self.start)
        return out
