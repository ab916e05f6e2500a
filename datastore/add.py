"""Add documents to a finished datastore without a rebuild (as SILO, Min et al. 2023, does).

Stages, each skipped when its output exists (so a killed add resumes with the same command), scratch in
`.generation/` (datastore.generations), the datastore's files untouched until the commit:

    tokenize  the new documents (those whose fingerprint the datastore does not hold live) -> tokens,
              offsets and their records, numbered after the datastore's documents (datastore.build stage 1)
    encode    the same model, windows (context, stride, batch size) and boundary token as the datastore's
              manifest -> the new entries' keys, values, docs, positions (datastore.build stage 2)
    merge     the committed arrays + the new ones -> generation g + 1's keys, values, docs (+ documents),
              positions and documents table
    index     the committed index (trained already: no retraining) + the new keys -> g + 1's index
    commit    manifest generation g + 1 (datastore.generations.commit)

So a datastore built from A and extended by B holds exactly the entries of one built from A + B, in the
same order, added to the same trained index: with Flat, bit-identical searches (tests/datastore/
test_lifecycle.py), when the windows' batches are the same (batch composition changes float results;
with batch size 1 they always are).

Shape legend: N committed entries, n new entries, d key dimension, D documents.
"""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

from datastore import build as build_lib
from datastore import generations
from datastore import index as index_lib
from datastore.build import BuildSettings, BuildSource, Document, Documents
from datastore.documents import as_source, read_documents, write_documents
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
from datastore.shards import PROVENANCE_DTYPE, VALUE_DTYPE, read_array, write_array
from memlm.errors import MemlmError
from memlm.files import atomic_open
from memlm.jobs.windows import WindowConfig
from memlm.model.decoder import Decoder
from memlm.model.weight_formats import format_of

COPY_BLOCK = 1 << 24
"""Bytes per read when copying a committed file into the next generation's."""


def check_same_encoder(m: Manifest, model: Decoder, source: BuildSource, directory: Path) -> None:
    """New entries must live in the datastore's key space and text layout: the same model weights,
    tokenizer, key layer, boundary token, dtype and weight format; refused in one line naming the first difference."""
    dtype = str(model.dtype).removeprefix("torch.")
    for what, have, want in (("model fingerprint", source.model_fingerprint, m.model_fingerprint),
                             ("tokenizer fingerprint", source.tokenizer_fingerprint, m.tokenizer_fingerprint),
                             ("key layer", model.config.key_description, m.key_layer),
                             ("boundary token", source.boundary_token, m.boundary_token),
                             ("model dtype", dtype, m.build.get("model_dtype", dtype)),
                             ("weight format", format_of(model), m.weights)):
        if have != want:
            raise MemlmError(f"cannot add to {directory}: its entries were made with {what} {want!s:.16}, this "
                             f"model has {have!s:.16}; add with the datastore's model ({m.model_name}) or build a "
                             "new datastore")


def add_settings(m: Manifest, shard_batches: int = 64) -> BuildSettings:
    """The encoding settings of an add: the datastore's own windows and batch size (its manifest)."""
    window = WindowConfig(context=m.context, stride=m.stride, batch_size=int(m.build.get("batch_size", 4)))
    return BuildSettings(window=window, index_factory=m.index_factory, nprobe=m.nprobe, shard_batches=shard_batches)


