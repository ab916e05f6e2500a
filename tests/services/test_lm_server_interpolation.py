"""An LM server given a saved interpolation (`serve lm --interpolation`) scores as the in-process evaluation
does (memlm.jobs.interpolation_eval on the same windows): learned weights with and without the document
cache, over an in-process datastore or a retrieval service; Generate mixes as Score; a constant file is the
server's constant lambda and T exactly; a file fitted elsewhere is refused at start."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from memlm.errors import MemlmError
from memlm.jobs.interpolation_eval import (
    CacheConfig,
    Timers,
    collect_interpolation_data,
    fit_method,
    group_logprobs,
    retrieved_groups,
)
from memlm.jobs.windows import WindowConfig, score_documents
from memlm.retrieval.interpolation import FitConfig, lm_features, save_method
from memlm.retrieval.knnlm import KNNLMConfig
from services.common.server import ServiceError
from services.lm.client import KnnRequest, LanguageModelClient
from services.lm.server import start_lm_server
from services.retrieval.client import RetrievalClient
from services.retrieval.server import create_retrieval_server

WINDOW = WindowConfig(48, 24, 4)
"""The index fixture's windows, which Score reads when a request leaves them unset."""
KNN = KNNLMConfig(k=8, lmbda=0.5, temperature=5.0)
CACHE = CacheConfig(size=64, k=16)
LEARNED_ATOL = 2e-3
"""The engine's and the evaluation's forward passes differ by float32 rounding (ENGINE_LOGPROB_ATOL); the tiny
random model's near-uniform distributions give the entropy feature a standard deviation of about 7e-4 on the
tuning text, so standardising it scales that rounding by about 1e3 before the learned weights read it."""
TUNE = "the quick dog and the lazy fox jump over a brown peck of peppers. " * 3
EVAL = ["Peter Piper jumps over the quick brown fox and the lazy dog. " * 2, "The lazy fox picked a pepper."]


@pytest.fixture(scope="module")
def setting(tiny, index, boundary, tmp_path_factory):
    """The tuning split's data and a directory for saved methods."""
    data = collect_interpolation_data(tiny.model, [tiny.tokenizer.encode(TUNE)], index, WINDOW, KNN, CACHE, boundary,
                                      progress=False)
    return data, tmp_path_factory.mktemp("interpolation")


def saved(setting, tiny, index, name: str, **changes) -> tuple[object, object]:
    data, root = setting
    method = fit_method(name, data, FitConfig())
    settings = {"model_fingerprint": tiny.fingerprint, "key_layer": tiny.model.config.key_description,
                "datastore_corpus_fingerprint": index.info().corpus_fingerprint, "k": KNN.k, "context": WINDOW.context,
                "stride": WINDOW.stride, "cache_size": CACHE.size, "cache_k": CACHE.k, **changes}
    return method, save_method(method, root / f"{name}.json", settings)


def in_process(tiny, index, boundary, docs, method) -> list[list[float]]:
    """Per document the evaluation's mixed log-probabilities of its tokens (one group per window)."""
    stream = score_documents(tiny.model, docs, WINDOW, boundary, with_logprobs=True, lm_features=lm_features)
    cache = CACHE if "cache" in method.sources else None
    out: list[list[float]] = [[] for _ in docs]
    for g in retrieved_groups(stream, index, KNN, cache, 1, Timers(tiny.model.device)):
        out[g.windows[0].doc].extend(group_logprobs(g, method).tolist())
    return out


def server(loop_thread, tiny, index, path, defaults=KNN) -> LanguageModelClient:
    """A client of a new LM server over `index` with `path`'s interpolation (None: none)."""
    started = loop_thread.run(start_lm_server("127.0.0.1:0", tiny, index, model_name="tiny", knn_defaults=defaults,
                                              interpolation=path))
    loop_thread.servers.append(started.running.server)
    return LanguageModelClient(f"127.0.0.1:{started.running.port}", timeout=60)


def served(loop_thread, tiny, index, path, *inputs, knn=KnnRequest(), defaults=KNN) -> list[list[float]]:
    with server(loop_thread, tiny, index, path, defaults) as client:
        return [[t.logprob for t in r.tokens] for r in client.score(list(inputs), knn=knn)]


@pytest.mark.parametrize("name", ["learned", "learned+cache"])
def test_learned_score_is_the_in_process_evaluation(loop_thread, setting, tiny, index, boundary, name):
    method, path = saved(setting, tiny, index, name)
    docs = [tiny.tokenizer.encode(t) for t in EVAL]
    got = served(loop_thread, tiny, index, path, *docs)
    want = in_process(tiny, index, boundary, docs, method)
    assert [len(g) for g in got] == [len(w) for w in want]
    assert all(np.allclose(g, w, rtol=0.0, atol=LEARNED_ATOL) for g, w in zip(got, want))
    constant, _ = saved(setting, tiny, index, "constant+cache" if "cache" in name else "constant")
    apart = [np.abs(np.subtract(g, c)).max() for g, c in zip(got, in_process(tiny, index, boundary, docs, constant))]
    assert max(apart) > 100 * LEARNED_ATOL  # the learned weights are in force, not the constant ones


