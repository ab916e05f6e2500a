"""Datastore lifecycle (add, remove, compact): A then add B answers every search exactly as A + B built at
once with the same trained index; removing B from A + B answers exactly as A alone, and no search returns
an entry of a removed document (over the whole key set, through every path); compaction leaves A's bytes;
a SIGKILL during add, remove or compact leaves a datastore that opens and equals the old or the new one."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import faiss
import numpy as np
import pytest
import torch
from lifecycle_docs import DOCS_A, DOCS_B, WINDOW_1
from store_helpers import PROVENANCE, make_model

from datastore import BuildSettings, Datastore, build_from_tokens, generations
from datastore.add import add_documents
from datastore.manifest import (
    DOCS_NAME,
    KEYS_NAME,
    POSITIONS_NAME,
    VALUES_NAME,
    Manifest,
)
from datastore.removal import compact, remove_documents
from memlm.errors import MemlmError
from memlm.retrieval.searcher import SearchOptions

QUIET = {"progress": False, "log": lambda m: None}
ARRAYS = (KEYS_NAME, VALUES_NAME, DOCS_NAME, POSITIONS_NAME)
WORKER = Path(__file__).with_name("lifecycle_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def build(out: Path, docs, factory: str = "Flat") -> Path:
    settings = BuildSettings(window=WINDOW_1, index_factory=factory, nprobe=2, shard_batches=2)
    return build_from_tokens(make_model(), docs, out, PROVENANCE, settings, **QUIET)


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> dict[str, Path]:
    """A, A + B built at once, and A then add B (all Flat)."""
    root = tmp_path_factory.mktemp("life")
    a, ab = build(root / "a", DOCS_A), build(root / "ab", DOCS_A + DOCS_B)
    added = Path(shutil.copytree(a, root / "added"))
    assert add_documents(make_model(), DOCS_B, added, PROVENANCE, **QUIET) == len(DOCS_B)
    return {"a": a, "ab": ab, "added": added}


def arrays(directory: Path) -> dict[str, bytes]:
    m = Manifest.read(directory)
    return {role: (directory / m.file_name(role)).read_bytes() for role in ARRAYS}


def table(store: Datastore) -> list[tuple]:
    return [(r.index, r.doc_id, r.fingerprint, r.tokens, r.meta, r.removed) for r in store.documents()]


def all_keys(store: Datastore) -> np.ndarray:
    return np.asarray(store.keys, dtype=np.float32)  # (N, d): every key is a query


def assert_same_search(a: Datastore, b: Datastore, xq: np.ndarray, k: int, options=None) -> None:
    na, nb = a.search(xq, k, options), b.search(xq, k, options)
    np.testing.assert_array_equal(na.ids, nb.ids)
    np.testing.assert_array_equal(na.distances, nb.distances)  # bit-identical
    np.testing.assert_array_equal(na.values, nb.values)


def test_a_then_b_is_a_plus_b(stores):
    added, ab = Datastore.open(stores["added"]), Datastore.open(stores["ab"])
    assert arrays(stores["added"]) == arrays(stores["ab"])  # keys, values, provenance byte for byte
    assert table(added) == table(ab)
    assert (added.manifest.generation, ab.manifest.generation) == (1, 0)
    assert added.manifest.corpus == "random tokens + random tokens"
    for k in (1, 10):
        assert_same_search(added, ab, all_keys(ab), k)


def test_an_added_ivf_index_is_the_trained_index_filled_with_a_plus_b(tmp_path):
    """Oracle: A's trained index (emptied) filled with the keys of A + B built at once."""
    a = build(tmp_path / "a", DOCS_A, "IVF4,Flat")
    trained = faiss.clone_index(faiss.read_index(str(a / "index.faiss")))
    trained.reset()
    add_documents(make_model(), DOCS_B, a, PROVENANCE, **QUIET)
    ab_keys = all_keys(Datastore.open(build(tmp_path / "ab", DOCS_A + DOCS_B)))
    trained.add(ab_keys)
    store = Datastore.open(a)
    got = store.search(ab_keys, 8, SearchOptions(nprobe=2))
    want_d, want_i = trained.search(ab_keys, 8, params=faiss.SearchParametersIVF(nprobe=2))
    np.testing.assert_array_equal(got.ids, want_i)
    np.testing.assert_array_equal(got.distances, want_d)


