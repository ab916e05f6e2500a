"""Transport security for every memlm server and client: optional TLS and a bearer-token check.

- TLS: the server presents a key and certificate chain; with `client_ca` set it also requires a
  client certificate signed by that CA (mutual TLS). Without TLS the servers bind 127.0.0.1 by
  default, so plaintext traffic stays on the machine unless the user asks otherwise.
- Bearer token: every call must carry the metadata `authorization: Bearer <token>`, else it ends
  with UNAUTHENTICATED before the servicer runs. The token names the call's tenant (services.common.
  tenants: a shared token is the one tenant "default"); an rpc outside the tenant's list ends with
  PERMISSION_DENIED, a call past one of its quotas with RESOURCE_EXHAUSTED naming the quota. Health checks (`grpc.health.v1.Health`) stay
  open on purpose, so that load balancers and orchestrators can probe readiness without the
  secret; reflection is NOT open (it describes the API, which is the token holder's business).
  The token travels as plain metadata, so over a network use it together with TLS. A token is never
  empty (`check_token`): an empty string must not quietly mean "no authentication".
- Budgets: calls are counted in three separate budgets, so that callers without
  the token can never take a slot from those with it: token holders' calls (`max_calls`), health
  Watch streams (`max_open_calls`: the only open calls that can last), and the momentary open calls,
  health Checks and calls refused for a missing or wrong token (`max_open_calls` again, their own
  counter), so that held Watch streams can neither fail a readiness probe nor turn a refusal into
  anything but UNAUTHENTICATED, and a busy server still answers probes. A call past its budget ends
  with RESOURCE_EXHAUSTED naming the option that sets it.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.common.tenants import NOBODY, OPEN_TENANT, Tenant, Tenants, enter_tenant

# Methods a caller may reach without the token (see the module docstring for why).
OPEN_METHOD_PREFIXES: tuple[str, ...] = ("/grpc.health.v1.Health/",)
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
"""The readiness probe: counted apart from health Watch streams (which can be held forever)."""

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

    def __post_init__(self) -> None:
        if (self.certificate_chain is None) != (self.private_key is None):
            raise ValueError("a client certificate and its private key go together")

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


def check_token(token: str) -> str:
    """`token` if it can serve as a bearer token, else ValueError: non-empty (an empty token must never mean
    "no authentication"), printable ASCII without surrounding spaces (what a metadata value can carry)."""
    if not token:
        raise ValueError("the token is empty; leave it unset for no authentication")
    if token != token.strip() or not (token.isascii() and token.isprintable()):
        raise ValueError("the token must be printable ASCII without leading or trailing spaces")
    return token


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Per-call metadata carrying the bearer token; empty without a token (None; "" is refused).

    Sent as call metadata rather than grpc call credentials because grpc refuses call credentials
    on plaintext channels, and plaintext on 127.0.0.1 with a token is a supported setup.
    """
    return () if token is None else ((AUTHORIZATION_KEY, f"Bearer {check_token(token)}"),)


def _token_of(metadata) -> str | None:
    for key, value in metadata or ():
        if key == AUTHORIZATION_KEY:
            scheme, _, token = str(value).partition(" ")
            return token if scheme.lower() == "bearer" else None  # RFC 6750: scheme is case-insensitive
    return None


