"""LanguageModelService with real servers on port 0 and the tiny model.

Oracles: memlm.jobs.scoring / tests/reference_decoding.py in process, evaluate_perplexity, and kNN-LM over the same
index in process versus through a real retrieval server (RetrievalClient). Malformed requests get the
right status codes and the server stays healthy.

Shape legend: N datastore entries, C key width.
"""

from __future__ import annotations

import dataclasses
import math

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tiny_models import logprobs_close

from memlm.errors import MemlmError
from memlm.jobs.evaluate import evaluate_perplexity
from reference_decoding import reference_generate
from memlm.jobs.decoding import SamplingConfig, TokenEvent
from memlm.jobs.scoring import score_tokens, score_tokens_segments
from memlm.jobs.segment_eval import evaluate_segments
from memlm.jobs.windows import WindowConfig
from memlm.model.memory_config import MemoryConfig
from memlm.model.tokenizer import document_boundary
from memlm.retrieval.exact import TorchExactSearcher
from memlm.v1 import language_model_pb2 as lm_pb2
from services.lm.client import (
    Finish,
    KnnRequest,
    LanguageModelClient,
    MemoryRequest,
    TextDelta,
    main_generate,
    main_score,
)
from services.lm.engine import GenerationRecord
from services.lm.server import LMLimits, bind_lm_server
from services.retrieval.server import info_from_proto
from services.common.server import ServerOptions, ServiceError


def assert_logprobs_close(got: list[float], want: list[float]) -> None:
    """Engine log-probs against the one-sequence path's: float32 rounding of another cache layout only."""
    assert logprobs_close(got, want), (got, want)


def client(address: str) -> LanguageModelClient:
    return LanguageModelClient(address, timeout=60)


def health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status


def test_score_equals_library_and_memlm_eval(tiny, docs, servers):
    with client(servers["plain"]) as c:
        remote = c.score(docs, window_tokens=32, stride_tokens=16, top_n=3)
    local = score_tokens(tiny.model, docs, context=32, stride=16, boundary_token=document_boundary(tiny.tokenizer), top_n=3)
    for r, s in zip(remote, local):
        assert [t.token_id for t in r.tokens] == s.tokens.tolist()
        # Score runs on the engine (services.lm.score_engine): float32 rounding of its cache layout only.
        assert_logprobs_close([t.base_logprob for t in r.tokens], s.base_logprob.tolist())
        assert_logprobs_close([t.logprob for t in r.tokens], s.logprob.tolist())
        assert [t.is_greedy for t in r.tokens] == s.greedy.tolist()
        assert [[a.token_id for a in t.alternatives] for t in r.tokens] == s.top_ids.tolist()
        assert math.isclose(r.total_logprob, s.total_logprob, rel_tol=1e-6)
        assert r.context_tokens == 1
    result = evaluate_perplexity(tiny.model, docs, WindowConfig(32, 16, 4), document_boundary(tiny.tokenizer), progress=False)
    nll = -sum(r.total_logprob for r in remote)
    assert math.isclose(math.exp(nll / result["tokens"]), result["perplexity"], rel_tol=1e-6)


def test_text_input_and_context(tiny, servers):
    tok = tiny.tokenizer
    with client(servers["plain"]) as c:
        by_text = c.score(["Peter Piper"], contexts=["Said "])
        by_ids = c.score([tok.encode("Peter Piper")], contexts=[tok.encode("Said ")])
        (tokenized,) = c.tokenize(["Peter Piper"], add_bos=True)
    assert by_text == by_ids
    assert by_text[0].context_tokens == 1 + len(tok.encode("Said "))
    assert "".join(t.text for t in by_text[0].tokens) == "Peter Piper"
    assert tokenized.ids == (tok.bos_id, *tok.encode("Peter Piper")) and tokenized.pieces[1] == "P"


