"""Faults in datastores: a damaged manifest or file is one line and a non-zero exit, `datastore
info --verify` checks what `Datastore.open` checks, and a search the float32 distances cannot answer (k
beyond MAX_K, |x| >= 1e20) is refused, locally and by the retrieval server (INVALID_ARGUMENT naming the
field), while searchable queries get the exact neighbours.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest

from datastore import Datastore
from datastore.manifest import (
    DOCS_NAME,
    INDEX_NAME,
    KEYS_NAME,
    MANIFEST_NAME,
    POSITIONS_NAME,
    VALUES_NAME,
)
from memlm.cli import main
from memlm.errors import MemlmError
from memlm.retrieval.searcher import MAX_K, MAX_QUERY_ABS, SearchOptions
from memlm.v1 import retrieval_pb2, retrieval_pb2_grpc, tensor_pb2
from services.retrieval.server import create_retrieval_server


@pytest.fixture()
def store_copy(built, tmp_path) -> Path:
    """A writable copy of the session's finished datastore (1483 keys, IVF16,Flat)."""
    return Path(shutil.copytree(built, tmp_path / "store"))


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def edit_manifest(directory: Path, change) -> None:
    path = directory / MANIFEST_NAME
    path.write_text(json.dumps(change(json.loads(path.read_text()))))


def without_file(name: str):
    def change(raw: dict) -> dict:
        del raw["files"][name]
        return raw
    return change


def with_field(name: str, value):
    return lambda raw: {**raw, name: value}


@pytest.mark.parametrize("change, message", [
    (lambda raw: [], "holds a JSON list, not an object"),
    (lambda raw: None, "holds a JSON NoneType, not an object"),
    (with_field("n", "abc"), 'n is "abc", not a JSON integer'),
    (with_field("dim", 1.5), "dim is 1.5, not a JSON integer"),
    (with_field("n", True), "n is true, not a JSON integer"),
    (with_field("nprobe", 0), "nprobe is 0"),
    (with_field("files", []), "files is [], not a JSON object"),
    (without_file(KEYS_NAME), f"files has no entry for {KEYS_NAME}"),
    (without_file(VALUES_NAME), f"files has no entry for {VALUES_NAME}"),
    (without_file(INDEX_NAME), f"files has no entry for {INDEX_NAME}"),
    (without_file(DOCS_NAME), f"files has no entry for {DOCS_NAME}"),
    (without_file(POSITIONS_NAME), f"files has no entry for {POSITIONS_NAME}"),
    (with_field("documents", -1), "documents is -1"),
    (lambda raw: {k: v for k, v in raw.items() if k != "documents"}, "lacks documents"),
    (lambda raw: {**raw, "files": {**raw["files"], KEYS_NAME: {"bytes": "many"}}}, "must hold bytes, name, sha256"),
])
def test_a_damaged_manifest_is_refused_in_one_line(capsys, store_copy, change, message):
    edit_manifest(store_copy, change)
    with pytest.raises(MemlmError, match="damaged, rebuild it") as info:
        Datastore.open(store_copy)
    assert message in str(info.value)
    for argv in (("datastore", "info", str(store_copy)), ("datastore", "info", "--verify", str(store_copy))):
        code, out, err = run_cli(capsys, *argv)
        assert code == 1 and out == ""
        assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_removing_a_files_entry_does_not_hide_a_damaged_file(store_copy):
    """Deleting the keys' entry from `files` does not turn its size and checksum check off."""
    keys = store_copy / KEYS_NAME
    keys.write_bytes(keys.read_bytes()[:-4096])
    edit_manifest(store_copy, without_file(KEYS_NAME))
    with pytest.raises(MemlmError, match=f"no entry for {KEYS_NAME}"):
        Datastore.open(store_copy)


@pytest.mark.parametrize("damage, message", [
    (lambda p: p.write_bytes(p.read_bytes()[:-100]), "bytes, the manifest says"),
    (lambda p: p.write_bytes(bytes([p.read_bytes()[0] ^ 1]) + p.read_bytes()[1:]), "fails its checksum"),
    (lambda p: p.unlink(), f"lacks {KEYS_NAME}"),
])
def test_info_verify_checks_what_open_checks(capsys, store_copy, damage, message):
    code, out, _ = run_cli(capsys, "datastore", "info", "--verify", str(store_copy))
    assert code == 0 and "verified      files, sizes, checksums, arrays and index match" in out
    damage(store_copy / KEYS_NAME)
    with pytest.raises(MemlmError, match=message):
        Datastore.open(store_copy)
    code, out, err = run_cli(capsys, "datastore", "info", "--verify", str(store_copy))
    assert code == 1 and out == "" and message in err and err.count("\n") == 1
    # Plain info reads the manifest only, and says so instead of looking healthy.
    code, out, _ = run_cli(capsys, "datastore", "info", str(store_copy))
    assert code == 0 and "verified      no: files were not checked" in out


