"""The gRPC servicer: admission control, limits, sessions, cancellation and metrics over any backend."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TypeVar

import grpc

from sandbox import requests as rq
from sandbox.backend import DEFAULT_LIMITS, Backend, CancelEvent, ExecResult, Limits, SandboxError, SessionInfo, Verdict
from sandbox.judge import judge_command, judge_verdict
from sandbox.metrics import SandboxMetrics
from sandbox.proto import sandbox_pb2 as pb
from sandbox.proto import sandbox_pb2_grpc as pb_grpc
from sandbox.wire import files_to_pb, limits_from_pb, result_to_pb

log = logging.getLogger(__name__)
T = TypeVar("T")

# The most a request may ask for; a request above it is refused rather than silently clamped.
MAX_LIMITS = Limits(wall_s=3600, cpu_s=3600, memory_bytes=64 << 30, processes=4096, open_files=65536,
                    file_size_bytes=16 << 30, output_bytes=256 << 20, cpus=256)
DEADLINE_MARGIN_S = 0.05  # leave time to send the result before the caller's deadline


class SandboxService(pb_grpc.SandboxServicer):
    """Serves Run and sessions on ``backend``, at most ``concurrency`` commands at once and ``max_queue`` waiting."""

    def __init__(self, backend: Backend, *, concurrency: int = 8, max_queue: int = 256, max_sessions: int = 256,
                 default_limits: Limits = DEFAULT_LIMITS, max_limits: Limits = MAX_LIMITS,
                 session_idle_s: float = 1800.0, max_read_bytes: int = 16 << 20, metrics: SandboxMetrics | None = None,
                 advertise_address: str = ""):
        self.backend = backend
        self.advertise_address = advertise_address  # where this replica's sessions are reached
        self.concurrency, self.max_queue, self.max_sessions = concurrency, max_queue, max_sessions
        self.default_limits, self.max_limits = default_limits, max_limits
        self.session_idle_s, self.max_read_bytes = session_idle_s, max_read_bytes
        self.metrics = metrics or SandboxMetrics()
        self._slots = threading.Semaphore(concurrency)
        self._lock = threading.Lock()
        self._waiting = 0
        self._sessions: dict[str, SessionInfo] = {}
        self._closed = threading.Event()
        self._draining = threading.Event()
        self._running = 0  # commands holding a slot (under self._lock)
        self._reaper = threading.Thread(target=self._reap_idle_sessions, name="sandbox-session-reaper", daemon=True)
        self._reaper.start()

    # ---- RPCs ----------------------------------------------------------------------------------------------------

    def Run(self, request: pb.RunRequest, context: grpc.ServicerContext) -> pb.ExecResult:
        t0 = time.perf_counter()
        self._refuse_when_draining(context)
        files, executable = self._call(context, rq.check_files, request.files)
        argv, stdin, nonce = list(request.command), request.stdin, None
        if request.code or request.tests:
            if argv or files or stdin:
                _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "Run takes either a command (with files and "
                       "stdin) or code + tests, not both")
            files, argv, stdin, nonce = judge_command(request.code, request.tests)
        if not argv:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "Run needs a command (or code and tests)")
        self._check_exec(request, context)
        limits = self._limits(request.limits, context)
        cancel = _cancel_event(context)
        with self._slot(context):
            session = self._call(context, self.backend.create_session, request.image, files)
            try:
                if executable:
                    self._call(context, session.write_files, files, executable)
                result = self._call(context, session.exec, argv, self._deadline_limits(limits, context),
                                    stdin, dict(request.env), cancel)
            finally:
                session.close()
        result = self._cut_short(result, context)
        if nonce is not None:
            result = judge_verdict(result, nonce)
        return self._finish("run", result, t0)

    def CreateSession(self, request: pb.CreateSessionRequest, context: grpc.ServicerContext):
        self._refuse_when_draining(context)
        self._call(context, rq.check_image, request.image)
        files, executable = self._call(context, rq.check_files, request.files)
        with self._lock:
            if len(self._sessions) >= self.max_sessions:
                self.metrics.rejections.labels("session_limit").inc()
                _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"the sandbox service already holds {self.max_sessions} sessions (--max-sessions); "
                       "close some first")
            # Reserve the place before the (possibly slow) creation so concurrent calls cannot overshoot.
            sid = uuid.uuid4().hex[:16]
            self._sessions[sid] = None  # type: ignore[assignment]
        try:
            session = self._call(context, self.backend.create_session, request.image, files)
            if executable:
                self._call(context, session.write_files, files, executable)
        except BaseException:
            with self._lock:
                self._sessions.pop(sid, None)
            raise
        now = time.monotonic()
        with self._lock:
            self._sessions[sid] = SessionInfo(session, created=now, last_used=now)
        self.metrics.active_sessions.set(len(self._sessions))
        return pb.CreateSessionResponse(session_id=sid, address=self.advertise_address)

    def Exec(self, request: pb.ExecRequest, context: grpc.ServicerContext) -> pb.ExecResult:
        t0 = time.perf_counter()
        self._call(context, rq.check_session_id, request.session_id)
        if not request.command:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "Exec needs a command")
        self._check_exec(request, context)
        limits = self._limits(request.limits, context)
        cancel = _cancel_event(context)
        with self._session(request.session_id, context) as info, self._slot(context):
            result = self._call(context, info.session.exec, list(request.command),
                                self._deadline_limits(limits, context), request.stdin, dict(request.env), cancel)
        return self._finish("exec", self._cut_short(result, context), t0)

    def WriteFiles(self, request: pb.WriteFilesRequest, context: grpc.ServicerContext):
        self._call(context, rq.check_session_id, request.session_id)
        files, executable = self._call(context, rq.check_files, request.files)
        with self._session(request.session_id, context) as info:
            self._call(context, info.session.write_files, files, executable)
        return pb.WriteFilesResponse()

    def ReadFiles(self, request: pb.ReadFilesRequest, context: grpc.ServicerContext):
        self._call(context, rq.check_session_id, request.session_id)
        max_bytes = self._call(context, rq.check_max_bytes, request.max_bytes, self.max_read_bytes)
        paths = self._call(context, rq.check_paths, request.paths)
        with self._session(request.session_id, context) as info:
            files = self._call(context, info.session.read_files, paths, max_bytes)
        return pb.ReadFilesResponse(files=files_to_pb(files))

    def CloseSession(self, request: pb.CloseSessionRequest, context: grpc.ServicerContext):
        self._call(context, rq.check_session_id, request.session_id)
        with self._lock:
            info = self._sessions.get(request.session_id)
            if info is not None:
                del self._sessions[request.session_id]
        if info is None:
            _abort(context, grpc.StatusCode.NOT_FOUND, f"no session {request.session_id!r} (closed or expired)")
        with info.lock:  # wait for a command still running in it
            info.session.close()
        self.metrics.active_sessions.set(len(self._sessions))
        return pb.CloseSessionResponse()

    # ---- lifecycle -----------------------------------------------------------------------------------------------

    def drain(self) -> None:
        """Take no new sessions or runs (UNAVAILABLE, so clients go to another replica); the open sessions go on."""
        self._draining.set()

    def wait_drained(self, timeout_s: float) -> str:
        """Wait until no command runs and no session is open, at most ``timeout_s``; "" when drained, else what is
        left (for the log)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                running, sessions = self._running, len(self._sessions)
            if not running and not sessions:
                return ""
            if time.monotonic() >= deadline:
                return f"{sessions} session(s) and {running} running command(s)"
            time.sleep(0.05)

    def close(self) -> None:
        """Close every session and the backend; commands still running are cut short (verdict ERROR)."""
        self._draining.set()
        self._closed.set()
        with self._lock:
            infos = [i for i in self._sessions.values() if i is not None]
            self._sessions.clear()
        for info in infos:
            with contextlib.suppress(Exception):
                info.session.close()
        self.metrics.active_sessions.set(0)
        self.backend.close()

    def session_count(self) -> int:
        """Open sessions (including ones being created)."""
        return len(self._sessions)

    # ---- helpers -------------------------------------------------------------------------------------------------

    def _limits(self, msg: pb.Limits, context: grpc.ServicerContext) -> Limits:
        asked = limits_from_pb(msg)
        self._call(context, rq.check_limits, asked, self.max_limits)
        return self.default_limits.merged(**asked)

    def _check_exec(self, request: pb.RunRequest | pb.ExecRequest, context: grpc.ServicerContext) -> None:
        """The fields of a command: its argv, environment and (Run) image, each named when malformed."""
        if request.command:
            self._call(context, rq.check_command, request.command)
        self._call(context, rq.check_env, request.env)
        if isinstance(request, pb.RunRequest):
            self._call(context, rq.check_image, request.image)

    @staticmethod
    def _deadline_limits(limits: Limits, context: grpc.ServicerContext) -> Limits:
        """The wall limit shortened to the caller's remaining deadline (checked again after queueing)."""
        remaining = context.time_remaining()
        if remaining is None or remaining - DEADLINE_MARGIN_S >= limits.wall_s:
            return limits
        if remaining <= DEADLINE_MARGIN_S:
            _abort(context, grpc.StatusCode.DEADLINE_EXCEEDED, "the caller's deadline passed before the command ran")
        return replace(limits, wall_s=remaining - DEADLINE_MARGIN_S)

    @contextlib.contextmanager
    def _slot(self, context: grpc.ServicerContext) -> Iterator[None]:
        """Hold one of the ``concurrency`` command slots; refuse when ``max_queue`` requests already wait."""
        got = self._slots.acquire(blocking=False)
        if not got:
            got = self._wait_for_slot(context)
        if not got:
            self.metrics.rejections.labels("deadline_in_queue").inc()
            _abort(context, grpc.StatusCode.DEADLINE_EXCEEDED,
                   "the deadline passed (or the call was cancelled) while waiting for a free sandbox slot")
        self.metrics.running.inc()
        with self._lock:
            self._running += 1
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1
            self._slots.release()
            self.metrics.running.dec()

    def _wait_for_slot(self, context: grpc.ServicerContext) -> bool:
        """Queue for a slot until one frees up, the deadline passes or the caller goes away."""
        with self._lock:
            if self._waiting >= self.max_queue:
                self.metrics.rejections.labels("queue_full").inc()
                _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"the sandbox service is saturated: {self.concurrency} commands running and "
                       f"{self._waiting} waiting (--max-queue {self.max_queue}); retry later")
            self._waiting += 1
        self.metrics.queued.inc()
        try:
            while context.is_active():
                remaining = context.time_remaining()
                if remaining is not None and remaining <= DEADLINE_MARGIN_S:
                    return False
                if self._slots.acquire(timeout=0.2 if remaining is None else min(0.2, remaining)):
                    return True
            return False
        finally:
            with self._lock:
                self._waiting -= 1
            self.metrics.queued.dec()

    @contextlib.contextmanager
    def _session(self, sid: str, context: grpc.ServicerContext) -> Iterator[SessionInfo]:
        info = self._sessions.get(sid)
        if info is None:
            _abort(context, grpc.StatusCode.NOT_FOUND, f"no session {sid!r} (closed, expired, or still being created)")
        with info.lock:
            if self._sessions.get(sid) is not info:
                _abort(context, grpc.StatusCode.NOT_FOUND, f"session {sid!r} was closed")
            info.last_used = time.monotonic()
            try:
                yield info
            finally:
                info.last_used = time.monotonic()

    def _refuse_when_draining(self, context: grpc.ServicerContext) -> None:
        if self._draining.is_set():
            self.metrics.rejections.labels("shutting_down").inc()
            _abort(context, grpc.StatusCode.UNAVAILABLE, "the sandbox service is shutting down and takes no new "
                   "sessions or runs; retry (another replica takes it)")

    def _cut_short(self, result: ExecResult, context: grpc.ServicerContext) -> ExecResult:
        """A command killed because the service shut down is the environment's failure, never the program's."""
        if result.verdict == Verdict.CANCELLED and self._closed.is_set() and context.is_active():
            return replace(result, verdict=Verdict.ERROR, detail="the sandbox service shut down before the command "
                           "finished (an environment error, not the program's)")
        return result

    def _call(self, context: grpc.ServicerContext, fn: Callable[..., T], *args) -> T:
        """Call the backend, turning its errors into gRPC statuses that name the problem."""
        try:
            return fn(*args)
        except SandboxError as e:
            code = getattr(grpc.StatusCode, e.code, grpc.StatusCode.INTERNAL)
            self.metrics.errors.labels(code.name).inc()
            _abort(context, code, str(e))
        except Exception as e:
            log.exception("sandbox backend failed")
            self.metrics.errors.labels("INTERNAL").inc()
            _abort(context, grpc.StatusCode.INTERNAL, f"sandbox backend error: {type(e).__name__}: {e}")

    def _finish(self, kind: str, result: ExecResult, t0: float) -> pb.ExecResult:
        self.metrics.commands.labels(kind, result.verdict.value).inc()
        self.metrics.latency.labels(kind).observe(time.perf_counter() - t0)
        return result_to_pb(result)

    def _reap_idle_sessions(self) -> None:
        while not self._closed.wait(min(10.0, self.session_idle_s / 4)):
            now = time.monotonic()
            with self._lock:
                idle = [sid for sid, i in self._sessions.items()
                        if i is not None and not i.lock.locked() and now - i.last_used > self.session_idle_s]
                infos = [self._sessions.pop(sid) for sid in idle]
            for sid, info in zip(idle, infos, strict=True):
                log.info("closing session %s after %.0f s idle", sid, now - info.last_used)
                with contextlib.suppress(Exception), info.lock:
                    info.session.close()
            if idle:
                self.metrics.active_sessions.set(len(self._sessions))


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str):
    """End the RPC with ``code`` (raises)."""
    context.abort(code, message)
    raise AssertionError("unreachable")  # context.abort always raises


def _cancel_event(context: grpc.ServicerContext):
    """An event set when the RPC ends early (client cancel or deadline), so the backend kills the command."""
    ev = CancelEvent()
    context.add_callback(ev.set)
    return ev


__all__ = ["MAX_LIMITS", "SandboxService", "Verdict"]
