"""Device values brought to the host together: each host read of a device value waits for every kernel queued before
it, so the trainer queues a step's metrics and reads them in one copy, alongside a read it has to make anyway.
"""

from __future__ import annotations

import torch


class Deferred:
    """The values of one queued device tensor, flattened to floats; ``values`` before they were read reads the
    whole queue (one wait)."""

    def __init__(self, reads: HostReads, values: list[float] | None = None) -> None:
        self._reads = reads
        self._values = values

    @property
    def values(self) -> list[float]:
        """The values as Python floats (reads the queue if they are not on the host yet)."""
        if self._values is None:
            self._reads.flush()
        assert self._values is not None
        return self._values


class HostReads:
    """A queue of device tensors that ``flush`` reads to the host in one device-to-host copy."""

    def __init__(self) -> None:
        self._queue: list[tuple[torch.Tensor, Deferred]] = []

    def defer(self, value: torch.Tensor | float) -> Deferred:
        """Queue ``value`` (a tensor of any shape; a Python number is ready at once) for the next ``flush``."""
        if not isinstance(value, torch.Tensor):
            return Deferred(self, [float(value)])
        out = Deferred(self)
        self._queue.append((value.detach().reshape(-1), out))
        return out

    def flush(self) -> None:
        """Read every queued tensor to the host in one copy (float64: exact for float32 and counts below 2**53)."""
        if not self._queue:
            return
        queue, self._queue = self._queue, []
        device = queue[0][0].device
        flat = torch.cat([t.to(device, torch.float64) for t, _ in queue]).tolist()
        start = 0
        for t, out in queue:
            out._values = flat[start:start + t.numel()]
            start += t.numel()
