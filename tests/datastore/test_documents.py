"""The documents table: one record a document, in docs.i32 order, with a stable id, the
text's fingerprint (the function eval's overlap check uses), its token count and the corpus row's
metadata; `memlm datastore info` summarises it and `memlm datastore docs --where` lists it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from store_helpers import PROVENANCE, WINDOW

from datastore import (
    BuildSettings,
    Datastore,
    build_datastore,
    build_from_tokens,
    datastore_docs,
)
from datastore.documents import TOKENS_PREFIX, token_fingerprint
from datastore.manifest import DOCUMENTS_NAME, MANIFEST_NAME
from memlm.cli import main
from memlm.data.documents import Document, document_fingerprint
from memlm.errors import MemlmError
from memlm.model.tokenizer import Tokenizer

ROWS = [
    {"text": "First speech: we hold these truths.", "year": 1990, "president": "Bush", "title": "one"},
    {"text": "", "year": 1991, "president": "Bush", "title": "empty"},
    {"text": "Second speech, about the economy and jobs.", "year": 1999, "president": "Clinton", "title": "two"},
    {"text": "First speech: we hold these truths.", "year": 2003, "president": "Bush", "title": "copy"},
    {"text": "Third: a longer address on many things " * 3, "year": 2010, "president": "Obama", "title": "three"},
]
MAX_TOKENS = 200  # cuts the last document (ROWS hold 246 byte tokens)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "speeches.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


@pytest.fixture(scope="module")
def text_store(tmp_path_factory, corpus) -> Path:
    out = tmp_path_factory.mktemp("docs") / "store"
    return build_datastore("tiny", str(corpus), out, max_tokens=MAX_TOKENS, index="Flat", context=32, stride=16,
                           batch_size=2, device="cpu", dtype="float32", progress=False)


def test_records_against_the_corpus(text_store):
    """Oracle: the corpus rows, tokenized again; record i is docs.i32 value i."""
    store = Datastore.open(text_store)
    records = store.documents()
    tokenizer = Tokenizer.byte_level()
    left, expected_tokens = MAX_TOKENS, []
    for row in ROWS:
        n = min(len(tokenizer.encode(row["text"])), left)
        expected_tokens.append(n)
        left -= n
    assert sum(expected_tokens) == MAX_TOKENS and expected_tokens[-1] < len(tokenizer.encode(ROWS[-1]["text"]))
    assert [r.index for r in records] == list(range(len(ROWS))) == list(range(store.manifest.documents))
    for record, row, tokens in zip(records, ROWS, expected_tokens):
        meta = {k: v for k, v in row.items() if k != "text"}
        assert record.fingerprint == document_fingerprint(Document(row["text"], meta))
        assert record.meta == meta and record.tokens == tokens and not record.removed
    entries = np.bincount(np.asarray(store.entry_provenance.docs), minlength=len(records))
    assert entries.tolist() == expected_tokens  # one entry a token, the empty document none
    ids = [r.doc_id for r in records]
    assert len(set(ids)) == len(ids)
    assert ids[0] == records[0].fingerprint[:16] and ids[3] == ids[0] + "-2"  # the same text twice


def test_doc_ids_are_stable_across_splits(tmp_path, corpus, text_store):
    """The id is the content's: a datastore of another selection gives the same speech the same id."""
    out = build_datastore("tiny", str(corpus), tmp_path / "late", split="year>=1999", index="Flat", context=32,
                          stride=16, device="cpu", dtype="float32", progress=False)
    late = {r.meta["title"]: r.doc_id for r in Datastore.open(out).documents()}
    full = {r.meta["title"]: r.doc_id for r in Datastore.open(text_store).documents()}
    assert late["two"] == full["two"] and late["copy"] == full["one"]  # the copy is first in this one


def test_token_documents_get_token_fingerprints(tmp_path, tiny_model, docs):
    out = build_from_tokens(tiny_model, docs[:3], tmp_path / "t", PROVENANCE, BuildSettings(window=WINDOW),
                            progress=False, log=lambda m: None)
    records = Datastore.open(out).documents()
    assert [r.fingerprint for r in records] == [token_fingerprint(d) for d in docs[:3]]
    assert all(r.fingerprint.startswith(TOKENS_PREFIX) and r.meta == {} for r in records)
    assert [r.tokens for r in records] == [len(d) for d in docs[:3]]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_docs_lists_what_where_selects(capsys, text_store):
    code, out, _ = run_cli(capsys, "datastore", "docs", str(text_store), "--where", "president=Bush,year>1990")
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[0] == "index\tdoc_id\ttokens\tmeta"
    assert [json.loads(line.split("\t")[3])["title"] for line in lines[1:]] == ["empty", "copy"]
    code, out, _ = run_cli(capsys, "datastore", "docs", str(text_store), "--where", "year>=1990[-2:]")
    assert [line.split("\t")[0] for line in out.strip().splitlines()[1:]] == ["3", "4"]
    assert len(datastore_docs(text_store).splitlines()) == 1 + len(ROWS)


