"""Attribution: per scored token, the documents its p_kNN mass came from.

Oracles: the interpolation identity (p = lambda p_kNN + (1 - lambda) p_LM, so p_kNN follows from the
scores' final and base log-probabilities) for "shares sum to the kNN mass"; a document scored as it was
stored for "the top document is that document"; the in-process datastore for the retrieval service."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

from datastore import BuildSettings, BuildSource, Datastore, build_from_tokens
from datastore.documents import SourceDocument, token_fingerprint
from memlm.errors import MemlmError
from memlm.jobs.scoring import score_tokens
from memlm.jobs.windows import WindowConfig
from memlm.model.config import ModelConfig
from memlm.model.decoder import build_model
from memlm.retrieval.exact import TorchExactSearcher
from memlm.retrieval.knnlm import KNNLMConfig

VOCAB, BOS, CONTEXT, STRIDE = 64, 1, 48, 24
SOURCE = BuildSource(model_name="tiny-test", model_fingerprint="m" * 64, tokenizer_fingerprint="t" * 64,
                     corpus="random tokens", corpus_fingerprint="c" * 64, boundary_token=BOS)
SETTINGS = BuildSettings(window=WindowConfig(context=CONTEXT, stride=STRIDE, batch_size=1), index_factory="Flat")
KNN = KNNLMConfig(k=16, lmbda=0.5, temperature=1.0)


def tiny_model():
    torch.manual_seed(0)
    return build_model(ModelConfig.from_name("tiny", vocab_size=VOCAB)).eval()


def documents() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(2, VOCAB, size=n).tolist() for n in (200, 90, 150, 120)]


def sources(docs: list[list[int]], first: int = 0) -> list[SourceDocument]:
    return [SourceDocument(d, token_fingerprint(d), {"title": f"speech {first + i}", "year": 1990 + first + i})
            for i, d in enumerate(docs)]


def build(docs, out) -> Datastore:
    return Datastore.open(build_from_tokens(tiny_model(), docs, out, SOURCE, SETTINGS, progress=False,
                                            log=lambda m: None))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return build(sources(documents()), tmp_path_factory.mktemp("attr") / "store")


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """The same documents in two shard datastores (documents 0-1 and 2-3)."""
    root = tmp_path_factory.mktemp("attr-shards")
    return build(sources(documents()[:2]), root / "s0"), build(sources(documents()[2:], 2), root / "s1")


def score(model, store, seqs, attribution, knn=KNN):
    return score_tokens(model, seqs, context=CONTEXT, stride=STRIDE, boundary_token=BOS, searcher=store, knn=knn,
                        attribution=attribution)


def test_shares_sum_to_the_knn_mass(store):
    model = tiny_model()
    rng = np.random.default_rng(9)
    seqs = [documents()[1][:40] + rng.integers(2, VOCAB, size=60).tolist()]  # half known, half new text
    (s,) = score(model, store, seqs, attribution=len(store.documents()))  # every document with mass is listed
    assert len(s.attribution) == len(s.tokens)
    lam = KNN.lmbda
    p_knn = (np.exp(s.logprob.astype(np.float64)) - (1 - lam) * np.exp(s.base_logprob.astype(np.float64))) / lam
    for a, want, final in zip(s.attribution, p_knn, s.logprob):
        masses = [d.knn_mass for d in a.documents]
        assert abs(sum(masses) - want) <= 1e-6 and abs(a.knn_prob - want) <= 1e-6
        assert masses == sorted(masses, reverse=True) and all(m > 0 for m in masses)
        assert abs(sum(d.final_share for d in a.documents) - lam * a.knn_prob / np.exp(float(final))) <= 1e-6
        assert a.generation == 0
    assert any(a.documents for a in s.attribution) and any(not a.documents for a in s.attribution)


def test_the_top_document_of_a_stored_document_is_that_document(store):
    model = tiny_model()
    records = store.documents()
    docs = documents()
    results = score(model, store, docs, attribution=2)
    for record, s in zip(records, results):
        tops = [a.documents[0].source.doc_id for a in s.attribution]
        assert tops == [record.doc_id] * len(s.tokens)
        assert all(a.documents[0].source.meta == record.meta for a in s.attribution)
    # Scores do not change with attribution.
    plain = score(model, store, docs, attribution=0)
    for a, b in zip(results, plain):
        np.testing.assert_array_equal(a.logprob, b.logprob)
        assert b.attribution == ()


def test_attribution_needs_a_searcher_with_documents(store):
    model = tiny_model()
    bare = TorchExactSearcher(torch.from_numpy(np.array(store.keys)), np.asarray(store.values), info=store.info())
    with pytest.raises(MemlmError, match="documents table"):
        score(model, bare, [[5, 6, 7]], attribution=1)
    with pytest.raises(MemlmError, match="needs kNN-LM"):
        score_tokens(model, [[5, 6, 7]], context=CONTEXT, stride=STRIDE, boundary_token=BOS, attribution=1)


class Servers:
    """Retrieval servers (and a router over them) on port 0, on an event loop of their own thread."""

    def __init__(self, stores, router: bool, options=None) -> None:
        from services.retrieval.server import start_retrieval_server
        from services.router.server import start_router_server
        from services.common.server import ServerOptions

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        options = options or ServerOptions()
        self.running = [self._run(start_retrieval_server("127.0.0.1:0", s, options=options)).running for s in stores]
        if router:
            self.running.append(self._run(start_router_server(
                "127.0.0.1:0", [f"127.0.0.1:{r.port}" for r in self.running])))
        self.address = f"127.0.0.1:{self.running[-1].port}"

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def close(self) -> None:
        for r in reversed(self.running):
            self._run(r.server.stop(None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def same_attribution(a, b, tol: float) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert [d.source for d in x.documents] == [d.source for d in y.documents]
        np.testing.assert_allclose([d.knn_mass for d in x.documents], [d.knn_mass for d in y.documents], rtol=0,
                                   atol=tol)
        np.testing.assert_allclose([d.final_share for d in x.documents], [d.final_share for d in y.documents],
                                   rtol=0, atol=tol)
        assert abs(x.knn_prob - y.knn_prob) <= tol


@pytest.mark.parametrize("through", ["server", "router"])
def test_through_the_retrieval_service_equals_in_process(store, shards, through):
    from services.retrieval.client import RetrievalClient

    model = tiny_model()
    rng = np.random.default_rng(5)
    seqs = [documents()[2][:70], rng.integers(2, VOCAB, size=50).tolist()]
    local = score(model, store, seqs, attribution=3)
    servers = Servers([store] if through == "server" else list(shards), router=through == "router")
    try:
        with RetrievalClient(servers.address) as remote:
            served = score(model, remote, seqs, attribution=3)
            found = remote.search_sourced(np.asarray(store.keys[:5], dtype=np.float32), 4)
    finally:
        servers.close()
    for a, b in zip(local, served):
        np.testing.assert_array_equal(a.logprob, b.logprob)
        # One server: bit for bit; a router sums each document's mass over the shards' merged rows.
        same_attribution(a.attribution, b.attribution, 0.0 if through == "server" else 1e-9)
    assert {d.source.meta["title"] for s in served for a in s.attribution for d in a.documents} >= {"speech 2"}
    own = store.search_sourced(np.asarray(store.keys[:5], dtype=np.float32), 4)
    names = lambda r: [[r.sources[i].doc_id if i >= 0 else None for i in row] for row in r.documents]
    assert names(found) == names(own) and found.generation == 0


def test_segment_scoring_attributes_too(store):
    from memlm.jobs.scoring import score_tokens_segments
    from memlm.model.memory_config import MemoryConfig

    model = tiny_model()
    seqs = [documents()[0][:60], documents()[3][:30]]
    memory = MemoryConfig("xl", mem_len=16, sink_tokens=2, segment=16)
    runs = [score_tokens_segments(model, seqs, memory=memory, boundary_token=BOS, searcher=store, knn=KNN,
                                  attribution=n) for n in (len(store.documents()), 0)]
    for s, plain in zip(*runs):
        np.testing.assert_array_equal(s.logprob, plain.logprob)
        assert len(s.attribution) == len(s.tokens) and plain.attribution == ()
        p_knn = (np.exp(s.logprob.astype(np.float64)) - 0.5 * np.exp(s.base_logprob.astype(np.float64))) / 0.5
        for a, want in zip(s.attribution, p_knn):
            assert abs(sum(d.knn_mass for d in a.documents) - want) <= 1e-6


def test_sources_too_big_for_a_message_are_refused_in_one_line(tmp_path):
    import grpc

    from services.retrieval.client import RetrievalClient
    from services.common.server import ServerOptions, ServiceError

    docs = documents()
    big = [SourceDocument(d, token_fingerprint(d), {"title": "x" * 40_000}) for d in docs]  # 40 kB of metadata each
    store = build(big, tmp_path / "big")
    servers = Servers([store], router=False, options=ServerOptions(max_message_bytes=64 * 1024))
    try:
        with RetrievalClient(servers.address, max_message_bytes=64 * 1024) as remote:
            xq = np.asarray(store.keys[[0, 250, 400, 500]], dtype=np.float32)  # one key of each document
            assert remote.search(xq, 8).ids.shape == (4, 8)  # the neighbours alone fit
            with pytest.raises(ServiceError, match="with_documents: the response") as e:
                remote.search_sourced(xq, 8)
            assert e.value.code == grpc.StatusCode.OUT_OF_RANGE
    finally:
        servers.close()
