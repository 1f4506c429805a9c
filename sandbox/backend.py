"""What every sandbox backend provides: sessions that run commands under limits and hold a file tree."""

from __future__ import annotations

import contextlib
import enum
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Protocol


class Verdict(str, enum.Enum):
    """How a command ended. Each exceeded limit has its own verdict."""

    OK = "ok"  # exit status 0
    FAILED = "failed"  # non-zero exit status or killed by a signal, no limit exceeded
    TIMEOUT = "timeout"  # wall-clock limit (or the caller's deadline)
    CPU_LIMIT = "cpu_limit"  # CPU-time limit
    MEMORY_LIMIT = "memory_limit"  # address-space / memory limit
    OUTPUT_LIMIT = "output_limit"  # stdout or stderr went over the cap
    FILE_SIZE_LIMIT = "file_size_limit"  # a file grew over the size limit
    PROCESS_LIMIT = "process_limit"  # could not create more processes/threads
    CANCELLED = "cancelled"  # the caller cancelled the request
    ERROR = "error"  # the sandbox itself failed (not the program's fault)


@dataclass(frozen=True)
class Limits:
    """Resource limits of one command. Sizes in bytes, times in seconds."""

    wall_s: float = 10.0
    cpu_s: float = 10.0
    memory_bytes: int = 512 << 20
    processes: int = 64
    open_files: int = 256
    file_size_bytes: int = 16 << 20
    output_bytes: int = 1 << 20  # per stream (stdout and stderr each)
    cpus: float = 1.0  # CPUs the whole sandbox may use at once (cgroup cpu.max), where cgroups are in force

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise SandboxError(f"limits.{name}={value!r} is not a finite number", "INVALID_ARGUMENT")

    def merged(self, **overrides: float | int | None) -> Limits:
        """These limits with the non-None, non-zero overrides applied."""
        vals = {k: v for k, v in overrides.items() if v}
        return Limits(**{**self.__dict__, **vals})


DEFAULT_LIMITS = Limits()


