"""Starting the sandbox service: pick a backend, bind a gRPC port, expose Prometheus metrics."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from sandbox import auth
from sandbox.backend import Backend, SandboxError
from sandbox.heap import HeapTrimmer
from sandbox.metrics import SandboxMetrics
from sandbox.options import SandboxOptions
from sandbox.proto import sandbox_pb2 as pb
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


class _Malformed:
    """A request whose bytes did not parse (invalid UTF-8 in a string field, or no protobuf at all)."""

    def __init__(self, error: str):
        self.error = error


def _lenient(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """A request deserializer that hands a parse failure to the handler (gRPC would answer INTERNAL itself)."""

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as e:
            return _Malformed(str(e))

    return deserialize


def _rpc_handlers(service: SandboxService, trimmer: HeapTrimmer) -> grpc.GenericRpcHandler:
    """The service's methods, with malformed requests refused as the caller's error and large calls followed by a
    heap trim."""
    desc = pb.DESCRIPTOR.services_by_name["Sandbox"]

    def wrap(method: Callable, request_type: str) -> Callable:
        def handle(request, context: grpc.ServicerContext):
            if isinstance(request, _Malformed):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a valid {request_type} message "
                              f"(string fields must be UTF-8): {request.error}")
            size = request.ByteSize()
            try:
                response = method(request, context)
                size += response.ByteSize()
                return response
            finally:
                trimmer.note(size)

        return handle

    handlers = {
        m.name: grpc.unary_unary_rpc_method_handler(
            wrap(getattr(service, m.name), m.input_type.name),
            request_deserializer=_lenient(getattr(pb, m.input_type.name).FromString),
            response_serializer=getattr(pb, m.output_type.name).SerializeToString)
        for m in desc.methods}
    return grpc.method_handlers_generic_handler(desc.full_name, handlers)


class SandboxServer:
    """A running sandbox service: ``address`` to connect to, ``stop()`` to shut it down (draining, then closing all
    sessions)."""

    def __init__(self, backend: Backend, options: SandboxOptions | None = None, *, session_idle_s: float = 1800.0,
                 token: str | None = None, **fields: Any):
        """``options``: host, port, concurrency, queue, sessions, default limits, metrics port, advertised address and
        drain time (the backend's keys are the backend's business); ``fields`` replace some of them, validated.
        Without ``options``, the defaults on port 0 (a free one) and no drain. ``token``: the bearer token every
        call must carry (None: ``RL_SANDBOX_TOKEN``, unset or empty = none)."""
        self.options = o = (options if options is not None else SandboxOptions(port=0, drain_s=0)).override(**fields)
        self.token = token if token is not None else auth.token_from_env()
        self.metrics = SandboxMetrics()
        self.service = SandboxService(backend, concurrency=o.concurrency, max_queue=o.max_queue,
                                      max_sessions=o.max_sessions, default_limits=o.limits.to_limits(),
                                      session_idle_s=session_idle_s, metrics=self.metrics,
                                      advertise_address=o.advertise_address or "")
        # One thread per running or queued call, plus a few for session calls that need no slot.
        workers = o.concurrency + o.max_queue + 16
        # grpc.so_reuseport off: with it (gRPC's default) a second service on a port already served binds as well
        # and the kernel splits the connections between the two
        self.trimmer = HeapTrimmer()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sandbox-rpc"),
                                   options=[*GRPC_OPTIONS, ("grpc.max_connection_age_ms", MAX_CONNECTION_AGE_MS),
                                            ("grpc.so_reuseport", 0)],
                                   interceptors=[auth.TokenInterceptor(self.token)] if self.token else None)
        self._server.add_generic_rpc_handlers((_rpc_handlers(self.service, self.trimmer),))
        try:
            self.port = self._server.add_insecure_port(f"{o.host}:{o.port}")
        except RuntimeError:  # newer grpcio raises where older ones returned 0
            self.port = 0
        if self.port == 0:
            self.service.close()
            self.trimmer.close()
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
        self._stopped = False
        log.info("sandbox service (%s backend) on %s", backend.name, self.address)
        if not self.token and not auth.is_loopback(o.host):
            log.warning("sandbox service listens on %s without authentication: any host that reaches it may run "
                        "code; set %s on the service and its clients", self.address, auth.TOKEN_ENV)

    def wait(self) -> None:
        """Block until the server stops."""
        self._server.wait_for_termination()

    def stop(self, grace_s: float = 1.0, drain_s: float | None = None) -> None:
        """Shut down: take no new sessions or runs, give the running commands and open sessions ``drain_s`` (None:
        the options' ``drain_s``) to finish, then cut what is left (a cut command's verdict is ERROR, an
        environment error) and close the backend; answers still in flight get ``grace_s``. Idempotent.

        A second stop signal during the drain (Ctrl-C, SIGTERM again) ends the drain early, never the clean-up."""
        if self._stopped:
            return
        self._stopped = True
        drain_s = self.options.drain_s if drain_s is None else drain_s
        self.service.drain()
        interrupted: BaseException | None = None
        try:
            left = self.service.wait_drained(drain_s)
            if left:
                log.warning("sandbox service: %s still open after the %g s drain; cutting them short", left, drain_s)
        except (KeyboardInterrupt, SystemExit) as e:
            interrupted = e
            log.warning("sandbox service: drain interrupted; cutting the open sessions short")
        self.service.close()  # cut commands return at once (ERROR), so their answers go out within grace_s
        self._server.stop(grace_s).wait()
        self.trimmer.close()
        if self.metrics_port is not None:
            self._metrics_server.shutdown()
        if interrupted is not None:
            raise interrupted

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
