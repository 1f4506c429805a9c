"""Memory whose address outlives the memory: what lets the inference engine sleep and keep its CUDA graphs.

A captured CUDA graph replays kernels with the device addresses they were captured with (weights, the KV
pool). Freeing those tensors for the trainer and allocating them again at wake-up gives new addresses,
so every graph would have to be captured again after each sleep. An ``Arena`` keeps the address and
gives back only the memory behind it:

- ``CudaArena`` reserves a virtual address range with the CUDA driver's virtual memory management
  (``cuMemAddressReserve``) and maps physical allocations into it (``cuMemCreate``/``cuMemMap``); ``unmap``
  unmaps and releases them, so the memory returns to the device while the range stays reserved, and
  ``map`` maps fresh allocations at the same addresses. The driver's C interface is called through
  ``ctypes``: it has been stable since CUDA 10.2 and is present wherever a CUDA build of torch runs,
  whereas the ``cuda-bindings`` package must match the driver's major version.
- ``HostArena`` does the same with an anonymous private mapping on the host: ``unmap`` is
  ``madvise(MADV_DONTNEED)``, which returns the pages to the system and keeps the mapping.

Both guarantee zeros after ``map``. A view of an unmapped arena must not be touched: on the host it reads
zeros; on a GPU the access faults. ``new_arena`` returns None where neither applies (e.g. a ROCm build, a
device without virtual memory management): the engine then frees and reallocates as before.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
from collections.abc import Iterable

import torch

log = logging.getLogger(__name__)

ALIGN = 256  # bytes between tensors placed in one arena: every dtype's alignment, and a GPU cache line pair


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class Arena:
    """A fixed range of addresses of ``nbytes`` bytes on ``device`` whose memory can be given back and taken
    again. ``bytes`` is a flat uint8 tensor over the whole range; ``view`` carves typed tensors from it."""

    device: torch.device
    nbytes: int
    base: int  # the range's first address
    mapped: bool

    @property
    def bytes(self) -> torch.Tensor:
        """The whole range as a flat uint8 tensor (it keeps the arena alive while it lives)."""
        raise NotImplementedError

    def map(self) -> None:
        """Put memory behind the range again (no-op when mapped); after an ``unmap`` it reads as zeros."""
        raise NotImplementedError

    def unmap(self) -> None:
        """Give the memory back, keep the addresses (no-op when unmapped). Work queued on the range must be done."""
        raise NotImplementedError

    def close(self) -> None:
        """Give back the memory and the addresses; the arena's views are dead afterwards."""
        raise NotImplementedError

    def view(self, offset: int, shape: Iterable[int], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` at byte ``offset`` (a multiple of the dtype's size)."""
        shape = tuple(shape)
        n = dtype.itemsize * math.prod(shape)
        return self.bytes[offset: offset + n].view(dtype).view(shape)

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s memory lies inside this arena."""
        return t.device == self.device and self.base <= t.data_ptr() < self.base + self.nbytes

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: the driver or the module may be gone already
            pass


class HostArena(Arena):
    """An anonymous private mapping: unmapping is ``madvise(MADV_DONTNEED)``, after which pages read as zero."""

    def __init__(self, nbytes: int, mapped: bool = True) -> None:
        self.nbytes = _round_up(max(nbytes, 1), mmap.PAGESIZE)
        self.device = torch.device("cpu")
        self._map = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)  # holds the mapping while any view lives
        self.base = self._bytes.data_ptr()
        self.mapped = mapped  # untouched pages hold no memory: mapped or not, nothing is resident yet

    @property
    def bytes(self) -> torch.Tensor:
        return self._bytes

    def map(self) -> None:
        self.mapped = True  # the kernel maps zero pages back on first touch

    def unmap(self) -> None:
        if self.mapped:
            self._map.madvise(mmap.MADV_DONTNEED)
            self.mapped = False

    def close(self) -> None:
        self.mapped = False  # the mapping goes when the last view does (torch holds the buffer)


class CudaError(RuntimeError):
    """A CUDA driver call failed."""


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_ALLOCATION_PINNED, _LOCATION_DEVICE, _ACCESS_READWRITE, _GRANULARITY_MINIMUM = 1, 1, 3, 0
_ATTRIBUTE_VMM_SUPPORTED = 102  # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
_CHUNK = 1 << 30  # physical allocations of at most this size: a large pool needs no single huge one


class _Driver:
    """The few driver entry points the arena uses, with CUresult turned into CudaError."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        u64, size = ctypes.c_ulonglong, ctypes.c_size_t
        signatures = {
            "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
            "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
            "cuDeviceGetAttribute": [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int],
            "cuMemGetAllocationGranularity": [ctypes.POINTER(size), ctypes.POINTER(_AllocationProp), ctypes.c_int],
            "cuMemAddressReserve": [ctypes.POINTER(u64), size, size, u64, u64],
            "cuMemAddressFree": [u64, size],
            "cuMemCreate": [ctypes.POINTER(u64), size, ctypes.POINTER(_AllocationProp), u64],
            "cuMemRelease": [u64],
            "cuMemMap": [u64, size, size, u64, u64],
            "cuMemUnmap": [u64, size],
            "cuMemSetAccess": [u64, size, ctypes.POINTER(_AccessDesc), size],
        }
        for name, args in signatures.items():
            fn = getattr(self.lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int

    def __call__(self, name: str, *args) -> None:
        res = getattr(self.lib, name)(*args)
        if res:
            msg = ctypes.c_char_p()
            self.lib.cuGetErrorString(res, ctypes.byref(msg))
            text = msg.value.decode() if msg.value else "unknown error"
            raise CudaError(f"{name} failed: CUDA error {res} ({text})")


_driver: _Driver | None = None


def _get_driver() -> _Driver:
    global _driver
    if _driver is None:
        _driver = _Driver()
    return _driver


class _DevicePointer:
    """A raw device range in the CUDA array interface, so ``torch.as_tensor`` can wrap it without a copy; the
    tensor holds this object, and this object the arena, so the range outlives every view of it."""

    def __init__(self, ptr: int, nbytes: int, owner: Arena) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


class CudaArena(Arena):
    """A reserved device address range with physical memory mapped in and out by the driver's VMM calls."""

    def __init__(self, nbytes: int, device: torch.device, mapped: bool = True) -> None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        torch.empty(1, device=self.device)  # the runtime's primary context, current on this thread
        self.drv = d = _get_driver()
        dev, vmm = ctypes.c_int(), ctypes.c_int()
        d("cuDeviceGet", ctypes.byref(dev), index)
        d("cuDeviceGetAttribute", ctypes.byref(vmm), _ATTRIBUTE_VMM_SUPPORTED, dev.value)
        if not vmm.value:
            raise CudaError(f"device {self.device} has no virtual memory management")
        self.prop = _AllocationProp(type=_ALLOCATION_PINNED, location=_Location(_LOCATION_DEVICE, dev.value))
        self.access = _AccessDesc(location=_Location(_LOCATION_DEVICE, dev.value), flags=_ACCESS_READWRITE)
        gran = ctypes.c_size_t()
        d("cuMemGetAllocationGranularity", ctypes.byref(gran), ctypes.byref(self.prop), _GRANULARITY_MINIMUM)
        self.nbytes = _round_up(max(nbytes, 1), gran.value)
        chunk = _round_up(min(self.nbytes, _CHUNK), gran.value)
        self.chunks = [(o, min(chunk, self.nbytes - o)) for o in range(0, self.nbytes, chunk)]
        ptr = ctypes.c_ulonglong()
        d("cuMemAddressReserve", ctypes.byref(ptr), self.nbytes, 0, 0, 0)
        self.ptr = self.base = ptr.value
        self.handles: list[int] = []
        self.mapped = self.closed = False
        if mapped:
            self.map()

    @property
    def bytes(self) -> torch.Tensor:
        # made afresh each time: an arena holding its own view would never be freed (the view holds the arena)
        return torch.as_tensor(_DevicePointer(self.ptr, self.nbytes, self), device=self.device)

    def map(self) -> None:
        if self.mapped:
            return
        torch.cuda.synchronize(self.device)  # makes the device's context current on this thread too
        d = self.drv
        try:
            for offset, n in self.chunks:
                h = ctypes.c_ulonglong()
                d("cuMemCreate", ctypes.byref(h), n, ctypes.byref(self.prop), 0)
                self.handles.append(h.value)
                d("cuMemMap", self.ptr + offset, n, 0, h.value, 0)
                d("cuMemSetAccess", self.ptr + offset, n, ctypes.byref(self.access), 1)
        except CudaError:
            self._release()  # nothing half-mapped stays behind: the caller may retry after freeing memory
            raise
        self.mapped = True
        self.bytes.zero_()

    def unmap(self) -> None:
        if self.mapped:
            torch.cuda.synchronize(self.device)  # no kernel may still read or write the range
            self._release()
            self.mapped = False

    def _release(self) -> None:
        for (offset, n), h in zip(self.chunks, self.handles, strict=False):
            try:
                self.drv("cuMemUnmap", self.ptr + offset, n)
            except CudaError:
                pass  # this chunk was created but never mapped
            self.drv("cuMemRelease", h)
        self.handles.clear()

    def close(self) -> None:
        if getattr(self, "closed", True):
            return
        self.unmap()
        self.drv("cuMemAddressFree", self.ptr, self.nbytes)
        self.closed = True


def new_arena(nbytes: int, device: torch.device | str, mapped: bool = True) -> Arena | None:
    """An arena of at least ``nbytes`` on ``device`` (zeros, or unmapped until its first ``map``), or None
    where addresses cannot outlive the memory here."""
    device = torch.device(device)
    if device.type == "cpu":
        return HostArena(nbytes, mapped)
    if device.type != "cuda" or torch.version.cuda is None:
        return None
    try:
        return CudaArena(nbytes, device, mapped)
    except (OSError, AttributeError, CudaError) as e:
        log.warning("no CUDA virtual memory arena (%s): CUDA graphs are captured again after sleep", e)
        return None


def layout(tensors: Iterable[torch.Tensor]) -> tuple[list[int], int]:
    """Byte offsets that place ``tensors`` one after another, each aligned, and the bytes they need in all."""
    offsets, end = [], 0
    for t in tensors:
        offsets.append(end)
        end = _round_up(end + t.numel() * t.element_size(), ALIGN)
    return offsets, end


def adopt(tensors: dict[str, torch.Tensor], device: torch.device | str) -> Arena | None:
    """Move ``tensors`` (parameters and buffers, each storage once) into a new arena: their values are copied
    and their ``.data`` rebound to the arena's views, so modules holding them now compute from the arena.
    Returns None (and leaves them where they are) where no arena can be had."""
    items = [t for t in tensors.values() if t.numel()]
    offsets, total = layout(items)
    arena = new_arena(total, device)
    if arena is None:
        return None
    for t, offset in zip(items, offsets, strict=True):
        view = arena.view(offset, t.shape, t.dtype)
        view.copy_(t.data)
        t.data = view
    return arena
