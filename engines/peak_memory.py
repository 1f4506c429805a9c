"""Peak memory of this process over a phase: device memory on a GPU, resident memory on a CPU.

A phase starts with ``reset`` and ends with ``peak_bytes``. On CUDA these are the caching
allocator's peak counters; on CPU Linux's high-water mark of the resident set (VmHWM), which
writing 5 to /proc/self/clear_refs resets to the current RSS.
"""

from __future__ import annotations

import torch


def reset(device: torch.device) -> None:
    """Start a new peak at the current usage."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # not Linux, or not allowed: the peak then covers the process's life


def peak_bytes(device: torch.device) -> int:
    """The highest usage since the last ``reset``: allocated device bytes, or resident host bytes."""
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
