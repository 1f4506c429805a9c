"""The sandbox service's answers to its callers, over real gRPC with the bubblewrap backend: every malformed request
field is INVALID_ARGUMENT naming the field, a shared token guards the service, a shutdown drains open sessions
(and a command it cuts short is an environment error), and memory of large payloads goes back to the system."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
import time

import grpc
import pytest

from sandbox.auth import TOKEN_ENV
from sandbox.backend import Limits, SandboxError, Verdict
from sandbox.client import SandboxClient
from sandbox.proto import sandbox_pb2 as pb
from sandbox.server import start_server
from tests.test_sandbox_truth import CHILDREN_OVER_THE_LIMIT

SMALL = Limits(wall_s=5, cpu_s=5, memory_bytes=256 << 20, processes=32, output_bytes=64 << 10)
F = pb.File


@pytest.fixture(scope="module")
def server():
    srv = start_server("local", concurrency=2, max_sessions=8)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with SandboxClient(server.address) as c:
        yield c


@pytest.fixture(scope="module")
def sid(client):
    s = client.create_session(files={"a.txt": "x"})
    yield s.id
    s.close()


def _invalid(sid: str) -> list[tuple[str, str, object, str]]:
    """(what, method, request, the field the error must name) for every malformed field of every request."""
    long_name = "n" * 300
    return [
        ("NUL in a file path", "Run", pb.RunRequest(command=["true"], files=[F(path="a\0b")]), "files[0].path"),
        ("absolute file path", "Run", pb.RunRequest(command=["true"], files=[F(path="ok"), F(path="/etc/x")]),
         "files[1].path"),
        ("'..' in a file path", "CreateSession", pb.CreateSessionRequest(files=[F(path="../x")]), "files[0].path"),
        ("empty file path", "CreateSession", pb.CreateSessionRequest(files=[F(path="")]), "files[0].path"),
        ("over-long file name", "CreateSession", pb.CreateSessionRequest(files=[F(path=long_name)]),
         "files[0].path"),
        ("a path given twice", "Run", pb.RunRequest(command=["true"], files=[F(path="a"), F(path="a")]),
         "files[1].path"),
        ("NUL in an argument", "Run", pb.RunRequest(command=["echo", "a\0b"]), "command[1]"),
        ("empty program", "Run", pb.RunRequest(command=["", "x"]), "command[0]"),
        ("'=' in an env name", "Run", pb.RunRequest(command=["true"], env={"A=B": "1"}), "env"),
        ("NUL in an env value", "Exec", pb.ExecRequest(session_id=sid, command=["true"], env={"A": "x\0"}),
         "env['A']"),
        ("negative memory limit", "Run", pb.RunRequest(command=["true"], limits=pb.Limits(memory_bytes=-1)),
         "limits.memory_bytes"),
        ("negative processes", "Exec", pb.ExecRequest(session_id=sid, command=["true"],
                                                      limits=pb.Limits(processes=-3)), "limits.processes"),
        ("image with a space", "Run", pb.RunRequest(command=["true"], image="python 3"), "image"),
        ("image with a control character", "CreateSession", pb.CreateSessionRequest(image="a\nb"), "image"),
        ("NUL in an Exec argument", "Exec", pb.ExecRequest(session_id=sid, command=["cat", "a\0"]), "command[1]"),
        ("empty session id", "Exec", pb.ExecRequest(command=["true"]), "session_id"),
        ("NUL in a written path", "WriteFiles", pb.WriteFilesRequest(session_id=sid, files=[F(path="b\0")]),
         "files[0].path"),
        ("empty session id", "WriteFiles", pb.WriteFilesRequest(files=[F(path="b")]), "session_id"),
        ("NUL in a read path", "ReadFiles", pb.ReadFilesRequest(session_id=sid, paths=["a.txt", "a\0"]), "paths[1]"),
        ("absolute read path", "ReadFiles", pb.ReadFilesRequest(session_id=sid, paths=["/etc/passwd"]), "paths[0]"),
        ("negative max_bytes", "ReadFiles", pb.ReadFilesRequest(session_id=sid, paths=["a.txt"], max_bytes=-1),
         "max_bytes"),
        ("max_bytes above the maximum", "ReadFiles",
         pb.ReadFilesRequest(session_id=sid, paths=["a.txt"], max_bytes=1 << 40), "max_bytes"),
        ("empty session id", "ReadFiles", pb.ReadFilesRequest(paths=["a.txt"]), "session_id"),
        ("empty session id", "CloseSession", pb.CloseSessionRequest(), "session_id"),
    ]


def test_every_malformed_field_is_invalid_argument_naming_it(client, sid):
    """Each caller error gets INVALID_ARGUMENT with the field's name (a NUL byte in a path was INTERNAL, a negative
    max_bytes RESOURCE_EXHAUSTED), and the session it was sent to still works."""
    wrong = []
    for what, method, request, field in _invalid(sid):
        try:
            client._call(getattr(client._stub, method), request, 30)
        except SandboxError as e:
            if e.code != "INVALID_ARGUMENT" or field not in str(e):
                wrong.append(f"{what}: {e.code} {e}")
        else:
            wrong.append(f"{what}: accepted")
    assert wrong == []
    got = client._call(client._stub.ReadFiles, pb.ReadFilesRequest(session_id=sid, paths=["a.txt"]), 30)
    assert [(f.path, f.content) for f in got.files] == [("a.txt", b"x")]


def test_a_request_that_does_not_parse_is_invalid_argument(server):
    """Bytes that are no valid request (invalid UTF-8 in a string field) are the caller's error, not INTERNAL."""
    raw = pb.ReadFilesRequest(session_id="s", paths=["ab"]).SerializeToString().replace(b"ab", b"\xff\xfe")
    with grpc.insecure_channel(server.address) as ch:
        call = ch.unary_unary("/rl.sandbox.v1.Sandbox/ReadFiles")
        with pytest.raises(grpc.RpcError) as e:
            call(raw, timeout=10)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "ReadFilesRequest" in e.value.details()


