"""The local bubblewrap sandbox backend against hostile programs: each attack is contained, gets the right verdict,
and the same session runs a normal program correctly right after."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from sandbox import runner
from sandbox.backend import CancelEvent, ExecResult, Limits, SandboxError, Verdict
from sandbox.local import LocalBackend, LocalSession

LIM = Limits(wall_s=10, cpu_s=5, memory_bytes=256 << 20, processes=32, open_files=64, file_size_bytes=1 << 20,
             output_bytes=64 << 10)
README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.fixture(scope="module")
def backend():
    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap (bwrap) is not installed; the local sandbox needs it: run `make setup` "
                    "(apt-get install bubblewrap)")
    b = LocalBackend()
    yield b
    b.close()
    assert not b.root.exists()


@pytest.fixture
def session(backend):
    s = backend.create_session()
    yield s
    s.close()


def py(session: LocalSession, code: str, *args: str, limits: Limits = LIM, **kw) -> ExecResult:
    return session.exec(["python3", "-c", code, *args], limits, **kw)


def assert_healthy(session: LocalSession) -> None:
    """A normal program still runs correctly in this session."""
    r = py(session, "import sys; print(sum(range(10)), sys.stdin.read())", stdin=b"ok")
    assert (r.verdict, r.exit_code, r.stdout) == (Verdict.OK, 0, b"45 ok\n"), r


def uid_pids(uid: int) -> list[int]:
    """Host pids whose real uid is ``uid``."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                status = Path(entry.path, "status").read_text()
            except OSError:
                continue
            line = next(x for x in status.splitlines() if x.startswith("Uid:"))
            if int(line.split()[1]) == uid:
                pids.append(int(entry.name))
    return pids


