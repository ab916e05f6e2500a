"""The LM server scores with the windows its datastore's keys were made with when a Score request leaves
them unset (one rule for an artifact's settings, never a server literal of its own)."""

from __future__ import annotations

from tiny_models import logprobs_close

from memlm.jobs.scoring import score_tokens
from memlm.jobs.windows import WindowConfig
from memlm.model.tokenizer import document_boundary
from memlm.model.weights import load_pretrained
from memlm.jobs.windows import exact_searcher_over_documents
from memlm.retrieval.knnlm import KNNLMConfig
from services.lm.client import KnnRequest, LanguageModelClient
from services.lm.server import create_lm_server

KNN = KNNLMConfig(k=8, lmbda=0.5, temperature=5.0)


def test_unset_windows_are_the_datastores(loop_thread):
    tiny = load_pretrained("tiny")
    tok, boundary = tiny.tokenizer, document_boundary(tiny.tokenizer)
    docs = [tok.encode("The quick brown fox jumps over the lazy dog. " * 4)]  # 180 tokens: many 48-token windows
    index = exact_searcher_over_documents(tiny.model, docs, WindowConfig(48, 24, 4), boundary,
                                          model_fingerprint=tiny.fingerprint, tokenizer_fingerprint=tok.fingerprint)
    port = loop_thread.start(create_lm_server, "127.0.0.1:0", tiny, index, knn_defaults=KNN)
    with LanguageModelClient(f"127.0.0.1:{port}", timeout=60) as client:
        got = [t.logprob for t in client.score(docs, knn=KnnRequest())[0].tokens]
        no_knn = [t.logprob for t in client.score(docs)[0].tokens]

    def in_process(context: int, stride: int, knn: KNNLMConfig | None = KNN) -> list[float]:
        return score_tokens(tiny.model, docs, context=context, stride=stride, boundary_token=boundary,
                            searcher=index if knn else None, knn=knn)[0].logprob.tolist()

    # Score runs on the engine (services.lm.score_engine): float32 rounding of its cache layout only.
    assert logprobs_close(got, in_process(48, 24))
    assert logprobs_close(no_knn, in_process(48, 24, knn=None))  # the datastore's windows
    assert not logprobs_close(got, in_process(1024, 512))  # tells them from a fixed 1024/512 default