def test_knn_remote_equals_local_and_lambda_zero_is_base(tiny, docs, servers, index):
    knn = KnnRequest()
    with client(servers["local"]) as a, client(servers["remote"]) as b:
        # No window given: kNN-LM scores with the datastore's (48, 24), as its keys were made.
        local = a.score(docs, knn=knn, top_n=2)
        remote = b.score(docs, knn=knn, top_n=2)
        base = a.score(docs)
        zero = b.score(docs, knn=KnnRequest(lmbda=0.0))
    assert remote == local  # identical tokens, log-probs, greedy flags, alternatives
    in_process = score_tokens(tiny.model, docs, context=48, stride=24, boundary_token=document_boundary(tiny.tokenizer),
                              searcher=index, knn=servers["knn"])
    for r, s in zip(local, in_process):
        assert_logprobs_close([t.logprob for t in r.tokens], s.logprob.tolist())  # the engine's (see above)
    for z, b_ in zip(zero, base):
        assert [t.logprob for t in z.tokens] == [t.logprob for t in b_.tokens]
    assert abs(sum(r.total_logprob for r in local) - sum(r.total_logprob for r in base)) > 1.0


def test_generate_greedy_and_seeded_equal_library(tiny, servers, index):
    tok = tiny.tokenizer
    prompt = tok.encode("The quick")
    for sampling in (SamplingConfig(temperature=0.0), SamplingConfig(temperature=0.9, top_k=50, seed=7)):
        events = list(reference_generate(tiny.model, tok, prompt, max_new_tokens=10, sampling=sampling,
                                         boundary_token=document_boundary(tok), eos_id=tok.eos_id))
        want = [e.token_id for e in events if isinstance(e, TokenEvent)]
        with client(servers["plain"]) as c:
            got = list(c.generate("The quick", max_new_tokens=10, temperature=sampling.temperature,
                                  top_k=sampling.top_k, seed=sampling.seed))
            again = list(c.generate(prompt, max_new_tokens=10, temperature=sampling.temperature,
                                    top_k=sampling.top_k, seed=sampling.seed))
        assert got == again
        assert [i for d in got if isinstance(d, TextDelta) for i in d.token_ids] == want
        assert isinstance(got[-1], Finish) and got[-1].completion_tokens == len(want)
        text = "".join(d.text for d in got if isinstance(d, TextDelta))
        assert text == tok.decode(want)
    # kNN-LM generation over the remote index equals the in-process one.
    events = list(reference_generate(tiny.model, tok, prompt, max_new_tokens=6, sampling=SamplingConfig(temperature=0.0),
                                     boundary_token=document_boundary(tok), eos_id=tok.eos_id, searcher=index, knn=servers["knn"]))
    with client(servers["remote"]) as c:
        got = list(c.generate(prompt, max_new_tokens=6, temperature=0.0, knn=KnnRequest()))
    # Generate runs on the engine (services.lm.engine): its KV cache attends over preallocated slots, so
    # keys and log-probs round differently from the one-sequence path's (measured: 3.6e-7 relative);
    # the tokens are the same.
    served = [(d.token_ids[0], d.logprobs[0]) for d in got if isinstance(d, TextDelta) and d.token_ids]
    assert [t for t, _ in served] == [e.token_id for e in events if isinstance(e, TokenEvent)]
    assert_logprobs_close([lp for _, lp in served], [e.logprob for e in events if isinstance(e, TokenEvent)])


def test_stop_sequence_stops(tiny, servers):
    with client(servers["plain"]) as c:
        free = list(c.generate("abc", max_new_tokens=12, temperature=0.0))
        ids = [i for d in free if isinstance(d, TextDelta) for i in d.token_ids]
        stop = tiny.tokenizer.decode(ids[4:6])
        got = list(c.generate("abc", max_new_tokens=12, temperature=0.0, stop=[stop]))
    assert got[-1].reason == "stop" and got[-1].stop_sequence == stop
    assert got[-1].completion_tokens <= 6
    assert stop in "".join(d.text for d in got if isinstance(d, TextDelta))


def wait_for_record(servicer, count: int):
    with servicer.records_changed:
        assert servicer.records_changed.wait_for(lambda: len(servicer.records) >= count, timeout=30)
        return servicer.records[count - 1]


