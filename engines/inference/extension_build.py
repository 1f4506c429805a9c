"""Build and load a C++ extension with PyTorch's JIT loader so that a killed build never blocks the next one.

PyTorch's loader serialises builds with a "baton": a ``lock`` file in the build directory, created at the start
and removed at the end. A process killed in between (a timeout, an OOM kill, ``kill -9`` during start-up) leaves
the file behind, and every later load of the extension waits for it to go, forever and silently. Here every load
first takes an ``fcntl.flock`` on a file beside the build, which the kernel releases when its holder dies; whoever
holds it knows that no other process is building, so a baton it finds is stale: it says so in one warning line,
removes it, and builds.

The build directory is named by a digest of the source, the flags and the torch and Python versions, and the
source is copied into it: checkouts of the same code at different paths (git worktrees, a CI cache) share one
build instead of rebuilding it in turn, and a process of an older version never shares a directory with this one.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

BATON = "lock"  # the file PyTorch's loader creates in the build directory while it builds
FLOCK = "build.flock"  # the lock every load of this module takes first (released by the kernel with its holder)


def build_directory(name: str, source: Path, cflags: list[str], ldflags: list[str]) -> Path:
    """Where ``name`` built from ``source`` with these flags lives: under ``TORCH_EXTENSIONS_DIR`` (default
    PyTorch's build root), named by a digest of everything the build depends on."""
    h = hashlib.sha256(source.read_bytes())
    h.update(repr((cflags, ldflags, torch.__version__, sys.version_info[:2], getattr(sys, "abiflags", ""))).encode())
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return Path(root) / f"{name}_{h.hexdigest()[:12]}"


def load_extension(name: str, source: Path, cflags: list[str], ldflags: list[str]) -> ModuleType:
    """The extension module ``name`` compiled from the C++ file ``source`` (built on first use, then loaded from
    the build directory); raises what the build raises."""
    from torch.utils.cpp_extension import load

    where = build_directory(name, source, cflags, ldflags)
    where.mkdir(parents=True, exist_ok=True)
    with open(where / FLOCK, "a+") as lock:
        _lock(lock, where)
        try:
            baton = where / BATON
            if baton.exists():  # we hold the flock, so nobody is building: its holder died mid-build
                log.warning("removed a stale build lock %s (a build of %s was killed before it finished)", baton,
                            name)
                baton.unlink()
            copy = where / source.name
            if not copy.exists() or copy.read_bytes() != source.read_bytes():  # unchanged: ninja has nothing to do
                copy.write_bytes(source.read_bytes())
            return load(name, [str(copy)], extra_cflags=cflags, extra_ldflags=ldflags, build_directory=str(where))
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _lock(lock, where: Path) -> None:
    """Take the exclusive flock on ``lock``, saying once (at info level) when another live process holds it."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        log.info("waiting for %s, which is building the extension in %s", holder, where)
        started = time.monotonic()
        fcntl.flock(lock, fcntl.LOCK_EX)
        log.info("waited %.0f s for the extension build in %s", time.monotonic() - started, where)
    lock.seek(0)
    lock.truncate()
    lock.write(f"process {os.getpid()}")
    lock.flush()
