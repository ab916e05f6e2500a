"""RetoMaton pointers (Alon et al. 2022, "Neuro-Symbolic Language Modeling with Automaton-augmented
Retrieval", neulab/knn-transformers retomaton.py): the datastore is a sequence, so the neighbours of step
t point to their successor entries, which are the candidates of step t+1; a search is made only when
fewer than a minimum of those pointers survive.

An entry's successor is the entry of the same document at position + 1 (memlm.retrieval.searcher.
Provenance); the last entry of a document has none (-1), so a pointer never crosses a document boundary.
`successors` derives them from any Provenance lookup (`datastore.Datastore.provenance`); this module never
imports `datastore`.

One step of the walk (`follow`) for S streams at once, vectorised over streams and neighbours:
1. a neighbour of step t survives when its value is the token that actually came next (the target of
   step t) and it has a successor (retomaton.py: `vals_at_knns == label`);
2. the survivors' successors are step t+1's candidates; their distances to step t+1's query are
   recomputed exactly from the stored float16 keys when the source holds them (retomaton.py reconstructs
   the pointed keys for the same purpose), else each carries its predecessor's distance (a remote
   searcher gives no keys; the walk then ranks pointers by how near their chain started). The successors
   come from a SuccessorLookup: the in-process SuccessorTable, or the retrieval service's Successors rpc
   (services.retrieval.walk.OneGeneration, held to one datastore generation), asked only for the survivors;
3. rows with fewer than `min_pointers` candidates are searched instead (`needs_search`). Unlike
   retomaton.py, which concatenates the pointers to the fresh search results, a searched row keeps the k
   nearest only: pointers that are not among them are farther than the k-th neighbour, which kNN-LM
   would drop, and so a minimum above k is plain kNN-LM exactly.
4. optionally over clustered states (Alon et al. 2022, section 3.2; retomaton.py
   `extend_pointers_using_clusters`): the entries are clustered by key (k-means, memlm.retrieval.clustered_states), and a
   row that is not searched takes the members of its pointers' clusters as candidates (the pointers are
   members of their own clusters; `extend_by_clusters`), at most PointerConfig.extended_width of them. The
   minimum is checked on the pointers before they are extended, as retomaton.py does; the extension adds
   candidates, so more of them survive the next step. The members are scored either all exactly (the
   default: one matmul per cluster against every row asking for it, the nearest kept), or ranked first by
   a KeySketch (the keys' top principal components) with the row's own candidates ranked first (as
   retomaton.py keeps its pointers before the members) and only KeySketch.exact_members of them scored
   exactly; the others kept are followed at the next step but weigh nothing in p_kNN (distance inf), so
   a wide PointerConfig.cluster_width keeps pointers alive without the cost of their exact distances.
   Measured: benchmarks/search_savings.py, README "Fewer searches" (savings, perplexity and time against plain
   kNN-LM on the 81K Flat and the 208K IVF2048,SQ8 SOTU datastores).

Distances per index type: a pointed row's p_kNN is formed from exact squared L2 between its query and the
stored keys (float16 keys, float32 arithmetic: `follow` and the clustered extension alike), whatever the
index. On a Flat index these are plain kNN-LM's distances; on an IVF,SQ8 index plain kNN-LM takes FAISS'
SQ8 distances (residual 8-bit codes; exact only with exact_rerank), so a walk's rows are those of plain
kNN-LM with exact re-ranking. The two differ little: 100 evaluation queries' 1,024 neighbours on the
208,427-key IVF2048,SQ8 SOTU datastore, SQ8 against exact: median 0.11% of the distance (0.010 nats at
T 2.5), 99th percentile 0.055 nats. Other ways to score given ids that were tried and found slower are in the
README ("Fewer searches").

Shape legend: N datastore entries, S streams walked together, w candidates per stream, d key dimension,
M candidates over all streams, C clusters, r rows extended, p sketch components.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple, Protocol

import numpy as np
import torch

from memlm.errors import MemlmError
from memlm.retrieval.clustered_states import (
    OWN_KEY,
    PAD_KEY,
    PLACE_MASK,
    StateClusters,
    exact_member_distances,
    lowest_keys,
    nearest_pairs,
    rank_keys,
    score_of,
    stable_argsort,
)
from memlm.retrieval.searcher import Neighbors, Provenance

ProvenanceLookup = Callable[[np.ndarray], Provenance]
"""ids (Q, k) int64 -> their Provenance (Q, k): `datastore.Datastore.provenance`, or any equal lookup."""

LOOKUP_ROWS = 1 << 20
"""Entries whose provenance is read per lookup call while deriving successors."""


class Successors(NamedTuple):
    """Each datastore entry's successor, derived once from the provenance."""

    next_ids: np.ndarray  # (N,) int64, the entry of the same document at position + 1, -1 at a document's end
    contiguous: bool  # rows are in (document, position) order: a successor, where there is one, is id + 1