def test_an_oom_kill_reaches_the_caller(client, server):
    """Over gRPC too: the verdict and the cgroup's oom_kill count of a child killed while its parent exits 0."""
    if "cgroup" not in server.service.backend.enforced:
        pytest.skip("cgroup limits are not in force on this host")
    r = client.run(["python3", "-c", CHILDREN_OVER_THE_LIMIT], limits=Limits(wall_s=20, memory_bytes=128 << 20))
    assert r.verdict == Verdict.MEMORY_LIMIT and r.exit_code == 0 and r.oom_kills >= 1, r


def test_a_token_guards_every_call(monkeypatch):
    with start_server("local", concurrency=1, token="s3cret") as srv:
        for token in ("", "wrong", "s3cret-but-longer"):
            with SandboxClient(srv.address, token=token) as c, pytest.raises(SandboxError) as e:
                c.run(["true"], limits=SMALL)
            assert e.value.code == "UNAUTHENTICATED" and TOKEN_ENV in str(e.value)
        with SandboxClient(srv.address, token="wrong") as c, pytest.raises(SandboxError) as e:
            c._call(c._stub.CloseSession, pb.CloseSessionRequest(session_id="x"), 10)
        assert e.value.code == "UNAUTHENTICATED"
        monkeypatch.setenv(TOKEN_ENV, "s3cret")  # clients (and a session's replica client) read it themselves
        with SandboxClient(srv.address) as c:
            assert c.run(["echo", "ok"], limits=SMALL).stdout == b"ok\n"
            with c.create_session(files={"f": "1"}) as s:
                assert s.exec(["cat", "f"], limits=SMALL).stdout == b"1"


def test_the_token_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    with start_server("local", concurrency=1) as srv:
        with SandboxClient(srv.address, token="") as c, pytest.raises(SandboxError) as e:
            c.run(["true"], limits=SMALL)
        assert e.value.code == "UNAUTHENTICATED"
        with SandboxClient(srv.address) as c:
            assert c.run(["true"], limits=SMALL).verdict == Verdict.OK


def test_a_warning_without_a_token_off_loopback(monkeypatch, caplog):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger="sandbox.server"):
        with start_server("local", concurrency=1):
            pass
        assert not [r for r in caplog.records if "without authentication" in r.message]
        with start_server("local", concurrency=1, host="0.0.0.0"):
            pass
    warned = [r.message for r in caplog.records if "without authentication" in r.message]
    assert len(warned) == 1 and TOKEN_ENV in warned[0] and "\n" not in warned[0]


