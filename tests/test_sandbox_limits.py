"""Whole-sandbox limits of the local backend, checked to be really in force where the host allows them: cgroup
memory/pids/cpu, the tmpfs disk quota, the seccomp filter, fresh kernel keys per uid, deep trees, and that every
attack leaves no uid, slot, directory, cgroup or mount behind."""

from __future__ import annotations

import math
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from sandbox.backend import Limits, SandboxError, Verdict
from sandbox.local import LocalBackend, LocalSession
from sandbox.options import LocalOptions
from tests.test_sandbox_local import assert_healthy, assert_no_processes

LIM = Limits(wall_s=20, cpu_s=10, memory_bytes=256 << 20, processes=32, open_files=64, file_size_bytes=1 << 20,
             output_bytes=64 << 10)


@pytest.fixture(scope="module")
def backend():
    b = LocalBackend(options=LocalOptions(disk_mb=8))
    yield b
    b.close()
    assert not b.root.exists()


def need(backend: LocalBackend, what: str) -> None:
    """Skip, naming why, where the host does not allow ``what``; on a root CI machine all are there."""
    if what not in backend.enforced:
        pytest.skip(f"{what} is not in force on this host: {'; '.join(backend.warnings)}")


def py(session: LocalSession, code: str, limits: Limits = LIM, **kw):
    return session.exec(["python3", "-c", code], limits, **kw)


def mounts_under(root: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(str(root) + "/")]


def assert_released(backend: LocalBackend) -> None:
    """Every slot free again, nothing of any session left: directories, mounts, cgroups."""
    assert not backend._sessions and not backend._dirty
    assert sorted(backend._free) == list(range(backend.max_sessions))
    assert [p.name for p in backend.root.iterdir() if not p.name.startswith(".")] == []
    assert mounts_under(backend.root) == [str(backend.root / ".system")] * backend._system[1]  # the shared files
    if backend.cgroups is not None:
        for parent in backend.cgroups.parents.values():
            assert [p for p in parent.iterdir() if p.is_dir()] == []


def test_memory_is_limited_for_the_whole_sandbox(backend):
    """Nine processes of 60 MiB each, every one under the per-process limit, against 256 MiB for the sandbox."""
    need(backend, "cgroup")
    code = ("import os, time\nkids = []\nfor i in range(9):\n    pid = os.fork()\n    if pid == 0:\n"
            "        b = bytearray(60 << 20)\n        for j in range(0, len(b), 4096):\n            b[j] = 1\n"
            "        time.sleep(3)\n        os._exit(0)\n    kids.append(pid)\n"
            "bad = sum(os.waitpid(p, 0)[1] != 0 for p in kids)\nraise SystemExit(bad)")
    s = backend.create_session()
    try:
        r = py(s, code)
        assert r.verdict == Verdict.MEMORY_LIMIT and "whole sandbox" in r.detail, r
        mem = s.cgroup.dirs.get("memory") or s.cgroup.dirs[""]
        peak_file = mem / ("memory.max_usage_in_bytes" if backend.cgroups.mode == "v1" else "memory.peak")
        if peak_file.exists():
            assert int(peak_file.read_text()) <= LIM.memory_bytes
        assert_healthy(s)
    finally:
        s.close()


def test_every_process_of_the_sandbox_is_in_its_cgroup(backend):
    """The program and what it forks are in the session's cgroup(s), whose pids and CPU limits are those asked."""
    need(backend, "cgroup")
    s = backend.create_session()
    try:
        done = threading.Event()
        result = []
        th = threading.Thread(target=lambda: (result.append(py(s, "import os, time\nos.fork()\ntime.sleep(1.5)",
                                                                  LIM.merged(cpus=0.5))), done.set()))
        th.start()
        deadline = time.monotonic() + 10
        pids: set[int] = set()
        while time.monotonic() < deadline and len(pids) < 2:
            time.sleep(0.1)
            pids = {int(p) for d in s.cgroup.dirs.values() for p in (d / "cgroup.procs").read_text().split()}
            pids = {p for p in pids if Path(f"/proc/{p}").exists() and os.stat(f"/proc/{p}").st_uid == s.uid}
        th.join()
        assert len(pids) >= 2, "the program and its child were not found in the session's cgroup"
        assert result[0].verdict == Verdict.OK, result[0]
        if backend.cgroups.mode == "v1":
            assert int((s.cgroup.dirs["pids"] / "pids.max").read_text()) == LIM.processes + 4
            assert int((s.cgroup.dirs["cpu"] / "cpu.cfs_quota_us").read_text()) == 50_000
        else:
            assert (s.cgroup.dirs[""] / "cpu.max").read_text().split()[0] == "50000"
    finally:
        s.close()


