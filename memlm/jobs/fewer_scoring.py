"""Fewer kNN-LM searches in per-token scoring (the Score rpc through memlm.jobs.scoring.score_tokens):
the neighbours of one forward batch's tokens from adaptive retrieval's gate (memlm.retrieval.adaptive: search
only the tokens it lets) and/or RetoMaton's walk (memlm.jobs.pointer_walk: pointers, a search where too few
survive), with the same rules as `memlm eval --adaptive-* / --pointers` (memlm.jobs.knnlm_eval).

Each sequence's tokens in the batch are walked as streams of PointerConfig.stream_tokens (a fixed length, so
that a sequence's streams do not depend on what else is in the batch); a stream starts afresh at each forward
batch. A token the gate keeps from searching gets the base distribution (lambda 0), as in evaluation.

Shape legend: Q scored tokens of the batch, n of one window, k neighbours, C key width, V vocab.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import NamedTuple

import numpy as np
import torch

from memlm.jobs.knnlm_eval import Retrieval
from memlm.jobs.pointer_walk import walk
from memlm.retrieval.knnlm import KNNLMConfig
from memlm.retrieval.searcher import Neighbors, Searcher, search_keys


class FewerNeighbors(NamedTuple):
    """One window's neighbours under fewer searches."""

    neighbors: Neighbors  # (n, k) candidates (searched or pointed); missing where the gate skipped the token
    keep_base: torch.Tensor  # (n,) bool, the gate skipped the token: its final distribution is the base one
    searched: torch.Tensor  # (n,) bool, a search was made for the token


def search_fewer(searcher: Searcher, knn: KNNLMConfig, keys: list[torch.Tensor], targets: list[torch.Tensor],
                 features: list[torch.Tensor] | None, docs: list[int], how: Retrieval) -> list[FewerNeighbors]:
    """Per window (keys (n_i, C), targets (n_i,), the gate's distribution_features (n_i, 5) when how.adaptive,
    document docs[i]; windows of one document consecutive and in order), its FewerNeighbors: one gate call
    over the batch, then one walk (pointers) or one search of the tokens the gate lets (no pointers)."""
    xq = torch.cat(keys).detach().float().cpu().numpy()  # (Q, C) float32, as search_keys sends it
    target = torch.cat(targets).cpu().numpy().astype(np.int64)  # (Q,)
    q, k = xq.shape[0], knn.k
    allowed = None
    if how.adaptive is not None:
        allowed = how.adaptive.allowed(torch.cat(features), torch.cat(keys)).numpy()  # (Q,)
    if how.pointers is not None:
        doc_of = np.concatenate([np.full(b.shape[0], d) for b, d in zip(keys, docs)])  # (Q,)
        walked = walk(xq, target, doc_of, searcher, k, knn.search_options, knn.temperature, how.pointers,
                      how.source, allowed, nullcontext(), stream_tokens=how.pointers.stream_tokens, collect=True)
        found, skipped, searched = walked.neighbors, walked.skipped, walked.searched
    else:
        rows = np.flatnonzero(allowed) if allowed is not None else np.arange(q)  # (r,)
        found = Neighbors(np.full((q, k), np.inf, np.float32), np.full((q, k), -1, np.int64),
                          np.full((q, k), -1, np.int32))  # (Q, k)
        if rows.size:
            nb = search_keys(searcher, torch.cat(keys)[torch.from_numpy(rows)], k, knn.search_options)  # (r, k)
            for arr, new in zip(found, nb):
                arr[rows] = new
        searched = np.zeros(q, bool)
        searched[rows] = True
        skipped = ~searched
    out, lo = [], 0
    for block in keys:
        rows = slice(lo, lo + block.shape[0])
        out.append(FewerNeighbors(Neighbors(*(a[rows] for a in found)), torch.from_numpy(skipped[rows].copy()),
                                  torch.from_numpy(searched[rows].copy())))
        lo += block.shape[0]
    return out
