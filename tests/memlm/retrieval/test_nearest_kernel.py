"""The compiled nearest-k kernel (memlm.retrieval.nearest_kernel) against a numpy oracle: the distances the torch
path computes (((x.k * -2) + |x|^2) + |k|^2, clamped at 0, in float32), bit for bit, and the ids of the k smallest
by (distance, id); both builds (this CPU's and the portable one); rows short of k padded; chunks merged equal one
chunk; a strided sample that misses the near keys falls back to every key and stays exact; and the torch exact
searcher with the kernel returns what it returns with torch.topk (the same distances, the same neighbour sets)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from memlm.retrieval import nearest_kernel
from memlm.retrieval.exact import TorchExactSearcher
from memlm.retrieval.nearest_kernel import PORTABLE_FLAGS, compile_kernel, empty_best, load_kernel, nearest_into

needs_kernel = pytest.mark.skipif(not nearest_kernel.available(), reason="no C compiler: the kernel cannot be built")


@pytest.fixture(scope="module")
def portable(tmp_path_factory) -> object:
    """The portable build (no vector instructions), in a folder of its own."""
    return load_kernel(compile_kernel(PORTABLE_FLAGS, tmp_path_factory.mktemp("kernels")))


def torch_distances(products: np.ndarray, x_norms: np.ndarray, key_norms: np.ndarray) -> np.ndarray:
    """(Q, n) float32 distances as TorchExactSearcher's torch path computes them."""
    d = torch.from_numpy(products.copy()).mul_(-2.0).add_(torch.from_numpy(x_norms)[:, None])
    return d.add_(torch.from_numpy(key_norms)).clamp_(min=0.0).numpy()


def oracle(dist: np.ndarray, k: int, id_offset: int) -> tuple[np.ndarray, np.ndarray]:
    """(Q, k) the k smallest distances of each row and their ids (position + id_offset), by (distance, id); inf
    and -1 past the row's end."""
    Q, n = dist.shape
    best_d, best_i = empty_best(Q, k)
    for r in range(Q):
        order = np.lexsort((np.arange(n), dist[r]))[:k]
        best_d[r, : len(order)] = dist[r, order]
        best_i[r, : len(order)] = order + id_offset
    return best_d, best_i


def assert_equals_the_oracle(products: np.ndarray, x_norms: np.ndarray, key_norms: np.ndarray, k: int,
                             id_offset: int, lib: object | None) -> None:
    """nearest_into over one chunk from nothing gives the oracle's distances (bit for bit, inf padding included) and
    ids."""
    best_d, best_i = empty_best(products.shape[0], k)
    nearest_into(products, x_norms, key_norms, id_offset, best_d, best_i, lib)
    want_d, want_i = oracle(torch_distances(products, x_norms, key_norms), k, id_offset)
    np.testing.assert_array_equal(best_d, want_d)
    np.testing.assert_array_equal(best_i, want_i)


