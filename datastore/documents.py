"""The documents table (documents.jsonl, format 4): one record a document of the datastore.

A datastore entry names its document by index (docs.i32, memlm.retrieval.searcher.Provenance); the
table says what that document is: a stable id, the fingerprint of its text, how many tokens (= entries)
it gave, the metadata its corpus row carries (year, president, title, ...), and whether it was removed.
Records are in index order, so record i describes docs.i32 value i. The build writes it, `add` extends
it, `remove` marks records, `compact` drops the removed ones.

Identity is the content: `fingerprint` is memlm.data.documents.document_fingerprint (sha256 of the text,
the function eval's overlap check uses), so the same speech has the same fingerprint, and the same
`doc_id`, in every datastore and every split of its corpus -- a publisher's opt-out list of ids or
fingerprints applies to all of them, and `add` recognises a document it already holds (SILO, Min et al.
2023: the nonparametric store is where data is added and removed).
"""

from __future__ import annotations

import collections
import hashlib
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from memlm.data.documents import Document, document_fingerprint, tokenize_documents
from memlm.data.splits import SPLIT_SYNTAX, parse_split, slice_iter
from memlm.errors import MemlmError
from memlm.files import atomic_write

DOC_ID_HEX = 16
"""Hex digits of the fingerprint that make a doc_id (64 bits: no collision among millions of documents)."""
TOKENS_PREFIX = "tokens:"
"""Fingerprint prefix of a document given as bare token ids (no text known): sha256 of its int32 ids."""


class SourceDocument(NamedTuple):
    """A document as a build or an add reads it: its token ids and what the table records about it."""

    ids: list[int]
    """Token ids (before the build's --max-tokens cut)."""
    fingerprint: str
    """document_fingerprint of its text, or token_fingerprint(ids) when only the ids are known."""
    meta: dict
    """The corpus row's fields other than text (JSON values)."""


@dataclass(frozen=True)
class DocumentRecord:
    """One document of a datastore (a line of documents.jsonl)."""

    index: int
    """Its index in the datastore: the value docs.i32 holds for its entries (0 .. Manifest.documents - 1)."""
    doc_id: str
    """Stable id: the first DOC_ID_HEX hex digits of the fingerprint; the n-th copy of the same text in one
    datastore (n >= 2) gets "-n" appended (empty documents all share one fingerprint)."""
    fingerprint: str
    """sha256 hex of the document's text (memlm.data.documents.document_fingerprint); for a document given
    as bare token ids, TOKENS_PREFIX + the sha256 of its int32 little-endian ids."""
    tokens: int
    """Tokens stored (= its entries), after the build's --max-tokens cut; 0 for an empty document."""
    meta: dict[str, Any]
    """The corpus row's fields other than text, as JSON values (sotu: doc_id, year, president, title, ...)."""
    removed: bool = False
    """Removed by `memlm datastore remove`: its entries are never returned; `compact` drops it from disk."""

    def to_json(self) -> str:
        return json.dumps({"index": self.index, "doc_id": self.doc_id, "fingerprint": self.fingerprint,
                           "tokens": self.tokens, "meta": self.meta, "removed": self.removed},
                          ensure_ascii=False, sort_keys=True)


def token_fingerprint(ids: Sequence[int]) -> str:
    """The fingerprint of a document known only by its token ids (tests, benchmarks, build_from_tokens)."""
    import numpy as np

    return TOKENS_PREFIX + hashlib.sha256(np.asarray(ids, dtype="<i4").tobytes()).hexdigest()


def as_source(doc: list[int] | SourceDocument) -> SourceDocument:
    """A build's document: a SourceDocument as given, bare token ids with their token fingerprint."""
    if isinstance(doc, SourceDocument):
        return doc
    return SourceDocument(list(doc), token_fingerprint(doc), {})


def json_meta(meta: dict) -> dict[str, Any]:
    """`meta` as JSON values (dates, numpy scalars from parquet become their str / Python values)."""
    return json.loads(json.dumps(meta, default=str, ensure_ascii=False))


def source_documents(docs: Iterable[Document], tokenizer: Any) -> Iterator[SourceDocument]:
    """Corpus documents -> SourceDocument (ids by memlm.data.documents.tokenize_documents, the text's
    fingerprint, JSON metadata), one a document, in order."""
    held: list[Document] = []

    def remember(source: Iterable[Document]) -> Iterator[Document]:
        for doc in source:
            held.append(doc)
            yield doc

    for ids in tokenize_documents(remember(docs), tokenizer):
        doc = held.pop()
        yield SourceDocument(ids, document_fingerprint(doc), json_meta(doc.meta))