def test_cancelled_generate_stops_work(tiny, servers):
    servicer = servers["servicer"]
    before = len(servicer.records)
    with client(servers["plain"]) as c:
        stream = c.generate("abc", max_new_tokens=100_000, temperature=0.0)
        for _, event in zip(range(3), stream):
            assert isinstance(event, TextDelta)
        stream.close()  # cancels the call
        record = wait_for_record(servicer, before + 1)
        assert record.outcome == "cancelled" and record.completion_tokens < 100_000
        # A deadline ends the work the same way. Greedy from "The quick" runs 3000 tokens without the
        # tiny model's end-of-text (checked once); sampling draws it after a few hundred tokens, which
        # could end the stream before the deadline.
        hurried = LanguageModelClient(servers["plain"])
        hurried.tokenize(["connect first"])  # the 1 s deadline below then covers generation only
        hurried.timeout = 1.0
        with pytest.raises(ServiceError) as e:
            for _ in hurried.generate("The quick", max_new_tokens=100_000, temperature=0.0):
                pass
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        record = wait_for_record(servicer, before + 2)
        assert record.outcome == "cancelled" and record.completion_tokens < 100_000
        assert [t.token_id for t in c.score(["still serving"])[0].tokens] == tiny.tokenizer.encode("still serving")


class _Aborted(Exception):
    pass


class ExpiringContext:
    """A servicer context whose deadline passes after `tokens` time checks (grpc has not cancelled yet)."""

    def __init__(self, tokens: int) -> None:
        self.checks_left = tokens
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    def cancelled(self) -> bool:
        return False

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def time_remaining(self) -> float:
        self.checks_left -= 1
        return 10.0 if self.checks_left >= 0 else 0.0

    async def abort(self, code: grpc.StatusCode, details: str):
        self.aborted = (code, details)
        raise _Aborted(details)


