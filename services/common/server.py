"""What every memlm gRPC server shares: construction, limits, health, reflection, errors, shutdown.

A server is built in two steps so that tests and the command line use the same code:
`start_server(address, services, options)` binds (port 0 picks a free port), registers the
servicers with health (NOT_SERVING until the caller marks it ready) and reflection, counts and times
every call (services.common.metrics; /metrics over HTTP with options.metrics.port), and starts
serving; `run_until_signal(...)` prints `listening on HOST:PORT`, re-reads an auth file on SIGHUP and, on
SIGTERM or SIGINT, turns health to NOT_SERVING, refuses new calls and lets in-flight ones finish within a
grace period.

Servicers raise `InvalidRequest` (or `tensors.TensorError`) for bad input; `add_service` turns these
into INVALID_ARGUMENT / OUT_OF_RANGE statuses whose message names the field, and answers a request
whose bytes do not even parse with INVALID_ARGUMENT instead of grpc's INTERNAL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import ipaddress
import signal
import sys
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import grpc
from google.protobuf import message as pb_message
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from memlm.errors import MemlmError
from services.common.metrics import (
    CallInterceptor,
    ClientCalls,
    MetricsEndpoint,
    MetricsOptions,
    ServerMetrics,
    serve_metrics,
)
from services.common.security import (
    AdmissionInterceptor,
    ClientTls,
    ServerTls,
    auth_metadata,
    channel_credentials,
    channel_tls_options,
    check_token,
    server_credentials,
)
from services.common.tenants import AuthFileError, Tenants
from services.common.tensors import TensorError

DEFAULT_MAX_MESSAGE_BYTES = 64 * 2**20
"""64 MiB: a (1024, 1024) Search response (16 MiB) fits with room; grpc's own default is 4 MiB."""

DEFAULT_HOST = "127.0.0.1"
"""Bind the loopback interface unless the user names another host (secure by default)."""

TASKS_END_S = 2.0
"""At exit, how long run_until_signal waits for grpc's tasks of cancelled calls to end (they take milliseconds)."""

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(frozen=True)
class ServerOptions:
    """Limits and security shared by every memlm server."""

    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    """Largest message the server receives or sends, in bytes."""
    max_concurrent_rpcs: int = 64
    """Token holders' calls in progress at once (every call but health when there is no token);
    RESOURCE_EXHAUSTED past it. Health checks and calls without the token never count here."""
    max_open_rpcs: int = 16
    """Health Watch streams in progress at once, and, counted apart, health Checks and calls refused for a
    missing or wrong token at once (services.common.security: the budgets); RESOURCE_EXHAUSTED past it."""
    grace_s: float = 30.0
    """On shutdown, seconds in-flight calls get to finish before they are cancelled."""
    tls: ServerTls | None = None
    """Serve TLS with these credentials; None = plaintext."""
    token: str | None = None
    """Require `authorization: Bearer <token>` on every call except health checks; None = open. Never ""
    (ValueError): an empty token must not quietly switch authentication off. One tenant, "default"."""
    auth_file: Path | None = None
    """Tenants from this auth file instead of one token (services.common.tenants), re-read on SIGHUP."""
    metrics: MetricsOptions = MetricsOptions()
    """The /metrics endpoint (off unless a port is given) and the call log's format (services.common.metrics)."""

    def __post_init__(self) -> None:
        if self.token is not None:
            check_token(self.token)
            if self.auth_file is not None:
                raise ValueError("give a token or an auth file, not both")
        for name in ("max_concurrent_rpcs", "max_open_rpcs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    def exposure_warning(self, host: str) -> str | None:
        """One line when binding `host` exposes the server: a non-loopback address without TLS (traffic and
        token readable on the network) or without authentication (a token or client certificates); else None."""
        if is_loopback(host):
            return None
        missing = []
        if self.tls is None:
            missing.append("TLS (--tls-cert/--tls-key)")
        if self.token is None and self.auth_file is None and (self.tls is None or self.tls.client_ca is None):
            missing.append("authentication (--auth-file, --token-file, $MEMLM_TOKEN or --tls-client-ca)")
        if not missing:
            return None
        return f"warning: serving on {host or 'every interface'} without {' or '.join(missing)}: anyone who can reach it can use it"


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine only: localhost, 127.0.0.0/8 or ::1 (0.0.0.0 and :: are every interface)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Message-size limits for a server or a channel; both ends must raise grpc's 4 MiB default."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def open_channel(
    address: str, tls: ClientTls | None, max_message_bytes: int, *, asynchronous: bool = False,
    interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
) -> grpc.Channel | grpc.aio.Channel:
    """The one channel setup of every memlm client (LM client, retrieval client, the router's shard links):
    message limits raised on both ends, TLS (with its server-name override) or plaintext.

    asynchronous: a grpc.aio channel (for code on an event loop, the router) instead of a blocking one, with
    `interceptors` (services.common.metrics.AsyncClientCalls: its calls counted).
    """
    options = channel_options(max_message_bytes) + channel_tls_options(tls)
    if asynchronous:
        if tls is None:
            return grpc.aio.insecure_channel(address, options=options, interceptors=list(interceptors))
        return grpc.aio.secure_channel(address, channel_credentials(tls), options=options,
                                       interceptors=list(interceptors))
    if interceptors:
        raise ValueError("interceptors are for asynchronous channels (a blocking one is wrapped by its client)")
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, channel_credentials(tls), options=options)


