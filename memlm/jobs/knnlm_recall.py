"""kNN-LM evaluation, recall: how many of the exact k nearest neighbours the evaluation's searcher returns.

Shape legend: Q queries, k neighbours, d key dimension, R sampled evaluation keys.
"""

from __future__ import annotations

import numpy as np

from memlm.retrieval.knnlm import KNNLMConfig
from memlm.retrieval.searcher import Searcher, SearchOptions


def recall_at_k(
    searcher: Searcher,
    exact_searcher: Searcher,
    queries: np.ndarray,
    k: int,
    options: SearchOptions | None = None,
) -> float:
    """Mean fraction of the exact k nearest ids that `searcher` (searched with `options`) also returns,
    over queries (Q, d) float32."""
    approx = searcher.search(queries, k, options).ids  # (Q, k)
    exact = exact_searcher.search(queries, k).ids  # (Q, k)
    hits = 0
    count = 0
    for a, e in zip(approx, exact):
        e = e[e >= 0]
        hits += np.intersect1d(a[a >= 0], e).size
        count += e.size
    return hits / count if count else 1.0


EXACT_RECALL_MAX_BYTES = 8 << 30
"""Most memory a TorchExactSearcher for the recall check may take (memlm.retrieval.exact.searcher_bytes)."""



def recall_result(searcher: Searcher, exact_searcher: Searcher, queries: np.ndarray, knn_config: KNNLMConfig) -> dict:
    """recall_k, recall_at_k, recall_at_10, recall_queries over sampled evaluation keys (R, d), searched with
    the options of the evaluation itself: recall says how good the neighbours it used were."""
    options, k = knn_config.search_options, knn_config.k
    return {
        "recall_k": k,
        "recall_at_k": recall_at_k(searcher, exact_searcher, queries, k, options),
        "recall_at_10": recall_at_k(searcher, exact_searcher, queries, min(10, k), options),
        "recall_queries": int(queries.shape[0]),
    }