@pytest.mark.parametrize("where, message", [
    ("train", "'train' is a hub split"),
    ("party=Whig", "no document has field 'party'; fields found: president, title, year"),
    ("year<<3", "bad split"),
])
def test_bad_where_is_one_line(capsys, text_store, where, message):
    code, out, err = run_cli(capsys, "datastore", "docs", str(text_store), "--where", where)
    assert code == 1 and out == "" and message in err and err.count("\n") == 1


def test_info_summarises_the_documents(capsys, text_store):
    code, out, _ = run_cli(capsys, "datastore", "info", str(text_store))
    assert code == 0
    line = next(x for x in out.splitlines() if x.startswith("documents"))
    assert line == ("documents     5 documents, 200 tokens; metadata: president (3 distinct), title (5 distinct), "
                    "year 1990..2010")


def as_format_3(directory: Path) -> None:
    """Rewrite a datastore as a format-3 build wrote it: no documents table, generation or file names."""
    raw = json.loads((directory / MANIFEST_NAME).read_text())
    del raw["files"][DOCUMENTS_NAME]
    (directory / DOCUMENTS_NAME).unlink()
    for entry in raw["files"].values():
        del entry["name"]
    del raw["generation"]
    raw["format_version"] = 3
    (directory / MANIFEST_NAME).write_text(json.dumps(raw))


def test_a_format_3_datastore_searches_but_says_it_predates_the_table(capsys, text_store, tmp_path):
    old = Path(shutil.copytree(text_store, tmp_path / "v3"))
    as_format_3(old)
    store = Datastore.open(old)
    xq = np.asarray(store.keys[:4], dtype=np.float32)
    np.testing.assert_array_equal(store.search(xq, 3).ids, Datastore.open(text_store).search(xq, 3).ids)
    assert store.provenance(np.array([[0]])).docs[0, 0] == 0
    with pytest.raises(MemlmError, match="format version 3, which predates the documents table \\(format 4\\); "
                                         "rebuild it: memlm datastore build --model tiny"):
        store.documents()
    code, out, err = run_cli(capsys, "datastore", "docs", str(old))
    assert code == 1 and "predates the documents table" in err
    code, out, _ = run_cli(capsys, "datastore", "info", str(old))
    assert code == 0 and "documents     no table (format 3)" in out


def test_a_changed_table_fails_its_checksum(text_store, tmp_path):
    copy = Path(shutil.copytree(text_store, tmp_path / "c"))
    table = copy / DOCUMENTS_NAME
    table.write_text(table.read_text().replace('"Bush"', '"Hush"'))
    with pytest.raises(MemlmError, match="documents.jsonl fails its checksum"):
        Datastore.open(copy)


def test_remove_add_compact_from_the_command_line(capsys, text_store, corpus, tmp_path):
    """Bush's speeches out (by metadata), back in from the corpus (the copy of a text once), compacted."""
    directory = Path(shutil.copytree(text_store, tmp_path / "cli"))
    code, _, err = run_cli(capsys, "datastore", "remove", str(directory), "--where", "president=Bush")
    assert code == 0 and "removed 3 documents (" in err and "generation 1 committed" in err
    _, out, _ = run_cli(capsys, "datastore", "docs", str(directory), "--where", "president=Bush")
    assert all(line.endswith("REMOVED") for line in out.strip().splitlines()[1:])
    _, out, _ = run_cli(capsys, "datastore", "info", str(directory))
    bush = sum(r.tokens for r in Datastore.open(text_store).documents() if r.meta["president"] == "Bush")
    assert f"documents     2 documents, {200 - bush} tokens; 3 removed ({bush} entries never returned" in out
    assert "format        version 4, generation 1" in out
    code, _, err = run_cli(capsys, "datastore", "add", str(directory), "--data", str(corpus), "--quiet")
    assert code == 0 and "skipped 3 documents already in" in err  # Clinton, Obama, and the copy of speech one
    store = Datastore.open(directory)
    live = [r for r in store.documents() if not r.removed]
    assert sorted(r.meta["title"] for r in live) == ["empty", "one", "three", "two"]
    code, _, err = run_cli(capsys, "datastore", "compact", str(directory), "--quiet")
    assert code == 0 and "generation 3 committed" in err
    store = Datastore.open(directory)
    assert [r.meta["title"] for r in store.documents()] == ["two", "three", "one", "empty"]
    assert [r.index for r in store.documents()] == [0, 1, 2, 3] and store.manifest.generation == 3
    code, _, err = run_cli(capsys, "datastore", "remove", str(directory), "--doc-id", "nope")
    assert code == 1 and err.count("\n") == 1 and "--doc-id nope is not a document of it" in err
