"""Prometheus metrics and JSON call logs of real servers on port 0: the scraped series equal the calls made.

Every server's /metrics is served on a free port (MetricsOptions.port 0), scraped with urllib and parsed with
prometheus_client's own parser; the oracle is the list of calls the test made and the statuses they got.

Shape legend: Q queries, d key dimension.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import grpc
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from memlm.v1 import retrieval_pb2, retrieval_pb2_grpc
from services.common.circuit import CLOSED
from services.common.metrics import DEFAULT_TENANT, MetricsOptions
from services.common.tenants import NO_TENANT
from services.common.server import ServerOptions, ServiceError
from services.lm.client import KnnRequest, LanguageModelClient, TextDelta
from services.lm.server import LMLimits, start_lm_server
from services.retrieval.client import RetrievalClient
from services.retrieval.memory_sessions import MemoryOptions
from services.retrieval.server import start_retrieval_server
from services.router.server import start_router_server

SEARCH = "memlm.v1.RetrievalService/Search"
GET_INFO = "memlm.v1.RetrievalService/GetInfo"
METRICS = MetricsOptions(port=0)
REPO = Path(__file__).resolve().parents[2]


def settled(read, done, timeout_s: float = 10.0):
    """read() until done(value), within a bound: an aborted call's status reaches its caller a moment before
    the server's interceptor has counted it."""
    until = time.monotonic() + timeout_s
    value = read()
    while not done(value):
        if time.monotonic() > until:
            raise AssertionError(f"not reached in {timeout_s} s: {value}")
        time.sleep(0.01)
        value = read()
    return value


def scrape_calls(port: int, total: int) -> dict[str, list]:
    """scrape(port) once memlm_rpc_calls_total of the memlm services adds up to `total` calls."""
    return settled(lambda: scrape(port), lambda samples: sum(memlm_calls(samples).values()) >= total)


