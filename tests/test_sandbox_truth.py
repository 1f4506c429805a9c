"""Verdicts of the local backend that tell the truth: an OOM kill anywhere in the sandbox is reported (also when the
command exits 0), a run killed at its wall limit reports the CPU time it really used, a sandbox killed from outside
is the sandbox's failure (not the program's, and the client runs it once more), and the sandbox's /proc hides the
kernel's symbols and the host's directories."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest

from sandbox.backend import Limits, Verdict
from sandbox.client import SandboxClient
from sandbox.local import LocalBackend
from sandbox.server import start_server

LIM = Limits(wall_s=20, cpu_s=10, memory_bytes=128 << 20, processes=32, open_files=64, output_bytes=64 << 10)


@pytest.fixture(scope="module")
def backend():
    b = LocalBackend(options=None)
    yield b
    b.close()


def need_cgroup(backend: LocalBackend) -> None:
    if "cgroup" not in backend.enforced:
        pytest.skip(f"cgroup limits are not in force on this host: {'; '.join(backend.warnings)}")


def run(backend: LocalBackend, code: str, limits: Limits = LIM):
    s = backend.create_session()
    try:
        return s.exec(["python3", "-c", code], limits)
    finally:
        s.close()


# Four children of 50 MiB each, every one under the per-process limit, together over the sandbox's 128 MiB: the
# kernel kills some of them. The parent ignores how they ended and exits 0, as a test runner that swallows a
# crashed worker would.
CHILDREN_OVER_THE_LIMIT = (
    "import os, time\nkids = []\nfor i in range(4):\n    pid = os.fork()\n    if pid == 0:\n"
    "        b = bytearray(50 << 20)\n        for j in range(0, len(b), 4096):\n            b[j] = 1\n"
    "        time.sleep(2)\n        os._exit(0)\n    kids.append(pid)\n"
    "for p in kids:\n    os.waitpid(p, 0)\nprint('parent done')")


def test_a_child_killed_by_the_memory_limit_is_reported_when_the_parent_exits_0(backend):
    need_cgroup(backend)
    r = run(backend, CHILDREN_OVER_THE_LIMIT)
    assert r.exit_code == 0 and r.stdout == b"parent done\n", r
    assert r.verdict == Verdict.MEMORY_LIMIT, r
    assert r.oom_kills >= 1 and "exited 0" in r.detail and f"{LIM.memory_bytes} bytes" in r.detail, r


def test_no_oom_kill_no_memory_verdict(backend):
    """The counter is per command: the next command of the same session starts from zero."""
    need_cgroup(backend)
    s = backend.create_session()
    try:
        first = s.exec(["python3", "-c", CHILDREN_OVER_THE_LIMIT], LIM)
        second = s.exec(["python3", "-c", "print(1)"], LIM)
    finally:
        s.close()
    assert first.oom_kills >= 1
    assert second.verdict == Verdict.OK and second.oom_kills == 0, second


def test_cpu_time_of_a_run_killed_at_its_wall_limit_is_counted(backend):
    """A busy loop killed at its wall limit reports at least the CPU time it last printed of itself: the service
    kills bwrap first, so bwrap's wait status holds none of it, the cgroup's counter does."""
    need_cgroup(backend)
    code = ("import time\nnext_print = 0\nwhile True:\n    if time.monotonic() >= next_print:\n"
            "        print(time.process_time(), flush=True)\n        next_print = time.monotonic() + 0.05")
    r = run(backend, code, Limits(wall_s=2, cpu_s=10, memory_bytes=128 << 20))
    assert r.verdict == Verdict.TIMEOUT, r
    lines = r.stdout.decode().splitlines()
    last = float(lines[-2])  # the last complete line (the kill may cut the one after it)
    assert last > 0.1, lines
    assert last <= r.cpu_s <= r.wall_s * LIM.cpus + 0.2, (r.cpu_s, last, r.wall_s)


def test_cpu_time_of_children_is_counted(backend):
    """Two children that spin while the parent only waits: their CPU time is the command's."""
    need_cgroup(backend)
    code = ("import os, time\nkids = []\nfor i in range(2):\n    pid = os.fork()\n    if pid == 0:\n"
            "        end = time.process_time() + 0.5\n        while time.process_time() < end:\n            pass\n"
            "        os._exit(0)\n    kids.append(pid)\nfor p in kids:\n    os.waitpid(p, 0)")
    r = run(backend, code, Limits(wall_s=20, cpu_s=10, memory_bytes=128 << 20, cpus=2))
    assert r.verdict == Verdict.OK and r.cpu_s >= 0.9, r


