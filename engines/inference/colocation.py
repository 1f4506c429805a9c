"""The native engine's colocation memory: where its weights and KV pool live, and what a sleep gives back.

The engine shares its device with the trainer, so between rollouts it sleeps: level 1 frees the KV pool (and on
an accelerator moves the weights to host memory), level 2 frees the weights too (the next update refills them).
Both live in arenas (``engines.inference.arena``) whose addresses survive the sleep, so the CUDA graphs that read
them are kept; where no arena can be had, the tensors are freed and reallocated instead (and the graphs must be
captured again). Host copies of the weights are pinned once and reused by every sleep.
"""

from __future__ import annotations

import logging

import torch

from engines.device import host_buffer
from engines.inference.arena import CudaError, adopt, new_arena

log = logging.getLogger(__name__)


class EngineMemory:
    """The weight arena (the model's tensors moved into it), the KV pool's arena of ``kv_bytes``, and the host
    copies a sleep keeps, on ``device``."""

    def __init__(self, tensors: dict[str, torch.Tensor], kv_bytes: int, device: torch.device) -> None:
        self.device, self.kv_bytes = device, kv_bytes
        # weights and KV pool at addresses that survive sleep (None where no arena can be had: freed instead)
        self.weight_arena = adopt(tensors, device)
        self.kv_arena = new_arena(kv_bytes, device, mapped=False)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the weights' first copies, now in the arena
        self._host_arena: torch.Tensor | None = None  # the weight arena's host copy, pinned once
        self._host_weights: dict[str, torch.Tensor] = {}  # pinned once, reused by every sleep
        self._offloaded: dict[str, tuple[torch.Size, int]] = {}  # emptied by sleep: shape, level
        self.level = 0  # 0 awake, else the level of the last sleep

    def kv_storage(self) -> torch.Tensor | None:
        """The KV pool's bytes (mapping them after a sleep), or None where the pool has no arena (allocate it)."""
        if self.kv_arena is None:
            return None
        try:
            self.kv_arena.map()
        except CudaError as e:
            free = free_device_bytes(self.device)
            raise torch.OutOfMemoryError(
                f"the KV cache ({self.kv_bytes / 2**20:.0f} MiB) does not fit on {self.device}: "
                f"{free / 2**20:.0f} MiB free; lower kv_cache_bytes (rollout.kv_cache_mb) or pass "
                f"kv_memory_fraction ({e})") from e
        return self.kv_arena.bytes

    def sleep(self, level: int, tensors: dict[str, torch.Tensor]) -> bool:
        """Give back the KV pool and, by ``level``, the weights ``tensors`` (the model's, by name). Returns whether
        every address stays (weights and pool in arenas), so what was captured against them may be kept."""
        if self.kv_arena is not None:
            self.kv_arena.unmap()
        tensors = {k: t for k, t in tensors.items() if t.numel()}
        w = self.weight_arena
        # an update that swapped in other tensors (rollback "swap") leaves the arena to the receiver's spare
        in_arena = w is not None and all(w.holds(t) for t in tensors.values())
        if in_arena:
            tensors = {}
            if level == 1 and self.device.type != "cpu":
                if self._host_arena is None:
                    self._host_arena = host_buffer(w.nbytes)
                self._host_arena.copy_(w.bytes)
            if level == 2 or self.device.type != "cpu":
                w.unmap()
        for name, t in tensors.items():
            if level == 1 and t.device.type == "cpu":
                continue  # already where it would go
            if level == 1:
                host = self._host_weights.get(name)
                if host is None or host.shape != t.shape or host.dtype != t.dtype:
                    host = self._host_weights[name] = host_buffer(t.nbytes).view(t.dtype).view(t.shape)
                host.copy_(t.data)
            self._offloaded[name] = (t.shape, level)
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        self.level = level
        return in_arena and self.kv_arena is not None

    def wake(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take back what ``sleep`` freed, ``tensors`` being the model's by name (level-2 weights come back as
        zeros, or uninitialised where they could not live in an arena)."""
        w = self.weight_arena
        if w is not None and not w.mapped:  # only sleep unmaps it
            w.map()
            if self.level == 1:
                w.bytes.copy_(self._host_arena, non_blocking=True)
        for name, t in tensors.items():
            if name in self._offloaded:
                shape, level = self._offloaded.pop(name)
                t.data = self._host_weights[name].to(self.device, non_blocking=True) if level == 1 else \
                    torch.empty(shape, dtype=t.dtype, device=self.device)
        self.level = 0

    def mapped_bytes(self) -> int:
        """Device bytes mapped in the arenas now: the weights and pool, which a CUDA caching allocator's counters
        do not see (on the host they are in the resident set already)."""
        if self.device.type == "cpu":
            return 0
        return sum(a.nbytes for a in (self.weight_arena, self.kv_arena) if a is not None and a.mapped)


def fit_kv_budget(requested: int, need: int, free: int, fraction: float, device: torch.device | str) -> int:
    """The KV budget on a device with ``free`` bytes free: ``requested``, capped at ``fraction`` of them (the
    rest is for activations and graphs, as vLLM's gpu_memory_utilization keeps); ``need`` is the least that
    serves one sequence, and a cap below it is an error."""
    if not 0 < fraction <= 1:
        raise ValueError(f"kv_memory_fraction must be in (0, 1], got {fraction}")
    cap = int(free * fraction)
    if cap < need:
        raise ValueError(f"the KV cache needs at least {need / 2**20:.0f} MiB (one full-length sequence) but "
                         f"{fraction:g} of the {free / 2**20:.0f} MiB free on {device} is {cap / 2**20:.0f} MiB; "
                         "free device memory or lower max_seq_len")
    if requested > cap:
        log.info("KV cache budget %d MiB capped at %d MiB (%g of the memory free on %s)", requested >> 20,
                 cap >> 20, fraction, device)
    return min(requested, cap)


def free_device_bytes(device: torch.device) -> int:
    """Bytes free on a CUDA device, counting the caching allocator's unused blocks (``empty_cache`` frees them)."""
    free = torch.cuda.mem_get_info(device)[0]
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
