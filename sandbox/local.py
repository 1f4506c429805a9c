"""The local sandbox backend: each command runs in a fresh bubblewrap (``bwrap``) container on this machine.

Isolation, when the service runs as root (as in CI and in the service's container):

- ``bwrap`` runs as root *without* a user namespace and unshares the ipc, pid, net, uts and cgroup namespaces. The
  sandbox sees a read-only ``/usr`` (and the ``/bin``, ``/lib*``, ``/sbin`` links), a minimal ``/etc`` staged by
  the backend (no ``/etc/shadow``), its own ``/proc`` and ``/dev``, the Python installation read-only, and its
  session's ``/work`` (the cwd) and ``/tmp`` read-write. Nothing from ``/root``, ``/home``, the project, or other
  sessions. The network namespace has only a loopback interface of its own.
- Inside, ``setpriv`` drops to the session's own uid/gid ``uid_base + slot`` (no supplementary groups, empty
  capability and bounding sets, no_new_privs) before anything untrusted runs. A uid per session means that
  RLIMIT_NPROC counts only that session's processes (root is exempt from it), and that sessions cannot read each
  other's files or signal each other. ``env -i`` then sets the program's environment, so that the caller's
  variables (``LD_PRELOAD``...) never reach a privileged process, and ``prlimit`` applies the rlimits, so no
  preexec_fn is needed (the service calls exec from many threads, where preexec_fn is unsafe).
- The chain runs as pid 1 of its pid namespace (``--as-pid-1``) and ends with ``timeout``, which forks the program
  and waits for it: when the program exits, pid 1 exits and the kernel kills everything left in the namespace, so
  nothing the program started survives it; bwrap waits for pid 1, so the program's CPU time reaches our wait4.
  ``timeout`` also kills the program a few seconds after its wall limit, which bounds how long a sandbox outlives
  a crashed service. Signals are reported by bwrap/timeout as exit status 128+N; ``exec`` turns those back into
  signals (so a program that itself exits with 137 is reported as killed by SIGKILL).
- bwrap's ``--new-session`` is not used: pid 1 must stay in the process group that ``run_command`` kills (its
  parent-death signal does not survive the uid change), and ``start_new_session`` already leaves the sandbox
  without a controlling terminal, which is what ``--new-session`` protects.

Not running as root: bwrap uses an unprivileged user namespace (``--unshare-user``) and the uid stays the service's
own. Weaker: RLIMIT_NPROC then counts all of that user's processes and threads on the machine (the service's
included), so the fork-bomb limit is shared and can be hit by the service itself; and sessions share a uid, so
only the mount and pid namespaces keep them apart. Neither mode has a seccomp filter or disk quotas.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import heapq
import os
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from sandbox.backend import ExecResult, Limits, SandboxError, Verdict, check_relative_path, open_parent_dir
from sandbox.runner import classify, prlimit_argv, run_command

_ETC_FILES = ("passwd", "group", "hosts", "host.conf", "nsswitch.conf", "gai.conf", "ld.so.cache", "ld.so.conf",
              "ld.so.conf.d", "localtime", "ssl", "alternatives", "protocols", "services", "mime.types")
_SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_SANDBOX_PATH = "/sandbox/bin:/usr/local/bin:/usr/bin:/bin"
_KILLED_BY_US = (Verdict.TIMEOUT, Verdict.OUTPUT_LIMIT, Verdict.CANCELLED)
_BACKSTOP_S = 5  # timeout(1) kills the program this long after its wall limit if the service could not
_CLOSE_WAIT_S = 10.0


def _tool(name: str) -> str:
    path = shutil.which(name, path="/usr/bin:/bin:/usr/sbin:/sbin")
    if path is None:
        raise SandboxError(f"{name} is not installed; the local sandbox backend needs it (util-linux/coreutils)",
                           "UNAVAILABLE")
    return path


def _rmtree(path: Path) -> None:
    """Remove a tree the sandbox filled; without root, first give back the permissions the program may have taken."""
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():
        with contextlib.suppress(OSError):
            os.chmod(path, 0o700)
        for dirpath, dirnames, _ in os.walk(path):
            for d in dirnames:  # before os.walk descends into it
                p = os.path.join(dirpath, d)
                if not os.path.islink(p):
                    with contextlib.suppress(OSError):
                        os.chmod(p, 0o700)
        shutil.rmtree(path, ignore_errors=True)


_UID_LOCKS = Path(tempfile.gettempdir()) / "rl-sandbox-uids"


def _claim_uid(uid: int) -> int | None:
    """Claim ``uid`` host-wide for one session (an flock held while the session lives); None if another holds it.

    Sessions are told apart by their uid (process limits, permissions, the clean-up below), so two backends on
    one host, in one process or several, must never hand out the same uid at the same time.
    """
    _UID_LOCKS.mkdir(mode=0o700, exist_ok=True)
    fd = os.open(_UID_LOCKS / str(uid), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _release_uid(fd: int | None) -> None:
    if fd is not None and fd >= 0:
        with contextlib.suppress(OSError):
            os.close(fd)  # closing the descriptor drops the flock


def _live_pids(uid: int) -> list[int]:
    """Processes of ``uid`` that are not zombies (a zombie is already dead; its parent reaps it)."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if os.stat(f"/proc/{name}").st_uid == uid:
                with open(f"/proc/{name}/stat", "rb") as f:
                    if f.read().rsplit(b")", 1)[-1].split()[0] != b"Z":
                        pids.append(int(name))
    return pids


