"""Moving a set of tensors' storages to one flat host buffer and back (trainer offload/onload).

Each distinct storage (FSDP's padded shard, an optimizer moment...) is copied into its own aligned
range of one host buffer, then shrunk to 0 bytes with ``untyped_storage().resize_(0)``. Tensor
objects, views of them and every reference FSDP or an optimizer holds stay valid: onload grows the
same storages back and fills them from the buffer, one copy per storage and one synchronise in all.
On CUDA the buffer is pinned, so those copies are asynchronous DMA; on CPU the same code frees each
tensor's own allocation while the bytes wait in the buffer.

The buffer comes from ``engines.device.host_buffer`` (pinned at its exact size, not torch's power of two).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from engines.device import host_buffer, malloc_trim, synchronize

ALIGN = 64  # bytes; every slot starts aligned, so typed views of the buffer are valid


@dataclass
class _Slot:
    storage: torch.UntypedStorage
    nbytes: int
    offset: int  # in the host buffer


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy bytes between same-size uint8 tensors, asynchronously where one side is a device.

    Host to host is one memmove: a parallel copy_ per storage pays a thread-pool round per call,
    which dominates for hundreds of storages (and stalls when the cores are busy).
    """
    if dst.device.type == "cpu" and src.device.type == "cpu":
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel())
    else:
        dst.copy_(src, non_blocking=True)


class HostOffloader:
    """Holds the host copy of some storages while they are shrunk to 0 bytes.

    ``keep_buffer`` keeps the host buffer between cycles (default: on CUDA, where pinning is slow;
    on CPU it is freed at onload, so the process never holds the bytes twice when idle).
    """

    def __init__(self, keep_buffer: bool | None = None) -> None:
        self.keep_buffer = keep_buffer
        self._buffer: torch.Tensor | None = None
        self._slots: list[_Slot] = []
        self._device: torch.device | None = None
        self.views: dict[str, torch.Tensor] = {}

    @property
    def offloaded(self) -> bool:
        return bool(self._slots)

    def offload(self, tensors: Iterable[torch.Tensor], expose: Mapping[str, torch.Tensor] | None = None) -> dict:
        """Copy the storages under ``tensors`` to the host buffer and free them; returns bytes, seconds.

        ``expose`` names tensors (each under one of ``tensors``' storages) whose host copies are
        then readable as ``views[name]`` until ``onload``.
        """
        if self.offloaded:
            raise RuntimeError("already offloaded: call onload() first")
        t0 = time.perf_counter()
        by_ptr: dict[int, _Slot] = {}
        total, device = 0, None
        for t in tensors:
            st = t.untyped_storage()
            if st.nbytes() == 0 or st.data_ptr() in by_ptr:
                continue
            if not st.resizable():
                raise ValueError(f"a storage of {tuple(t.shape)} {t.dtype} is not resizable (memory-mapped?)")
            if device is None:
                device = st.device
            elif st.device != device:
                raise ValueError(f"tensors on several devices: {device} and {st.device}")
            by_ptr[st.data_ptr()] = _Slot(st, st.nbytes(), total)
            total += -(-st.nbytes() // ALIGN) * ALIGN
        if device is None:
            return {"bytes": 0, "seconds": time.perf_counter() - t0}
        pin = device.type == "cuda"
        if self._buffer is None or self._buffer.numel() < total:
            self._buffer = None  # let the old one go before the new one is allocated
            self._buffer = host_buffer(total, pin)
        slots = list(by_ptr.values())
        for s in slots:
            _copy(self._buffer[s.offset : s.offset + s.nbytes], _bytes_of(s.storage))
        synchronize(device)
        self.views = {}
        for name, t in (expose or {}).items():
            slot = by_ptr.get(t.untyped_storage().data_ptr())
            if slot is None and t.numel():
                raise ValueError(f"{name} is not under any of the offloaded tensors")
            start = slot.offset + t.storage_offset() * t.element_size() if slot else 0
            raw = self._buffer[start : start + t.numel() * t.element_size()]
            self.views[name] = raw.view(t.dtype).view(t.shape)
        for s in slots:
            s.storage.resize_(0)
        self._slots, self._device = slots, device
        if device.type == "cuda":
            torch.cuda.empty_cache()  # hand the memory to the colocated inference engine
        else:
            malloc_trim()
        return {"bytes": sum(s.nbytes for s in slots), "seconds": time.perf_counter() - t0}

    def onload(self) -> dict:
        """Grow every storage back and fill it from the host buffer; returns bytes, seconds."""
        if not self.offloaded:
            raise RuntimeError("not offloaded: nothing to onload")
        t0 = time.perf_counter()
        assert self._buffer is not None and self._device is not None
        pin = self._device.type == "cuda"
        for s in self._slots:
            s.storage.resize_(s.nbytes)
            _copy(_bytes_of(s.storage), self._buffer[s.offset : s.offset + s.nbytes])
        synchronize(self._device)
        nbytes = sum(s.nbytes for s in self._slots)
        self._slots, self.views = [], {}
        keep = self.keep_buffer if self.keep_buffer is not None else pin
        if not keep:
            self._buffer = None
        return {"bytes": nbytes, "seconds": time.perf_counter() - t0}

    @property
    def buffer(self) -> torch.Tensor | None:
        """The flat host buffer (None before the first offload, or after onload when not kept)."""
        return self._buffer