def successors(lookup: ProvenanceLookup, n: int) -> Successors:
    """The successor of each of the n entries, from their documents and positions.

    The builder writes a document's entries as consecutive rows in position order, so the successor is
    usually id + 1; that is checked, never assumed: whatever the row order, the successor is found by
    sorting the entries by (document, position), and an entry whose next one in that order is not the
    same document at position + 1 (a document's end, or a gap) has none.
    """
    if n == 0:
        return Successors(np.zeros(0, dtype=np.int64), True)
    docs = np.empty(n, dtype=np.int64)
    positions = np.empty(n, dtype=np.int64)
    for lo in range(0, n, LOOKUP_ROWS):
        ids = np.arange(lo, min(n, lo + LOOKUP_ROWS), dtype=np.int64)[None, :]  # (1, r)
        prov = lookup(ids)
        docs[lo : lo + ids.shape[1]] = prov.docs[0]
        positions[lo : lo + ids.shape[1]] = prov.positions[0]
    if (docs < 0).any():
        raise MemlmError("the datastore's provenance has entries without a document; rebuild the datastore")
    order = np.lexsort((positions, docs))  # (N,) rows by (document, position)
    nxt = np.full(n, -1, dtype=np.int64)
    follows = (docs[order[1:]] == docs[order[:-1]]) & (positions[order[1:]] == positions[order[:-1]] + 1)  # (N-1,)
    nxt[order[:-1][follows]] = order[1:][follows]
    return Successors(nxt, bool(np.array_equal(order, np.arange(n))))


MIN_STREAM_TOKENS = 32
"""Shortest stream `PointerConfig.stream_length` cuts (a forced search every 32 tokens at most)."""