def test_adding_what_is_there_is_skipped_in_one_line(stores, tmp_path):
    directory = Path(shutil.copytree(stores["added"], tmp_path / "again"))
    lines: list[str] = []
    assert add_documents(make_model(), DOCS_B[:1] + DOCS_A, directory, PROVENANCE, progress=False,
                         log=lines.append) == 0
    assert lines == [f"skipped {1 + len(DOCS_A)} documents already in {directory} (same fingerprint)",
                     f"nothing to add to {directory}: no new document with tokens"]
    assert Manifest.read(directory).generation == 1 and not (directory / ".generation").exists()


def test_another_model_is_refused(stores, tmp_path):
    directory = Path(shutil.copytree(stores["a"], tmp_path / "a"))
    other = PROVENANCE.__class__(**{**PROVENANCE.__dict__, "model_fingerprint": "x" * 64})
    with pytest.raises(MemlmError, match="made with model fingerprint mmmmmmmmmmmmmmmm, this model has xxxx"):
        add_documents(make_model(), DOCS_B, directory, other, **QUIET)
    with pytest.raises(MemlmError, match="made with model dtype float32, this model has bfloat16"):
        add_documents(make_model().bfloat16(), DOCS_B, directory, PROVENANCE, **QUIET)


@pytest.fixture()
def removed(stores, tmp_path) -> Path:
    """A + B with B removed (by doc_id)."""
    directory = Path(shutil.copytree(stores["ab"], tmp_path / "removed"))
    ids = [r.doc_id for r in Datastore.open(directory).documents()[len(DOCS_A):]]
    assert len(remove_documents(directory, ids, log=lambda m: None)) == len(DOCS_B)
    return directory


def test_removing_b_answers_as_a_alone(stores, removed):
    a, gone = Datastore.open(stores["a"]), Datastore.open(removed)
    xq = all_keys(gone)  # the whole key set, B's keys included
    b_docs = {r.index for r in gone.documents() if r.removed}
    assert b_docs == set(range(len(DOCS_A), len(DOCS_A) + len(DOCS_B)))
    for k in (1, 10, len(a)):
        assert_same_search(gone, a, xq, k)
        assert_same_search(gone, a, xq, k, SearchOptions(exact_rerank=True))
    got = gone.search(xq, len(a) + 5)  # more than the live rows: exact counts, then padding
    assert (got.ids[:, : len(a)] >= 0).all() and (got.ids[:, len(a):] == -1).all()
    assert not np.isin(gone.provenance(got.ids).docs, list(b_docs)).any()
    exact_gone, exact_a = gone.exact_searcher("cpu").search(xq, 10), a.exact_searcher("cpu").search(xq, 10)
    np.testing.assert_array_equal(exact_gone.ids, exact_a.ids)  # recall's ground truth sees A only
    torch_store = Datastore.open(removed, backend="torch", device="cpu")
    np.testing.assert_array_equal(torch_store.search(xq, 10).ids, exact_a.ids)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the torch backend on CUDA needs a GPU")
def test_the_torch_backend_on_cuda_never_returns_removed_rows(stores, removed):
    gone = Datastore.open(removed, backend="torch", device="cuda")
    xq = all_keys(gone)
    got, want = gone.search(xq, 10), Datastore.open(stores["a"]).exact_searcher("cpu").search(xq, 10)
    assert not np.isin(gone.provenance(got.ids).docs, range(len(DOCS_A), len(DOCS_A) + len(DOCS_B))).any()
    np.testing.assert_allclose(got.distances, want.distances, rtol=1e-4, atol=1e-4)  # GPU matmul rounding
    assert (got.ids == want.ids).mean() > 0.99  # the same rows but for near-ties


