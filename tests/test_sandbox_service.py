"""The sandbox service over real gRPC on loopback with the real bubblewrap backend: runs, sessions, admission
control, deadlines, cancellation, metrics, the CLI, and that attacks never stop it from serving the next request."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sandbox.backend import Limits, SandboxError, Verdict
from sandbox.client import SandboxClient, connect
from sandbox.proto import sandbox_pb2 as pb
from sandbox.server import start_server

SMALL = Limits(wall_s=5, cpu_s=5, memory_bytes=256 << 20, processes=32, output_bytes=64 << 10)


@pytest.fixture(scope="module")
def server():
    srv = start_server("local", concurrency=4, max_queue=64, max_sessions=8, metrics_port=0)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with SandboxClient(server.address) as c:
        yield c


def healthy(client: SandboxClient) -> None:
    """The service still answers a normal request correctly."""
    r = client.run(["python3", "-c", "import sys; print(sum(range(10)), sys.stdin.read())"], stdin=b"in",
                   limits=SMALL)
    assert r.verdict == Verdict.OK and r.stdout == b"45 in\n", r


def metric(server, name: str, **labels: str) -> float:
    """One sample of the service's /metrics endpoint, read over HTTP as Prometheus would."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def test_code_and_tests_pass_and_fail(client):
    code = "def add(a, b):\n    return a + b\n"
    ok = client.run(code=code, tests="assert add(2, 3) == 5\nprint('passed')", limits=SMALL)
    assert ok.verdict == Verdict.OK and ok.exit_code == 0 and ok.stdout == b"passed\n"
    bad = client.run(code=code, tests="assert add(2, 3) == 6", limits=SMALL)
    assert bad.verdict == Verdict.FAILED and bad.exit_code == 1 and b"AssertionError" in bad.stderr


def test_files_command_env_and_executable(client):
    r = client.run(["./run.sh"], {"run.sh": "#!/bin/sh\necho \"$GREETING\" $(cat data.txt)\n", "data.txt": "x"},
                   env={"GREETING": "hello"}, executable=["run.sh"], limits=SMALL)
    assert r.verdict == Verdict.OK and r.stdout == b"hello x\n", r


def test_session_keeps_files_between_commands(client, server):
    before = metric(server, "sandbox_active_sessions")
    with client.create_session(files={"src/a.py": "X = 1\n"}) as s:
        assert metric(server, "sandbox_active_sessions") == before + 1
        r = s.exec(["python3", "-c", "import sys; sys.path.insert(0, 'src'); import a; "
                    "open('out.txt', 'w').write(str(a.X + 1))"], limits=SMALL)
        assert r.verdict == Verdict.OK, r
        assert s.read_files(["out.txt", "src/a.py"]) == {"out.txt": b"2", "src/a.py": b"X = 1\n"}
        s.write_files({"src/a.py": "X = 41\n"})
        r = s.exec(["python3", "-c", "import sys; sys.path.insert(0, 'src'); import a; print(a.X + 1)"], limits=SMALL)
        assert r.stdout == b"42\n"
        with pytest.raises(SandboxError) as e:
            s.read_files(["missing.txt"])
        assert e.value.code == "NOT_FOUND" and "missing.txt" in str(e.value)
        with pytest.raises(SandboxError) as e:
            s.write_files({"../escape.txt": "x"})
        assert e.value.code == "INVALID_ARGUMENT"
        sid = s.id
    assert metric(server, "sandbox_active_sessions") == before
    with pytest.raises(SandboxError) as e:
        client._call(client._stub.Exec, pb.ExecRequest(session_id=sid, command=["true"]), 10)
    assert e.value.code == "NOT_FOUND" and sid in str(e.value)


@pytest.mark.parametrize("attack, verdict", [
    ("import os\nwhile True:\n    os.fork()", Verdict.PROCESS_LIMIT),
    ("x = bytearray(1 << 34)", Verdict.MEMORY_LIMIT),
    ("while True:\n    pass", Verdict.TIMEOUT),
    ("import sys\nwhile True:\n    sys.stdout.write('y' * 65536)", Verdict.OUTPUT_LIMIT),
    ("open('big', 'wb').write(b'0' * (64 << 20))", Verdict.FILE_SIZE_LIMIT),
])
def test_attacks_get_their_verdict_and_the_service_keeps_serving(client, attack, verdict):
    lim = Limits(wall_s=2, cpu_s=10, memory_bytes=256 << 20, processes=32, file_size_bytes=1 << 20,
                 output_bytes=64 << 10)
    r = client.run(["python3", "-c", attack], limits=lim)
    assert r.verdict == verdict, (r.verdict, r.detail, r.stderr[-300:])
    assert len(r.stdout) <= lim.output_bytes
    healthy(client)


