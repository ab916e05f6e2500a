"""The leakage guard: drop retrieved neighbours that are the query's own text, or next to it.

When the text being trained on (or evaluated) is itself in the datastore, a query's nearest key is
often the entry made from the very same position, whose value is the answer, so a SPALM gate (Yogatama
et al. 2021) trained on it learns to copy the retrieved token instead of when retrieval helps.
An entry leaks when it comes from the query's
document and its position is within `window` of the query's position. Positions follow
memlm.retrieval.searcher.Provenance: the boundary token is position 0, and a query's position is that of
the token it predicts (input index i predicts position i + 1), the same convention as the entries'.

Which datastore document a query's text is goes by document identity (`document_indices`): the
fingerprint of its text (memlm.data.documents.document_fingerprint) against the datastore's documents
table, so the same speech selected by a differently written split, or from another copy of the corpus
file, is still recognised (a corpus fingerprint names the selection, not the documents).

Library side: this takes a Provenance (from `datastore.Datastore.provenance`) and fingerprints (from
`datastore.Datastore.documents`), never a datastore.

Shape legend: Q queries, k neighbours.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from memlm.retrieval.searcher import Neighbors, Provenance


def exclude_nearby(
    neighbors: Neighbors,
    provenance: Provenance,
    query_docs: torch.Tensor,
    query_positions: torch.Tensor,
    window: int,
) -> Neighbors:
    """`neighbors` with every neighbour from the query's document within `window` positions masked.

    neighbors: (Q, k) arrays of a search; provenance: (Q, k) docs and positions of those ids
        (Datastore.provenance(neighbors.ids)).
    query_docs: (Q,) integer document index of each query, in the datastore build's corpus order
        (-1: a query from text outside the datastore, which nothing matches).
    query_positions: (Q,) integer position of the token each query predicts (boundary = 0).
    window: >= 0; a neighbour with |position - query position| <= window in the same document is masked
        (id -1, value -1, distance +inf), so window 0 removes the query's own entry only.
    Returns new Neighbors (Q, k), everything else unchanged; the rows are not re-sorted (masked
    entries keep their place, as missing neighbours do: consumers skip id -1 wherever it stands).
    """
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    q, k = neighbors.ids.shape
    for name, array in (("provenance.docs", provenance.docs), ("provenance.positions", provenance.positions)):
        if array.shape != (q, k):
            raise ValueError(f"{name} has shape {array.shape}, the neighbours {(q, k)}")
    for name, tensor in (("query_docs", query_docs), ("query_positions", query_positions)):
        if tuple(tensor.shape) != (q,):
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected ({q},)")
    docs = query_docs.detach().cpu().numpy().astype(np.int64)[:, None]  # (Q, 1)
    positions = query_positions.detach().cpu().numpy().astype(np.int64)[:, None]  # (Q, 1)
    same_doc = (provenance.docs.astype(np.int64) == docs) & (docs >= 0)  # (Q, k)
    near = np.abs(provenance.positions.astype(np.int64) - positions) <= window  # (Q, k)
    leak = same_doc & near & (neighbors.ids >= 0)  # (Q, k)
    return Neighbors(
        np.where(leak, np.float32(np.inf), neighbors.distances).astype(neighbors.distances.dtype),
        np.where(leak, -1, neighbors.ids).astype(neighbors.ids.dtype),
        np.where(leak, -1, neighbors.values).astype(neighbors.values.dtype),
    )


def document_indices(datastore_fingerprints: Sequence[str], fingerprints: Sequence[str]) -> list[list[int]]:
    """For each document of `fingerprints`, the indices (the datastore's document order, the provenance's
    doc index) of the datastore documents with the same fingerprint, in increasing order: one for a
    document the datastore holds once, more for a text it holds several copies of, none where absent
    (such a query's document is -1 for exclude_nearby: nothing of it is masked).
    datastore_fingerprints: the datastore's documents table, record i's fingerprint at i."""
    where: dict[str, list[int]] = {}
    for index, fingerprint in enumerate(datastore_fingerprints):
        where.setdefault(fingerprint, []).append(index)
    return [list(where.get(f, ())) for f in fingerprints]


def copy_level(indices: Sequence[Sequence[int]], level: int) -> list[int]:
    """The `level`-th datastore copy of each document (document_indices' lists), -1 where it has fewer:
    the query documents of one exclude_nearby pass (one pass per copy level masks every copy)."""
    return [d[level] if level < len(d) else -1 for d in indices]
