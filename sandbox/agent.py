"""The in-pod agent of the Kubernetes backend: JSON over HTTP to run commands and move files in the pod's workdir.

Stdlib only: it runs under the task image's ``python3`` (3.9+, which the runner needs), with the ``sandbox`` package
copied into the pod by an init container and put on PYTHONPATH. ``AgentClient`` at the end is the service's side.
Start: ``python3 -m sandbox.agent --port 8000 [--host H] [--workdir D]``.

Endpoints (bodies and answers are JSON; bytes are base64):
  GET  /healthz                                  → {"ok": true, "workdir": ...}
  POST /exec        {argv, stdin, env, limits, exec_id} → an ExecResult (see ``result_to_json``)
  POST /cancel      {exec_id}                     → {"cancelled": bool}
  POST /write_files {files: {path: b64}, executable: [path, ...]} → {}
  POST /read_files  {paths: [...], max_bytes}     → {files: {path: b64}}
Errors are {"code", "message"} with an HTTP status (400 INVALID_ARGUMENT, 404 NOT_FOUND, 413 RESOURCE_EXHAUSTED, ...).
When the environment variable SANDBOX_AGENT_TOKEN is set, every POST must carry it in the X-Sandbox-Token header.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import errno
import hmac
import http.client
import json
import os
import select
import signal
import socket
import stat
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from sandbox.backend import (
    ExecResult,
    Limits,
    SandboxError,
    Verdict,
    check_relative_path,
    note_oom_kills,
    open_parent_dir,
)

TOKEN_ENV = "SANDBOX_AGENT_TOKEN"
TOKEN_HEADER = "X-Sandbox-Token"
HTTP_MARGIN_S = 10.0  # an exec's HTTP wait beyond its wall limit: output transfer and the runner's clean-up
CANCEL_WAIT_S = 5.0  # how long a cancelled exec waits for the agent to confirm the kill
MAX_BODY_BYTES = 1 << 30  # one request may carry a repository snapshot, but not an unbounded one
HTTP_STATUS = {"INVALID_ARGUMENT": 400, "UNAUTHENTICATED": 401, "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 413,
               "INTERNAL": 500, "UNAVAILABLE": 503}
_LIMIT_FIELDS = tuple(Limits.__dataclass_fields__)
# The package root this agent was imported from: stripped from the commands' PYTHONPATH so that the task's own
# code never imports our ``sandbox`` package instead of its own.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))


def b64(data: bytes) -> str:
    """Bytes → base64 text."""
    return base64.b64encode(data).decode("ascii")


def unb64(text: Any, what: str) -> bytes:
    """Base64 text → bytes (raises SandboxError INVALID_ARGUMENT)."""
    if not isinstance(text, str):
        raise SandboxError(f"{what} must be base64 text", "INVALID_ARGUMENT")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise SandboxError(f"{what} is not valid base64: {e}", "INVALID_ARGUMENT") from None


def limits_to_json(limits: Limits) -> dict[str, Any]:
    """Limits → JSON object."""
    return {k: getattr(limits, k) for k in _LIMIT_FIELDS}


def limits_from_json(obj: Any) -> Limits:
    """JSON object → Limits; missing fields keep their defaults, unknown ones are refused."""
    if not isinstance(obj, dict) or set(obj) - set(_LIMIT_FIELDS):
        raise SandboxError(f"limits must be an object with fields among {', '.join(_LIMIT_FIELDS)}",
                           "INVALID_ARGUMENT")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in obj.values()):
        raise SandboxError("limits must be non-negative numbers", "INVALID_ARGUMENT")
    return Limits(**obj)  # exactly what the service decided (0 means "no limit" to the runner)


def result_to_json(r: ExecResult) -> dict[str, Any]:
    """ExecResult → JSON object (the dataclass's fields; bytes as base64)."""
    return {**vars(r), "verdict": r.verdict.value, "stdout": b64(r.stdout), "stderr": b64(r.stderr)}


def result_from_json(obj: dict[str, Any]) -> ExecResult:
    """JSON object → ExecResult."""
    fields = {k: obj[k] for k in ExecResult.__dataclass_fields__ if k in obj}
    return ExecResult(**{**fields, "verdict": Verdict(obj["verdict"]), "stdout": unb64(obj.get("stdout", ""), "stdout"),
                         "stderr": unb64(obj.get("stderr", ""), "stderr")})


# The pod container's own cgroup (the pod is the session): v2, then v1.
_OOM_FILES = ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control")
_MEMORY_MAX_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def container_oom_kills() -> int | None:
    """The container cgroup's oom_kill counter, or None where it cannot be read."""
    for path in _OOM_FILES:
        try:
            with open(path) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return None


def container_memory_max(default: int) -> int:
    """The container's memory limit in bytes (``default`` where it is unlimited or unreadable)."""
    for path in _MEMORY_MAX_FILES:
        try:
            with open(path) as f:
                return int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return default


def child_environment(environ: Mapping[str, str], request_env: dict[str, str]) -> dict[str, str]:
    """The image's environment (PATH, conda variables...) without the agent's secrets, plus the request's variables."""
    env = {k: v for k, v in environ.items() if k != TOKEN_ENV}
    path = os.pathsep.join(p for p in env.pop("PYTHONPATH", "").split(os.pathsep)
                           if p and os.path.realpath(p) != _PACKAGE_ROOT)
    if path:
        env["PYTHONPATH"] = path
    env.update(request_env)
    return env


class WorkDir:
    """File access confined to one directory. Writes never go through a symlink (a directory on the way that is a
    symlink is refused; a symlink at the file's own name is replaced, not followed); reads follow symlinks only when
    they end inside the directory."""

    def __init__(self, root: str):
        os.makedirs(root, exist_ok=True)
        self.root = os.path.realpath(root)

    def write(self, path: str, data: bytes, executable: bool) -> None:
        """Create or replace one file, atomically (a temporary file renamed over the name)."""
        try:
            fd, name = open_parent_dir(self.root, path, create=True)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENOTDIR):
                raise SandboxError(f"file path {path!r} goes through a symlink or a file", "INVALID_ARGUMENT") from None
            raise
        tmp = f".sandbox-{uuid.uuid4().hex[:12]}.tmp"
        try:
            f = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=fd)
            with os.fdopen(f, "wb") as fh:
                fh.write(data)
                os.fchmod(fh.fileno(), 0o755 if executable else 0o644)  # explicit: the umask must not decide
            try:
                os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
            except OSError as e:
                os.unlink(tmp, dir_fd=fd)
                if e.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
                    raise SandboxError(f"file path {path!r} is a directory", "INVALID_ARGUMENT") from None
                raise
        finally:
            os.close(fd)

    def read(self, path: str, max_bytes: int) -> bytes:
        """One regular file's bytes (NOT_FOUND if missing, RESOURCE_EXHAUSTED if over ``max_bytes``)."""
        rel = check_relative_path(path)
        real = os.path.realpath(os.path.join(self.root, str(rel)))
        if os.path.commonpath([real, self.root]) != self.root:
            raise SandboxError(f"file path {path!r} leads out of the work directory", "INVALID_ARGUMENT")
        try:
            fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not block the agent
        except FileNotFoundError:
            raise SandboxError(f"no such file: {path}", "NOT_FOUND") from None
        with os.fdopen(fd, "rb") as fh:
            st = os.fstat(fh.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise SandboxError(f"{path} is not a regular file", "INVALID_ARGUMENT")
            if st.st_size > max_bytes:
                raise SandboxError(f"{path} has {st.st_size} bytes, over the limit of {max_bytes}",
                                   "RESOURCE_EXHAUSTED")
            data = fh.read(max_bytes + 1)  # the file may have grown since the fstat
        if len(data) > max_bytes:
            raise SandboxError(f"{path} is over the limit of {max_bytes} bytes", "RESOURCE_EXHAUSTED")
        return data


def _watch_disconnect(sock: socket.socket, cancel: threading.Event, done: threading.Event) -> None:
    """Set ``cancel`` if the caller hangs up while its command runs (e.g. the service died): no orphan commands."""
    while not done.is_set():
        try:
            readable, _, _ = select.select([sock], [], [], 0.25)
            if readable:
                if not sock.recv(1, socket.MSG_PEEK):
                    cancel.set()
                return  # EOF, or unexpected bytes: either way nothing more to watch
        except (OSError, ValueError):
            cancel.set()
            return


class AgentServer(ThreadingHTTPServer):
    """The HTTP server, holding the work directory, the token and the commands running now (for /cancel)."""

    daemon_threads = True

    def __init__(self, host: str, port: int, workdir: str, token: str = ""):
        if ":" in host:  # an IPv6 pod IP
            self.address_family = socket.AF_INET6
        self.workdir = WorkDir(workdir)
        self.token = token
        self.running: dict[str, threading.Event] = {}
        self.lock = threading.Lock()
        super().__init__((host, port), _Handler)


class _Handler(BaseHTTPRequestHandler):
    server: AgentServer
    server_version = "rl-sandbox-agent"

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per request would flood the pod log; errors are answered to the caller instead

    def _reply(self, status: int, obj: dict[str, Any]) -> None:
        data = json.dumps(obj).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the caller hung up (gave up or cancelled): there is no one to tell
            self.close_connection = True

    def _error(self, e: SandboxError) -> None:
        self._reply(HTTP_STATUS.get(e.code, 500), {"code": e.code, "message": str(e)})

    def do_GET(self) -> None:
        """Liveness: answers once the server is up (no token needed: it reveals nothing)."""
        if self.path == "/healthz":
            self._reply(200, {"ok": True, "workdir": self.server.workdir.root})
        else:
            self._error(SandboxError(f"no such endpoint: GET {self.path}", "NOT_FOUND"))

    def do_POST(self) -> None:
        """Dispatch one JSON request."""
        routes = {"/exec": self._exec, "/cancel": self._cancel, "/write_files": self._write_files,
                  "/read_files": self._read_files}
        try:
            handler = routes.get(self.path)
            if handler is None:
                raise SandboxError(f"no such endpoint: POST {self.path}", "NOT_FOUND")
            token = self.headers.get(TOKEN_HEADER, "")
            if self.server.token and not hmac.compare_digest(token.encode(), self.server.token.encode()):
                raise SandboxError("missing or wrong agent token", "UNAUTHENTICATED")
            answer = handler(self._body())
        except SandboxError as e:
            return self._error(e)
        except Exception as e:  # the agent must answer, whatever went wrong
            return self._error(SandboxError(f"agent error: {type(e).__name__}: {e}", "INTERNAL"))
        self._reply(200, answer)

    def _body(self) -> dict[str, Any]:
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            raise SandboxError("bad Content-Length", "INVALID_ARGUMENT") from None
        if length > MAX_BODY_BYTES:
            self.close_connection = True  # the unread body must not be parsed as a next request
            raise SandboxError(f"request of {length} bytes is over {MAX_BODY_BYTES}", "RESOURCE_EXHAUSTED")
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except ValueError as e:
            raise SandboxError(f"request is not JSON: {e}", "INVALID_ARGUMENT") from None
        if not isinstance(body, dict):
            raise SandboxError("request must be a JSON object", "INVALID_ARGUMENT")
        return body

    def _exec(self, body: dict[str, Any]) -> dict[str, Any]:
        from sandbox.runner import run_command  # imported here so the file API works even if the runner cannot load

        argv, env = body.get("argv"), body.get("env") or {}
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise SandboxError("argv must be a non-empty list of strings", "INVALID_ARGUMENT")
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise SandboxError("env must map strings to strings", "INVALID_ARGUMENT")
        limits = limits_from_json(body.get("limits") or {})
        stdin = unb64(body.get("stdin", ""), "stdin")
        exec_id = str(body.get("exec_id") or uuid.uuid4().hex)
        cancel, done = threading.Event(), threading.Event()
        with self.server.lock:
            self.server.running[exec_id] = cancel
        threading.Thread(target=_watch_disconnect, args=(self.connection, cancel, done), daemon=True).start()
        try:
            workdir = self.server.workdir.root
            oom_before = container_oom_kills()
            result = run_command(argv, limits, cwd=workdir, env=child_environment(os.environ, env), stdin=stdin,
                                 cancel=cancel, rlimits="preexec", scan_dirs=(workdir,))
            oom_after = container_oom_kills()
            if oom_before is not None and oom_after is not None:
                note_oom_kills(result, oom_after - oom_before, container_memory_max(limits.memory_bytes))
        finally:
            done.set()
            with self.server.lock:
                self.server.running.pop(exec_id, None)
        return result_to_json(result)

    def _cancel(self, body: dict[str, Any]) -> dict[str, Any]:
        with self.server.lock:
            cancel = self.server.running.get(str(body.get("exec_id")))
        if cancel is not None:
            cancel.set()
        return {"cancelled": cancel is not None}

    def _write_files(self, body: dict[str, Any]) -> dict[str, Any]:
        files, executable = body.get("files") or {}, set(body.get("executable") or ())
        if not isinstance(files, dict):
            raise SandboxError("files must map paths to base64 contents", "INVALID_ARGUMENT")
        decoded = {path: unb64(data, f"file {path}") for path, data in files.items()}
        for path in decoded:  # all paths are checked before anything is written
            check_relative_path(path)
        for path, data in decoded.items():
            self.server.workdir.write(path, data, path in executable)
        return {}

    def _read_files(self, body: dict[str, Any]) -> dict[str, Any]:
        paths, max_bytes = body.get("paths"), body.get("max_bytes")
        if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            raise SandboxError("paths must be a list of strings", "INVALID_ARGUMENT")
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0:
            raise SandboxError("max_bytes must be a non-negative integer", "INVALID_ARGUMENT")
        return {"files": {p: b64(self.server.workdir.read(p, max_bytes)) for p in paths}}


# The client side, used by the service (sandbox.kubernetes). Pod IPs are reached directly: never through an HTTP
# proxy that the service's environment may name.
_CLIENT_CODES = frozenset({"INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED", "UNAVAILABLE", "INTERNAL"})
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class AgentUnreachable(SandboxError):
    """The agent did not answer (connection refused or reset, or no answer in time)."""

    def __init__(self, message: str, timed_out: bool):
        super().__init__(message, "UNAVAILABLE")
        self.timed_out = timed_out


class AgentClient:
    """The service's side of this API, for one agent at ``url``; errors come back as SandboxError."""

    def __init__(self, url: str, token: str = "", name: str = ""):
        self.url, self.token, self.name = url, token, name or url

    def call(self, path: str, body: dict[str, Any] | None = None, timeout: float = 30.0) -> dict[str, Any]:
        """One JSON request (GET without a body, else POST)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method="GET" if data is None else "POST",
                                     headers={"Content-Type": "application/json", TOKEN_HEADER: self.token})
        try:
            with _OPENER.open(req, timeout=timeout) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as e:
            try:
                err = json.loads(e.read())
                code, msg = str(err["code"]), str(err["message"])
            except (ValueError, KeyError, TypeError, OSError):
                code, msg = "INTERNAL", f"agent answered HTTP {e.code} {e.reason}"
            if code not in _CLIENT_CODES:  # e.g. UNAUTHENTICATED: a bug of ours, not the caller's
                code, msg = "INTERNAL", f"{code}: {msg}"
            raise SandboxError(msg, code) from None
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            timed_out = isinstance(reason, TimeoutError) or "timed out" in str(reason)
            raise AgentUnreachable(f"{self.name}: agent at {self.url} unreachable: {reason}", timed_out) from None

    def exec(self, argv: list[str], limits: Limits, stdin: bytes = b"", env: dict[str, str] | None = None,
             cancel: threading.Event | None = None) -> ExecResult:
        """Run a command; ``cancel`` set → /cancel, and the agent's CANCELLED result (or one made up if it is slow)."""
        if cancel is not None and cancel.is_set():
            return ExecResult(verdict=Verdict.CANCELLED, exit_code=None, detail="cancelled before it started")
        exec_id = uuid.uuid4().hex
        body = {"argv": list(argv), "stdin": b64(stdin), "env": dict(env or {}), "limits": limits_to_json(limits),
                "exec_id": exec_id}
        timeout = (limits.wall_s if limits.wall_s > 0 else 24 * 3600) + HTTP_MARGIN_S
        if cancel is None:
            return self._exec_once(body, timeout)
        box: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                box["result"] = self._exec_once(body, timeout)
            except BaseException as e:  # handed to the caller's thread
                box["error"] = e
            finally:
                done.set()

        # The request blocks in another thread so that this one can watch ``cancel`` meanwhile.
        threading.Thread(target=run, daemon=True, name=f"exec-{exec_id[:8]}").start()
        while not done.wait(0.05):
            if cancel.is_set():
                self._cancel(exec_id, done)
                break
        if "result" in box:
            return box["result"]
        if "error" in box:
            raise box["error"]
        return ExecResult(verdict=Verdict.CANCELLED, exit_code=None,
                          detail="cancelled; the agent did not confirm the kill in time")

    def _exec_once(self, body: dict[str, Any], timeout: float) -> ExecResult:
        try:
            return result_from_json(self.call("/exec", body, timeout))
        except AgentUnreachable as e:
            if not e.timed_out:
                raise
            return ExecResult(verdict=Verdict.ERROR, exit_code=None, detail=f"no answer within {timeout:g} s: {e}")

    def _cancel(self, exec_id: str, done: threading.Event) -> None:
        """Ask the agent to kill ``exec_id``, again while the exec request may not have reached it yet."""
        end = time.monotonic() + CANCEL_WAIT_S
        while not done.is_set() and time.monotonic() < end:
            try:
                if self.call("/cancel", {"exec_id": exec_id}, 2.0).get("cancelled"):
                    done.wait(max(0.0, end - time.monotonic()))
                    return
            except SandboxError:
                pass
            done.wait(0.1)

    def write_files(self, files: dict[str, bytes], executable: frozenset[str] = frozenset()) -> None:
        """Create or replace files (≥ 10 MB/s assumed for the timeout)."""
        body = {"files": {p: b64(d) for p, d in files.items()}, "executable": sorted(executable)}
        self.call("/write_files", body, 30.0 + sum(len(d) for d in files.values()) / (10 << 20))

    def read_files(self, paths: list[str], max_bytes: int) -> dict[str, bytes]:
        """Read files."""
        out = self.call("/read_files", {"paths": list(paths), "max_bytes": max_bytes},
                        30.0 + len(paths) * max_bytes / (10 << 20))
        return {p: unb64(d, p) for p, d in out["files"].items()}


def main(argv: list[str] | None = None) -> None:
    """Serve until killed (the pod's main process)."""
    p = argparse.ArgumentParser(prog="python3 -m sandbox.agent", description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default=os.environ.get("POD_IP") or "0.0.0.0",
                   help="address to listen on (default: $POD_IP, else all interfaces)")
    p.add_argument("--workdir", default="/work", help="the session's work directory (created if missing)")
    args = p.parse_args(argv)
    # The image's python3, not the project's: the runner needs 3.9 (os.waitstatus_to_exitcode); say so in the pod log.
    if sys.version_info < (3, 9):  # noqa: UP036
        sys.exit(f"sandbox.agent needs python3 >= 3.9, this image has {sys.version.split()[0]}")
    token = os.environ.pop(TOKEN_ENV, "")  # popped so that no command inherits it
    server = AgentServer(args.host, args.port, args.workdir, token)
    # As PID 1 in the container, SIGTERM would be ignored without a handler; exit promptly instead.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    print(f"sandbox agent on {args.host}:{server.server_address[1]}, workdir {server.workdir.root}", flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
