"""kNN-LM evaluation: score documents with the base LM and kNN-LM in one pass, tune lambda and T on a
separate split, measure recall@k against exact search. The stages, in data-flow order: windows -> groups
of queries (memlm.jobs.knnlm_groups), lambda and T from a tuning split (memlm.jobs.knnlm_tune), the
evaluation pass: searches, pointer walk or gate, interpolation (memlm.jobs.knnlm_pass), recall
(memlm.jobs.knnlm_recall); this module runs them in that order.

Shape legend: Q queries (scored tokens), k neighbours, V vocab, d key dimension, n tuning tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from memlm.errors import MemlmError
from memlm.jobs.knnlm_pass import Retrieval, knn_pass, pass_result
from memlm.jobs.knnlm_recall import EXACT_RECALL_MAX_BYTES, recall_at_k, recall_result
from memlm.jobs.knnlm_tune import (
    DEFAULT_LAMBDAS,
    Tuned,
    TuningData,
    collect_tuning_data,
    tune,
)
from memlm.jobs.windows import WindowConfig
from memlm.model.decoder import Decoder
from memlm.retrieval.attribution import AttributionWriter
from memlm.retrieval.knnlm import KNNLMConfig
from memlm.retrieval.searcher import Searcher

__all__ = ["DEFAULT_LAMBDAS", "EXACT_RECALL_MAX_BYTES", "Retrieval", "Tuned", "TuningData", "collect_tuning_data",
           "evaluate_knnlm", "recall_at_k", "tune"]
"""Re-exported: the names callers imported from here before the split (one definition each, in the stage's
module)."""


def evaluate_knnlm(
    model: Decoder,
    token_docs: Sequence[list[int]],
    searcher: Searcher,
    window_config: WindowConfig,
    knn_config: KNNLMConfig,
    boundary_token: int,
    *,
    tune_docs: Sequence[list[int]] | None = None,
    exact_searcher: Searcher | None = None,
    recall_queries: int = 256,
    search_tokens: int = 1024,
    progress: bool = True,
    retrieval: Retrieval | None = None,
    attribution: AttributionWriter | None = None,
) -> dict[str, Any]:
    """Base and kNN-LM perplexity of `model` on `token_docs`, side by side.

    model, token_docs, window_config, boundary_token: as `memlm.jobs.evaluate.evaluate_perplexity` (the same
        windows, so base_perplexity equals its perplexity exactly).
    searcher: the datastore (any Searcher); its keys must come from this model and key layer.
    knn_config: k, lambda, T, exact re-rank, nprobe; lambda/T None are tuned on tune_docs first.
    tune_docs: a tuning split, disjoint from token_docs; required when knn_config.needs_tuning.
    exact_searcher: ground truth for recall (e.g. `Datastore.exact_searcher()`, built by the caller, who
        knows whether the keys fit in memory); None: recall is not measured.
    recall_queries: evaluation keys (seeded random sample) on which recall@k is measured; 0: skip.
    search_tokens: scored tokens gathered per search call (bigger batches search faster).
    retrieval: fewer searches (issue 15; None: a search for every token): RetoMaton pointers (retrieval.pointers with retrieval.source, the
        datastore's successors, values and keys) and/or adaptive retrieval (retrieval.adaptive, a fitted gate
        and its threshold); lambda and T are tuned (when auto) with a search for every tuning token.
    attribution: write every evaluated token's top documents as it goes (memlm.retrieval.attribution); needs a
        search for every token (no pointers, no gate) and a searcher with a documents table.

    Returns a dict: tokens, base_nll, knnlm_nll, base_perplexity, knnlm_perplexity, perplexity (= kNN-LM),
    relative_change (knnlm / base - 1), lambda, temperature, tuned, tune_tokens, tune_base_perplexity,
    tune_knnlm_perplexity, k, exact_rerank, nprobe, knn_hit_rate (share of tokens with the target among
    the neighbours), forward_seconds, search_seconds, interpolate_seconds, base_tokens_per_s,
    knnlm_tokens_per_s, knnlm_speed_ratio, index, datastore_size (from searcher.info()), searches (query
    rows searched), searches_saved (tokens - searches), searches_saved_fraction, pointer_seconds and
    gate_seconds (0 without them); with pointers min_pointers, pointer_tokens (tokens scored from pointers
    alone) and stream_searches; with a gate adaptive_threshold and adaptive_skipped; and with an
    exact_searcher recall_at_k, recall_at_10, recall_k, recall_queries.
    """
    retrieval = retrieval or Retrieval()
    if attribution is not None and retrieval != Retrieval():
        raise MemlmError("--attribution needs a search for every token: not with RetoMaton pointers or a gate")
    if knn_config.needs_tuning and not tune_docs:
        raise MemlmError("--lambda auto / --temperature auto need a tuning split (--tune-data); "
                         "they are never tuned on the evaluation split")
    total = sum(len(d) for d in token_docs)
    if total == 0:
        raise MemlmError("nothing to evaluate: the corpus split tokenized to 0 tokens")
    result: dict[str, Any] = {"tuned": False, "tune_tokens": 0}
    lmbda, temperature = knn_config.lmbda, knn_config.temperature
    if knn_config.needs_tuning:
        data = collect_tuning_data(model, tune_docs, searcher, window_config, knn_config, boundary_token, progress)
        tuned = tune(data, fixed_lmbda=knn_config.lmbda, fixed_temperature=knn_config.temperature)
        lmbda, temperature = tuned.lmbda, tuned.temperature
        result.update(tuned=True, tune_tokens=int(data.lm_logprob.shape[0]),
                      tune_base_perplexity=tuned.base_perplexity, tune_knnlm_perplexity=tuned.perplexity)
    assert lmbda is not None and temperature is not None

    run = knn_pass(model, token_docs, searcher, window_config, knn_config, boundary_token, lmbda, temperature,
                    recall_queries, search_tokens, progress, retrieval, attribution)
    assert run.tokens == total, f"scored {run.tokens} tokens of {total}"
    info = searcher.info()
    result.update(pass_result(run), k=knn_config.k, exact_rerank=knn_config.exact_rerank, nprobe=knn_config.nprobe,
                  context=window_config.context, stride=window_config.stride, index=info.index,
                  datastore_size=info.n)
    result["lambda"] = lmbda
    result["temperature"] = temperature
    if retrieval.pointers is not None:
        result.update(min_pointers=retrieval.pointers.min_pointers, stream_searches=run.stream_searches,
                      pointer_tokens=run.tokens - run.searches - run.skipped,
                      pointer_distances="exact" if retrieval.source.keys is not None else "carried")
    if retrieval.adaptive is not None:
        result.update(adaptive_threshold=retrieval.adaptive.threshold, adaptive_skipped=run.skipped)
    if exact_searcher is not None and run.sample:
        result.update(recall_result(searcher, exact_searcher, np.stack(run.sample), knn_config))
    return result

