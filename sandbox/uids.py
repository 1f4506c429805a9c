"""The sandbox uids of the local backend: claimed host-wide, and handed out again only once nothing of the session
that used them is left (processes, kernel keys).

Sessions are told apart by their uid (process limits, permissions, clean-up), so two backends on one host, in one
process or several, never hand out the same uid at the same time: a session holds an ``flock`` on a file named
after its uid for as long as it lives (and longer, while its leftovers could not be removed).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LOCK_DIR = Path(tempfile.gettempdir()) / "rl-sandbox-uids"

# Run as the uid itself: keyctl(KEYCTL_CLEAR) of its user and user-session keyrings, which outlive its processes.
_CLEAR_KEYS = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
               "for ring in (-4, -5):\n    libc.syscall(250, 7, ctypes.c_int(ring))\n")


def claim(uid: int) -> int | None:
    """Claim ``uid`` host-wide for one session (the returned descriptor holds the lock); None if another holds it."""
    LOCK_DIR.mkdir(mode=0o700, exist_ok=True)
    fd = os.open(LOCK_DIR / str(uid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def release(fd: int | None) -> None:
    """Give a claimed uid back (closing the descriptor drops the flock)."""
    if fd is not None and fd >= 0:
        with contextlib.suppress(OSError):
            os.close(fd)


def live_pids(uid: int) -> list[int]:
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


def reap(uid: int, timeout_s: float = 2.0) -> bool:
    """Wait until no process of ``uid`` is left, SIGKILLing stragglers; False if some survived ``timeout_s``.

    The kernel tears down a pid namespace asynchronously once its pid 1 exits, so a killed program's children can
    still be alive for a moment after bwrap is reaped.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        pids = live_pids(uid)
        if not pids:
            return True
        if time.monotonic() > deadline:
            return False
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.005)


def key_count(uid: int) -> int:
    """Kernel keys (keyrings included) charged to ``uid``, from /proc/key-users; 0 when it has none."""
    with contextlib.suppress(OSError), open("/proc/key-users") as f:
        for line in f:
            owner, _, rest = line.partition(":")
            if owner.strip() == str(uid):
                return int(rest.split()[1].split("/")[0])
    return 0


def clear_keys(uid: int, setpriv: str) -> bool:
    """Empty the user keyrings of ``uid`` (where seccomp did not stop it from adding keys); True when none is left
    but the two keyrings themselves. Costs a process, so it runs only when /proc/key-users lists the uid."""
    if key_count(uid) == 0:
        return True
    subprocess.run([setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
                    "--no-new-privs", "--", sys.executable, "-I", "-S", "-c", _CLEAR_KEYS],
                   stdin=subprocess.DEVNULL, capture_output=True, timeout=30, check=False)
    # unlinked keys are freed by the kernel's key garbage collector, shortly after
    deadline = time.monotonic() + 2.0
    while key_count(uid) > 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    return key_count(uid) <= 2
