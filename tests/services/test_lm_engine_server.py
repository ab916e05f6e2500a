"""Generate on the decoding engine (services.lm.engine): one running batch, bounded admission.

Real servers on port 0 over the tiny model. Oracles: the same call alone on the same server (the engine's
rows are independent: a request yields the tokens it yields alone, greedy and seeded) and
the reference decoder in process (kNN-LM through a real retrieval server).
"""

from __future__ import annotations

import dataclasses
import threading
import time

import grpc
import pytest

from reference_decoding import reference_generate
from memlm.engine.kv_cache import kv_bytes_per_token
from memlm.jobs.decoding import SamplingConfig, TokenEvent
from memlm.model.memory_config import MemoryConfig
from memlm.model.tokenizer import document_boundary
from memlm.retrieval.knnlm import KNNLMConfig
from memlm.v1 import language_model_pb2 as lm_pb2
from memlm.v1 import language_model_pb2_grpc as lm_grpc
from services.lm.engine import MAX_LANES, RETRY_AFTER_KEY
from services.lm.requests import LMLimits
from services.lm.server import start_lm_server
from services.retrieval.client import RetrievalClient
from services.retrieval.server import create_retrieval_server

FAST_S = 2.0
"""What "at once" means here: far under a long generation, far over one step (milliseconds)."""
WAIT_S = 30.0
"""How long a poll for a state waits (not a latency bound: the assert after the poll decides)."""


def ids(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + salt) % 250 + 1 for i in range(n)]  # ids the tiny tokenizer knows


def start(module_loop, tiny, searcher=None, **limits):
    started = module_loop.run(start_lm_server("127.0.0.1:0", tiny, searcher,
                                              limits=dataclasses.replace(LMLimits(max_new_tokens=100_000), **limits)))
    module_loop.servers.append(started.running.server)
    return f"127.0.0.1:{started.running.port}", started.servicer


def request(prompt: list[int], n: int, sampling: lm_pb2.SamplingOptions | None = None, **kw) -> lm_pb2.GenerateRequest:
    return lm_pb2.GenerateRequest(prompt_token_ids=lm_pb2.TokenIds(ids=prompt), max_new_tokens=n,
                                  sampling=sampling or lm_pb2.SamplingOptions(temperature=0.0), **kw)


def tokens(responses) -> list[tuple[int, float]]:
    return [(t.token_id, t.logprob) for r in responses if r.HasField("delta") for t in r.delta.tokens]


def run_concurrently(stub, requests: list[lm_pb2.GenerateRequest]) -> list[list]:
    out: list[list | None] = [None] * len(requests)
    go = threading.Barrier(len(requests))

    def one(i: int) -> None:
        go.wait(10)
        out[i] = list(stub.Generate(requests[i], timeout=120))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(o is not None for o in out)
    return out


def test_concurrent_generations_share_steps_and_each_equals_itself_alone(tiny, module_loop):
    address, servicer = start(module_loop, tiny, max_batch=8)
    seeded = lm_pb2.SamplingOptions(temperature=0.9, top_k=40, seed=11)
    xl = {"memory_mode": lm_pb2.MEMORY_MODE_XL,
          "memory": lm_pb2.MemoryOptions(segment_tokens=16, memory_tokens=24, sink_tokens=2)}
    requests = [request(ids(5 + 9 * i, salt=i), 20 + 7 * i, seeded if i % 2 else None) for i in range(6)]
    requests += [request(ids(40, salt=9), 30, **xl), request(ids(3, salt=8), 25, seeded, **xl)]
    with grpc.insecure_channel(address) as channel:
        stub = lm_grpc.LanguageModelServiceStub(channel)
        alone = [list(stub.Generate(r, timeout=60)) for r in requests]
        steps_before = {id(lane): lane.engine.steps for lane in servicer.engines.lanes()}
        together = run_concurrently(stub, requests)
    for a, t in zip(alone, together):
        assert [tok for tok, _ in tokens(t)] == [tok for tok, _ in tokens(a)]
        for (_, lp_t), (_, lp_a) in zip(tokens(t), tokens(a)):
            assert abs(lp_t - lp_a) <= 1e-5 * max(1.0, abs(lp_a))  # batched rows: float32 rounding only
        assert t[-1].finish == a[-1].finish
    lanes = servicer.engines.lanes()
    assert len(lanes) == 2  # NONE and this XL setting (no kNN-LM): one batch each
    steps = sum(lane.engine.steps - steps_before[id(lane)] for lane in lanes)
    generated = sum(r.max_new_tokens for r in requests)
    assert steps < generated / 2, (steps, generated)  # the calls shared forward steps


