"""The parts of the local backend's bubblewrap containers that are the same for every session: the staged ``/etc``,
the masks over ``/proc``, and the constant head of the ``bwrap`` command line (see ``sandbox.local`` for the
isolation they make up).

The staged files live on a tmpfs of their own where the service may mount one (root): a bind mount shows its source
directory in the sandbox's ``/proc/self/mountinfo``, and from a tmpfs that is ``/etc``, not a directory of the host.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from sandbox.backend import SandboxError
from sandbox.fs import mount_tmpfs, unmount

ETC_FILES = ("passwd", "group", "hosts", "host.conf", "nsswitch.conf", "gai.conf", "ld.so.cache", "ld.so.conf",
             "ld.so.conf.d", "localtime", "ssl", "alternatives", "protocols", "services", "mime.types")
SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
SANDBOX_PATH = "/sandbox/bin:/usr/local/bin:/usr/bin:/bin"
#: /proc files a judged program never needs and that tell about the host's kernel or other processes (kernel symbols
#: and memory, loaded modules, timers of every process, keys): an unreadable empty file is bound over each that exists
MASKED_PROC = ("kallsyms", "kcore", "modules", "keys", "key-users", "timer_list", "sched_debug", "latency_stats",
               "sysrq-trigger", "kpagecount", "kpageflags", "kpagecgroup", "vmallocinfo", "iomem", "ioports",
               "config.gz")
SYSTEM_DIR = ".system"  # under the backend's root: etc/ and the mask file
_SYSTEM_TMPFS_BYTES = 64 << 20
#: the environment of every command, to which the caller's variables are added
DEFAULT_ENV = {"PATH": SANDBOX_PATH, "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1"}


def stage_system(root: Path, uids: range | None) -> tuple[Path, bool]:
    """The directory of the files every sandbox shares (``etc/``, ``masked``), on a tmpfs of its own where the
    service may mount one; returns it and whether it is mounted (``release_system`` undoes both)."""
    system = root / SYSTEM_DIR
    system.mkdir(mode=0o755, exist_ok=True)
    mounted = True
    try:
        mount_tmpfs(system, _SYSTEM_TMPFS_BYTES, 16384, mode=0o755)
    except OSError:
        mounted = False  # not root: bind sources then show under the backend's directory in mountinfo
    stage_etc(system, uids)
    masked = system / "masked"
    masked.touch()
    os.chmod(masked, 0)  # unreadable by the sandbox's uid (it has no capabilities)
    return system, mounted


def release_system(system: Path, mounted: bool) -> None:
    """Unmount the shared files' tmpfs (then the directory is empty); raises OSError."""
    if mounted:
        unmount(system)


def stage_etc(root: Path, uids: range | None) -> Path:
    """A minimal /etc in ``root`` for the sandboxes: copies of the harmless host files, plus users for the sandbox
    ``uids`` (None: the sandboxes keep the service's uid)."""
    etc = root / "etc"
    shutil.rmtree(etc, ignore_errors=True)
    etc.mkdir(mode=0o755)
    for name in ETC_FILES:
        src = Path("/etc") / name
        if src.is_symlink():
            os.symlink(os.readlink(src), etc / name)
        elif src.is_dir():
            shutil.copytree(src, etc / name, symlinks=True, ignore=shutil.ignore_patterns("private"))
        elif src.is_file():
            shutil.copyfile(src, etc / name)
    if uids is not None:  # so that getpass.getuser(), ~ and friends work for the sandbox uids
        with open(etc / "passwd", "a") as f:
            f.writelines(f"sandbox{u - uids.start}:x:{u}:{u}:sandbox:/tmp:/usr/sbin/nologin\n" for u in uids)
        with open(etc / "group", "a") as f:
            f.writelines(f"sandbox{u - uids.start}:x:{u}:\n" for u in uids)
    for dirpath, dirnames, filenames in os.walk(etc):
        for d in dirnames:
            os.chmod(os.path.join(dirpath, d), 0o755, follow_symlinks=False)
        for fn in filenames:
            p = os.path.join(dirpath, fn)
            if not os.path.islink(p):
                os.chmod(p, 0o644)
    return etc


def base_argv(bwrap: str, system: Path, python: str, *, as_root: bool, ro_paths: Sequence[str] = ()) -> list[str]:
    """The constant part of every bwrap command line: namespaces, capabilities, the read-only system, ``system``'s
    etc as /etc, the masks over /proc, ``python``'s installation and ``ro_paths`` read-only, and ``python`` as
    /sandbox/bin/python3."""
    a = [bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
         "--hostname", "sandbox", "--die-with-parent", "--as-pid-1", "--clearenv", "--cap-drop", "ALL"]
    for k, v in DEFAULT_ENV.items():  # only these reach the root part of the chain (see LocalSession.exec)
        a += ["--setenv", k, v]
    if as_root:
        # DAC_READ_SEARCH lets bwrap's --chdir enter /work, the session uid's own 0700 directory; setpriv drops
        # it with the others when it switches to that uid
        a += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_SETPCAP",
              "--cap-add", "CAP_DAC_READ_SEARCH"]
    else:
        a += ["--unshare-user"]
    a += ["--ro-bind", "/usr", "/usr"]
    for link in SYSTEM_LINKS:
        if os.path.islink(link):
            a += ["--symlink", os.readlink(link), link]
        elif os.path.isdir(link):
            a += ["--ro-bind", link, link]
    a += ["--ro-bind", str(system / "etc"), "/etc", "--proc", "/proc"]
    for name in MASKED_PROC:  # the sandbox's /proc is of the same kernel: it has the files the host's has
        if os.path.lexists(f"/proc/{name}"):
            a += ["--ro-bind", str(system / "masked"), f"/proc/{name}"]
    a += ["--dev", "/dev", "--perms", "1777", "--size", str(64 << 20), "--tmpfs", "/dev/shm"]
    made: set[str] = set()
    prefix = Path(python).parent.parent
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
        a += ["--symlink", python, f"/sandbox/bin/{name}"]
    return a