def test_cpu_is_limited_for_the_whole_sandbox(backend):
    """Two busy threads for 2 s of wall time under cpus=0.5 use at most about 1 CPU-second (2+ without)."""
    need(backend, "cgroup")
    code = ("import threading, time\ndef spin():\n    end = time.monotonic() + 2\n    while time.monotonic() < end:\n"
            "        pass\nts = [threading.Thread(target=spin) for _ in range(2)]\n[t.start() for t in ts]\n"
            "[t.join() for t in ts]")
    s = backend.create_session()
    try:
        r = py(s, code, LIM.merged(cpus=0.5))
        assert r.verdict == Verdict.OK and r.cpu_s < 1.4, r
    finally:
        s.close()


def test_disk_quota_holds_for_many_small_files(backend):
    """Files each under the per-file limit cannot add up past the session's quota (8 MiB here)."""
    need(backend, "disk_quota")
    code = ("import os\nfor i in range(40):\n    d = '/tmp' if i % 2 else '/work'\n"
            "    with open(f'{d}/f{i}', 'wb') as f:\n        f.write(os.urandom(900 << 10))")
    s = backend.create_session()
    try:
        r = py(s, code)
        assert r.verdict == Verdict.FILE_SIZE_LIMIT and "disk quota" in r.detail, r
        used = sum(p.stat().st_size for d in (s.work, s.tmp) for p in d.iterdir())
        assert used <= backend.disk_bytes
        # the error swallowed: still the quota's verdict
        r = py(s, "try:\n    open('more', 'wb').write(b'x' * (2 << 20))\nexcept OSError:\n    raise SystemExit(3)")
        assert r.verdict == Verdict.FILE_SIZE_LIMIT, r
        with pytest.raises(SandboxError) as e:
            s.write_files({"big.bin": bytes(1 << 20)})
        assert e.value.code == "RESOURCE_EXHAUSTED"
    finally:
        s.close()
    assert not s.dir.exists()


SYSCALLS = """
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
def call(nr, *args):
    r = libc.syscall(nr, *args)
    return errno.errorcode.get(ctypes.get_errno(), "?") if r == -1 else "allowed"
out = {
  "add_key": call(248, b"user", b"k", b"v", 1, ctypes.c_int(-4)),
  "keyctl": call(250, 0, ctypes.c_int(-4), 0),
  "ptrace": call(101, 16, os.getppid(), 0, 0),
  "unshare_user": call(272, 0x10000000),
  "clone_newuser": call(56, 0x10000000 | 17, 0, 0, 0, 0),
  "io_uring_setup": call(425, 1, ctypes.create_string_buffer(120)),
  "bpf": call(321, 0, 0, 0),
  "perf_event_open": call(298, 0, 0, -1, -1, 0),
  "mount": call(165, b"none", b"/tmp", b"tmpfs", 0, 0),
}
print(sorted(out.items()))
"""


def test_seccomp_refuses_what_a_judged_program_never_needs(backend):
    need(backend, "seccomp")
    s = backend.create_session()
    try:
        r = py(s, SYSCALLS)
        assert r.verdict == Verdict.OK, r
        got = dict(eval(r.stdout))
        assert got == dict.fromkeys(got, "EPERM"), got
        # ordinary programs are not affected: threads, subprocesses, fork
        r = py(s, "import subprocess, threading, os\nt = threading.Thread(target=print)\nt.start(); t.join()\n"
                  "print(subprocess.run(['echo', 'hi'], capture_output=True).stdout.decode().strip())\n"
                  "pid = os.fork()\nos._exit(0) if pid == 0 else print(os.waitpid(pid, 0)[1])")
        assert r.verdict == Verdict.OK and r.stdout.split()[-2:] == [b"hi", b"0"], r
    finally:
        s.close()


ADD_KEY = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
           "print(libc.syscall(248, b'user', b'secret', b'hunter2', 7, ctypes.c_int(-4)), ctypes.get_errno())")
FIND_KEY = ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "k = libc.syscall(250, 10, ctypes.c_int(-4), b'user', b'secret', 0)\n"
            "buf = ctypes.create_string_buffer(64)\n"
            "print(buf.raw[:libc.syscall(250, 11, k, buf, 64)] if k > 0 else b'no key')")


