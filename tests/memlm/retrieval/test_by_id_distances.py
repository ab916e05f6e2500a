"""Squared L2 between queries and keys given by id, on the library paths (faiss' fvec_L2sqr_by_idx over float32
keys, a gather and a torch reduction over float16 ones), against a float64 numpy oracle: random float16 and float32
keys, ids with -1 (missing) among them, rows of different counts, a dimension that is no multiple of a vector
width. memlm.retrieval.pointers' pointer distances and clustered_states' member distances."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from memlm.retrieval.clustered_states import clusters_of, exact_member_distances
from memlm.retrieval.pointers import _exact_distances


def oracle(q: np.ndarray, keys: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """(r, e) float64 ||q[i] - keys[ids[i, j]]||^2, inf where the id is -1, row by row."""
    out = np.full(ids.shape, np.inf)
    for i, j in zip(*np.nonzero(ids >= 0)):
        out[i, j] = ((q[i].astype(np.float64) - keys[ids[i, j]].astype(np.float64)) ** 2).sum()
    return out


def ragged_ids(rng: np.random.Generator, n: int, counts: list[int], width: int) -> np.ndarray:
    """(len(counts), width) int64 ids: row i holds counts[i] ids (repeats allowed) with a few -1 among them,
    then -1 to the end of the row."""
    ids = np.full((len(counts), width), -1, dtype=np.int64)
    for i, c in enumerate(counts):
        ids[i, :c] = rng.integers(0, n, size=c)
        ids[i, :c][rng.random(c) < 0.2] = -1
    return ids


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("d", [1, 37, 576])
def test_pointer_distances_equal_a_float64_oracle(dtype, d):
    rng = np.random.default_rng(d)
    n = 300
    keys = (rng.normal(size=(n, d)) * 3).astype(dtype)
    q = rng.normal(size=(6, d)).astype(np.float32)
    ids = ragged_ids(rng, n, [0, 1, 7, 40, 3, 40], 40)
    got = _exact_distances(q, ids, ids >= 0, keys)
    want = oracle(q, keys, ids)
    assert got.dtype == np.float32 and got.shape == ids.shape
    np.testing.assert_array_equal(np.isinf(got), ids < 0)
    np.testing.assert_allclose(got[ids >= 0], want[ids >= 0], rtol=2e-6 * max(1, d) ** 0.5, atol=0)


def test_exact_member_distances_equal_the_oracle():
    """StateClusters' exact distances (faiss over the float32 copy of the float16 keys): the oracle's, inf past
    each row's count."""
    rng = np.random.default_rng(5)
    n, d = 500, 70
    keys = rng.normal(size=(n, d)).astype(np.float16)
    cl = clusters_of(rng.integers(0, 6, size=n), keys, 6, seed=0)
    pos = ragged_ids(rng, n, [10, 0, 33, 50], 50).clip(min=0)  # places in cl.members
    counts = np.array([10, 0, 33, 50])
    q = torch.from_numpy(rng.normal(size=(4, d)).astype(np.float32))
    got = exact_member_distances(q, pos, counts, cl)
    scored = np.arange(pos.shape[1])[None, :] < counts[:, None]  # (r, e)
    want = oracle(q.numpy(), keys, np.where(scored, cl.members[pos], -1))
    np.testing.assert_array_equal(np.isinf(got), ~scored)
    np.testing.assert_allclose(got[scored], want[scored], rtol=1e-5)