def _refusing_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str,
                      tenant: Tenant) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind as `handler` that ends the call with `code` for `tenant`.

    It never deserializes the request: a refused caller gets no work done on its bytes.
    """

    async def refuse(_request_or_iterator, context: grpc.aio.ServicerContext):
        enter_tenant(tenant)
        await context.abort(code, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


def _guarded(handler: grpc.RpcMethodHandler, enter: Callable[[grpc.aio.ServicerContext], Awaitable[None]],
             leave: Callable[[], None]) -> grpc.RpcMethodHandler:
    """`handler` with `await enter(context)` before its behaviour (it may abort the call) and `leave()` after
    it, when enter returned."""
    kinds = {(False, False): (grpc.unary_unary_rpc_method_handler, handler.unary_unary),
             (False, True): (grpc.unary_stream_rpc_method_handler, handler.unary_stream),
             (True, False): (grpc.stream_unary_rpc_method_handler, handler.stream_unary),
             (True, True): (grpc.stream_stream_rpc_method_handler, handler.stream_stream)}
    make, behaviour = kinds[handler.request_streaming, handler.response_streaming]
    # grpc.aio takes a streaming behaviour in two forms, an async generator (ours, reflection) or a
    # coroutine that calls context.write (health Watch); the wrapper keeps the form it was given.
    if inspect.isasyncgenfunction(behaviour):
        async def stream(request, context):
            await enter(context)
            try:
                async for response in behaviour(request, context):
                    yield response
            finally:
                leave()

        wrapped = stream
    else:
        async def call(request, context):
            await enter(context)
            try:
                return await behaviour(request, context)
            finally:
                leave()

        wrapped = call
    return make(wrapped, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


class _Budget:
    """Calls of one kind in progress at once, at most `limit`; past it a call ends with RESOURCE_EXHAUSTED.

    The counter lives on the server's event loop (every handler runs there), so it needs no lock.
    """

    def __init__(self, kind: str, limit: int, option: str) -> None:
        if limit < 1:
            raise ValueError(f"{option} must be at least 1, got {limit}")
        self.kind, self.limit, self.option = kind, limit, option
        self.in_flight = 0

    def admit(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """`handler` with its behaviour counted against this budget."""
        return _guarded(handler, self._enter, self._leave)

    async def _enter(self, context: grpc.aio.ServicerContext) -> None:
        if self.in_flight >= self.limit:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"server busy: {self.limit} {self.kind} in progress ({self.option})")
        self.in_flight += 1

    def _leave(self) -> None:
        self.in_flight -= 1


class TenantCalls:
    """Each tenant's calls in progress and its request rate, checked against its quotas as a call starts.

    Kept by tenant name, so the counts carry over when a reload replaces the table. The rate is a token
    bucket holding one second of calls (max_requests_per_second), refilled continuously. Lives on the
    server's event loop, like _Budget.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.in_flight: dict[str, int] = {}
        self._buckets: dict[str, tuple[float, float]] = {}  # name -> (calls left, clock() of that count)

    def admit(self, handler: grpc.RpcMethodHandler, tenant: Tenant) -> grpc.RpcMethodHandler:
        """`handler` run as `tenant`'s call: the tenant set for the call (services.common.tenants), then its quotas."""

        async def enter(context: grpc.aio.ServicerContext) -> None:
            enter_tenant(tenant)
            refusal = self.start(tenant)
            if refusal is not None:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)

        return _guarded(handler, enter, lambda: self.end(tenant))

    def start(self, tenant: Tenant) -> str | None:
        """Count a new call of `tenant`, or say which quota it would break (a message naming it; nothing counted)."""
        refusal = self.refusal(tenant)
        if refusal is None:
            self.in_flight[tenant.name] = self.in_flight.get(tenant.name, 0) + 1
        return refusal

    def end(self, tenant: Tenant) -> None:
        """A call that `start` counted has ended."""
        self.in_flight[tenant.name] -= 1

    def refusal(self, tenant: Tenant) -> str | None:
        """Which quota a new call of `tenant` would break (a message naming it), else None (its rate counted)."""
        q, name = tenant.quotas, tenant.name
        if q.max_concurrent_calls is not None and self.in_flight.get(name, 0) >= q.max_concurrent_calls:
            return f"tenant {name!r}: max_concurrent_calls {q.max_concurrent_calls} reached"
        if q.max_requests_per_second is not None:
            rate, now = q.max_requests_per_second, self._clock()
            room = max(rate, 1.0)  # a second of calls, and at least one (a rate below 1 still admits a call)
            left, since = self._buckets.get(name, (room, now))
            left = min(room, left + (now - since) * rate)
            if left < 1.0:
                self._buckets[name] = (left, now)
                return f"tenant {name!r}: max_requests_per_second {rate:g} reached"
            self._buckets[name] = (left - 1.0, now)
        return None


class AdmissionInterceptor(grpc.aio.ServerInterceptor):
    """Every call of a server passes here: its tenant from the bearer token, the tenant's rpcs and quotas, and
    the three budgets (module docstring).

    tenants: the server's table (services.common.tenants.Tenants; its table None = every caller is the open
    tenant). max_calls: admitted calls at once (--max-concurrent-rpcs). max_open_calls: health Watch streams
    at once, and, separately, health Checks and refused calls at once (--max-open-rpcs).
    """

    def __init__(self, tenants: Tenants, max_calls: int, max_open_calls: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.tenants = tenants
        self.tenant_calls = TenantCalls(clock)
        self._calls = _Budget("calls", max_calls, "--max-concurrent-rpcs")
        self._watches = _Budget("health watches", max_open_calls, "--max-open-rpcs")
        self._momentary = _Budget("health checks and refused calls", max_open_calls, "--max-open-rpcs")

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None:
            return None  # unknown methods get UNIMPLEMENTED at once
        if method == HEALTH_CHECK:
            return self._momentary.admit(handler)
        if method.startswith(OPEN_METHOD_PREFIXES):
            return self._watches.admit(handler)
        tenant, refusal = self._identify(handler_call_details.invocation_metadata)
        if refusal is not None:
            return self._momentary.admit(
                _refusing_handler(handler, grpc.StatusCode.UNAUTHENTICATED, refusal, NOBODY))
        if not tenant.allows(method):
            return self._momentary.admit(_refusing_handler(
                handler, grpc.StatusCode.PERMISSION_DENIED, f"tenant {tenant.name!r} may not call {method.lstrip('/')}",
                tenant))
        # The tenant's quotas first (they set the call's tenant), then the server's budget.
        return self.tenant_calls.admit(self._calls.admit(handler), tenant)

    def _identify(self, metadata) -> tuple[Tenant, str | None]:
        """The caller's tenant, and why its call may not proceed (None = it may)."""
        table = self.tenants.table
        if table is None:
            return OPEN_TENANT, None
        token = _token_of(metadata)
        if token is None:
            return NOBODY, "missing bearer token: send metadata 'authorization: Bearer <token>'"
        tenant = table.identify(token)  # constant-time over the digests of every tenant
        if tenant is None:
            return NOBODY, "wrong bearer token"
        return tenant, None