# ---------------------------------------------------------------------------------------------------
# searches float32 distances cannot answer


def exact_distances(store: Datastore, xq: np.ndarray) -> np.ndarray:
    """Oracle: float64 squared L2 from each query to every key. xq (Q, d) -> (Q, N)."""
    keys = np.asarray(store.keys, dtype=np.float64)  # (N, d)
    return ((xq.astype(np.float64)[:, None, :] - keys[None]) ** 2).sum(-1)  # (Q, N)


def test_k_beyond_the_maximum_is_refused_before_searching(built):
    store = Datastore.open(built)
    xq = np.asarray(store.keys[:2], dtype=np.float32)  # (2, d)
    with pytest.raises(MemlmError, match=f"k must be 1 to {MAX_K}, got 1000000000"):
        store.search(xq, 1_000_000_000)
    padded = store.search(xq, MAX_K)  # the maximum itself is answered: N = 1483 neighbours, the rest padding
    assert padded.ids.shape == (2, MAX_K) and (padded.ids[:, len(store):] == -1).all()


def test_queries_out_of_the_keys_range_are_refused_and_large_ones_answered_exactly(built):
    store = Datastore.open(built)
    rng = np.random.default_rng(3)
    xq = np.asarray(store.keys[rng.choice(len(store), 4, replace=False)], dtype=np.float32)  # (4, d)
    for bad in (1e20, -1e20, 1e30, MAX_QUERY_ABS * 2):
        huge = xq.copy()
        huge[2, 5] = bad
        with pytest.raises(MemlmError, match="query 2 has a NaN, an infinity or a coordinate beyond"):
            store.search(huge, 8)
    # Within the range distances still order neighbours: queries scaled to the bound's edge get the
    # exact neighbours (an oracle in float64), where FAISS alone returned none at 1e20.
    far = xq * np.float32(MAX_QUERY_ABS / 4 / np.abs(xq).max())  # (4, d), max |x| = 16376
    got = store.search(far, 5, SearchOptions(nprobe=16))  # every list: the IVF index is exact
    oracle = exact_distances(store, far)  # (4, N)
    # The retrieved keys are the nearest ones (compared by true distance: near-ties may swap places).
    retrieved = np.take_along_axis(oracle, got.ids, axis=1)  # (4, 5)
    np.testing.assert_allclose(retrieved, np.sort(oracle, axis=1)[:, :5], rtol=1e-5)


class _Loop:
    """An asyncio loop on a thread, for an in-process server driven by a blocking client."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def test_retrieval_server_refuses_huge_queries_naming_the_field(built):
    store = Datastore.open(built)
    loop = _Loop()
    server, port = loop.run(create_retrieval_server("127.0.0.1:0", store))
    try:
        xq = np.asarray(store.keys[:3], dtype=np.float32)  # (3, d)
        huge = xq.copy()
        huge[1, 0] = 1e20
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = retrieval_pb2_grpc.RetrievalServiceStub(channel)

            def search(x: np.ndarray, k: int):
                tensor = tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_FLOAT32, shape=x.shape, data=x.tobytes())
                return stub.Search(retrieval_pb2.SearchRequest(queries=tensor, k=k), timeout=10)

            with pytest.raises(grpc.RpcError) as info:
                search(huge, 4)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details().startswith("queries.data: query 1 contains NaN, infinity or a coordinate")
            with pytest.raises(grpc.RpcError) as info:
                search(xq, 1_000_000_000)
            assert info.value.code() == grpc.StatusCode.OUT_OF_RANGE and info.value.details().startswith("k:")
            ids = np.frombuffer(search(xq, 4).ids.data, dtype="<i8").reshape(3, 4)  # the server keeps serving
            np.testing.assert_array_equal(ids, store.search(xq, 4).ids)
    finally:
        loop.run(server.stop(None))
        loop.close()


def test_a_version_1_manifest_is_refused_as_an_older_format(store_copy):
    """A version-1 manifest (before sink_tokens was recorded) is an older format to rebuild, not damage."""
    path = store_copy / MANIFEST_NAME
    raw = json.loads(path.read_text())
    del raw["sink_tokens"]
    raw["format_version"] = 1
    path.write_text(json.dumps(raw))
    with pytest.raises(MemlmError, match=r"format version 1, this memlm reads version 4 \(and 3, without "
                                         r"the documents table; 2, without provenance either\); rebuild"):
        Datastore.open(store_copy)
