"""Datastore.open/search: the Searcher seam, refusals, exact re-rank, recall against exact search."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
from store_helpers import BOS, PROVENANCE, WINDOW

from datastore import BuildSettings, Datastore, build_from_tokens
from memlm.errors import MemlmError
from memlm.jobs.knnlm_eval import recall_at_k
from memlm.retrieval.searcher import Searcher, SearcherInfo, SearchOptions


def brute_force(keys: np.ndarray, xq: np.ndarray) -> np.ndarray:
    """(Q, N) exact squared L2 in float64 from the stored float16 keys."""
    k64 = keys.astype(np.float64)
    return ((xq.astype(np.float64)[:, None, :] - k64[None]) ** 2).sum(-1)


def queries(ds: Datastore, n: int = 64, seed: int = 0) -> np.ndarray:
    """Keys of held-out positions perturbed a little: realistic queries that are not stored keys."""
    rng = np.random.default_rng(seed)
    rows = rng.choice(len(ds), size=n, replace=False)
    base = np.asarray(ds.keys[rows], dtype=np.float32)
    return base + rng.normal(scale=0.05, size=base.shape).astype(np.float32)


def test_datastore_is_a_searcher_and_reports_info(built):
    ds = Datastore.open(built)
    assert isinstance(ds, Searcher) and ds.dim == 64
    p = PROVENANCE
    assert ds.info() == SearcherInfo(
        n=1483, dim=64, index="IVF16,Flat", metric="l2", nprobe=4, key_layer="ffn_input.1",
        model_name=p.model_name, model_fingerprint=p.model_fingerprint, tokenizer_fingerprint=p.tokenizer_fingerprint,
        corpus=p.corpus, corpus_fingerprint=p.corpus_fingerprint, context=WINDOW.context, stride=WINDOW.stride,
        boundary_token=BOS, sink_tokens=0,
    )


def test_ivf_recall_at_10_against_exact_search(built):
    ds = Datastore.open(built)
    exact = ds.exact_searcher("cpu")
    assert exact.info() == dataclasses.replace(ds.info(), index="exact", nprobe=1)
    xq = queries(ds)
    recall = recall_at_k(ds, exact, xq, 10)  # the manifest's nprobe 4 of 16 lists
    assert recall >= 0.9
    assert recall_at_k(ds, exact, xq, 10, SearchOptions(nprobe=16)) == 1.0  # all lists probed: exact
    assert recall_at_k(ds, exact, xq, 10, SearchOptions(nprobe=1)) < recall  # fewer lists, fewer found


def test_search_results_match_brute_force_with_all_lists(built):
    ds = Datastore.open(built)
    xq = queries(ds, 8)
    nb = ds.search(xq.astype(np.float16), 5, SearchOptions(nprobe=16))
    exact = brute_force(np.asarray(ds.keys), xq.astype(np.float16).astype(np.float32))
    np.testing.assert_allclose(nb.distances, np.sort(exact, axis=1)[:, :5], rtol=1e-4, atol=1e-3)
    np.testing.assert_array_equal(nb.values, np.asarray(ds.values)[nb.ids])


def test_exact_rerank_gives_exact_distances(tmp_path, tiny_model, docs):
    out = build_from_tokens(tiny_model, docs, tmp_path / "pq", PROVENANCE,
                            BuildSettings(window=WINDOW, index_factory="IVF8,PQ8x4", nprobe=8),
                            progress=False, log=lambda m: None)
    ds = Datastore.open(out)
    xq = queries(ds, 16)
    approx = ds.search(xq, 20)
    reranked = ds.search(xq, 20, SearchOptions(exact_rerank=True))
    exact = brute_force(np.asarray(ds.keys), xq)  # (Q, N)
    oracle = np.take_along_axis(exact, reranked.ids, axis=1)
    np.testing.assert_allclose(reranked.distances, oracle, rtol=1e-5, atol=1e-4)
    assert (np.diff(reranked.distances, axis=1) >= 0).all()
    assert np.array_equal(np.sort(approx.ids, 1), np.sort(reranked.ids, 1))  # same ids, re-sorted
    assert np.abs(approx.distances - np.sort(np.take_along_axis(exact, approx.ids, 1), 1)).max() > 1e-2  # PQ is lossy


def test_k_larger_than_n_pads_with_missing(tmp_path, tiny_model):
    out = build_from_tokens(tiny_model, [[5, 6, 7]], tmp_path / "small", PROVENANCE,
                            BuildSettings(window=WINDOW), progress=False, log=lambda m: None)
    ds = Datastore.open(out)
    for rerank in (False, True):
        nb = ds.search(np.zeros((2, ds.dim), np.float32), 6, SearchOptions(exact_rerank=rerank))
        assert (nb.ids[:, 3:] == -1).all() and (nb.values[:, 3:] == -1).all() and np.isinf(nb.distances[:, 3:]).all()
        assert sorted(nb.values[0, :3]) == [5, 6, 7]


def test_mmap_index_searches_the_same(built):
    xq = queries(Datastore.open(built), 8)
    a = Datastore.open(built).search(xq, 10)
    b = Datastore.open(built, mmap=True).search(xq, 10)
    np.testing.assert_array_equal(a.ids, b.ids)
    np.testing.assert_array_equal(a.distances, b.distances)


@pytest.mark.parametrize("which", ["model", "tokenizer"])
def test_fingerprint_mismatch_is_refused(built, which):
    """The one check (memlm.retrieval.compat.check_searcher) over what the opened datastore says."""
    from memlm.retrieval.compat import check_searcher

    info = Datastore.open(built).info()
    ours = {"model_fingerprint": PROVENANCE.model_fingerprint, "tokenizer_fingerprint": PROVENANCE.tokenizer_fingerprint,
            "dim": info.dim, "key_layer": info.key_layer, "boundary_token": PROVENANCE.boundary_token}
    check_searcher(info, **ours)
    with pytest.raises(MemlmError, match=f"different {which}"):
        check_searcher(info, **{**ours, f"{which}_fingerprint": "0" * 64})


@pytest.mark.parametrize("name", ["keys.f16", "values.i32", "docs.i32", "positions.i32", "index.faiss"])
def test_corrupted_file_is_refused(tmp_path, built, name):
    copy = tmp_path / "copy"
    shutil.copytree(built, copy)
    data = bytearray((copy / name).read_bytes())
    data[len(data) // 2] ^= 0x01  # flip one bit in the middle
    (copy / name).write_bytes(bytes(data))
    with pytest.raises(MemlmError, match="checksum"):
        Datastore.open(copy)
    (copy / name).write_bytes(bytes(data[:-4]))  # truncated: caught by size even without verify
    with pytest.raises(MemlmError, match="bytes"):
        Datastore.open(copy, verify=False)


def test_not_a_datastore_is_refused(tmp_path):
    with pytest.raises(MemlmError, match="manifest.json"):
        Datastore.open(tmp_path)


def test_bad_queries_are_refused(built):
    ds = Datastore.open(built)
    with pytest.raises(MemlmError, match="shape"):
        ds.search(np.zeros((2, 3), np.float32), 4)
    with pytest.raises(MemlmError, match="float32 or float16"):
        ds.search(np.zeros((2, ds.dim), np.int64), 4)



def test_nprobe_option_changes_the_search_and_none_means_the_manifest_default(built):
    ds = Datastore.open(built)
    xq = queries(ds)
    default = ds.search(xq, 10)
    np.testing.assert_array_equal(default.ids, ds.search(xq, 10, SearchOptions(nprobe=4)).ids)  # manifest nprobe 4
    assert not np.array_equal(default.ids, ds.search(xq, 10, SearchOptions(nprobe=1)).ids)


def test_torch_backend_is_exact_search_over_the_stored_keys(built):
    """backend="torch": the exact neighbours of the float16 keys (float64 brute force is the oracle)."""
    ds = Datastore.open(built, backend="torch", device="cpu")
    xq = queries(ds)
    nb = ds.search(xq, 10)
    want = np.argsort(brute_force(np.asarray(ds.keys), xq), axis=1, kind="stable")[:, :10]
    assert (nb.ids == want).mean() > 0.99  # ties in float32 may swap equal-distance neighbours
    np.testing.assert_array_equal(nb.values, np.asarray(ds.values)[nb.ids])


def test_unknown_backend_is_refused(built):
    with pytest.raises(MemlmError, match="backend"):
        Datastore.open(built, backend="annoy")
