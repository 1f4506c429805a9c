"""Whole-sandbox limits with cgroups: memory, processes and CPU of everything one sandbox runs, together.

rlimits count per process (RLIMIT_AS) or per uid (RLIMIT_NPROC); a cgroup counts the sandbox as a whole, so nine
processes of 300 MiB each cannot hold 2.7 GiB against a 512 MiB limit. One cgroup per session, under a parent made
for the backend inside the service's own cgroup (so the service's own limits still bound every sandbox):

- **cgroup v2** (the unified hierarchy with the ``memory``, ``pids`` and ``cpu`` controllers): ``memory.max``,
  ``memory.swap.max`` = 0, ``pids.max``, ``cpu.max``; ``memory.events`` and ``pids.events`` tell which limit
  was hit. The controllers must be delegated to the service's cgroup (systemd ``Delegate=yes``, or a container of
  its own: the service then moves itself into a leaf so that its cgroup may hand controllers to children).
- **cgroup v1** (hosts that still mount the per-controller hierarchies): ``memory.limit_in_bytes`` (and the
  memory+swap limit), ``pids.max``, ``cpu.cfs_quota_us``; ``memory.oom_control`` and ``pids.events`` count hits.

Where neither is possible (no root, a read-only cgroup file system, controllers not delegated) ``probe`` says why
and the backend keeps only the rlimits, with a warning.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

CONTROLLERS = ("memory", "pids", "cpu")
CPU_PERIOD_US = 100_000
#: tasks of the sandbox's own chain (bwrap's monitor and its pid 1, ``timeout``) counted by pids.max on top of the
#: program's, with room to spare
CHAIN_TASKS = 4
#: the start of the detail when a command cannot be moved into the cgroup (the sandbox's failure, not the program's)
ENTER_ERROR = "rl-sandbox: cannot enter the session cgroup"


class CgroupUnavailable(Exception):
    """Whole-sandbox limits cannot be set up here; the message says why."""


@dataclass
class Usage:
    """Counters of one session's cgroup: how often the kernel enforced a limit, and the CPU time of everything that
    ran in it (None where the host does not account it)."""

    oom_kills: int = 0
    pids_max_hits: int = 0
    cpu_s: float | None = None

    def __sub__(self, other: Usage) -> Usage:
        cpu = None if self.cpu_s is None or other.cpu_s is None else self.cpu_s - other.cpu_s
        return Usage(self.oom_kills - other.oom_kills, self.pids_max_hits - other.pids_max_hits, cpu)


def _read_keyed(path: Path, key: str) -> int:
    """The value of ``key`` in a flat-keyed cgroup file (``key value`` lines); 0 when absent."""
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v)
    except (OSError, ValueError):
        pass
    return 0


def _read_int(path: Path) -> int | None:
    """A file holding one integer, or None when absent or unreadable."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _write(path: Path, value: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fs type, super options) of the cgroup file systems, from /proc/self/mountinfo."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            pre, _, post = line.partition(" - ")
            fields, post_fields = pre.split(), post.split()
            if post_fields and post_fields[0] in ("cgroup", "cgroup2"):
                opts = set(post_fields[2].split(",")) if len(post_fields) > 2 else set()
                out.append((fields[4].replace("\\040", " "), post_fields[0], opts))
    return out


def _own_paths() -> dict[str, str]:
    """This process's cgroup path per v1 controller, and under "" its v2 path (from /proc/self/cgroup)."""
    paths = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                paths[c] = path
    return paths


