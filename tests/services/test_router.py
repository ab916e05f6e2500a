"""Shard router: over exact (Flat) shards it equals one Flat index over their union.

Shape legend: N datastore entries, d key dimension, Q queries, k neighbours.
"""

from __future__ import annotations

import dataclasses
import hashlib

import grpc
import numpy as np
import pytest

from memlm.errors import MemlmError
from memlm.retrieval.searcher import Neighbors
from services.retrieval.client import RetrievalClient
from services.retrieval.server import create_retrieval_server
from services.router.server import create_router_server, merge_top_k
from services.common.server import ServiceError


def start_shards(loop_thread, searcher, sizes, flat_searcher_type):
    """Split `searcher`'s rows into consecutive shards of `sizes`; one server each, in order."""
    ports, start = [], 0
    for size in sizes:
        shard = flat_searcher_type(searcher.keys[start : start + size], searcher.values[start : start + size])
        ports.append(loop_thread.start(create_retrieval_server, "127.0.0.1:0", shard))
        start += size
    return [f"127.0.0.1:{p}" for p in ports]


@pytest.mark.parametrize("k", [1, 80, 3100])  # 80 > the 50-row shard; 3100 > all 3000 rows
def test_router_over_flat_shards_equals_flat_union(loop_thread, searcher, k):
    shards = start_shards(loop_thread, searcher, [1000, 50, 1950], type(searcher))
    port = loop_thread.start(create_router_server, "127.0.0.1:0", shards)
    xq = np.random.default_rng(k).standard_normal((20, searcher.dim)).astype(np.float32)  # (Q, d)
    with RetrievalClient(f"127.0.0.1:{port}") as client:
        assert client.info().n == 3000 and client.dim == searcher.dim
        remote = client.search(xq, k)
    expected = searcher.search(xq, k)
    for name, a, b in zip(("distances", "ids", "values"), remote, expected):
        np.testing.assert_array_equal(a, b, err_msg=name)
    # Every shard contributed (ids are global: 1000..1049 come from the middle shard).
    if k == 3100:
        assert set(range(3000)) == set(remote.ids[0, :3000].tolist()) and (remote.ids[:, 3000:] == -1).all()


def test_merge_top_k_offsets_ids_and_keeps_missing():
    a = Neighbors(np.array([[0.5, np.inf]], np.float32), np.array([[1, -1]]), np.array([[7, -1]], np.int32))
    b = Neighbors(np.array([[0.1, 0.7]], np.float32), np.array([[0, 3]]), np.array([[8, 9]], np.int32))
    merged = merge_top_k([a, b], offsets=[0, 10], k=4)
    np.testing.assert_array_equal(merged.ids, [[10, 1, 13, -1]])
    np.testing.assert_array_equal(merged.values, [[8, 7, 9, -1]])
    np.testing.assert_array_equal(merged.distances, np.array([[0.1, 0.5, 0.7, np.inf]], np.float32))


def test_router_refuses_shards_that_disagree(loop_thread, make_searcher):
    a, b = make_searcher(100, 8, seed=1), make_searcher(100, 8, seed=2)
    pa = loop_thread.start(create_retrieval_server, "127.0.0.1:0", a)
    b.info_changes["model_fingerprint"] = "other-model"
    pb = loop_thread.start(create_retrieval_server, "127.0.0.1:0", b)
    with pytest.raises(MemlmError, match="model_fingerprint"):
        loop_thread.run(create_router_server("127.0.0.1:0", [f"127.0.0.1:{pa}", f"127.0.0.1:{pb}"]))


@pytest.mark.parametrize("field, value", [
    ("tokenizer_fingerprint", "other-tokenizer"), ("metric", "ip"), ("key_layer", "ffn_input.0"), ("context", 1024),
    ("stride", 512), ("boundary_token", 7), ("sink_tokens", 4),
])
def test_router_refuses_shards_whose_keys_were_made_differently(loop_thread, make_searcher, field, value):
    a, b = make_searcher(100, 8, seed=1), make_searcher(100, 8, seed=2)
    b.info_changes[field] = value
    pa = loop_thread.start(create_retrieval_server, "127.0.0.1:0", a)
    pb = loop_thread.start(create_retrieval_server, "127.0.0.1:0", b)
    with pytest.raises(MemlmError, match=f"has {field}={value!r} but shard"):
        loop_thread.run(create_router_server("127.0.0.1:0", [f"127.0.0.1:{pa}", f"127.0.0.1:{pb}"]))


def test_router_info_describes_the_union_of_its_shards(loop_thread, make_searcher):
    shards = [make_searcher(100, 8, seed=1), make_searcher(50, 8, seed=2), make_searcher(70, 8, seed=3)]
    for i, shard in enumerate(shards):
        shard.info_changes.update(corpus=f"corpus shard {i} of 3", corpus_fingerprint=f"fp{i}")
    shards[2].info_changes.update(index="IVF4,Flat", nprobe=2)
    ports = [loop_thread.start(create_retrieval_server, "127.0.0.1:0", s) for s in shards]
    router = loop_thread.start(create_router_server, "127.0.0.1:0", [f"127.0.0.1:{p}" for p in ports])
    with RetrievalClient(f"127.0.0.1:{router}") as client:
        info = client.info()
    first = shards[0].info()
    assert info == dataclasses.replace(
        first, n=220, index="Flat | IVF4,Flat", nprobe=0,  # 0: the shards' default nprobe differs
        corpus="corpus shard 0 of 3 | corpus shard 1 of 3 | corpus shard 2 of 3",
        corpus_fingerprint=hashlib.sha256(b"fp0\nfp1\nfp2").hexdigest(),
    )


def test_router_over_one_shard_describes_it_unchanged(loop_thread, make_searcher):
    shard = make_searcher(100, 8, seed=1)
    port = loop_thread.start(create_retrieval_server, "127.0.0.1:0", shard)
    router = loop_thread.start(create_router_server, "127.0.0.1:0", [f"127.0.0.1:{port}"])
    with RetrievalClient(f"127.0.0.1:{router}") as client:
        assert client.info() == shard.info()


def test_router_validates_input_and_passes_deadlines(loop_thread, searcher, gated_searcher):
    fast = start_shards(loop_thread, searcher, [1500], type(searcher))
    gated_searcher.info_changes["n"] = 1500
    slow = loop_thread.start(create_retrieval_server, "127.0.0.1:0", gated_searcher)
    port = loop_thread.start(create_router_server, "127.0.0.1:0", [*fast, f"127.0.0.1:{slow}"])
    with RetrievalClient(f"127.0.0.1:{port}", timeout=0.5) as client:
        with pytest.raises(ServiceError) as info:
            client.search(np.zeros((2, 5), np.float32), 3)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "queries.shape[1]" in info.value.details
        with pytest.raises(ServiceError) as info:  # the gated shard never answers in time
            client.search(np.zeros((2, searcher.dim), np.float32), 3)
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    gated_searcher.release.set()
