"""An OpenAI-compatible HTTP front for the LM service: `memlm serve openai --lm ADDRESS`.

Where users already are: every OpenAI client, lm-evaluation-harness' `local-completions` model, and tools
written against vLLM/TGI/llama.cpp servers speak the completions API. This front translates it to the gRPC
LanguageModelService (services.lm.client); it holds no model.

Endpoints (JSON bodies; errors are OpenAI-shaped: {"error": {"message", "type", "param", "code"}}, 4xx for
the caller's mistakes, 502/503 when the LM service fails or is down):
- POST /v1/completions: prompt (a string, a list of strings, a list of token ids, or a list of those),
  max_tokens (default 16; 0 only with echo), temperature, top_p, seed, stop (a string or a list),
  logprobs (0..5: the top-n alternatives per token), echo, stream (server-sent events, then
  `data: [DONE]`), n (1 only). echo + max_tokens 0 + logprobs is scoring, as lm-eval's local-completions
  asks: the LM service's Score over the prompt; every prompt token gets its log-probability (the first
  one too: memlm conditions it on the document-boundary token, where OpenAI's servers give null).
  Generated tokens' top_logprobs hold the chosen token only (Generate reports no alternatives).
  memlm's extra body fields (the OpenAI client sends them with `extra_body=`):
    "top_k": int;
    "knn": {"lambda": float, "temperature": float, "k": int, "nprobe": int} turns kNN-LM on (each field
        optional: the LM server's defaults; {} = kNN-LM with all defaults);
    "memory": {"mode": "none"|"xl"|"compressive"|"memorizing"|"spalm", "segment_tokens", "memory_tokens",
        "sink_tokens", "knn_mem_size", "knn_top_k"} (services.lm.client.MemoryRequest).
- GET /v1/models: the one model the LM service serves (its GetInfo name, or --model-name).
- GET /health: 200 {"status": "ok"} when the LM service answers GetInfo, else 503.

Bearer token: the front checks `Authorization: Bearer TOKEN` (--token/--token-file/$MEMLM_TOKEN); /health
needs none, as the gRPC health service. The link to the LM service has credentials of its own (TLS, a client
certificate, a token: `ClientTls` and the LM client's token), by default the callers' token sent on.

HTTP is starlette on uvicorn's h11 protocol (`FrontProtocol`), with `HttpOptions`: TLS, a connection limit
(503 past it), a deadline for a request's headers and one for its body (408), an idle keep-alive timeout,
and a body limit checked on Content-Length before anything is read and again on the bytes as they arrive
(413). Malformed HTTP is a 400 and every refusal an OpenAI-shaped JSON error. SIGTERM/SIGINT: stop
accepting, let in-flight requests finish for HttpOptions.grace_s (`serve_openai`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import signal
import socket
import ssl
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import grpc
import h11
import uvicorn
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from memlm.errors import MemlmError
from services.common.metrics import HttpCallMetrics, HttpMetrics, MetricsOptions, ServerMetrics
from services.common.security import ClientTls, ServerTls, TenantCalls
from services.common.server import ServerOptions, ServiceError, join_host_port, open_metrics_endpoint
from services.common.tenants import NOBODY, Tenant, TenantTable, Tenants, enter_tenant
from services.lm.client import Finish, LanguageModelClient, TextDelta
from services.openai_front.requests import ApiError, Completion, FrontLimits, decode_json, parse_completion

FINISH = {"length": "length", "stop": "stop", "eos": "stop"}
"""Generate's finish reasons as OpenAI's (end of text is "stop" there)."""
GRPC_HTTP = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400,
             grpc.StatusCode.OUT_OF_RANGE: 400, grpc.StatusCode.UNIMPLEMENTED: 400,
             grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.PERMISSION_DENIED: 403,
             grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503,
             grpc.StatusCode.DEADLINE_EXCEEDED: 504}
"""HTTP status of an LM service error (others: 502)."""


# -- answering ----------------------------------------------------------------------------------------


def _logprobs_block(tokens: list[str], logprobs: list[float], tops: list[dict[str, float]], start: int) -> dict:
    """OpenAI's logprobs object; text offsets count from `start` characters into the choice's text."""
    offsets, at = [], start
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def _prompt_scores(client: LanguageModelClient, c: Completion) -> tuple[str, dict | None, int]:
    """The prompt's text, its logprobs block (echo with logprobs; else None) and its length in tokens."""
    if c.logprobs is None and isinstance(c.prompt, str) and c.max_tokens > 0:
        return c.prompt, None, -1  # echo without logprobs: only the text, the count comes from Generate
    result = client.score([c.prompt], knn=c.knn, top_n=c.logprobs or 0, memory_mode=c.memory_mode,
                          memory=c.memory)[0]
    text = c.prompt if isinstance(c.prompt, str) else "".join(t.text for t in result.tokens)
    tokens = [t.text for t in result.tokens]
    block = _logprobs_block(tokens, [t.logprob for t in result.tokens],
                            [{a.text: a.logprob for a in t.alternatives} for t in result.tokens], 0)
    return text, block if c.logprobs is not None else None, len(result.tokens)