class ServiceClient:
    """What every memlm client shares: one channel (`open_channel`), the bearer token on every call, a
    per-call deadline, and grpc errors raised as ServiceError. Subclasses add their stub and methods.

    address: "HOST:PORT". tls: None = plaintext. token: bearer token, if the server wants one.
    timeout: seconds allowed per call; None = no deadline. wait_for_ready: True = calls wait (within the
    timeout) for a server that is still starting; False = an unreachable server fails at once (UNAVAILABLE).
    """

    def __init__(self, address: str, tls: ClientTls | None, token: str | None, timeout: float | None,
                 max_message_bytes: int, wait_for_ready: bool) -> None:
        self.address = address
        self.timeout = timeout
        self._wait_for_ready = wait_for_ready
        self._metadata = auth_metadata(token)
        self._max_message_bytes = max_message_bytes
        self.calls = ClientCalls()
        """Observers of every call on the channel (a server counts its link's calls: services.common.metrics)."""
        self._channel = grpc.intercept_channel(open_channel(address, tls, max_message_bytes), self.calls)

    def _call_options(self) -> dict:
        """Keyword arguments of every stub call: deadline, token, wait_for_ready."""
        return {"timeout": self.timeout, "metadata": self._metadata, "wait_for_ready": self._wait_for_ready}

    def _call(self, method: Callable, request: pb_message.Message):
        """A unary call; grpc errors become ServiceError (code and details kept)."""
        try:
            return method(request, **self._call_options())
        except grpc.RpcError as e:
            raise ServiceError(self.address, e.code(), e.details() or "") from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InvalidRequest(Exception):
    """Bad input from a caller; becomes a gRPC status whose message starts with the field name."""

    def __init__(self, field: str, message: str, code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.code = code


class ServiceError(MemlmError):
    """A call to a memlm server failed; client classes raise this instead of grpc.RpcError.

    It is a MemlmError, so the command line prints it as one line (e.g. a server that is down).
    """

    def __init__(self, address: str, code: grpc.StatusCode, details: str):
        super().__init__(f"{address}: {code.name}: {details}")
        self.address = address
        self.code = code
        self.details = details


# ---------------------------------------------------------------------------------------------
# Servicer registration with safe deserialization and field-naming errors


class _Malformed:
    """Stands in for a request whose bytes are not a valid message of the expected type."""

    def __init__(self, type_name: str, error: str):
        self.message = f"request: not a valid {type_name}: {error}"


def _safe_parser(message_class: type[pb_message.Message]) -> Callable[[bytes], object]:
    def parse(data: bytes) -> object:
        try:
            return message_class.FromString(data)
        except pb_message.DecodeError as e:
            return _Malformed(message_class.DESCRIPTOR.full_name, str(e))

    return parse


def _wrap_unary(method: Callable) -> Callable:
    @functools.wraps(method)
    async def call(request, context: grpc.aio.ServicerContext):
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            return await method(request, context)
        except InvalidRequest as e:
            await context.abort(e.code, str(e))
        except TensorError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    return call


def _wrap_server_streaming(method: Callable) -> Callable:
    @functools.wraps(method)
    async def call(request, context: grpc.aio.ServicerContext):
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            async for response in method(request, context):
                yield response
        except InvalidRequest as e:
            await context.abort(e.code, str(e))
        except TensorError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    return call


def add_service(
    server: grpc.aio.Server,
    service: ServiceDescriptor,
    servicer: object,
    message_classes: dict[str, type[pb_message.Message]],
) -> None:
    """Register `servicer` (async methods named like the rpcs) for `service`.

    Unary and server-streaming rpcs only (all memlm rpcs are). `message_classes` maps a message's
    full name to its generated class (see `message_classes_of`). Unlike the generated
    `add_*Servicer_to_server`, undecodable request bytes get INVALID_ARGUMENT, and InvalidRequest /
    TensorError become statuses naming the field.
    """
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for m in service.methods:
        behaviour = getattr(servicer, m.name)
        parse = _safe_parser(message_classes[m.input_type.full_name])
        serialize = message_classes[m.output_type.full_name].SerializeToString
        if m.client_streaming:
            raise NotImplementedError(f"{m.full_name}: client streaming is not used by memlm")
        if m.server_streaming:
            handlers[m.name] = grpc.unary_stream_rpc_method_handler(
                _wrap_server_streaming(behaviour), request_deserializer=parse, response_serializer=serialize
            )
        else:
            handlers[m.name] = grpc.unary_unary_rpc_method_handler(
                _wrap_unary(behaviour), request_deserializer=parse, response_serializer=serialize
            )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))


