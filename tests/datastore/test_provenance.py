"""Provenance: every datastore entry names its document and the position of its next token,
checked against the corpus tokenized again; Datastore.provenance over search results; format-2
datastores still search but refuse provenance; the leakage guard over a real search."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from store_helpers import BOS, PROVENANCE, WINDOW

from datastore import (
    BuildSettings,
    Datastore,
    build_datastore,
    build_from_tokens,
    datastore_info,
)
from datastore.manifest import DOCS_NAME, DOCUMENTS_NAME, MANIFEST_NAME, POSITIONS_NAME
from memlm.errors import MemlmError
from memlm.jobs.windows import score_documents
from memlm.model.tokenizer import Tokenizer
from memlm.retrieval.leakage import exclude_nearby

TEXTS = [f"Document {i}: {'naïve café words ' * (2 + i % 4)}and an end." for i in range(7)]
MAX_TOKENS = 400  # cuts the corpus inside its fifth document (TEXTS hold 598 byte tokens)


@pytest.fixture(scope="module")
def text_store(tmp_path_factory) -> Path:
    """A datastore of TEXTS (a .jsonl corpus) under the tiny preset (byte-level tokenizer)."""
    corpus = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    out = tmp_path_factory.mktemp("text") / "store"
    return build_datastore("tiny", str(corpus), out, max_tokens=MAX_TOKENS, index="Flat", context=32, stride=16,
                           batch_size=3, device="cpu", dtype="float32", progress=False, shard_batches=2)


def test_every_entry_is_the_token_its_document_and_position_name(text_store):
    """Oracle: the corpus tokenized again, here; entry i's value is document docs[i]'s token at positions[i]
    (boundary = position 0), and the entries cover every token of the corpus once, in corpus order."""
    store = Datastore.open(text_store)
    tokenizer = Tokenizer.byte_level()
    expected, left = [], MAX_TOKENS
    for text in TEXTS:
        if left <= 0:
            break
        ids = tokenizer.encode(text)[:left]
        expected.append(ids)
        left -= len(ids)
    assert len(expected) == 5 and len(expected[-1]) < len(tokenizer.encode(TEXTS[4]))  # a cut document
    docs, positions = (np.asarray(a) for a in store.entry_provenance)
    values = np.asarray(store.values)
    assert docs.dtype == positions.dtype == np.int32 and len(store) == MAX_TOKENS
    for i in range(len(store)):
        assert values[i] == expected[docs[i]][positions[i] - 1], i
    pairs = [(d, p) for d, ids in enumerate(expected) for p in range(1, len(ids) + 1)]
    assert list(zip(docs.tolist(), positions.tolist())) == pairs
    for d, ids in enumerate(expected):  # the values of one document, by position, are its text
        assert tokenizer.decode(values[docs == d][np.argsort(positions[docs == d])].tolist()) == tokenizer.decode(ids)
    assert store.manifest.documents == len(expected)


def test_each_key_is_the_state_before_its_position(built, tiny_model, docs):
    """Entry i's key is what evaluation computes at input index positions[i] - 1 of document docs[i]."""
    store = Datastore.open(built)
    want = {}
    for chunk in score_documents(tiny_model, docs, WINDOW, BOS, with_logprobs=False):
        for j, key in zip(chunk.positions.tolist(), chunk.keys.to(torch.float16).numpy()):
            want[(chunk.doc, j + 1)] = key
    prov = store.entry_provenance
    got = np.stack([want[(int(d), int(p))] for d, p in zip(prov.docs, prov.positions)])  # (N, d)
    np.testing.assert_array_equal(got, np.asarray(store.keys))
    assert 2 not in set(np.asarray(prov.docs).tolist())  # the empty document has no entry, but counts
    assert set(np.asarray(prov.docs).tolist()) == {0, 1, 3, 4, 5}


def test_provenance_of_search_results_with_missing_neighbours(tmp_path, tiny_model, docs):
    out = build_from_tokens(tiny_model, [docs[1][:12], docs[4][:9]], tmp_path / "small", PROVENANCE,
                            BuildSettings(window=WINDOW, index_factory="Flat"), progress=False, log=lambda m: None)
    store = Datastore.open(out)
    result = store.search(np.asarray(store.keys[::4], dtype=np.float32), 30)  # k > N = 21: padded with -1
    assert (result.ids == -1).any()
    got = store.provenance(result.ids)
    table = store.entry_provenance
    for (row, col), i in np.ndenumerate(result.ids):  # oracle: one by one from the table
        assert got.docs[row, col] == (-1 if i < 0 else table.docs[i])
        assert got.positions[row, col] == (-1 if i < 0 else table.positions[i])
    assert got.docs.dtype == got.positions.dtype == np.int32 and got.docs.shape == result.ids.shape
    assert sorted(zip(table.docs.tolist(), table.positions.tolist())) == (
        [(0, p) for p in range(1, 13)] + [(1, p) for p in range(1, 10)])


