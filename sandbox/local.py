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
import heapq
import logging
import os
import resource
import shutil
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

from sandbox import uids
from sandbox.backend import (
    Limits,
    SandboxError,
)
from sandbox.bwrap import base_argv, release_system, stage_system
from sandbox.cgroups import CgroupManager, CgroupUnavailable
from sandbox.fs import mount_tmpfs, remove_tree, unmount
from sandbox.local_session import LocalSession
from sandbox.options import LocalOptions
from sandbox.runner import prlimit_argv
from sandbox.seccomp import SeccompUnavailable, write_filter

log = logging.getLogger(__name__)
_BACKSTOP_S = 5  # timeout(1) kills the program this long after its wall limit if the service could not
_BWRAP_FILES, _BWRAP_MEMORY = 16, 16 << 20  # rlimits below these are set inside: bwrap itself needs that much


def _tool(name: str) -> str:
    path = shutil.which(name, path="/usr/bin:/bin:/usr/sbin:/sbin")
    if path is None:
        raise SandboxError(f"{name} is not installed; the local sandbox backend needs it (util-linux/coreutils)",
                           "UNAVAILABLE")
    return path


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