def test_removed_ivf_rows_are_never_returned(stores, tmp_path):
    directory = build(tmp_path / "ivf", DOCS_A + DOCS_B, "IVF4,Flat")
    remove_documents(directory, [Datastore.open(directory).documents()[0].doc_id], log=lambda m: None)
    store = Datastore.open(directory)
    for nprobe in (1, 4):
        got = store.search(all_keys(store), 20, SearchOptions(nprobe=nprobe))
        docs = store.provenance(got.ids).docs
        assert not (docs == 0).any() and (got.ids >= 0).sum() > 0
    full = store.search(all_keys(store), 20, SearchOptions(nprobe=4))  # all lists: exact counts
    assert (full.ids >= 0).all()


def test_compaction_leaves_a_alone(stores, removed):
    dropped = compact(removed, **QUIET)
    assert dropped == sum(len(d) for d in DOCS_B)
    assert arrays(removed) == arrays(stores["a"])
    gone, a = Datastore.open(removed), Datastore.open(stores["a"])
    assert table(gone) == table(a) and len(gone) == len(a) and gone.manifest.generation == 2
    assert_same_search(gone, a, all_keys(a), 10)
    names = sorted(p.name for p in removed.iterdir() if p.name != generations.LOCK_NAME)
    assert names == sorted(["manifest.json", *(gone.manifest.file_name(r) for r in gone.manifest.files)])
    assert all(".g000002." in n for n in names if n not in ("manifest.json",))  # B's keys are gone from disk


def test_a_rebuild_over_later_generations_leaves_generation_0_only(removed):
    settings = BuildSettings(window=WINDOW_1, index_factory="Flat", shard_batches=2)
    build_from_tokens(make_model(), DOCS_A, removed, PROVENANCE, settings, overwrite=True, **QUIET)
    assert sorted(p.name for p in removed.iterdir() if p.name != generations.LOCK_NAME) == sorted(
        ["manifest.json", "keys.f16", "values.i32", "docs.i32", "positions.i32", "index.faiss", "documents.jsonl"])
    assert Manifest.read(removed).generation == 0 and not any(r.removed for r in Datastore.open(removed).documents())


def test_remove_refusals_and_re_adding(stores, removed):
    records = Datastore.open(removed).documents()
    with pytest.raises(MemlmError, match="--doc-id nope is not a document of it"):
        remove_documents(removed, ["nope"], log=lambda m: None)
    with pytest.raises(MemlmError, match=f"--doc-id {records[-1].doc_id} was removed already"):
        remove_documents(removed, [records[-1].doc_id], log=lambda m: None)
    add_documents(make_model(), DOCS_B[:1], removed, PROVENANCE, **QUIET)  # opted back in
    back = Datastore.open(removed).documents()[-1]
    assert back.doc_id == records[len(DOCS_A)].doc_id and not back.removed  # the id it had


@pytest.mark.parametrize("change", [
    lambda d: add_documents(make_model(), DOCS_B, d, PROVENANCE, **QUIET),
    lambda d: compact(d, **QUIET),
])
def test_a_damaged_file_is_not_carried_into_a_new_generation(removed, change):
    keys = removed / Manifest.read(removed).file_name(KEYS_NAME)
    keys.write_bytes(bytes([keys.read_bytes()[0] ^ 1]) + keys.read_bytes()[1:])
    with pytest.raises(MemlmError, match="fails its size or checksum .* damaged, rebuild it \\(nothing was changed\\)"):
        change(removed)
    assert Manifest.read(removed).generation == 1


def test_one_change_at_a_time(removed):
    with generations.exclusive(removed), pytest.raises(MemlmError, match="another add, remove or compact of .* is running"):
        compact(removed, **QUIET)
    assert compact(removed, **QUIET) > 0  # the lock went with its holder


