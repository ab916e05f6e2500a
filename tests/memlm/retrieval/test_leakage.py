"""exclude_nearby: masks exactly the neighbours from the query's document within the window,
against an oracle loop over every (query, neighbour)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from memlm.retrieval.leakage import exclude_nearby
from memlm.retrieval.searcher import Neighbors, Provenance


def random_case(seed: int, q: int = 40, k: int = 12) -> tuple[Neighbors, Provenance, torch.Tensor, torch.Tensor]:
    """Neighbours over 3 documents of 20 positions, some missing (id -1), queries from those documents
    and from outside (document -1): plenty of same-document neighbours at every distance."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 60, size=(q, k)).astype(np.int64)  # (Q, k)
    ids[rng.random((q, k)) < 0.15] = -1
    missing = ids < 0
    docs = np.where(missing, -1, ids // 20).astype(np.int32)  # (Q, k)
    positions = np.where(missing, -1, ids % 20 + 1).astype(np.int32)  # (Q, k)
    distances = np.sort(rng.random((q, k)).astype(np.float32), axis=1)
    distances[missing] = np.inf
    values = np.where(missing, -1, rng.integers(0, 50, size=(q, k))).astype(np.int32)
    query_docs = torch.from_numpy(rng.integers(-1, 3, size=q))  # (Q,)
    query_positions = torch.from_numpy(rng.integers(1, 21, size=q))  # (Q,)
    return Neighbors(distances, ids, values), Provenance(docs, positions), query_docs, query_positions


def oracle(neighbors, provenance, query_docs, query_positions, window) -> np.ndarray:
    """(Q, k) bool: which neighbours leak, one by one."""
    q, k = neighbors.ids.shape
    leak = np.zeros((q, k), dtype=bool)
    for i in range(q):
        for j in range(k):
            if neighbors.ids[i, j] < 0 or int(query_docs[i]) < 0:
                continue
            leak[i, j] = (provenance.docs[i, j] == int(query_docs[i])
                          and abs(int(provenance.positions[i, j]) - int(query_positions[i])) <= window)
    return leak


@pytest.mark.parametrize("seed, window", [(0, 0), (1, 1), (2, 3), (3, 25)])
def test_removes_exactly_the_nearby_neighbours_of_the_same_document(seed, window):
    neighbors, provenance, query_docs, query_positions = random_case(seed)
    before = [a.copy() for a in neighbors]
    got = exclude_nearby(neighbors, provenance, query_docs, query_positions, window)
    leak = oracle(neighbors, provenance, query_docs, query_positions, window)
    assert leak.any() and (~leak & (neighbors.ids >= 0)).any()  # the case has both kinds
    np.testing.assert_array_equal(got.ids, np.where(leak, -1, neighbors.ids))
    np.testing.assert_array_equal(got.values, np.where(leak, -1, neighbors.values))
    np.testing.assert_array_equal(got.distances, np.where(leak, np.inf, neighbors.distances))
    assert (got.ids.dtype, got.values.dtype, got.distances.dtype) == (np.int64, np.int32, np.float32)
    for a, b in zip(before, neighbors):  # the input is not changed in place
        np.testing.assert_array_equal(a, b)


def test_window_zero_removes_the_query_own_entry_only():
    ids = np.array([[5, 6, 7, 8]], dtype=np.int64)  # (1, 4)
    neighbors = Neighbors(np.array([[0.0, 1.0, 2.0, 3.0]], dtype=np.float32), ids,
                          np.array([[10, 11, 12, 13]], dtype=np.int32))
    # the query's own entry (doc 2, position 7), its neighbour at 8, the same position in doc 1, doc 2 at 5
    provenance = Provenance(np.array([[2, 2, 1, 2]], dtype=np.int32), np.array([[7, 8, 7, 5]], dtype=np.int32))
    got = exclude_nearby(neighbors, provenance, torch.tensor([2]), torch.tensor([7]), window=0)
    np.testing.assert_array_equal(got.ids, [[-1, 6, 7, 8]])
    got = exclude_nearby(neighbors, provenance, torch.tensor([2]), torch.tensor([7]), window=2)
    np.testing.assert_array_equal(got.ids, [[-1, -1, 7, -1]])
    np.testing.assert_array_equal(got.values, [[-1, -1, 12, -1]])
    got = exclude_nearby(neighbors, provenance, torch.tensor([-1]), torch.tensor([7]), window=100)
    np.testing.assert_array_equal(got.ids, ids)  # a query from outside the datastore keeps everything


def test_bad_arguments_are_refused():
    neighbors, provenance, query_docs, query_positions = random_case(0, q=4, k=3)
    with pytest.raises(ValueError, match="window must be >= 0"):
        exclude_nearby(neighbors, provenance, query_docs, query_positions, -1)
    with pytest.raises(ValueError, match=r"query_docs has shape \(3,\), expected \(4,\)"):
        exclude_nearby(neighbors, provenance, query_docs[:3], query_positions, 1)
    with pytest.raises(ValueError, match="provenance.positions has shape"):
        exclude_nearby(neighbors, Provenance(provenance.docs, provenance.positions[:, :2]), query_docs,
                       query_positions, 1)


def test_document_indices_find_every_copy_and_nothing_for_absent_documents():
    from memlm.retrieval.leakage import copy_level, document_indices

    table = ["a", "b", "a", "c", "a"]  # the datastore holds text "a" three times
    found = document_indices(table, ["c", "x", "a", "b"])
    assert found == [[3], [], [0, 2, 4], [1]]
    assert [copy_level(found, level) for level in range(3)] == [[3, -1, 0, 1], [-1, -1, 2, -1], [-1, -1, 4, -1]]


def test_one_pass_per_copy_masks_every_copy_and_an_absent_document_nothing():
    from memlm.retrieval.leakage import copy_level

    nb, prov, _docs, positions = random_case(3)
    indices = [[0, 2] if i % 3 == 0 else [] for i in range(nb.ids.shape[0])]  # (Q,) copies 0 and 2, or absent
    out = nb
    for level in range(2):
        out = exclude_nearby(out, prov, torch.tensor(copy_level(indices, level)), positions, 4)
    for q in range(nb.ids.shape[0]):
        for j in range(nb.ids.shape[1]):
            leak = (nb.ids[q, j] >= 0 and int(prov.docs[q, j]) in indices[q]
                    and abs(int(prov.positions[q, j]) - int(positions[q])) <= 4)
            assert (out.ids[q, j] == -1) == (leak or nb.ids[q, j] == -1)
    absent = [q for q in range(len(indices)) if not indices[q]]
    assert np.array_equal(out.ids[absent], nb.ids[absent])  # -1: nothing of an absent document is masked
    assert any(int(prov.docs[q, j]) == 2 and out.ids[q, j] == -1 for q in range(0, len(indices), 3)
               for j in range(nb.ids.shape[1]))  # the second copy's entries were there to mask
