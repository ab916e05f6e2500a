"""Prometheus metrics and per-call logs of every memlm server, taken by one gRPC interceptor.

`start_server` puts a `CallInterceptor` in front of every other interceptor, so every call is seen, refused
ones (UNAUTHENTICATED, RESOURCE_EXHAUSTED) included: it counts calls by rpc, status code and tenant, times
each one to its end (a stream to its last message) into a histogram per rpc, hands responses to the
server's observers (the LM server counts tokens this way, with no code in its handlers) and, with
`--log-format json`, writes one JSON line per call. Each server owns a `ServerMetrics` with a registry of
its own (not prometheus_client's global one), so several servers in one process count apart; servers add
what only they know as gauges read at scrape time. `--metrics-port` serves the registry over HTTP
(prometheus_client.start_http_server), on loopback unless `--metrics-host` names another address.

Clients count their own calls the same way: `ClientCalls` (blocking channels) and `AsyncClientCalls`
(grpc.aio) are client interceptors that tell their observers (rpc, code, seconds) of every call on a channel;
`LinkMetrics` turns them, with the links' breaker states, into series (the LM server's retrieval link, the
router's shards).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.common.circuit import CLOSED, HALF_OPEN, OPEN
from services.common.tenants import DEFAULT_TENANT as DEFAULT_TENANT  # the label of a shared token's calls
from services.common.tenants import current_tenant_name


REQUEST_ID_KEY = "x-request-id"
"""Call metadata naming the request in the call log; a call without it gets a fresh id."""

LOG_FORMATS = ("text", "json")
"""--log-format: text = the servers' usual lines only; json = also one JSON line per call on stderr."""

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0)
"""Seconds: from a cached GetInfo (about a millisecond) to a long Generate stream (minutes)."""

READ_ATTEMPTS = 3
"""Reads of a gauge at scrape time before a changing dict's RuntimeError is let through."""


def tenant_of() -> str:
    """The `tenant` label of the call in progress, the one place that decides it: the name of the tenant the
    admission check found for it (services.common.tenants), NO_TENANT for a call refused before that, and
    DEFAULT_TENANT for a call no check has named (a health check, the HTTP front's requests)."""
    return current_tenant_name()


def request_id_of(metadata: Iterable[tuple[str, Any]] | None) -> str:
    """The caller's x-request-id (at most 128 characters of it), else a fresh random id."""
    for key, value in metadata or ():
        if key == REQUEST_ID_KEY and value:
            return str(value)[:128]
    return uuid.uuid4().hex


def rpc_name(method: str) -> str:
    """"/memlm.v1.RetrievalService/Search" -> "memlm.v1.RetrievalService/Search" (the `rpc` label)."""
    return method.lstrip("/")


@dataclass(frozen=True)
class MetricsOptions:
    """Where a server serves its metrics and how it logs calls (`serve ... --metrics-port/--log-format`)."""

    port: int | None = None
    """TCP port of the HTTP /metrics endpoint; None = not served (the counters are still kept); 0 = any free port."""
    host: str = "127.0.0.1"
    """Address the metrics endpoint binds: loopback unless named (metrics describe the traffic)."""
    log_format: str = "text"
    """"text": no line per call; "json": one JSON line per call on stderr (LOG_FORMATS)."""

    def __post_init__(self) -> None:
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}")
        if self.port is not None and not 0 <= self.port <= 65535:
            raise ValueError(f"metrics port must be in [0, 65535], got {self.port}")


class _CallbackGauge(Collector):
    """A gauge whose samples are read at scrape time: read() -> a value, or {label values: value}."""

    def __init__(self, name: str, documentation: str, labels: tuple[str, ...],
                 read: Callable[[], float | Mapping[tuple[str, ...], float]]) -> None:
        self._name, self._documentation, self._labels, self._read = name, documentation, labels, read

    def collect(self):
        family = GaugeMetricFamily(self._name, self._documentation, labels=self._labels)
        for attempt in range(READ_ATTEMPTS):
            try:  # read() may sum a dict that the server's loop changes meanwhile
                values = self._read()
                break
            except RuntimeError:
                if attempt == READ_ATTEMPTS - 1:
                    raise
        if not self._labels:
            values = {(): values}
        for label_values, value in values.items():
            family.add_metric(list(label_values), float(value))
        yield family


