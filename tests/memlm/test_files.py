"""memlm.files: content hashes (against hashlib) and atomic writes (a failed write leaves the old file)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from memlm import files
from memlm.files import PARTIAL_SUFFIX, atomic_open, atomic_path, atomic_write, fsync_tree, sha256_file


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("MEMLM_CACHE", str(root))
    return root


def test_sha256_file_is_hashlib_and_remembered_by_stamp(tmp_path, cache) -> None:
    f = tmp_path / "w.bin"
    f.write_bytes(b"abc")
    assert sha256_file(f) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"  # sha256("abc")
    (entry,) = (cache / "hashes").glob("*.json")
    # A doctored entry is believed while the stamp matches (so the cache is really read) ...
    entry.write_text(json.dumps({**json.loads(entry.read_text()), "sha256": "0" * 64}))
    assert sha256_file(f) == "0" * 64
    # ... never when the caller asks for a real check ...
    assert sha256_file(f, remember=False) == hashlib.sha256(b"abc").hexdigest()
    # ... and no longer once the mtime moves (same size, same inode).
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert sha256_file(f) == hashlib.sha256(b"abc").hexdigest()
    f.write_bytes(b"abcd")
    assert sha256_file(f) == hashlib.sha256(b"abcd").hexdigest()


def test_sha256_file_entry_survives_a_rename(tmp_path, cache) -> None:
    # A checkpoint is hashed in its temporary folder and published by renaming the folder.
    before = tmp_path / ".ckpt.tmp" / "model.safetensors"
    before.parent.mkdir()
    before.write_bytes(b"weights")
    digest = sha256_file(before)
    (entry,) = (cache / "hashes").glob("*.json")
    entry.write_text(json.dumps({**json.loads(entry.read_text()), "sha256": "1" * 64}))
    os.replace(before.parent, tmp_path / "ckpt")
    assert sha256_file(tmp_path / "ckpt" / "model.safetensors") == "1" * 64 != digest


def test_sha256_file_broken_entry_is_recomputed(tmp_path, cache) -> None:
    f = tmp_path / "w.bin"
    f.write_bytes(b"xyz")
    sha256_file(f)
    (entry,) = (cache / "hashes").glob("*.json")
    entry.write_text("{not json")
    assert sha256_file(f) == hashlib.sha256(b"xyz").hexdigest()
    assert json.loads(entry.read_text())["sha256"] == hashlib.sha256(b"xyz").hexdigest()


@pytest.mark.parametrize("durable", [False, True])
def test_atomic_write_replaces_whole_file(tmp_path, durable) -> None:
    out = tmp_path / "sub" / "result.json"
    atomic_write(out, "first\n", durable=durable)
    assert out.read_text() == "first\n"
    atomic_write(out, b"second", durable=durable)
    assert out.read_bytes() == b"second"
    assert sorted(p.name for p in out.parent.iterdir()) == ["result.json"]


def test_failed_atomic_write_keeps_the_old_file_and_leaves_no_partial(tmp_path) -> None:
    out = tmp_path / "keys.f16"
    out.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="killed"):
        with atomic_open(out, "wb", durable=True) as f:
            f.write(b"half of the new")
            raise RuntimeError("killed mid-write")
    assert out.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keys.f16"]


def test_atomic_path_names(tmp_path) -> None:
    out = tmp_path / "index.faiss"
    with atomic_path(out) as tmp:
        assert tmp == tmp_path / ("index.faiss" + PARTIAL_SUFFIX)  # the name the datastore builder knows
        tmp.write_bytes(b"x")
        assert not out.exists()  # nothing under the final name before the block ends
    with atomic_path(out, concurrent=True) as tmp:
        assert tmp.name == f"index.faiss.{os.getpid()}{PARTIAL_SUFFIX}"
        tmp.write_bytes(b"y")
    assert out.read_bytes() == b"y"


def test_atomic_open_refuses_modes_that_do_not_write_a_new_file(tmp_path) -> None:
    with pytest.raises(ValueError, match="mode 'wb' or 'w', got 'ab'"):
        with atomic_open(tmp_path / "x", "ab"):
            pass


def test_fsync_tree_syncs_every_file_then_the_folders_deepest_first(tmp_path, monkeypatch) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    for name in ("top.json", "a/mid.bin", "a/b/deep.bin"):
        (tmp_path / name).write_bytes(b"x")
    synced: list[str] = []
    real = os.fsync
    monkeypatch.setattr(files.os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd))[1])
    fsync_tree(tmp_path)
    root = str(tmp_path)
    files_synced, folders_synced = synced[:3], synced[3:]
    assert sorted(files_synced) == sorted(f"{root}/{n}" for n in ("top.json", "a/mid.bin", "a/b/deep.bin"))
    assert folders_synced == [f"{root}/a/b", f"{root}/a", root]