def message_classes_of(*modules) -> dict[str, type[pb_message.Message]]:
    """{full message name: class} for the generated `*_pb2` modules given."""
    out: dict[str, type[pb_message.Message]] = {}
    for module in modules:
        for name in module.DESCRIPTOR.message_types_by_name:
            cls = getattr(module, name)
            out[cls.DESCRIPTOR.full_name] = cls
    return out


# ---------------------------------------------------------------------------------------------
# Construction and lifecycle


@dataclass(frozen=True)
class RunningServer:
    """A started server, its bound port, and the health servicer that says whether it is ready."""

    server: grpc.aio.Server
    """The grpc.aio server (already started)."""
    port: int
    """The bound TCP port (the real one when the address asked for port 0)."""
    health: health.aio.HealthServicer
    """Health servicer; `mark_serving` flips the services and the overall status ("")."""
    service_names: tuple[str, ...]
    """Full names of the memlm services registered, e.g. ("memlm.v1.RetrievalService",)."""
    metrics: ServerMetrics = dataclasses.field(default_factory=ServerMetrics)
    """The server's registry: call counts and latencies, and the gauges its servicers add."""
    metrics_endpoint: MetricsEndpoint | None = None
    """The HTTP /metrics endpoint (ServerOptions.metrics.port); None when not served."""
    tenants: Tenants = dataclasses.field(default_factory=lambda: Tenants(None))
    """Who may call (ServerOptions.token or .auth_file); `reload_tenants` re-reads the auth file."""

    def reload_tenants(self) -> None:
        """Re-read the auth file (SIGHUP): calls in progress keep their tenant, new ones meet the new table;
        a bad file keeps the old table. One line on stderr says which."""
        print(f"memlm: {self.tenants.reload()}", file=sys.stderr, flush=True)

    async def mark_serving(self, serving: bool = True) -> None:
        """Report SERVING (or NOT_SERVING) for every service and for the server as a whole."""
        status = SERVING if serving else NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)


