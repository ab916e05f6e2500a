"""The default FAISS factory follows N and d, and every default is a factory FAISS accepts."""

from __future__ import annotations

import faiss
import pytest

from datastore.index import (
    FLAT_MAX,
    SQ8_MAX,
    default_factory,
    default_nlist,
    default_nprobe,
    default_pq_m,
    make_index,
)


@pytest.mark.parametrize("d", [64, 576, 768, 1024, 100])
def test_pq_sub_quantisers_divide_the_dimension(d):
    m = default_pq_m(d)
    assert d % m == 0 and 1 <= m <= 64 and d // m >= 4


@pytest.mark.parametrize("n", [10, 150_000, FLAT_MAX + 1, 1_000_000, SQ8_MAX + 1, 100_000_000])
def test_default_factory_is_valid_and_grows_with_n(n):
    factory, reason = default_factory(n, 576)
    index = make_index(factory, 576)
    if n <= FLAT_MAX:
        assert factory == "Flat"
        assert reason == f"N {n} <= {FLAT_MAX}: exact brute-force search is affordable"
    else:
        # the reason names N, the threshold it was compared with and the list count chosen
        nlist = default_nlist(n)
        assert reason.startswith(f"N {n} {'<=' if n <= SQ8_MAX else '>'} {SQ8_MAX}: {nlist} lists (~4 sqrt N), ")
        ivf = faiss.try_extract_index_ivf(index)
        assert ivf.nlist == default_nlist(n) and n // ivf.nlist >= 64
        assert ("SQ8" in factory) == (n <= SQ8_MAX) and ("PQ" in factory) == (n > SQ8_MAX)
        assert 16 <= default_nprobe(index) <= ivf.nlist


def test_nlist_is_about_four_sqrt_n():
    assert default_nlist(1_000_000) == 4096
    assert default_nlist(100_000_000) == 32768


@pytest.mark.parametrize("factory", ["PQ8", "IVF4,PQ8", "OPQ8,IVF4,PQ8x4"])
def test_pq_indexes_skip_polysemous_training(factory):
    # The factory turns it on for PQ codes; it takes minutes for PQ64 and we never use Hamming filtering.
    index = make_index(factory, 64)
    ivf = faiss.try_extract_index_ivf(index)
    assert faiss.downcast_index(ivf if ivf is not None else index).do_polysemous_training is False


def test_reading_a_large_index_makes_small_search_calls_use_blas(tmp_path):
    """Issue 15: FAISS's default threshold left calls of tens of queries on its query-by-query scan (each
    query reading every key); a large index read sets it to BLAS_MIN_QUERIES queries, a small one keeps it."""
    import numpy as np

    from datastore.index import BLAS_MIN_KEYS, BLAS_MIN_QUERIES, read_index

    default = faiss.cvar.distance_compute_blas_threshold
    try:
        d = 8
        rng = np.random.default_rng(0)
        for n, expected in ((BLAS_MIN_KEYS - 1, default), (BLAS_MIN_KEYS, BLAS_MIN_QUERIES * d)):
            faiss.cvar.distance_compute_blas_threshold = default
            index = faiss.IndexFlatL2(d)
            index.add(rng.standard_normal((n, d)).astype(np.float32))
            faiss.write_index(index, str(tmp_path / f"{n}.faiss"))
            assert read_index(tmp_path / f"{n}.faiss").ntotal == n
            assert faiss.cvar.distance_compute_blas_threshold == expected
        xq = rng.standard_normal((BLAS_MIN_QUERIES, d)).astype(np.float32)  # BLAS path: the same neighbours
        index = read_index(tmp_path / f"{BLAS_MIN_KEYS}.faiss")
        _, blas_ids = index.search(xq, 10)
        faiss.cvar.distance_compute_blas_threshold = default
        _, scan_ids = index.search(xq, 10)
        assert (blas_ids == scan_ids).mean() > 0.99
    finally:
        faiss.cvar.distance_compute_blas_threshold = default