@dataclass(frozen=True)
class PointerConfig:
    """RetoMaton's walk in kNN-LM evaluation (`memlm eval --pointers --min-pointers N`)."""

    min_pointers: int = 1
    """Search when fewer candidates than this survive; above k every token is searched (plain kNN-LM)."""
    stream_tokens: int = 64
    """Most tokens walked per stream. Streams (runs of one document, cut at `stream_length`) are walked
    together so that searches are batched (memlm.jobs.pointer_walk); each stream's first token is searched
    (at most 1/MIN_STREAM_TOKENS of the tokens, reported as stream_searches)."""
    keep_pointers: bool = False
    """Also keep a searched token's surviving pointers beside its k nearest (retomaton.py concatenates them
    to the fresh search; Alon et al. 2022): more candidates, so a minimum above k is no longer plain kNN-LM
    exactly (hence off by default)."""
    streams: int = 256
    """Streams walked together: a search call holds every one of them waiting for a search, up to this many
    (a Flat search call reads every key once, ~85 ms on the 81,169-key SOTU index at d 576, one thread, plus
    ~4 ms a query with BLAS, which datastore.index.BLAS_MIN_QUERIES turns on from 4 queries: the fixed
    part is amortised only over many queries a call)."""
    search_rows: int | None = None
    """Search the streams waiting for a search as soon as this many wait, or as many as still move (`search_now`);
    None: only once every walking stream waits (the fewest and fullest calls, for a Flat index). Which tokens are
    searched and what each gets do not change (a stream's walk is its own), only how the work is batched: smaller
    search calls, and pointed rows extended in fewer, fuller calls, whose per-cluster matmuls (rank_keys) serve more
    rows at once. On the 208K IVF2048,SQ8 SOTU datastore (50 clusters, 3 nearest, replayed walk, one thread):
    64 gives 48 extension calls instead of 213 and the walk 2.66-2.80 s instead of 2.89-3.03 s."""

    cluster_width: int | None = None
    """Candidates a row extended by clustered states keeps at most (extend_by_clusters); None: as many as a
    searched row holds (`searched_width`). Wider keeps more pointers alive at the next step."""

    def searched_width(self, k: int) -> int:
        """Candidates a searched row holds: its k nearest, and up to k kept pointers beside with keep_pointers."""
        return 2 * k if self.keep_pointers else k

    def extended_width(self, k: int) -> int:
        """Candidates a row extended by clustered states holds at most."""
        return self.cluster_width or self.searched_width(k)

    def width(self, k: int) -> int:
        """Candidates any walked row holds at most."""
        return max(self.searched_width(k), self.extended_width(k))

    @property
    def group_tokens(self) -> int:
        """Evaluation tokens walked as one group (their keys are held at once): twice the streams' worth."""
        return 2 * self.streams * self.stream_tokens

    def search_now(self, waiting: int, moving: int) -> bool:
        """Whether the `waiting` streams are searched now, with `moving` streams still walking (search_rows)."""
        return moving == 0 or (self.search_rows is not None and waiting >= min(self.search_rows, moving))

    def stream_length(self, tokens: int) -> int:
        """Tokens per stream for a group of `tokens`: twice as many streams as walk at once when the group
        allows (so that ended streams are replaced), down to MIN_STREAM_TOKENS, at most stream_tokens."""
        wanted = -(-tokens // (2 * self.streams))
        return max(min(MIN_STREAM_TOKENS, self.stream_tokens), min(self.stream_tokens, wanted))

    def __post_init__(self) -> None:
        if self.min_pointers < 1:
            raise MemlmError(f"--min-pointers must be at least 1, got {self.min_pointers}")
        if self.stream_tokens < 1 or self.streams < 1:
            raise MemlmError("stream_tokens and streams must be at least 1")
        if self.search_rows is not None and self.search_rows < 1:
            raise MemlmError(f"search_rows must be at least 1, got {self.search_rows}")
        if self.cluster_width is not None and self.cluster_width < 1:
            raise MemlmError(f"cluster_width must be at least 1, got {self.cluster_width}")


class SuccessorLookup(Protocol):
    """Where the walk reads successors: an in-process table (SuccessorTable) or the retrieval service's
    Successors rpc (services.retrieval.walk.OneGeneration, one generation a walk), which answer alike."""

    def successors_of(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """ids (M,) int64 datastore rows (each in [0, N)) -> (next_ids (M,) int64, the successor of each, -1
        at a document's end; next_values (M,) int32, the value stored with that successor, -1 where none)."""
        ...


@dataclass(frozen=True)
class SuccessorTable:
    """Every entry's successor and the datastore's values, in memory (a SuccessorLookup)."""

    next_ids: np.ndarray
    """(N,) int64 successors (`successors(...).next_ids`)."""
    values: np.ndarray
    """(N,) int32 stored next tokens (the datastore's values)."""

    def __post_init__(self) -> None:
        n = self.next_ids.shape[0]
        if self.values.shape != (n,):
            raise ValueError(f"values must have shape ({n},), got {self.values.shape}")

    def __len__(self) -> int:
        return self.next_ids.shape[0]

    def successors_of(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        nxt = self.next_ids[ids]  # (M,)
        return nxt, np.where(nxt >= 0, self.values[np.maximum(nxt, 0)], -1).astype(np.int32)  # (M,), (M,)


@dataclass(frozen=True)
class PointerSource:
    """What the walk reads from the datastore besides searches (the command line fills it in)."""

    successors: SuccessorLookup
    """The entries' successors and their values (a SuccessorTable, or the retrieval service's rpc)."""
    keys: np.ndarray | None
    """(N, d) float16 stored keys for exact pointer distances; None: pointers carry their predecessor's
    (a remote datastore sends no keys)."""
    clusters: StateClusters | None = None
    """The entries' clusters (RetoMaton's clustered states, `extend_by_clusters`); None: pointers alone.
    Needs the keys and the values (the members' distances and tokens)."""
    values: np.ndarray | None = None
    """(N,) int32 stored next tokens, for the clusters' members (given exactly when clusters are)."""

    @cached_property
    def member_values(self) -> np.ndarray:
        """(N,) int32 the values in StateClusters.members order: a clustered row's kept members lie in a few
        clusters, contiguous there, so reading their values by place stays in a few runs of memory where reading
        them by id jumps over the whole datastore (extend_by_clusters)."""
        return np.ascontiguousarray(self.values[self.clusters.members])

    def __post_init__(self) -> None:
        if (self.clusters is None) != (self.values is None):
            raise ValueError("clustered states need the datastore's values, and values are read only for them")
        if self.clusters is not None and self.keys is None:
            raise MemlmError("clustered pointer states need the datastore's keys (an in-process datastore)")

    @classmethod
    def local(cls, next_ids: np.ndarray, values: np.ndarray, keys: np.ndarray | None,
              clusters: StateClusters | None = None) -> PointerSource:
        """A source over in-process arrays: successors (N,), values (N,), keys (N, d) or None, clusters."""
        if keys is not None and keys.shape[0] != next_ids.shape[0]:
            raise ValueError(f"keys must have {next_ids.shape[0]} rows, got {keys.shape[0]}")
        return cls(SuccessorTable(next_ids, values), keys, clusters, values if clusters is not None else None)


def empty_candidates(rows: int) -> Neighbors:
    """Candidate sets with nothing in them: (rows, 1) missing neighbours."""
    return Neighbors(np.full((rows, 1), np.inf, np.float32), np.full((rows, 1), -1, np.int64),
                     np.full((rows, 1), -1, np.int32))


def follow(prev: Neighbors, prev_targets: np.ndarray, xq: np.ndarray, source: PointerSource,
           distances: bool = True) -> Neighbors:
    """Step t+1's pointer candidates from step t's candidates `prev` (S, w) and the tokens that came next
    `prev_targets` (S,): the successors of the neighbours whose value was that token, nearest first,
    padded with missing entries (id -1, value -1, distance inf) to the longest row.

    xq: (S, d) float32 queries of step t+1 (distances are recomputed from source.keys when it has them).
    distances: False gives every pointer distance inf, in prev's order, for a caller that rescores them all
    (`followed_distances_used`): their exact distances cost a gather of each one's key.
    """
    ids = prev.ids  # (S, w)
    match = (ids >= 0) & (prev.values == prev_targets[:, None])  # (S, w) the token that came next
    rows, cols = np.nonzero(match)  # (M,), (M,) row by row, in prev's order
    found, found_values = source.successors.successors_of(ids[rows, cols])  # (M,), (M,) only these are asked
    alive = found >= 0  # (M,) ... and with a successor
    rows, cols, found, found_values = rows[alive], cols[alive], found[alive], found_values[alive]  # (A,)
    counts = np.bincount(rows, minlength=ids.shape[0])  # (S,) survivors per row
    shape = (ids.shape[0], max(1, int(counts.max(initial=0))))  # (S, w')
    place = np.arange(rows.size) - (np.cumsum(counts) - counts)[rows]  # (A,) survivors first, in prev's order
    new_ids = np.full(shape, -1, dtype=np.int64)  # (S, w')
    values = np.full(shape, -1, dtype=np.int32)  # (S, w')
    new_ids[rows, place], values[rows, place] = found, found_values
    if not distances:
        return Neighbors(np.full(shape, np.inf, np.float32), new_ids, values)  # (S, w')
    if source.keys is None:
        dist = np.full(shape, np.inf, dtype=np.float32)  # (S, w')
        dist[rows, place] = prev.distances[rows, cols]
    else:
        dist = _exact_distances(xq, new_ids, new_ids >= 0, source.keys)  # (S, w')
    resort = np.argsort(dist, axis=1, kind="stable")  # (S, w') nearest first, as a search returns them
    return Neighbors(np.take_along_axis(dist, resort, axis=1), np.take_along_axis(new_ids, resort, axis=1),
                     np.take_along_axis(values, resort, axis=1))


def followed_distances_used(source: PointerSource, keep_pointers: bool) -> bool:
    """Whether a walk reads the distances `follow` gives: not when every pointed row it keeps is rescored by
    extend_by_clusters (clustered states) and a searched row drops its pointers (keep_pointers off); then
    `follow(..., distances=False)` saves their keys' gather."""
    return source.clusters is None or keep_pointers


def _exact_distances(xq: np.ndarray, ids: np.ndarray, keep: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Squared L2 (float32) between each stream's query (S, d) and its kept candidates' float16 keys
    (S, w), inf elsewhere: float32 keys by faiss' fvec_L2sqr_by_idx (each key read once where it lies), float16
    ones by one gather of the M kept keys and one batched reduction."""
    if keys.dtype == np.float32 and keys.flags.c_contiguous:
        import faiss

        at = np.where(keep, ids, -1).astype(np.int64)  # (S, w) -1: none
        qs = np.ascontiguousarray(xq, dtype=np.float32)  # (S, d)
        out = np.empty(at.shape, dtype=np.float32)  # (S, w)
        faiss.fvec_L2sqr_by_idx(faiss.swig_ptr(out), faiss.swig_ptr(qs), faiss.swig_ptr(keys), faiss.swig_ptr(at),
                                keys.shape[1], at.shape[0], at.shape[1])  # inf where at is -1
        return out
    rows, cols = np.nonzero(keep)  # (M,), (M,)
    out = np.full(ids.shape, np.inf, dtype=np.float32)  # (S, w)
    if rows.size:
        flat = ids[rows, cols]  # (M,)
        order = np.argsort(flat, kind="stable")  # sorted gather: sequential-ish reads of a memmap
        gathered = np.empty((flat.size, keys.shape[1]), dtype=np.float16)  # (M, d)
        gathered[order] = keys[flat[order]]
        diff = torch.from_numpy(gathered).float() - torch.from_numpy(xq)[torch.from_numpy(rows)]  # (M, d)
        out[rows, cols] = diff.pow(2).sum(dim=1).numpy()  # (M,)
    return out


def extend_by_clusters(candidates: Neighbors, rows: np.ndarray, xq: np.ndarray, source: PointerSource,
                       width: int) -> Neighbors:
    """`candidates` (S, w) with each row of `rows` (r,) replaced by at most `width` members of its candidates'
    clusters (each member once: an entry is in one cluster, so the candidates are among them), for the row's
    query xq (S, d); (S, w') padded with missing entries. Rows not in `rows`, and everything without
    source.clusters, are returned as they are.

    What is exact and what is not. Without a sketch (StateClusters.sketch None): the nearest `width`
    members at their exact distances (squared L2 in float32 from the stored keys, as `follow`'s), nearest
    first. With a KeySketch the members are ranked by the sketch (approximate), the row's own candidates
    first (retomaton.py keeps its pointers before the clusters' members too), and the best `width` by that
    ranking are kept (all of its own, if more, then cut to the nearest `width`). Its own candidates and the
    best others, KeySketch.exact_members in all (or all of its own, if more), get exact distances and come
    first, nearest first; the others get distance inf and come after them in place order (StateClusters.members
    order: no sort of them is needed): followed at the next step like any candidate, but of no weight in this
    step's p_kNN (knnlm.knn_logprob_from_matches), so the kNN distribution is built from exact distances only. So
    a row whose clusters hold at most min(width, exact_members) members (all kept, all scored), or a sketch that
    ranks like the exact distances, keeps the exact nearest beside its own candidates
    (tests/memlm/retrieval/test_pointers_clusters.py). Ties keep member order (rank_keys). With
    KeySketch.max_clusters only the members of the row's nearest clusters (`nearest_pairs`) are ranked, and
    its own candidates in its other clusters beside them (tests/memlm/retrieval/test_clustered_order.py)."""
    cl = source.clusters
    if cl is None or rows.size == 0:
        return candidates
    ids = candidates.ids[rows]  # (r, w)
    q = torch.from_numpy(np.ascontiguousarray(xq[rows], dtype=np.float32))  # (r, d)
    return merge_rows(candidates, rows, _extended_rows(ids, q, source, width))


def _extended_rows(ids: np.ndarray, q: torch.Tensor, source: PointerSource, width: int) -> Neighbors:
    """extend_by_clusters' rows in numpy (with clustered_states' pieces): ids (r, w) the rows' own candidates, q (r, d) their queries; (r, <= width) kept members."""
    cl = source.clusters
    r, n_cl = ids.shape[0], cl.n_clusters
    r_idx, c_idx = np.nonzero(ids >= 0)  # (m,), (m,)
    own_cl = cl.assign[ids[r_idx, c_idx]]  # (m,)
    pair_of = r_idx * n_cl + own_cl  # (m,) each own candidate's (row, cluster)
    pairs = np.unique(pair_of)  # (p,) (row, cluster), each once, by row then cluster
    p_row, p_cl = pairs // n_cl, pairs % n_cl  # (p,), (p,)
    sk = cl.sketch
    if sk is not None and sk.max_clusters is not None:  # only the nearest clusters' members are ranked
        near = nearest_pairs(q, p_row, p_cl, cl, sk.max_clusters)  # (p,)
        pairs, p_row, p_cl = pairs[near], p_row[near], p_cl[near]  # (p',)
    sizes = cl.offsets[p_cl + 1] - cl.offsets[p_cl]  # (p,)
    at = np.searchsorted(pairs, pair_of)  # (m,)
    strays = pairs[np.minimum(at, pairs.size - 1)] != pair_of if pairs.size else np.ones(at.shape, bool)  # (m,)
    n_stray = np.bincount(r_idx[strays], minlength=r)  # (r,) own candidates outside the ranked clusters
    held = np.bincount(p_row, weights=sizes, minlength=r).astype(np.int64) + n_stray  # (r,) members per row
    bounds = np.concatenate([[0], np.cumsum(held)])  # (r + 1,) each row's keys, one after another
    first = np.cumsum(sizes) - sizes + (np.cumsum(n_stray) - n_stray)[p_row]  # (p,) each pair's first key
    keys = rank_keys(q, p_row, p_cl, cl, first, int(bounds[-1]))  # (T,) (score, place) keys, pairs, then strays
    takes = np.minimum(held, width)  # (r,) members kept
    if sk is not None:  # the row's own candidates ranked first: all of them are scored exactly
        own = cl.position[ids[r_idx, c_idx]]  # (m,) their places in `members`
        slot = np.empty(own.shape, dtype=np.int64)  # (m,) each one's key
        mine = ~strays
        slot[mine] = first[at[mine]] + own[mine] - cl.offsets[p_cl[at[mine]]]
        s_row = r_idx[strays]  # (x,) by row: after the row's pairs' keys, in candidate order
        s_rank = np.arange(s_row.size) - (np.cumsum(n_stray) - n_stray)[s_row]  # (x,) its place among the row's
        slot[strays] = bounds[s_row + 1] - n_stray[s_row] + s_rank
        keys[slot] = OWN_KEY | own  # score -inf, ties by place
        n_own = np.bincount(r_idx, minlength=r)  # (r,)
        takes = np.minimum(held, np.maximum(width, n_own))  # all its own if more than `width`, cut below
    best = lowest_keys(keys, bounds, takes)  # (r, t) best first, ties by place
    valid = best != PAD_KEY  # (r, t) past a row's kept: missing
    pos = np.where(valid, best & PLACE_MASK, 0)  # (r, t) places in `members`
    m_ids = np.where(valid, cl.members[pos], -1)  # (r, t)
    vals = np.where(valid, source.member_values[pos], -1).astype(np.int32)  # (r, t)
    if sk is None:  # the ranking was the exact distance, nearest first
        dist = np.where(valid, np.maximum(score_of(best), 0.0), np.inf)
    else:  # a row's own candidates and the best others, exact_members in all (or its own), exactly, first,
        # nearest first (ties in ranking order); then the others at inf (followed only) and the missing
        n_scored = np.minimum(np.maximum(sk.exact_members, n_own), takes)  # (r,) a prefix of the kept
        col = np.arange(best.shape[1])[None, :]  # (1, t)
        after = np.where(valid, pos, PLACE_MASK + 1) + best.shape[1]  # (r, t) followed-only by place, then missing
        order = np.argsort(np.where(col < n_scored[:, None], col, after), axis=1, kind="stable")  # (r, t)
        pos, m_ids, vals = (np.take_along_axis(a, order, axis=1) for a in (pos, m_ids, vals))
        dist = _scored_first(q, pos, n_scored, sk.exact_members, cl, m_ids, vals)  # (r, t)
    found = Neighbors(dist.astype(np.float32), m_ids, vals)
    return Neighbors(*(a[:, :width] for a in found))  # (r, <= width)


def _scored_first(q: torch.Tensor, pos: np.ndarray, n_scored: np.ndarray, exact_members: int, cl: StateClusters,
                  m_ids: np.ndarray, vals: np.ndarray) -> np.ndarray:
    """(r, t) float32 exact distances of each row's first n_scored[i] kept members (pos (r, t), their places),
    nearest first (ties in ranking order), inf after them; m_ids and vals (r, t) are reordered alike, in place.
    Rows with more own candidates than exact_members (all of them scored) are scored apart from the others, so
    that a few wide rows widen no other row's arrays."""
    dist = np.full(pos.shape, np.inf, dtype=np.float32)  # (r, t)
    wide = n_scored > exact_members  # (r,)
    for sel in (np.flatnonzero(~wide), np.flatnonzero(wide)):
        e = int(n_scored[sel].max(initial=0))
        if e == 0:
            continue
        scored = exact_member_distances(q[torch.from_numpy(sel)], pos[sel, :e], n_scored[sel], cl)  # (s, e)
        order = stable_argsort(scored)  # (s, e) past a row's scored: inf, in order
        dist[sel, :e] = np.take_along_axis(scored, order, axis=1)
        for a in (m_ids, vals):
            a[sel, :e] = np.take_along_axis(a[sel, :e], order, axis=1)
    return dist


def weighed(candidates: Neighbors) -> Neighbors:
    """`candidates` (S, w) cut after the last column holding a finite distance in any row (at least one
    column): the candidates after it weigh nothing in p_kNN (distance inf: clustered states' followed-only
    members, missing entries), so log p_kNN of the cut rows is theirs, over fewer columns."""
    finite = np.flatnonzero(np.isfinite(candidates.distances).any(axis=0))  # (f,) columns with a weight
    w = int(finite[-1]) + 1 if finite.size else 1
    return candidates if w == candidates.ids.shape[1] else Neighbors(*(a[:, :w] for a in candidates))  # (S, w')


def weighed_groups(candidates: Neighbors) -> list[tuple[np.ndarray, Neighbors]]:
    """(rows (s,), `weighed` of those rows) for two groups of `candidates`' rows (S, w) split at the median of
    their last weighted column: each group's log p_kNN is reduced over its own widest row only (a clustered row
    with many own candidates scores them all, and would otherwise widen every row's reduction)."""
    finite = np.isfinite(candidates.distances)  # (S, w)
    last = np.where(finite.any(axis=1), finite.shape[1] - np.argmax(finite[:, ::-1], axis=1), 0)  # (S,)
    narrow = last <= np.median(last) if last.size else last.astype(bool)  # (S,)
    groups = [np.flatnonzero(narrow), np.flatnonzero(~narrow)]
    return [(g, weighed(Neighbors(*(a[g] for a in candidates)))) for g in groups if g.size]


def needs_search(candidates: Neighbors, min_pointers: int) -> np.ndarray:
    """(S,) bool: rows with fewer than min_pointers candidates, which a search replaces."""
    return (candidates.ids >= 0).sum(axis=1) < min_pointers


def merge_rows(candidates: Neighbors, rows: np.ndarray, searched: Neighbors) -> Neighbors:
    """`candidates` (S, w) with the rows `rows` (s,) replaced by `searched` (s, k), padded to one width."""
    width = max(candidates.ids.shape[1], searched.ids.shape[1])
    out = [_pad(a, width, fill) for a, fill in zip(candidates, (np.inf, -1, -1))]  # (S, width) each
    for o, s, fill in zip(out, searched, (np.inf, -1, -1)):
        o[rows] = _pad(s, width, fill)
    return Neighbors(*out)


def _pad(a: np.ndarray, width: int, fill: float) -> np.ndarray:
    if a.shape[1] == width:
        return a.copy()
    out = np.full((a.shape[0], width), fill, dtype=a.dtype)  # (S, width)
    out[:, : a.shape[1]] = a
    return out


def union_candidates(searched: Neighbors, pointed: Neighbors) -> Neighbors:
    """Each row's searched neighbours (S, k) and pointer candidates (S, w) together, nearest first, a pointer
    already among the searched dropped (its searched copy kept): (S, k + w), padded with missing entries."""
    ids = np.concatenate([searched.ids, pointed.ids], axis=1)  # (S, k + w)
    dist = np.concatenate([searched.distances, pointed.distances], axis=1)
    vals = np.concatenate([searched.values, pointed.values], axis=1)
    by_id = np.argsort(ids, axis=1, kind="stable")  # equal ids: the searched one first
    sorted_ids = np.take_along_axis(ids, by_id, axis=1)
    again = np.zeros(ids.shape, dtype=bool)
    again[:, 1:] = (sorted_ids[:, 1:] == sorted_ids[:, :-1]) & (sorted_ids[:, 1:] >= 0)
    dup = np.zeros(ids.shape, dtype=bool)
    np.put_along_axis(dup, by_id, again, axis=1)  # (S, k + w) a later copy of an id in its row
    missing = dup | (ids < 0)
    ids, dist, vals = np.where(missing, -1, ids), np.where(missing, np.inf, dist).astype(np.float32), np.where(missing, -1, vals)
    order = np.lexsort((dist, missing), axis=1)  # nearest first, missing last (after any at distance inf)
    return Neighbors(np.take_along_axis(dist, order, axis=1), np.take_along_axis(ids, order, axis=1),
                     np.take_along_axis(vals, order, axis=1).astype(np.int32))