def test_no_network_and_no_project_files(client):
    probe = ("import socket\ns = socket.socket()\ns.settimeout(1)\ntry:\n"
             "    s.connect(('127.0.0.1', PORT)); print('connected')\nexcept OSError:\n    print('refused')\n")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    try:
        port = listener.getsockname()[1]
        r = client.run(["python3", "-c", probe.replace("PORT", str(port))], limits=SMALL)
        assert r.stdout == b"refused\n", r
    finally:
        listener.close()
    readme = os.path.abspath("README.md")
    r = client.run(["python3", "-c", f"print(open({readme!r}).read()[:10])"], limits=SMALL)
    assert r.verdict == Verdict.FAILED and b"No such file" in r.stderr


@pytest.mark.serial  # each attack's verdict races its wall-clock limit: another test process's load turns a fork
# bomb's process_limit into a timeout (seen once when the machine ran more than the suite)
def test_parallel_attacks_do_not_disturb_honest_requests(client):
    attacks = ["import os\nwhile True:\n    os.fork()", "while True:\n    pass", "x = bytearray(1 << 34)"]
    lim = Limits(wall_s=2, cpu_s=5, memory_bytes=256 << 20, processes=32)

    def honest(i: int) -> bytes:
        return client.run(["python3", "-c", f"print({i} * {i})"], limits=SMALL).stdout

    with ThreadPoolExecutor(8) as pool:
        bad = [pool.submit(client.run, ["python3", "-c", a], limits=lim) for a in attacks]
        good = list(pool.map(honest, range(12)))
        assert [f.result().verdict for f in bad] == [Verdict.PROCESS_LIMIT, Verdict.TIMEOUT, Verdict.MEMORY_LIMIT]
    assert good == [f"{i * i}\n".encode() for i in range(12)]


def _host_processes_with(marker: str) -> int:
    n = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                n += marker.encode() in f.read()
        except OSError:
            pass
    return n