@pytest.mark.serial
def test_shutdown_drains_open_sessions_and_refuses_new_ones():
    """A stop lets the open session finish its work (a command running, then another, then its close) while new
    sessions and runs are refused as UNAVAILABLE; it returns as soon as the session is closed."""
    srv = start_server("local", concurrency=2, drain_s=30)
    c = SandboxClient(srv.address)
    s = c.create_session(files={"n": "7"})
    running = threading.Thread(target=lambda: results.append(s.exec(["sh", "-c", "sleep 1; cat n"], limits=SMALL)))
    results: list = []
    running.start()
    time.sleep(0.3)
    stopper = threading.Thread(target=srv.stop)
    t0 = time.monotonic()
    stopper.start()
    try:
        time.sleep(0.2)
        for new in (lambda: c.create_session(), lambda: c.run(["true"], limits=SMALL)):
            with pytest.raises(SandboxError) as e:
                new()
            assert e.value.code == "UNAVAILABLE" and "shutting down" in str(e.value)
        running.join()
        assert results[0].verdict == Verdict.OK and results[0].stdout == b"7", results
        assert s.exec(["echo", "more"], limits=SMALL).stdout == b"more\n"
        s.close()
        stopper.join(10)
        assert not stopper.is_alive() and time.monotonic() - t0 < 10
    finally:
        c.close()
        srv.stop()


def test_a_command_cut_short_by_the_shutdown_is_an_environment_error():
    """Past the drain, a command still running is killed and reported as ERROR (the environment's failure, which
    rewards never count as a wrong answer), not as a cancelled or failed program."""
    srv = start_server("local", concurrency=2, drain_s=0.5)
    c = SandboxClient(srv.address)
    try:
        with c.create_session() as s:
            out: list = []
            t = threading.Thread(target=lambda: out.append(s.exec(["sleep", "30"], limits=Limits(wall_s=60))))
            t.start()
            time.sleep(0.5)
            srv.stop()
            t.join(10)
            assert out and out[0].verdict == Verdict.ERROR and "shut down" in out[0].detail, out
            s.closed = True  # the service is gone with it
    finally:
        c.close()


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_memory_of_large_payloads_goes_back():
    """A service that moved ~1 GiB in large requests and answers (files in, files and output out) is back near its
    resting memory a few seconds later, rather than keeping its peak."""
    proc = subprocess.Popen([sys.executable, "-m", "rl.cli", "sandbox", "serve", "--port", "0", "--concurrency", "2"],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        address = re.search(r"listening on (\S+)", proc.stdout.readline()).group(1)
        big = os.urandom(32 << 20)
        out_limits = Limits(wall_s=30, memory_bytes=512 << 20, output_bytes=64 << 20)
        with SandboxClient(address) as c:
            c.run(["true"], files={"warm": b"x" * (1 << 20)}, limits=SMALL)
            time.sleep(3)
            before = _rss_mib(proc.pid)
            peak = before
            for _ in range(3):
                with c.create_session(files={"a.bin": big}) as s:
                    s.write_files({"b.bin": big})
                    s.exec(["sh", "-c", "head -c 15000000 a.bin > c.bin"], limits=out_limits)
                    assert s.read_files(["c.bin"])["c.bin"] == big[:15_000_000]
                    r = s.exec(["python3", "-c", "import sys; sys.stdout.buffer.write(b'x' * (40 << 20))"],
                               limits=out_limits)
                    assert len(r.stdout) == 40 << 20, r.detail
                r = c.run(["cat", "a.bin"], files={"a.bin": big}, limits=out_limits)
                assert len(r.stdout) == len(big), r.detail
                peak = max(peak, _rss_mib(proc.pid))
            deadline = time.monotonic() + 10
            while _rss_mib(proc.pid) > before + 96 and time.monotonic() < deadline:
                time.sleep(0.25)
            after = _rss_mib(proc.pid)
        assert after <= before + 96, f"RSS {before:.0f} MiB before, peak {peak:.0f}, {after:.0f} after"
    finally:
        proc.terminate()
        proc.wait(60)
