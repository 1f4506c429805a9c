"""Run one command under limits and classify how it ended.

Stdlib only: this module is also copied into the Kubernetes pods and imported there as ``sandbox.runner`` (it may
import only the standard library and ``sandbox.backend``).
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import resource
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence

from sandbox.backend import ExecResult, Limits, SandboxError, Verdict

_CHUNK = 1 << 16
_CANCEL_POLL_S = 0.05  # how often a running command checks its cancel event
_EXIT_GRACE_S = 0.5  # how long to keep reading pipes that a leftover process holds open after the command exited
_SCAN_MAX_ENTRIES = 10_000  # bounds the post-run file-size scan of a directory tree the program filled

_FILE_SIZE_MARKS = (b"File too large", b"[Errno 27]", b"EFBIG")
_MEMORY_MARKS = (b"MemoryError", b"Cannot allocate memory", b"[Errno 12]", b"std::bad_alloc", b"out of memory")
_PROCESS_MARKS = (b"Resource temporarily unavailable", b"BlockingIOError: [Errno 11]", b"can't start new thread",
                  b"fork: retry")


def _limit(value: float) -> int:
    """An rlimit value; a limit of 0 or less means unlimited."""
    return int(value) if value > 0 else resource.RLIM_INFINITY


def _cpu_seconds(limits: Limits) -> int:
    """The CPU limit in whole seconds (RLIMIT_CPU has one-second granularity), rounded up."""
    return max(1, math.ceil(limits.cpu_s))


def rlimit_pairs(limits: Limits) -> list[tuple[int, int, int]]:
    """The (resource, soft, hard) rlimits for ``limits``; the CPU hard limit is one second above the soft one."""
    cpu = _cpu_seconds(limits) if limits.cpu_s > 0 else resource.RLIM_INFINITY
    # soft < hard so that the kernel sends SIGXCPU first (a clean CPU_LIMIT signal) and SIGKILL a second later
    cpu_hard = cpu + 1 if cpu != resource.RLIM_INFINITY else cpu
    return [
        (resource.RLIMIT_CPU, cpu, cpu_hard),
        (resource.RLIMIT_AS, _limit(limits.memory_bytes), _limit(limits.memory_bytes)),
        (resource.RLIMIT_NPROC, _limit(limits.processes), _limit(limits.processes)),
        (resource.RLIMIT_NOFILE, _limit(limits.open_files), _limit(limits.open_files)),
        (resource.RLIMIT_FSIZE, _limit(limits.file_size_bytes), _limit(limits.file_size_bytes)),
        (resource.RLIMIT_CORE, 0, 0),
    ]


def prlimit_argv(limits: Limits, prlimit: str = "prlimit", only: Sequence[int] | None = None) -> list[str]:
    """The ``prlimit ... --`` argv prefix that applies ``limits`` (those in ``only``, if given) to the command that
    follows it."""
    names = {resource.RLIMIT_CPU: "cpu", resource.RLIMIT_AS: "as", resource.RLIMIT_NPROC: "nproc",
             resource.RLIMIT_NOFILE: "nofile", resource.RLIMIT_FSIZE: "fsize", resource.RLIMIT_CORE: "core"}

    def fmt(v: int) -> str:
        return "unlimited" if v == resource.RLIM_INFINITY else str(v)

    pairs = [(r, s, h) for r, s, h in rlimit_pairs(limits) if only is None or r in only]
    return [prlimit, *(f"--{names[r]}={fmt(s)}:{fmt(h)}" for r, s, h in pairs), "--"]


def _clamped_rlimits(limits: Limits) -> list[tuple[int, int, int]]:
    """``rlimit_pairs`` clamped to our own hard limits (which only root may raise)."""
    pairs = []
    for res, soft, hard in rlimit_pairs(limits):
        _, cur_hard = resource.getrlimit(res)
        if cur_hard != resource.RLIM_INFINITY:
            hard = cur_hard if hard == resource.RLIM_INFINITY else min(hard, cur_hard)
            soft = hard if soft == resource.RLIM_INFINITY else min(soft, hard)
        pairs.append((res, soft, hard))
    return pairs


def set_rlimits(pid: int, limits: Limits, skip: Sequence[int] = ()) -> None:
    """Apply ``limits`` to the running process ``pid`` (prlimit(2)); what it starts afterwards inherits them.
    ``skip``: resources left as they are. Raises OSError (ESRCH once the process is gone)."""
    pairs = rlimit_pairs(limits) if os.geteuid() == 0 else _clamped_rlimits(limits)
    for res, soft, hard in pairs:
        if res not in skip:
            resource.prlimit(pid, res, (soft, hard))


def _preexec_rlimits(limits: Limits) -> Callable[[], None]:
    """A preexec_fn applying ``limits``; values are clamped to our own hard limits, which we may not raise."""
    pairs = _clamped_rlimits(limits)

    def apply() -> None:
        for res, soft, hard in pairs:
            resource.setrlimit(res, (soft, hard))

    return apply


def file_at_size_limit(dirs: Sequence[str], size_limit: int) -> str | None:
    """The first regular file under ``dirs`` whose size reached ``size_limit`` (symlinks are not followed)."""
    if size_limit <= 0:
        return None
    stack, seen = list(dirs), 0
    while stack and seen < _SCAN_MAX_ENTRIES:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    seen += 1
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                    elif entry.is_file(follow_symlinks=False):
                        if entry.stat(follow_symlinks=False).st_size >= size_limit:
                            return entry.path
        except OSError:
            continue
    return None


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def classify(exit_code: int | None, sig: int | None, limits: Limits, stderr: bytes, cpu_s: float,
             scan_dirs: Sequence[str] = ()) -> tuple[Verdict, str]:
    """The verdict and detail of a command that ended on its own (not killed by us for wall/output/cancel).

    Heuristics, first match wins:

    - exit status 0 → OK;
    - SIGXCPU, or SIGKILL once the CPU time used reached the limit (the hard RLIMIT_CPU) → CPU_LIMIT;
    - SIGXFSZ, "File too large" / EFBIG in stderr, or a file in ``scan_dirs`` whose size reached the limit
      (CPython ignores SIGXFSZ and only sees EFBIG, which a program may swallow) → FILE_SIZE_LIMIT;
    - ``MemoryError``, "Cannot allocate memory", ``std::bad_alloc``, "out of memory" in stderr → MEMORY_LIMIT
      (RLIMIT_AS makes allocations fail rather than killing the process);
    - "Resource temporarily unavailable", ``BlockingIOError: [Errno 11]``, "can't start new thread", "fork: retry"
      in stderr → PROCESS_LIMIT (RLIMIT_NPROC makes fork/clone fail with EAGAIN); ``run_command`` also gives it to
      a command that printed them and then ran out of wall time (a fork bomb whose first process never notices);
    - anything else → FAILED.

    The stderr markers are what CPython, glibc, libstdc++ and bash print; a program that prints them itself while
    failing gets the corresponding verdict, which only affects its own result.
    """
    if exit_code == 0:
        return Verdict.OK, ""
    cpu_limit = _cpu_seconds(limits) if limits.cpu_s > 0 else math.inf
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s >= 0.9 * cpu_limit):
        return Verdict.CPU_LIMIT, f"CPU-time limit of {limits.cpu_s:g}s exceeded ({cpu_s:.2f}s used)"
    how = f"killed by {_signal_name(sig)}" if sig is not None else f"exit status {exit_code}"
    if sig == signal.SIGXFSZ or any(m in stderr for m in _FILE_SIZE_MARKS):
        return Verdict.FILE_SIZE_LIMIT, f"file-size limit of {limits.file_size_bytes} bytes exceeded ({how})"
    if any(m in stderr for m in _MEMORY_MARKS):
        return Verdict.MEMORY_LIMIT, f"memory limit of {limits.memory_bytes} bytes exceeded ({how})"
    if any(m in stderr for m in _PROCESS_MARKS):
        return Verdict.PROCESS_LIMIT, f"process/thread limit of {limits.processes} reached ({how})"
    big = file_at_size_limit(scan_dirs, limits.file_size_bytes)
    if big is not None:
        return Verdict.FILE_SIZE_LIMIT, f"file-size limit of {limits.file_size_bytes} bytes reached by {big} ({how})"
    return Verdict.FAILED, how


class _Run:
    """The I/O loop of one started command: feeds stdin, collects capped output, watches wall/cancel/exit."""

    def __init__(self, proc: subprocess.Popen, limits: Limits, stdin: bytes, cancel: threading.Event | None):
        self.proc, self.limits, self.cancel = proc, limits, cancel
        self.stdin = memoryview(stdin)
        self.out = {"stdout": bytearray(), "stderr": bytearray()}
        self.truncated = {"stdout": False, "stderr": False}
        self.reason: str | None = None  # why we killed it: "wall", "cancel", "stdout", "stderr"
        self.exited = False
        self.sel = selectors.DefaultSelector()
        self.pidfd: int | None = None
        self._wake: tuple[int, int] | None = None  # a pipe the cancel event writes to when it is set
        self._wake_lock = threading.Lock()
        self._unwatch: Callable[[], None] | None = None

    def _watch_cancel(self) -> bool:
        """Have the cancel event wake the loop through a pipe when it is set; False if it cannot call back (then the
        loop polls it)."""
        on_set = getattr(self.cancel, "on_set", None)
        if on_set is None:
            return False
        self._wake = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self.sel.register(self._wake[0], selectors.EVENT_READ, "cancel")
        self._unwatch = on_set(self._wake_up)
        if self._unwatch is None:
            self._close_wake()
            return False
        return True

    def _wake_up(self) -> None:
        with self._wake_lock:  # the callback may come from another thread after the loop ended
            if self._wake is not None:
                with contextlib.suppress(BlockingIOError):
                    os.write(self._wake[1], b"x")

    def _close_wake(self) -> None:
        if self._unwatch is not None:
            # dropped, not just called: it refers back to this object, and a cycle would keep the output buffers
            # alive until the garbage collector's next full pass
            self._unwatch()
            self._unwatch = None
        with self._wake_lock:
            if self._wake is not None:
                with contextlib.suppress(KeyError):
                    self.sel.unregister(self._wake[0])
                os.close(self._wake[0])
                os.close(self._wake[1])
                self._wake = None

    def kill(self) -> None:
        """SIGKILL the command's whole process group (safe while the leader is not yet reaped)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def _poll_exit(self) -> bool:
        """Whether the command exited, without reaping it (so its pid and group id cannot be reused yet)."""
        try:
            info = os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True
        return info is not None

    def _drop(self, fileobj) -> None:
        """Stop watching a pipe and close it."""
        self.sel.unregister(fileobj)
        fileobj.close()

    def _on_exit(self) -> None:
        self.exited = True
        # remove whatever the command left behind in its group; they may still hold our pipes open
        self.kill()

    def loop(self, deadline: float) -> None:
        """Run until the command exited and its pipes closed, or until we killed it."""
        p = self.proc
        self.sel.register(p.stdout, selectors.EVENT_READ, "stdout")
        self.sel.register(p.stderr, selectors.EVENT_READ, "stderr")
        if p.stdin is not None:
            os.set_blocking(p.stdin.fileno(), False)
            self.sel.register(p.stdin, selectors.EVENT_WRITE, "stdin")
        try:
            self.pidfd = os.pidfd_open(p.pid)
            self.sel.register(self.pidfd, selectors.EVENT_READ, "exit")
        except (AttributeError, OSError):
            self.pidfd = None  # old kernel or Python: poll with waitid instead
        poll_cancel = self.cancel is not None and not self._watch_cancel()
        streams = 2
        grace_end = math.inf
        while True:
            if not self.exited and self.pidfd is None and self._poll_exit():
                self._on_exit()
            now = time.monotonic()
            if self.exited:
                if streams == 0:
                    return
                grace_end = min(grace_end, now + _EXIT_GRACE_S)
                if now >= grace_end:
                    return
            elif self.cancel is not None and self.cancel.is_set():
                self.reason = "cancel"
            elif now >= deadline:
                self.reason = "wall"
            if self.reason:
                self.kill()
                return
            timeout = (grace_end if self.exited else deadline) - now
            if poll_cancel or self.pidfd is None:
                timeout = min(timeout, _CANCEL_POLL_S)
            for key, _ in self.sel.select(None if math.isinf(timeout) else max(timeout, 0.0)):
                if key.data == "exit":
                    self.sel.unregister(key.fileobj)
                    self._on_exit()
                elif key.data == "cancel":
                    self.sel.unregister(key.fileobj)  # seen: the next round reads the event itself
                elif key.data == "stdin":
                    self._feed(key.fileobj)
                else:
                    data = os.read(key.fd, _CHUNK)
                    if not data:
                        self._drop(key.fileobj)
                        streams -= 1
                    elif self._keep(key.data, data):
                        self.reason = key.data
            if self.reason:
                self.kill()
                return

    def _feed(self, pipe) -> None:
        try:
            n = os.write(pipe.fileno(), self.stdin[:_CHUNK])
        except BlockingIOError:
            return
        except (BrokenPipeError, OSError):
            n = len(self.stdin)  # the program stopped reading stdin; that is its business
        self.stdin = self.stdin[n:]
        if not self.stdin:
            self._drop(pipe)

    def _keep(self, stream: str, data: bytes) -> bool:
        """Append output up to the cap; True when the stream went over it."""
        buf, cap = self.out[stream], self.limits.output_bytes
        room = cap - len(buf) if cap > 0 else len(data)
        buf += data[:room]
        if len(data) > room:
            self.truncated[stream] = True
            return True
        return False

    def close(self) -> None:
        """Close our ends of the pipes, the wake-up pipe and the pidfd."""
        self._close_wake()
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()
        self.sel.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
        self.stdin.release()


