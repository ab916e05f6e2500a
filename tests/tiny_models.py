"""Small helpers shared by the model, memory and training tests (a module of its own: every `conftest`
of the tree shares that one module name, so helpers imported from it resolve to whichever loaded first)."""

from __future__ import annotations

import torch


def sharp_tiny_model(n_layer: int = 2, seed: int = 0):
    """The tiny preset with weights drawn at std 0.2 (not the default 0.02), so that attention is far from
    uniform and a wrong memory shows in the logits."""
    from memlm.model.config import ModelConfig
    from memlm.model.decoder import build_model

    torch.manual_seed(seed)
    model = build_model(ModelConfig.from_name("tiny", n_layer=n_layer))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else None
    return model.eval()


def phrase_documents(n_docs: int, length: int, seed: int = 0) -> list[list[int]]:
    """Learnable byte documents: each repeats a random 12-token phrase, so memory of the phrase helps."""
    import random

    rng = random.Random(seed)
    docs = []
    for _ in range(n_docs):
        phrase = [rng.randrange(97, 123) for _ in range(12)]
        docs.append((phrase * (length // 12 + 1))[:length])
    return docs


class RowWiseSearcher:
    """A Searcher whose answer for a query does not depend on the other queries of the call (an exact search
    one row at a time), so that plain and walked (or gated) kNN-LM meet the same floats."""

    def __init__(self, exact) -> None:
        self.exact, self.dim, self.calls, self.rows, self.sizes = exact, exact.dim, 0, 0, []

    def info(self):
        return self.exact.info()

    def search(self, xq, k, options=None):
        import numpy as np

        from memlm.retrieval.searcher import Neighbors

        self.calls += 1
        self.rows += xq.shape[0]
        self.sizes.append(xq.shape[0])
        parts = [self.exact.search(xq[i : i + 1], k) for i in range(xq.shape[0])]
        return Neighbors(*(np.concatenate([p[f] for p in parts]) for f in range(3)))


def own_text_datastore(model, documents: list[list[int]]):
    """A datastore of `documents` (token ids, each starting with its boundary token) under `model`, for
    speculative decoding: (TorchExactSearcher over the keys, memlm.engine.drafts.DraftSource of its
    successors and suffix index). Entry i of a document is (key at input index i, token i + 1) at position i + 1, as the
    builder writes them (memlm.retrieval.searcher.Provenance)."""
    import numpy as np

    from memlm.engine.drafts import draft_source
    from memlm.retrieval.exact import TorchExactSearcher
    from memlm.retrieval.searcher import Provenance

    keys, values, docs, positions = [], [], [], []
    with torch.inference_mode():
        for d, ids in enumerate(documents):
            keys.append(model(torch.tensor([ids[:-1]])).knn_key[0].float())  # (n, C)
            values += ids[1:]
            docs += [d] * (len(ids) - 1)
            positions += range(1, len(ids))
    values_np = np.array(values, dtype=np.int32)
    docs_np, pos_np = np.array(docs, dtype=np.int32), np.array(positions, dtype=np.int32)

    def lookup(ids):
        return Provenance(docs_np[ids], pos_np[ids])

    return TorchExactSearcher(torch.cat(keys), values_np), draft_source(lookup, values_np)


def repeated_phrase_documents(vocab_size: int) -> list[list[int]]:
    """Four documents (7, 3, 9 and 5 phrases long) cycling through three random 9-token phrases of ids in
    [2, vocab_size), so that RetoMaton pointers survive for several steps."""
    import numpy as np

    rng = np.random.default_rng(1)
    phrases = [rng.integers(2, vocab_size, size=9).tolist() for _ in range(3)]
    return [[t for j in range(n) for t in phrases[(i + j) % 3]] for i, n in enumerate((7, 3, 9, 5))]


ENGINE_LOGPROB_RTOL, ENGINE_LOGPROB_ATOL = 1e-5, 1e-6
"""How far a log-prob from the decoding engine (a Score or Generate row in a shared batch, its cache layout) may
be from another path's (the library's one-sequence functions, or the same call alone): float32 rounding of
another summation order only, a few ulps (float32 eps 1.2e-7) with margin. Measured over the four services
tests that use it (test_lm_server, _windows, test_security, test_lm_engine_score): at most 3.3e-6 (relative
1.3e-6), 0.13 of the bound; the 1024-token windows that test_lm_server_windows tells apart: 5.7."""


def logprobs_close(got, want) -> bool:
    """Same length and |got - want| <= ENGINE_LOGPROB_ATOL + ENGINE_LOGPROB_RTOL * |want| for every token (equal
    infinities are close): the one tolerance of engine-vs-library log-probs in the services tests."""
    import numpy as np

    g, w = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return g.shape == w.shape and bool(np.isclose(g, w, rtol=ENGINE_LOGPROB_RTOL, atol=ENGINE_LOGPROB_ATOL).all())


FOX_TEXTS = ("the lazy dog and the quick fox " * 5, "The quick brown fox jumps. " * 4)
"""The two texts of the fewer-searches service tests' datastore."""


def fox_datastore(pretrained, directory, window):
    """A Flat datastore of FOX_TEXTS under `pretrained` (load_pretrained("tiny")) with `window`
    (a WindowConfig), built in `directory` and opened."""
    from datastore import BuildSettings, BuildSource, Datastore, build_from_tokens
    from memlm.model.tokenizer import document_boundary

    tok = pretrained.tokenizer
    docs = [tok.encode(t) for t in FOX_TEXTS]
    source = BuildSource(model_name="tiny", model_fingerprint=pretrained.fingerprint,
                         tokenizer_fingerprint=tok.fingerprint, corpus="texts", corpus_fingerprint="c" * 64,
                         boundary_token=document_boundary(tok))
    out = build_from_tokens(pretrained.model, docs, directory / "ds", source,
                            BuildSettings(window=window, index_factory="Flat"), progress=False, log=lambda m: None)
    return Datastore.open(out)


def standardised_gate(pretrained, texts, window, knn):
    """A random retrieval gate (hidden 8, seed 3) standardised on the features of `texts` under `pretrained`,
    its score quantiles theirs: (RetrievalGate, GateSettings) recorded for `knn` (a KNNLMConfig)."""
    from memlm.jobs.windows import score_documents
    from memlm.model.tokenizer import document_boundary
    from memlm.retrieval.adaptive import GateConfig, GateSettings, RetrievalGate, distribution_features, score_quantiles

    with torch.random.fork_rng(devices=[]):  # the global RNG stays as other tests expect it
        torch.manual_seed(3)
        net = RetrievalGate(5, 8)
    docs = [pretrained.tokenizer.encode(t) for t in texts]
    x = torch.cat([s.features for s in score_documents(pretrained.model, docs, window,
                                                       document_boundary(pretrained.tokenizer),
                                                       lm_features=distribution_features)])  # (n, 5)
    net.mean.copy_(x.mean(dim=0))
    net.std.copy_(x.std(dim=0))
    return net.eval(), GateSettings("m", "k", "c" * 64, knn.k, knn.temperature, knn.lmbda, GateConfig(hidden=8), 5, (),
                                    "t", 1, 0.5, 0.5, score_quantiles(net.scores(x)))
