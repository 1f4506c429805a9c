"""Starting the sandbox service: pick a backend, bind a gRPC port, expose Prometheus metrics."""

from __future__ import annotations

import logging
from concurrent import futures
from typing import Any

import grpc

from sandbox.backend import Backend, SandboxError
from sandbox.metrics import SandboxMetrics
from sandbox.options import SandboxOptions
from sandbox.proto import sandbox_pb2_grpc as pb_grpc
from sandbox.service import SandboxService

log = logging.getLogger(__name__)
BACKENDS = ("local", "kubernetes")
# Files of a whole repository travel in one message; gRPC's default cap is 4 MiB.
MAX_MESSAGE_BYTES = 256 << 20
GRPC_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
# Clients reconnect (and re-resolve the service's name) this often, so replicas an autoscaler adds get
# traffic; calls in flight are never cut (no grace limit).
MAX_CONNECTION_AGE_MS = 60_000


def build_backend(name: str, **options: Any) -> Backend:
    """The backend called ``name`` ("local" or "kubernetes"), built with its keyword arguments (``options=``: its
    ``LocalOptions`` or ``KubernetesOptions``)."""
    if name == "local":
        from sandbox.local import LocalBackend

        return LocalBackend(**options)
    if name == "kubernetes":
        from sandbox.kubernetes import KubernetesBackend

        return KubernetesBackend(**options)
    raise SandboxError(f"unknown sandbox backend {name!r}; choose one of {', '.join(BACKENDS)}", "INVALID_ARGUMENT")


class SandboxServer:
    """A running sandbox service: ``address`` to connect to, ``stop()`` to shut it down (closing all sessions)."""

    def __init__(self, backend: Backend, options: SandboxOptions | None = None, *, session_idle_s: float = 1800.0,
                 **fields: Any):
        """``options``: host, port, concurrency, queue, sessions, default limits, metrics port and advertised address
        (the backend's keys are the backend's business); ``fields`` replace some of them, validated. Without
        ``options``, the defaults on port 0 (a free one)."""
        self.options = o = (options if options is not None else SandboxOptions(port=0)).override(**fields)
        self.metrics = SandboxMetrics()
        self.service = SandboxService(backend, concurrency=o.concurrency, max_queue=o.max_queue,
                                      max_sessions=o.max_sessions, default_limits=o.limits.to_limits(),
                                      session_idle_s=session_idle_s, metrics=self.metrics,
                                      advertise_address=o.advertise_address or "")
        # One thread per running or queued call, plus a few for session calls that need no slot.
        workers = o.concurrency + o.max_queue + 16
        # grpc.so_reuseport off: with it (gRPC's default) a second service on a port already served binds as well
        # and the kernel splits the connections between the two
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox-rpc"),
                                   options=[*GRPC_OPTIONS, ("grpc.max_connection_age_ms", MAX_CONNECTION_AGE_MS),
                                            ("grpc.so_reuseport", 0)])
        pb_grpc.add_SandboxServicer_to_server(self.service, self._server)
        try:
            self.port = self._server.add_insecure_port(f"{o.host}:{o.port}")
        except RuntimeError:  # newer grpcio raises where older ones returned 0
            self.port = 0
        if self.port == 0:
            self.service.close()
            raise SandboxError(f"cannot bind the sandbox service to {o.host}:{o.port}: the port is in use (or the "
                               "address is not this machine's)", "UNAVAILABLE")
        self.address = f"{o.host}:{self.port}"
        self.metrics_port = None
        if o.metrics_port is not None:
            from prometheus_client import start_http_server

            server, _ = start_http_server(o.metrics_port, registry=self.metrics.registry)
            self._metrics_server = server
            self.metrics_port = server.server_port
        self._server.start()
        log.info("sandbox service (%s backend) on %s", backend.name, self.address)

    def wait(self) -> None:
        """Block until the server stops."""
        self._server.wait_for_termination()

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving (running calls get ``grace_s``), then close every session and the backend."""
        self._server.stop(grace_s).wait()
        self.service.close()
        if self.metrics_port is not None:
            self._metrics_server.shutdown()

    def __enter__(self) -> SandboxServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_server(backend: str | Backend = "local", backend_options: dict[str, Any] | None = None,
                 **server_options: Any) -> SandboxServer:
    """Start a sandbox service in this process (port 0 picks a free port); see SandboxServer for the options."""
    if isinstance(backend, str):
        backend = build_backend(backend, **(backend_options or {}))
    return SandboxServer(backend, **server_options)


def server_from_config(options: SandboxOptions) -> SandboxServer:
    """Start the service a run config's ``sandbox`` section describes; it and its backend get their options as is."""
    return SandboxServer(build_backend(options.backend, options=options.backend_options), options)
