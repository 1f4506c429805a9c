"""One session of the local sandbox backend (``sandbox.local``: how a command is isolated): its uid, its tmpfs
``/work`` and ``/tmp``, its cgroup, and the bwrap container each command runs in."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from sandbox import uids
from sandbox.backend import (
    CancelEvent,
    ExecResult,
    Limits,
    SandboxError,
    Verdict,
    check_relative_path,
    note_oom_kills,
    open_parent_dir,
)
from sandbox.bwrap import DEFAULT_ENV
from sandbox.cgroups import ENTER_ERROR, SessionCgroup, Usage
from sandbox.fs import mount_tmpfs, remove_tree, unmount
from sandbox.runner import classify, run_command, set_rlimits

if TYPE_CHECKING:
    from sandbox.local import LocalBackend

log = logging.getLogger("sandbox.local")
_KILLED_BY_US = (Verdict.TIMEOUT, Verdict.OUTPUT_LIMIT, Verdict.CANCELLED)
_CLOSE_WAIT_S = 10.0
_BYTES_PER_INODE = 4096  # files a session may hold: one per 4 KiB of its quota (at least 16384)


class _StartFailed(Exception):
    """The sandbox could not be put under its limits before it started (the service's failure, not the program's)."""


class _EitherEvent(threading.Event):
    """Set when the caller's cancel event or the session's close event is (run_command calls is_set and on_set)."""

    def __init__(self, *events: threading.Event):
        super().__init__()
        self._events = events

    def is_set(self) -> bool:
        """Whether any of the events is set."""
        return any(e.is_set() for e in self._events)

    def on_set(self, callback: Callable[[], None]) -> Callable[[], None] | None:
        """Call ``callback`` when any of the events is set; None if one of them cannot tell (it is then polled)."""
        if not all(isinstance(e, CancelEvent) for e in self._events):
            return None
        removers = [e.on_set(callback) for e in self._events]
        return lambda: [remove() for remove in removers]


class LocalSession:
    """One session: a uid, a work directory and a /tmp on this machine; commands run in bwrap containers."""

    def __init__(self, backend: LocalBackend, slot: int):
        self.backend, self.slot = backend, slot
        self.id = uuid.uuid4().hex
        self.uid = backend.uid_base + slot if backend.as_root else os.getuid()
        self.uid_lock: int | None = None  # the host-wide claim on self.uid (see sandbox.uids)
        self.dir = backend.root / self.id
        self.work, self.tmp = self.dir / "work", self.dir / "tmp"
        self.leftover = ""  # what the last clean-up could not remove
        self.cgroup: SessionCgroup | None = None
        self._mounted = False
        self._closed = CancelEvent()
        self._cond = threading.Condition()
        self._inflight = 0
        try:
            self._make()
        except BaseException:
            self.clean_up()
            raise
        self._argv, self._command = backend.session_argv(self.uid, self.work, self.tmp)
        self._scan = [str(self.work), str(self.tmp)]

    def _make(self) -> None:
        b = self.backend
        self.dir.mkdir(mode=0o700)
        if b.tmpfs:
            mount_tmpfs(self.dir, b.disk_bytes, max(16384, b.disk_bytes // _BYTES_PER_INODE))
            self._mounted = True
        for d in (self.work, self.tmp):
            d.mkdir(mode=0o700)
            if b.as_root:
                os.chown(d, self.uid, self.uid)
        if b.cgroups is not None:
            self.cgroup = b.cgroups.create(self.id)

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise SandboxError(f"session {self.id} is closed", "NOT_FOUND")

    def exec(self, argv: list[str], limits: Limits, stdin: bytes = b"", env: dict[str, str] | None = None,
             cancel: threading.Event | None = None) -> ExecResult:
        """Run ``argv`` in /work under ``limits``; ``cancel`` set (or the session closed) → killed, CANCELLED."""
        if not argv:
            raise SandboxError("empty command", "INVALID_ARGUMENT")
        for k, v in (env or {}).items():
            if not k or "=" in k or "\0" in k or "\0" in v:
                raise SandboxError(f"invalid environment variable {k!r}", "INVALID_ARGUMENT")
        # The caller's variables (LD_PRELOAD...) must never reach a privileged process: bwrap and setpriv, which
        # still runs as root, get only DEFAULT_ENV; ``env -i`` sets the caller's, after the switch to the session's
        # uid. Without any, the program keeps DEFAULT_ENV and the chain is one program shorter.
        # PATH stays first: env(1) stops parsing options at the first NAME=VALUE
        set_env: list[str] = []
        if env:  # PWD: what bwrap sets after its --chdir
            merged = {**DEFAULT_ENV, "PWD": "/work", **env}
            set_env = [self.backend.env_tool, "-i", *(f"{k}={v}" for k, v in merged.items())]
        with self._cond:
            self._check_open()
            self._inflight += 1
        fds: list[int] = []
        try:
            before = Usage()
            if self.cgroup is not None:
                self.cgroup.set_limits(limits.memory_bytes, limits.processes, limits.cpus)
                before = self.cgroup.usage()
            options = self._argv[1:]
            if self.backend.seccomp_file is not None:
                fds.append(os.open(self.backend.seccomp_file, os.O_RDONLY | os.O_CLOEXEC))
                options = ["--seccomp", str(fds[-1]), *options]
            fds += os.pipe2(os.O_CLOEXEC)  # bwrap's options: read end, write end (last, see _start)
            command = [*self._command, *set_env, *self.backend.tail_argv(limits), *argv]
            try:
                res = run_command([self._argv[0], "--args", str(fds[-2]), *command], limits, cwd=str(self.dir), env={},
                                  stdin=stdin, cancel=_EitherEvent(self._closed, cancel) if cancel else self._closed,
                                  rlimits="none", scan_dirs=self._scan, pass_fds=fds[:-1],
                                  on_start=lambda pid: self._start(pid, limits, options, fds))
            except _StartFailed as e:
                res = ExecResult(verdict=Verdict.ERROR, exit_code=None, detail=f"sandbox failed: {e}")
            if self.cgroup is not None:
                self.cgroup.wait_empty()
            elif self.backend.as_root:
                uids.reap(self.uid)
            hit = self.cgroup.usage() - before if self.cgroup is not None else Usage()
            if hit.cpu_s is not None:
                # everything the sandbox ran, also what bwrap never reaped because we killed it (wall clock, output)
                res.cpu_s = hit.cpu_s
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            with self._cond:
                self._inflight -= 1
                self._cond.notify_all()
        return self._fix_result(res, limits, hit)

    def _start(self, pid: int, limits: Limits, options: list[str], fds: list[int]) -> None:
        """Put the just started bwrap into the session's cgroup and under the rlimits, then hand it its options.

        bwrap reads its options (``--args``) before it makes the sandbox, so everything the sandbox will run
        starts inside the cgroup and inherits the rlimits: two programs fewer than a shell that moves itself and
        ``prlimit``, and no preexec_fn (the service starts commands from many threads). ``pid`` is our own child,
        not yet reaped, so it cannot name another process. bwrap runs as root, which RLIMIT_NPROC exempts: it
        counts the session uid's processes once ``setpriv`` switched to it. The rlimits that cannot be set on bwrap
        are set inside (``LocalBackend.inner_rlimits``).
        """
        try:
            if self.cgroup is not None:
                self.cgroup.enter(pid)
            set_rlimits(pid, limits, skip=self.backend.inner_rlimits(limits))
        except OSError as e:
            raise _StartFailed(f"{ENTER_ERROR} or set its rlimits: {e}") from e
        data = memoryview(b"".join(os.fsencode(a) + b"\0" for a in options))
        # closed here, and only here: bwrap reads until the end, and a write fails once bwrap is gone
        args_w, args_r = fds.pop(), fds.pop()
        os.close(args_r)
        try:
            while data:  # bwrap reads all of it before it starts
                data = data[os.write(args_w, data):]
        except BrokenPipeError:
            pass  # bwrap is gone already; its exit status tells why
        finally:
            os.close(args_w)

    def _fix_result(self, res: ExecResult, limits: Limits, hit: Usage) -> ExecResult:
        """Turn bwrap's 128+N statuses back into signals, tell the sandbox's own failures apart, and name the
        whole-sandbox limit the kernel enforced (the cgroup's counters)."""
        if res.verdict == Verdict.CANCELLED and self._closed.is_set():
            res.detail = "the session was closed"
        if res.verdict in _KILLED_BY_US:
            return note_oom_kills(res, hit.oom_kills, limits.memory_bytes)
        if res.signal is not None and res.verdict is Verdict.FAILED and not hit.oom_kills:
            # bwrap itself died of a signal: it lives outside the sandbox's PID namespace, where the program cannot
            # reach it, and the service did not send it (its kills have verdicts of their own): someone outside
            # killed the sandbox (an operator, a node's OOM killer elsewhere, an eviction). Not the program's doing.
            res.verdict, res.detail = Verdict.ERROR, f"the sandbox was killed from outside (signal {res.signal})"
            return res
        if res.exit_code in (1, 125, 127) and res.stderr.startswith(self.backend.tool_errors):
            res.verdict, res.detail = Verdict.ERROR, "sandbox failed: " + res.stderr.decode(errors="replace")[:500]
            return res
        if res.exit_code is not None and 128 < res.exit_code < 128 + 65:
            res.signal, res.exit_code = res.exit_code - 128, None
            res.verdict, res.detail = classify(None, res.signal, limits, res.stderr, res.cpu_s, self._scan)
        if res.verdict == Verdict.FAILED and self._disk_full():
            res.verdict = Verdict.FILE_SIZE_LIMIT
            res.detail = (f"disk quota of {self.backend.disk_bytes} bytes for the session's /work and /tmp reached "
                          f"({res.detail})")
        # an OOM kill anywhere in the cgroup is reported, also when the command itself exited 0
        res = note_oom_kills(res, hit.oom_kills, limits.memory_bytes)
        if hit.pids_max_hits and res.verdict == Verdict.FAILED:
            how = f"killed by signal {res.signal}" if res.signal is not None else f"exit status {res.exit_code}"
            res.verdict = Verdict.PROCESS_LIMIT
            res.detail = f"process/thread limit of {limits.processes} for the whole sandbox reached ({how})"
        return res

    def _disk_full(self) -> bool:
        """Whether the session's tmpfs is (nearly) out of space or of files."""
        if not self._mounted:
            return False
        try:
            st = os.statvfs(self.dir)
        except OSError:
            return False
        return st.f_bavail * st.f_frsize < 64 << 10 or st.f_favail == 0

    def _open(self, rel: str, flags: int, mode: int = 0o644, create: bool = False) -> int:
        """Open a regular file inside /work; symlinks, directories and special files are refused."""
        try:
            dfd, name = open_parent_dir(self.work, rel, create=create,
                                        owner=self.uid if self.backend.as_root else None)
            try:
                fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=dfd)
            finally:
                os.close(dfd)
        except FileNotFoundError as e:
            raise SandboxError(f"file {rel!r} not found in the session", "NOT_FOUND") from e
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.EISDIR, errno.ENXIO, errno.EMLINK):
                raise SandboxError(f"file path {rel!r} goes through a symlink or names a non-file",
                                   "INVALID_ARGUMENT") from e
            code = "RESOURCE_EXHAUSTED" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "INTERNAL"
            raise SandboxError(f"cannot open {rel!r}: {e}", code) from e
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise SandboxError(f"file path {rel!r} is not a regular file", "INVALID_ARGUMENT")
        return fd

    def write_files(self, files: dict[str, bytes], executable: frozenset[str] = frozenset()) -> None:
        """Create or replace files under /work (parents created); paths through symlinks are refused."""
        self._check_open()
        for rel in files:
            check_relative_path(rel)
        for rel, data in files.items():
            mode = 0o755 if rel in executable else 0o644
            fd = self._open(rel, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode, create=True)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fchmod(fd, mode)
                if self.backend.as_root:
                    os.fchown(fd, self.uid, self.uid)
            except OSError as e:
                code = "RESOURCE_EXHAUSTED" if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else "INTERNAL"
                raise SandboxError(f"cannot write {rel!r}: {e}", code) from e
            finally:
                os.close(fd)

    def read_files(self, paths: list[str], max_bytes: int) -> dict[str, bytes]:
        """Read files under /work; missing → NOT_FOUND, bigger than ``max_bytes`` → RESOURCE_EXHAUSTED."""
        self._check_open()
        out: dict[str, bytes] = {}
        for rel in paths:
            fd = self._open(rel, os.O_RDONLY)
            try:
                if os.fstat(fd).st_size > max_bytes:
                    raise SandboxError(f"file {rel!r} is larger than {max_bytes} bytes", "RESOURCE_EXHAUSTED")
                with open(fd, "rb", closefd=False) as f:
                    data = f.read(max_bytes + 1)
            finally:
                os.close(fd)
            if len(data) > max_bytes:
                raise SandboxError(f"file {rel!r} is larger than {max_bytes} bytes", "RESOURCE_EXHAUSTED")
            out[rel] = data
        return out

    def close(self) -> None:
        """Kill the running command if any, delete the session's files and cgroup and free its slot. Idempotent,
        never raises: what cannot be removed keeps the slot (and its uid) out of use until a later try succeeds."""
        with self._cond:
            if self._closed.is_set():
                return
            self._closed.set()  # the running exec sees it as a cancel and kills the sandbox
            self._cond.wait_for(lambda: self._inflight == 0, timeout=_CLOSE_WAIT_S)
        self.backend._forget(self, self.clean_up())

    def clean_up(self) -> bool:
        """Remove everything of this session: processes, cgroup, files, kernel keys; True when nothing is left."""
        left = []
        b = self.backend
        # with a cgroup, its removal proves that no process of the session is left: every process of the session's
        # uid was started inside it and cannot leave it (no cgroup file system in the sandbox, no capabilities)
        if b.as_root and self.cgroup is None and not uids.reap(self.uid):
            left.append(f"processes of uid {self.uid}")
        if self.cgroup is not None:
            if self.cgroup.remove():
                self.cgroup = None
            else:
                left.append(f"cgroup {self.cgroup.dirs}")
        if self._mounted:
            try:
                unmount(self.dir)
                self._mounted = False
            except OSError as e:
                if e.errno == errno.EINVAL:  # not mounted any more
                    self._mounted = False
                else:
                    left.append(f"tmpfs on {self.dir}: {e}")
        if not self._mounted:
            try:
                remove_tree(self.dir)
            except OSError as e:
                left.append(f"directory {self.dir}: {e}")
        if b.as_root and b.seccomp_file is None and not uids.clear_keys(self.uid, b._setpriv):
            left.append(f"kernel keys of uid {self.uid}")
        self.leftover = "; ".join(left)
        if left:
            log.warning("local sandbox: session %s left %s; its slot waits for a later clean-up", self.id,
                        self.leftover)
        return not left
