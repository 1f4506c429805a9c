"""The seccomp filter of the local sandbox: the system calls a judged program never needs are refused.

The filter is built once with libseccomp (through ``pyseccomp``) and handed to bubblewrap as a compiled BPF program
(``bwrap --seccomp FD``); bubblewrap loads it just before it executes the sandbox's command chain, so it holds for
every process of the sandbox. Everything not listed is allowed; a listed call fails with EPERM (``clone3``, whose
flags sit in memory a filter cannot read, with ENOSYS, so that libc falls back to ``clone``, whose flags it can).
System calls of another ABI (32-bit ``int 0x80`` on x86-64) kill the process (libseccomp's default for a foreign
architecture), so the 32-bit numbers cannot be used to get round the list.
"""

from __future__ import annotations

import errno
import logging
import os
import tempfile

log = logging.getLogger(__name__)

#: refused with EPERM, by reason
DENIED = {
    # kernel keyrings outlive the sandbox (they belong to the uid, not to the process)
    "keys": ("add_key", "request_key", "keyctl"),
    # inspecting or changing other processes (the judge of a code task runs beside the program)
    "tracing": ("ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd"),
    # new namespaces (a user namespace gives back every capability inside it), mounts
    "namespaces": ("unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "fsopen", "fsmount",
                   "fsconfig", "fspick", "move_mount", "open_tree", "mount_setattr"),
    # large kernel attack surface that no test needs
    "kernel": ("io_uring_setup", "io_uring_enter", "io_uring_register", "bpf", "perf_event_open", "userfaultfd",
               "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot",
               "swapon", "swapoff", "acct", "quotactl", "open_by_handle_at", "name_to_handle_at", "lookup_dcookie",
               "syslog", "vhangup", "iopl", "ioperm", "settimeofday", "clock_settime", "clock_adjtime",
               "adjtimex", "fanotify_init", "personality", "uselib", "nfsservctl"),
}
#: clone flags that make a new namespace; clone with any of them is refused
NEW_NAMESPACE_FLAGS = {"CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
                       "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
                       "CLONE_NEWNET": 0x40000000, "CLONE_NEWTIME": 0x00000080}


def denied_syscalls() -> list[str]:
    """Every system call the filter refuses outright (clone with namespace flags comes on top)."""
    return sorted({name for names in DENIED.values() for name in names})


class SeccompUnavailable(Exception):
    """The filter cannot be built here (no libseccomp, or its Python binding); the message says which."""


def build_filter() -> bytes:
    """The compiled BPF program of the filter (raises SeccompUnavailable)."""
    try:
        import pyseccomp as sc
    except (ImportError, RuntimeError, OSError) as e:  # RuntimeError: the binding found no libseccomp
        raise SeccompUnavailable(f"libseccomp or its Python binding pyseccomp is missing ({e})") from None
    f = sc.SyscallFilter(sc.ALLOW)
    for name in denied_syscalls():
        try:
            f.add_rule(sc.ERRNO(errno.EPERM), name)
        except (OSError, ValueError, RuntimeError):
            log.debug("seccomp: %s is not a system call of this architecture", name)  # e.g. iopl on arm64
    for flag in NEW_NAMESPACE_FLAGS.values():
        f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    try:
        f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    except (OSError, ValueError, RuntimeError):
        pass  # a libseccomp too old to know clone3, on a kernel then also too old for it
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        return out.read()


def write_filter(path: str | os.PathLike) -> None:
    """Build the filter and write its BPF program to ``path`` (read-only for everyone but its owner)."""
    data = build_filter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
