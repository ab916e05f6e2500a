"""One pointer step (memlm.retrieval.pointers.follow) against a row-by-row oracle written from its rule: the
successors of a row's candidates whose value came true and that have a successor, first in the row's order
(distances=False), then nearest first by their exact distance (stored keys) or their predecessor's (no keys),
ties in the row's order; padded to the longest row. Integer keys make the distances exact, and many tie.
And the cut of weightless columns before log p_kNN (`weighed`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from memlm.retrieval.knnlm import knn_target_logprob
from memlm.retrieval.pointers import PointerSource, follow, weighed
from memlm.retrieval.searcher import Neighbors

N, D, S, W = 120, 4, 7, 15


def oracle(prev: Neighbors, targets: np.ndarray, xq: np.ndarray, nxt: np.ndarray, values: np.ndarray,
           keys: np.ndarray | None, distances: bool) -> list[list[tuple]]:
    """Each row's (id, value, distance) in order."""
    out = []
    for s in range(prev.ids.shape[0]):
        row = []
        for j, i in enumerate(prev.ids[s]):
            if i < 0 or prev.values[s, j] != targets[s] or nxt[i] < 0:
                continue
            if not distances:
                dist = np.inf
            elif keys is None:
                dist = prev.distances[s, j]
            else:
                dist = float(((keys[nxt[i]].astype(np.float64) - xq[s]) ** 2).sum())
            row.append((nxt[i], values[nxt[i]], dist))
        if distances:
            row = [row[j] for j in sorted(range(len(row)), key=lambda j: (row[j][2], j))]
        out.append(row)
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("with_keys", [True, False])
@pytest.mark.parametrize("distances", [True, False])
def test_follow_equals_a_row_by_row_oracle(seed, with_keys, distances):
    rng = np.random.default_rng(seed)
    values = rng.integers(0, 3, size=N).astype(np.int32)  # few tokens: many candidates come true
    nxt = np.where(rng.random(N) < 0.2, -1, (np.arange(N) + 1) % N)  # document ends at random
    keys = rng.integers(-1, 2, size=(N, D)).astype(np.float16)
    ids = np.where(rng.random((S, W)) < 0.25, -1, rng.integers(0, N, size=(S, W)))
    ids[2] = -1  # a row with nothing
    prev = Neighbors(rng.integers(0, 4, size=(S, W)).astype(np.float32), ids,
                     np.where(ids >= 0, values[np.maximum(ids, 0)], -1).astype(np.int32))
    targets = rng.integers(0, 3, size=S)
    xq = rng.integers(-1, 2, size=(S, D)).astype(np.float32)
    source = PointerSource.local(nxt, values, keys if with_keys else None)
    got = follow(prev, targets, xq, source, distances)
    want = oracle(prev, targets, xq, nxt, values, keys if with_keys else None, distances)
    assert got.ids.shape[1] == max(1, max(len(r) for r in want))
    for s, row in enumerate(want):
        n = len(row)
        assert got.ids[s, :n].tolist() == [i for i, _, _ in row]
        assert got.values[s, :n].tolist() == [v for _, v, _ in row]
        np.testing.assert_array_equal(got.distances[s, :n], np.array([d for _, _, d in row], np.float32))
        assert (got.ids[s, n:] == -1).all() and (got.values[s, n:] == -1).all() and np.isinf(got.distances[s, n:]).all()


def test_weighed_drops_only_columns_without_weight_and_keeps_log_p_knn():
    """Clustered rows hold their scored members first and followed-only ones (distance inf) after: the cut
    keeps every column up to the last finite distance of any row, and log p_kNN is that of the whole rows."""
    rng = np.random.default_rng(0)
    dist = rng.random((5, 40)).astype(np.float32) * 4
    dist[:, 12:] = np.inf
    dist[3, 9:] = np.inf
    dist[1, 17] = 0.5  # one row's late scored member keeps the columns before it
    values = rng.integers(0, 4, size=(5, 40)).astype(np.int32)
    values[0, 30:] = 2  # matching but weightless
    ids = np.arange(200).reshape(5, 40)
    targets = np.array([2, 1, 0, 3, 2])
    full = Neighbors(dist, ids, values)
    cut = weighed(full)
    assert cut.ids.shape == (5, 18)
    np.testing.assert_array_equal(cut.ids, ids[:, :18])
    torch.testing.assert_close(knn_target_logprob(cut, targets, 2.0), knn_target_logprob(full, targets, 2.0))
    nothing = Neighbors(np.full((2, 6), np.inf, np.float32), np.full((2, 6), -1), np.full((2, 6), -1, np.int32))
    assert weighed(nothing).ids.shape == (2, 1)