def test_generate_whose_deadline_passes_ends_deadline_exceeded_not_ok(servers):
    # A handler that returned normally would let a client whose own timer had not fired yet see the stream
    # end with status OK and no finish message, as if the generation were complete.
    servicer = servers["servicer"]
    before = len(servicer.records)
    context = ExpiringContext(tokens=1 + 3)  # one check when the call starts (lm_server.CallStop), one per token

    async def drive() -> list:
        out = []
        with pytest.raises(_Aborted):
            # Greedy from "The quick": no end-of-text for thousands of tokens (see test_cancelled_generate_stops_work).
            request = lm_pb2.GenerateRequest(prompt_text="The quick", max_new_tokens=50,
                                             sampling=lm_pb2.SamplingOptions(temperature=0.0))
            async for response in servicer.Generate(request, context):
                out.append(response)
        return out

    responses = servers["loop"].run(drive())
    assert len(responses) == 3 and all(r.HasField("delta") for r in responses)
    assert context.aborted == (grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed after 3 generated tokens")
    # (Calls of earlier tests may record after this one: their handlers end after their clients do.)
    assert GenerationRecord(completion_tokens=3, outcome="cancelled") in servicer.records[before:]


def test_info(tiny, servers, index):
    with client(servers["plain"]) as c:
        info = c.info()
    assert info.model == "tiny" and info.model_fingerprint == tiny.fingerprint
    assert info.vocab_size == tiny.tokenizer.vocab_size and info.context_length == tiny.model.config.max_seq_len
    assert not info.HasField("datastore")
    assert list(info.memory_modes) == [lm_pb2.MEMORY_MODE_NONE, lm_pb2.MEMORY_MODE_XL, lm_pb2.MEMORY_MODE_COMPRESSIVE]
    assert info.default_memory_mode == lm_pb2.MEMORY_MODE_NONE
    d = info.default_memory
    assert (d.segment_tokens, d.memory_tokens, d.sink_tokens) == (128, 1024, 4) and info.max_memory_tokens == 65536
    assert info.max_new_tokens == 100_000 and info.max_score_tokens == 400
    with client(servers["remote"]) as c:
        # The remote datastore's description reaches the LM client through two servers, every field.
        assert info_from_proto(c.info().datastore) == index.info()


def test_not_serving_until_loaded_and_datastore_checked(tiny, servers, index, boundary):
    loop = servers["loop"]
    started = loop.run(bind_lm_server("127.0.0.1:0", model_name="tiny", knn_defaults=servers["knn"], options=ServerOptions(),
                                      limits=LMLimits()))
    loop.servers.append(started.running.server)
    address = f"127.0.0.1:{started.running.port}"
    assert health(address) == health_pb2.HealthCheckResponse.NOT_SERVING
    with client(address) as c, pytest.raises(ServiceError) as e:
        c.score(["hi"])
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    def described_as(**changes) -> TorchExactSearcher:
        return TorchExactSearcher(index.keys, index.values, info=dataclasses.replace(index.info(), **changes))

    with pytest.raises(MemlmError, match="different model"):
        started.servicer.load(tiny, described_as(model_fingerprint="other"))
    with pytest.raises(MemlmError, match="different tokenizer"):
        started.servicer.load(tiny, described_as(tokenizer_fingerprint="other"))
    with pytest.raises(MemlmError, match=f"start with token {boundary + 1}, this tokenizer's document boundary is {boundary}"):
        started.servicer.load(tiny, described_as(boundary_token=boundary + 1))
    started.servicer.load(tiny, index)
    loop.run(started.running.mark_serving())
    assert health(address) == health_pb2.HealthCheckResponse.SERVING
    with client(address) as c, client(servers["local"]) as reference:  # the same datastore, loaded before
        assert c.score(["hi"], knn=KnnRequest()) == reference.score(["hi"], knn=KnnRequest())


def test_command_line_entry_points(servers, capsys):
    results = main_score(servers["local"], ["hello there", "x"], knn=KnnRequest(), per_token=True, top_n=2)
    out = capsys.readouterr().out
    assert "base ppl" in out and f"{results[0].perplexity:.3f}" in out and "'hello there'" in out
    finish = main_generate(servers["plain"], "Once", max_new_tokens=5, temperature=0.0, stop=["zzzz"])
    captured = capsys.readouterr()
    assert captured.out.startswith("Once") and finish.reason == "length"
    assert "[finish: length; prompt 4 tokens, generated 5]" in captured.err


# ---------------------------------------------------------------------------------------------
# MEMORY_MODE_XL: oracle memlm.jobs.segment_eval.evaluate_segments (what `memlm eval --memory xl` runs)

XL = MemoryRequest(segment_tokens=8, memory_tokens=12, sink_tokens=2)
XL_CONFIG = MemoryConfig("xl", mem_len=12, sink_tokens=2, segment=8)


def test_score_xl_equals_evaluate_segments(tiny, docs, servers):
    bos = document_boundary(tiny.tokenizer)
    with client(servers["plain"]) as c:
        remote = c.score(docs, memory_mode="xl", memory=XL, top_n=2)
        windows = c.score(docs, window_tokens=8, stride_tokens=4)
        defaults = c.score(docs, memory_mode="xl")
    # Same rows as the server (LMLimits.score_batch_size 4), so the floats are bit-identical.
    result = evaluate_segments(tiny.model, docs, segment=8, memory="xl", mem_len=12, sink_tokens=2,
                               batch_size=4, boundary_token=bos)
    assert sum(len(r.tokens) for r in remote) == result["tokens"]
    total = sum(r.total_logprob for r in remote)
    assert math.isclose(total, -result["nll"] * result["tokens"], rel_tol=1e-6)  # the engine's XL rows (see above)
    local = score_tokens_segments(tiny.model, docs, memory=XL_CONFIG, boundary_token=bos, top_n=2)
    for r, s in zip(remote, local):
        assert [t.token_id for t in r.tokens] == s.tokens.tolist()
        assert_logprobs_close([t.base_logprob for t in r.tokens], s.base_logprob.tolist())
        assert_logprobs_close([t.logprob for t in r.tokens], s.logprob.tolist())
        assert [t.is_greedy for t in r.tokens] == s.greedy.tolist()
        assert [[a.token_id for a in t.alternatives] for t in r.tokens] == s.top_ids.tolist()
    # The mode is really applied: sliding windows of the same length score differently.
    assert abs(total - sum(r.total_logprob for r in windows)) > 1e-3
    # Unset sizes take the server's defaults (segment 128, memory 1024, sinks 4).
    result = evaluate_segments(tiny.model, docs, segment=128, memory="xl", mem_len=1024, sink_tokens=4,
                               batch_size=4, boundary_token=bos)
    assert math.isclose(sum(r.total_logprob for r in defaults), -result["nll"] * result["tokens"], rel_tol=1e-6)


def test_score_xl_with_knn_remote_equals_local(tiny, docs, servers, index):
    with client(servers["local"]) as a, client(servers["remote"]) as b:
        local = a.score(docs, knn=KnnRequest(), memory_mode="xl", memory=XL, top_n=2)
        remote = b.score(docs, knn=KnnRequest(), memory_mode="xl", memory=XL, top_n=2)
        base = a.score(docs, memory_mode="xl", memory=XL)
    assert remote == local
    in_process = score_tokens_segments(tiny.model, docs, memory=XL_CONFIG,
                                       boundary_token=document_boundary(tiny.tokenizer), searcher=index, knn=servers["knn"])
    for r, s, b_ in zip(local, in_process, base):
        assert_logprobs_close([t.logprob for t in r.tokens], s.logprob.tolist())  # the engine's XL rows
        assert [t.base_logprob for t in r.tokens] == [t.base_logprob for t in b_.tokens]
    assert abs(sum(r.total_logprob for r in local) - sum(r.total_logprob for r in base)) > 1.0


def test_generate_xl_equals_library(tiny, servers):
    tok = tiny.tokenizer
    prompt = tok.encode("The quick brown fox jumps")
    for sampling in (SamplingConfig(temperature=0.0), SamplingConfig(temperature=0.9, top_k=50, seed=3)):
        events = list(reference_generate(tiny.model, tok, prompt, max_new_tokens=12, sampling=sampling,
                                         boundary_token=document_boundary(tok), eos_id=tok.eos_id, memory=XL_CONFIG))
        want = [(e.token_id, e.logprob) for e in events if isinstance(e, TokenEvent)]
        with client(servers["plain"]) as c:
            got = list(c.generate(prompt, max_new_tokens=12, temperature=sampling.temperature, top_k=sampling.top_k,
                                  seed=sampling.seed, memory_mode="xl", memory=XL))
        served = [(d.token_ids[0], d.logprobs[0]) for d in got if isinstance(d, TextDelta) and d.token_ids]
        assert [t for t, _ in served] == [t for t, _ in want]  # the engine's XL rows (logprobs: see above)
        assert_logprobs_close([lp for _, lp in served], [lp for _, lp in want])
        assert isinstance(got[-1], Finish) and got[-1].completion_tokens == len(want)


def test_knn_score_with_a_window_other_than_the_datastores_is_refused(docs, servers):
    """The one settings rule: a kNN-LM Score request that names a window or stride other than the one the
    datastore's keys were made with (48, 24) is refused, naming the field; the datastore's own is accepted."""
    with client(servers["local"]) as c:
        for kwargs, field in (({"window_tokens": 32}, "window_tokens"),
                              ({"window_tokens": 48, "stride_tokens": 16}, "stride_tokens")):
            with pytest.raises(ServiceError) as e:
                c.score(docs, knn=KnnRequest(), **kwargs)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details
            assert "differs from the datastore's" in e.value.details
        same = c.score(docs, knn=KnnRequest(), window_tokens=48, stride_tokens=24)
        unset = c.score(docs, knn=KnnRequest())
    assert same == unset


def test_serve_lm_search_backend_torch_searches_the_keys_on_the_models_device(tmp_path):
    """`memlm serve lm --datastore DIR --search-backend torch`: the server's datastore searches its float16 keys
    exactly with torch (memlm.retrieval.exact) on the model's device; over a Flat index the same neighbours."""
    import numpy as np

    from datastore import build_datastore
    from services.lm.server import open_model_and_searcher

    corpus = tmp_path / "c.txt"
    corpus.write_text("the union is strong and the people are free. " * 12)
    store = build_datastore("tiny", str(corpus), tmp_path / "store", context=32, stride=16, progress=False)
    _, flat = open_model_and_searcher("tiny", datastore=str(store))
    _, exact = open_model_and_searcher("tiny", datastore=str(store), search_backend="torch")
    assert flat.exact is None and exact.exact is not None
    queries = np.asarray(flat.keys[:16], dtype=np.float32)  # (16, C)
    assert (exact.search(queries, 4).ids == flat.search(queries, 4).ids).mean() >= 0.95  # ties may swap
