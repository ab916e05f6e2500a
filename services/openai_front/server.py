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

Bearer token: the front checks `Authorization: Bearer TOKEN` against the LM server's token (the same
secret, --token/--token-file/$MEMLM_TOKEN) and sends that token on to the LM service itself; /health
needs none, as the gRPC health service. SIGTERM/SIGINT: stop accepting, let in-flight requests finish
(`serve_until_signal`).
"""

from __future__ import annotations

import hmac
import json
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc

from memlm.errors import MemlmError
from services.lm.client import Finish, LanguageModelClient, TextDelta
from services.openai_front.requests import ApiError, Completion, FrontLimits, parse_completion
from services.common.server import ServiceError, join_host_port

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


def model_entry(name: str, info: Any) -> dict[str, Any]:
    """/v1/models' entry of the served model: OpenAI's fields, and the weight format and compute dtype the LM
    service's GetInfo reports (`info`), so that a caller sees which format answers."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "memlm", "weights": info.weights,
            "compute_dtype": info.compute_dtype}


def service_error(e: ServiceError) -> ApiError:
    status = GRPC_HTTP.get(e.code, 502)
    kind = "invalid_request_error" if status < 500 else "api_error"
    return ApiError(status, f"LM service: {e.code.name}: {e.details}", kind=kind, code=e.code.name.lower())


# -- HTTP ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Front:
    """What every request handler shares: the LM client, the served model's name, the token, the limits."""

    client: LanguageModelClient
    """The LM service (thread-safe: every request thread calls it)."""
    model_name: str
    """The one model id /v1/models lists and requests may name."""
    token: str | None
    """The LM server's bearer token, required of callers and sent on; None = no authentication."""
    limits: FrontLimits
    """What one request may ask (services.openai_front.requests)."""


class Handler(BaseHTTPRequestHandler):
    """One HTTP request (ThreadingHTTPServer: a thread each) on its own connection.

    HTTP/1.0, so every connection closes after its response (a stream: after `data: [DONE]`): no idle
    keep-alive connection holds a thread, and draining on SIGTERM waits for requests in flight only.
    """

    protocol_version = "HTTP/1.0"
    front: Front  # set on the subclass made by make_server

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per request would drown the server's own output; the LM service logs the work

    def do_GET(self) -> None:
        self._answer(self._get)

    def do_POST(self) -> None:
        self._answer(self._post)

    def _answer(self, route: Any) -> None:
        try:
            route()
        except ApiError as e:
            self._json(e.status, e.body())
        except ServiceError as e:
            err = service_error(e)
            self._json(err.status, err.body())
        except MemlmError as e:  # the client library refusing an argument before any call
            self._json(400, ApiError(400, str(e)).body())
        except (BrokenPipeError, ConnectionResetError):
            pass  # the caller went away; a stream's Generate is cancelled when its iterator is closed

    def _get(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/health":
            try:
                self.front.client.info()
            except ServiceError as e:
                raise ApiError(503, f"LM service unavailable: {e}", kind="api_error") from None
            self._json(200, {"status": "ok"})
            return
        self._check_token()
        if path == "/v1/models":
            entry = model_entry(self.front.model_name, self.front.client.info())
            self._json(200, {"object": "list", "data": [entry]})
            return
        raise ApiError(404, f"no such endpoint: GET {path}", code="not_found")

    def _post(self) -> None:
        path = self.path.split("?", 1)[0]
        self._check_token()
        if path != "/v1/completions":
            raise ApiError(404, f"no such endpoint: POST {path} (memlm serves /v1/completions)", code="not_found")
        body = self._body()
        model = body.get("model") if isinstance(body, dict) else None
        if model is not None and model != self.front.model_name:
            raise ApiError(404, f"model {model!r} is not served here; this front serves {self.front.model_name!r}",
                           "model", code="model_not_found")
        completions, stream = parse_completion(body, self.front.limits)
        if stream:
            self._stream(completions)
            return
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for i, c in enumerate(completions):
            choice, p, n = complete(self.front.client, c, i)
            choices.append(choice)
            prompt_tokens, completion_tokens = prompt_tokens + max(p, 0), completion_tokens + n
        self._json(200, completion_body(self.front.model_name, choices, prompt_tokens, completion_tokens))

    def _stream(self, completions: list[Completion]) -> None:
        chunks = stream_chunks(self.front.client, self.front.model_name, completions)
        try:
            first = next(chunks)  # errors before the first event are still a plain JSON error
        except StopIteration:
            first = None
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        try:
            for c in ([first] if first is not None else []):
                self._event(c)
            for c in chunks:
                self._event(c)
        except ServiceError as e:  # mid-stream: OpenAI's servers send the error object as an event
            self._event(service_error(e).body())
        finally:
            chunks.close()
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def _event(self, obj: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        self.wfile.flush()

    def _check_token(self) -> None:
        token = self.front.token
        if token is None:
            return
        given = self.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise ApiError(401, "missing or wrong bearer token (Authorization: Bearer TOKEN, the LM server's token)",
                           kind="invalid_request_error", code="invalid_api_key")

    def _body(self) -> Any:
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            raise ApiError(411, "a Content-Length header is required") from None
        if length > self.front.limits.max_body_bytes:
            raise ApiError(413, f"request body of {length} bytes, at most {self.front.limits.max_body_bytes}")
        try:
            return json.loads(self.rfile.read(length) or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not JSON ({e})") from None

    def _json(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def make_server(host: str, port: int, front: Front) -> ThreadingHTTPServer:
    """A bound (not yet serving) HTTP server for `front`; port 0 = any free port (server.server_address)."""
    handler = type("FrontHandler", (Handler,), {"front": front})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = False  # server_close() waits for in-flight requests (the drain on SIGTERM)
    return server


def model_name_of(client: LanguageModelClient) -> str:
    """The served model's name, from the LM service's GetInfo."""
    return client.info().model


def serve_until_signal(server: ThreadingHTTPServer) -> None:
    """Print `listening on HOST:PORT`, serve until SIGTERM/SIGINT, then stop accepting and let the requests
    in flight finish (server_close joins their threads)."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    thread = threading.Thread(target=server.serve_forever, name="openai-front", daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    print(f"listening on {join_host_port(host, port)}", flush=True)
    stop.wait()
    print("draining: refusing new requests, finishing the ones in flight", file=sys.stderr, flush=True)
    server.shutdown()
    server.server_close()


def serve_openai(lm: str, *, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 model_name: str | None = None, limits: FrontLimits | None = None, timeout: float = 300.0) -> None:
    """`memlm serve openai`: the front over the LM service at `lm` until SIGTERM/SIGINT.

    token: the LM server's bearer token, checked on every request but /health and sent on to the LM service.
    model_name: the id /v1/models lists and requests name; None = the LM service's GetInfo model.
    limits: what one request may ask (services.openai_front.requests.FrontLimits); None = its defaults.
    timeout: seconds one LM call (a whole Generate stream) may take.
    """
    client = LanguageModelClient(lm, token=token, timeout=timeout)
    try:
        name = model_name or model_name_of(client)
        server = make_server(host, port, Front(client, name, token, limits or FrontLimits()))
        serve_until_signal(server)
    finally:
        client.close()