def test_compressive_generations_run_on_the_engine_and_each_equals_itself_alone(tiny, module_loop):
    """MEMORY_MODE_COMPRESSIVE Generate is a row of a compressive engine batch (memlm.engine.compression);
    concurrent calls share its steps and each yields its tokens alone (the library: test_lm_server_compressive)."""
    address, servicer = start(module_loop, tiny, max_batch=4)
    compressive = {"memory_mode": lm_pb2.MEMORY_MODE_COMPRESSIVE,
                   "memory": lm_pb2.MemoryOptions(segment_tokens=8, memory_tokens=8, sink_tokens=2,
                                                  compressed_memory_tokens=4, compression_rate=2)}
    seeded = lm_pb2.SamplingOptions(temperature=0.9, top_k=40, seed=3)
    requests = [request(ids(6 + 11 * i, salt=i), 40 + 5 * i, seeded if i % 2 else None, **compressive) for i in range(4)]
    with grpc.insecure_channel(address) as channel:
        stub = lm_grpc.LanguageModelServiceStub(channel)
        alone = [list(stub.Generate(r, timeout=60)) for r in requests]
        together = run_concurrently(stub, requests)
    for a, t in zip(alone, together):
        assert [tok for tok, _ in tokens(t)] == [tok for tok, _ in tokens(a)] and len(tokens(a)) > 30
    (lane,) = servicer.engines.lanes()
    assert lane.key.memory.kind == "compressive" and lane.engine.cache.layout.cmem == 4


def test_a_cancelled_call_frees_its_row_at_once_and_a_full_server_says_when_to_retry(tiny, module_loop):
    address, servicer = start(module_loop, tiny, max_batch=1, max_queue=1)
    with grpc.insecure_channel(address) as channel:
        stub = lm_grpc.LanguageModelServiceStub(channel)
        # Greedy from "The quick" runs thousands of tokens without the tiny model's end-of-text
        # (test_lm_server.test_cancelled_generate_stops_work).
        first = stub.Generate(request(tiny.tokenizer.encode("The quick"), 100_000), timeout=120)
        assert next(first).HasField("delta")  # running in the one row
        second = stub.Generate(request(ids(8, salt=3), 5), timeout=120)  # waits for the row
        time.sleep(0.2)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request(ids(8, salt=5), 5), timeout=30))  # the queue is full
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        hint = dict(e.value.trailing_metadata())[RETRY_AFTER_KEY]
        assert int(hint) >= 1 and f"retry after {hint} ms" in e.value.details()
        assert "queue" in e.value.details()
        t0 = time.monotonic()
        first.cancel()
        assert next(second).HasField("delta")  # the row was freed for it
        assert time.monotonic() - t0 < FAST_S
        assert list(second)[-1].finish.completion_tokens == 5
    (lane,) = servicer.engines.lanes()
    deadline = time.monotonic() + WAIT_S
    while not lane.idle and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lane.idle  # nothing left running or waiting


