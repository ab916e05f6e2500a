"""Transport security for every memlm server and client: optional TLS and a bearer-token check.

- TLS: the server presents a key and certificate chain; with `client_ca` set it also requires a
  client certificate signed by that CA (mutual TLS). Without TLS the servers bind 127.0.0.1 by
  default, so plaintext traffic stays on the machine unless the user asks otherwise.
- Bearer token: every call must carry the metadata `authorization: Bearer <token>`, else it ends
  with UNAUTHENTICATED before the servicer runs. Health checks (`grpc.health.v1.Health`) stay
  open on purpose, so that load balancers and orchestrators can probe readiness without the
  secret; reflection is NOT open (it describes the API, which is the token holder's business).
  The token travels as plain metadata, so over a network use it together with TLS.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path

import grpc

# Methods a caller may reach without the token (see the module docstring for why).
OPEN_METHOD_PREFIXES: tuple[str, ...] = ("/grpc.health.v1.Health/",)

AUTHORIZATION_KEY = "authorization"  # gRPC metadata keys are lower-case


@dataclass(frozen=True)
class ServerTls:
    """What a server needs to speak TLS. All values are PEM-encoded bytes."""

    certificate_chain: bytes
    """The server's certificate, followed by any intermediate certificates."""
    private_key: bytes
    """The private key of the first certificate in `certificate_chain`."""
    client_ca: bytes | None = None
    """When set, clients must present a certificate signed by this CA (mutual TLS)."""

    @classmethod
    def from_files(cls, cert: Path | str, key: Path | str, client_ca: Path | str | None = None) -> ServerTls:
        """Read the PEM files given on a command line."""
        return cls(
            certificate_chain=Path(cert).read_bytes(),
            private_key=Path(key).read_bytes(),
            client_ca=Path(client_ca).read_bytes() if client_ca is not None else None,
        )


@dataclass(frozen=True)
class ClientTls:
    """What a client needs to reach a TLS server. All values are PEM-encoded bytes."""

    root_ca: bytes | None = None
    """CA that signed the server's certificate; None = the system's trusted roots."""
    certificate_chain: bytes | None = None
    """Client certificate for mutual TLS; None = no client certificate."""
    private_key: bytes | None = None
    """Private key of `certificate_chain`."""
    server_name: str | None = None
    """Name to check the server certificate against when it differs from the dialled host."""

    @classmethod
    def from_files(
        cls,
        root_ca: Path | str | None = None,
        cert: Path | str | None = None,
        key: Path | str | None = None,
        server_name: str | None = None,
    ) -> ClientTls:
        """Read the PEM files given on a command line."""

        def read(p: Path | str | None) -> bytes | None:
            return Path(p).read_bytes() if p is not None else None

        return cls(read(root_ca), read(cert), read(key), server_name)


def server_credentials(tls: ServerTls) -> grpc.ServerCredentials:
    """grpc credentials for `server.add_secure_port`."""
    return grpc.ssl_server_credentials(
        [(tls.private_key, tls.certificate_chain)],
        root_certificates=tls.client_ca,
        require_client_auth=tls.client_ca is not None,
    )


def channel_credentials(tls: ClientTls) -> grpc.ChannelCredentials:
    """grpc credentials for `grpc.secure_channel` / `grpc.aio.secure_channel`."""
    return grpc.ssl_channel_credentials(
        root_certificates=tls.root_ca,
        private_key=tls.private_key,
        certificate_chain=tls.certificate_chain,
    )


def channel_tls_options(tls: ClientTls | None) -> list[tuple[str, str]]:
    """Channel options that go with `tls` (the server-name override), for any channel."""
    if tls is None or tls.server_name is None:
        return []
    return [("grpc.ssl_target_name_override", tls.server_name)]


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Per-call metadata carrying the bearer token; empty without a token.

    Sent as call metadata rather than grpc call credentials because grpc refuses call credentials
    on plaintext channels, and plaintext on 127.0.0.1 with a token is a supported setup.
    """
    return ((AUTHORIZATION_KEY, f"Bearer {token}"),) if token else ()


def _token_of(metadata) -> str | None:
    for key, value in metadata or ():
        if key == AUTHORIZATION_KEY:
            scheme, _, token = str(value).partition(" ")
            return token if scheme.lower() == "bearer" else None  # RFC 6750: scheme is case-insensitive
    return None


def _refusing_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as `handler` that ends the call with UNAUTHENTICATED.

    It never deserializes the request: an unauthenticated caller gets no work done on its bytes.
    """

    async def refuse(_request_or_iterator, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Ends every call without `authorization: Bearer <token>` with UNAUTHENTICATED.

    Calls to OPEN_METHOD_PREFIXES (health checks) pass without a token.
    """

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("token must be a non-empty string")
        self._token = token.encode()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler  # unknown methods still get UNIMPLEMENTED
        token = _token_of(handler_call_details.invocation_metadata)
        if token is None:
            return _refusing_handler(handler, "missing bearer token: send metadata 'authorization: Bearer <token>'")
        # Constant-time comparison, so response timing does not leak how much of the token matched.
        if not hmac.compare_digest(token.encode(), self._token):
            return _refusing_handler(handler, "wrong bearer token")
        return handler