class ServerMetrics:
    """One server's registry: call counts and latencies (CallInterceptor) and what the server adds."""

    def __init__(self, log_format: str = "text", write_log: Callable[[str], None] | None = None) -> None:
        """log_format: MetricsOptions.log_format. write_log: where JSON call lines go (default: stderr)."""
        if log_format not in LOG_FORMATS:
            raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # the process' memory, CPU time and open files (Linux)
        self.calls = Counter("memlm_rpc_calls", "Calls ended, by rpc, gRPC status code and tenant",
                             ("rpc", "code", "tenant"), registry=self.registry)
        self.latency = Histogram("memlm_rpc_duration_seconds", "Seconds from a call's start to its end "
                                 "(a stream: to its last message), by rpc", ("rpc",), buckets=LATENCY_BUCKETS,
                                 registry=self.registry)
        self._log = (write_log or _write_stderr) if log_format == "json" else None
        self._observers: dict[str, list[Callable[[Any], None]]] = {}

    def counter(self, name: str, documentation: str, labels: tuple[str, ...] = ()) -> Counter:
        """A counter in this server's registry (exposed as NAME_total)."""
        return Counter(name, documentation, labels, registry=self.registry)

    def histogram(self, name: str, documentation: str, labels: tuple[str, ...] = (),
                  buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
        """A histogram in this server's registry."""
        return Histogram(name, documentation, labels, buckets=buckets, registry=self.registry)

    def gauge(self, name: str, documentation: str, read: Callable[[], float | Mapping[tuple[str, ...], float]],
              labels: tuple[str, ...] = ()) -> None:
        """A gauge read at scrape time: read() -> its value, or {label values: value} when it has labels.
        read runs on the metrics endpoint's thread: it reads counts, it takes no lock a step holds."""
        self.registry.register(_CallbackGauge(name, documentation, labels, read))

    def observe_responses(self, method: str, observe: Callable[[Any], None]) -> None:
        """Call observe(response) for every response message of `method` ("/package.Service/Rpc")."""
        self._observers.setdefault(method, []).append(observe)

    def observers(self, method: str) -> list[Callable[[Any], None]]:
        return self._observers.get(method, [])

    def record(self, method: str, code: grpc.StatusCode, seconds: float, tenant: str, request_id: str) -> None:
        """One ended call: counted, timed, and logged as a JSON line when asked."""
        rpc = rpc_name(method)
        self.calls.labels(rpc, code.name, tenant).inc()
        self.latency.labels(rpc).observe(seconds)
        self.log_call(request_id, tenant, rpc, code.name, seconds)

    def log_call(self, request_id: str, tenant: str, rpc: str, status: str, seconds: float) -> None:
        """The call's JSON line, when --log-format json asks (gRPC servers and the HTTP front alike)."""
        if self._log is not None:
            self._log(json.dumps({"request_id": request_id, "tenant": tenant, "rpc": rpc, "status": status,
                                  "duration_ms": round(seconds * 1000, 3)}))


def _write_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _ending_code(context: grpc.aio.ServicerContext, error: BaseException | None) -> grpc.StatusCode:
    """The status a call ended with: the one its handler set or aborted with, else OK, CANCELLED or UNKNOWN."""
    if isinstance(error, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    if isinstance(code, int):  # some grpc versions keep the number
        return next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
    return grpc.StatusCode.OK if error is None else grpc.StatusCode.UNKNOWN


class CallInterceptor(grpc.aio.ServerInterceptor):
    """Every call of a server: counted, timed to its end, its responses observed, logged (ServerMetrics)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None  # unknown methods: grpc answers UNIMPLEMENTED
        method = handler_call_details.method
        metadata = handler_call_details.invocation_metadata
        kinds = {(False, False): (grpc.unary_unary_rpc_method_handler, handler.unary_unary),
                 (False, True): (grpc.unary_stream_rpc_method_handler, handler.unary_stream),
                 (True, False): (grpc.stream_unary_rpc_method_handler, handler.stream_unary),
                 (True, True): (grpc.stream_stream_rpc_method_handler, handler.stream_stream)}
        make, behaviour = kinds[handler.request_streaming, handler.response_streaming]
        return make(self._measured(behaviour, method, metadata), request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)

    def _measured(self, behaviour: Callable, method: str, metadata) -> Callable:
        metrics = self._metrics
        observers = metrics.observers(method)

        def end(context, start: float, error: BaseException | None) -> None:
            metrics.record(method, _ending_code(context, error), time.perf_counter() - start, tenant_of(),
                           request_id_of(metadata))

        # grpc.aio takes a streaming behaviour as an async generator or as a coroutine that calls
        # context.write (health Watch); the wrapper keeps the form it was given.
        if inspect.isasyncgenfunction(behaviour):
            async def stream(request, context):
                start, error = time.perf_counter(), None
                try:
                    async for response in behaviour(request, context):
                        for observe in observers:
                            observe(response)
                        yield response
                except BaseException as e:
                    error = e
                    raise
                finally:
                    end(context, start, error)

            return stream

        async def call(request, context):
            start, error = time.perf_counter(), None
            try:
                response = await behaviour(request, context)
                for observe in observers:
                    observe(response)
                return response
            except BaseException as e:
                error = e
                raise
            finally:
                end(context, start, error)

        return call


@dataclass
class MetricsEndpoint:
    """The HTTP /metrics endpoint of a server (prometheus_client's WSGI server on its own thread)."""

    port: int
    """The bound port (the real one when MetricsOptions.port was 0)."""
    _httpd: Any
    _thread: threading.Thread

    def close(self) -> None:
        """Stop serving and release the port (blocks for up to the server's poll interval, half a second)."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()


def serve_metrics(metrics: ServerMetrics, host: str, port: int) -> MetricsEndpoint:
    """Serve `metrics` at http://HOST:PORT/metrics (port 0: any free port). OSError when it cannot bind."""
    httpd, thread = start_http_server(port, addr=host, registry=metrics.registry)
    return MetricsEndpoint(httpd.server_port, httpd, thread)


class _CallObservers:
    """Observers of a channel's calls: observe(rpc, code, seconds), added at any time (a server adds its own
    once its metrics exist); they only count, on whichever thread ends the call."""

    def __init__(self) -> None:
        self._observers: list[Callable[[str, grpc.StatusCode, float], None]] = []

    def add_observer(self, observe: Callable[[str, grpc.StatusCode, float], None]) -> None:
        self._observers.append(observe)

    def _tell(self, method: str | bytes, code: grpc.StatusCode | None, seconds: float) -> None:
        name = rpc_name(method.decode() if isinstance(method, bytes) else method)
        for observe in list(self._observers):
            observe(name, code if code is not None else grpc.StatusCode.UNKNOWN, seconds)


class ClientCalls(_CallObservers, grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """A blocking channel's interceptor that tells its observers of every call when it ends."""

    def _watch(self, method: str, call: Any, start: float) -> Any:
        if self._observers:
            call.add_done_callback(lambda done: self._tell(method, done.code(), time.perf_counter() - start))
        return call

    def intercept_unary_unary(self, continuation, client_call_details, request):
        start = time.perf_counter()
        return self._watch(client_call_details.method, continuation(client_call_details, request), start)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        start = time.perf_counter()
        return self._watch(client_call_details.method, continuation(client_call_details, request), start)


class AsyncClientCalls(_CallObservers, grpc.aio.UnaryUnaryClientInterceptor):
    """A grpc.aio channel's interceptor (the router's shard links) that tells its observers of every unary call:
    it awaits the call's outcome (the caller's await then gets the same answer) and reports a cancelled one
    (a hedge that lost) as CANCELLED."""

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        start = time.perf_counter()
        call = await continuation(client_call_details, request)
        code = grpc.StatusCode.UNKNOWN
        try:
            await call
            code = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as e:
            code = e.code()
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            self._tell(client_call_details.method, code, time.perf_counter() - start)
        return call


BREAKER_STATES = (CLOSED, HALF_OPEN, OPEN)
"""The `state` label's values of memlm_retrieval_breaker_state (services.common.circuit)."""


class LinkMetrics:
    """A server's series of its calls to other servers (retrieval, memory sessions, shards): calls by target,
    rpc and code, their latency, and each target's circuit-breaker state (1 for the state it is in, else 0)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.calls = metrics.counter("memlm_retrieval_calls", "Calls this server made to a retrieval, memory or "
                                     "shard server, by target address, rpc and gRPC status code",
                                     ("target", "rpc", "code"))
        self.latency = metrics.histogram("memlm_retrieval_call_duration_seconds", "Seconds of this server's calls "
                                         "to a retrieval, memory or shard server, by target address and rpc",
                                         ("target", "rpc"))
        self._breakers: dict[str, Callable[[], str]] = {}
        self._lock = threading.Lock()
        metrics.gauge("memlm_retrieval_breaker_state", "Circuit breaker of each link: 1 for its state "
                      "(closed: calls pass, half-open: one trial call, open: calls refused at once), else 0",
                      self._breaker_samples, ("target", "state"))

    def record(self, target: str, rpc: str, code: grpc.StatusCode, seconds: float) -> None:
        self.calls.labels(target, rpc, code.name).inc()
        self.latency.labels(target, rpc).observe(seconds)

    def watch(self, target: str, calls: _CallObservers | None = None,
              breaker_state: Callable[[], str] | None = None) -> None:
        """Count the calls a channel's ClientCalls or AsyncClientCalls sees, and report its breaker's state
        (breaker_state() -> services.common.circuit's CLOSED, HALF_OPEN or OPEN), under `target`."""
        if calls is not None:
            calls.add_observer(lambda rpc, code, seconds: self.record(target, rpc, code, seconds))
        if breaker_state is not None:
            with self._lock:
                self._breakers[target] = breaker_state

    def _breaker_samples(self) -> dict[tuple[str, str], float]:
        with self._lock:
            breakers = dict(self._breakers)
        out = {}
        for target, state in breakers.items():
            now = state()
            out.update({(target, s): float(s == now) for s in BREAKER_STATES})
        return out


class HttpMetrics:
    """The HTTP front's series in a ServerMetrics: requests by route, HTTP status and tenant, and their latency
    (a streamed response: to its last byte). `HttpCallMetrics` (ASGI middleware) feeds them."""

    def __init__(self, metrics: ServerMetrics, routes: Iterable[str]) -> None:
        """routes: the paths counted by name; any other path counts as "other" (the label stays bounded)."""
        self.metrics = metrics
        self.routes = frozenset(routes)
        self.requests = metrics.counter("memlm_http_requests", "HTTP requests answered, by route, HTTP status and "
                                        "tenant", ("route", "status", "tenant"))
        self.latency = metrics.histogram("memlm_http_request_duration_seconds", "Seconds from a request's start "
                                         "to its response's last byte, by route", ("route",))

    def record(self, method: str, path: str, status: int, seconds: float, headers: list[tuple[str, str]]) -> None:
        route = f"{method} {path if path in self.routes else 'other'}"
        tenant = tenant_of()
        self.requests.labels(route, str(status), tenant).inc()
        self.latency.labels(route).observe(seconds)
        self.metrics.log_call(request_id_of(headers), tenant, route, str(status), seconds)


class HttpCallMetrics:
    """ASGI middleware: every HTTP request counted, timed to its response's end and logged (HttpMetrics).

    A request whose handler raises before it answers counts as 500, the status the server then sends.
    """

    def __init__(self, app: Callable, http: HttpMetrics) -> None:
        self._app, self._http = app, http

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        start, status = time.perf_counter(), [500]

        async def sending(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self._app(scope, receive, sending)
        finally:
            headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope.get("headers", ())]
            self._http.record(scope["method"], scope["path"], status[0], time.perf_counter() - start, headers)
