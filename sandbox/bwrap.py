"""The parts of the local backend's bubblewrap containers that are the same for every session: the staged ``/etc``
and the constant head of the ``bwrap`` command line (see ``sandbox.local`` for the isolation they make up)."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from sandbox.backend import SandboxError

ETC_FILES = ("passwd", "group", "hosts", "host.conf", "nsswitch.conf", "gai.conf", "ld.so.cache", "ld.so.conf",
             "ld.so.conf.d", "localtime", "ssl", "alternatives", "protocols", "services", "mime.types")
SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
SANDBOX_PATH = "/sandbox/bin:/usr/local/bin:/usr/bin:/bin"
#: the environment of every command, to which the caller's variables are added
DEFAULT_ENV = {"PATH": SANDBOX_PATH, "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1"}


def stage_etc(root: Path, uids: range | None) -> Path:
    """A minimal /etc under ``root`` for the sandboxes: copies of the harmless host files, plus users for the sandbox
    ``uids`` (None: the sandboxes keep the service's uid)."""
    etc = root / ".etc"
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


def base_argv(bwrap: str, etc: Path, python: str, *, as_root: bool, ro_paths: Sequence[str] = ()) -> list[str]:
    """The constant part of every bwrap command line: namespaces, capabilities, the read-only system, ``etc`` as
    /etc, ``python``'s installation and ``ro_paths`` read-only, and ``python`` as /sandbox/bin/python3."""
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
    a += ["--ro-bind", str(etc), "/etc", "--proc", "/proc", "--dev", "/dev",
          "--perms", "1777", "--size", str(64 << 20), "--tmpfs", "/dev/shm"]
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