def _reap_uid(uid: int, timeout_s: float = 2.0) -> None:
    """Wait until no process of the session's own uid is left, SIGKILLing stragglers.

    The kernel tears down the pid namespace asynchronously once its pid 1 exits, so a killed program's
    children can still be alive for a moment after bwrap is reaped; an exec returns only once they are gone.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        pids = _live_pids(uid)
        if not pids or time.monotonic() > deadline:
            return
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.005)


class _EitherEvent(threading.Event):
    """Set when the caller's cancel event or the session's close event is (run_command only calls is_set)."""

    def __init__(self, *events: threading.Event):
        super().__init__()
        self._events = events

    def is_set(self) -> bool:
        """Whether any of the events is set."""
        return any(e.is_set() for e in self._events)


class LocalBackend:
    """Sessions in bubblewrap containers on this machine; see the module docstring for the isolation."""

    name = "local"

    def __init__(self, root: str | Path | None = None, *, python: str | None = None, uid_base: int = 61000,
                 max_sessions: int = 1024, ro_paths: Sequence[str] = ()):
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise SandboxError("bubblewrap (bwrap) is not installed; the local sandbox backend needs it: "
                               "apt-get install bubblewrap", "UNAVAILABLE")
        self.as_root = os.geteuid() == 0
        self.uid_base, self.max_sessions = uid_base, max_sessions
        self._env, self._prlimit, self._timeout = _tool("env"), _tool("prlimit"), _tool("timeout")
        self._setpriv = _tool("setpriv")
        # how the sandbox's own tools (not the program) report a failure: they prefix their messages with argv[0]
        self.tool_errors = tuple(f"{t}: ".encode() for t in ("bwrap", bwrap, self._setpriv, self._env, self._prlimit))
        self._own_root = root is None
        self.root = Path(tempfile.mkdtemp(prefix="rl-sandbox-") if root is None else root).absolute()
        self.root.mkdir(parents=True, exist_ok=True)
        self.python = self._find_python(python)
        self._lock = threading.Lock()
        self._free = list(range(max_sessions))  # a heap of free slots: smallest first
        self._sessions: dict[str, LocalSession] = {}
        self._closed = False
        etc = self._stage_etc()
        self._base = self._base_argv(bwrap, etc, ro_paths)

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

    def _stage_etc(self) -> Path:
        """A minimal /etc for the sandboxes: copies of the harmless host files, plus users for the sandbox uids."""
        etc = self.root / ".etc"
        shutil.rmtree(etc, ignore_errors=True)
        etc.mkdir(mode=0o755)
        for name in _ETC_FILES:
            src = Path("/etc") / name
            if src.is_symlink():
                os.symlink(os.readlink(src), etc / name)
            elif src.is_dir():
                shutil.copytree(src, etc / name, symlinks=True, ignore=shutil.ignore_patterns("private"))
            elif src.is_file():
                shutil.copyfile(src, etc / name)
        if self.as_root:  # so that getpass.getuser(), ~ and friends work for the sandbox uids
            ids = range(self.uid_base, self.uid_base + self.max_sessions)
            with open(etc / "passwd", "a") as f:
                f.writelines(f"sandbox{u - self.uid_base}:x:{u}:{u}:sandbox:/tmp:/usr/sbin/nologin\n" for u in ids)
            with open(etc / "group", "a") as f:
                f.writelines(f"sandbox{u - self.uid_base}:x:{u}:\n" for u in ids)
        for dirpath, dirnames, filenames in os.walk(etc):
            for d in dirnames:
                os.chmod(os.path.join(dirpath, d), 0o755, follow_symlinks=False)
            for fn in filenames:
                p = os.path.join(dirpath, fn)
                if not os.path.islink(p):
                    os.chmod(p, 0o644)
        return etc

    def _base_argv(self, bwrap: str, etc: Path, ro_paths: Sequence[str]) -> list[str]:
        """The constant part of every bwrap command line, built once."""
        a = [bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
             "--hostname", "sandbox", "--die-with-parent", "--as-pid-1", "--clearenv", "--cap-drop", "ALL"]
        if self.as_root:
            a += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP"]
        else:
            a += ["--unshare-user"]
        a += ["--ro-bind", "/usr", "/usr"]
        for link in _SYSTEM_LINKS:
            if os.path.islink(link):
                a += ["--symlink", os.readlink(link), link]
            elif os.path.isdir(link):
                a += ["--ro-bind", link, link]
        a += ["--ro-bind", str(etc), "/etc", "--proc", "/proc", "--dev", "/dev",
              "--perms", "1777", "--size", str(64 << 20), "--tmpfs", "/dev/shm"]
        made: set[str] = set()
        prefix = Path(self.python).parent.parent
        for path in [str(prefix), *ro_paths]:
            path = os.path.abspath(path)
            if not os.path.exists(path):
                raise SandboxError(f"read-only path {path!r} does not exist", "INVALID_ARGUMENT")
            if path == "/" or any(path == p or path.startswith(p + "/") for p in ("/usr", "/etc", "/proc", "/dev")):
                continue  # already visible (or must not be replaced)
            for parent in reversed(Path(path).parents[:-1]):  # bwrap would create missing parents 0700
                if str(parent) not in made:
                    made.add(str(parent))
                    a += ["--perms", "0755", "--dir", str(parent)]
            a += ["--ro-bind", path, path]
        a += ["--perms", "0755", "--dir", "/sandbox", "--perms", "0755", "--dir", "/sandbox/bin"]
        for name in ("python3", "python", f"python{sys.version_info.major}.{sys.version_info.minor}"):
            a += ["--symlink", self.python, f"/sandbox/bin/{name}"]
        return a

    def create_session(self, image: str = "", files: dict[str, bytes] | None = None) -> LocalSession:
        """A new session with its own uid and work directory; ``image`` is ignored (no containers images here)."""
        with self._lock:
            if self._closed:
                raise SandboxError("the local sandbox backend is closed", "UNAVAILABLE")
            slot, lock_fd, busy = None, None, []
            while self._free and lock_fd is None:
                slot = heapq.heappop(self._free)
                lock_fd = _claim_uid(self.uid_base + slot) if self.as_root else -1
                if lock_fd is None:
                    busy.append(slot)  # held by another backend on this host (another service, another test)
            for b in busy:
                heapq.heappush(self._free, b)
            if lock_fd is None:
                raise SandboxError(f"all {self.max_sessions} local sandbox sessions are in use", "RESOURCE_EXHAUSTED")
        try:
            session = LocalSession(self, slot)
            session.uid_lock = lock_fd
        except BaseException:
            _release_uid(lock_fd)
            self._release_slot(slot)
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

    def _release_slot(self, slot: int) -> None:
        with self._lock:
            heapq.heappush(self._free, slot)

    def _forget(self, session: LocalSession) -> None:
        with self._lock:
            self._sessions.pop(session.id, None)
            _release_uid(session.uid_lock)
            session.uid_lock = -1
            heapq.heappush(self._free, session.slot)

    def close(self) -> None:
        """Close every session; remove the root directory if this backend made it."""
        with self._lock:
            self._closed = True
            sessions = list(self._sessions.values())
        for s in sessions:
            s.close()
        _rmtree(self.root / ".etc")
        if self._own_root:
            _rmtree(self.root)

    def session_argv(self, uid: int, work: Path, tmp: Path) -> list[str]:
        """The bwrap command line of one session, up to the program's environment."""
        a = [*self._base, "--bind", str(work), "/work", "--bind", str(tmp), "/tmp", "--chdir", "/", self._setpriv]
        if self.as_root:
            a += [f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all"]
        return [*a, "--no-new-privs", "--", self._env, "-i", "-C", "/work"]

    def tail_argv(self, limits: Limits) -> list[str]:
        """The per-command rlimits and the waiting ``timeout`` that precede the program's argv."""
        backstop = int(limits.wall_s) + _BACKSTOP_S if limits.wall_s > 0 else 0
        return [*prlimit_argv(limits, self._prlimit), self._timeout, "--foreground", "--signal=KILL", str(backstop)]


class LocalSession:
    """One session: a uid, a work directory and a /tmp on this machine; commands run in bwrap containers."""

    def __init__(self, backend: LocalBackend, slot: int):
        self.backend, self.slot = backend, slot
        self.id = uuid.uuid4().hex
        self.uid = backend.uid_base + slot if backend.as_root else os.getuid()
        self.uid_lock: int | None = None  # the host-wide claim on self.uid (see _claim_uid)
        self.dir = backend.root / self.id
        self.work, self.tmp = self.dir / "work", self.dir / "tmp"
        self.dir.mkdir(mode=0o700)
        for d in (self.work, self.tmp):
            d.mkdir(mode=0o700)
            if backend.as_root:
                os.chown(d, self.uid, self.uid)
        self._argv = backend.session_argv(self.uid, self.work, self.tmp)
        self._scan = [str(self.work), str(self.tmp)]
        self._closed = threading.Event()
        self._cond = threading.Condition()
        self._inflight = 0

    def _check_open(self) -> None:
        if self._closed.is_set():
            raise SandboxError(f"session {self.id} is closed", "NOT_FOUND")

    def exec(self, argv: list[str], limits: Limits, stdin: bytes = b"", env: dict[str, str] | None = None,
             cancel: threading.Event | None = None) -> ExecResult:
        """Run ``argv`` in /work under ``limits``; ``cancel`` set (or the session closed) → killed, CANCELLED."""
        if not argv:
            raise SandboxError("empty command", "INVALID_ARGUMENT")
        merged = {"PATH": _SANDBOX_PATH, "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
                  "PYTHONDONTWRITEBYTECODE": "1", **(env or {})}
        for k, v in merged.items():
            if not k or "=" in k or "\0" in k or "\0" in v:
                raise SandboxError(f"invalid environment variable {k!r}", "INVALID_ARGUMENT")
        # PATH stays first: env(1) stops parsing options at the first NAME=VALUE
        full = [*self._argv, *(f"{k}={v}" for k, v in merged.items()), *self.backend.tail_argv(limits), *argv]
        with self._cond:
            self._check_open()
            self._inflight += 1
        try:
            res = run_command(full, limits, cwd=str(self.dir), env={}, stdin=stdin,
                              cancel=_EitherEvent(self._closed, cancel) if cancel else self._closed,
                              rlimits="none", scan_dirs=self._scan)
            if self.backend.as_root:
                _reap_uid(self.uid)
        finally:
            with self._cond:
                self._inflight -= 1
                self._cond.notify_all()
        return self._fix_result(res, limits)

    def _fix_result(self, res: ExecResult, limits: Limits) -> ExecResult:
        """Turn bwrap's 128+N statuses back into signals and tell the sandbox's own failures apart."""
        if res.verdict == Verdict.CANCELLED and self._closed.is_set():
            res.detail = "the session was closed"
        if res.verdict in _KILLED_BY_US or res.exit_code is None:
            return res
        if res.exit_code in (1, 125, 127) and res.stderr.startswith(self.backend.tool_errors):
            res.verdict, res.detail = Verdict.ERROR, "sandbox failed: " + res.stderr.decode(errors="replace")[:500]
        elif 128 < res.exit_code < 128 + 65:
            res.signal, res.exit_code = res.exit_code - 128, None
            res.verdict, res.detail = classify(None, res.signal, limits, res.stderr, res.cpu_s, self._scan)
        return res

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
        """Kill the running command if any, delete the session's directory and free its slot. Idempotent."""
        with self._cond:
            if self._closed.is_set():
                return
            self._closed.set()  # the running exec sees it as a cancel and kills the sandbox
            self._cond.wait_for(lambda: self._inflight == 0, timeout=_CLOSE_WAIT_S)
        _rmtree(self.dir)
        self.backend._forget(self)
