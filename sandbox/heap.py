"""Giving the memory of large payloads back to the operating system.

A request or response of a few hundred megabytes (a repository's files, a command's output) is freed once sent, but
glibc keeps freed heap memory in its per-thread arenas, and the service has a thread per call: without a trim its
RSS stays at its peak. Two measures: buffers of a megabyte and more always get pages of their own from ``mmap``,
given back the moment they are freed (``fix_mmap_threshold``: glibc otherwise raises its threshold to the largest
block freed so far, up to 32 MiB, and serves later payloads from its arenas); and ``HeapTrimmer`` calls
``malloc_trim(0)`` shortly after each large call (again a little later, for responses still being sent) for what the
arenas still hold. Elsewhere than glibc both do nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import threading
import time

LARGE_BYTES = 8 << 20  # a call at least this large is followed by a trim
_DELAYS_S = (0.2, 2.0)  # after the call: once its response is likely sent, and once more for slow receivers


#: mallopt's M_MMAP_THRESHOLD: setting it also turns off glibc's dynamic raising of it
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 20


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD) -> bool:
    """Make every allocation of ``nbytes`` or more an ``mmap`` of its own in this process; False where impossible."""
    with contextlib.suppress(OSError, AttributeError, TypeError):
        return bool(ctypes.CDLL(ctypes.util.find_library("c")).mallopt(_M_MMAP_THRESHOLD, nbytes))
    return False


def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none."""
    with contextlib.suppress(OSError, AttributeError, TypeError):
        return ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    return None


class HeapTrimmer:
    """Trims the C heap on a thread of its own after ``note`` saw a large call; ``close`` stops it."""

    def __init__(self, large_bytes: int = LARGE_BYTES):
        self.large_bytes = large_bytes
        self.trims = 0
        self._trim = _malloc_trim()
        self._due = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="sandbox-heap-trim", daemon=True)
        if self._trim is not None:
            self._thread.start()

    def note(self, nbytes: int) -> None:
        """A call moved ``nbytes`` (request and response): schedule a trim if that is large."""
        if nbytes >= self.large_bytes:
            self._due.set()

    def _loop(self) -> None:
        while True:
            self._due.wait()
            if self._closed:
                return
            self._due.clear()
            waited = 0.0
            for delay in _DELAYS_S:
                time.sleep(delay - waited)
                waited = delay
                self._trim(0)
                self.trims += 1

    def close(self) -> None:
        """Stop the thread (a trim in progress finishes)."""
        self._closed = True
        self._due.set()
