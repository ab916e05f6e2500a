"""Score with fewer kNN-LM searches: KnnOptions pointers/min_pointers and adaptive_threshold/
adaptive_fraction through a real LM server on port 0 equal the library (memlm.jobs.scoring.score_tokens with the
same Retrieval) bit for bit, with the datastore in process and behind a real retrieval server (pointers through
its Successors rpc); results carry searches and searches_saved; what is not served is refused naming the field."""

from __future__ import annotations

import grpc
import pytest
from tiny_models import fox_datastore, standardised_gate

from memlm.jobs.knnlm_eval import Retrieval
from memlm.jobs.scoring import score_tokens
from memlm.jobs.windows import WindowConfig
from memlm.model.tokenizer import document_boundary
from memlm.model.weights import load_pretrained
from memlm.retrieval.adaptive import (
    AdaptiveConfig,
    GateSettings,
    RetrievalGate,
    threshold_for_fraction,
)
from memlm.retrieval.knnlm import KNNLMConfig
from memlm.retrieval.pointers import PointerConfig, PointerSource
from services.lm.args import FewerSources, server_sources
from services.lm.client import KnnRequest, LanguageModelClient
from services.lm.requests import LMLimits
from services.lm.server import start_lm_server
from services.retrieval.client import RetrievalClient
from services.retrieval.server import create_retrieval_server
from services.retrieval.successors import successors_by_generation, table_of
from services.common.server import ServiceError

WINDOW = WindowConfig(48, 24, 4)
KNN = KNNLMConfig(k=8, lmbda=0.5, temperature=5.0)
LIMITS = LMLimits(max_score_tokens=400)
TEXTS = ["the lazy dog and the quick fox " * 4, "The quick brown fox jumps over the lazy dog. " * 2]


@pytest.fixture(scope="module")
def tiny():
    return load_pretrained("tiny")


@pytest.fixture(scope="module")
def store(tiny, tmp_path_factory):
    return fox_datastore(tiny, tmp_path_factory.mktemp("fewer"), WINDOW)


def gate(tiny) -> tuple[RetrievalGate, GateSettings]:
    return standardised_gate(tiny, TEXTS, WINDOW, KNN)


@pytest.fixture(scope="module")
def servers(tiny, store, module_loop):
    """("local": the datastore in process, with a gate; "remote": through a retrieval server, no gate;
    "plain_gate": no datastore)."""
    local_sources = FewerSources(gate(tiny), server_sources(store, remote=False, gate_dir=None, model_fingerprint="",
                                                        key_layer="").pointers)
    started = module_loop.run(start_lm_server("127.0.0.1:0", tiny, store, knn_defaults=KNN, limits=LIMITS,
                                              fewer=local_sources))
    module_loop.servers.append(started.running.server)
    retrieval = module_loop.start(create_retrieval_server, "127.0.0.1:0", store,
                                  successors=successors_by_generation(lambda: (store, 0)))
    link = RetrievalClient(f"127.0.0.1:{retrieval}")
    remote = module_loop.run(start_lm_server("127.0.0.1:0", tiny, link, knn_defaults=KNN, limits=LIMITS,
                                             fewer=server_sources(link, remote=True, gate_dir=None, model_fingerprint="",
                                                                  key_layer="")))
    module_loop.servers.append(remote.running.server)
    yield {"local": f"127.0.0.1:{started.running.port}", "remote": f"127.0.0.1:{remote.running.port}",
           "local_sources": local_sources}
    link.close()


def library(tiny, store, docs, retrieval):
    step = min(WINDOW.context, max(len(d) for d in docs))
    return score_tokens(tiny.model, docs, context=WINDOW.context, stride=WINDOW.stride,
                        boundary_token=document_boundary(tiny.tokenizer), searcher=store, knn=KNN, top_n=2,
                        batch_size=LIMITS.step_rows(step), retrieval=retrieval)


def assert_equal(remote, local):
    for r, s in zip(remote, local):
        assert [t.logprob for t in r.tokens] == s.logprob.tolist()
        assert [t.is_greedy for t in r.tokens] == s.greedy.tolist()
        assert [[a.token_id for a in t.alternatives] for t in r.tokens] == s.top_ids.tolist()
        assert r.searches == s.searches and r.searches_saved == len(s.tokens) - s.searches


def test_pointers_score_equals_the_library_in_process_and_through_the_retrieval_service(tiny, store, servers):
    docs = [tiny.tokenizer.encode(t) for t in TEXTS]
    asked = KnnRequest(pointers=True, min_pointers=1)
    with LanguageModelClient(servers["local"]) as a, LanguageModelClient(servers["remote"]) as b:
        here, there, plain = a.score(docs, knn=asked, top_n=2), b.score(docs, knn=asked, top_n=2), a.score(docs, knn=KnnRequest())
    exact = library(tiny, store, docs, Retrieval(PointerConfig(min_pointers=1), servers["local_sources"].pointers()))
    assert_equal(here, exact)
    carried = library(tiny, store, docs, Retrieval(PointerConfig(min_pointers=1), PointerSource(table_of(store), None)))
    assert_equal(there, carried)  # the remote walk has no keys: pointers carry their predecessor's distance
    assert sum(r.searches_saved for r in here) > 0 and all(r.searches + r.searches_saved == len(r.tokens) for r in here)
    assert all(p.searches == len(p.tokens) and p.searches_saved == 0 for p in plain)


def test_adaptive_score_equals_the_library(tiny, store, servers):
    docs = [tiny.tokenizer.encode(t) for t in TEXTS]
    net, settings = servers["local_sources"].gate
    with LanguageModelClient(servers["local"]) as c:
        median = threshold_for_fraction(settings, 0.5)
        for asked, threshold in ((KnnRequest(adaptive_threshold=median), median), (KnnRequest(adaptive_fraction=0.5), median),
                                 (KnnRequest(adaptive_threshold=median, pointers=True), median)):
            got = c.score(docs, knn=asked, top_n=2)
            pointers = (PointerConfig(), servers["local_sources"].pointers()) if asked.pointers else (None, None)
            want = library(tiny, store, docs, Retrieval(*pointers, AdaptiveConfig(net, settings, threshold)))
            assert_equal(got, want)
            saved = sum(r.searches_saved for r in got)
            assert 0 < saved < sum(len(r.tokens) for r in got)  # the gate skips some tokens, not all


def test_fewer_searches_refusals_name_the_field(tiny, servers):
    with LanguageModelClient(servers["remote"]) as c:
        for kwargs, code, field in (
            ({"knn": KnnRequest(adaptive_threshold=0.5)}, grpc.StatusCode.FAILED_PRECONDITION, "knn.adaptive_threshold"),
            ({"knn": KnnRequest(min_pointers=2)}, grpc.StatusCode.INVALID_ARGUMENT, "knn.min_pointers"),
            ({"knn": KnnRequest(pointers=True, attribution_top_n=1)}, grpc.StatusCode.INVALID_ARGUMENT, "knn.pointers"),
            ({"knn": KnnRequest(pointers=True), "memory_mode": "xl"}, grpc.StatusCode.UNIMPLEMENTED, "knn.pointers"),
        ):
            with pytest.raises(ServiceError) as e:
                c.score(["the lazy dog"], **kwargs)
            assert e.value.code == code and e.value.details.startswith(field), e.value.details
        with pytest.raises(ServiceError) as e:
            list(c.generate("the lazy", max_new_tokens=2, knn=KnnRequest(pointers=True), memory_mode="xl"))
        assert e.value.code == grpc.StatusCode.UNIMPLEMENTED and e.value.details.startswith("knn.pointers")
