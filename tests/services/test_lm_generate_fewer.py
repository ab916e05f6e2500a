"""Generate with fewer kNN-LM searches: KnnOptions pointers/min_pointers and adaptive_threshold through
a real LM server on port 0 equal `memlm generate`'s engine path (memlm.engine.fewer_rows with the same Retrieval)
token for token with the same searches and searches_saved, with the datastore in process; pointers through a
real retrieval server (its Successors rpc) are refused with FAILED_PRECONDITION naming knn.pointers (nothing
holds the lane's searches and a row's lookups to one datastore generation: services.lm.args.generate_retrieval_of),
and so is speculative with pointers."""

from __future__ import annotations

import grpc
import pytest
from tiny_models import fox_datastore, standardised_gate

from memlm.engine.engine import Engine, run_all
from memlm.engine.requests import EngineConfig, GenerationRequest
from memlm.jobs.decoding import SamplingConfig, TokenEvent
from memlm.jobs.knnlm_eval import Retrieval
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
from memlm.retrieval.pointers import PointerConfig
from services.lm.args import FewerSources, server_sources
from services.lm.client import Finish, KnnRequest, LanguageModelClient, TextDelta
from services.lm.requests import LMLimits
from services.lm.server import start_lm_server
from services.retrieval.client import RetrievalClient
from services.retrieval.server import create_retrieval_server
from services.retrieval.successors import successors_by_generation
from services.common.server import ServiceError

WINDOW = WindowConfig(48, 24, 4)
KNN = KNNLMConfig(k=8, lmbda=0.8, temperature=5.0)
PROMPTS = ["the lazy dog and", "The quick brown", "a fox"]
N = 20


@pytest.fixture(scope="module")
def tiny():
    return load_pretrained("tiny")


@pytest.fixture(scope="module")
def store(tiny, tmp_path_factory):
    return fox_datastore(tiny, tmp_path_factory.mktemp("gen_fewer"), WINDOW)


def gate(tiny) -> tuple[RetrievalGate, GateSettings]:
    return standardised_gate(tiny, [p + " the quick fox jumps over the lazy dog" for p in PROMPTS], WINDOW, KNN)


@pytest.fixture(scope="module")
def servers(tiny, store, module_loop):
    """"local": the datastore in process with a gate; "remote": through a real retrieval server."""
    local_sources = FewerSources(gate(tiny), server_sources(store, remote=False, gate_dir=None, model_fingerprint="",
                                                        key_layer="").pointers)
    started = module_loop.run(start_lm_server("127.0.0.1:0", tiny, store, knn_defaults=KNN, limits=LMLimits(),
                                              fewer=local_sources))
    module_loop.servers.append(started.running.server)
    retrieval = module_loop.start(create_retrieval_server, "127.0.0.1:0", store,
                                  successors=successors_by_generation(lambda: (store, 0)))
    link = RetrievalClient(f"127.0.0.1:{retrieval}")
    remote = module_loop.run(start_lm_server("127.0.0.1:0", tiny, link, knn_defaults=KNN, limits=LMLimits(),
                                             fewer=server_sources(link, remote=True, gate_dir=None, model_fingerprint="",
                                                                  key_layer="")))
    module_loop.servers.append(remote.running.server)
    yield {"local": f"127.0.0.1:{started.running.port}", "remote": f"127.0.0.1:{remote.running.port}",
           "local_sources": local_sources}
    link.close()


def rpc(address, asked: KnnRequest, seed=None):
    """Per prompt: (token ids, Finish) of a Generate call."""
    out = []
    with LanguageModelClient(address) as c:
        for p in PROMPTS:
            events = list(c.generate(p, max_new_tokens=N, temperature=0.0 if seed is None else 1.0, seed=seed, knn=asked))
            out.append(([t for e in events if isinstance(e, TextDelta) for t in e.token_ids],
                        next(e for e in events if isinstance(e, Finish))))
    return out


def engine(tiny, searcher, retrieval, seed=None):
    """Per prompt: (token ids, GenerationEnd) of memlm generate's engine path, one row at a time."""
    tok = tiny.tokenizer
    sampling = SamplingConfig(temperature=0.0 if seed is None else 1.0, seed=seed)
    reqs = [GenerationRequest(tuple(tok.encode(p)), N, sampling, boundary_token=document_boundary(tok), eos_id=tok.eos_id,
                              knn=KNN, fewer=retrieval) for p in PROMPTS]
    out = run_all(Engine(tiny.model, tok, EngineConfig(max_batch=1), searcher=searcher), reqs)
    return [([e.token_id for e in ev if isinstance(e, TokenEvent)], ev[-1]) for ev in out]


def assert_equal(got, want):
    for (g_tokens, g_end), (w_tokens, w_end) in zip(got, want):
        assert g_tokens == w_tokens
        assert (g_end.searches, g_end.searches_saved) == (w_end.searches, w_end.searches_saved)


def test_pointer_generate_equals_the_engine_in_process(tiny, store, servers):
    asked = KnnRequest(pointers=True, min_pointers=1)
    local = rpc(servers["local"], asked)
    assert_equal(local, engine(tiny, store, Retrieval(PointerConfig(min_pointers=1), servers["local_sources"].pointers())))
    assert sum(end.searches_saved for _, end in local) > 0
    plain = rpc(servers["local"], KnnRequest())
    assert all(end.searches_saved == 0 and end.searches > 0 for _, end in plain)


def test_adaptive_generate_equals_the_engine(tiny, store, servers):
    net, settings = servers["local_sources"].gate
    median = threshold_for_fraction(settings, 0.5)
    for asked, seed in ((KnnRequest(adaptive_fraction=0.5), None), (KnnRequest(adaptive_threshold=median, pointers=True), 5)):
        got = rpc(servers["local"], asked, seed)
        pointers = (PointerConfig(), servers["local_sources"].pointers()) if asked.pointers else (None, None)
        assert_equal(got, engine(tiny, store, Retrieval(*pointers, AdaptiveConfig(net, settings, median)), seed))
        saved = sum(end.searches_saved for _, end in got)
        assert 0 < saved < sum(end.searches + end.searches_saved for _, end in got)


def test_pointers_through_a_retrieval_service_are_refused_and_plain_knn_is_served(servers):
    with LanguageModelClient(servers["remote"]) as c:
        with pytest.raises(ServiceError) as e:
            list(c.generate("a fox", max_new_tokens=2, knn=KnnRequest(pointers=True, min_pointers=1)))
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and e.value.details.startswith("knn.pointers"), \
            e.value.details
        plain = [e for e in c.generate("a fox", max_new_tokens=3, temperature=0.0, knn=KnnRequest())
                 if isinstance(e, Finish)]
    assert plain[0].searches == 3 and plain[0].searches_saved == 0


def test_refusals_name_the_field(servers):
    with LanguageModelClient(servers["local"]) as c:
        for kwargs, code, field in (
            ({"knn": KnnRequest(pointers=True), "speculative": True}, grpc.StatusCode.FAILED_PRECONDITION, "speculative"),
            ({"knn": KnnRequest(min_pointers=2)}, grpc.StatusCode.INVALID_ARGUMENT, "knn.min_pointers"),
        ):
            with pytest.raises(ServiceError) as e:
                list(c.generate("a fox", max_new_tokens=2, **kwargs))
            assert e.value.code == code and e.value.details.startswith(field), e.value.details
