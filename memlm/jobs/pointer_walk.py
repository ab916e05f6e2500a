"""RetoMaton's walk over a group of evaluation tokens (memlm.retrieval.pointers has the rule): the tokens
are cut into streams (runs of one document, at most PointerConfig.stream_tokens long) that are walked
together: each tick is a few vectorised array operations over every stream not waiting for a search, and
when all of them wait, one batched search serves them all (a search of one query at a time would cost
more than the searches saved: a Flat index reads every key per call). Adaptive retrieval (memlm.retrieval.adaptive)
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
    extend_by_clusters,
    follow,
    followed_distances_used,
    needs_search,
    union_candidates,
    weighed_groups,
)
from memlm.retrieval.searcher import Neighbors, Searcher, SearchOptions


class Walked(NamedTuple):
    """What the walk gives for each token of the group."""

    knn_logprob: torch.Tensor  # (Q,) float32 log p_kNN(target), -inf where skipped or nothing predicts it
    searched: np.ndarray  # (Q,) bool, a search was made for the token
    skipped: np.ndarray  # (Q,) bool, the gate skipped the search and the token keeps the base distribution
    stream_searches: int  # searches made at the first token of a stream
    neighbors: Neighbors | None = None  # (Q, k) each token's candidates (searched or pointed), when collected


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
    stream_tokens: int | None = None,
    collect: bool = False,
) -> Walked:
    """Walk the group's tokens: xq (Q, d) float32 queries, targets (Q,) int64, docs (Q,) document of each
    token (tokens of a document consecutive and in order); allowed (Q,) bool: the gate lets the token
    search (None: every token may). Searches are timed in search_timer. stream_tokens: cut streams at this
    length (None: PointerConfig.stream_length of the group); collect: also give each token's candidates
    (Walked.neighbors, missing entries where the gate skipped it), which the Score rpc's dense scores need.

    Streams advance independently: one that needs a search parks at that token, and when every stream
    walking is parked (or PointerConfig.search_rows of them), all that are parked are searched in one call.
    PointerConfig.streams walk at once, a stream that ends is replaced by the next, and while fewer than that
    wait for a call more are started, so that calls hold PointerConfig.streams queries until the group's last
    streams (search_rows None)."""
    q, width = xq.shape[0], config.width(k)  # kept pointers, clustered states: more than k
    kept = Neighbors(np.full((q, width), np.inf, np.float32), np.full((q, width), -1, np.int64),
                     np.full((q, width), -1, np.int32)) if collect else None  # (Q, width)
    out = Walked(torch.full((q,), NEG_INF), np.zeros(q, bool), np.zeros(q, bool), 0, kept)
    index = streams_of(docs, stream_tokens or config.stream_length(q))  # (S, L)
    first = _walk_streams(index, xq, targets, searcher, k, options, temperature, config, source, allowed,
                          search_timer, out)
    return out._replace(stream_searches=first)


class _Block:
    """The candidates of S streams, (S, k) arrays padded with missing entries, and where each stream is."""

    def __init__(self, block: np.ndarray, k: int) -> None:
        s = block.shape[0]
        self.block = block  # (S, L) token indices, -1 past a stream's end
        self.lengths = (block >= 0).sum(axis=1)  # (S,)
        self.step = np.zeros(s, dtype=np.int64)  # (S,) the stream's current token is block[s, step[s]]
        self.parked = np.zeros(s, dtype=bool)  # (S,) waiting for a search of its current token
        self.ids = np.full((s, k), -1, dtype=np.int64)  # (S, k)
        self.dist = np.full((s, k), np.inf, dtype=np.float32)
        self.vals = np.full((s, k), -1, dtype=np.int32)
        self.count = np.zeros(s, dtype=np.int64)  # (S,) columns in use: up to each row's last candidate

    def rows(self, rows: np.ndarray, columns: int | None = None) -> Neighbors:
        """The candidates of `rows` (r, w): as many columns as the fullest of them holds, or `columns`."""
        w = max(1, int(self.count[rows].max(initial=0)) if columns is None else columns)
        return Neighbors(self.dist[rows, :w], self.ids[rows, :w], self.vals[rows, :w])  # (r, w)

    def store(self, rows: np.ndarray, cands: Neighbors) -> None:
        """Replace the candidates of `rows` (r,) by `cands` (r, w): count becomes each row's columns up to its last
        candidate, and the columns past it that held candidates before are reset (the others already are)."""
        w, old = cands.ids.shape[1], int(self.count[rows].max(initial=0))
        for arr, new, fill in ((self.dist, cands.distances, np.inf), (self.ids, cands.ids, -1), (self.vals, cands.values, -1)):
            arr[rows, :w] = new
            if old > w:
                arr[rows, w:old] = fill
        held = cands.ids >= 0  # (r, w)
        self.count[rows] = np.where(held.any(axis=1), w - np.argmax(held[:, ::-1], axis=1), 0)


def _walk_streams(block: np.ndarray, xq: np.ndarray, targets: np.ndarray, searcher: Searcher, k: int,
                  options: SearchOptions, temperature: float, config: PointerConfig, source: PointerSource,
                  allowed: np.ndarray | None, search_timer: AbstractContextManager, out: Walked) -> int:
    """Walk the streams `block` (S, L), writing into `out`; returns the searches made at a stream's first token."""
    b = _Block(block, config.width(k))
    distances = followed_distances_used(source, config.keep_pointers)
    first = admitted = 0
    while True:
        unfinished = b.step < b.lengths  # (S,)
        room = config.streams - int(unfinished[:admitted].sum())
        admitted = min(block.shape[0], admitted + max(0, room))  # streams 0..admitted-1 have started
        live = unfinished & (np.arange(block.shape[0]) < admitted)  # (S,)
        if not live.any():
            return first
        movers = np.flatnonzero(live & ~b.parked)  # (m,)
        waiting = int(b.parked.sum())
        if waiting and config.search_now(waiting, movers.size):  # every stream waits, or enough of them
            if movers.size == 0 and waiting < config.streams and admitted < block.shape[0]:  # start more first
                admitted = min(block.shape[0], admitted + config.streams - waiting)
                continue
            rows = np.flatnonzero(b.parked)  # (r,) one call for all that wait
            tok = b.block[rows, b.step[rows]]  # (r,)
            with search_timer:
                found = searcher.search(xq[tok], k, options)  # (r, k)
            if config.keep_pointers:  # the pointers that were too few, beside the fresh search
                found = union_candidates(found, b.rows(rows))  # (r, k + w)
                found = Neighbors(*(a[:, : config.searched_width(k)] for a in found))  # (r, <= 2k) the nearest kept
            b.store(rows, found)
            _keep(out.neighbors, tok, found)
            out.knn_logprob[torch.from_numpy(tok)] = knn_target_logprob(found, targets[tok], temperature)
            out.searched[tok] = True
            first += int((b.step[rows] == 0).sum())
            b.parked[rows] = False
            b.step[rows] += 1
            continue
        tok = b.block[movers, b.step[movers]]  # (m,)
        fresh = b.step[movers] == 0  # a stream's first token: nothing to follow
        prev_tok = b.block[movers, np.maximum(b.step[movers] - 1, 0)]  # (m,)
        cands = follow(b.rows(movers), targets[prev_tok], xq[tok], source, distances)  # (m, w)
        need = needs_search(cands, config.min_pointers) | fresh  # (m,)
        b.store(movers, extend_by_clusters(cands, np.flatnonzero(~need), xq[tok], source, config.extended_width(k)))
        go = need if allowed is None else need & allowed[tok]
        empty = fresh | (need & ~go)  # skipped by the gate: the base distribution, and nothing to follow
        if empty.any():
            b.store(movers[empty], empty_candidates(int(empty.sum())))
        moved = ~go  # scored now from pointers (or skipped); the others park for the search
        if moved.any():
            mine = b.rows(movers[moved])
            _keep(out.neighbors, tok[moved], mine)
            for group, nb in weighed_groups(mine):  # (g,) rows of `mine` and their weighed candidates
                at = tok[moved][group]  # (g,)
                out.knn_logprob[torch.from_numpy(at)] = knn_target_logprob(nb, targets[at], temperature)
        out.skipped[tok[need & ~go]] = True
        b.step[movers[moved]] += 1
        b.parked[movers[go]] = True


def _keep(kept: Neighbors | None, tok: np.ndarray, found: Neighbors) -> None:
    """Write the candidates `found` (r, w) of tokens `tok` (r,) into `kept` (Q, k) (nothing when not collecting)."""
    if kept is None:
        return
    w = found.ids.shape[1]
    for arr, new in zip(kept, found):
        arr[tok, :w] = new
