"""On-disk IVF indexes: inverted lists in a memory-mapped file, searched exactly as the
in-memory index built from the same trained quantizer.

Shape legend: N keys, d key dimension, Q queries, k neighbours.
"""

from __future__ import annotations

import numpy as np
import pytest
from store_helpers import PROVENANCE, WINDOW

from datastore import (
    BuildSettings,
    Datastore,
    Manifest,
    build_from_tokens,
    datastore_info,
)
from datastore.index import IVFDATA_NAME, is_on_disk
from memlm.errors import MemlmError
from memlm.retrieval.searcher import SearchOptions

QUIET = {"progress": False, "log": lambda m: None}


def settings(factory: str, on_disk: bool) -> BuildSettings:
    # add_chunk 64: blocks of 64 * ON_DISK_BLOCK_CHUNKS = 1024 rows, so the 1483 keys span two blocks.
    return BuildSettings(window=WINDOW, index_factory=factory, nprobe=4, shard_batches=2, add_chunk=64,
                         on_disk=on_disk)


@pytest.fixture(scope="module", params=["IVF16,Flat", "IVF16,SQ8"])
def pair(request, tmp_path_factory, tiny_model, docs):
    """(in-memory, on-disk) datastores of the same documents and factory string."""
    base = tmp_path_factory.mktemp("ondisk")
    return tuple(build_from_tokens(tiny_model, docs, base / name, PROVENANCE, settings(request.param, on_disk), **QUIET)
                 for name, on_disk in (("memory", False), ("disk", True)))


@pytest.mark.parametrize("nprobe", [1, 4, 16])
@pytest.mark.parametrize("mmap", [False, True])
def test_on_disk_search_equals_the_in_memory_index(pair, nprobe, mmap):
    memory, disk = Datastore.open(pair[0], device="cpu"), Datastore.open(pair[1], mmap=mmap, device="cpu")
    assert is_on_disk(disk.index) and not is_on_disk(memory.index)
    assert (memory.keys == disk.keys).all() and (memory.values == disk.values).all()
    xq = np.asarray(memory.keys[::37], dtype=np.float32) + 0.01  # (Q, d) near stored keys: ties are few
    options = SearchOptions(nprobe=nprobe)
    for name, a, b in zip(("distances", "ids", "values"), memory.search(xq, 20, options), disk.search(xq, 20, options)):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_the_lists_file_is_in_the_manifest_checked_and_shown_by_info(pair):
    disk = pair[1]
    m = Manifest.read(disk)
    assert IVFDATA_NAME in m.files and (disk / IVFDATA_NAME).stat().st_size == m.files[IVFDATA_NAME].bytes
    info = datastore_info(disk, verify=True)
    assert f"MiB on disk ({IVFDATA_NAME}" in info, info
    assert "0 MiB on disk" in datastore_info(pair[0])
    with open(disk / IVFDATA_NAME, "rb+") as f:  # one flipped byte of the lists
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    try:
        with pytest.raises(MemlmError, match=f"{IVFDATA_NAME} fails its checksum"):
            Datastore.open(disk, device="cpu")
    finally:
        with open(disk / IVFDATA_NAME, "rb+") as f:
            f.seek(100)
            f.write(byte)


def test_an_on_disk_build_resumes_after_its_merge_was_lost(tmp_path, tiny_model, docs):
    """A build killed after adding its blocks (index.faiss not yet written) merges again, to the same lists."""
    out, whole = tmp_path / "d", tmp_path / "whole"
    s = settings("IVF16,Flat", True)
    with pytest.raises(RuntimeError, match="stop"):
        build_from_tokens(tiny_model, docs, out, PROVENANCE, s, progress=False, log=_stop_at("index trained"))
    (out / "index.faiss").unlink()  # as if killed between adding the blocks and writing the index
    build_from_tokens(tiny_model, docs, out, PROVENANCE, s, **QUIET)
    build_from_tokens(tiny_model, docs, whole, PROVENANCE, s, **QUIET)
    assert (out / IVFDATA_NAME).read_bytes() == (whole / IVFDATA_NAME).read_bytes()
    assert Manifest.read(out).files == Manifest.read(whole).files


def _stop_at(prefix: str):
    def log(message: str) -> None:
        if message.startswith(prefix):
            raise RuntimeError("stop")
    return log


def test_on_disk_needs_an_ivf_index(tmp_path, tiny_model, docs):
    with pytest.raises(MemlmError, match="--on-disk needs an IVF index"):
        build_from_tokens(tiny_model, docs, tmp_path / "d", PROVENANCE, settings("Flat", True), **QUIET)
