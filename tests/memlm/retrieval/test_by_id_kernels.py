"""The compiled by-id L2 kernels (memlm.retrieval.by_id_kernels) against a float64 numpy oracle: random float16
and float32 keys, ids with -1 (missing) among them and rows of different counts, a dimension that is no
multiple of the vector width, both builds (this CPU's, and the portable one with its own half conversion);
the build is cached by source and flags; without a compiler the kernels are unavailable (logged once), and the
numpy path's exact member distances (faiss) are the oracle's. The walk's compiled step and extension are held to
numpy's in test_pointers_clusters.py and test_clustered_order.py."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from memlm import compiled
from memlm.retrieval import by_id_kernels
from memlm.retrieval.by_id_kernels import (
    PORTABLE_FLAGS,
    compile_kernels,
    l2_by_id,
    load_kernels,
    lowest_keys_into,
    placed_keys_into,
)
from memlm.retrieval.clustered_states import (
    PAD_KEY,
    clusters_of,
    exact_member_distances,
    lowest_keys,
    placed_keys,
    rank_keys,
)

needs_kernels = pytest.mark.skipif(not by_id_kernels.available(), reason="no C compiler: the kernels cannot be built")


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


@pytest.fixture(scope="module")
def portable(tmp_path_factory) -> object:
    """The portable build (no vector instructions: the C half-to-float conversion), in a folder of its own."""
    return load_kernels(compile_kernels(PORTABLE_FLAGS, tmp_path_factory.mktemp("kernels")))


@needs_kernels
@pytest.mark.parametrize("build", ["this_cpu", "portable"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("d", [1, 37, 576])
def test_l2_by_id_equals_a_float64_oracle(build, dtype, d, portable):
    rng = np.random.default_rng(d)
    n = 300
    keys = (rng.normal(size=(n, d)) * 3).astype(dtype)
    q = rng.normal(size=(6, d)).astype(np.float32)
    ids = ragged_ids(rng, n, [0, 1, 7, 40, 3, 40], 40)
    got = l2_by_id(q, keys, ids, portable if build == "portable" else None)
    want = oracle(q, keys, ids)
    assert got.dtype == np.float32 and got.shape == ids.shape
    np.testing.assert_array_equal(np.isinf(got), ids < 0)
    np.testing.assert_allclose(got[ids >= 0], want[ids >= 0], rtol=2e-6 * max(1, d) ** 0.5, atol=0)


@needs_kernels
@pytest.mark.parametrize("build", ["this_cpu", "portable"])
def test_half_keys_subnormal_infinite_and_nan(build, portable):
    """Every float16 class converts as numpy converts it: subnormals, zero, infinities (distance inf), nan."""
    keys = np.array([[6e-8, -3e-5, 0.0, 1.0], [np.inf, 0.0, 0.0, 0.0], [np.nan, 1.0, 2.0, 3.0],
                     [-65504.0, 1e-4, -2.0, 0.5]], dtype=np.float16)
    q = np.array([[0.0, 1e-5, -1.0, 2.0]], dtype=np.float32)
    ids = np.array([[0, 1, 2, 3, -1]])
    got = l2_by_id(q, keys, ids, portable if build == "portable" else None)
    want = oracle(q, keys, ids)
    np.testing.assert_allclose(got[0, [0, 3]], want[0, [0, 3]], rtol=1e-6)
    assert np.isposinf(got[0, 1]) and np.isnan(got[0, 2]) and np.isposinf(got[0, 4])


@needs_kernels
def test_l2_by_id_refuses_ids_out_of_range_and_odd_keys():
    keys = np.zeros((5, 4), dtype=np.float16)
    q = np.zeros((1, 4), dtype=np.float32)
    for bad in ([[5]], [[-2]]):
        with pytest.raises(ValueError, match="ids must be in"):
            l2_by_id(q, keys, np.array(bad))
    with pytest.raises(ValueError, match="C-contiguous"):
        l2_by_id(q, np.zeros((4, 5), dtype=np.float16).T, np.array([[0]]))
    with pytest.raises(ValueError, match="queries"):
        l2_by_id(np.zeros((2, 4), np.float32), keys, np.array([[0]]))
    assert l2_by_id(q, keys, np.zeros((1, 0), dtype=np.int64)).shape == (1, 0)


@needs_kernels
def test_a_build_is_cached_by_source_and_flags(tmp_path):
    first = compile_kernels(PORTABLE_FLAGS, tmp_path)
    stamp = first.stat().st_mtime_ns
    assert compile_kernels(PORTABLE_FLAGS, tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert compile_kernels(("-O2",), tmp_path) != first  # other flags, another library
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, compile_kernels(("-O2",), tmp_path).name])


@pytest.fixture
def no_compiler(monkeypatch):
    """The kernels as in a process without a C compiler (the cache of `kernels()` cleared before and after)."""
    monkeypatch.setattr(compiled.shutil, "which", lambda name: None)
    by_id_kernels.kernels.cache_clear()
    yield
    by_id_kernels.kernels.cache_clear()


def test_without_a_compiler_the_kernels_are_unavailable_and_logged_once(no_compiler, caplog):
    with caplog.at_level(logging.WARNING, logger=by_id_kernels.__name__):
        assert not by_id_kernels.available() and not by_id_kernels.available()
    assert sum("no compiled by-id kernels" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(RuntimeError, match="not available"):
        l2_by_id(np.zeros((1, 2), np.float32), np.zeros((1, 2), np.float16), np.zeros((1, 1), np.int64))


def test_exact_member_distances_equal_the_oracle():
    """StateClusters' exact distances on the numpy path (faiss over the float32 copy of the float16 keys): the
    oracle's, inf past each row's count."""
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


@needs_kernels
@pytest.mark.parametrize("build", ["this_cpu", "portable"])
def test_placed_keys_into_equals_placed_keys_row_by_row(build, portable):
    """Each row's keys written at its start equal clustered_states.placed_keys (the numpy reference) bit for bit:
    negatives, -0.0 against 0.0 (one key), infinities, subnormals; what no row covers is left as it was."""
    rng = np.random.default_rng(3)
    scores = (rng.normal(size=(4, 9)) * 1e3).astype(np.float32)
    scores[0, :5] = [-0.0, 0.0, -np.inf, np.inf, 1e-45]
    scores[1, :3] = [-1e-45, np.float32(-3.4e38), 3.4e38]
    starts = np.array([30, 0, 9, 18], dtype=np.int64)
    out = np.full(40, 7, dtype=np.int64)
    placed_keys_into(scores, 100, starts, out, portable if build == "portable" else None)
    for row, start in zip(scores, starts):
        want = placed_keys(row.copy(), 100 + np.arange(9, dtype=np.int64))
        np.testing.assert_array_equal(out[start : start + 9], want)
    np.testing.assert_array_equal(out[27:30], 7)
    assert out[30] == out[31] - 1  # -0.0 and 0.0: the same score, ordered by place
    with pytest.raises(ValueError, match="do not fit"):
        placed_keys_into(scores, 0, starts + 5, out)
    with pytest.raises(ValueError, match="float32"):
        placed_keys_into(scores.astype(np.float64), 0, starts, out)


@needs_kernels
@pytest.mark.parametrize("build", ["this_cpu", "portable"])
def test_lowest_keys_into_equals_a_sort_row_by_row(build, portable):
    """Each row's min(take, length) lowest keys, lowest first, the pad after them, against np.sort: random rows,
    rows sharing their high bits (only the places differ), negative keys, an empty row, takes of 0, of more than
    the row and of all of it, and a row whose every 8th key (the sample) is its lowest, so that the sampled
    bound leaves too few and every key is taken; the keys are not changed."""
    rng = np.random.default_rng(5)
    lengths = [3000, 0, 2500, 700, 4000, 16, 5000]
    takes = np.array([1000, 5, 2500, 900, 0, 3, 600], dtype=np.int64)
    rows = [(rng.integers(-2**31, 2**31, n).astype(np.int64) << 32) | rng.permutation(n) for n in lengths]
    rows[2] = (np.int64(-7) << 32) | rng.permutation(2500)  # one shared high part
    rows[6] = (rng.integers(1000, 2000, 5000).astype(np.int64) << 32) | np.arange(5000)
    rows[6][::8] = (np.int64(3) << 32) | np.arange(0, 5000, 8)  # the sample holds the lowest 625
    keys = np.concatenate(rows)
    bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    out = np.full((len(lengths), 2500), PAD_KEY, dtype=np.int64)
    before = keys.copy()
    lowest_keys_into(keys, bounds, takes, out, portable if build == "portable" else None)
    for i, (row, take) in enumerate(zip(rows, takes)):
        want = np.sort(row)[:take]
        np.testing.assert_array_equal(out[i, : want.size], want)
        assert (out[i, want.size :] == PAD_KEY).all()
    np.testing.assert_array_equal(keys, before)
    with pytest.raises(ValueError, match="bounds"):
        lowest_keys_into(keys, bounds[::-1].copy(), takes, out)
    with pytest.raises(ValueError, match="out must be"):
        lowest_keys_into(keys, bounds, takes, out[:, :10].copy())


@needs_kernels
def test_lowest_keys_equal_with_and_without_the_kernels(monkeypatch):
    """clustered_states.lowest_keys: the compiled selection and numpy's partition and sort give the same rows."""
    rng = np.random.default_rng(6)
    lengths = [900, 0, 40, 1200]
    keys = np.concatenate([(rng.integers(-5, 5, n).astype(np.int64) << 32) | rng.permutation(n) for n in lengths])
    bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    takes = np.array([300, 4, 100, 1200], dtype=np.int64)
    compiled = lowest_keys(keys.copy(), bounds, takes)
    monkeypatch.setattr(by_id_kernels, "available", lambda: False)
    np.testing.assert_array_equal(lowest_keys(keys.copy(), bounds, takes), compiled)


@pytest.mark.parametrize("sketched", [False, True])
def test_rank_keys_equal_with_and_without_the_kernels(sketched, monkeypatch):
    """The clustered walk's sort keys: the compiled writer and the numpy one give the same keys, pairs asking
    for the same cluster in one call among them, exact and sketched scores."""
    rng = np.random.default_rng(11)
    n, d = 400, 24
    keys = rng.normal(size=(n, d)).astype(np.float16)
    cl = clusters_of(rng.integers(0, 5, size=n), keys, 5, seed=0, sketch_dims=8 if sketched else 0)
    q = torch.from_numpy(rng.normal(size=(3, d)).astype(np.float32))
    p_row, p_cl = np.array([0, 1, 2, 0, 2]), np.array([3, 3, 0, 1, 4])
    compiled = rank_keys(q, p_row, p_cl, cl)
    monkeypatch.setattr(by_id_kernels, "available", lambda: False)
    np.testing.assert_array_equal(compiled, rank_keys(q, p_row, p_cl, cl))