@pytest.mark.parametrize("ids, message", [
    (np.array([[0, 1483]]), "ids must be -1 or rows 0 to 1482"),
    (np.array([[-2]]), "got -2"),
    (np.array([0, 1]), r"a \(Q, k\) integer array"),
    (np.array([[0.0]]), r"a \(Q, k\) integer array"),
])
def test_bad_ids_are_refused(built, ids, message):
    with pytest.raises(MemlmError, match=message):
        Datastore.open(built).provenance(ids)


def test_the_guard_removes_each_query_own_entry_from_a_real_search(built):
    """Queries are stored keys: each finds its own entry first; window 0 removes that entry and no other."""
    store = Datastore.open(built)
    rows = np.arange(0, len(store), 29)
    result = store.search(np.asarray(store.keys[rows], dtype=np.float32), 8)
    own = result.ids == rows[:, None]  # (Q, 8)
    assert own.any(axis=1).all()  # every query found itself (duplicate keys aside, it is among the 8)
    table = store.entry_provenance
    guarded = exclude_nearby(result, store.provenance(result.ids), torch.from_numpy(table.docs[rows].copy()),
                             torch.from_numpy(table.positions[rows].copy()), window=0)
    np.testing.assert_array_equal(guarded.ids, np.where(own, -1, result.ids))


def as_format_2(directory: Path) -> None:
    """Rewrite a datastore as a format-2 build wrote it: no docs/positions files, no documents count (and
    none of format 4's: documents table, generation, file names)."""
    raw = json.loads((directory / MANIFEST_NAME).read_text())
    for name in (DOCS_NAME, POSITIONS_NAME, DOCUMENTS_NAME):
        del raw["files"][name]
        (directory / name).unlink()
    for entry in raw["files"].values():
        del entry["name"]
    del raw["documents"], raw["generation"]
    raw["format_version"] = 2
    (directory / MANIFEST_NAME).write_text(json.dumps(raw))


def test_a_format_2_datastore_searches_but_refuses_provenance(built, tmp_path):
    old = Path(shutil.copytree(built, tmp_path / "v2"))
    as_format_2(old)
    store, new = Datastore.open(old), Datastore.open(built)
    xq = np.asarray(new.keys[::50], dtype=np.float32)
    a, b = store.search(xq, 5), new.search(xq, 5)
    np.testing.assert_array_equal(a.ids, b.ids)  # kNN-LM keeps working on it
    np.testing.assert_array_equal(a.values, b.values)
    with pytest.raises(MemlmError, match="format version 2, without each entry's document and position; "
                                         "rebuild it for provenance: memlm datastore build --model tiny-test"):
        store.provenance(a.ids)
    assert "provenance    none (format 2): rebuild" in datastore_info(old, verify=True)


def test_the_build_check_finds_an_entry_whose_position_is_off(tmp_path):
    """datastore.build._check_provenance, the build's last look: off by one position is caught."""
    from datastore.build import _check_provenance
    from datastore.shards import ARRAY_DTYPES, ShardPaths, write_array

    tokens = np.array([7, 8, 9, 5, 6], dtype=np.int32)  # documents [7, 8, 9], [], [5, 6]
    offsets = np.array([0, 3, 3, 5], dtype=np.int64)
    paths = ShardPaths(*(tmp_path / name for name in ("k", "v", "d", "p")))
    write_array(paths.keys, np.zeros((5, 2)), ARRAY_DTYPES.keys)
    write_array(paths.values, tokens, ARRAY_DTYPES.values)
    write_array(paths.docs, [0, 0, 0, 2, 2], ARRAY_DTYPES.docs)
    write_array(paths.positions, [1, 2, 3, 1, 2], ARRAY_DTYPES.positions)
    _check_provenance(tokens, offsets, paths, block=2)  # right: passes
    for name, wrong in (("positions", [1, 2, 3, 2, 2]), ("positions", [1, 2, 3, 1, 3]), ("docs", [0, 0, 0, 1, 2])):
        write_array(getattr(paths, name), wrong, getattr(ARRAY_DTYPES, name))
        with pytest.raises(RuntimeError, match="entry 3: document|entry 4: document"):
            _check_provenance(tokens, offsets, paths, block=2)
        write_array(paths.docs, [0, 0, 0, 2, 2], ARRAY_DTYPES.docs)
        write_array(paths.positions, [1, 2, 3, 1, 2], ARRAY_DTYPES.positions)
