"""Device helpers both engines use: waiting for queued work, returning freed heap, peak memory.

Peak memory of this process over a phase: device memory on a GPU, resident memory on a CPU. A phase
starts with ``reset_peak_memory`` and ends with ``peak_memory_bytes``. On CUDA these are the caching
allocator's peak counters; on CPU Linux's high-water mark of the resident set (VmHWM), which writing
5 to /proc/self/clear_refs resets to the current RSS.

``host_buffer`` is how this project pins large host buffers: torch's pinned allocator
(``pin_memory=True``, ``Tensor.pin_memory()``) rounds every block up to a power of two and keeps it
cached, so a 16.4 GB buffer pins 32 GiB. Here the pages are mapped at the exact size, faulted in by
every core, then registered with CUDA as they are.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host tensor ``t`` on ``device`` without the host waiting: staged in pinned memory on CUDA (the pinned
    block stays reserved until the copy has run: torch's host allocator records the stream)."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


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


#: glibc malloc settings for a process that trains on the CPU, read at its start (environment variables). glibc
#: serves a block over its mmap threshold (128 KiB, adapting up to 32 MiB) by mmap and unmaps it on free, and gives
#: the heap's top back above its trim threshold: each micro-batch's activations, gradients and logit chunks (tens of
#: MB) then fault every page in afresh, zero-filled by the kernel (about 4·10⁵ faults and a tenth of the CPU time of a
#: train phase of a 2.6 M-parameter model). Above both thresholds freed blocks are reused; the offload's
#: ``malloc_trim`` still returns them to the OS between training phases. ``mallopt`` cannot set a threshold above
#: 32 MiB, and Ray cuts a ``GLIBC_TUNABLES`` value at its first colon: these are glibc's names for the two tunables.
CPU_TRAINER_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


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


class _Registered(mmap.mmap):
    """An anonymous mapping that stays registered with CUDA (page-locked) for as long as it lives."""

    pinned_at = 0  # the address registered, 0 while not registered

    def __del__(self) -> None:
        if self.pinned_at:
            try:
                _unregister(self.pinned_at)
            except Exception:  # interpreter shutdown: CUDA may be gone already, the process with it
                pass


def _register(ptr: int, nbytes: int) -> None:
    """Page-lock host memory for the current CUDA context (``cudaHostRegister``)."""
    err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: {err}")


def _unregister(ptr: int) -> None:
    """Undo ``_register``."""
    torch.cuda.cudart().cudaHostUnregister(ptr)


def host_buffer(nbytes: int, pinned: bool = True) -> torch.Tensor:
    """``nbytes`` of host memory as a flat uint8 tensor; page-locked with ``pinned`` where CUDA is present.

    Pinned, it costs exactly ``nbytes`` (rounded to a page), not the next power of two, and is unpinned
    and unmapped when the last view of it is gone. Without CUDA it is a plain tensor.
    """
    if not pinned or nbytes == 0 or not torch.cuda.is_available():
        return torch.empty(nbytes, dtype=torch.uint8)
    region = _Registered(-1, nbytes, flags=mmap.MAP_PRIVATE)  # private: Python's default shares it (tmpfs)
    t = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping: it lives as long as any view
    t.zero_()  # faults the pages in on every core; registering would fault them one by one
    _register(t.data_ptr(), nbytes)
    region.pinned_at = t.data_ptr()
    return t