def scrape(port: int) -> dict[str, list]:
    """{sample name: [samples]} of http://127.0.0.1:PORT/metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def by_labels(samples: dict[str, list], name: str, *labels: str) -> dict[tuple[str, ...], float]:
    """{label values: value} of one sample name."""
    return {tuple(s.labels[label] for label in labels): s.value for s in samples.get(name, [])}


def memlm_calls(samples: dict[str, list]) -> dict[tuple[str, str], float]:
    """memlm_rpc_calls_total of the memlm services by (rpc, code), health and reflection left out."""
    return {(rpc, code): v for (rpc, code, tenant), v in
            by_labels(samples, "memlm_rpc_calls_total", "rpc", "code", "tenant").items()
            if rpc.startswith("memlm.") and tenant in (DEFAULT_TENANT, NO_TENANT)}


def queries(q: int, d: int) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((q, d)).astype(np.float32)  # (Q, d)


def started_retrieval(loop_thread, searcher, **options):
    started = loop_thread.run(start_retrieval_server(
        "127.0.0.1:0", searcher, options=ServerOptions(**{"metrics": METRICS, **options}),
        memories=MemoryOptions(max_sessions=4)))
    loop_thread.servers.append(started.running.server)
    return started


def test_retrieval_server_counts_every_call_by_rpc_and_code(loop_thread, searcher):
    started = started_retrieval(loop_thread, searcher)
    made: Counter = Counter()
    with RetrievalClient(f"127.0.0.1:{started.running.port}") as client:
        for q in (1, 3, 5):
            client.search(queries(q, searcher.dim), 4)
            made[SEARCH, "OK"] += 1
        made[GET_INFO, "OK"] += 1  # the client's first search asks GetInfo once
        for bad_k in (0, -2):
            with pytest.raises(ServiceError) as e:
                client.search(queries(2, searcher.dim), bad_k)
            made[SEARCH, e.value.code.name] += 1
    samples = scrape_calls(started.running.metrics_endpoint.port, sum(made.values()))
    assert memlm_calls(samples) == dict(made)
    assert made[SEARCH, "INVALID_ARGUMENT"] == 2
    counts = by_labels(samples, "memlm_rpc_duration_seconds_count", "rpc")
    for rpc in (SEARCH, GET_INFO):
        assert counts[(rpc,)] == sum(n for (r, _), n in made.items() if r == rpc)
    assert by_labels(samples, "memlm_memory_sessions") == {(): 0.0}
    assert by_labels(samples, "process_resident_memory_bytes")[()] > 0  # the process collector


def test_refused_calls_are_counted_with_their_code(loop_thread, searcher):
    started = started_retrieval(loop_thread, searcher, token="s3cret")
    address = f"127.0.0.1:{started.running.port}"
    for token, code in ((None, grpc.StatusCode.UNAUTHENTICATED), ("wrong", grpc.StatusCode.UNAUTHENTICATED),
                        ("s3cret", grpc.StatusCode.OK)):
        with RetrievalClient(address, token=token) as client:
            if code == grpc.StatusCode.OK:
                client.server_info()
            else:
                with pytest.raises(ServiceError) as e:
                    client.server_info()
                assert e.value.code == code
    samples = scrape_calls(started.running.metrics_endpoint.port, 3)
    assert memlm_calls(samples) == {(GET_INFO, "UNAUTHENTICATED"): 2, (GET_INFO, "OK"): 1}
    tenants = by_labels(samples, "memlm_rpc_calls_total", "code", "tenant")
    assert tenants == {("UNAUTHENTICATED", NO_TENANT): 2, ("OK", DEFAULT_TENANT): 1}  # no tenant before the token


def test_memory_sessions_and_bytes_follow_the_sessions(loop_thread, searcher):
    started = started_retrieval(loop_thread, searcher)
    with grpc.insecure_channel(f"127.0.0.1:{started.running.port}") as channel:
        stub = retrieval_pb2_grpc.MemoryServiceStub(channel)
        for capacity in (16, 48):
            stub.CreateMemory(retrieval_pb2.CreateMemoryRequest(streams=1, capacity=capacity, dim=8, value_dim=8),
                              timeout=10)
    samples = scrape(started.running.metrics_endpoint.port)
    sessions = started.memories
    assert by_labels(samples, "memlm_memory_sessions") == {(): float(len(sessions))} == {(): 2.0}
    assert by_labels(samples, "memlm_memory_bytes") == {(): float(sessions.reserved_bytes)}
    assert sessions.reserved_bytes > 0


def test_json_log_has_one_line_per_call_with_its_fields(loop_thread, searcher, capsys):
    started = started_retrieval(loop_thread, searcher, metrics=MetricsOptions(log_format="json"))
    assert started.running.metrics_endpoint is None  # no port: no endpoint, the log still written
    with grpc.insecure_channel(f"127.0.0.1:{started.running.port}") as channel:
        stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
        stub.GetInfo(retrieval_pb2.RetrievalServiceGetInfoRequest(), timeout=10,
                     metadata=(("x-request-id", "req-42"),))
        with pytest.raises(grpc.RpcError):
            stub.Search(retrieval_pb2.SearchRequest(k=1), timeout=10)  # no queries: INVALID_ARGUMENT
    err: list[str] = []
    settled(lambda: err.extend(capsys.readouterr().err.splitlines()) or err,
            lambda got: sum(line.startswith("{") for line in got) >= 2)
    lines = [json.loads(line) for line in err if line.startswith("{")]
    assert [(x["rpc"], x["status"]) for x in lines] == [(GET_INFO, "OK"), (SEARCH, "INVALID_ARGUMENT")]
    assert lines[0]["request_id"] == "req-42" and lines[1]["request_id"] not in ("", "req-42")
    for line in lines:
        assert line["tenant"] == DEFAULT_TENANT
        assert isinstance(line["duration_ms"], float) and line["duration_ms"] >= 0


def test_lm_server_counts_tokens_engine_rows_and_its_retrieval_link(loop_thread, tiny, index):
    retrieval = started_retrieval(loop_thread, index)
    link = RetrievalClient(f"127.0.0.1:{retrieval.running.port}")
    started = loop_thread.run(start_lm_server("127.0.0.1:0", tiny, link, options=ServerOptions(metrics=METRICS),
                                              limits=LMLimits(max_new_tokens=100_000)))
    loop_thread.servers.append(started.running.server)
    port = started.running.metrics_endpoint.port
    generated = scored = 0
    with LanguageModelClient(f"127.0.0.1:{started.running.port}") as client:
        for prompt in ("abc", "The quick"):
            generated += sum(len(e.token_ids) for e in client.generate(prompt, max_new_tokens=5, temperature=0.0)
                             if isinstance(e, TextDelta))
        for knn in (None, KnnRequest()):  # the base LM, then kNN-LM: searches over the link
            scored += sum(len(s.tokens) for s in client.score(["the lazy dog", "Peter Piper"], knn=knn))
        with pytest.raises(ServiceError) as refused:
            list(client.generate("abc", max_new_tokens=5, temperature=-1.0))
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        # A long greedy stream holds one row while it runs ("abc" reaches no end-of-text for thousands of tokens).
        stream = client.generate("abc", max_new_tokens=100_000, temperature=0.0)
        for _, event in zip(range(2), stream):
            assert isinstance(event, TextDelta)
        running = scrape(port)
        stream.close()
    assert by_labels(running, "memlm_engine_rows_in_use") == {(): 1.0}
    assert by_labels(running, "memlm_engine_queue_depth") == {(): 0.0}
    samples = scrape_calls(port, 5)  # 2 + 1 Generate, 2 Score (the cancelled stream may come later)
    tokens = by_labels(samples, "memlm_tokens_total", "kind")
    assert tokens[("scored",)] == scored
    assert tokens[("generated",)] >= generated + 2  # the long stream's tokens count as they are sent
    assert generated == 10
    calls = memlm_calls(samples)
    assert calls[("memlm.v1.LanguageModelService/Generate", "OK")] == 2
    assert calls[("memlm.v1.LanguageModelService/Generate", "INVALID_ARGUMENT")] == 1
    assert calls[("memlm.v1.LanguageModelService/Score", "OK")] == 2
    # The link's calls as the retrieval server counted them (GetInfo at load, the kNN-LM Score's searches),
    # their latencies one each, and its breaker closed.
    target = link.address
    link_calls = by_labels(samples, "memlm_retrieval_calls_total", "target", "rpc", "code")
    served = memlm_calls(scrape(retrieval.running.metrics_endpoint.port))
    assert {(rpc, code): n for (t, rpc, code), n in link_calls.items() if t == target} == served
    assert served[(SEARCH, "OK")] >= 1
    link_counts = by_labels(samples, "memlm_retrieval_call_duration_seconds_count", "target", "rpc")
    assert link_counts[(target, SEARCH)] == served[(SEARCH, "OK")]
    assert by_labels(samples, "memlm_retrieval_breaker_state", "target", "state")[(target, CLOSED)] == 1.0
    link.close()


@pytest.mark.parametrize("server", [["retrieval", "--memories"], ["router", "--shard", "127.0.0.1:1"],
                                    ["lm", "--model", "tiny"], ["openai", "--lm", "127.0.0.1:1"]])
def test_every_server_takes_the_metrics_and_log_flags(server):
    from memlm.cli.commands import build_parser, server_options
    from memlm.cli.metrics_options import metrics_options

    parser = build_parser()
    default = parser.parse_args(["serve", *server])
    assert metrics_options(default) == MetricsOptions()  # not served, loopback, no line per call
    args = parser.parse_args(["serve", *server, "--metrics-port", "9464", "--metrics-host", "0.0.0.0",
                              "--log-format", "json"])
    assert metrics_options(args) == MetricsOptions(port=9464, host="0.0.0.0", log_format="json")
    if server[0] != "openai":  # the gRPC servers carry them in their ServerOptions
        assert server_options(args).metrics == metrics_options(args)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", *server, "--log-format", "yaml"])


def test_router_counts_its_calls_and_each_shards_calls_and_breaker(loop_thread, make_searcher):
    shards = [started_retrieval(loop_thread, make_searcher(n, 8, seed=n)) for n in (40, 60)]
    addresses = [f"127.0.0.1:{s.running.port}" for s in shards]
    router = loop_thread.run(start_router_server("127.0.0.1:0", addresses, options=ServerOptions(metrics=METRICS)))
    loop_thread.servers.append(router.server)
    made: Counter = Counter()
    with RetrievalClient(f"127.0.0.1:{router.port}") as client:
        for q in (1, 4):
            client.search(queries(q, 8), 5)
            made[SEARCH, "OK"] += 1
        made[GET_INFO, "OK"] += 1
        with pytest.raises(ServiceError):
            client.search(queries(2, 8), 0)  # refused by the router itself: no shard sees it
        made[SEARCH, "INVALID_ARGUMENT"] += 1
    samples = scrape_calls(router.metrics_endpoint.port, sum(made.values()))
    assert memlm_calls(samples) == dict(made)
    link_calls = by_labels(samples, "memlm_retrieval_calls_total", "target", "rpc", "code")
    breakers = by_labels(samples, "memlm_retrieval_breaker_state", "target", "state")
    for address, shard in zip(addresses, shards):
        served = memlm_calls(scrape(shard.running.metrics_endpoint.port))
        assert {(rpc, code): n for (t, rpc, code), n in link_calls.items() if t == address} == served
        assert served[(SEARCH, "OK")] == made[SEARCH, "OK"]  # every search fans out to every shard
        assert breakers[(address, CLOSED)] == 1.0 and sum(v for (t, _), v in breakers.items() if t == address) == 1.0


def test_serve_retrieval_serves_metrics_and_logs_json_from_the_command_line():
    """The flags end to end: `memlm serve retrieval --memories --metrics-port 0 --log-format json`."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "memlm", "serve", "retrieval", "--memories", "--metrics-port", "0", "--log-format",
         "json"], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        err: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [err.put(line.strip()) for line in proc.stderr], daemon=True).start()
        listening = proc.stdout.readline().strip()
        assert listening.startswith("listening on 127.0.0.1:"), listening
        before = []
        while not (before and before[-1].startswith("metrics on ")):
            before.append(err.get(timeout=60))
        metrics_port = int(before[-1].removesuffix("/metrics").rsplit(":", 1)[1])
        with grpc.insecure_channel(listening.removeprefix("listening on ")) as channel:
            stub = retrieval_pb2_grpc.MemoryServiceStub(channel)
            stub.CreateMemory(retrieval_pb2.CreateMemoryRequest(streams=1, capacity=8, dim=4, value_dim=4),
                              timeout=30, metadata=(("x-request-id", "cli-1"),))
        create = "memlm.v1.MemoryService/CreateMemory"
        logged = json.loads(settled(lambda: err.get(timeout=30), lambda line: line.startswith("{")))
        assert logged["request_id"] == "cli-1" and (logged["rpc"], logged["status"]) == (create, "OK")
        samples = scrape_calls(metrics_port, 1)
        assert memlm_calls(samples) == {(create, "OK"): 1}
        assert by_labels(samples, "memlm_memory_sessions") == {(): 1.0}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_http_middleware_counts_requests_by_route_and_status_and_logs_them():
    """The HTTP front's middleware (HttpCallMetrics) over a small starlette app, driven through ASGI directly."""
    import asyncio

    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    from services.common.metrics import HttpCallMetrics, HttpMetrics, ServerMetrics

    async def models(request):
        return JSONResponse({"data": []})

    async def completions(request):
        async def chunks():
            for i in range(3):
                yield f"data: {i}\n\n".encode()
        if request.query_params.get("fail"):
            raise RuntimeError("a handler's bug")
        return StreamingResponse(chunks(), media_type="text/event-stream")

    routes = [Route("/v1/models", models, methods=["GET"]), Route("/v1/completions", completions, methods=["POST"])]
    lines: list[str] = []
    metrics = ServerMetrics("json", lines.append)
    http = HttpMetrics(metrics, (r.path for r in routes))
    app = Starlette(routes=routes, middleware=[Middleware(HttpCallMetrics, http=http)])

    async def call(method: str, path: str, query: bytes = b"", headers: tuple = ()) -> int:
        sent, bodies = [], [{"type": "http.request", "body": b"", "more_body": False}]

        async def receive():  # the request's one body message, then a caller who stays connected
            if bodies:
                return bodies.pop()
            await asyncio.Event().wait()

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
                 "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "",
                 "headers": [(k.encode(), v.encode()) for k, v in headers], "server": ("127.0.0.1", 80),
                 "client": ("127.0.0.1", 1)}
        try:
            await app(scope, receive, send)
        except RuntimeError:
            pass  # starlette re-raises a handler's error after answering 500
        return next(m["status"] for m in sent if m["type"] == "http.response.start")

    answered = []
    for method, path, query in (("GET", "/v1/models", b""), ("GET", "/v1/models", b""), ("POST", "/v1/completions", b""),
                                ("POST", "/v1/completions", b"fail=1"), ("GET", "/secret/path", b"")):
        status = asyncio.run(call(method, path, query, (("x-request-id", f"r{len(answered)}"),)))
        answered.append((f"{method} {path if path.startswith('/v1/') else 'other'}", str(status)))
    made = Counter(answered)
    assert made == {("GET /v1/models", "200"): 2, ("POST /v1/completions", "200"): 1,
                    ("POST /v1/completions", "500"): 1, ("GET other", "404"): 1}
    from prometheus_client import generate_latest

    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    assert by_labels(samples, "memlm_http_requests_total", "route", "status") == dict(made)
    counts = by_labels(samples, "memlm_http_request_duration_seconds_count", "route")
    assert counts == {(route,): float(sum(n for (r, _), n in made.items() if r == route)) for route, _ in made}
    logged = [json.loads(line) for line in lines]
    assert [(x["rpc"], x["status"]) for x in logged] == answered
    assert [x["request_id"] for x in logged] == [f"r{i}" for i in range(5)]