def test_kernel_symbols_are_unreadable(backend):
    code = ("import os\ntry:\n    data = open('/proc/kallsyms').read()\nexcept OSError as e:\n    print('refused', "
            "e.errno)\nelse:\n    print('read', len(data), '_stext' in data)")
    r = run(backend, code)
    assert r.verdict == Verdict.OK, r
    assert r.stdout.startswith(b"refused"), r.stdout  # the host's own /proc/kallsyms is readable by anyone


def test_mountinfo_names_no_host_directory(backend):
    """What the sandbox sees of its mounts names none of the service's directories: not the backend's root, not the
    session's, not the staged /etc."""
    s = backend.create_session()
    try:
        r = s.exec(["sh", "-c", "cat /proc/self/mountinfo /proc/self/mounts"], LIM)
        assert r.verdict == Verdict.OK and r.stdout, r
        text = r.stdout.decode()
        for host_dir in (str(backend.root), str(s.dir), "rl-sandbox-"):
            assert host_dir not in text, (host_dir, text)
        # a bind mount's root (field 4) is the directory it came from inside its file system: for the staged /etc it
        # is /etc on the shared files' tmpfs, not a directory of the host
        roots = {line.split()[4]: line.split()[3] for line in text.splitlines() if line[:1].isdigit()}
        if backend._system[1]:
            assert roots["/etc"] == "/etc", roots
    finally:
        s.close()


def _kill_sandboxes_of(pid: int, after: threading.Event) -> None:
    """SIGKILL, from outside, every sandbox (bwrap) process ``pid`` runs, once: as an eviction would."""
    deadline = time.time() + 20
    while time.time() < deadline:
        kids = [p for p in psutil.Process(pid).children() if p.name() == "bwrap"]
        if kids:
            time.sleep(0.3)  # the program is running inside
            for p in kids:
                os.kill(p.pid, signal.SIGKILL)
            after.set()
            return
        time.sleep(0.01)


def test_a_sandbox_killed_from_outside_is_the_sandboxs_failure_and_the_client_runs_it_once_more():
    """SIGKILL of the bwrap process running a command (the program inside cannot reach it: it lives outside the
    sandbox's PID namespace): the verdict is the sandbox's ERROR naming the signal, not the program's FAILED; a
    client runs such a one-shot command once more and returns the program's own verdict."""
    backend = LocalBackend(options=None)
    try:
        s = backend.create_session()
        killed = threading.Event()
        threading.Thread(target=_kill_sandboxes_of, args=(os.getpid(), killed), daemon=True).start()
        r = s.exec(["python3", "-c", "import time; time.sleep(5)"], LIM)
        s.close()
        assert killed.is_set() and r.verdict == Verdict.ERROR, r
        assert r.detail == "the sandbox was killed from outside (signal 9)", r
        # the program killing itself is its own doing: FAILED, as before
        own = run(backend, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
        assert own.verdict == Verdict.FAILED and own.signal == signal.SIGKILL, own
    finally:
        backend.close()
    with start_server("local", concurrency=2) as server, SandboxClient(server.address) as client:
        killed = threading.Event()
        threading.Thread(target=_kill_sandboxes_of, args=(os.getpid(), killed), daemon=True).start()
        r = client.run(["python3", "-c", "import time; time.sleep(1); print('done')"], limits=LIM)
        assert killed.is_set() and r.verdict == Verdict.OK and r.stdout == b"done\n" and client.retries == 1, r
