"""Client of the sandbox service: one-shot runs and sessions, with gRPC errors turned into SandboxError."""

from __future__ import annotations

import atexit
import json
import logging
import threading
from collections.abc import Iterable

import grpc

from sandbox import auth
from sandbox.backend import ExecResult, Limits, SandboxError, Verdict
from sandbox.proto import sandbox_pb2 as pb
from sandbox.proto import sandbox_pb2_grpc as pb_grpc
from sandbox.server import GRPC_OPTIONS, MAX_MESSAGE_BYTES, SandboxServer, start_server
from sandbox.wire import files_from_pb, files_to_pb, limits_to_pb, result_from_pb

# Time beyond a command's wall limit allowed for sandbox set-up and queueing before the client gives up.
DEADLINE_SLACK_S = 120.0
# How long a one-shot run cut off by the service's death waits for a service to answer again before its one retry.
RECONNECT_S = 60.0

log = logging.getLogger(__name__)
_retried = [0]  # one-shot runs run once more by any client of this process
_retried_lock = threading.Lock()


def runs_retried() -> int:
    """One-shot runs that any client in this process ran once more after the sandbox infrastructure failed."""
    return _retried[0]


# One-shot runs spread over every address the name resolves to (the replicas behind a headless Service). A run or a
# new session refused as UNAVAILABLE (a replica shutting down, or gone) is tried once more, on the next replica:
# neither has anything on the replica that refused it.
ROUND_ROBIN = ("grpc.service_config", json.dumps({
    "loadBalancingConfig": [{"round_robin": {}}],
    "methodConfig": [{"name": [{"service": "rl.sandbox.v1.Sandbox", "method": m} for m in ("Run", "CreateSession")],
                      "retryPolicy": {"maxAttempts": 2, "initialBackoff": "0.2s", "maxBackoff": "1s",
                                      "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}]}))


class SandboxClient:
    """Talks to a sandbox service at ``address``: host:port, or any gRPC target naming several replicas
    (``dns:///sandbox.ns.svc:50051`` of a headless Service, ``ipv4:10.0.0.1:50051,10.0.0.2:50051``).

    Runs go round-robin over the replicas; a session's calls go to the replica that holds it. Every call carries
    ``token`` (None: ``RL_SANDBOX_TOKEN``; unset or empty: none) as ``authorization: Bearer <token>``."""

    def __init__(self, address: str, *, slack_s: float = DEADLINE_SLACK_S, token: str | None = None):
        self.address, self.slack_s = address, slack_s
        self.token = token if token is not None else auth.token_from_env()
        self._metadata = auth.call_metadata(self.token)
        # a restarted service is found within a second or two, not after gRPC's default backoff of up to 2 minutes
        self._channel = grpc.insecure_channel(address, options=[*GRPC_OPTIONS, ROUND_ROBIN,
                                                                ("grpc.initial_reconnect_backoff_ms", 200),
                                                                ("grpc.max_reconnect_backoff_ms", 2000)])
        self._stub = pb_grpc.SandboxStub(self._channel)
        self._replicas: dict[str, SandboxClient] = {}
        self._replicas_lock = threading.Lock()
        self.retries = 0  # one-shot runs run again after the sandbox or the service failed under them

    def run(self, command: list[str] | None = None, files: dict[str, bytes | str] | None = None, *,
            code: str = "", tests: str = "", limits: Limits | None = None, stdin: bytes = b"",
            env: dict[str, str] | None = None, image: str = "", executable: Iterable[str] = (),
            timeout_s: float | None = None) -> ExecResult:
        """Run one command (or ``code`` followed by ``tests`` as one Python program) in a fresh sandbox.

        A run the sandbox infrastructure cut off (the service died under it: UNAVAILABLE; or its sandbox was killed
        from outside or failed: verdict ERROR) is run once more, in a fresh sandbox, once a service answers again
        (within ``RECONNECT_S``): a fresh sandbox makes it safe, and the caller gets the program's own verdict.
        A second failure is returned (or raised) as it is: the caller's environment error, never a wrong answer."""
        req = pb.RunRequest(files=files_to_pb(files, frozenset(executable)), command=command or [], code=code,
                            tests=tests, limits=limits_to_pb(limits), stdin=stdin, env=env or {}, image=image)
        timeout = self._timeout(limits, timeout_s)
        try:
            result = result_from_pb(self._call(self._stub.Run, req, timeout))
        except SandboxError as e:
            if e.code != "UNAVAILABLE":
                raise
            why = str(e)
            self._await_service(why)
        else:
            if result.verdict is not Verdict.ERROR:
                return result
            why = result.detail
        self.retries += 1
        with _retried_lock:
            _retried[0] += 1
        log.warning("sandbox: a run was cut off (%s); running it once more", why)
        return result_from_pb(self._call(self._stub.Run, req, timeout))

    def _await_service(self, why: str) -> None:
        """Wait until the channel reaches a service again; SandboxError UNAVAILABLE after ``RECONNECT_S``."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=RECONNECT_S)
        except grpc.FutureTimeoutError:
            raise SandboxError(f"{why}; and no sandbox service answered for {RECONNECT_S:g} s after",
                               "UNAVAILABLE") from None

    def create_session(self, image: str = "", files: dict[str, bytes | str] | None = None,
                       executable: Iterable[str] = (), timeout_s: float | None = 600.0) -> RemoteSession:
        """Open a session (a private work directory, or a pod from ``image``) holding ``files``."""
        req = pb.CreateSessionRequest(image=image, files=files_to_pb(files, frozenset(executable)))
        resp = self._call(self._stub.CreateSession, req, timeout_s)
        return RemoteSession(self._replica(resp.address), resp.session_id)

    def _replica(self, address: str) -> SandboxClient:
        """The client of one replica (one channel each, reused), or this one when it names none."""
        if not address or address == self.address:
            return self
        with self._replicas_lock:
            if address not in self._replicas:
                self._replicas[address] = SandboxClient(address, slack_s=self.slack_s, token=self.token)
            return self._replicas[address]

    def close(self) -> None:
        """Close the channels."""
        for replica in self._replicas.values():
            replica.close()
        self._channel.close()

    def __enter__(self) -> SandboxClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _timeout(self, limits: Limits | None, timeout_s: float | None) -> float | None:
        if timeout_s is not None:
            return timeout_s
        return (limits.wall_s if limits and limits.wall_s else Limits().wall_s) + self.slack_s

    def _call(self, method, request, timeout_s: float | None):
        try:
            return method(request, timeout=timeout_s, metadata=self._metadata)
        except grpc.RpcError as e:
            details = e.details() or ""
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details:
                details += (f" (one request or answer may carry at most {MAX_MESSAGE_BYTES >> 20} MiB: send the files "
                            "in several calls)")
            raise SandboxError(f"sandbox service: {details}", e.code().name) from None


class RemoteSession:
    """A session on the service; close it (or use ``with``) to free its sandbox."""

    def __init__(self, client: SandboxClient, session_id: str):
        self.client, self.id = client, session_id
        self.closed = False

    def exec(self, command: list[str], *, limits: Limits | None = None, stdin: bytes = b"",
             env: dict[str, str] | None = None, timeout_s: float | None = None) -> ExecResult:
        """Run ``command`` in the session's work directory."""
        req = pb.ExecRequest(session_id=self.id, command=command, limits=limits_to_pb(limits), stdin=stdin,
                             env=env or {})
        c = self.client
        return result_from_pb(c._call(c._stub.Exec, req, c._timeout(limits, timeout_s)))

    def write_files(self, files: dict[str, bytes | str], executable: Iterable[str] = ()) -> None:
        """Create or replace files in the work directory."""
        req = pb.WriteFilesRequest(session_id=self.id, files=files_to_pb(files, frozenset(executable)))
        self.client._call(self.client._stub.WriteFiles, req, 300.0)

    def read_files(self, paths: list[str], max_bytes: int = 0) -> dict[str, bytes]:
        """Contents of files in the work directory (``max_bytes`` per file; 0 = the server's default)."""
        req = pb.ReadFilesRequest(session_id=self.id, paths=paths, max_bytes=max_bytes)
        return files_from_pb(self.client._call(self.client._stub.ReadFiles, req, 300.0).files)[0]

    def close(self) -> None:
        """Delete the session's sandbox (idempotent)."""
        if not self.closed:
            self.closed = True
            self.client._call(self.client._stub.CloseSession, pb.CloseSessionRequest(session_id=self.id), 300.0)

    def __enter__(self) -> RemoteSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_local: SandboxServer | None = None
_local_lock = threading.Lock()


def connect(address: str | None = None, *, concurrency: int = 8) -> SandboxClient:
    """A client of the service at ``address``; with None, of a local-backend service started once in this process."""
    global _local
    if address:
        return SandboxClient(address)
    with _local_lock:
        if _local is None:
            _local = start_server("local", concurrency=concurrency)
            atexit.register(_local.stop)
        return SandboxClient(_local.address)