def test_tokens_in_flight_bound_and_get_info(tiny, module_loop):
    # The KV bytes of 300 tokens and a little less than one more: the budget is 300 tokens.
    per_token = kv_bytes_per_token(tiny.model.config, tiny.model.dtype)
    kv_bytes = 301 * per_token - 1
    address, _ = start(module_loop, tiny, max_batch=3, max_queue=5, max_kv_bytes=kv_bytes)
    with grpc.insecure_channel(address) as channel:
        stub = lm_grpc.LanguageModelServiceStub(channel)
        info = stub.GetInfo(lm_pb2.LanguageModelServiceGetInfoRequest(), timeout=10)
        assert (info.max_batch, info.max_queue, info.max_tokens_in_flight) == (3, 5, 300)
        assert info.max_kv_bytes == kv_bytes
        assert list(info.engine_memory_modes) == [lm_pb2.MEMORY_MODE_NONE, lm_pb2.MEMORY_MODE_XL,
                                                  lm_pb2.MEMORY_MODE_COMPRESSIVE, lm_pb2.MEMORY_MODE_SPALM,
                                                  lm_pb2.MEMORY_MODE_MEMORIZING]
        quick = tiny.tokenizer.encode("The quick")  # no end-of-text for thousands of greedy tokens
        running = stub.Generate(request(quick, 250), timeout=60)  # 1 + len(quick) + 250 tokens in flight
        assert next(running).HasField("delta")
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request(ids(10), 100), timeout=30))  # 111 more: over 300
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "tokens_in_flight" in e.value.details()
        assert int(dict(e.value.trailing_metadata())[RETRY_AFTER_KEY]) >= 1
        assert list(stub.Generate(request(ids(10), 20), timeout=30))[-1].finish.completion_tokens == 20  # fits
        with pytest.raises(grpc.RpcError) as e:  # alone over the budget: no retry would admit it, refused first
            list(stub.Generate(request(ids(10), 290), timeout=30))  # 1 + 10 + 290 = 301 tokens
        assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE
        assert e.value.details().startswith("max_new_tokens: boundary + prompt + max_new_tokens = 301 tokens")
        running.cancel()


class CountingSearcher:
    """The test index, counting the rows of every search the retrieval server runs."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.queries: list[int] = []

    @property
    def dim(self) -> int:
        return self._inner.dim

    def info(self):
        return self._inner.info()

    def search(self, xq, k, options=None):
        self.queries.append(len(xq))
        return self._inner.search(xq, k, options)


def test_knn_generations_through_the_retrieval_service_search_once_per_step(tiny, index, module_loop):
    counting = CountingSearcher(index)
    retrieval = f"127.0.0.1:{module_loop.start(create_retrieval_server, '127.0.0.1:0', counting)}"
    link = RetrievalClient(retrieval)
    try:
        knn = lm_pb2.KnnOptions(enabled=True, k=8, lambda_weight=0.5, temperature=5.0)
        address, servicer = start(module_loop, tiny, link, max_batch=4)
        prompts = [ids(6 + 5 * i, salt=i) for i in range(4)]
        with grpc.insecure_channel(address) as channel:
            together = run_concurrently(lm_grpc.LanguageModelServiceStub(channel),
                                        [request(p, 12, knn=knn) for p in prompts])
        (lane,) = servicer.engines.lanes()
        assert len(counting.queries) == lane.engine.steps  # one search per engine step, every ready row in it
        assert max(counting.queries) > 1 and sum(counting.queries) == sum(g[-1].finish.completion_tokens for g in together)
        tok = tiny.tokenizer
        config = KNNLMConfig(k=8, lmbda=0.5, temperature=5.0)  # = knn above
        for p, got in zip(prompts, together):
            events = reference_generate(tiny.model, tok, p, max_new_tokens=12, sampling=SamplingConfig(temperature=0.0),
                                        boundary_token=document_boundary(tok), eos_id=tok.eos_id, searcher=index, knn=config)
            assert [t for t, _ in tokens(got)] == [e.token_id for e in events if isinstance(e, TokenEvent)]
    finally:
        link.close()


class GatedSearcher(CountingSearcher):
    """The test index behind a gate: a search blocks until `release` is set (a hung retrieval service)."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.entered = threading.Event()
        self.release = threading.Event()

    def search(self, xq, k, options=None):
        self.entered.set()
        assert self.release.wait(30), "test never released the searcher"
        return super().search(xq, k, options)


