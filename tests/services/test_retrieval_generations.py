"""Live generations: a retrieval server searched in a loop while `add`, `remove` and
`compact` commit generations 1, 2 and 3 of its datastore answers every call (0 errors), each answer is
the one of the generation it was served from (A, or A + B), and GetInfo then reports the new generation."""

from __future__ import annotations

import asyncio
import shutil

import grpc
import numpy as np
import pytest
import torch

from datastore import BuildSettings, BuildSource, Datastore, build_from_tokens
from datastore.add import add_documents
from datastore.live import LiveDatastore
from datastore.removal import compact, remove_documents
from memlm.jobs.windows import WindowConfig
from memlm.model.config import ModelConfig
from memlm.model.decoder import build_model
from memlm.v1 import retrieval_pb2, retrieval_pb2_grpc
from services.retrieval.client import RetrievalClient
from services.retrieval.server import GenerationWatch, start_retrieval_server
from services.common.tensors import from_tensor, to_tensor

SOURCE = BuildSource(model_name="tiny-test", model_fingerprint="m" * 64, tokenizer_fingerprint="t" * 64,
                     corpus="random tokens", corpus_fingerprint="c" * 64, boundary_token=1)
SETTINGS = BuildSettings(window=WindowConfig(context=48, stride=24, batch_size=1), index_factory="Flat")
QUIET = {"progress": False, "log": lambda m: None}
K = 6


def model():
    torch.manual_seed(0)
    return build_model(ModelConfig.from_name("tiny", vocab_size=64)).eval()


def documents(seed: int, sizes) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 64, size=n).tolist() for n in sizes]


