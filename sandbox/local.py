"""The local sandbox backend: each command runs in a fresh bubblewrap (``bwrap``) container on this machine.

Isolation, when the service runs as root (as in CI and in the service's container):

- ``bwrap`` runs as root *without* a user namespace and unshares the ipc, pid, net, uts and cgroup namespaces. The
  sandbox sees a read-only ``/usr`` (and the ``/bin``, ``/lib*``, ``/sbin`` links), a minimal ``/etc`` staged by
  the backend (no ``/etc/shadow``), its own ``/proc`` and ``/dev``, the Python installation read-only, and its
  session's ``/work`` (the cwd) and ``/tmp`` read-write. Nothing from ``/root``, ``/home``, the project, or other
  sessions. The network namespace has only a loopback interface of its own.
- Each session's ``/work`` and ``/tmp`` live on one tmpfs of ``disk_mb`` (and a bounded number of files)
  mounted for the session: an aggregate disk quota, and clean-up is an unmount whatever the program left there.
- Each session has its own cgroup (``sandbox.cgroups``, v2 or v1): memory, processes and CPU of the whole sandbox
  are limited together, on top of the per-process rlimits, and the cgroup's counters tell which limit was hit.
  The service starts bwrap, moves it into the cgroup and sets the rlimits on it (prlimit(2)), and only then hands
  it its options (``--args``): so everything the sandbox runs starts inside the cgroup and under the rlimits, with
  no shell and no preexec_fn (the service calls exec from many threads, where preexec_fn is unsafe).
- A seccomp filter (``sandbox.seccomp``) refuses the system calls a judged program never needs: kernel keyrings,
  ptrace and reading other processes' memory, new namespaces and mounts, io_uring, bpf, perf events, modules...
- Inside, ``setpriv`` drops to the session's own uid/gid ``uid_base + slot`` (no supplementary groups, empty
  capability and bounding sets, no_new_privs) before anything untrusted runs; until then bwrap keeps only the
  capabilities that needs, and DAC_READ_SEARCH, with which it enters ``/work`` (the session uid's own 0700
  directory) as the cwd. A uid per session means that RLIMIT_NPROC counts only that session's processes (root is
  exempt from it), and that sessions cannot read each other's files or signal each other. A uid is handed out again
  only once nothing of its last session is left: no process (the session's cgroup is empty, or without cgroups none
  of the uid's in /proc), no directory, no kernel key (``sandbox.uids``); until then its slot waits and is checked
  again later. bwrap and setpriv, which run as root, get a fixed environment; the caller's variables
  (``LD_PRELOAD``...), if any, are set by ``env -i`` after the switch to the session's uid, so they never reach a
  privileged process.
- The chain runs as pid 1 of its pid namespace (``--as-pid-1``) and ends with ``timeout``, which forks the program
  and waits for it: when the program exits, pid 1 exits and the kernel kills everything left in the namespace, so
  nothing the program started survives it; bwrap waits for pid 1, so the program's CPU time reaches our wait4.
  ``timeout`` also kills the program a few seconds after its wall limit, which bounds how long a sandbox outlives
  a crashed service. Signals are reported by bwrap/timeout as exit status 128+N; ``exec`` turns those back into
  signals (so a program that itself exits with 137 is reported as killed by SIGKILL).
- bwrap's ``--new-session`` is not used: pid 1 must stay in the process group that ``run_command`` kills (its
  parent-death signal does not survive the uid change), and ``start_new_session`` already leaves the sandbox
  without a controlling terminal, which is what ``--new-session`` protects.

Where the host does not allow a mechanism (no cgroup delegation, no libseccomp, no right to mount), the backend
says so in a warning and in ``enforced``, and keeps the others. Not running as root: bwrap uses an unprivileged
user namespace (``--unshare-user``) and the uid stays the service's own. Weaker: no cgroups and no tmpfs quota
(both need root here); RLIMIT_NPROC then counts all of that user's processes and threads on the machine (the
service's included), so the fork-bomb limit is shared and can be hit by the service itself; and sessions share a
uid, so only the mount and pid namespaces keep them apart.
"""