def test_a_hung_retrieval_service_stalls_only_the_calls_that_search(tiny, index, module_loop):
    gated = GatedSearcher(index)
    retrieval = f"127.0.0.1:{module_loop.start(create_retrieval_server, '127.0.0.1:0', gated)}"
    link = RetrievalClient(retrieval)
    try:
        address, _ = start(module_loop, tiny, link)
        knn = lm_pb2.KnnOptions(enabled=True, k=8, lambda_weight=0.5, temperature=5.0)
        with grpc.insecure_channel(address) as channel:
            stub = lm_grpc.LanguageModelServiceStub(channel)
            hung = stub.Generate(request(ids(6), 5, knn=knn), timeout=60)
            assert gated.entered.wait(10)  # its step waits on the retrieval service
            t0 = time.monotonic()
            plain = list(stub.Generate(request(ids(6), 5), timeout=30))  # a base-LM generation meanwhile
            stub.Score(lm_pb2.ScoreRequest(inputs=[lm_pb2.ScoreInput(token_ids=lm_pb2.TokenIds(ids=ids(40)))]),
                       timeout=30)
            assert time.monotonic() - t0 < FAST_S
            assert plain[-1].finish.completion_tokens == 5
            gated.release.set()
            assert list(hung)[-1].finish.completion_tokens == 5  # and the kNN call goes on once it answers
    finally:
        gated.release.set()
        link.close()


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0.0), SamplingConfig(temperature=0.8, top_p=0.9, seed=4)])
@pytest.mark.parametrize("memory", [None, MemoryConfig("xl", mem_len=12, sink_tokens=2, segment=8)])
def test_knn_generate_local_and_remote_equal_the_library(tiny, servers, index, sampling, memory):
    # The reference decoder (tests/reference_decoding.py) token for token, greedy and seeded, plain and XL, with the
    # datastore in process ("local") and through a retrieval server ("remote").
    tok = tiny.tokenizer
    prompt = tok.encode("The quick brown fox")
    events = reference_generate(tiny.model, tok, prompt, max_new_tokens=12, sampling=sampling, boundary_token=document_boundary(tok),
                                eos_id=tok.eos_id, searcher=index, knn=servers["knn"], memory=memory)
    want = [e.token_id for e in events if isinstance(e, TokenEvent)]
    extra = {} if memory is None else {"memory_mode": lm_pb2.MEMORY_MODE_XL, "memory": lm_pb2.MemoryOptions(
        segment_tokens=memory.segment, memory_tokens=memory.mem_len, sink_tokens=memory.sink_tokens)}
    options = lm_pb2.SamplingOptions(temperature=sampling.temperature)
    if sampling.seed is not None:
        options.top_p, options.seed = sampling.top_p, sampling.seed
    for name in ("local", "remote"):
        with grpc.insecure_channel(servers[name]) as channel:
            got = list(lm_grpc.LanguageModelServiceStub(channel).Generate(
                request(prompt, 12, options, knn=lm_pb2.KnnOptions(enabled=True), **extra), timeout=60))
        assert [t for t, _ in tokens(got)] == want, name


def test_a_deadline_retires_the_row(tiny, module_loop):
    address, servicer = start(module_loop, tiny, max_batch=1)
    with grpc.insecure_channel(address) as channel:
        stub = lm_grpc.LanguageModelServiceStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request(tiny.tokenizer.encode("The quick"), 100_000), timeout=0.5))
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        (lane,) = servicer.engines.lanes()
        deadline = time.monotonic() + WAIT_S
        while not lane.idle and time.monotonic() < deadline:
            time.sleep(0.01)
        assert lane.idle  # the row was retired: the next call gets it at once
        t0 = time.monotonic()
        assert list(stub.Generate(request(ids(5), 3), timeout=10))[-1].finish.completion_tokens == 3
        assert time.monotonic() - t0 < FAST_S


