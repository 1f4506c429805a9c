"""Device helpers both engines use: waiting for queued work, returning freed heap, peak memory.

Peak memory of this process over a phase: device memory on a GPU, resident memory on a CPU. A phase
starts with ``reset_peak_memory`` and ends with ``peak_memory_bytes``. On CUDA these are the caching
allocator's peak counters; on CPU Linux's high-water mark of the resident set (VmHWM), which writing
5 to /proc/self/clear_refs resets to the current RSS.

The checkpoint engine's IPC buffers are mapped by the process that loads from them with ``map_ipc``: POSIX shared
memory on a CPU, a CUDA IPC handle (naming its GPU by UUID, since two processes may number their devices
differently) on a GPU. Both engines may map them (a vLLM worker loads its tensor-parallel shard from its own GPU's).

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
import os
from pathlib import Path

import torch

#: where POSIX shared memory lives (the checkpoint engine's CPU IPC buffers)
SHM_DIR = Path(os.environ.get("RL_SHM_DIR", "/dev/shm"))
#: position of the device index in ``torch.multiprocessing.reductions.rebuild_cuda_tensor``'s arguments
_DEVICE_ARG = 6


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


# ---- IPC buffers ---------------------------------------------------------------------------------------------

def device_uuid(index: int) -> str:
    """The UUID of CUDA device ``index`` (as this process numbers its visible devices)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def cuda_handle(t: torch.Tensor) -> tuple:
    """A CUDA IPC handle of ``t`` that names its device by UUID, not by this process's index."""
    from torch.multiprocessing.reductions import reduce_tensor

    return "cuda", reduce_tensor(t), device_uuid(t.device.index)


def local_device(uuid: str, visible: list[str]) -> int:
    """This process's index of the device with ``uuid``, among its ``visible`` devices' UUIDs (in order):
    the two processes may see the GPUs in different orders (``CUDA_VISIBLE_DEVICES``)."""
    if uuid not in visible:
        raise RuntimeError(f"the checkpoint engine's buffer is on GPU {uuid}, which this process does not see "
                           f"(it sees {', '.join(visible) or 'no GPU'}); give both processes that GPU")
    return visible.index(uuid)


def remap_device(args: tuple, index: int) -> tuple:
    """``rebuild_cuda_tensor``'s arguments with the device index replaced by ``index``."""
    return (*args[:_DEVICE_ARG], index, *args[_DEVICE_ARG + 1:])


def visible_uuids() -> list[str]:
    """The UUIDs of the CUDA devices this process sees, in its own order (none without CUDA)."""
    return [device_uuid(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def map_ipc(handle: tuple) -> torch.Tensor:
    """The buffer an IPC ``handle`` names (``("shm", name, nbytes)`` or ``cuda_handle``'s), mapped without a copy;
    the tensor keeps the mapping alive."""
    if handle[0] == "shm":
        _, name, nbytes = handle
        path = SHM_DIR / name
        if not path.exists():
            raise FileNotFoundError(f"shared buffer {name} does not exist (was its owner started?)")
        if path.stat().st_size != nbytes:
            raise ValueError(f"shared buffer {name} has {path.stat().st_size} bytes, expected {nbytes}")
        return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)
    (rebuild, args), uuid = handle[1], handle[2]
    return rebuild(*remap_device(args, local_device(uuid, visible_uuids())))


def ipc_device(handle: tuple) -> str | None:
    """The UUID of the GPU an IPC ``handle``'s buffer is on (None: host shared memory)."""
    return handle[2] if handle[0] == "cuda" else None