def _events(client: LanguageModelClient, c: Completion) -> Iterator[TextDelta | Finish]:
    return client.generate(c.prompt, max_new_tokens=c.max_tokens, temperature=c.temperature, top_k=c.top_k,
                           top_p=c.top_p, seed=c.seed, stop=c.stop, knn=c.knn, memory_mode=c.memory_mode,
                           memory=c.memory)


def _delta_logprobs(d: TextDelta) -> tuple[list[str], list[float], list[dict[str, float]]]:
    # A delta's text covers all of its tokens; it goes to the first (Generate sends no per-token text).
    texts = [d.text] + [""] * (len(d.token_ids) - 1)
    return texts, list(d.logprobs), [{t: lp} for t, lp in zip(texts, d.logprobs)]


def complete(client: LanguageModelClient, c: Completion, index: int) -> tuple[dict[str, Any], int, int]:
    """One choice of a non-streamed completion, with its prompt and completion token counts."""
    text, block, prompt_tokens = ("", None, -1)
    if c.echo:
        text, block, prompt_tokens = _prompt_scores(client, c)
    if c.max_tokens == 0:
        return {"text": text, "index": index, "logprobs": block, "finish_reason": "length"}, prompt_tokens, 0
    tokens, lps, tops, finish = [], [], [], None
    for e in _events(client, c):
        if isinstance(e, TextDelta):
            text += e.text
            t, lp, top = _delta_logprobs(e)
            tokens, lps, tops = tokens + t, lps + lp, tops + top
        else:
            finish = e
    assert finish is not None, "Generate ends with a Finish"
    if finish.reason == "stop" and finish.stop_sequence and text.endswith(finish.stop_sequence):
        text = text[: len(text) - len(finish.stop_sequence)]  # OpenAI's text ends before the stop sequence
    if c.logprobs is not None:
        start = len(text) - sum(len(t) for t in tokens)
        gen = _logprobs_block(tokens, lps, tops, start)
        block = gen if block is None else {k: block[k] + gen[k] for k in gen}
    choice = {"text": text, "index": index, "logprobs": block, "finish_reason": FINISH.get(finish.reason, "stop")}
    return choice, finish.prompt_tokens, finish.completion_tokens