def add_documents(
    model: Decoder,
    documents: Documents,
    directory: Path,
    source: BuildSource,
    *,
    shard_batches: int = 64,
    progress: bool = True,
    log: Callable[[str], None] = build_lib._log,
) -> int:
    """Add `documents` (as datastore.build.Documents) to the datastore in `directory`, committing the next
    generation; returns the number of documents added (0: all were present already, nothing committed).

    source: the new documents' corpus and the model's fingerprints (checked by check_same_encoder).
    Documents whose fingerprint a live document of the datastore has are skipped, said in one line.
    """
    directory = Path(directory)
    started = time.perf_counter()
    plan = {"corpus": source.corpus, "corpus_fingerprint": source.corpus_fingerprint, "shard_batches": shard_batches}
    committed = Manifest.read(directory)
    check_same_encoder(committed, model, source, directory)
    with generations.exclusive(directory):
        m, work = generations.begin(directory, "add", plan, DATA_ROLES, log)
        records = read_documents(directory / m.file_name(DOCUMENTS_NAME))
        settings = add_settings(m, shard_batches)
        offsets_path = work / "doc_offsets.i64"
        if not offsets_path.exists():
            live = {r.fingerprint for r in records if not r.removed}
            fresh = _new_only(documents, live, directory, log)
            build_lib._stage_tokenize(fresh, None, work / "tokens.i32", offsets_path, work / DOCUMENTS_NAME,
                                      records, progress)
        tokens = read_array(work / "tokens.i32", VALUE_DTYPE)  # (n,)
        if tokens.shape[0] == 0:
            generations.remove_uncommitted(directory, m)
            shutil.rmtree(work, ignore_errors=True)
            log(f"nothing to add to {directory}: no new document with tokens")
            return 0
        offsets = read_array(offsets_path, np.dtype("<i8"), mmap=False)  # (D_new + 1,)
        new_keys, _ = build_lib._stage_keys(model, tokens, offsets, settings, source, work, work, progress, log)  # (n, d)
        written = _stage_merge(directory, m, work, records)
        index_name = generations.next_file(m, INDEX_NAME)
        if not (directory / index_name).exists():
            index = index_lib.read_index(directory / m.file_name(INDEX_NAME))
            index = index_lib.add_keys(index, new_keys, settings.add_chunk, log, progress)
            index_lib.write_index(index, directory / index_name)
        written[INDEX_NAME] = index_name
        added = len(read_documents(work / DOCUMENTS_NAME, m.documents))
        change = {"op": "add", "documents": added, "entries": int(tokens.shape[0]), "corpus": source.corpus,
                  "seconds": round(time.perf_counter() - started, 3)}
        new = dataclasses.replace(
            m, n=m.n + int(tokens.shape[0]), documents=m.documents + added, generation=m.generation + 1,
            files=generations.named_files(directory, m, written), corpus=f"{m.corpus} + {source.corpus}",
            corpus_fingerprint=hashlib.sha256(f"{m.corpus_fingerprint}\n+{source.corpus_fingerprint}".encode()).hexdigest(),
            build={**m.build, "last_change": change},
        )
        generations.commit(directory, m, new, log)
        return added


def _new_only(documents: Documents, live: set[str], directory: Path, log: Callable[[str], None]) -> Iterator[Document]:
    """The documents whose fingerprint no live document has (nor an earlier one of this add); one line
    says how many were skipped, once all were read."""
    docs: Iterable[Document] = documents() if callable(documents) else documents
    seen, skipped = set(live), 0
    for item in docs:
        doc = as_source(item)
        if doc.fingerprint in seen:
            skipped += 1
            continue
        seen.add(doc.fingerprint)
        yield doc
    if skipped:
        log(f"skipped {skipped} document{'' if skipped == 1 else 's'} already in {directory} (same fingerprint)")


def _stage_merge(directory: Path, m: Manifest, work: Path, records) -> dict[str, str]:
    """Generation g + 1's keys (N + n, d), values, docs, positions (N + n,) and documents table: the committed
    file's bytes, then the new rows' (docs shifted by the committed document count). Returns role -> name."""
    written = {}
    for role in (KEYS_NAME, VALUES_NAME, POSITIONS_NAME):
        name = generations.next_file(m, role)
        if not (directory / name).exists():
            with atomic_open(directory / name, durable=True) as f:
                for path in (directory / m.file_name(role), work / role):
                    with open(path, "rb") as src:
                        while block := src.read(COPY_BLOCK):
                            f.write(block)
        written[role] = name
    name = generations.next_file(m, DOCS_NAME)
    if not (directory / name).exists():
        old = read_array(directory / m.file_name(DOCS_NAME), PROVENANCE_DTYPE)  # (N,)
        new = read_array(work / DOCS_NAME, PROVENANCE_DTYPE).astype(np.int64) + m.documents  # (n,)
        write_array(directory / name, np.concatenate([np.asarray(old), new]), PROVENANCE_DTYPE)  # (N + n,)
    written[DOCS_NAME] = name
    name = generations.next_file(m, DOCUMENTS_NAME)
    if not (directory / name).exists():
        write_documents(directory / name, (*records, *read_documents(work / DOCUMENTS_NAME, m.documents)))
    written[DOCUMENTS_NAME] = name
    return written