def run_command(argv: list[str], limits: Limits, *, cwd: str, env: dict[str, str], stdin: bytes = b"",
                cancel: threading.Event | None = None, rlimits: str = "preexec",
                scan_dirs: Sequence[str] = (), pass_fds: Sequence[int] = (),
                on_start: Callable[[int], None] | None = None) -> ExecResult:
    """Run ``argv`` in its own session under ``limits`` and classify the outcome (see ``classify``).

    ``rlimits="preexec"`` sets the rlimits in a preexec_fn; ``"none"`` means the caller applies them (for example
    with ``set_rlimits`` from ``on_start``, which is called with the pid once the command started; if it raises, the
    command is killed and reaped and the exception propagates). The whole process group is SIGKILLed on wall
    timeout, output overflow, cancel, and once the command exited (so nothing it started in its group outlives it).
    ``cancel`` only needs ``is_set()``; one with ``on_set`` (``sandbox.backend.CancelEvent``) is waited for rather
    than polled. ``pass_fds`` are descriptors the command inherits (all others are closed).
    """
    if rlimits not in ("preexec", "none"):
        raise ValueError(f"rlimits must be 'preexec' or 'none', not {rlimits!r}")
    if not argv:
        raise SandboxError("empty command", "INVALID_ARGUMENT")
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, cwd=cwd, env=env, start_new_session=True, close_fds=True,
            pass_fds=tuple(pass_fds),
            preexec_fn=_preexec_rlimits(limits) if rlimits == "preexec" else None)
    except ValueError as e:  # NUL bytes in argv or env
        raise SandboxError(f"invalid command or environment: {e}", "INVALID_ARGUMENT") from e
    except OSError as e:
        code = {errno.ENOENT: 127, errno.EACCES: 126, errno.ENOEXEC: 126}.get(e.errno or 0)
        if code is None:
            return ExecResult(verdict=Verdict.ERROR, exit_code=None, detail=f"could not start {argv[0]!r}: {e}")
        return ExecResult(verdict=Verdict.FAILED, exit_code=code, stderr=str(e).encode(),
                          detail=f"could not start {argv[0]!r}: {e}")
    run = _Run(proc, limits, stdin, cancel)
    try:
        if on_start is not None:
            on_start(proc.pid)
        run.loop(t0 + limits.wall_s if limits.wall_s > 0 else math.inf)
    finally:
        if run.reason is None and not run.exited:  # an exception in the loop: never leave the command running
            run.kill()
        run.close()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)  # so that Popen never waits for this pid again
    wall_s = time.monotonic() - t0
    cpu_s = usage.ru_utime + usage.ru_stime
    exit_code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    stdout, stderr = bytes(run.out["stdout"]), bytes(run.out["stderr"])
    run.out.clear()  # the copies above are what lives on; a payload's worth of memory goes back now
    if run.reason == "wall" and any(m in stderr for m in _PROCESS_MARKS):
        # a fork bomb is stopped by the process limit, but its first process may not notice before the wall clock
        verdict = Verdict.PROCESS_LIMIT
        detail = f"process/thread limit of {limits.processes} reached, then the wall-clock limit of {limits.wall_s:g}s"
    elif run.reason == "wall":
        verdict, detail = Verdict.TIMEOUT, f"wall-clock limit of {limits.wall_s:g}s exceeded"
    elif run.reason == "cancel":
        verdict, detail = Verdict.CANCELLED, "cancelled by the caller"
    elif run.reason in ("stdout", "stderr"):
        verdict, detail = Verdict.OUTPUT_LIMIT, f"{run.reason} went over {limits.output_bytes} bytes"
    else:
        verdict, detail = classify(exit_code, sig, limits, stderr, cpu_s, scan_dirs)
    return ExecResult(verdict=verdict, exit_code=exit_code, signal=sig, stdout=stdout, stderr=stderr,
                      stdout_truncated=run.truncated["stdout"], stderr_truncated=run.truncated["stderr"], wall_s=wall_s,
                      cpu_s=cpu_s, detail=detail)