from __future__ import annotations

import contextlib
import errno
import heapq
import logging
import os
import resource
import shutil
import stat
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

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
from sandbox.bwrap import DEFAULT_ENV, base_argv, release_system, stage_system
from sandbox.cgroups import ENTER_ERROR, CgroupManager, CgroupUnavailable, SessionCgroup, Usage
from sandbox.fs import mount_tmpfs, remove_tree, unmount
from sandbox.options import LocalOptions
from sandbox.runner import classify, prlimit_argv, run_command, set_rlimits
from sandbox.seccomp import SeccompUnavailable, write_filter

log = logging.getLogger(__name__)
_KILLED_BY_US = (Verdict.TIMEOUT, Verdict.OUTPUT_LIMIT, Verdict.CANCELLED)
_BACKSTOP_S = 5  # timeout(1) kills the program this long after its wall limit if the service could not
_BWRAP_FILES, _BWRAP_MEMORY = 16, 16 << 20  # rlimits below these are set inside: bwrap itself needs that much
_CLOSE_WAIT_S = 10.0
_BYTES_PER_INODE = 4096  # files a session may hold: one per 4 KiB of its quota (at least 16384)


def _tool(name: str) -> str:
    path = shutil.which(name, path="/usr/bin:/bin:/usr/sbin:/sbin")
    if path is None:
        raise SandboxError(f"{name} is not installed; the local sandbox backend needs it (util-linux/coreutils)",
                           "UNAVAILABLE")
    return path


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