DOCS_A, DOCS_B = documents(0, (300, 120, 80)), documents(1, (150, 90))


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Datastores A and A + B built at once: the answers of generations 0, 2, 3 and of generation 1."""
    root = tmp_path_factory.mktemp("gen")
    a = build_from_tokens(model(), DOCS_A, root / "a", SOURCE, SETTINGS, **QUIET)
    ab = build_from_tokens(model(), DOCS_A + DOCS_B, root / "ab", SOURCE, SETTINGS, **QUIET)
    return a, ab


def answer(response: retrieval_pb2.SearchResponse) -> tuple[np.ndarray, ...]:
    return tuple(from_tensor(t, name) for t, name in ((response.distances, "d"), (response.ids, "i"),
                                                       (response.values, "v")))


def test_a_server_switches_generations_without_failing_a_call(references, tmp_path):
    a_dir, ab_dir = references
    a, ab = Datastore.open(a_dir), Datastore.open(ab_dir)
    xq = np.asarray(ab.keys[::11], dtype=np.float32)  # (Q, d), B's keys among them
    want = {name: tuple(np.asarray(x) for x in store.search(xq, K)) for name, store in (("A", a), ("A+B", ab))}
    directory = shutil.copytree(a_dir, tmp_path / "served")
    logs: list[str] = []
    result = asyncio.run(_serve_while_changing(directory, xq, logs))
    assert result["errors"] == [] and result["calls"] > 20
    expected = {0: "A", 1: "A+B", 2: "A", 3: "A"}  # generation -> its answers (removal hides B, compaction drops it)
    for generation, got in result["answers"]:  # every answer is its generation's, bit for bit
        assert all(np.array_equal(g, x) for g, x in zip(got, want[expected[generation]])), generation
    assert [g for g, _ in result["answers"]][-1] == 3 and {g for g, _ in result["answers"]} >= {0, 1, 3}
    assert result["generations"] == [1, 2, 3] and result["n"] == [len(ab), len(ab), len(a)]
    assert any("now serving generation 3" in line for line in logs)


async def _serve_while_changing(directory, xq: np.ndarray, logs: list[str]) -> dict:
    live = LiveDatastore(directory, log=logs.append)
    watch = GenerationWatch(live.refresh, live.served, poll_s=0.05)
    started = await start_retrieval_server("127.0.0.1:0", live, watch=watch)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{started.running.port}")
    stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
    request = retrieval_pb2.SearchRequest(queries=to_tensor(xq), k=K)
    stop, out = asyncio.Event(), {"errors": [], "answers": [], "calls": 0, "generations": [], "n": []}

    async def search_loop() -> None:
        while not stop.is_set():
            try:
                response = await stub.Search(request, timeout=30)
                out["answers"].append((response.generation, answer(response)))
            except grpc.aio.AioRpcError as e:
                out["errors"].append(e.code())
            out["calls"] += 1

    async def reach(generation: int) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while (info := await stub.GetInfo(retrieval_pb2.RetrievalServiceGetInfoRequest())).generation != generation:
            assert loop.time() < deadline, f"still generation {info.generation}"
            await asyncio.sleep(0.02)
        out["generations"].append(info.generation)
        out["n"].append(info.datastore.n)
        await asyncio.sleep(0.2)  # searches on the new generation

    loops = [asyncio.create_task(search_loop()) for _ in range(3)]
    client = RetrievalClient(f"127.0.0.1:{started.running.port}", timeout=30)
    try:
        await asyncio.sleep(0.2)
        assert await asyncio.to_thread(client.generation) == 0
        n_before = client.info().n
        await asyncio.to_thread(add_documents, model(), DOCS_B, directory, SOURCE, **QUIET)
        await reach(1)
        assert await asyncio.to_thread(client.generation) == 1 and client.info().n > n_before  # refreshed
        ids = [r.doc_id for r in live.current.documents()[len(DOCS_A):]]
        await asyncio.to_thread(remove_documents, directory, ids, log=lambda m: None)
        await reach(2)
        await asyncio.to_thread(compact, directory, **QUIET)
        await reach(3)
    finally:
        client.close()
        stop.set()
        await asyncio.gather(*loops)
        await channel.close()
        await started.running.server.stop(None)
    return out


def test_a_removed_document_is_not_returned_through_the_router(references, tmp_path):
    """Removal keeps every row number (rows are hidden, not renumbered), so a router over live shards needs
    no restart: once the shard serves the new generation, the removed rows never come back through it."""
    a_dir, ab_dir = references
    shard_dirs = [shutil.copytree(a_dir, tmp_path / "s0"), shutil.copytree(ab_dir, tmp_path / "s1")]
    asyncio.run(_route_after_removal(shard_dirs))


async def _route_after_removal(shard_dirs) -> None:
    from services.router.server import start_router_server

    lives = [LiveDatastore(d, log=lambda m: None) for d in shard_dirs]
    shards = [await start_retrieval_server("127.0.0.1:0", live, watch=GenerationWatch(
        live.refresh, live.served, poll_s=0.05)) for live in lives]
    router = await start_router_server("127.0.0.1:0", [f"127.0.0.1:{s.running.port}" for s in shards])
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{router.port}")
    stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
    try:
        offset = len(lives[0])
        victim = lives[1].current.documents()[0]  # shard 1's first document
        rows = offset + np.flatnonzero(np.asarray(lives[1].current.entry_provenance.docs) == victim.index)
        xq = np.concatenate([np.asarray(live.current.keys, dtype=np.float32) for live in lives])  # every key
        request = retrieval_pb2.SearchRequest(queries=to_tensor(xq), k=K)
        before = answer(await stub.Search(request, timeout=30))[1]
        assert np.isin(before, rows).any()  # its rows were being returned
        await asyncio.to_thread(remove_documents, shard_dirs[1], [victim.doc_id], log=lambda m: None)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while lives[1].generation != 1:
            assert loop.time() < deadline
            await asyncio.sleep(0.02)
        after = answer(await stub.Search(request, timeout=30))[1]
        assert not np.isin(after, rows).any() and (after >= 0).all()  # never returned, k still filled
    finally:
        await channel.close()
        await router.server.stop(None)
        for s in shards:
            await s.running.server.stop(None)


def test_the_router_follows_a_shard_that_grows_and_shrinks(references, tmp_path):
    """Shard 0 gains B (add), then loses it (remove + compact renumbers nothing before B, but N shrinks):
    the router's merged answer equals merging the shards' own answers with the offsets of the
    generations that answered (oracle: merge_top_k over direct searches of the datastores on disk)."""
    a_dir, _ = references
    shard_dirs = [shutil.copytree(a_dir, tmp_path / "s0"), shutil.copytree(a_dir, tmp_path / "s1")]
    asyncio.run(_route_while_shard_changes(shard_dirs))


async def _route_while_shard_changes(shard_dirs) -> None:
    from services.router.server import merge_top_k, start_router_server

    lives = [LiveDatastore(d, log=lambda m: None) for d in shard_dirs]
    shards = [await start_retrieval_server("127.0.0.1:0", live, watch=GenerationWatch(
        live.refresh, live.served, poll_s=0.05)) for live in lives]
    router = await start_router_server("127.0.0.1:0", [f"127.0.0.1:{s.running.port}" for s in shards])
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{router.port}")
    stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)
    xq = np.asarray(Datastore.open(shard_dirs[0]).keys[::5], dtype=np.float32)  # (Q, d)
    request = retrieval_pb2.SearchRequest(queries=to_tensor(xq), k=K)
    changes = [
        lambda: add_documents(model(), DOCS_B, shard_dirs[0], SOURCE, **QUIET),
        lambda: remove_documents(shard_dirs[0], [r.doc_id for r in lives[0].current.documents()[len(DOCS_A):]],
                                 log=lambda m: None),
        lambda: compact(shard_dirs[0], **QUIET),
    ]
    try:
        for generation, change in enumerate(changes, 1):
            await asyncio.to_thread(change)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while lives[0].generation != generation:
                assert loop.time() < deadline
                await asyncio.sleep(0.02)
            got = answer(await stub.Search(request, timeout=30))
            stores = [Datastore.open(d) for d in shard_dirs]
            want = merge_top_k([s.search(xq, K) for s in stores], [0, len(stores[0])], K)
            for g, w in zip(got, want):
                np.testing.assert_array_equal(g, w)
        info = await stub.GetInfo(retrieval_pb2.RetrievalServiceGetInfoRequest())
        assert info.datastore.n == 2 * len(Datastore.open(shard_dirs[1]))  # relaid out: A and A again
    finally:
        await channel.close()
        await router.server.stop(None)
        for s in shards:
            await s.running.server.stop(None)