@pytest.mark.parametrize("seccomp", [True, False], ids=["seccomp", "no-seccomp"])
def test_kernel_keys_do_not_reach_the_next_session_of_the_uid(tmp_path, seccomp):
    """With seccomp a key cannot be added at all; without it, the uid's keys are cleared before it is reused."""
    b = LocalBackend(tmp_path / "root", max_sessions=1, uid_base=63500, seccomp=seccomp,
                     options=LocalOptions(disk_mb=4))
    if not b.as_root:
        b.close()
        pytest.skip("sandbox uids need root; without it the sandbox runs as the service's own uid")
    try:
        first = b.create_session()
        uid = first.uid
        r = py(first, ADD_KEY)
        added = int(r.stdout.split()[0]) > 0
        assert added != seccomp, r
        first.close()
        second = b.create_session()
        assert second.uid == uid
        r = py(second, FIND_KEY)
        assert b"hunter2" not in r.stdout, r
        second.close()
    finally:
        b.close()


DEEP = ("import os\nfor top in ('/work', '/tmp'):\n    os.chdir(top)\n    for i in range(1200):\n"
        "        os.mkdir('d')\n        os.chdir('d')\n        open('f', 'w').write('x')\n"
        "os.chdir('/work')\nos.chmod('d', 0)\nprint('deep')")


@pytest.mark.parametrize("disk_mb", [32, 0], ids=["tmpfs", "plain-directory"])
def test_deep_trees_and_requests_are_cleaned_up(tmp_path, disk_mb):
    """1,200 nested directories made by the program, and a request path just as deep: closing frees everything
    (unmounting the tmpfs, or removing the tree without recursion)."""
    b = LocalBackend(tmp_path / "root", max_sessions=2, uid_base=63600, options=LocalOptions(disk_mb=disk_mb))
    try:
        for _ in range(3):  # more rounds than slots: each round's slot must have come back
            s = b.create_session()
            r = py(s, DEEP)
            assert r.verdict == Verdict.OK and r.stdout == b"deep\n", r
            deep_path = "/".join(["p"] * 1200) + "/file.txt"
            s.write_files({deep_path: b"x"})
            assert s.read_files([deep_path], 10) == {deep_path: b"x"}
            s.close()
            assert_released(b)
    finally:
        b.close()
    assert not (tmp_path / "root").exists() or not any((tmp_path / "root").iterdir())


ATTACKS = {
    "fork bomb": ("import os\nwhile True:\n    os.fork()", LIM.merged(processes=16)),
    "memory bomb": ("a = []\nwhile True:\n    a.append(bytearray(10 << 20))", LIM),
    "disk filler": ("import os\ni = 0\nwhile True:\n    open(f'f{i}', 'wb').write(os.urandom(512 << 10))\n    i += 1",
                    LIM),
    "leftover daemon": ("import os, subprocess\nsubprocess.Popen(['sleep', '600'], start_new_session=True)", LIM),
    "locked directories": ("import os\nos.makedirs('a/b/c')\nopen('a/b/c/f', 'w').write('x')\n"
                           "os.chmod('a/b/c', 0)\nos.chmod('a/b', 0)\nos.chmod('a', 0)", LIM),
    "timeout": ("while True:\n    pass", LIM.merged(wall_s=1)),
}


def test_uids_and_dirs_are_released_after_each_attack(backend):
    for name, (code, limits) in ATTACKS.items():
        s = backend.create_session()
        py(s, code, limits)
        assert_no_processes(s.uid)
        s.close()
        assert_released(backend), name


def test_a_failed_clean_up_keeps_the_slot_until_it_succeeds(tmp_path):
    """Something of the session that cannot be removed (here a mount the test puts in its directory) keeps its slot
    and uid out of use; once it can be removed, the next session gets the slot back."""
    b = LocalBackend(tmp_path / "root", max_sessions=1, uid_base=63700, options=LocalOptions(disk_mb=0))
    if not b.as_root:
        b.close()
        pytest.skip("mounting needs root")
    try:
        s = b.create_session()
        (s.work / "m").mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "none", str(s.work / "m")], check=True)
        s.close()  # never raises
        assert s.slot in b._dirty and "directory" in s.leftover
        with pytest.raises(SandboxError) as e:
            b.create_session()
        assert e.value.code == "RESOURCE_EXHAUSTED" and "waiting for their clean-up" in str(e.value)
        subprocess.run(["umount", str(s.work / "m")], check=True)
        again = b.create_session()
        assert again.slot == s.slot and not b._dirty and not s.dir.exists()
        again.close()
    finally:
        b.close()


@pytest.mark.parametrize("field", ["wall_s", "cpu_s", "memory_bytes", "cpus"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_limits_are_refused(field, value):
    with pytest.raises(SandboxError, match=rf"limits\.{field}=.* is not a finite number") as e:
        Limits(**{field: value})
    assert e.value.code == "INVALID_ARGUMENT"
