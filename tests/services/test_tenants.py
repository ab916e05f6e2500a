"""Tenants from an auth file against real servers: who may call what, each tenant's quotas, memory sessions
that belong to their tenant, the metrics label, and a reload on SIGHUP that drops no call.

Shape legend: Q queries, d key dimension, k neighbours, S streams, T entries per stream, dv value dimension.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import queue
import signal
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import grpc
import torch
import numpy as np
import pytest

from services.common.metrics import MetricsOptions
from services.common.server import ServerOptions, ServiceError
from services.common.tenants import AuthFileError, TenantTable
from services.retrieval.client import RetrievalClient
from services.retrieval.server import create_retrieval_server, start_retrieval_server

TOKEN_A, TOKEN_B = "token-of-a", "token-of-b"


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def tenant(name: str, token: str, **keys) -> str:
    """One [[tenant]] table of an auth file."""
    lines = ["[[tenant]]", f'name = "{name}"', f'token_sha256 = "{digest(token)}"']
    for key, value in keys.items():
        lines.append(f"{key} = {value!r}".replace("'", '"'))
    return "\n".join(lines) + "\n"


def auth_file(tmp_path: Path, *tables: str) -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text("\n".join(tables))
    return path


def queries(q: int, d: int) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((q, d)).astype(np.float32)  # (Q, d)


def code_of(call) -> tuple[grpc.StatusCode, str]:
    """The status code and message of a client call that must fail."""
    with pytest.raises(ServiceError) as e:
        call()
    return e.value.code, e.value.details


def retrieval(loop_thread, searcher, path: Path, **options) -> str:
    port = loop_thread.start(create_retrieval_server, "127.0.0.1:0", searcher,
                             options=ServerOptions(auth_file=path, **options))
    return f"127.0.0.1:{port}"


# ---------------------------------------------------------------------------------------------
# The auth file


def test_an_auth_file_is_read_with_roles_quotas_and_sizes(tmp_path):
    table = TenantTable.read(auth_file(tmp_path, tenant("a", TOKEN_A, rpcs=["search", "Tokenize"],
                                                        max_memory_bytes="4G", max_requests_per_second=2.5),
                                       tenant("b", TOKEN_B)))
    a, b = table.tenants
    assert a.quotas.max_memory_bytes == 4 << 30 and a.quotas.max_requests_per_second == 2.5
    assert a.allows("/memlm.v1.RetrievalService/Search") and a.allows("/memlm.v1.LanguageModelService/Tokenize")
    assert not a.allows("/memlm.v1.MemoryService/CreateMemory")
    assert b.rpcs is None and all(b.allows(m) for m in ("/memlm.v1.MemoryService/DropMemory", "/x/Y"))
    assert table.identify(TOKEN_A) is a and table.identify(TOKEN_B) is b and table.identify("other") is None


@pytest.mark.parametrize(("tables", "named"), [
    (tenant("a", TOKEN_A, max_calls=3), "'max_calls'"),
    ("colour = 1\n" + tenant("a", TOKEN_A), "'colour'"),
    (tenant("a", TOKEN_A, rpcs=["Scroe"]), "'Scroe'"),
    (tenant("a", TOKEN_A, max_concurrent_calls=0), "max_concurrent_calls"),
    (tenant("a", TOKEN_A) + tenant("a", TOKEN_B), "'a' is listed twice"),
    ('[[tenant]]\nname = "a"\ntoken_sha256 = "s3cret"\n', "token_sha256"),
])
def test_a_bad_auth_file_is_refused_by_name(tmp_path, tables, named):
    with pytest.raises(AuthFileError, match=named):
        TenantTable.read(auth_file(tmp_path, tables))


def test_the_command_line_refuses_a_bad_auth_file_before_serving(tmp_path):
    from memlm.cli.commands import build_parser, server_options
    from memlm.errors import MemlmError

    path = auth_file(tmp_path, tenant("a", TOKEN_A, max_calls=3))
    args = build_parser().parse_args(["serve", "retrieval", "--memories", "--auth-file", str(path)])
    with pytest.raises(MemlmError, match="unknown key 'max_calls'"):
        server_options(args)
    args = build_parser().parse_args(["serve", "retrieval", "--auth-file", str(path), "--token", "s3cret"])
    with pytest.raises(MemlmError, match="not both"):
        server_options(args)


# ---------------------------------------------------------------------------------------------
# Calls


def test_two_tenants_each_reach_what_their_rpcs_allow(loop_thread, searcher, tmp_path):
    path = auth_file(tmp_path, tenant("a", TOKEN_A, rpcs=["search"]), tenant("b", TOKEN_B, rpcs=["GetInfo"]))
    address = retrieval(loop_thread, searcher, path)
    xq = queries(3, searcher.dim)
    with RetrievalClient(address, token=TOKEN_A) as a, RetrievalClient(address, token=TOKEN_B) as b:
        np.testing.assert_array_equal(a.search(xq, 4).ids, searcher.search(xq, 4).ids)
        assert b.server_info().datastore.n == len(searcher.keys)
        code, message = code_of(lambda: b.search(xq, 4))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "tenant 'b'" in message and "Search" in message
    for token in ("wrong", None, TOKEN_A + "x"):
        with RetrievalClient(address, token=token) as nobody:
            assert code_of(nobody.server_info)[0] == grpc.StatusCode.UNAUTHENTICATED


def test_the_router_answers_its_tenants_as_a_retrieval_server_does(loop_thread, searcher, tmp_path):
    from services.router.server import ShardLinks, create_router_server

    shard = loop_thread.start(create_retrieval_server, "127.0.0.1:0", searcher, options=ServerOptions(token="shard"))
    path = auth_file(tmp_path, tenant("a", TOKEN_A, rpcs=["search"]), tenant("b", TOKEN_B, rpcs=["score"]))
    port = loop_thread.start(create_router_server, "127.0.0.1:0", [f"127.0.0.1:{shard}"],
                             shards=ShardLinks(token="shard"), options=ServerOptions(auth_file=path))
    xq = queries(3, searcher.dim)
    with RetrievalClient(f"127.0.0.1:{port}", token=TOKEN_A) as a, RetrievalClient(f"127.0.0.1:{port}",
                                                                                  token=TOKEN_B) as b:
        np.testing.assert_array_equal(a.search(xq, 4).ids, searcher.search(xq, 4).ids)
        assert code_of(b.server_info)[0] == grpc.StatusCode.PERMISSION_DENIED
    with RetrievalClient(f"127.0.0.1:{port}", token="shard") as shard_token:  # the shards' token is no tenant here
        assert code_of(shard_token.server_info)[0] == grpc.StatusCode.UNAUTHENTICATED


def test_a_shared_token_is_the_default_tenant_with_every_rpc(loop_thread, searcher):
    port = loop_thread.start(create_retrieval_server, "127.0.0.1:0", searcher, options=ServerOptions(token="s3cret"))
    xq = queries(2, searcher.dim)
    with RetrievalClient(f"127.0.0.1:{port}", token="s3cret") as ok:
        np.testing.assert_array_equal(ok.search(xq, 3).ids, searcher.search(xq, 3).ids)
    with RetrievalClient(f"127.0.0.1:{port}", token="other") as wrong:
        assert code_of(wrong.server_info)[0] == grpc.StatusCode.UNAUTHENTICATED


def test_a_tenant_at_its_concurrent_calls_is_refused_while_the_other_goes_on(loop_thread, gated_searcher, tmp_path):
    path = auth_file(tmp_path, tenant("a", TOKEN_A, max_concurrent_calls=1), tenant("b", TOKEN_B))
    address = retrieval(loop_thread, gated_searcher, path)
    xq = queries(2, gated_searcher.dim)
    held: dict[str, object] = {}

    def search() -> None:
        with RetrievalClient(address, token=TOKEN_A, timeout=30) as a:
            held["ids"] = a.search(xq, 3).ids

    thread = threading.Thread(target=search)
    thread.start()
    try:
        assert gated_searcher.entered.wait(20)
        with RetrievalClient(address, token=TOKEN_A) as a, RetrievalClient(address, token=TOKEN_B) as b:
            code, message = code_of(a.server_info)
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert message == "tenant 'a': max_concurrent_calls 1 reached"
            assert b.server_info().datastore.n == len(gated_searcher.keys)
    finally:
        gated_searcher.release.set()
        thread.join(30)
    np.testing.assert_array_equal(held["ids"], gated_searcher.search(xq, 3).ids)  # the held call was not dropped
    with RetrievalClient(address, token=TOKEN_A) as a:
        assert a.server_info().datastore.n == len(gated_searcher.keys)  # its slot came back


def test_a_burst_past_the_rate_is_refused_naming_the_quota_while_the_other_tenant_goes_on(
        loop_thread, searcher, tmp_path):
    path = auth_file(tmp_path, tenant("a", TOKEN_A, max_requests_per_second=1), tenant("b", TOKEN_B))
    address = retrieval(loop_thread, searcher, path)
    burst, xq = 40, queries(1, searcher.dim)  # far above one call a second, however slow the machine
    with RetrievalClient(address, token=TOKEN_A) as a, RetrievalClient(address, token=TOKEN_B) as b:
        a.server_info()  # the first call finds a full second of calls
        outcomes = []
        for _ in range(burst):
            try:
                a.search(xq, 1)
                outcomes.append("ok")
            except ServiceError as e:
                assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED, e
                outcomes.append(e.details)
            b.search(xq, 1)  # never refused: b has no rate of its own
    refusals = [o for o in outcomes if o != "ok"]
    assert refusals
    assert set(refusals) == {"tenant 'a': max_requests_per_second 1 reached"}


def test_calls_are_counted_under_their_tenant(loop_thread, searcher, tmp_path):
    from prometheus_client.parser import text_string_to_metric_families
    import urllib.request

    path = auth_file(tmp_path, tenant("a", TOKEN_A), tenant("b", TOKEN_B, rpcs=["Search"]))
    started = loop_thread.run(start_retrieval_server(
        "127.0.0.1:0", searcher, options=ServerOptions(auth_file=path, metrics=MetricsOptions(port=0))))
    loop_thread.servers.append(started.running.server)
    address = f"127.0.0.1:{started.running.port}"
    with RetrievalClient(address, token=TOKEN_A) as a, RetrievalClient(address, token=TOKEN_B) as b:
        a.server_info()
        a.search(queries(1, searcher.dim), 1)
        code_of(b.server_info)
    with RetrievalClient(address, token="wrong") as nobody:
        code_of(nobody.server_info)
    expected = {("a", "OK"): 2.0, ("b", "PERMISSION_DENIED"): 1.0, ("-", "UNAUTHENTICATED"): 1.0}

    def calls() -> dict[tuple[str, str], float]:
        url = f"http://127.0.0.1:{started.running.metrics_endpoint.port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        out: dict[tuple[str, str], float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "memlm_rpc_calls_total" and s.labels["rpc"].startswith("memlm."):
                    key = (s.labels["tenant"], s.labels["code"])
                    out[key] = out.get(key, 0.0) + s.value
        return out

    # An aborted call's status reaches its caller a moment before the interceptor counts it: bounded retries.
    for _ in range(500):
        if calls() == expected:
            break
        threading.Event().wait(0.02)
    assert calls() == expected


# ---------------------------------------------------------------------------------------------
# Reload


def test_a_reload_swaps_the_tenants_without_dropping_a_call_in_flight(loop_thread, gated_searcher, tmp_path):
    path = auth_file(tmp_path, tenant("a", TOKEN_A))
    started = loop_thread.run(start_retrieval_server("127.0.0.1:0", gated_searcher,
                                                     options=ServerOptions(auth_file=path)))
    loop_thread.servers.append(started.running.server)
    address = f"127.0.0.1:{started.running.port}"
    xq = queries(2, gated_searcher.dim)
    held: dict[str, object] = {}

    def search() -> None:
        with RetrievalClient(address, token=TOKEN_A, timeout=30) as a:
            held["ids"] = a.search(xq, 3).ids

    thread = threading.Thread(target=search)
    thread.start()
    try:
        assert gated_searcher.entered.wait(20)
        path.write_text(tenant("b", TOKEN_B))
        loop_thread.run(asyncio.to_thread(started.running.reload_tenants))
        with RetrievalClient(address, token=TOKEN_A) as a, RetrievalClient(address, token=TOKEN_B) as b:
            assert code_of(a.server_info)[0] == grpc.StatusCode.UNAUTHENTICATED
            assert b.server_info().datastore.n == len(gated_searcher.keys)
    finally:
        gated_searcher.release.set()
        thread.join(30)
    np.testing.assert_array_equal(held["ids"], gated_searcher.search(xq, 3).ids)


def memory_info(address: str, token: str) -> grpc.StatusCode:
    """The status of a GetMemoryInfo call with `token`."""
    from memlm.v1 import retrieval_pb2, retrieval_pb2_grpc
    from services.common.security import auth_metadata

    with grpc.insecure_channel(address) as channel:
        try:
            retrieval_pb2_grpc.MemoryServiceStub(channel).GetMemoryInfo(
                retrieval_pb2.GetMemoryInfoRequest(), metadata=auth_metadata(token), timeout=20)
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def test_sighup_rereads_the_auth_file_and_a_bad_one_keeps_the_tenants(tmp_path):
    path = auth_file(tmp_path, tenant("a", TOKEN_A))
    process = subprocess.Popen([sys.executable, "-m", "memlm.cli", "serve", "retrieval", "--memories", "--threads", "1",
                                "--auth-file", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in process.stderr], daemon=True).start()
    try:
        listening = process.stdout.readline()
        assert listening.startswith("listening on "), listening + process.stderr.read()
        address = listening.split()[-1]
        assert memory_info(address, TOKEN_A) == grpc.StatusCode.OK
        assert memory_info(address, TOKEN_B) == grpc.StatusCode.UNAUTHENTICATED

        def reload() -> str:
            process.send_signal(signal.SIGHUP)
            while True:
                line = lines.get(timeout=60)
                if "auth file" in line:
                    return line

        path.write_text(tenant("b", TOKEN_B))
        assert "1 tenants" in reload()
        assert memory_info(address, TOKEN_A) == grpc.StatusCode.UNAUTHENTICATED
        assert memory_info(address, TOKEN_B) == grpc.StatusCode.OK
        path.write_text(tenant("c", TOKEN_A, colour=1))
        assert "unknown key 'colour'" in reload()
        assert memory_info(address, TOKEN_B) == grpc.StatusCode.OK  # the tenants read before stay in use
    finally:
        process.terminate()
        process.wait(60)


# ---------------------------------------------------------------------------------------------
# Memory sessions


def memory_calls(stub, memory_id: str) -> dict[str, object]:
    """Every MemoryService call that names a session, as zero-argument callables, for `memory_id`."""
    from memlm.v1 import retrieval_pb2
    from services.retrieval.memory_sessions import torch_to_tensor

    S, D, DV = 1, 4, 4
    keys, values, valid = torch.zeros(S, 2, D), torch.zeros(S, 2, DV), torch.ones(S, 2, dtype=torch.bool)
    return {
        "AppendMemory": lambda md: stub.AppendMemory(retrieval_pb2.AppendMemoryRequest(
            memory_id=memory_id, keys=torch_to_tensor(keys), values=torch_to_tensor(values),
            valid=torch_to_tensor(valid)), metadata=md, timeout=20),
        "SearchMemory": lambda md: stub.SearchMemory(retrieval_pb2.SearchMemoryRequest(
            memory_id=memory_id, queries=torch_to_tensor(torch.zeros(S, 1, D)), k=1), metadata=md, timeout=20),
        "ClearMemory": lambda md: stub.ClearMemory(retrieval_pb2.ClearMemoryRequest(
            memory_id=memory_id, streams=torch_to_tensor(torch.ones(S, dtype=torch.bool))), metadata=md, timeout=20),
        "DropMemory": lambda md: stub.DropMemory(retrieval_pb2.DropMemoryRequest(memory_id=memory_id),
                                                 metadata=md, timeout=20),
    }


def failure(call, metadata) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        call(metadata)
    return e.value.code(), e.value.details()


def test_another_tenants_session_is_not_found_exactly_as_an_id_that_never_existed(loop_thread, tmp_path):
    from memlm.v1 import retrieval_pb2, retrieval_pb2_grpc
    from services.common.security import auth_metadata
    from services.retrieval.memory_sessions import MemoryOptions

    path = auth_file(tmp_path, tenant("a", TOKEN_A), tenant("b", TOKEN_B))
    port = loop_thread.start(create_retrieval_server, "127.0.0.1:0", None, memories=MemoryOptions(),
                             options=ServerOptions(auth_file=path))
    a, b = auth_metadata(TOKEN_A), auth_metadata(TOKEN_B)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = retrieval_pb2_grpc.MemoryServiceStub(channel)
        create = retrieval_pb2.CreateMemoryRequest(streams=1, capacity=8, dim=4, value_dim=4)
        owned = stub.CreateMemory(create, metadata=a, timeout=20).memory_id
        never = "0" * len(owned)
        for name, call in memory_calls(stub, owned).items():
            other = failure(call, b)
            unknown = failure(memory_calls(stub, never)[name], b)
            assert other[0] == unknown[0] == grpc.StatusCode.NOT_FOUND, name
            assert other[1].replace(owned, never) == unknown[1], name  # the same answer, id for id
        calls = memory_calls(stub, owned)
        for name in ("AppendMemory", "SearchMemory", "ClearMemory", "DropMemory"):  # still a's, untouched by b
            calls[name](a)


def test_each_tenant_holds_its_own_sessions_and_bytes(loop_thread, tmp_path):
    from memlm.v1 import retrieval_pb2, retrieval_pb2_grpc
    from services.common.security import auth_metadata
    from memlm.memory.knn_store import storage_dtype
    from services.retrieval.memory_sessions import MemoryOptions, session_bytes

    one = session_bytes(1, 8, 4, 4, storage_dtype(torch.device("cpu")).itemsize)  # bytes of one session below
    path = auth_file(tmp_path, tenant("a", TOKEN_A, max_memory_sessions=2),
                     tenant("b", TOKEN_B, max_memory_bytes=str(one * 3)))
    port = loop_thread.start(create_retrieval_server, "127.0.0.1:0", None, memories=MemoryOptions(),
                             options=ServerOptions(auth_file=path))
    a, b = auth_metadata(TOKEN_A), auth_metadata(TOKEN_B)
    create = retrieval_pb2.CreateMemoryRequest(streams=1, capacity=8, dim=4, value_dim=4)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = retrieval_pb2_grpc.MemoryServiceStub(channel)
        first = [stub.CreateMemory(create, metadata=a, timeout=20).memory_id for _ in range(2)]
        code, message = failure(lambda md: stub.CreateMemory(create, metadata=md, timeout=20), a)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and message == "tenant 'a': max_memory_sessions 2 reached"
        for _ in range(3):
            stub.CreateMemory(create, metadata=b, timeout=20)  # a's count is a's alone
        code, message = failure(lambda md: stub.CreateMemory(create, metadata=md, timeout=20), b)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and message.startswith("tenant 'b': max_memory_bytes")
        stub.DropMemory(retrieval_pb2.DropMemoryRequest(memory_id=first[0]), metadata=a, timeout=20)
        stub.CreateMemory(create, metadata=a, timeout=20)  # a dropped session gives its room back


# ---------------------------------------------------------------------------------------------
# The LM server: fair share and engine rows by tenant


def test_the_lm_server_shares_the_model_by_tenant_and_bounds_its_engine_rows(loop_thread, tiny, tmp_path):
    from services.lm.client import LanguageModelClient
    from services.lm.server import start_lm_server

    path = auth_file(tmp_path, tenant("a", TOKEN_A, max_engine_rows=1), tenant("b", TOKEN_B))
    started = loop_thread.run(start_lm_server("127.0.0.1:0", tiny, model_name="tiny",
                                              options=ServerOptions(auth_file=path)))
    loop_thread.servers.append(started.running.server)
    address = f"127.0.0.1:{started.running.port}"
    texts = ["The quick brown fox.", "Peter Piper picked."]
    with (LanguageModelClient(address, token=TOKEN_A, timeout=60) as a1,
          LanguageModelClient(address, token=TOKEN_A, timeout=60) as a2,
          LanguageModelClient(address, token=TOKEN_B, timeout=60) as b):
        alone = [r.total_logprob for r in b.score(texts)]  # b has no row quota: both inputs at once
        apart = [r.total_logprob for r in a1.score(texts[:1]) + a2.score(texts[1:])]
        np.testing.assert_allclose(apart, alone, rtol=1e-5)  # one row at a time scores as two at once
        code, message = code_of(lambda: a1.score(texts))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and message == "tenant 'a': max_engine_rows 1 reached"
    shares = {c for c in started.servicer.scheduler.turns.clients() if not c.startswith("engine:")}
    assert shares == {"a", "b"}  # two connections of a: one share


def test_the_serving_page_example_is_an_auth_file_that_reads():
    page = (Path(__file__).resolve().parents[2] / "docs" / "concepts" / "serving.md").read_text()
    example = page.split("```toml\n", 1)[1].split("```", 1)[0]
    table = TenantTable.parse(tomllib.loads(example))
    assert [t.name for t in table.tenants] == ["search-team", "eval"]
    assert table.tenants[0].quotas.max_memory_bytes == 2 << 30


def test_the_openai_front_answers_each_tenant_by_its_rpcs(loop_thread, tiny, tmp_path):
    import http.client
    import json

    from services.common.metrics import ServerMetrics
    from services.common.tenants import Tenants
    from services.lm.client import LanguageModelClient
    from services.lm.server import start_lm_server
    from services.openai_front.server import Front, FrontLimits, start_front

    path = auth_file(tmp_path, tenant("a", TOKEN_A, rpcs=["generate"]), tenant("b", TOKEN_B, rpcs=["search"]),
                     tenant("c", "token-of-c", max_requests_per_second=1))
    started = loop_thread.run(start_lm_server("127.0.0.1:0", tiny, model_name="tiny"))
    loop_thread.servers.append(started.running.server)
    metrics = ServerMetrics()
    body = json.dumps({"model": "tiny", "prompt": "the quick", "max_tokens": 3, "temperature": 0}).encode()
    statuses, burst = {}, []
    with LanguageModelClient(f"127.0.0.1:{started.running.port}") as lm, \
            start_front(Front(lm, "tiny", None, FrontLimits(), Tenants.from_settings(None, path)),
                        metrics=metrics) as front:
        for who, token in (("a", TOKEN_A), ("b", TOKEN_B), ("nobody", "wrong")):
            connection = http.client.HTTPConnection("127.0.0.1", front.port, timeout=60)
            connection.request("POST", "/v1/completions", body=body, headers={
                "Content-Type": "application/json", "Authorization": f"Bearer {token}"})
            response = connection.getresponse()
            statuses[who] = (response.status, json.loads(response.read()).get("error", {}).get("message"))
            connection.close()
        for _ in range(20):  # far above one request a second
            connection = http.client.HTTPConnection("127.0.0.1", front.port, timeout=60)
            connection.request("GET", "/v1/models", headers={"Authorization": "Bearer token-of-c"})
            response = connection.getresponse()
            burst.append((response.status, json.loads(response.read()).get("error", {}).get("message")))
            connection.close()
    assert statuses == {"a": (200, None), "b": (403, "tenant 'b' may not call /v1/completions"),
                        "nobody": (401, "missing or wrong bearer token (Authorization: Bearer TOKEN)")}
    assert burst[0] == (200, None) and (429, "tenant 'c': max_requests_per_second 1 reached") in burst
    assert set(burst) <= {(200, None), (429, "tenant 'c': max_requests_per_second 1 reached")}
    for who, status in (("a", "200"), ("b", "403"), ("-", "401")):
        labels = {"route": "POST /v1/completions", "status": status, "tenant": who}
        assert metrics.registry.get_sample_value("memlm_http_requests_total", labels) == 1.0, labels


def test_the_rate_is_a_bucket_of_one_second_of_calls():
    from services.common.security import TenantCalls
    from services.common.tenants import Quotas, Tenant

    now = [0.0]
    calls = TenantCalls(clock=lambda: now[0])
    slow, fast = (Tenant(name, b"", None, Quotas(max_requests_per_second=r)) for name, r in (("slow", 0.5), ("fast", 3)))
    assert [calls.refusal(fast) for _ in range(4)] == [None] * 3 + ["tenant 'fast': max_requests_per_second 3 reached"]
    assert calls.refusal(slow) is None  # below one a second, a call still fits
    assert calls.refusal(slow) == "tenant 'slow': max_requests_per_second 0.5 reached"
    now[0] = 2.0  # two seconds later: one call of slow, three of fast (never more than a second's worth)
    assert calls.refusal(slow) is None and calls.refusal(slow) is not None
    assert [calls.refusal(fast) for _ in range(4)].count(None) == 3
