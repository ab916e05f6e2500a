"""Remove documents from a datastore, at once, and free them later.

`remove_documents` commits a generation whose documents table marks them removed; nothing else changes
on disk, so it takes as long as rewriting the table. From that generation on, `Datastore.open` turns the
marks into a bitmap of live rows (datastore.index.LiveRows) that every FAISS search carries as its ID
selector, and the exact searcher copies only live keys: a removed entry is never returned, by a local
search, an exact re-rank (it re-ranks what the index returned), recall measurement (its ground truth is
`Datastore.exact_searcher`), the retrieval service or a router (both search a Datastore). Counts stay
exact: FAISS fills each top-k from live rows only.

`compact` commits a generation without them: arrays rewritten without their rows, their records dropped
and the remaining documents renumbered in order, and the index refilled from the same trained index (a
copy of it emptied by `reset`: no retraining), so row i of the index is row i of the keys again and the
removed keys are gone from disk (the previous generation's files go at the next commit; see
datastore.generations).

Shape legend: N entries before, L live entries, d key dimension, D documents.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import faiss
import numpy as np

from datastore import build as build_lib
from datastore import generations
from datastore import index as index_lib
from datastore.datastore import Datastore
from datastore.documents import DocumentRecord, read_documents, select, write_documents
from datastore.manifest import (
    DATA_ROLES,
    DOCS_NAME,
    DOCUMENTS_NAME,
    INDEX_NAME,
    KEYS_NAME,
    POSITIONS_NAME,
    VALUES_NAME,
    Manifest,
)
from datastore.shards import (
    KEY_DTYPE,
    PROVENANCE_DTYPE,
    VALUE_DTYPE,
    read_array,
    write_array,
)
from memlm.errors import MemlmError
from memlm.files import atomic_open

ROWS_BLOCK = 1 << 16
"""Rows per step when compaction copies the live keys."""


def chosen_documents(records: Sequence[DocumentRecord], doc_ids: Sequence[str] | None, where: str | None,
                     directory: Path) -> list[DocumentRecord]:
    """The live records named by `doc_ids`, or whose metadata pass `where` (exactly one of them given)."""
    if (doc_ids is None) == (where is None):
        raise MemlmError("remove needs --doc-id ID... or --where EXPR (one of them)")
    live = [r for r in records if not r.removed]
    if where is not None:
        return select(live, where)
    by_id = {r.doc_id: r for r in live}
    gone = {r.doc_id for r in records if r.removed}
    for doc_id in doc_ids:
        if doc_id not in by_id:
            why = "was removed already" if doc_id in gone else "is not a document of it"
            raise MemlmError(f"--doc-id {doc_id} {why} ({directory}); memlm datastore docs {directory} lists them")
    return [by_id[d] for d in dict.fromkeys(doc_ids)]


def remove_documents(directory: Path, doc_ids: Sequence[str] | None = None, where: str | None = None, *,
                     log: Callable[[str], None] = build_lib._log) -> list[DocumentRecord]:
    """Mark documents removed in the next generation; returns their records (empty: nothing committed)."""
    directory = Path(directory)
    chosen = chosen_documents(Datastore.documents_of(directory, Manifest.read(directory)), doc_ids, where, directory)
    if not chosen:
        log(f"nothing to remove from {directory}: no live document passes --where {where}")
        return []
    plan = {"doc_ids": None if doc_ids is None else list(doc_ids), "where": where}
    with generations.exclusive(directory):
        m, _ = generations.begin(directory, "remove", plan, (DOCUMENTS_NAME,), log)
        records = read_documents(directory / m.file_name(DOCUMENTS_NAME))
        chosen = chosen_documents(records, doc_ids, where, directory)
        marked = {r.index for r in chosen}
        new_records = [dataclasses.replace(r, removed=True) if r.index in marked else r for r in records]
        name = generations.next_file(m, DOCUMENTS_NAME)
        write_documents(directory / name, new_records)
        entries = sum(r.tokens for r in chosen)
        change = {"op": "remove", "documents": len(chosen), "entries": entries}
        new = dataclasses.replace(m, generation=m.generation + 1, build={**m.build, "last_change": change},
                                  files=generations.named_files(directory, m, {DOCUMENTS_NAME: name}))
        generations.commit(directory, m, new, log)
        log(f"removed {len(chosen)} document{'' if len(chosen) == 1 else 's'} ({entries:,} entries) from {directory}; "
            "they are no longer retrieved, memlm datastore compact frees their space")
        return chosen


def compact(directory: Path, *, progress: bool = True, log: Callable[[str], None] = build_lib._log) -> int:
    """Commit a generation without the removed documents' entries and records; returns the entries dropped
    (0: nothing was removed, nothing committed)."""
    directory = Path(directory)
    started = time.perf_counter()
    if not any(r.removed for r in Datastore.documents_of(directory, Manifest.read(directory))):
        log(f"nothing to compact in {directory}: no removed document")
        return 0
    with generations.exclusive(directory):
        m, _ = generations.begin(directory, "compact", {}, DATA_ROLES, log)
        records = read_documents(directory / m.file_name(DOCUMENTS_NAME))
        removed = np.array([r.index for r in records if r.removed], dtype=np.int64)
        docs = read_array(directory / m.file_name(DOCS_NAME), PROVENANCE_DTYPE)  # (N,)
        rows = np.flatnonzero(~np.isin(np.asarray(docs), removed))  # (L,) live rows, in order
        renumber = np.cumsum([not r.removed for r in records]) - 1  # (D,) old index -> new index (live ones)
        written = {}
        for role, dtype, width in ((KEYS_NAME, KEY_DTYPE, m.dim), (VALUES_NAME, VALUE_DTYPE, None),
                                   (POSITIONS_NAME, PROVENANCE_DTYPE, None)):
            written[role] = _write_rows(directory, m, role, dtype, width, rows)
        written[DOCS_NAME] = name = generations.next_file(m, DOCS_NAME)
        if not (directory / name).exists():
            write_array(directory / name, renumber[np.asarray(docs)[rows]], PROVENANCE_DTYPE)  # (L,)
        written[DOCUMENTS_NAME] = name = generations.next_file(m, DOCUMENTS_NAME)
        if not (directory / name).exists():
            kept = [dataclasses.replace(r, index=int(renumber[r.index])) for r in records if not r.removed]
            write_documents(directory / name, kept)
        written[INDEX_NAME] = name = generations.next_file(m, INDEX_NAME)
        if not (directory / name).exists():
            index = index_lib.read_index(directory / m.file_name(INDEX_NAME))
            trained = faiss.clone_index(index)
            trained.reset()  # the trained quantizer and codebooks stay; the codes go
            keys = read_array(directory / written[KEYS_NAME], KEY_DTYPE, width=m.dim)  # (L, d)
            chunk = build_lib.BuildSettings.add_chunk  # the build's chunk size: one place
            index_lib.write_index(index_lib.add_keys(trained, keys, chunk, log, progress), directory / name)
        n_dropped = m.n - int(rows.shape[0])
        change = {"op": "compact", "documents": int(removed.size), "entries": n_dropped,
                  "seconds": round(time.perf_counter() - started, 3)}
        new = dataclasses.replace(m, n=int(rows.shape[0]), documents=len(records) - int(removed.size),
                                  generation=m.generation + 1, files=generations.named_files(directory, m, written),
                                  build={**m.build, "last_change": change})
        generations.commit(directory, m, new, log, keep_previous=False)
        return n_dropped


def _write_rows(directory: Path, m: Manifest, role: str, dtype: np.dtype, width: int | None, rows: np.ndarray) -> str:
    """Generation g + 1's file of `role`: the committed file's `rows` (L,), in order; returns its name."""
    name = generations.next_file(m, role)
    if (directory / name).exists():
        return name
    source = read_array(directory / m.file_name(role), dtype, width=width)  # (N, d) or (N,)
    with atomic_open(directory / name, durable=True) as f:
        for lo in range(0, rows.shape[0], ROWS_BLOCK):
            f.write(np.ascontiguousarray(source[rows[lo : lo + ROWS_BLOCK]], dtype=dtype).tobytes())
    return name
