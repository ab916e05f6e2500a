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


def test_a_large_index_search_uses_blas_and_leaves_the_process_threshold_as_it_was(tmp_path, built, monkeypatch):
    """FAISS's default threshold leaves calls of tens of queries on its query-by-query scan (each
    query reading every key); a search of an index of BLAS_MIN_KEYS keys or more lowers it to
    BLAS_MIN_QUERIES queries for that call only (datastore.index.blas_calls): reading an index, and searching
    a small one, leave FAISS's process-wide threshold as it was, and overlapping calls of two threads restore
    it once both are done (reading a large index must not set it for the whole process)."""
    import contextlib
    import threading

    import numpy as np

    from datastore import Datastore
    from datastore import index as index_module
    from datastore.index import BLAS_MIN_KEYS, BLAS_MIN_QUERIES, blas_calls, read_index

    default = faiss.cvar.distance_compute_blas_threshold
    try:
        d = 8
        rng = np.random.default_rng(0)
        for n, inside in ((BLAS_MIN_KEYS - 1, default), (BLAS_MIN_KEYS, BLAS_MIN_QUERIES * d)):
            index = faiss.IndexFlatL2(d)
            index.add(rng.standard_normal((n, d)).astype(np.float32))
            faiss.write_index(index, str(tmp_path / f"{n}.faiss"))
            assert read_index(tmp_path / f"{n}.faiss").ntotal == n
            assert faiss.cvar.distance_compute_blas_threshold == default  # reading sets nothing
            with blas_calls(index):
                assert faiss.cvar.distance_compute_blas_threshold == inside
            assert faiss.cvar.distance_compute_blas_threshold == default
        xq = rng.standard_normal((BLAS_MIN_QUERIES, d)).astype(np.float32)  # BLAS path: the same neighbours
        with blas_calls(index):
            _, blas_ids = index.search(xq, 10)
        _, scan_ids = index.search(xq, 10)
        assert (blas_ids == scan_ids).mean() > 0.99
        # Two threads' calls overlap: the first one out does not restore under the second.
        entered, leave = threading.Barrier(2), threading.Event()
        seen = []

        def call(first: bool) -> None:
            with blas_calls(index):
                entered.wait()
                if first:
                    return
                leave.wait()
                seen.append(faiss.cvar.distance_compute_blas_threshold)

        threads = [threading.Thread(target=call, args=(first,)) for first in (True, False)]
        for t in threads:
            t.start()
        threads[0].join()
        leave.set()
        threads[1].join()
        assert seen == [BLAS_MIN_QUERIES * d] and faiss.cvar.distance_compute_blas_threshold == default
        # The datastore's own search goes through it (its few keys counted as many: lowered inside only).
        store = Datastore.open(built)
        monkeypatch.setattr(index_module, "BLAS_MIN_KEYS", store.index.ntotal)
        calls = []
        real = index_module.blas_calls

        @contextlib.contextmanager
        def spy(index):
            with real(index):
                calls.append((index is store.index, faiss.cvar.distance_compute_blas_threshold))
                yield

        monkeypatch.setattr(index_module, "blas_calls", spy)
        store.search(np.asarray(store.keys[:2], dtype=np.float32), 3)
        assert calls == [(True, BLAS_MIN_QUERIES * store.dim)]
        assert faiss.cvar.distance_compute_blas_threshold == default
    finally:
        faiss.cvar.distance_compute_blas_threshold = default
