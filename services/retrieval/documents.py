"""Neighbours' documents on the wire (attribution): SearchRequest.with_documents asks a
retrieval server (or a router) to say each neighbour's document, SearchResponse.documents ([Q, k] int32
indices) into SearchResponse.sources (doc_id + metadata JSON, each document once), all from the generation
that answered: provenance travels with the neighbours, so it cannot come from another generation than
theirs (a live datastore may switch between two calls).

A router merges the shards' answers: each shard's indices are shifted past the sources of the shards
before it, and after the global top-k only the sources still pointed to are kept.

Shape legend: Q queries, k neighbours, S sources, Z shards.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import numpy as np

from memlm.retrieval.attribution import (
    DocumentSource,
    SourcedNeighbors,
    compact_sources,
)
from memlm.retrieval.searcher import Neighbors
from memlm.v1 import retrieval_pb2, tensor_pb2
from services.common.tensors import TensorError, from_tensor, to_tensor

DOCUMENT_BYTES_PER_NEIGHBOUR = 4
"""Bytes per (query, neighbour) that SearchResponse.documents adds (int32); the sources' size is checked
on the built response (a few hundred bytes a document, at most one per neighbour)."""


def sources_to_proto(sources: Sequence[DocumentSource]) -> list[retrieval_pb2.SourceDocument]:
    return [retrieval_pb2.SourceDocument(doc_id=s.doc_id, meta_json=json.dumps(s.meta, ensure_ascii=False,
                                                                               sort_keys=True)) for s in sources]


def sources_from_proto(messages: Sequence[retrieval_pb2.SourceDocument]) -> tuple[DocumentSource, ...]:
    """SourceDocument messages -> DocumentSource; TensorError naming `sources` for metadata that is no JSON object."""
    out = []
    for i, m in enumerate(messages):
        try:
            meta = json.loads(m.meta_json)
        except json.JSONDecodeError as e:
            raise TensorError(f"sources[{i}].meta_json", f"not JSON ({e})") from None
        if not isinstance(meta, dict):
            raise TensorError(f"sources[{i}].meta_json", "not a JSON object")
        out.append(DocumentSource(m.doc_id, meta))
    return tuple(out)


def set_documents(response: retrieval_pb2.SearchResponse, found: SourcedNeighbors) -> None:
    """Fill a response's documents and sources from a sourced result (its neighbours are encoded apart)."""
    response.documents.CopyFrom(to_tensor(np.asarray(found.documents, dtype=np.int32)))
    response.sources.extend(sources_to_proto(found.sources))


def decode_sourced(response: retrieval_pb2.SearchResponse, neighbors: Neighbors, generation: int) -> SourcedNeighbors:
    """A with_documents response's documents and sources around its decoded neighbours (Q, k); TensorError
    naming the field when they are missing, of another shape, or point outside the sources."""
    if not response.HasField("documents"):
        raise TensorError("documents", "missing: the server did not answer with_documents")
    docs = from_tensor(response.documents, "documents", dtypes=(tensor_pb2.DTYPE_INT32,), ndim=2)  # (Q, k)
    if docs.shape != neighbors.ids.shape:
        raise TensorError("documents", f"shape {docs.shape}, expected {neighbors.ids.shape}")
    sources = sources_from_proto(response.sources)
    if ((docs < -1) | (docs >= len(sources))).any():
        raise TensorError("documents", f"an index outside the {len(sources)} sources")
    return SourcedNeighbors(neighbors, np.array(docs), sources, generation)


def merge_sourced(parts: Sequence[SourcedNeighbors], order: np.ndarray, merged: Neighbors) -> SourcedNeighbors:
    """The router's merge of the shards' documents: `order` (Q, k) picked columns of the shards' neighbours
    side by side (Z * k columns, shard order), as merge_top_k picked them into `merged`."""
    documents, sources = [], []
    for part in parts:
        documents.append(np.where(part.documents >= 0, part.documents + len(sources), -1))  # (Q, k)
        sources.extend(part.sources)
    docs = np.take_along_axis(np.concatenate(documents, axis=1), order, axis=1).astype(np.int32)  # (Q, k)
    return compact_sources(SourcedNeighbors(merged, docs, tuple(sources), 0))