async def start_server(
    address: str,
    services: Sequence[tuple[ServiceDescriptor, object]],
    message_classes: dict[str, type[pb_message.Message]],
    options: ServerOptions,
) -> RunningServer:
    """Build, bind and start a grpc.aio server for `services`; health stays NOT_SERVING.

    address: "HOST:PORT"; port 0 picks a free port (tests). Raises MemlmError when the address
    cannot be bound. Prints options.exposure_warning (one line on stderr) for an exposed bind.
    """
    # No grpc-wide maximum_concurrent_rpcs: it counts health checks and callers without the token against
    # the token holders' slots; the interceptor's budgets keep them apart.
    try:
        tenants = Tenants.from_settings(options.token, options.auth_file)
    except AuthFileError as e:
        raise MemlmError(str(e)) from None
    admission = AdmissionInterceptor(tenants, options.max_concurrent_rpcs, options.max_open_rpcs)
    metrics = ServerMetrics(options.metrics.log_format)
    # The metrics interceptor first: it sees the calls admission refuses too.
    server = grpc.aio.server(options=channel_options(options.max_message_bytes),
                             interceptors=[CallInterceptor(metrics), admission])
    names = []
    for descriptor, servicer in services:
        add_service(server, descriptor, servicer, message_classes)
        names.append(descriptor.full_name)
    health_servicer = health.aio.HealthServicer()
    for name in ("", *names):
        await health_servicer.set(name, NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    try:
        if options.tls is not None:
            port = server.add_secure_port(address, server_credentials(options.tls))
        else:
            port = server.add_insecure_port(address)
    except RuntimeError as e:  # grpc raises RuntimeError("Failed to bind ...")
        raise MemlmError(f"cannot listen on {address}: {e}") from None
    if port == 0:
        raise MemlmError(f"cannot listen on {address}: address in use or not local")
    warning = options.exposure_warning(split_host_port(address)[0])
    if warning is not None:
        print(f"memlm: {warning}", file=sys.stderr, flush=True)
    try:
        endpoint = open_metrics_endpoint(metrics, options.metrics)
    except MemlmError:
        await server.stop(None)
        raise
    await server.start()
    if endpoint is not None:
        close_when_stopped(server, lambda: asyncio.to_thread(endpoint.close))
    return RunningServer(server, port, health_servicer, tuple(names), metrics, endpoint, tenants)


def open_metrics_endpoint(metrics: ServerMetrics, options: MetricsOptions) -> MetricsEndpoint | None:
    """Serve `metrics` at options.host:options.port (None when no port is given) and say where on stderr, with a
    warning beyond loopback; MemlmError when the port cannot be bound. Every server's (the HTTP front's too)."""
    if options.port is None:
        return None
    try:
        endpoint = serve_metrics(metrics, options.host, options.port)
    except OSError as e:
        raise MemlmError(f"cannot serve metrics on {join_host_port(options.host, options.port)}: {e}") from None
    print(f"metrics on http://{join_host_port(options.host, endpoint.port)}/metrics", file=sys.stderr, flush=True)
    if not is_loopback(options.host):
        print(f"memlm: warning: metrics on {options.host or 'every interface'} without TLS or a token: "
              "anyone who can reach it reads the server's traffic figures", file=sys.stderr, flush=True)
    return endpoint


_WATCHERS: set[asyncio.Task] = set()
"""Tasks of close_when_stopped, held so that they are not garbage-collected while they wait."""


def close_when_stopped(server: grpc.aio.Server, cleanup: Callable[[], Awaitable[None]]) -> None:
    """Await `cleanup()` once `server` has stopped, however it was stopped (`server.stop`, SIGTERM): release
    worker threads and channels with the server. Call from the server's event loop."""

    async def watch() -> None:
        try:
            await server.wait_for_termination()
        finally:
            await cleanup()

    task = asyncio.get_running_loop().create_task(watch())
    _WATCHERS.add(task)
    task.add_done_callback(_WATCHERS.discard)


def split_host_port(address: str) -> tuple[str, int]:
    """"127.0.0.1:50051" -> ("127.0.0.1", 50051); "[::1]:0" -> ("::1", 0)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise MemlmError(f"address {address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def join_host_port(host: str, port: int) -> str:
    """Inverse of split_host_port (brackets IPv6 literals)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def run_until_signal(
    running: RunningServer,
    host: str,
    *,
    grace_s: float,
    on_stopped: Callable[[], None] | None = None,
    signals: Iterable[signal.Signals] = (signal.SIGTERM, signal.SIGINT),
) -> None:
    """Mark `running` SERVING, print `listening on HOST:PORT` (one flushed line), wait for a signal,
    then shut down gracefully: health NOT_SERVING, new calls refused, in-flight calls drained for
    up to grace_s seconds, then cancelled (`serve ... --grace`). `on_stopped` runs after the server has
    stopped (release resources); then grpc's leftover tasks get up to TASKS_END_S to end, so the caller's
    asyncio.run closes a quiet loop and the process exits 0 without a traceback."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    installed = []
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
        installed.append(sig)
    if running.tenants.path is not None:
        loop.add_signal_handler(signal.SIGHUP, running.reload_tenants)
        installed.append(signal.SIGHUP)
    try:
        await running.mark_serving()
        print(f"listening on {join_host_port(host, running.port)}", flush=True)
        await stop.wait()
        # Tell probes first, so load balancers stop routing here while the drain runs.
        await running.health.enter_graceful_shutdown()
        await running.server.stop(grace_s)  # refuses new calls, waits for in-flight ones
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        if on_stopped is not None:
            on_stopped()
    # grpc's own tasks of the calls the drain cancelled end a moment after the server stops; a loop closed
    # under them prints a CancelledError traceback for each. Give them a bounded moment.
    others = asyncio.all_tasks() - {asyncio.current_task()}
    if others:
        await asyncio.wait(others, timeout=TASKS_END_S)
    print("stopped", file=sys.stderr, flush=True)