class LocalBackend:
    """Sessions in bubblewrap containers on this machine; see the module docstring for the isolation."""

    name = "local"

    def __init__(self, root: str | Path | None = None, *, options: LocalOptions | None = None,
                 python: str | None = None, uid_base: int = 61000, max_sessions: int = 1024,
                 ro_paths: Sequence[str] = (), cgroups: bool = True, seccomp: bool = True):
        """``options``: a run config's keys for this backend (the disk quota of each session's /work and /tmp);
        ``cgroups`` / ``seccomp`` False turn those mechanisms off (for comparison); ``enforced`` then says what is in
        force and ``warnings`` why not."""
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise SandboxError("bubblewrap (bwrap) is not installed; the local sandbox backend needs it: "
                               "apt-get install bubblewrap", "UNAVAILABLE")
        self.as_root = os.geteuid() == 0
        self.options = options if options is not None else LocalOptions()
        self.uid_base, self.max_sessions, self.disk_bytes = uid_base, max_sessions, self.options.disk_bytes
        self.env_tool, self._prlimit, self._timeout = _tool("env"), _tool("prlimit"), _tool("timeout")
        self._setpriv = _tool("setpriv")
        # how the sandbox's own tools (not the program) report a failure: they prefix their messages with argv[0]
        tools = ("bwrap", bwrap, self._setpriv, self.env_tool, self._prlimit)
        self.tool_errors = tuple(f"{t}: ".encode() for t in tools)
        self._own_root = root is None
        self.root = Path(tempfile.mkdtemp(prefix="rl-sandbox-") if root is None else root).absolute()
        self.root.mkdir(parents=True, exist_ok=True)
        self.python = self._find_python(python)
        self._lock = threading.Lock()
        self._free = list(range(max_sessions))  # a heap of free slots: smallest first
        self._dirty: dict[int, LocalSession] = {}  # slots whose last session left something behind
        self._sessions: dict[str, LocalSession] = {}
        self._closed = False
        self.enforced: dict[str, str] = {}
        self.warnings: list[str] = []
        self.cgroups = self._setup_cgroups(cgroups)
        self.seccomp_file = self._setup_seccomp(seccomp)
        self.tmpfs = self._setup_tmpfs()
        for w in self.warnings:
            log.warning("local sandbox: %s", w)
        self._system = stage_system(self.root, range(uid_base, uid_base + max_sessions) if self.as_root else None)
        self._base = base_argv(bwrap, self._system[0], self.python, as_root=self.as_root, ro_paths=ro_paths)

    def _setup_cgroups(self, wanted: bool) -> CgroupManager | None:
        if not wanted:
            self.warnings.append("cgroup limits turned off: memory and processes are limited per process only")
            return None
        try:
            mgr = CgroupManager.probe()
        except CgroupUnavailable as e:
            self.warnings.append(f"no whole-sandbox limits ({e}); memory and processes are limited per process "
                                 "only (rlimits)")
            return None
        self.enforced["cgroup"] = f"{mgr.mode} (memory, pids, cpu)"
        return mgr

    def _setup_seccomp(self, wanted: bool) -> Path | None:
        if not wanted:
            self.warnings.append("seccomp filter turned off")
            return None
        path = self.root / ".seccomp.bpf"
        try:
            write_filter(path)
        except (SeccompUnavailable, OSError) as e:
            self.warnings.append(f"no seccomp filter: {e}")
            return None
        self.enforced["seccomp"] = "on"
        return path

    def _setup_tmpfs(self) -> bool:
        """Whether sessions get a size-limited tmpfs (needs the right to mount: root in the host's namespace)."""
        if self.disk_bytes <= 0:
            self.warnings.append("disk quota turned off (disk_mb=0)")
            return False
        probe = self.root / ".tmpfs-probe"
        try:
            probe.mkdir(exist_ok=True)
            mount_tmpfs(probe, 1 << 20, 16)
            unmount(probe)
        except OSError as e:
            self.warnings.append(f"no disk quota per session (cannot mount a tmpfs: {e.strerror or e})")
            return False
        finally:
            with contextlib.suppress(OSError):
                probe.rmdir()
        self.enforced["disk_quota"] = f"{self.disk_bytes >> 20} MiB per session (tmpfs)"
        return True

    def describe(self) -> str:
        """One line: what this backend enforces beyond namespaces and rlimits."""
        parts = [f"{k.replace('_', ' ')} {v}" for k, v in self.enforced.items()]
        return "; ".join(parts) if parts else "namespaces and rlimits only"

    @staticmethod
    def _find_python(python: str | None) -> str:
        """The interpreter's real path: the base one by default, since the venv lives inside the project."""
        if python is None:
            ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
            cands = [Path(sys.base_prefix) / "bin" / ver, Path(sys.base_prefix) / "bin" / "python3",
                     Path(getattr(sys, "_base_executable", sys.executable))]
            python = next((str(c) for c in cands if c.is_file()), sys.executable)
        real = os.path.realpath(python)
        if not os.path.isfile(real) or not os.access(real, os.X_OK):
            raise SandboxError(f"python interpreter {python!r} not found", "UNAVAILABLE")
        return real

    def create_session(self, image: str = "", files: dict[str, bytes] | None = None) -> LocalSession:
        """A new session with its own uid and work directory; ``image`` is ignored (no containers images here)."""
        self._retry_dirty()
        with self._lock:
            if self._closed:
                raise SandboxError("the local sandbox backend is closed", "UNAVAILABLE")
            slot, lock_fd, busy = None, None, []
            while self._free and lock_fd is None:
                slot = heapq.heappop(self._free)
                lock_fd = uids.claim(self.uid_base + slot) if self.as_root else -1
                if lock_fd is None:
                    busy.append(slot)  # held by another backend on this host (another service, another test)
            for b in busy:
                heapq.heappush(self._free, b)
            if lock_fd is None:
                dirty = f" ({len(self._dirty)} waiting for their clean-up)" if self._dirty else ""
                raise SandboxError(f"all {self.max_sessions} local sandbox sessions are in use{dirty}",
                                   "RESOURCE_EXHAUSTED")
        try:
            session = LocalSession(self, slot)
            session.uid_lock = lock_fd
        except BaseException:
            uids.release(lock_fd)
            with self._lock:
                heapq.heappush(self._free, slot)
            raise
        with self._lock:
            closed = self._closed
            self._sessions[session.id] = session
        if closed:  # the backend was closed while this session was being made
            session.close()
            raise SandboxError("the local sandbox backend is closed", "UNAVAILABLE")
        try:
            if files:
                session.write_files(files)
        except BaseException:
            session.close()
            raise
        return session

    def _forget(self, session: LocalSession, clean: bool) -> None:
        """Take a closed session off the books: its slot (and uid) go back to the free ones only when ``clean``."""
        with self._lock:
            self._sessions.pop(session.id, None)
            if clean:
                uids.release(session.uid_lock)
                session.uid_lock = -1
                self._dirty.pop(session.slot, None)
                heapq.heappush(self._free, session.slot)
            else:
                self._dirty[session.slot] = session

    def _retry_dirty(self) -> None:
        """Try again to clean up after the sessions that left something behind."""
        with self._lock:
            dirty = list(self._dirty.values())
        for session in dirty:
            self._forget(session, session.clean_up())

    def close(self) -> None:
        """Close every session; remove the root directory if this backend made it. Never raises."""
        with self._lock:
            self._closed = True
            sessions = list(self._sessions.values())
        for s in sessions:
            s.close()
        self._retry_dirty()
        for s in self._dirty.values():
            log.error("local sandbox: session %s (uid %d) could not be cleaned up: %s", s.id, s.uid, s.leftover)
        if self.cgroups is not None:
            self.cgroups.close()
        for path in (self._system[0], self.root / ".seccomp.bpf", *([self.root] if self._own_root else [])):
            try:
                if path == self._system[0]:
                    release_system(*self._system)
                    self._system = (path, False)
                remove_tree(path)
            except OSError as e:
                log.error("local sandbox: cannot remove %s: %s", path, e)

    def session_argv(self, uid: int, work: Path, tmp: Path) -> tuple[list[str], list[str]]:
        """The bwrap command line of one session: bwrap and its options (``--seccomp`` is added per command, with
        the descriptor it gets), and the command up to the caller's environment, if any."""
        options = [*self._base, "--bind", str(work), "/work", "--bind", str(tmp), "/tmp", "--chdir", "/work"]
        command = [self._setpriv]
        if self.as_root:
            command += [f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all"]
        return options, [*command, "--no-new-privs", "--"]

    def inner_rlimits(self, limits: Limits) -> tuple[int, ...]:
        """The rlimits that ``prlimit`` sets inside the sandbox, rather than the service on bwrap (see
        ``LocalSession._start``): without root the process limit (root is exempt from it, the service's own uid is
        not: bwrap could not even fork), and limits too small for bwrap itself to start."""
        inner = [] if self.as_root else [resource.RLIMIT_NPROC]
        if 0 < limits.open_files < _BWRAP_FILES:
            inner.append(resource.RLIMIT_NOFILE)
        if 0 < limits.memory_bytes < _BWRAP_MEMORY:
            inner.append(resource.RLIMIT_AS)
        return tuple(inner)

    def tail_argv(self, limits: Limits) -> list[str]:
        """The waiting ``timeout`` that precedes the program's argv, after ``prlimit`` for the inner rlimits."""
        backstop = int(limits.wall_s) + _BACKSTOP_S if limits.wall_s > 0 else 0
        inner = self.inner_rlimits(limits)
        return [*(prlimit_argv(limits, self._prlimit, inner) if inner else []), self._timeout, "--foreground",
                "--signal=KILL", str(backstop)]


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
                res = ExecResult(Verdict.ERROR, None, detail=f"sandbox failed: {e}")
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
