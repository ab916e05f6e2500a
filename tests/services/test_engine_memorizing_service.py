"""Memorizing rows whose kNN memories are sessions of a real retrieval server (`--memories`, port 0): the engine
equals its in-process exact backend and the reference decoder (tokens, log-probs); each row's session is dropped when
the row leaves (finished, cancelled: nothing is left on the server); a session the server refuses ends only its
row; the LM server's MEMORIZING Generate runs on the engine and a cancelled call's session is dropped.

Shape legend: T tokens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time

import grpc
import pytest
import torch

from memlm.engine.engine import Engine, run_all
from memlm.engine.requests import EngineConfig, GenerationRequest
from reference_decoding import reference_generate
from memlm.jobs.decoding import SamplingConfig, TokenEvent
from memlm.model.memory_config import MemoryConfig
from memlm.memory.memorizing import new_knn_attention
from memlm.model.tokenizer import document_boundary
from memlm.v1 import language_model_pb2 as lm_pb2
from memlm.v1 import language_model_pb2_grpc as lm_grpc
from services.lm.requests import LMLimits
from services.lm.server import start_lm_server
from services.retrieval.memory_client import remote_memory_factory
from services.retrieval.memory_sessions import MemoryOptions
from services.retrieval.server import create_retrieval_server
from services.common.server import ServiceError

MEMORY = MemoryConfig("memorizing", segment=16, mem_len=16, sink_tokens=2, knn_layer=1, knn_mem_size=48, knn_top_k=4,
                      knn_backend="exact")
"""mem_len + segment = 32 < the prompts + generations below; 48 entries: FIFO eviction."""
SERVICE = dataclasses.replace(MEMORY, knn_backend="service")
GREEDY = SamplingConfig(temperature=0.0)
SAMPLED = SamplingConfig(temperature=1.0, top_k=40, seed=4)


def ids(n: int, salt: int = 0) -> list[int]:
    return [(5 * i + salt) % 200 + 3 for i in range(n)]


@pytest.fixture(scope="module")
def knn_attention(tiny):
    module = new_knn_attention(tiny.model.config)
    with torch.no_grad():
        module.gate_logit.zero_()  # g = 0.5 in every head: the retrieved pairs count
    return module


def memory_server(module_loop, **limits) -> str:
    port = module_loop.start(create_retrieval_server, "127.0.0.1:0", None, memories=MemoryOptions(**limits))
    return f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def memories(module_loop):
    """A memory server and a client of it (its sessions are what the tests count)."""
    client = remote_memory_factory(memory_server(module_loop), timeout=30)
    yield client
    client.close()


def sessions(client) -> int:
    return client.info(refresh=True).sessions


def request(tiny, prompt: list[int], n: int, sampling: SamplingConfig = GREEDY) -> GenerationRequest:
    return GenerationRequest(tuple(prompt), n, sampling, boundary_token=document_boundary(tiny.tokenizer))


def engine(tiny, knn_attention, memory: MemoryConfig, service=None, max_batch: int = 3) -> Engine:
    config = EngineConfig(max_batch=max_batch, prefill_chunk=24, memory=memory)
    return Engine(tiny.model, tiny.tokenizer, config, knn_attention=knn_attention, knn_service=service)


def pairs(events) -> list[tuple[int, float]]:
    return [(e.token_id, e.logprob) for e in events if isinstance(e, TokenEvent)]


def assert_same(got, want) -> None:
    assert [t for t, _ in got] == [t for t, _ in want] and got
    torch.testing.assert_close(torch.tensor([lp for _, lp in got]), torch.tensor([lp for _, lp in want]),
                               atol=1e-5, rtol=1e-5)


def test_service_rows_equal_in_process_rows_and_the_library(tiny, knn_attention, memories) -> None:
    reqs = [request(tiny, ids(40, 1), 30), request(tiny, ids(21, 2), 40, SAMPLED), request(tiny, ids(9, 3), 30)]
    remote = run_all(engine(tiny, knn_attention, SERVICE, memories), reqs)
    local = run_all(engine(tiny, knn_attention, MEMORY), reqs)
    for req, r, loc in zip(reqs, remote, local):
        want = pairs(reference_generate(tiny.model, tiny.tokenizer, list(req.prompt_ids), max_new_tokens=req.max_new_tokens,
                                        sampling=req.sampling, boundary_token=req.boundary_token, memory=MEMORY,
                                        knn_attention=knn_attention))
        assert_same(pairs(r), want)
        assert_same(pairs(loc), want)
    assert sessions(memories) == 0  # every row's session was dropped when it finished


def test_a_cancelled_rows_session_is_dropped(tiny, knn_attention, memories) -> None:
    eng = engine(tiny, knn_attention, SERVICE, memories)
    stay, leave = eng.submit(request(tiny, ids(30, 4), 25)), eng.submit(request(tiny, ids(30, 5), 25))
    for _ in range(3):
        eng.step()
    assert sessions(memories) == 2
    leave.cancel()
    eng.step()
    assert sessions(memories) == 1 and list(leave.events())[-1].reason == "cancelled"
    list(stay.events())
    assert sessions(memories) == 0


def test_a_refused_session_ends_only_its_row(tiny, knn_attention, module_loop) -> None:
    client = remote_memory_factory(memory_server(module_loop, max_sessions=1), timeout=30)
    try:
        target = request(tiny, ids(30, 6), 20)
        alone = pairs(run_all(engine(tiny, knn_attention, MEMORY), [target])[0])
        eng = engine(tiny, knn_attention, SERVICE, client)
        first, second = eng.submit(target), eng.submit(request(tiny, ids(30, 7), 20))
        with pytest.raises(ServiceError) as e:
            list(second.events())
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert_same(pairs(first.events()), alone)
        assert sessions(client) == 0
    finally:
        client.close()


def test_lm_server_generate_runs_on_the_engine_and_a_cancelled_call_drops_its_session(tiny, knn_attention,
                                                                                     module_loop, memories) -> None:
    limits = LMLimits(knn_layer=1, max_knn_top_k=8, knn_backend="service")
    started = module_loop.run(start_lm_server("127.0.0.1:0", tiny, limits=limits, knn_attention=knn_attention,
                                              knn_service=memories))
    module_loop.servers.append(started.running.server)
    options = lm_pb2.MemoryOptions(segment_tokens=16, memory_tokens=16, sink_tokens=2, knn_mem_size=48, knn_top_k=4)
    prompt = ids(40, 8)
    call = lm_pb2.GenerateRequest(prompt_token_ids=lm_pb2.TokenIds(ids=prompt), max_new_tokens=30,
                                  sampling=lm_pb2.SamplingOptions(temperature=1.0, top_k=40, seed=4),
                                  memory_mode=lm_pb2.MEMORY_MODE_MEMORIZING, memory=options)
    with grpc.insecure_channel(f"127.0.0.1:{started.running.port}") as channel:
        stub = lm_grpc.LanguageModelServiceStub(channel)
        served = [t.token_id for r in stub.Generate(call, timeout=60) if r.HasField("delta") for t in r.delta.tokens]
        lanes = started.servicer.engines.lanes()
        assert [lane.key.memory.kind for lane in lanes] == ["memorizing"]  # the engine served it
        want = reference_generate(tiny.model, tiny.tokenizer, prompt, max_new_tokens=30, sampling=SAMPLED,
                                  boundary_token=document_boundary(tiny.tokenizer), eos_id=tiny.tokenizer.eos_id,
                                  memory=MEMORY, knn_attention=knn_attention)
        assert served == [e.token_id for e in want if isinstance(e, TokenEvent)]
        long = lm_pb2.GenerateRequest()
        long.CopyFrom(call)
        long.max_new_tokens = 4000
        stream = stub.Generate(long, timeout=60)
        next(r for r in stream if r.HasField("delta"))  # running: its session is open
        assert sessions(memories) == 1
        stream.cancel()
    deadline = time.monotonic() + 10
    while sessions(memories) and time.monotonic() < deadline:  # the row leaves at the engine's next step
        threading.Event().wait(0.05)
    assert sessions(memories) == 0


def test_a_stopping_lm_server_drops_the_sessions_of_its_running_rows(tiny, knn_attention, module_loop,
                                                                      memories) -> None:
    limits = LMLimits(knn_layer=1, max_knn_top_k=8, knn_backend="service")
    started = module_loop.run(start_lm_server("127.0.0.1:0", tiny, limits=limits, knn_attention=knn_attention,
                                              knn_service=memories))
    options = lm_pb2.MemoryOptions(segment_tokens=16, memory_tokens=16, sink_tokens=2, knn_mem_size=48, knn_top_k=4)
    call = lm_pb2.GenerateRequest(prompt_token_ids=lm_pb2.TokenIds(ids=ids(20, 9)), max_new_tokens=4000,
                                  memory_mode=lm_pb2.MEMORY_MODE_MEMORIZING, memory=options)
    with grpc.insecure_channel(f"127.0.0.1:{started.running.port}") as channel:
        stream = lm_grpc.LanguageModelServiceStub(channel).Generate(call, timeout=60)
        next(r for r in stream if r.HasField("delta"))
        assert sessions(memories) == 1
        module_loop.run(started.running.server.stop(0.2))  # the calls are cancelled, the lanes closed
        with contextlib.suppress(grpc.RpcError):  # ended one way or another (a status, or the finish of a cancel)
            list(stream)
    deadline = time.monotonic() + 10
    while sessions(memories) and time.monotonic() < deadline:  # the servicer closes after the server stopped
        threading.Event().wait(0.05)
    assert sessions(memories) == 0