def assert_no_processes(uid: int) -> None:
    deadline = time.monotonic() + 2
    while uid_pids(uid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert uid_pids(uid) == []


def test_runs_a_program(session):
    r = py(session, "import os; print(os.getuid(), os.getcwd()); raise SystemExit(0)")
    assert r.verdict == Verdict.OK and r.exit_code == 0 and r.detail == ""
    uid, cwd = r.stdout.split()
    assert int(uid) == session.uid != 0 and cwd == b"/work"
    assert r.wall_s > 0 and r.cpu_s > 0
    r = py(session, "import sys; print('bad', file=sys.stderr); sys.exit(3)")
    assert (r.verdict, r.exit_code, r.stderr) == (Verdict.FAILED, 3, b"bad\n")
    r = py(session, "import os, signal; os.kill(os.getpid(), signal.SIGTERM)")
    assert (r.verdict, r.exit_code, r.signal) == (Verdict.FAILED, None, 15)
    r = session.exec(["no-such-program"], LIM)
    assert r.verdict == Verdict.FAILED and r.exit_code == 127


def test_stdin_and_env(session):
    r = py(session, "import os, sys; print(sys.stdin.read()[::-1], os.environ['GREETING'], os.environ['HOME'])",
           stdin=b"abc" * 10_000, env={"GREETING": "hi"})
    assert r.verdict == Verdict.OK
    assert r.stdout == b"cba" * 10_000 + b" hi /tmp\n"
    with pytest.raises(SandboxError) as e:
        py(session, "pass", env={"A=B": "x"})
    assert e.value.code == "INVALID_ARGUMENT"


ENV_AND_CWD = "import json, os; print(json.dumps([dict(os.environ), os.getcwd()]))"
DEFAULT_ENV = {"PATH": "/sandbox/bin:/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp",
               "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1", "PWD": "/work"}


def test_environment_is_the_defaults_and_the_callers_only(session, monkeypatch):
    """Nothing of the service's environment reaches the program, with or without variables of the caller."""
    monkeypatch.setenv("RL_SERVICE_SECRET", "s3cret")
    r = py(session, ENV_AND_CWD)
    assert r.verdict == Verdict.OK, r
    assert json.loads(r.stdout) == [DEFAULT_ENV, "/work"]
    r = py(session, ENV_AND_CWD, env={"GREETING": "hi", "HOME": "/work"})
    assert r.verdict == Verdict.OK, r
    assert json.loads(r.stdout) == [{**DEFAULT_ENV, "GREETING": "hi", "HOME": "/work"}, "/work"]


def test_callers_environment_never_reaches_a_root_process(session):
    """LD_DEBUG makes the dynamic loader of every process that sees it report the libraries it loads: the program
    sees the caller's variable, setpriv (root until it switches to the session's uid) and bwrap never do."""
    r = py(session, "pass", env={"LD_DEBUG": "files"})
    assert r.verdict == Verdict.OK, r
    assert b"needed by" in r.stderr and b"python" in r.stderr
    assert b"setpriv" not in r.stderr and b"bwrap" not in r.stderr


def test_the_program_has_no_privileges(session):
    """No capability in any set (bwrap's, DAC_READ_SEARCH included, are gone with the switch to the session's
    uid), no_new_privs, the session's uid and gid with no supplementary groups, and the seccomp filter on."""
    r = session.exec(["cat", "/proc/self/status"], LIM)
    assert r.verdict == Verdict.OK, r
    status = dict(line.split(":\t", 1) for line in r.stdout.decode().splitlines() if ":\t" in line)
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(status[cap], 16) == 0, (cap, status[cap])
    assert status["NoNewPrivs"] == "1"
    assert status["Uid"].split() == [str(session.uid)] * 4 and status["Gid"].split() == [str(session.uid)] * 4
    assert status["Groups"].strip() == ""
    if session.backend.seccomp_file is not None:
        assert status["Seccomp"] == "2"


def test_rlimits_are_those_asked(session):
    """The program runs under the rlimits of its request, also those too small for bwrap (set inside)."""
    code = ("import resource as r\nprint([r.getrlimit(x) for x in (r.RLIMIT_CPU, r.RLIMIT_AS, r.RLIMIT_NPROC, "
            "r.RLIMIT_NOFILE, r.RLIMIT_FSIZE, r.RLIMIT_CORE)])")
    r = py(session, code)
    assert r.verdict == Verdict.OK, r
    assert eval(r.stdout) == [(5, 6), (256 << 20, 256 << 20), (32, 32), (64, 64), (1 << 20, 1 << 20), (0, 0)]
    r = session.exec(["sh", "-c", "ulimit -n"], LIM.merged(open_files=5))
    assert (r.verdict, r.stdout) == (Verdict.OK, b"5\n"), r


def test_no_descriptor_of_the_service_reaches_the_program(session):
    code = ("import os\nopen_fds = []\nfor fd in range(3, 1024):\n    try:\n        os.fstat(fd)\n"
            "        open_fds.append(fd)\n    except OSError:\n        pass\nprint(open_fds)")
    r = py(session, code)
    assert (r.verdict, r.stdout) == (Verdict.OK, b"[]\n"), r


@pytest.mark.serial
def test_cancel_and_close_need_no_polling(backend, monkeypatch):
    """The service's cancel event and the session's close wake the running command's loop at once (it does not
    poll them: with polling made useless here, both still end the command within a second or two)."""
    monkeypatch.setattr(runner, "_CANCEL_POLL_S", 60.0)
    s = backend.create_session()
    try:
        cancel = CancelEvent()
        threading.Timer(0.3, cancel.set).start()
        t = time.monotonic()
        r = s.exec(["sleep", "30"], LIM, cancel=cancel)
        assert r.verdict == Verdict.CANCELLED and time.monotonic() - t < 2, r
        threading.Timer(0.3, s.close).start()
        t = time.monotonic()
        r = s.exec(["sleep", "30"], LIM)
        assert r.verdict == Verdict.CANCELLED and "closed" in r.detail and time.monotonic() - t < 3, r
    finally:
        s.close()
    assert_no_processes(s.uid)


def test_fork_bomb(session):
    r = py(session, "import os\nwhile True:\n    os.fork()", limits=LIM.merged(processes=16))
    assert r.verdict == Verdict.PROCESS_LIMIT, r
    assert_no_processes(session.uid)
    assert_healthy(session)


def test_process_limit_then_timeout_is_a_process_limit(session):
    """A program that hits the process limit and then runs out of wall time is reported as the process limit."""
    code = ("import os, sys, time\nfor i in range(40):\n    try:\n        if os.fork() == 0:\n"
            "            time.sleep(60)\n    except OSError as e:\n        print(e, file=sys.stderr)\n"
            "        break\ntime.sleep(60)")
    r = py(session, code, limits=LIM.merged(processes=8, wall_s=1))
    assert r.verdict == Verdict.PROCESS_LIMIT and "then the wall-clock limit" in r.detail, r
    assert_no_processes(session.uid)


def test_memory_bomb(session):
    r = py(session, "a = []\nwhile True:\n    a.append(bytearray(10 << 20))", limits=LIM.merged(memory_bytes=128 << 20))
    assert r.verdict == Verdict.MEMORY_LIMIT, r
    assert_healthy(session)


@pytest.mark.serial
def test_infinite_loop_timeout(session):
    t = time.monotonic()
    r = py(session, "while True:\n    pass", limits=LIM.merged(wall_s=1))
    assert r.verdict == Verdict.TIMEOUT and time.monotonic() - t < 4, r
    assert_no_processes(session.uid)
    assert_healthy(session)


def test_cpu_limit(session):
    r = py(session, "while True:\n    pass", limits=LIM.merged(cpu_s=1))
    assert r.verdict == Verdict.CPU_LIMIT, r
    assert 0.9 <= r.cpu_s < 3
    # SIGXCPU ignored: the kernel SIGKILLs it at the hard limit one second later
    r = py(session, "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass",
           limits=LIM.merged(cpu_s=1))
    assert (r.verdict, r.signal) == (Verdict.CPU_LIMIT, 9), r
    assert_healthy(session)


def test_huge_file(session):
    r = py(session, "f = open('big', 'wb')\nwhile True:\n    f.write(b'x' * 65536)")
    assert r.verdict == Verdict.FILE_SIZE_LIMIT, r
    assert (session.work / "big").stat().st_size <= LIM.file_size_bytes
    # the error swallowed: found by the scan of the session's directories
    r = py(session, "try:\n    f = open('/tmp/big', 'wb')\n    while True:\n        f.write(b'x' * 65536)\n"
                    "except OSError:\n    raise SystemExit(1)")
    assert r.verdict == Verdict.FILE_SIZE_LIMIT and r.stderr == b"", r
    assert_healthy(session)


@pytest.mark.serial
def test_output_flood(session):
    t = time.monotonic()
    r = py(session, "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)")
    assert r.verdict == Verdict.OUTPUT_LIMIT and r.stdout_truncated and not r.stderr_truncated, r.detail
    assert r.stdout == b"x" * LIM.output_bytes and time.monotonic() - t < 5
    r = py(session, "import os\nwhile True:\n    os.write(2, b'e' * 65536)")
    assert r.verdict == Verdict.OUTPUT_LIMIT and r.stderr_truncated and len(r.stderr) == LIM.output_bytes
    assert_healthy(session)


def test_no_network(session):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        code = ("import socket, sys\nout = []\n"
                "for addr in [('127.0.0.1', int(sys.argv[1])), ('1.1.1.1', 53), ('8.8.8.8', 443)]:\n"
                "    s = socket.socket()\n    s.settimeout(2)\n"
                "    try:\n        s.connect(addr)\n        out.append('connected')\n"
                "    except OSError as e:\n        out.append(type(e).__name__)\n"
                "print(' '.join(out))")
        r = py(session, code, str(listener.getsockname()[1]))
        assert r.verdict == Verdict.OK, r
        assert b"connected" not in r.stdout and len(r.stdout.split()) == 3
        with pytest.raises(BlockingIOError):
            listener.accept()
    assert_healthy(session)


def test_host_files_hidden(session):
    assert README.is_file()
    code = ("import os, sys\nfor p in sys.argv[1:]:\n"
            "    try:\n        open(p, 'rb').read()\n        print('read', p)\n"
            "    except OSError as e:\n        print('blocked', type(e).__name__)\n"
            "print(sorted(os.listdir('/root')), sorted(os.listdir('/etc')))")
    r = py(session, code, "/etc/shadow", "/etc/gshadow", str(README), str(Path(__file__).resolve()), "/root/.bashrc")
    assert r.verdict == Verdict.OK, r
    assert b"read" not in r.stdout and r.stdout.count(b"blocked") == 5, r.stdout
    assert b"shadow" not in r.stdout and b"main" not in r.stdout.splitlines()[-1]
    assert_healthy(session)


def test_other_sessions_hidden(backend, session):
    other = backend.create_session(files={"secret.txt": b"s3cret"})
    try:
        (other.tmp / "t.txt").write_bytes(b"s3cret")
        paths = [str(other.work / "secret.txt"), str(other.tmp / "t.txt"), "/work/secret.txt", str(other.dir)]
        code = ("import sys\nfor p in sys.argv[1:]:\n    try:\n        print(open(p).read())\n"
                "    except OSError as e:\n        print('blocked', type(e).__name__)")
        r = py(session, code, *paths)
        assert r.verdict == Verdict.OK and b"s3cret" not in r.stdout and r.stdout.count(b"blocked") == 4, r
        r = py(other, "print(open('secret.txt').read())")
        assert r.stdout == b"s3cret\n"
    finally:
        other.close()
    assert_healthy(session)


def test_cannot_kill_outside(session):
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        code = ("import os, sys\ntry:\n    os.kill(int(sys.argv[1]), 9)\n    print('killed')\n"
                "except OSError as e:\n    print('blocked', type(e).__name__)\n"
                "try:\n    os.kill(-1, 9)\nexcept OSError:\n    pass")
        r = py(session, code, str(sleeper.pid))
        assert r.stdout.startswith(b"blocked"), r
        time.sleep(0.2)
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait()
    assert_healthy(session)


@pytest.mark.serial
def test_no_background_leftovers(session):
    code = ("import os, subprocess\n"
            "if os.fork() == 0:\n    os.setsid()\n    subprocess.Popen(['sleep', '987654'])\n    os._exit(0)\n"
            "subprocess.Popen(['sleep', '987653'], start_new_session=True)\nprint('bye')")
    t = time.monotonic()
    r = py(session, code)
    assert r.verdict == Verdict.OK and r.stdout == b"bye\n" and time.monotonic() - t < 5, r
    assert_no_processes(session.uid)
    for entry in os.scandir("/proc"):
        try:
            cmd = Path(entry.path, "cmdline").read_bytes() if entry.name.isdigit() else b""
        except OSError:
            continue
        assert b"98765" not in cmd
    assert_healthy(session)


def test_files_round_trip(session):
    session.write_files({"a/b/run.sh": b"#!/bin/sh\necho from-script > out/result.txt\n", "data.bin": bytes(256),
                         "out/.keep": b""}, executable=frozenset({"a/b/run.sh"}))
    assert (session.work / "a/b/run.sh").stat().st_mode & 0o777 == 0o755
    assert (session.work / "data.bin").stat().st_uid == session.uid
    r = session.exec(["./a/b/run.sh"], LIM)
    assert r.verdict == Verdict.OK, r
    got = session.read_files(["out/result.txt", "data.bin"], max_bytes=1024)
    assert got == {"out/result.txt": b"from-script\n", "data.bin": bytes(256)}
    session.write_files({"data.bin": b"new"})
    assert session.read_files(["data.bin"], 3) == {"data.bin": b"new"}
    with pytest.raises(SandboxError) as e:
        session.read_files(["nope.txt"], 10)
    assert e.value.code == "NOT_FOUND"
    with pytest.raises(SandboxError) as e:
        session.read_files(["out/result.txt"], 5)
    assert e.value.code == "RESOURCE_EXHAUSTED"


@pytest.mark.parametrize("path", ["../escape.txt", "/etc/passwd", "a/../../x", "", "."])
def test_path_traversal_refused(session, path):
    with pytest.raises(SandboxError) as e:
        session.write_files({path: b"x"})
    assert e.value.code == "INVALID_ARGUMENT"
    with pytest.raises(SandboxError) as e:
        session.read_files([path], 10)
    assert e.value.code == "INVALID_ARGUMENT"


def test_symlink_escapes_refused(session, tmp_path):
    target = tmp_path / "host.txt"
    target.write_bytes(b"host secret")
    code = ("import os, sys\nos.symlink(sys.argv[1], 'link')\nos.symlink(sys.argv[2], 'dirlink')\n"
            "os.symlink('/etc', 'etc')\nos.mkfifo('fifo')")
    r = py(session, code, str(target), str(tmp_path))
    assert r.verdict == Verdict.OK, r
    for bad in ("link", "dirlink/host.txt", "etc/passwd", "fifo"):
        with pytest.raises(SandboxError) as e:
            session.write_files({bad: b"pwned"})
        assert e.value.code in ("INVALID_ARGUMENT", "NOT_FOUND"), bad
        with pytest.raises(SandboxError) as e:
            session.read_files([bad], 1 << 20)
        assert e.value.code in ("INVALID_ARGUMENT", "NOT_FOUND"), bad
    assert target.read_bytes() == b"host secret" and not (tmp_path / "new.txt").exists()
    with pytest.raises(SandboxError):
        session.write_files({"dirlink/new.txt": b"pwned"})
    assert not (tmp_path / "new.txt").exists()
    assert b"pwned" not in Path("/etc/passwd").read_bytes()
    assert_healthy(session)


@pytest.mark.serial
def test_cancel(session):
    cancel = threading.Event()
    threading.Timer(0.3, cancel.set).start()
    t = time.monotonic()
    r = session.exec(["sleep", "30"], LIM, cancel=cancel)
    assert r.verdict == Verdict.CANCELLED and time.monotonic() - t < 2, r
    assert_no_processes(session.uid)
    assert_healthy(session)


@pytest.mark.serial
def test_close_kills_running_command(backend):
    s = backend.create_session()
    results: list[ExecResult] = []
    th = threading.Thread(target=lambda: results.append(s.exec(["sleep", "30"], LIM)))
    th.start()
    time.sleep(0.3)
    t = time.monotonic()
    s.close()
    th.join(5)
    assert results and results[0].verdict == Verdict.CANCELLED and time.monotonic() - t < 3
    assert not s.dir.exists()
    assert_no_processes(s.uid)
    s.close()  # idempotent
    with pytest.raises(SandboxError) as e:
        s.exec(["true"], LIM)
    assert e.value.code == "NOT_FOUND"


def test_concurrent_sessions(backend):
    sessions = [backend.create_session() for _ in range(6)]
    assert len({s.uid for s in sessions}) == 6
    results: dict[int, ExecResult] = {}

    def run(i: int) -> None:
        results[i] = py(sessions[i], "import sys; print(int(sys.argv[1]) ** 2)", str(i))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for s in sessions:
        s.close()
    assert {i: r.stdout for i, r in results.items()} == {i: f"{i * i}\n".encode() for i in range(6)}


def test_sandbox_failure_is_error(session):
    session._argv[1:1] = ["--ro-bind", "/nonexistent-source", "/x"]  # break bwrap itself
    r = session.exec(["true"], LIM)
    assert r.verdict == Verdict.ERROR and "nonexistent-source" in r.detail, r


def test_slot_exhaustion(tmp_path):
    # uids of its own: slots are claimed host-wide, and a backend of another test (another xdist worker) holding the
    # default range's first uids would leave this one fewer than two
    b = LocalBackend(tmp_path / "root", max_sessions=2, uid_base=63800)
    try:
        s1, _ = b.create_session(), b.create_session()
        with pytest.raises(SandboxError) as e:
            b.create_session()
        assert e.value.code == "RESOURCE_EXHAUSTED"
        s1.close()
        s3 = b.create_session("any-image-is-ignored", files={"x.txt": b"1"})
        assert s3.uid == s1.uid and s3.read_files(["x.txt"], 10) == {"x.txt": b"1"}
    finally:
        b.close()
    assert not list((tmp_path / "root").iterdir())


def test_unavailable_without_bwrap(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda *a, **k: None)
    with pytest.raises(SandboxError) as e:
        LocalBackend()
    assert e.value.code == "UNAVAILABLE" and "apt-get install bubblewrap" in str(e.value)


def test_two_backends_on_one_host_never_share_a_uid():
    """Sessions are told apart by uid (limits, permissions, clean-up), so uids are claimed host-wide."""
    a, b = LocalBackend(), LocalBackend()
    try:
        s1, s2, s3 = a.create_session(), b.create_session(), a.create_session()
        assert len({s1.uid, s2.uid, s3.uid}) == 3
        s1.close()
        s4 = b.create_session()
        assert s4.uid == s1.uid  # freed by a, reused by b
        assert b.create_session().uid not in {s2.uid, s3.uid, s4.uid}
    finally:
        a.close()
        b.close()