def random_chunk(rng: np.random.Generator, Q: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """products (Q, n), x_norms (Q,), key_norms (n,) of random float32 queries and keys (d 24), with duplicate
    keys (tied distances) and a query equal to a key (a distance that cancels to about 0)."""
    keys = rng.normal(size=(n, 24)).astype(np.float32)
    keys[1::5] = keys[0::5][: len(keys[1::5])]  # duplicates: ties
    x = rng.normal(size=(Q, 24)).astype(np.float32)
    x[0] = keys[min(3, n - 1)]
    return x @ keys.T, (x * x).sum(1), (keys * keys).sum(1)


@needs_kernel
@pytest.mark.parametrize("build", ["this_cpu", "portable"])
@pytest.mark.parametrize(("Q", "n", "k"), [(1, 40000, 1024), (3, 5000, 100), (2, 37, 64), (4, 4096, 1)])
def test_nearest_equals_the_oracle(build, Q, n, k, portable):
    rng = np.random.default_rng(n + k)
    products, x_norms, key_norms = random_chunk(rng, Q, n)
    assert_equals_the_oracle(products, x_norms, key_norms, k, 7, portable if build == "portable" else None)


@needs_kernel
@pytest.mark.parametrize("build", ["this_cpu", "portable"])
def test_chunks_merged_equal_one_chunk(build, portable):
    rng = np.random.default_rng(1)
    products, x_norms, key_norms = random_chunk(rng, 3, 30000)
    lib = portable if build == "portable" else None
    whole_d, whole_i = empty_best(3, 500)
    nearest_into(products, x_norms, key_norms, 0, whole_d, whole_i, lib)
    merged_d, merged_i = empty_best(3, 500)
    for lo, hi in ((0, 20000), (20000, 20001), (20001, 30000)):
        nearest_into(products[:, lo:hi], x_norms, key_norms[lo:hi], lo, merged_d, merged_i, lib)
    np.testing.assert_array_equal(merged_d, whole_d)
    np.testing.assert_array_equal(merged_i, whole_i)


@needs_kernel
@pytest.mark.parametrize("build", ["this_cpu", "portable"])
def test_a_sample_that_misses_the_near_keys_falls_back_to_every_key(build, portable):
    """The strided sample sees only every 16th key; make those the nearest, so that its bound leaves fewer than
    k candidates: the result must still be exact."""
    n, k = 16 * 2000, 300
    rng = np.random.default_rng(2)
    key_norms = rng.uniform(10.0, 20.0, n).astype(np.float32)
    key_norms[:: nearest_kernel.SAMPLE_STRIDE] = rng.uniform(0.0, 1.0, n // nearest_kernel.SAMPLE_STRIDE)
    products, x_norms = np.zeros((1, n), dtype=np.float32), np.zeros(1, dtype=np.float32)
    assert_equals_the_oracle(products, x_norms, key_norms, k, 0, portable if build == "portable" else None)


@needs_kernel
@pytest.mark.parametrize("build", ["this_cpu", "portable"])
def test_nan_distances_come_last_as_torch_topk_puts_them(build, portable):
    """A row with fewer than k keys of a number distance: the nan ones follow them, as torch.topk returns them."""
    rng = np.random.default_rng(4)
    products, x_norms, key_norms = random_chunk(rng, 2, 40)
    key_norms[[3, 17, 30]] = np.nan
    best_d, best_i = empty_best(2, 45)
    nearest_into(products, x_norms, key_norms, 0, best_d, best_i, portable if build == "portable" else None)
    dist = torch_distances(products, x_norms, key_norms)
    want_d, _ = torch.topk(torch.from_numpy(dist), 40, dim=1, largest=False, sorted=True)
    np.testing.assert_array_equal(best_d[:, :40], want_d.numpy())  # nan where torch has nan
    assert np.isnan(best_d[:, 37:40]).all() and (best_i[:, 40:] == -1).all()
    assert sorted(best_i[0, 37:40]) == [3, 17, 30]


@needs_kernel
def test_refuses_mismatched_shapes():
    best_d, best_i = empty_best(2, 4)
    with pytest.raises(ValueError, match="expected"):
        nearest_into(np.zeros((2, 10), np.float32), np.zeros(3, np.float32), np.zeros(10, np.float32), 0,
                     best_d, best_i)
    with pytest.raises(ValueError, match="writeable C-contiguous"):
        nearest_into(np.zeros((2, 10), np.float32), np.zeros(2, np.float32), np.zeros(10, np.float32), 0,
                     best_d.astype(np.float64), best_i)


@needs_kernel
def test_the_exact_searcher_with_the_kernel_equals_torch_topk(monkeypatch):
    """Same distances, same neighbours but for ties (which of the keys tied at the k-th distance, and the order
    among equal distances, where torch.topk's is unspecified)."""
    rng = np.random.default_rng(3)
    keys = torch.from_numpy(rng.normal(size=(9000, 32)).astype(np.float16))
    keys[1::4] = keys[0::4]  # duplicate keys: ties
    searcher = TorchExactSearcher(keys, rng.integers(0, 50, 9000).astype(np.int32), chunk_size=4000)
    xq = rng.normal(size=(5, 32)).astype(np.float32)
    with_kernel = searcher.search(xq, 256)
    monkeypatch.setattr(nearest_kernel, "available", lambda: False)
    with_topk = searcher.search(xq, 256)
    np.testing.assert_array_equal(with_kernel.distances, with_topk.distances)
    for r in range(5):  # the same neighbours, but for which of the keys tied at the k-th distance
        kth = with_kernel.distances[r, -1]
        nearer = set(with_kernel.ids[r][with_kernel.distances[r] < kth])
        assert nearer == set(with_topk.ids[r][with_topk.distances[r] < kth])
        np.testing.assert_array_equal(searcher.values[with_kernel.ids[r]], with_kernel.values[r])
    by_id = np.lexsort((with_kernel.ids, with_kernel.distances), axis=1)
    np.testing.assert_array_equal(by_id, np.broadcast_to(np.arange(256), (5, 256)))  # ties broken by the id
    none = searcher.search(xq, 0)  # k 0: nothing, as before the kernel
    assert none.ids.shape == (5, 0) and none.distances.shape == (5, 0)