def test_openai_front_counts_its_requests_by_route_and_status(module_loop, tiny):
    """The front over a real LM server: each request counted once by route and HTTP status, timed, logged."""
    import http.client

    from prometheus_client import generate_latest

    from services.common.metrics import ServerMetrics
    from services.openai_front.server import Front, FrontLimits, start_front

    started = module_loop.run(start_lm_server("127.0.0.1:0", tiny, model_name="tiny"))
    module_loop.servers.append(started.running.server)
    lines: list[str] = []
    metrics = ServerMetrics("json", lines.append)
    answered = []
    with LanguageModelClient(f"127.0.0.1:{started.running.port}") as lm, \
            start_front(Front(lm, "tiny", None, FrontLimits()), metrics=metrics) as front:
        body = json.dumps({"model": "tiny", "prompt": "the quick", "max_tokens": 3, "temperature": 0}).encode()
        for method, path, data in (("GET", "/v1/models", None), ("POST", "/v1/completions", body),
                                   ("POST", "/v1/completions", b"{not json"), ("GET", "/nowhere", None)):
            connection = http.client.HTTPConnection("127.0.0.1", front.port, timeout=30)
            connection.request(method, path, body=data, headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            response.read()
            connection.close()
            answered.append((f"{method} {path if path.startswith('/v1/') else 'other'}", str(response.status)))
    assert [status for _, status in answered] == ["200", "200", "400", "404"]
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    assert by_labels(samples, "memlm_http_requests_total", "route", "status") == dict(Counter(answered))
    counts = by_labels(samples, "memlm_http_request_duration_seconds_count", "route")
    assert counts == dict(Counter((route,) for route, _ in answered))
    assert [(x["rpc"], x["status"]) for x in map(json.loads, lines)] == answered
