"""What every sandbox backend provides: sessions that run commands under limits and hold a file tree."""

from __future__ import annotations

import enum
import threading
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

    def merged(self, **overrides: float | int | None) -> Limits:
        """These limits with the non-None, non-zero overrides applied."""
        vals = {k: v for k, v in overrides.items() if v}
        return Limits(**{**self.__dict__, **vals})


DEFAULT_LIMITS = Limits()


@dataclass
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


class SandboxError(Exception):
    """A request the sandbox cannot serve; ``code`` maps to a gRPC status name."""

    def __init__(self, message: str, code: str = "INTERNAL"):
        super().__init__(message)
        self.code = code  # INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, UNAVAILABLE, INTERNAL


def check_relative_path(path: str) -> PurePosixPath:
    """A session-relative file path, refusing absolute paths and '..' (raises SandboxError INVALID_ARGUMENT)."""
    p = PurePosixPath(path)
    if not path or p.is_absolute() or ".." in p.parts:
        raise SandboxError(f"file path {path!r} must be relative to the session's work directory, without '..'",
                           "INVALID_ARGUMENT")
    return p


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
