"""A shared bearer token between the sandbox service and its clients (``RL_SANDBOX_TOKEN``).

When the variable is set, the service refuses every call that does not carry ``authorization: Bearer <token>``
(UNAUTHENTICATED, compared in constant time) and clients send it; unset, there is no authentication (a service on
loopback inside one run). The Helm chart puts the same Secret into the service's and the run's pods.
"""

from __future__ import annotations

import hmac
import ipaddress
import os

import grpc

TOKEN_ENV = "RL_SANDBOX_TOKEN"
_HEADER = "authorization"
_SCHEME = "Bearer "


def token_from_env() -> str | None:
    """The shared token, or None where the variable is unset or empty."""
    return os.environ.get(TOKEN_ENV) or None


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata a client sends with every call (none without a token)."""
    return ((_HEADER, _SCHEME + token),) if token else ()


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a listen address) is reachable only from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name other than localhost, or a wildcard such as 0.0.0.0 / ::


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses calls without the bearer ``token`` before their handler runs."""

    def __init__(self, token: str):
        self._expected = (_SCHEME + token).encode()

        def deny(request, context: grpc.ServicerContext):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"the sandbox service needs 'authorization: Bearer "
                          f"<token>' metadata with the token of {TOKEN_ENV}")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation, handler_call_details):
        got = dict(handler_call_details.invocation_metadata or ()).get(_HEADER, "")
        if isinstance(got, bytes):
            got = got.decode(errors="replace")
        if hmac.compare_digest(got.encode(), self._expected):
            return continuation(handler_call_details)
        return self._deny