def test_a_live_datastore_reads_only_what_changed_and_skips_a_damaged_generation(stores, tmp_path, monkeypatch):
    import datastore.datastore as datastore_module
    from datastore.live import LiveDatastore

    directory = Path(shutil.copytree(stores["ab"], tmp_path / "live"))
    logs: list[str] = []
    live = LiveDatastore(directory, log=logs.append)
    hashed: list[str] = []
    real = datastore_module.sha256_file
    monkeypatch.setattr(datastore_module, "sha256_file",
                        lambda path, remember=True: hashed.append(Path(path).name) or real(path, remember=remember))
    records = live.current.documents()
    remove_documents(directory, [records[-1].doc_id], log=lambda m: None)
    assert live.refresh() and live.generation == 1
    assert hashed == ["documents.g000001.jsonl"]  # the arrays and the index were verified before
    remove_documents(directory, [records[-2].doc_id], log=lambda m: None)
    table = directory / Manifest.read(directory).file_name("documents.jsonl")
    table.write_text(table.read_text().replace('"removed": true', '"removed": false', 1))
    assert not live.refresh() and not live.refresh() and live.generation == 1  # still the good one
    assert sum("generation 2 of" in line and "does not open" in line for line in logs) == 1  # said once
    assert not np.isin(live.provenance(live.search(all_keys(live.current), 5).ids).docs, [records[-1].index]).any()


# ---------------------------------------------------------------------------------------------------
# SIGKILL


def start(op: str, directory: Path, delay: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(WORKER), op, str(directory), delay], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    line = proc.stdout.readline()  # blocks until imports are done (bounded by the worker's own run)
    assert line.strip() == "ready", proc.stderr.read()
    return proc


def finish(proc: subprocess.Popen) -> None:
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err


@pytest.mark.parametrize("op, before, after, delay, window", [
    ("add", "a", "ab", "0.05", 2.0),
    ("remove", "ab", "removed", "0.3", 0.9),
    ("compact", "removed", "a", "0.3", 2.0),
])
def test_sigkill_leaves_old_or_new_then_resumes(stores, tmp_path, op, before, after, delay, window):
    ref = dict(stores)
    if "removed" in (before, after):
        ref["removed"] = Path(shutil.copytree(stores["ab"], tmp_path / "ref-removed"))
        ids = [r.doc_id for r in Datastore.open(ref["removed"]).documents()[len(DOCS_A):]]
        remove_documents(ref["removed"], ids, log=lambda m: None)
    old, new = Datastore.open(ref[before]), Datastore.open(ref[after])
    xq = all_keys(Datastore.open(stores["ab"]))[::7]
    directory = Path(shutil.copytree(ref[before], tmp_path / "work"))
    rng, kills, states, mid = random.Random(7), 0, [], []
    for _ in range(3):
        proc = start(op, directory, delay)
        # Kill inside the change: once its scratch directory exists, after a random part of the window
        # (a fixed sleep from the start raced the change on a fast, idle machine and killed it too late).
        deadline = time.monotonic() + 60
        while not (directory / ".generation").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, window / 2))
        if proc.poll() is not None:
            finish(proc)
            break
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        kills += 1
        mid.append((directory / ".generation").exists())
        store = Datastore.open(directory)  # opens, all checksums good
        state = after if _answers_as(store, new, xq) else before
        assert _answers_as(store, old if state == before else new, xq)
        states.append(state)
        if state == after:
            break
    else:
        finish(start(op, directory, "0"))
    assert kills >= 1 and any(mid)  # at least one kill fell inside the change (its scratch was there)
    assert _answers_as(Datastore.open(directory), new, xq)


def _answers_as(store: Datastore, reference: Datastore, xq: np.ndarray) -> bool:
    """Same live documents and the same answers to every query, bit for bit."""
    if [(r.fingerprint, r.removed) for r in store.documents()] != [(r.fingerprint, r.removed)
                                                                   for r in reference.documents()]:
        return False
    a, b = store.search(xq, 10), reference.search(xq, 10)
    return all(np.array_equal(x, y) for x, y in zip(a, b))