def test_batches_of_other_settings_are_bounded(tiny, module_loop):
    address, servicer = start(module_loop, tiny)
    quick = tiny.tokenizer.encode("The quick")  # no end-of-text for thousands of greedy tokens

    def xl(segment: int, n: int) -> lm_pb2.GenerateRequest:
        return request(quick, n, memory_mode=lm_pb2.MEMORY_MODE_XL,
                       memory=lm_pb2.MemoryOptions(segment_tokens=segment, memory_tokens=16, sink_tokens=2))

    with grpc.insecure_channel(address) as channel:
        stub = lm_grpc.LanguageModelServiceStub(channel)
        running = [stub.Generate(xl(4 + i, 100_000), timeout=60) for i in range(MAX_LANES)]  # one batch each
        for stream in running:
            assert next(stream).HasField("delta")
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(xl(40, 3), timeout=30))  # a ninth setting while all eight batches run
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and f"{MAX_LANES} batches" in e.value.details()
        running[0].cancel()
        deadline = time.monotonic() + WAIT_S
        while not any(lane.idle for lane in servicer.engines.lanes()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert list(stub.Generate(xl(40, 3), timeout=30))[-1].finish.completion_tokens == 3  # an idle one made room
        assert len(servicer.engines.lanes()) == MAX_LANES
        for stream in running[1:]:
            stream.cancel()


def test_a_generate_cancelled_while_its_request_is_submitted_frees_its_row(tiny, module_loop, monkeypatch):
    """The submit runs in a worker thread; a call cancelled before it returns must still cancel what it submitted
    (services.lm.engine.submit_in_thread), or the row generates all its tokens for nobody. The worker is held
    until the client has cancelled, then submits: the request exists only after the cancel."""
    from services.lm.engine import EnginePool

    real, submitted, entered, release = EnginePool.submit, [], threading.Event(), threading.Event()

    def held(self, *args):
        entered.set()
        release.wait(WAIT_S)
        out = real(self, *args)
        submitted.append(out[1])
        return out

    monkeypatch.setattr(EnginePool, "submit", held)
    address, servicer = start(module_loop, tiny)
    with grpc.insecure_channel(address) as channel:
        call = lm_grpc.LanguageModelServiceStub(channel).Generate(request(ids(8), 4000), timeout=120)
        assert entered.wait(WAIT_S)
        call.cancel()
        time.sleep(0.5)  # the server sees the cancel while the worker thread is still in submit
        release.set()
        deadline = time.monotonic() + WAIT_S
        while not (submitted and all(lane.idle for lane in servicer.engines.lanes())) and time.monotonic() < deadline:
            time.sleep(0.01)
    assert submitted and submitted[0].handle.cancelled  # cancelled, not left to generate its tokens for nobody
    assert all(lane.idle for lane in servicer.engines.lanes())


def test_cuda_graphs_server_gives_the_same_tokens(tiny, module_loop):
    """LMLimits.cuda_graphs: the server's batches without a memory decode in fixed-shape steps (eagerly on a CPU,
    memlm.engine.decode_graphs); concurrent calls yield what a server without it yields, and an XL lane (which
    the fixed step does not serve) runs the ordinary way."""
    plain_address, _ = start(module_loop, tiny, max_batch=4)
    address, servicer = start(module_loop, tiny, max_batch=4, cuda_graphs=True)
    seeded = lm_pb2.SamplingOptions(temperature=0.9, top_k=40, seed=5)
    xl = {"memory_mode": lm_pb2.MEMORY_MODE_XL,
          "memory": lm_pb2.MemoryOptions(segment_tokens=16, memory_tokens=24, sink_tokens=2)}
    requests = [request(ids(4 + 7 * i, salt=i), 12 + 5 * i, seeded if i % 2 else None) for i in range(5)]
    requests.append(request(ids(20, salt=7), 15, **xl))
    with grpc.insecure_channel(plain_address) as channel:
        expected = run_concurrently(lm_grpc.LanguageModelServiceStub(channel), requests)
    with grpc.insecure_channel(address) as channel:
        got = run_concurrently(lm_grpc.LanguageModelServiceStub(channel), requests)
    for g, e in zip(got, expected):
        assert [tok for tok, _ in tokens(g)] == [tok for tok, _ in tokens(e)]
    graphs = {lane.key.memory is None: lane.engine.graphs for lane in servicer.engines.lanes()}
    assert graphs[True].replays > 10 and graphs[False] is None
