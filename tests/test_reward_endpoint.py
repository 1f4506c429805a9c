"""Rewards from an HTTP endpoint (envs/reward_endpoint.py), against real local HTTP servers: the reference server
of examples/reward_server.py in its own process, and a scripted server here that batches are counted on and that
fails on purpose (503s, slowness, nulls, malformed replies)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
from gymnasium.utils.env_checker import check_env

from checkpoint_engine.topology import free_port
from envs import Task, make
from envs.reward_endpoint import EndpointEnv, EndpointError

ROOT = Path(__file__).resolve().parents[1]
TASKS = [Task(f"t{i}", f"What is {i} + {i}?", str(2 * i)) for i in range(8)]


def last_number(text: str) -> str | None:
    found = re.findall(r"-?\d+(?:\.\d+)?", text)
    return found[-1] if found else None


@pytest.fixture(scope="module")
def reference_server():
    proc = subprocess.Popen([sys.executable, str(ROOT / "examples" / "reward_server.py"), "--port", "0"],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        url = line.split(" on ")[-1].strip()
        assert url.startswith("http://127.0.0.1:") and url.endswith("/reward"), line
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


class Scripted(BaseHTTPRequestHandler):
    """Answers each POST by the next entry of ``script`` (then by "ok"): "ok" rewards len(response) / 10,
    "503", "400" and "slow" (sleeps past the client's timeout), "null1" (no reward for item 1), "short" (one
    reward too few) and "html" (200 but not JSON). ``batches`` records each request's item count."""

    protocol_version = "HTTP/1.1"
    script: ClassVar[list[str]] = []
    batches: ClassVar[list[int]] = []
    lock = threading.Lock()

    def log_message(self, *args):
        pass

    def _reply(self, status: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        items = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["items"]
        with self.lock:
            self.batches.append(len(items))
            what = self.script.pop(0) if self.script else "ok"
        if what in ("503", "400"):
            return self._reply(int(what), b'{"error": "scripted"}')
        if what == "slow":
            time.sleep(1.5)
        if what == "html":
            return self._reply(200, b"<html>oops</html>", "text/html")
        rewards = [len(item["response"]) / 10 for item in items]
        errors = [None] * len(items)
        if what == "null1":
            rewards[1], errors[1] = None, "the verifier crashed on this one"
        if what == "short":
            rewards = rewards[:-1]
        infos = [{"chars": len(item["response"]), "meta_keys": sorted(item["meta"])} for item in items]
        return self._reply(200, json.dumps({"rewards": rewards, "infos": infos, "errors": errors}).encode())


@pytest.fixture(scope="module")
def scripted_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/score"
    server.shutdown()


@pytest.fixture
def scripted(scripted_url):
    Scripted.script, Scripted.batches = [], []
    return scripted_url


def step(env: EndpointEnv, task: Task, response: str):
    env.reset(options={"task": task})
    return env.step(response)


def test_the_reference_server_rewards_exact_answers(reference_server):
    env = make("endpoint", url=reference_server)
    assert env.task_type == "endpoint" and not env.group_level
    cases = [(TASKS[3], "3 + 3 makes 6"), (TASKS[3], "it is 7"), (TASKS[5], "10.0"), (TASKS[2], "no number")]
    for task, response in cases:
        want = float(last_number(response) is not None and float(last_number(response)) == float(task.answer))
        obs, reward, terminated, truncated, info = step(env, task, response)
        assert (obs, reward, terminated, truncated) == ("", want, True, False)
        assert info == {"extracted": last_number(response)}
    with pytest.raises(EndpointError, match="no reward: the item has no answer to compare with"):
        step(env, Task("blank", "Say hi.", ""), "hi")


def test_check_env_passes(reference_server):
    env = EndpointEnv(TASKS[:3], url=reference_server)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env, skip_render_check=True)


def test_concurrent_episodes_share_batches(scripted):
    envs = [EndpointEnv(url=scripted, batch_size=4, max_wait_s=0.5) for _ in TASKS]  # one per episode, as in a run
    responses = ["x" * (i + 1) for i in range(len(TASKS))]
    with ThreadPoolExecutor(len(TASKS)) as pool:
        results = list(pool.map(step, envs, TASKS, responses))
    assert [r[1] for r in results] == [len(s) / 10 for s in responses]
    assert sum(Scripted.batches) == len(TASKS) and max(Scripted.batches) <= 4 and len(Scripted.batches) < len(TASKS)
    assert results[0][4] == {"chars": 1, "meta_keys": []}
    assert envs[0].diagnostics["batch_items"] in Scripted.batches and envs[0].diagnostics["request_s"] > 0


def test_retries_then_success_and_unretried_client_errors(scripted):
    Scripted.script = ["503", "503"]
    assert step(EndpointEnv(url=scripted, retries=2), TASKS[0], "abcd")[1] == 0.4
    assert Scripted.batches == [1, 1, 1]
    Scripted.script, Scripted.batches = ["503"], []
    with pytest.raises(EndpointError, match=r"answered 503: .*\(after 1 attempt\)$"):
        step(EndpointEnv(url=scripted, retries=0), TASKS[0], "abcd")
    Scripted.script, Scripted.batches = ["400"], []
    with pytest.raises(EndpointError, match=r"answered 400: .*\(after 1 attempt\)$"):
        step(EndpointEnv(url=scripted, retries=3), TASKS[0], "abcd")
    assert Scripted.batches == [1]  # a client error is not retried


@pytest.mark.parametrize(("script", "message"), [
    (["slow"], r"no reply from .* within 0\.5 s \(after 1 attempt\)"),
    (["short"], r"returned 1 rewards for 2 items"),
    (["html"], r"answered 200 but not JSON"),
])
def test_a_failed_request_fails_its_items(scripted, script, message):
    Scripted.script = script
    env = EndpointEnv(url=scripted, retries=0, timeout_s=0.5, batch_size=2, max_wait_s=0.5)
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(step, env, t, "ab") for t in TASKS[:2]]
        for f in futures:
            with pytest.raises(EndpointError, match=message):
                f.result()


def test_a_null_reward_fails_only_its_item(scripted):
    Scripted.script = ["null1"]
    env = EndpointEnv(url=scripted, batch_size=2, max_wait_s=0.5)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(step, EndpointEnv(url=scripted, batch_size=2, max_wait_s=0.5), TASKS[0], "abc")
        time.sleep(0.05)  # item 1 of the batch
        second = pool.submit(step, env, TASKS[1], "abcde")
        assert first.result()[1] == 0.3
        with pytest.raises(EndpointError, match="gave item t1 no reward: the verifier crashed on this one"):
            second.result()


def test_an_unreachable_endpoint_is_an_error_after_its_retries():
    env = EndpointEnv(url=f"http://127.0.0.1:{free_port()}/score", retries=1, timeout_s=2)
    t0 = time.monotonic()
    with pytest.raises(EndpointError, match=r"cannot reach .*ConnectError.*\(after 2 attempts\)"):
        step(env, TASKS[0], "a")
    assert time.monotonic() - t0 >= 0.5  # waited the back-off before the retry


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="must start with http"):
        EndpointEnv(url="localhost:8000")
    with pytest.raises(ValueError, match="batch_size >= 1"):
        EndpointEnv(url="http://127.0.0.1:1/x", batch_size=0)