class SessionCgroup:
    """The cgroup(s) of one session: limits, moving a command in, its processes, counters, removal."""

    def __init__(self, manager: CgroupManager, dirs: dict[str, Path]):
        self.manager, self.dirs = manager, dirs
        self._set: tuple | None = None

    def set_limits(self, memory_bytes: int, processes: int, cpus: float) -> None:
        """Apply the limits of the next command (0 or less: unlimited); unchanged limits are not rewritten."""
        key = (memory_bytes, processes, cpus)
        if key != self._set:
            self.manager.apply(self.dirs, memory_bytes, processes, cpus)
            self._set = key

    def enter(self, pid: int) -> None:
        """Move the process ``pid`` (and so all it starts from now on) into the session's cgroup(s); raises OSError.

        The service moves the sandbox's first process itself, before that process starts anything: cheaper than a
        shell that moves itself, and a preexec_fn is no option (the service starts commands from many threads).
        """
        for d in self.dirs.values():
            _write(d / "cgroup.procs", str(pid))

    def pids(self) -> list[int]:
        """The processes in the session's cgroup (its pids hierarchy under v1)."""
        d = self.dirs.get("pids") or self.dirs[""]
        try:
            return [int(p) for p in (d / "cgroup.procs").read_text().split()]
        except FileNotFoundError:
            return []

    def wait_empty(self, timeout_s: float = 2.0) -> bool:
        """Wait until no process is left in the session's cgroup, SIGKILLing stragglers; False if some survived.

        The kernel tears down a pid namespace asynchronously once its pid 1 is killed, so a killed program's
        children can still be alive for a moment after bwrap is reaped.
        """
        deadline = time.monotonic() + timeout_s
        d = self.dirs.get("pids") or self.dirs[""]
        while self.pids():
            if time.monotonic() > deadline:
                return False
            self.manager.kill(d)
            time.sleep(0.005)
        return True

    def usage(self) -> Usage:
        """The enforcement counters so far (compare two readings to see what one command hit)."""
        return self.manager.usage(self.dirs)

    def remove(self, timeout_s: float = 2.0) -> bool:
        """Remove the cgroup(s) once empty; False if a process is still in one after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        for d in self.dirs.values():
            while True:
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY or time.monotonic() > deadline:
                        return False
                    self.manager.kill(d)
                    time.sleep(0.01)
        return True


class CgroupManager:
    """Makes the per-session cgroups under one parent of the backend's own; ``mode`` is "v2" or "v1"."""

    def __init__(self, mode: str, parents: dict[str, Path]):
        self.mode, self.parents = mode, parents

    # -- setting up ----------------------------------------------------------------------------------------------

    @classmethod
    def probe(cls, name: str | None = None) -> CgroupManager:
        """A manager for this host (v2 preferred), with a parent cgroup made and checked; raises CgroupUnavailable."""
        if os.geteuid() != 0:
            raise CgroupUnavailable("the service does not run as root, so it cannot make cgroups")
        name = name or f"rl-sandbox-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        mounts, own = _mounts(), _own_paths()
        reasons = []
        v2 = next((m for m in mounts if m[1] == "cgroup2"), None)
        if v2 is not None:
            try:
                return cls._probe_v2(Path(v2[0]), own.get("", "/"), name)
            except CgroupUnavailable as e:
                reasons.append(f"cgroup v2: {e}")
        v1 = {c: Path(m[0]) for m in mounts if m[1] == "cgroup" for c in (*CONTROLLERS, "cpuacct") if c in m[2]}
        if all(c in v1 for c in CONTROLLERS):
            try:
                return cls._probe_v1(v1, own, name)
            except CgroupUnavailable as e:
                reasons.append(f"cgroup v1: {e}")
        elif v1:
            reasons.append(f"cgroup v1: controllers {sorted(set(CONTROLLERS) - set(v1))} are not mounted")
        raise CgroupUnavailable("; ".join(reasons) or "no cgroup file system is mounted")

    @classmethod
    def _probe_v2(cls, mount: Path, own: str, name: str) -> CgroupManager:
        base = mount / own.lstrip("/")
        try:
            available = set((base / "cgroup.controllers").read_text().split())
        except OSError as e:
            raise CgroupUnavailable(f"cannot read {base / 'cgroup.controllers'}: {e.strerror}") from None
        missing = [c for c in CONTROLLERS if c not in available]
        if missing:
            raise CgroupUnavailable(f"controllers {missing} are not available in {base} (bound to cgroup v1, or "
                                    "not delegated to the service's cgroup)")
        enable = " ".join(f"+{c}" for c in CONTROLLERS)
        try:
            _write(base / "cgroup.subtree_control", enable)
        except OSError as e:
            if e.errno != errno.EBUSY:
                raise CgroupUnavailable(f"cannot enable controllers in {base}: {e.strerror}") from None
            # "no internal processes": a cgroup that hands controllers down holds no process itself. When the
            # service is alone in its cgroup (its own container), it moves into a leaf and tries again.
            others = [p for p in (base / "cgroup.procs").read_text().split() if int(p) != os.getpid()]
            if others:
                raise CgroupUnavailable(f"{base} holds other processes ({len(others)}), so it cannot delegate "
                                        "controllers; run the service in a cgroup of its own (systemd "
                                        "Delegate=yes, or its own container)") from None
            leaf = base / "rl-sandbox-service"
            try:
                leaf.mkdir(exist_ok=True)
                _write(leaf / "cgroup.procs", str(os.getpid()))
                _write(base / "cgroup.subtree_control", enable)
            except OSError as e2:
                raise CgroupUnavailable(f"cannot enable controllers in {base}: {e2.strerror}") from None
        parent = base / name
        try:
            parent.mkdir()
            _write(parent / "cgroup.subtree_control", enable)
        except OSError as e:
            with contextlib.suppress(OSError):
                parent.rmdir()
            raise CgroupUnavailable(f"cannot make {parent}: {e.strerror}") from None
        mgr = cls("v2", {"": parent})
        mgr._check()
        return mgr

    @classmethod
    def _probe_v1(cls, mounts: dict[str, Path], own: dict[str, str], name: str) -> CgroupManager:
        parents = {}
        # CPU time is accounted by cpuacct, mounted with cpu (cpu,cpuacct) or, on some hosts, on its own
        wanted = [*CONTROLLERS, *(["cpuacct"] if "cpuacct" in mounts and mounts["cpuacct"] != mounts["cpu"] else [])]
        try:
            for c in wanted:
                parent = mounts[c] / own.get(c, "/").lstrip("/") / name
                parent.mkdir()
                parents[c] = parent
        except OSError as e:
            for p in parents.values():
                with contextlib.suppress(OSError):
                    p.rmdir()
            raise CgroupUnavailable(f"cannot make a cgroup under {mounts[c]}: {e.strerror}") from None
        mgr = cls("v1", parents)
        mgr._check()
        return mgr

    def _check(self) -> None:
        """Make a probe session cgroup and set limits on it, so that a host that refuses fails here, not later."""
        try:
            probe = self.create("probe")
            probe.set_limits(64 << 20, 8, 1.0)
            probe.usage()
            probe.remove()
        except OSError as e:
            self.close()
            raise CgroupUnavailable(f"cannot set limits on a cgroup: {e}") from None

    # -- per session ---------------------------------------------------------------------------------------------

    def create(self, session: str) -> SessionCgroup:
        """A new session cgroup (in each v1 hierarchy)."""
        dirs = {}
        try:
            for c, parent in self.parents.items():
                d = parent / session
                d.mkdir()
                dirs[c] = d
        except OSError:
            for d in dirs.values():
                with contextlib.suppress(OSError):
                    d.rmdir()
            raise
        return SessionCgroup(self, dirs)

    def apply(self, dirs: dict[str, Path], memory_bytes: int, processes: int, cpus: float) -> None:
        """Write the limits into a session's cgroup(s)."""
        quota = int(cpus * CPU_PERIOD_US) if cpus > 0 else -1
        pids = str(processes + CHAIN_TASKS) if processes > 0 else "max"
        if self.mode == "v2":
            d = dirs[""]
            _write(d / "memory.max", str(memory_bytes) if memory_bytes > 0 else "max")
            with contextlib.suppress(FileNotFoundError):  # no swap accounting in this kernel: nothing to swap to
                _write(d / "memory.swap.max", "0")
            _write(d / "pids.max", pids)
            _write(d / "cpu.max", f"{quota if quota > 0 else 'max'} {CPU_PERIOD_US}")
            return
        mem = dirs["memory"]
        limit = str(memory_bytes) if memory_bytes > 0 else "-1"
        memsw = mem / "memory.memsw.limit_in_bytes"
        # memory.limit_in_bytes may never exceed the memory+swap limit: raise that one first, lower it last
        if memsw.exists():
            _write(memsw, "-1")
        _write(mem / "memory.limit_in_bytes", limit)
        if memsw.exists():
            _write(memsw, limit)
        _write(dirs["pids"] / "pids.max", pids)
        _write(dirs["cpu"] / "cpu.cfs_period_us", str(CPU_PERIOD_US))
        _write(dirs["cpu"] / "cpu.cfs_quota_us", str(quota))

    def usage(self, dirs: dict[str, Path]) -> Usage:
        """The counters of a session's cgroup(s): oom_kill of memory.events (v1: memory.oom_control), pids.events'
        max, and CPU time (cpu.stat's usage_usec; v1: cpuacct.usage, in ns)."""
        if self.mode == "v2":
            d = dirs[""]
            usec = _read_keyed(d / "cpu.stat", "usage_usec") if (d / "cpu.stat").exists() else None
            return Usage(_read_keyed(d / "memory.events", "oom_kill"), _read_keyed(d / "pids.events", "max"),
                         None if usec is None else usec / 1e6)
        ns = _read_int(dirs.get("cpuacct", dirs["cpu"]) / "cpuacct.usage")
        return Usage(_read_keyed(dirs["memory"] / "memory.oom_control", "oom_kill"),
                     _read_keyed(dirs["pids"] / "pids.events", "max"), None if ns is None else ns / 1e9)

    def kill(self, d: Path) -> None:
        """SIGKILL whatever is still in a session cgroup (v2's cgroup.kill; v1: each pid)."""
        if self.mode == "v2":
            with contextlib.suppress(OSError):
                _write(d / "cgroup.kill", "1")
            return
        with contextlib.suppress(OSError):
            for pid in (d / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    os.kill(int(pid), 9)

    def close(self) -> None:
        """Remove the backend's parent cgroup(s) (their session cgroups must be gone)."""
        for parent in self.parents.values():
            with contextlib.suppress(OSError):
                for child in parent.iterdir():
                    if child.is_dir():
                        self.kill(child)
                        with contextlib.suppress(OSError):
                            child.rmdir()
            with contextlib.suppress(OSError):
                parent.rmdir()