def new_records(documents: Iterable[tuple[str, int, dict]], existing: Sequence[DocumentRecord]
                ) -> list[DocumentRecord]:
    """Records for new documents (fingerprint, tokens, meta) appended after `existing`: indices continue,
    and a fingerprint already held by a live (not removed) record gets the next copy number in its doc_id
    (a removed document gives its id back: added again, it has the id it had)."""
    copies = collections.Counter(r.fingerprint for r in existing if not r.removed)
    out = []
    for i, (fingerprint, tokens, meta) in enumerate(documents, len(existing)):
        copies[fingerprint] += 1
        base = fingerprint.removeprefix(TOKENS_PREFIX)[:DOC_ID_HEX]
        doc_id = base if copies[fingerprint] == 1 else f"{base}-{copies[fingerprint]}"
        out.append(DocumentRecord(i, doc_id, fingerprint, int(tokens), meta))
    return out


def write_documents(path: Path, records: Sequence[DocumentRecord]) -> None:
    """The table, one JSON object a line, atomically and durably."""
    atomic_write(path, "".join(r.to_json() + "\n" for r in records), durable=True)


def read_documents(path: Path, first: int = 0) -> tuple[DocumentRecord, ...]:
    """documents.jsonl -> records, checked to be in index order first, first + 1, ... (an add's new ones
    start after the datastore's)."""
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            try:
                raw = json.loads(line)
                record = DocumentRecord(int(raw["index"]), str(raw["doc_id"]), str(raw["fingerprint"]),
                                        int(raw["tokens"]), dict(raw["meta"]), bool(raw["removed"]))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise MemlmError(f"{path}:{lineno} is not a document record ({type(e).__name__}: {e}); the "
                                 "datastore is damaged, rebuild it") from None
            if record.index != first + lineno - 1:
                raise MemlmError(f"{path}:{lineno} holds document {record.index}, expected {first + lineno - 1}; the "
                                 "datastore is damaged, rebuild it")
            records.append(record)
    return tuple(records)


def select(records: Iterable[DocumentRecord], where: str | None) -> list[DocumentRecord]:
    """The records whose metadata pass `where`, a --split expression without its hub part (conditions on
    the metadata, an optional trailing slice over the records that pass); None: all of them."""
    expr = parse_split(where)
    if expr is None:
        return list(records)
    if expr.hub is not None:
        raise MemlmError(f"--where {where!r}: {expr.hub!r} is a hub split, which a datastore's documents do not "
                         f"have; give conditions on their metadata ({SPLIT_SYNTAX})")
    records = list(records)
    passing = (r for r in records if all(c.holds(r.meta) for c in expr.conditions))
    chosen = list(slice_iter(passing, expr.start, expr.stop))
    if not chosen and expr.conditions:
        fields = sorted({k for r in records for k, v in r.meta.items() if v is not None})
        unknown = sorted({c.field for c in expr.conditions} - set(fields))
        if unknown:
            raise MemlmError(f"--where {where!r}: no document has field {', '.join(map(repr, unknown))}; fields "
                             f"found: {', '.join(fields) or '(none)'}")
    return chosen


def summary(records: Sequence[DocumentRecord]) -> str:
    """One line about the table: counts, tokens, and the metadata fields with their range or variety."""
    live = [r for r in records if not r.removed]
    removed = len(records) - len(live)
    fields: dict[str, list] = collections.defaultdict(list)
    for r in live:
        for k, v in r.meta.items():
            if v is not None:
                fields[k].append(v)
    parts = []
    for name in sorted(fields):
        values = fields[name]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            parts.append(f"{name} {min(values)}..{max(values)}")
        else:
            parts.append(f"{name} ({len(set(map(str, values)))} distinct)")
    gone = sum(r.tokens for r in records if r.removed)
    text = (f"{len(live):,} document{'' if len(live) == 1 else 's'}, {sum(r.tokens for r in live):,} tokens"
            + (f"; {removed:,} removed ({gone:,} entries never returned; compact frees them)" if removed else ""))
    return text + ("; metadata: " + ", ".join(parts) if parts else "; no metadata")


def describe(record: DocumentRecord) -> str:
    """One line a document for `memlm datastore docs`: index, doc_id, tokens, metadata (JSON)."""
    mark = " REMOVED" if record.removed else ""
    return (f"{record.index}\t{record.doc_id}\t{record.tokens}\t"
            f"{json.dumps(record.meta, ensure_ascii=False, sort_keys=True)}{mark}")
