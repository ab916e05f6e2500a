"""RetoMaton's walk over a group of evaluation tokens (memlm.retrieval.pointers has the rule): the tokens
are cut into streams (runs of one document, at most PointerConfig.stream_tokens long) that are walked in
lockstep, so that each step is a few vectorised array operations over every stream plus at most one
batched search for the streams whose pointers ran out. Adaptive retrieval (memlm.retrieval.adaptive)
combines with it: a stream that would search but whose token the gate skips keeps the base distribution
(lambda 0) and starts again from nothing.

Shape legend: Q tokens of the group, d key dimension, S streams walked together, L steps (tokens per stream).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import NamedTuple

import numpy as np
import torch

from memlm.retrieval.knnlm import NEG_INF, knn_target_logprob
from memlm.retrieval.pointers import (
    PointerConfig,
    PointerSource,
    empty_candidates,
    follow,
    merge_rows,
    needs_search,
)
from memlm.retrieval.searcher import Neighbors, Searcher, SearchOptions


class Walked(NamedTuple):
    """What the walk gives for each token of the group."""

    knn_logprob: torch.Tensor  # (Q,) float32 log p_kNN(target), -inf where skipped or nothing predicts it
    searched: np.ndarray  # (Q,) bool, a search was made for the token
    skipped: np.ndarray  # (Q,) bool, the gate skipped the search and the token keeps the base distribution
    stream_searches: int  # searches made at the first token of a stream


def streams_of(docs: np.ndarray, stream_tokens: int) -> np.ndarray:
    """(S, L) int64 token indices, -1 past a stream's end: runs of equal `docs` (Q,) in order, cut every
    stream_tokens tokens."""
    q = docs.shape[0]
    new_doc = np.ones(q, dtype=bool)  # (Q,)
    new_doc[1:] = docs[1:] != docs[:-1]
    run_start = np.maximum.accumulate(np.where(new_doc, np.arange(q), 0))  # (Q,) first token of each run
    offset = np.arange(q) - run_start  # (Q,) index within the run
    starts = np.flatnonzero(new_doc | (offset % stream_tokens == 0))  # (S,)
    lengths = np.diff(np.append(starts, q))  # (S,)
    steps = np.arange(int(lengths.max(initial=0)))  # (L,)
    return np.where(steps[None, :] < lengths[:, None], starts[:, None] + steps[None, :], -1)  # (S, L)


def walk(
    xq: np.ndarray,
    targets: np.ndarray,
    docs: np.ndarray,
    searcher: Searcher,
    k: int,
    options: SearchOptions,
    temperature: float,
    config: PointerConfig,
    source: PointerSource,
    allowed: np.ndarray | None,
    search_timer: AbstractContextManager,
) -> Walked:
    """Walk the group's tokens: xq (Q, d) float32 queries, targets (Q,) int64, docs (Q,) document of each
    token (tokens of a document consecutive and in order); allowed (Q,) bool: the gate lets the token
    search (None: every token may). Searches are timed in search_timer."""
    q = xq.shape[0]
    knn = torch.full((q,), NEG_INF)  # (Q,)
    searched = np.zeros(q, dtype=bool)
    skipped = np.zeros(q, dtype=bool)
    first = 0
    index = streams_of(docs, config.stream_tokens)  # (S_all, L)
    for lo in range(0, index.shape[0], config.streams):
        block = index[lo : lo + config.streams]  # (S, L)
        state, rows = empty_candidates(block.shape[0]), np.arange(block.shape[0])
        for step in range(block.shape[1]):
            active = np.flatnonzero(block[:, step] >= 0)  # (s,) streams still walking, a subset of `rows`
            tok = block[active, step]  # (s,)
            prev = Neighbors(*(a[np.searchsorted(rows, active)] for a in state))  # (s, w)
            if step == 0:
                cands = empty_candidates(active.shape[0])
            else:
                cands = follow(prev, targets[block[active, step - 1]], xq[tok], source)  # (s, w')
            need = needs_search(cands, config.min_pointers)  # (s,)
            go = need if allowed is None else need & allowed[tok]
            if go.any():
                with search_timer:
                    found = searcher.search(xq[tok[go]], k, options)  # (g, k)
                cands = merge_rows(cands, np.flatnonzero(go), found)
            skip = need & ~go
            if skip.any():
                cands = merge_rows(cands, np.flatnonzero(skip), empty_candidates(int(skip.sum())))
            searched[tok[go]] = True
            skipped[tok[skip]] = True
            first += int(go.sum()) if step == 0 else 0
            knn[torch.from_numpy(tok)] = knn_target_logprob(cands, targets[tok], temperature)  # (s,)
            state, rows = cands, active
    return Walked(knn, searched, skipped, first)