def test_constant_file_is_the_constant_lambda(loop_thread, setting, tiny, index):
    method, path = saved(setting, tiny, index, "constant")
    docs = [tiny.tokenizer.encode(t) for t in EVAL]
    lam, temperature = method.weights[1], method.temperatures[0]
    got = served(loop_thread, tiny, index, path, *docs)
    # `serve lm --lambda L --knn-temperature T` (the wire's float32 would round a request's lambda)
    want = served(loop_thread, tiny, index, None, *docs, defaults=KNNLMConfig(k=KNN.k, lmbda=lam, temperature=temperature))
    assert got == want  # the same code path, bit for bit


def test_a_request_lambda_overrides_and_attribution_and_fewer_searches_are_refused(loop_thread, setting, tiny, index):
    _, path = saved(setting, tiny, index, "learned")
    docs = [tiny.tokenizer.encode(EVAL[1])]
    got = served(loop_thread, tiny, index, path, *docs, knn=KnnRequest(lmbda=0.5, temperature=5.0))
    assert got == served(loop_thread, tiny, index, None, *docs, knn=KnnRequest())  # KNN's own lambda and T
    with server(loop_thread, tiny, index, path) as client:
        with pytest.raises(ServiceError) as e:  # attribution splits a constant mixture
            client.score(docs, knn=KnnRequest(attribution_top_n=1))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.details.startswith("knn.attribution_top_n")
        with pytest.raises(ServiceError) as e:  # the weights were fitted on every token's search
            client.score(docs, knn=KnnRequest(pointers=True))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.details.startswith("knn.pointers")


def test_generate_mixes_as_score_does(loop_thread, setting, tiny, index):
    """Greedy Generate under a learned file: each token is the argmax of the mixture Score gives the same text."""
    _, path = saved(setting, tiny, index, "learned")
    prompt = tiny.tokenizer.encode("The quick brown fox")
    with server(loop_thread, tiny, index, path) as client:
        deltas = [e for e in client.generate(prompt, max_new_tokens=12, temperature=0.0, knn=KnnRequest())
                  if hasattr(e, "token_ids")]
        tokens = [t for d in deltas for t in d.token_ids]
        logprobs = [p for d in deltas for p in d.logprobs]
        scored = client.score([tokens], contexts=[prompt], knn=KnnRequest())[0].tokens
        constant = client.score([tokens], contexts=[prompt], knn=KnnRequest(lmbda=0.5, temperature=5.0))[0].tokens
    assert len(tokens) == 12 and all(t.is_greedy for t in scored)
    assert np.allclose(logprobs, [t.logprob for t in scored], rtol=0.0, atol=LEARNED_ATOL)
    assert np.abs(np.subtract(logprobs, [t.logprob for t in constant])).max() > 100 * LEARNED_ATOL


def test_generate_with_a_cache_file_is_refused(loop_thread, setting, tiny, index):
    _, path = saved(setting, tiny, index, "learned+cache")
    with server(loop_thread, tiny, index, path) as client:
        with pytest.raises(ServiceError) as e:
            list(client.generate("The quick", max_new_tokens=2, knn=KnnRequest()))
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and e.value.details.startswith("knn.lambda_weight")
        assert len(list(client.generate("The quick", max_new_tokens=2, knn=KnnRequest(lmbda=0.5, temperature=5.0)))) > 1


@pytest.mark.parametrize("setting_name", ["model_fingerprint", "key_layer", "datastore_corpus_fingerprint"])
def test_a_file_fitted_elsewhere_is_refused_at_start(loop_thread, setting, tiny, index, setting_name):
    _, path = saved(setting, tiny, index, "constant", **{setting_name: "another"})
    with pytest.raises(MemlmError, match=f"fitted with {setting_name} 'another'"):
        loop_thread.run(start_lm_server("127.0.0.1:0", tiny, index, knn_defaults=KNN, interpolation=path))


def test_through_the_retrieval_service_as_in_process(loop_thread, setting, tiny, index, boundary):
    method, path = saved(setting, tiny, index, "learned+cache")
    remote = RetrievalClient(f"127.0.0.1:{loop_thread.start(create_retrieval_server, '127.0.0.1:0', index)}")
    try:
        docs = [tiny.tokenizer.encode(t) for t in EVAL]
        got = served(loop_thread, tiny, remote, path, *docs)
    finally:
        remote.close()
    want = in_process(tiny, index, boundary, docs, method)
    assert all(np.allclose(g, w, rtol=0.0, atol=LEARNED_ATOL) for g, w in zip(got, want))
