"""Device helpers both engines use: waiting for queued work, returning freed heap, peak memory.

Peak memory of this process over a phase: device memory on a GPU, resident memory on a CPU. A phase
starts with ``reset_peak_memory`` and ends with ``peak_memory_bytes``. On CUDA these are the caching
allocator's peak counters; on CPU Linux's high-water mark of the resident set (VmHWM), which writing
5 to /proc/self/clear_refs resets to the current RSS.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import torch


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    for name in ("libc.so.6", ctypes.util.find_library("c")):  # find_library runs ldconfig: only as a fallback
        try:
            return ctypes.CDLL(name) if name else None
        except OSError:
            continue
    return None


def malloc_trim() -> bool:
    """Ask glibc to return freed heap memory to the OS; False where there is no glibc."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    return bool(libc.malloc_trim(0))


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak of this process's memory at the current usage."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # not Linux, or not allowed: the peak then covers the process's life


def peak_memory_bytes(device: torch.device) -> int:
    """The highest usage since the last ``reset_peak_memory``: allocated device bytes, or resident host bytes."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
