"""memlm.data.documents.load_tokenized: the identity of every document a selection actually uses."""

from __future__ import annotations

import json

import pytest

from memlm.data.documents import document_fingerprint, load_documents, load_tokenized
from memlm.model.tokenizer import Tokenizer


@pytest.fixture(autouse=True)
def isolated(tmp_path_factory, monkeypatch):
    import datasets

    root = tmp_path_factory.mktemp("caches")
    monkeypatch.setenv("MEMLM_CACHE", str(root / "memlm"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(root / "hf"))


@pytest.fixture
def corpus(tmp_path):
    rows = [{"text": f"speech of {year}, " * 10, "year": year} for year in range(2000, 2006)]
    rows.insert(3, {"text": "", "year": 1999})  # an empty document contributes no tokens and no identity
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_overlapping_splits_share_exactly_the_common_documents(corpus):
    """The README's calibration row: tune "year>=2003", evaluate "year>=2001" -> 2003 onwards are shared."""
    byte = Tokenizer.byte_level()
    tune = load_tokenized(str(corpus), "year>=2003", byte)
    evaluation = load_tokenized(str(corpus), "year>=2001", byte)
    expected = {document_fingerprint(d) for d in load_documents(str(corpus), "year>=2003")}
    assert set(tune.fingerprints) & set(evaluation.fingerprints) == expected and len(expected) == 3
    assert not set(load_tokenized(str(corpus), "year<=2000", byte).fingerprints) & set(evaluation.fingerprints)


def test_max_tokens_keeps_only_the_documents_it_reaches(corpus):
    byte = Tokenizer.byte_level()
    per_doc = len(byte.encode("speech of 2000, " * 10))
    cut = load_tokenized(str(corpus), None, byte, max_tokens=per_doc + 5)  # the second document is cut short
    assert [len(t) for t in cut.token_docs] == [per_doc, 5]
    whole = load_tokenized(str(corpus), None, byte)
    assert cut.fingerprints == whole.fingerprints[:2] and len(whole.fingerprints) == 6
    assert whole.token_docs == [byte.encode(d.text) for d in load_documents(str(corpus)) if d.text]