def completion_body(name: str, choices: list[dict], prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": name, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def stream_chunks(client: LanguageModelClient, name: str, completions: list[Completion]) -> Iterator[dict]:
    """The chunks of a streamed completion: per prompt, the echoed prompt (echo), each delta, then a chunk
    with its finish_reason."""
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(index: int, text: str, logprobs: dict | None, finish: str | None) -> dict:
        return {"id": cid, "object": "text_completion", "created": created, "model": name,
                "choices": [{"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}]}

    for i, c in enumerate(completions):
        if c.echo:
            text, block, _ = _prompt_scores(client, c)
            yield chunk(i, text, block, None)
        # Text that may be the start of a stop sequence is held back until the next delta says it is not
        # (OpenAI's text ends before the stop sequence; the LM service's includes it).
        hold, held = max((len(x) for x in c.stop), default=0), ""
        for e in _events(client, c):
            if isinstance(e, TextDelta):
                held += e.text
                out, held = held[: max(0, len(held) - hold)], held[max(0, len(held) - hold):]
                t, lp, top = _delta_logprobs(e)
                yield chunk(i, out, None if c.logprobs is None else _logprobs_block(t, lp, top, 0), None)
            else:
                if e.reason == "stop" and e.stop_sequence and held.endswith(e.stop_sequence):
                    held = held[: len(held) - len(e.stop_sequence)]
                yield chunk(i, held, None, FINISH.get(e.reason, "stop"))


def service_error(e: ServiceError) -> ApiError:
    status = GRPC_HTTP.get(e.code, 502)
    kind = "invalid_request_error" if status < 500 else "api_error"
    return ApiError(status, f"LM service: {e.code.name}: {e.details}", kind=kind, code=e.code.name.lower())


# -- HTTP ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FrontTls:
    """The front's own TLS, as PEM files (uvicorn's ssl options read files)."""

    cert: Path
    """Certificate chain the front presents."""
    key: Path
    """Private key of `cert`."""
    client_ca: Path | None = None
    """When set, callers must present a certificate signed by this CA (mutual TLS)."""


@dataclass(frozen=True)
class HttpOptions:
    """How the front holds HTTP connections: TLS, how many at once, and how long each may make it wait."""

    tls: FrontTls | None = None
    """Serve HTTPS with these files; None = plain HTTP."""
    max_connections: int = 128
    """Open connections served at once; a request on one more gets 503 (uvicorn's limit_concurrency)."""
    header_timeout_s: float = 10.0
    """Seconds a connection has to send a request's headers, from its opening or its last response."""
    body_timeout_s: float = 30.0
    """Seconds a request has to send its whole body after its headers; 408 beyond."""
    keep_alive_timeout_s: float = 5.0
    """Seconds an idle keep-alive connection stays open between requests."""
    max_header_bytes: int = 16 << 10
    """Largest request line and headers h11 holds while waiting for their end; 400 beyond."""
    grace_s: float = 30.0
    """On shutdown, seconds in-flight requests get to finish before they are cancelled."""

    def __post_init__(self) -> None:
        for name in ("max_connections", "max_header_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s"):
            if not 0 < getattr(self, name) < float("inf"):
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {getattr(self, name)}")
        if not 0 <= self.grace_s < float("inf"):
            raise ValueError(f"grace_s must be a finite number of seconds >= 0, got {self.grace_s}")


@dataclass(frozen=True)
class Front:
    """What every request shares: the LM client, the served model's name, the token, the limits."""

    client: LanguageModelClient
    """The LM service (thread-safe: requests call it from the thread pool)."""
    model_name: str
    """The one model id /v1/models lists and requests may name."""
    token: str | None
    """The bearer token callers must send; None = no authentication."""
    limits: FrontLimits
    """What one request may ask (services.openai_front.requests)."""
    tenants: Tenants | None = None
    """The callers' tenants (an auth file, services.common.tenants) in place of `token`; None = `token` decides."""


def _error(e: ApiError) -> JSONResponse:
    # A refusal before the body was read ends the connection: what is left of the body is never parsed.
    return JSONResponse(e.body(), e.status, headers={"connection": "close"} if e.close else None)


_LM_RPC = "/memlm.v1.LanguageModelService/"
ROUTE_RPCS = {"/v1/models": (_LM_RPC + "GetInfo",), "/v1/completions": (_LM_RPC + "Generate", _LM_RPC + "Score")}
"""The LM rpcs behind each route: a tenant may use a route when its rpcs allow one of them."""


def _check_token(front: Front, request: Request) -> None:
    if front.tenants is not None or front.token is None:
        return  # tenants: TenantAdmission admitted the request
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {front.token}".encode()):
        raise ApiError(401, "missing or wrong bearer token (Authorization: Bearer TOKEN)",
                       kind="invalid_request_error", code="invalid_api_key", close=True)  # its body is never read


def _check_tenant(table: TenantTable, request: Request) -> Tenant:
    """The caller's tenant, set for the request (its metrics label), else 401; 403 for a route its rpcs exclude."""
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    tenant = table.identify(given) if scheme.lower() == "bearer" else None  # constant-time over every tenant
    if tenant is None:
        enter_tenant(NOBODY)
        raise ApiError(401, "missing or wrong bearer token (Authorization: Bearer TOKEN)",
                       kind="invalid_request_error", code="invalid_api_key", close=True)
    enter_tenant(tenant)
    if not any(tenant.allows(rpc) for rpc in ROUTE_RPCS[request.url.path]):
        raise ApiError(403, f"tenant {tenant.name!r} may not call {request.url.path}", kind="permission_error",
                       code="permission_denied", close=True)
    return tenant


class TenantAdmission:
    """ASGI middleware of a front with tenants: every /v1 request's tenant (401 without one), its route's rpcs
    (403) and the tenant's max_concurrent_calls and max_requests_per_second (429 naming the quota), a request
    held until its response's last byte (a stream's too)."""

    def __init__(self, app: Callable, tenants: Tenants) -> None:
        self._app, self._tenants = app, tenants
        self._calls = TenantCalls()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        table = self._tenants.table  # one table for the whole request, whatever a reload does meanwhile
        if scope["type"] != "http" or table is None or scope["path"] not in ROUTE_RPCS:
            await self._app(scope, receive, send)
            return
        try:
            tenant = _check_tenant(table, Request(scope))
            refusal = self._calls.start(tenant)
            if refusal is not None:
                raise ApiError(429, refusal, kind="rate_limit_exceeded", code="quota_exceeded", close=True)
        except ApiError as e:
            await _error(e)(scope, receive, send)
            return
        try:
            await self._app(scope, receive, send)
        finally:
            self._calls.end(tenant)


async def read_body(request: Request, limits: FrontLimits, timeout_s: float) -> bytes:
    """The request's body, at most limits.max_body_bytes: refused on its Content-Length before a byte is read,
    and cut off as soon as a body without one (chunked) grows past the limit (413); 408 past `timeout_s`."""
    limit = limits.max_body_bytes
    declared = request.headers.get("content-length")  # h11 has checked it is one decimal number
    if declared is None and "transfer-encoding" not in request.headers:
        raise ApiError(411, "a Content-Length header (or a chunked body) is required", close=True)
    if declared is not None and int(declared) > limit:
        raise ApiError(413, f"request body of {declared} bytes, at most {limit}", close=True)
    chunks, size = [], 0
    try:
        with anyio.fail_after(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, f"request body of more than {limit} bytes, at most {limit}", close=True)
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s", close=True) from None
    except ClientDisconnect:
        raise ApiError(400, "the caller closed the connection before its body ended", close=True) from None
    return b"".join(chunks)


async def health(request: Request) -> Response:
    front: Front = request.app.state.front
    try:
        await run_in_threadpool(front.client.info)
    except ServiceError as e:
        raise ApiError(503, f"LM service unavailable: {e}", kind="api_error") from None
    return JSONResponse({"status": "ok"})


def model_entry(name: str, info: Any) -> dict[str, Any]:
    """/v1/models' entry of the served model: OpenAI's fields, and the weight format and compute dtype the LM
    service's GetInfo reports (`info`), so that a caller sees which format answers."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "memlm", "weights": info.weights,
            "compute_dtype": info.compute_dtype}


async def models(request: Request) -> Response:
    front: Front = request.app.state.front
    _check_token(front, request)
    try:
        info = await run_in_threadpool(front.client.info)
    except ServiceError as e:
        raise ApiError(503, f"LM service unavailable: {e}", kind="api_error") from None
    return JSONResponse({"object": "list", "data": [model_entry(front.model_name, info)]})


def _complete_all(front: Front, completions: list[Completion]) -> dict[str, Any]:
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for i, c in enumerate(completions):
        choice, p, n = complete(front.client, c, i)
        choices.append(choice)
        prompt_tokens, completion_tokens = prompt_tokens + max(p, 0), completion_tokens + n
    return completion_body(front.model_name, choices, prompt_tokens, completion_tokens)


async def completions(request: Request) -> Response:
    front: Front = request.app.state.front
    _check_token(front, request)
    body = await run_in_threadpool(decode_json, await read_body(request, front.limits, request.app.state.body_timeout_s))
    model = body.get("model") if isinstance(body, dict) else None
    if isinstance(model, str) and model != front.model_name:
        raise ApiError(404, f"model {model[:64]!r} is not served here; this front serves {front.model_name!r}",
                       "model", code="model_not_found")
    parsed, stream = parse_completion(body, front.limits)
    if not stream:
        return JSONResponse(await run_in_threadpool(_complete_all, front, parsed))
    chunks = stream_chunks(front.client, front.model_name, parsed)
    try:
        first = await run_in_threadpool(next, chunks, None)  # errors before the first event are a plain JSON error
    except BaseException:
        chunks.close()
        raise
    return StreamingResponse(_sse(chunks, first), media_type="text/event-stream",
                             headers={"cache-control": "no-cache"})


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


async def _sse(chunks: Iterator[dict], first: dict | None) -> AsyncIterator[bytes]:
    """Server-sent events of a stream's chunks, then `data: [DONE]`. Each chunk is drawn in the thread pool
    (the LM client is synchronous); closing `chunks` when the caller leaves cancels its Generate."""
    try:
        chunk = first
        while chunk is not None:
            yield _event(chunk)
            chunk = await run_in_threadpool(next, chunks, None)
    except (ServiceError, MemlmError) as e:  # mid-stream: OpenAI's servers send the error object as an event
        yield _event((service_error(e) if isinstance(e, ServiceError) else ApiError(400, str(e))).body())
    finally:
        chunks.close()  # never while a draw runs: a thread-pool call shields its task until it returns
    yield b"data: [DONE]\n\n"


async def _api_error(request: Request, e: Exception) -> Response:
    assert isinstance(e, ApiError)
    return _error(e)


async def _service_error(request: Request, e: Exception) -> Response:
    assert isinstance(e, ServiceError)
    return _error(service_error(e))


async def _memlm_error(request: Request, e: Exception) -> Response:
    return _error(ApiError(400, str(e)))  # the client library refusing an argument before any call


async def _http_error(request: Request, e: Exception) -> Response:
    assert isinstance(e, HTTPException)
    if e.status_code == 404:
        return _error(ApiError(404, f"no such endpoint: {request.method} {request.url.path} (memlm serves "
                               "POST /v1/completions, GET /v1/models, GET /health)", code="not_found"))
    return _error(ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}"))


async def _internal_error(request: Request, e: Exception) -> Response:
    return _error(ApiError(500, f"internal error: {type(e).__name__}", kind="api_error"))


def create_app(front: Front, options: HttpOptions | None = None, metrics: ServerMetrics | None = None) -> Starlette:
    """The front's ASGI application (served by `start_front`); options: its body timeout and connection limit;
    metrics: the registry its requests are counted, timed and logged in (services.common.metrics); None: not."""
    options = options or HttpOptions()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # Every served connection may have one LM call in the thread pool; anyio's default pool holds 40.
        limiter = anyio.to_thread.current_default_thread_limiter()
        limiter.total_tokens = max(limiter.total_tokens, options.max_connections)
        yield

    routes = [Route("/health", health, methods=["GET"]), Route("/v1/models", models, methods=["GET"]),
              Route("/v1/completions", completions, methods=["POST"])]
    app = Starlette(
        routes=routes,
        exception_handlers={ApiError: _api_error, ServiceError: _service_error, MemlmError: _memlm_error,
                            HTTPException: _http_error, Exception: _internal_error},
        lifespan=lifespan,
        middleware=([] if metrics is None else [
            Middleware(HttpCallMetrics, http=HttpMetrics(metrics, (r.path for r in routes)))]) + (
            [] if front.tenants is None else [Middleware(TenantAdmission, tenants=front.tenants)]),
    )
    app.state.front, app.state.body_timeout_s = front, options.body_timeout_s
    return app


class FrontProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for request headers and JSON for malformed HTTP.

    uvicorn arms its idle timer only after a response, so a connection that sends nothing, or trickles its
    headers, would hold its place under the connection limit for ever; here it has `header_timeout_s` from
    its opening, or from its last response, to send a request's headers. Idle connections end at once
    (`_drop`). Subclassed per server by `start_front`, which sets header_timeout_s.
    """

    header_timeout_s: float = HttpOptions.header_timeout_s

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[arg-type]
        self._await_headers()

    def on_response_complete(self) -> None:
        self._await_headers()
        super().on_response_complete()

    def _await_headers(self) -> None:
        # The request cycle in place now: a request whose headers arrive replaces it, and the timer does nothing.
        self.loop.call_later(self.header_timeout_s, self._headers_due, self.cycle)

    def _headers_due(self, cycle: object) -> None:
        if self.cycle is cycle and not self.transport.is_closing():
            self._drop()

    def timeout_keep_alive_handler(self) -> None:
        if not self.transport.is_closing():
            self._drop()

    def shutdown(self) -> None:
        if self.cycle is None or self.cycle.response_complete:
            self._drop()  # idle, or done and closing: nothing is left to send
        else:
            super().shutdown()  # the response in flight ends the connection when it is complete

    def _drop(self) -> None:
        """End an idle connection at once. Aborted, not closed: closing TLS waits for the peer's close_notify
        (up to asyncio's 30 s ssl_shutdown_timeout), holding a place under the connection limit and the drain."""
        with contextlib.suppress(h11.LocalProtocolError):
            self.conn.send(h11.ConnectionClosed())
        self.transport.abort()

    def send_400_response(self, msg: str) -> None:
        body = json.dumps(ApiError(400, f"malformed HTTP request: {msg}").body()).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


class RunningFront:
    """A front serving on a thread of its own (from `start_front`): its address, and `stop()`."""

    def __init__(self, server: uvicorn.Server, sock: socket.socket, on_stopped: Callable[[], None] | None) -> None:
        self.host, self.port = sock.getsockname()[:2]
        self._server, self._on_stopped = server, on_stopped
        self.failure: BaseException | None = None
        """What ended the server when it stopped by itself (SystemExit when uvicorn could not start)."""
        self._thread = threading.Thread(target=self._run, args=(sock,), name="openai-front", daemon=True)
        self._thread.start()

    def _run(self, sock: socket.socket) -> None:
        try:
            self._server.run(sockets=[sock])  # not the main thread: uvicorn leaves the signals alone
        except BaseException as e:  # noqa: BLE001 - uvicorn ends a failed start with sys.exit
            self.failure = e
        finally:
            sock.close()
            if self._on_stopped is not None:
                self._on_stopped()

    def stop(self) -> None:
        """Stop accepting, let in-flight requests finish (HttpOptions.grace_s), and return once stopped."""
        self._server.should_exit = True
        self._thread.join()

    def __enter__(self) -> RunningFront:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _bind(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        raise MemlmError(f"cannot listen on {join_host_port(host, port)}: {e.strerror or e}") from None
    sock.listen(2048)  # connections queue from now on, before the server's loop is up
    return sock


def start_front(front: Front, host: str = "127.0.0.1", port: int = 0, options: HttpOptions | None = None,
                on_stopped: Callable[[], None] | None = None, metrics: ServerMetrics | None = None) -> RunningFront:
    """Serve `front` on host:port (port 0: any free port, RunningFront.port) on a thread of its own;
    `on_stopped` is called on that thread once the server has stopped, however it stopped. metrics: where
    its requests are counted (create_app).

    Bad TLS files and an address in use raise here, before anything serves.
    """
    options = options or HttpOptions()
    tls = options.tls
    protocol = type("FrontProtocol", (FrontProtocol,), {"header_timeout_s": options.header_timeout_s})
    config = uvicorn.Config(
        create_app(front, options, metrics), http=protocol, loop="asyncio", lifespan="on", ws="none",
        interface="asgi3", log_config=None, access_log=False, server_header=False,
        # uvicorn answers 503 once the open connections, this one included, reach limit_concurrency.
        limit_concurrency=options.max_connections + 1, timeout_keep_alive=options.keep_alive_timeout_s,
        h11_max_incomplete_event_size=options.max_header_bytes,
        timeout_graceful_shutdown=options.grace_s,  # type: ignore[arg-type]
        ssl_certfile=None if tls is None else str(tls.cert), ssl_keyfile=None if tls is None else str(tls.key),
        ssl_ca_certs=None if tls is None or tls.client_ca is None else str(tls.client_ca),
        ssl_cert_reqs=ssl.CERT_NONE if tls is None or tls.client_ca is None else ssl.CERT_REQUIRED,
    )
    try:
        config.load()  # reads the TLS files now: a bad one is an error of this call
    except (OSError, ssl.SSLError) as e:
        raise MemlmError(f"--tls-cert/--tls-key/--tls-client-ca: {e}") from None
    server = uvicorn.Server(config)
    return RunningFront(server, _bind(host, port), on_stopped)


def model_name_of(client: LanguageModelClient) -> str:
    """The served model's name, from the LM service's GetInfo."""
    return client.info().model


def serve_openai(lm: str, *, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 model_name: str | None = None, limits: FrontLimits | None = None, timeout: float = 300.0,
                 http: HttpOptions | None = None, lm_tls: ClientTls | None = None,
                 lm_token: str | None = None, metrics: MetricsOptions = MetricsOptions(),
                 auth_file: Path | None = None) -> None:
    """`memlm serve openai`: the front over the LM service at `lm` until SIGTERM/SIGINT, then a drain.

    token: the bearer token callers must send (every request but /health); None = open.
    model_name: the id /v1/models lists and requests name; None = the LM service's GetInfo model.
    limits: what one request may ask (services.openai_front.requests.FrontLimits); None = its defaults.
    timeout: seconds one LM call (a whole Generate stream) may take.
    http: TLS, connection limit and timeouts (HttpOptions); None = its defaults.
    lm_tls, lm_token: the link to the LM service (None: plaintext; the callers' token sent on).
    metrics: the /metrics endpoint (served on its own port when one is given) and the call log's format.
    auth_file: callers' tenants instead of `token` (re-read on SIGHUP); the LM link then sends lm_token only.
    """
    http = http or HttpOptions()
    tls = http.tls
    exposure = ServerOptions(tls=ServerTls.from_files(tls.cert, tls.key, tls.client_ca) if tls else None,
                             token=token, auth_file=auth_file).exposure_warning(host)
    tenants = Tenants.from_settings(None, auth_file) if auth_file is not None else None
    client = LanguageModelClient(lm, tls=lm_tls, token=lm_token if lm_token is not None else token, timeout=timeout)
    endpoint = None
    try:
        name = model_name or model_name_of(client)
        stop = threading.Event()  # a signal, or the server ending by itself
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        if tenants is not None:  # the table is replaced whole: requests read the old one or the new one
            signal.signal(signal.SIGHUP, lambda *_: print(f"memlm: {tenants.reload()}", file=sys.stderr, flush=True))
        registry = ServerMetrics(metrics.log_format)
        endpoint = open_metrics_endpoint(registry, metrics)
        running = start_front(Front(client, name, token, limits or FrontLimits(), tenants), host, port, http, stop.set,
                              registry)
        if exposure is not None:
            print(f"memlm: {exposure}", file=sys.stderr, flush=True)
        print(f"listening on {join_host_port(running.host, running.port)}", flush=True)
        stop.wait()
        print("draining: refusing new requests, finishing the ones in flight", file=sys.stderr, flush=True)
        running.stop()
        if running.failure is not None:
            raise MemlmError(f"the HTTP server stopped: {running.failure!r}")
    finally:
        if endpoint is not None:
            endpoint.close()
        client.close()