class CancelEvent(threading.Event):
    """A ``threading.Event`` that also calls back whoever asked (``on_set``) when it is set, so that a command's I/O
    loop wakes up at once rather than polling it."""

    def __init__(self) -> None:
        super().__init__()
        self._callbacks: list[Callable[[], None]] = []
        self._callbacks_lock = threading.Lock()

    def set(self) -> None:
        """Set the event and call the callbacks (in the calling thread)."""
        super().set()
        with self._callbacks_lock:
            callbacks = list(self._callbacks)
        for callback in callbacks:
            callback()

    def on_set(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` when the event is set (at once if it is already); returns the function that stops it.
        A callback may be called twice."""
        with self._callbacks_lock:
            self._callbacks.append(callback)
        if self.is_set():
            callback()

        def remove() -> None:
            with self._callbacks_lock, contextlib.suppress(ValueError):
                self._callbacks.remove(callback)

        return remove


@dataclass(kw_only=True)
class ExecResult:
    """The outcome of one command."""

    verdict: Verdict
    exit_code: int | None  # None when killed by a signal or never started
    signal: int | None = None
    stdout: bytes = b""
    stderr: bytes = b""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    wall_s: float = 0.0
    cpu_s: float = 0.0
    detail: str = ""  # a human-readable reason for a non-OK verdict
    oom_kills: int = 0  # processes the kernel killed at the sandbox's memory limit (its cgroup's oom_kill counter)


def note_oom_kills(res: ExecResult, kills: int, memory_bytes: int) -> ExecResult:
    """Record ``kills`` OOM kills in the sandbox's cgroup during the command, wherever they hit: the command itself,
    or a child of it whose parent carried on (even to exit 0). The verdict becomes MEMORY_LIMIT unless the service
    itself ended the command (wall clock, output, cancel) or another limit was named first (CPU time, disk)."""
    res.oom_kills = kills
    if kills <= 0:
        return res
    if res.verdict in (Verdict.OK, Verdict.FAILED, Verdict.MEMORY_LIMIT, Verdict.PROCESS_LIMIT):
        how = (f"killed by signal {res.signal}" if res.signal is not None else
               "the command itself exited 0" if res.exit_code == 0 else f"exit status {res.exit_code}")
        res.verdict = Verdict.MEMORY_LIMIT
        res.detail = (f"memory limit of {memory_bytes} bytes for the whole sandbox reached: the kernel killed "
                      f"{kills} process(es) ({how})")
    else:
        res.detail = f"{res.detail}; the kernel also killed {kills} process(es) at the memory limit".lstrip("; ")
    return res


class SandboxError(Exception):
    """A request the sandbox cannot serve; ``code`` maps to a gRPC status name."""

    def __init__(self, message: str, code: str = "INTERNAL"):
        super().__init__(message)
        self.code = code  # INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, UNAVAILABLE, INTERNAL


NAME_MAX = 255  # bytes in one path component (Linux)


def check_relative_path(path: str, field: str = "file path") -> PurePosixPath:
    """A session-relative file path, refusing absolute paths, '..', NUL bytes and over-long names (raises
    SandboxError INVALID_ARGUMENT naming ``field``, the request field it came from)."""
    if "\0" in path:
        raise SandboxError(f"{field} {path!r} contains a NUL byte", "INVALID_ARGUMENT")
    p = PurePosixPath(path)
    if not path or p.is_absolute() or ".." in p.parts:
        raise SandboxError(f"{field} {path!r} must be relative to the session's work directory, without '..'",
                           "INVALID_ARGUMENT")
    for part in p.parts:
        if len(os.fsencode(part)) > NAME_MAX:
            raise SandboxError(f"{field} {path[:80]!r}...: a name is longer than {NAME_MAX} bytes", "INVALID_ARGUMENT")
    return p


def open_parent_dir(root: str | os.PathLike, rel: str, *, create: bool,
                    owner: int | None = None) -> tuple[int, str]:
    """An open descriptor of the directory holding ``rel`` inside ``root``, and the file's name.

    The path is walked one directory at a time with O_NOFOLLOW, so a symlink that sandboxed code planted on the
    way cannot lead out of ``root``. Missing directories are made when ``create`` (owned by ``owner`` if given).
    A bad path raises SandboxError INVALID_ARGUMENT; a symlink or a file on the way raises OSError (ELOOP or
    ENOTDIR), a missing directory with ``create`` False FileNotFoundError. The caller closes the descriptor.
    """
    parts = check_relative_path(rel).parts
    if not parts:
        raise SandboxError(f"file path {rel!r} names the work directory itself", "INVALID_ARGUMENT")
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    fd = os.open(root, flags)
    try:
        for name in parts[:-1]:
            try:
                nxt = os.open(name, flags, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o755, dir_fd=fd)
                    if owner is not None:
                        os.chown(name, owner, owner, dir_fd=fd, follow_symlinks=False)
                nxt = os.open(name, flags, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd, parts[-1]


class Session(Protocol):
    """A private work directory plus a way to run commands in it. Not used by two threads at once."""

    id: str

    def exec(self, argv: list[str], limits: Limits, stdin: bytes = b"", env: dict[str, str] | None = None,
             cancel: threading.Event | None = None) -> ExecResult:
        """Run ``argv`` in the work directory under ``limits``; ``cancel`` set → kill it, verdict CANCELLED."""
        ...

    def write_files(self, files: dict[str, bytes], executable: frozenset[str] = frozenset()) -> None:
        """Create or replace files (paths relative to the work directory); parents are created."""
        ...

    def read_files(self, paths: list[str], max_bytes: int) -> dict[str, bytes]:
        """Read files; a missing one raises SandboxError NOT_FOUND, one over ``max_bytes`` RESOURCE_EXHAUSTED."""
        ...

    def close(self) -> None:
        """Kill anything still running and delete the work directory. Idempotent."""
        ...


class Backend(Protocol):
    """Creates sessions."""

    name: str

    def create_session(self, image: str = "", files: dict[str, bytes] | None = None) -> Session:
        """A new session, from a container ``image`` (backends without images ignore it) and an initial file tree."""
        ...

    def close(self) -> None:
        """Close every session this backend still holds."""
        ...


@dataclass
class SessionInfo:
    """Bookkeeping the service keeps per session."""

    session: Session
    created: float
    last_used: float
    lock: threading.Lock = field(default_factory=threading.Lock)