@pytest.mark.serial  # the answer must beat a 1 s deadline: under another test process's load it missed it once
def test_deadline_and_cancellation_kill_the_command(client, server):
    marker = "deadline-marker-7731"
    # The caller's deadline shortens the wall limit, so the caller still gets a result (TIMEOUT) in time.
    r = client.run(["python3", "-c", f"import time  # {marker}\ntime.sleep(60)"], limits=Limits(wall_s=30),
                   timeout_s=1.0)
    assert r.verdict == Verdict.TIMEOUT and r.wall_s < 1.0, r
    marker2 = "cancel-marker-4411"
    fut = client._stub.Run.future(pb.RunRequest(command=["python3", "-c", f"import time  # {marker2}\n"
                                                         "time.sleep(60)"], limits=pb.Limits(wall_s=30)))
    deadline = time.monotonic() + 10
    while _host_processes_with(marker2) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _host_processes_with(marker2) > 0
    fut.cancel()
    deadline = time.monotonic() + 10
    while (_host_processes_with(marker) or _host_processes_with(marker2)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _host_processes_with(marker) == 0 and _host_processes_with(marker2) == 0
    healthy(client)


def test_limits_above_the_maximum_are_refused_by_name(client):
    with pytest.raises(SandboxError) as e:
        client.run(["true"], limits=Limits(wall_s=10**6))
    assert e.value.code == "INVALID_ARGUMENT" and "limits.wall_s" in str(e.value)
    with pytest.raises(SandboxError) as e:
        client.run()
    assert e.value.code == "INVALID_ARGUMENT" and "command" in str(e.value)


def test_queue_and_session_limits_reject_with_resource_exhausted():
    with start_server("local", concurrency=1, max_queue=0, max_sessions=1, metrics_port=0) as srv, \
            SandboxClient(srv.address) as c:
        started = threading.Event()

        def slow():
            started.set()
            return c.run(["sleep", "2"], limits=SMALL)

        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(slow)
            started.wait()
            time.sleep(0.5)
            with pytest.raises(SandboxError) as e:
                c.run(["true"], limits=SMALL)
            assert e.value.code == "RESOURCE_EXHAUSTED" and "--max-queue" in str(e.value)
            assert fut.result().verdict == Verdict.OK
        assert metric(srv, "sandbox_rejections_total", reason="queue_full") == 1
        s = c.create_session()
        with pytest.raises(SandboxError) as e:
            c.create_session()
        assert e.value.code == "RESOURCE_EXHAUSTED"
        s.close()
        c.create_session().close()


def test_idle_sessions_are_closed():
    with start_server("local", concurrency=1, session_idle_s=0.4) as srv, SandboxClient(srv.address) as c:
        s = c.create_session()
        deadline = time.monotonic() + 5
        while srv.service.session_count() and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(SandboxError) as e:
            s.exec(["true"])
        assert e.value.code == "NOT_FOUND"


def test_metrics_count_verdicts_and_latency(client, server):
    ok0 = metric(server, "sandbox_commands_total", kind="run", verdict="ok")
    to0 = metric(server, "sandbox_commands_total", kind="run", verdict="timeout")
    n0 = metric(server, "sandbox_command_seconds_count", kind="run")
    client.run(["true"], limits=SMALL)
    client.run(["sleep", "5"], limits=Limits(wall_s=0.5))
    assert metric(server, "sandbox_commands_total", kind="run", verdict="ok") == ok0 + 1
    assert metric(server, "sandbox_commands_total", kind="run", verdict="timeout") == to0 + 1
    assert metric(server, "sandbox_command_seconds_count", kind="run") == n0 + 2


def test_connect_starts_one_local_service():
    a, b = connect(), connect()
    assert a.address == b.address
    assert a.run(["echo", "hi"]).stdout == b"hi\n"


def test_cli_serve_and_run():
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "rl.cli", "sandbox", "serve", "--port", "0", "--concurrency", "2"],
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        address = re.search(r"listening on (\S+)", line).group(1)
        r = subprocess.run([sys.executable, "-m", "rl.cli", "sandbox", "run", "--address", address, "--",
                            "python3", "-c", "print(6 * 7)"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and r.stdout == "42\n" and "verdict: ok" in r.stderr, r
        with grpc.insecure_channel(address) as ch:
            grpc.channel_ready_future(ch).result(timeout=5)
    finally:
        proc.terminate()
        proc.wait(10)
    bad = subprocess.run([sys.executable, "-m", "rl.cli", "sandbox", "serve", "--backend", "docker"],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "invalid choice: 'docker'" in bad.stderr


@pytest.mark.serial
def test_sigterm_stops_the_cli_service_and_leaves_nothing():
    """``rl sandbox serve`` stopped with SIGTERM (how Kubernetes, systemd and the benchmark stop it) drains: the open
    session goes on until its client closes it, new ones are refused; then the service removes its directories,
    mounts and cgroups, as a stop with Ctrl-C does."""
    if os.geteuid() != 0:
        pytest.skip("the session mounts and cgroups this checks need root")
    from sandbox.cgroups import _mounts, _own_paths

    def session_mounts() -> set[Path]:
        with open("/proc/self/mountinfo") as f:  # the service's mounts are in this mount namespace too
            return {Path(line.split()[4]) for line in f if "/rl-sandbox-" in line.split()[4]
                    and not line.split()[4].endswith("/.system")}  # a backend's shared files

    others = session_mounts()  # this process's own services'
    proc = subprocess.Popen([sys.executable, "-m", "rl.cli", "sandbox", "serve", "--port", "0", "--concurrency", "2"],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        address = re.search(r"listening on (\S+)", proc.stdout.readline()).group(1)
        with SandboxClient(address) as c:
            s = c.create_session(files={"a.txt": "x"})
            session_dirs = sorted(session_mounts() - others)
            assert len(session_dirs) == 1, session_dirs
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            assert proc.poll() is None  # draining: the open session goes on
            assert s.exec(["cat", "a.txt"], limits=SMALL).stdout == b"x"
            with pytest.raises(SandboxError) as e:
                c.create_session()
            assert e.value.code == "UNAVAILABLE"
            t0 = time.monotonic()
            s.close()
            assert proc.wait(30) == 0 and time.monotonic() - t0 < 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    root = session_dirs[0].parent
    assert not root.exists(), sorted(p.name for p in root.iterdir())
    own = _own_paths()
    left = [p for mount, fs, _ in _mounts() if fs == "cgroup" for c in (own.keys() & {"memory", "pids", "cpu"})
            for p in (Path(mount) / own[c].lstrip("/")).glob(f"rl-sandbox-{proc.pid}-*")]
    assert left == []


def test_replicas_behind_one_name_share_runs_and_keep_each_session():
    """Two replicas behind one gRPC target (as a headless Service's DNS name resolves to its pods): runs
    go round-robin over both, and every call of a session reaches the replica that holds it (another
    replica answers NOT_FOUND, so half of them would fail without the advertised address)."""
    from checkpoint_engine.topology import free_port

    ports = [free_port(), free_port()]
    replicas = [start_server("local", port=p, concurrency=2, metrics_port=0, advertise_address=f"127.0.0.1:{p}")
                for p in ports]
    try:
        with SandboxClient("ipv4:" + ",".join(f"127.0.0.1:{p}" for p in ports)) as client:
            runs = [client.run(["python3", "-c", f"print({i} * 2)"], limits=SMALL) for i in range(8)]
            assert [r.stdout for r in runs] == [f"{i * 2}\n".encode() for i in range(8)]
            served = [metric(r, "sandbox_commands_total", kind="run", verdict="ok") for r in replicas]
            assert sum(served) == 8 and min(served) >= 2, served
            sessions = [client.create_session(files={"n.txt": str(i)}) for i in range(6)]
            holders = {s.client.address for s in sessions}
            assert holders == {f"127.0.0.1:{p}" for p in ports}, holders
            for i, s in enumerate(sessions):
                s.write_files({"m.txt": f"{i}!"})
                assert s.exec(["cat", "n.txt", "m.txt"], limits=SMALL).stdout == f"{i}{i}!".encode()
                assert s.read_files(["m.txt"]) == {"m.txt": f"{i}!".encode()}
                s.close()
            assert all(len(r.service._sessions) == 0 for r in replicas)
    finally:
        for r in replicas:
            r.stop()


def test_a_port_already_served_is_refused():
    """gRPC's port reuse is off: a second service on the same port fails instead of splitting the traffic."""
    with start_server("local", concurrency=1) as first:
        with pytest.raises(SandboxError, match="port is in use") as e:
            start_server("local", port=first.port, concurrency=1)
        assert e.value.code == "UNAVAILABLE"
        cli = subprocess.run([sys.executable, "-m", "rl.cli", "sandbox", "serve", "--port", str(first.port)],
                             capture_output=True, text=True, timeout=60)
        assert cli.returncode == 2 and "port is in use" in cli.stderr and "Traceback" not in cli.stderr, cli.stderr
        with SandboxClient(first.address) as c:
            healthy(c)


@pytest.mark.parametrize("field", ["wall_s", "cpu_s", "cpus"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_limits_are_refused_over_grpc(client, field, value):
    with pytest.raises(SandboxError) as e:
        client._call(client._stub.Run, pb.RunRequest(command=["true"], limits=pb.Limits(**{field: value})), 30)
    assert e.value.code == "INVALID_ARGUMENT" and f"limits.{field}" in str(e.value)


def test_deep_trees_never_take_the_service_down():
    """Programs and requests that nest 1,200 directories, more of them than the service has session slots: every
    slot comes back, honest requests are still served, and the service shuts down cleanly."""
    deep = ("import os\nfor i in range(1200):\n    os.mkdir('d')\n    os.chdir('d')\nprint('ok')")
    with start_server("local", concurrency=2, max_sessions=4, backend_options={"max_sessions": 4}) as srv, \
            SandboxClient(srv.address) as c:
        root = srv.service.backend.root
        for _ in range(6):
            assert c.run(["python3", "-c", deep], limits=SMALL).stdout == b"ok\n"
            path = "/".join(["q"] * 1200) + "/f.txt"
            with c.create_session(files={path: "x"}) as s:
                assert s.read_files([path]) == {path: b"x"}
        healthy(c)
        backend = srv.service.backend
        assert not backend._dirty and len(backend._free) == backend.max_sessions
    assert not root.exists()
