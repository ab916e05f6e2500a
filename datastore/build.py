"""Build a datastore in named, resumable stages with files in between.

    tokenize  documents -> .build/tokens.i32 + .build/doc_offsets.i64 + .build/documents.jsonl (the
              documents table: id, fingerprint, tokens, metadata; datastore.documents)
    encode    the decoder over the windows of memlm.jobs.windows -> .build/shards/keys-*.f16, values-*.i32,
              docs-*.i32, positions-*.i32 (each entry's document and next-token position: its provenance)
    merge     shards -> keys.f16 (N, d) float16 + values.i32, docs.i32, positions.i32 (N,) int32
    train     a seeded sample of the keys -> .build/trained.faiss (empty, trained index)
    add       the keys in chunks, in order -> index.faiss
    manifest  checksums of every file + settings -> manifest.json (its presence marks a finished build)

Each stage skips itself when its output file exists, and every file is written under a temporary
name and renamed when complete (datastore.shards), so a build killed at any moment (SIGKILL) continues
with the same command. Encoding resumes from the last complete shard; a shard is a fixed number of
whole forward batches of the deterministic window plan, and a resumed run skips whole batches, so every
batch has the same composition (and padding) as in an uninterrupted run and the keys are
byte-identical (batch composition changes float results). `.build/build.json` records the settings of a
build in progress; resuming with different settings is refused.

Keys come from `memlm.jobs.windows.score_documents`, the loop that perplexity evaluation uses, so each key
sees exactly the left context that evaluation gives its token.

Shape legend: n scored tokens of a window, N keys in all, d key dimension, D documents.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import shutil
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

import faiss
import numpy as np
import torch
from tqdm import tqdm

import memlm
from datastore import index as index_lib
from datastore.documents import (
    DocumentRecord,
    SourceDocument,
    as_source,
    new_records,
    write_documents,
)
from datastore.encode import ParallelStages, concatenate, planned_shards, window_arrays
from datastore.generations import LOCK_NAME as GENERATION_LOCK
from datastore.generations import WORK_DIR as GENERATION_WORK_DIR
from datastore.generations import exclusive
from datastore.manifest import (
    DOCS_NAME,
    DOCUMENTS_NAME,
    INDEX_NAME,
    KEYS_NAME,
    MANIFEST_NAME,
    POSITIONS_NAME,
    VALUES_NAME,
    FileEntry,
    Manifest,
    file_generation,
)
from datastore.shards import (
    KEY_DTYPE,
    PROVENANCE_DTYPE,
    VALUE_DTYPE,
    ShardArrays,
    ShardPaths,
    complete_shards,
    merge_shards,
    read_array,
    shard_paths,
    write_array,
    write_shard,
)
from memlm.errors import MemlmError
from memlm.files import PARTIAL_SUFFIX, atomic_path, atomic_write, sha256_file
from memlm.jobs.windows import WindowConfig, score_documents
from memlm.model.decoder import Decoder
from memlm.model.weight_formats import format_of

WORK_DIR = ".build"
"""Scratch directory of a build in progress, removed when the manifest is written."""
DATA_FILES = (KEYS_NAME, VALUES_NAME, DOCS_NAME, POSITIONS_NAME, INDEX_NAME, DOCUMENTS_NAME)

Document = Union[list[int], SourceDocument]
Documents = Union[Iterable[Document], Callable[[], Iterable[Document]]]
"""Documents as token ids or as SourceDocument (ids, text fingerprint, metadata: what the documents table
records), or a function returning them (called only when the tokenize stage runs, so a resumed build does
not read the corpus again). Bare ids get datastore.documents.token_fingerprint and no metadata."""


@dataclass(frozen=True)
class BuildSource:
    """What a datastore is built from; stored in its manifest and checked when it is opened."""

    model_name: str
    """Model as the user named it (preset, path or hub id)."""
    model_fingerprint: str
    """Fingerprint of the model weights (memlm.model.weights)."""
    tokenizer_fingerprint: str
    """Fingerprint of the tokenizer (memlm.model.tokenizer.Tokenizer.fingerprint)."""
    corpus: str
    """Corpus spec and split as the user gave them."""
    corpus_fingerprint: str
    """Fingerprint of the corpus (memlm.data.documents.corpus_fingerprint)."""
    boundary_token: int
    """Token prepended to every document (memlm.model.tokenizer.document_boundary); evaluation uses the same."""


@dataclass(frozen=True)
class BuildSettings:
    """How to build; every field is recorded in the manifest."""

    window: WindowConfig = field(default_factory=WindowConfig)
    """Context, stride and batch size of the encoding windows (as in perplexity evaluation)."""
    index_factory: str | None = None
    """FAISS factory string; None: chosen from N and d by datastore.index.default_factory."""
    nprobe: int | None = None
    """Default inverted lists per query stored in the manifest; None: datastore.index.default_nprobe."""
    max_tokens: int | None = None
    """Stop after this many corpus tokens (the last document is cut); None: all."""
    shard_batches: int = 64
    """Forward batches per key/value shard: the unit of work a killed build loses."""
    add_chunk: int = 65536
    """Keys per FAISS add call."""
    seed: int = 0
    """Seed of the index training sample."""
    on_disk: bool = False
    """Keep the IVF index's inverted lists in a memory-mapped file (datastore.index.IVFDATA_NAME):
    added block by block and merged on disk, so neither building nor serving holds them in memory."""


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build_from_tokens(
    model: Decoder,
    documents: Documents,
    out: Path,
    source: BuildSource,
    settings: BuildSettings = BuildSettings(),
    *,
    overwrite: bool = False,
    progress: bool = True,
    log: Callable[[str], None] = _log,
    parallel: ParallelStages | None = None,
) -> Path:
    """Build (or continue building) the datastore in `out` and return `out`.

    model: the decoder whose kNN keys (model.config.knn_key) fill the datastore; any device and dtype.
    documents: token ids per document (see `Documents`); empty documents are skipped.
    Raises MemlmError when `out` already holds a finished datastore (unless overwrite), holds files
    that are not a datastore's, or holds a build in progress with different settings.
    parallel: who encodes the missing shards and adds an on-disk index's blocks (datastore.ray_build); None:
    this process, in order. Every other stage, and the files, are the same either way.
    """
    out = Path(out)
    started = time.perf_counter()
    work = begin_build(model, source, settings, out, overwrite, log)
    tokens, offsets = _stage_tokens(documents, settings, work, source, progress)
    keys, encode_seconds = _stage_keys(model, tokens, offsets, settings, source, out, work, progress, log, parallel)
    factory, nprobe = _stage_index(keys, settings, out, work, progress, log, parallel)
    if not (out / DOCUMENTS_NAME).exists():
        with atomic_path(out / DOCUMENTS_NAME, durable=True) as tmp:
            shutil.copyfile(work / DOCUMENTS_NAME, tmp)
    files = {name: file_entry(out, name) for name in DATA_FILES + ((index_lib.IVFDATA_NAME,) if settings.on_disk else ())}
    build = {
        "batch_size": settings.window.batch_size,
        "shard_batches": settings.shard_batches,
        "add_chunk": settings.add_chunk,
        "seed": settings.seed,
        "max_tokens": settings.max_tokens,
        "model_dtype": str(model.dtype).removeprefix("torch."),
        "device": model.device.type,
        "memlm_version": memlm.__version__,
        "torch_version": torch.__version__,
        "faiss_version": faiss.__version__,
        "python": platform.python_version(),
        "finished_unix": int(time.time()),
        "last_run_seconds": round(time.perf_counter() - started, 3),
        "last_run_encode_seconds": None if encode_seconds is None else round(encode_seconds, 3),
    }
    n_total, dim = keys.shape
    manifest = Manifest(
        n=n_total, dim=dim, key_layer=model.config.key_description,
        model_name=source.model_name, model_fingerprint=source.model_fingerprint,
        tokenizer_fingerprint=source.tokenizer_fingerprint, corpus=source.corpus,
        corpus_fingerprint=source.corpus_fingerprint, index_factory=factory, metric="l2",
        nprobe=int(nprobe), context=settings.window.context, stride=settings.window.stride,
        boundary_token=source.boundary_token, sink_tokens=0, files=files, build=build,
        documents=int(offsets.shape[0] - 1), weights=format_of(model),
    )
    atomic_write(out / MANIFEST_NAME, manifest.to_json(), durable=True)
    shutil.rmtree(work)
    log(f"datastore: {out} ({n_total} keys of dimension {dim}, index {factory})")
    return out


def begin_build(model: Decoder, source: BuildSource, settings: BuildSettings, out: Path, overwrite: bool,
                log: Callable[[str], None]) -> Path:
    """Check `out` (no finished datastore unless overwrite, no foreign files, a build in progress only with the
    same settings) and return its work directory; the local and the Ray build (datastore.ray_build) start so."""
    _prepare_out_dir(out, overwrite, log)
    work = out / WORK_DIR
    work.mkdir(parents=True, exist_ok=True)
    _check_identity(work, _identity(model, source, settings), out)
    return work


def file_entry(directory: Path, name: str) -> FileEntry:
    """The manifest entry of file `name` in `directory`: size, SHA-256 (read now, never cached) and name."""
    path = directory / name
    return FileEntry(bytes=path.stat().st_size, sha256=sha256_file(path, remember=False), name=name)


def _stage_tokens(documents: Documents, settings: BuildSettings, work: Path, source: BuildSource,
                  progress: bool, existing: tuple[DocumentRecord, ...] = ()) -> tuple[np.ndarray, np.ndarray]:
    """Stage 1: token ids (N,) int32 and document offsets (docs + 1,) int64, written once, then read back;
    beside them work/documents.jsonl, the records of these documents, numbered after `existing` (an add)."""
    offsets_path = work / "doc_offsets.i64"
    tokens_path = work / "tokens.i32"
    if not offsets_path.exists():
        _stage_tokenize(documents, settings.max_tokens, tokens_path, offsets_path, work / DOCUMENTS_NAME,
                        existing, progress)
    tokens = read_array(tokens_path, VALUE_DTYPE)  # (N,)
    offsets = read_array(offsets_path, np.dtype("<i8"), mmap=False)  # (docs + 1,)
    if tokens.shape[0] == 0:
        raise MemlmError(f"the corpus {source.corpus} gave no tokens; nothing to build")
    return tokens, offsets


def _stage_keys(model: Decoder, tokens: np.ndarray, offsets: np.ndarray, settings: BuildSettings,
                source: BuildSource, out: Path, work: Path, progress: bool,
                log: Callable[[str], None], parallel: ParallelStages | None = None) -> tuple[np.ndarray, float | None]:
    """Stage 2: encode in shards and merge them into keys (N, d) float16 and values, docs, positions (N,)
    int32 in `out`, then check the values against the documents and positions (_check_provenance).
    Returns the keys (a memmap) and the encoding time of this run (None when already done)."""
    dim, n_total = model.config.n_embd, int(tokens.shape[0])
    encode_seconds = None
    merged = ShardPaths(out / KEYS_NAME, out / VALUES_NAME, out / DOCS_NAME, out / POSITIONS_NAME)
    if not all(path.exists() for path in merged):
        shards_dir = work / "shards"
        shards_dir.mkdir(exist_ok=True)
        if parallel is None:
            encode_seconds = _stage_encode(model, tokens, offsets, settings, source.boundary_token,
                                           shards_dir, progress, log)
        else:
            t0 = time.perf_counter()
            parallel.encode(work, planned_shards(offsets, settings.window, settings.shard_batches))
            encode_seconds = time.perf_counter() - t0
        n_shards = complete_shards(shards_dir)
        n_merged = merge_shards(shards_dir, n_shards, dim, merged)
        if n_merged != n_total:
            raise RuntimeError(f"encoded {n_merged} keys for {n_total} tokens")
        _check_provenance(tokens, offsets, merged)
        shutil.rmtree(shards_dir)
    return read_array(out / KEYS_NAME, KEY_DTYPE, width=dim), encode_seconds  # (N, d)


def _check_provenance(tokens: np.ndarray, offsets: np.ndarray, merged: ShardPaths, block: int = 1 << 22) -> None:
    """Every entry's value is the token its document and position name: values[i] ==
    tokens[offsets[docs[i]] + positions[i] - 1]. One pass over N in blocks, against a bookkeeping slip."""
    values = read_array(merged.values, VALUE_DTYPE)  # (N,)
    docs = read_array(merged.docs, PROVENANCE_DTYPE)  # (N,)
    positions = read_array(merged.positions, PROVENANCE_DTYPE)  # (N,)
    lengths = np.diff(offsets)  # (D,)
    for lo in range(0, values.shape[0], block):
        d, p = np.asarray(docs[lo : lo + block], np.int64), np.asarray(positions[lo : lo + block], np.int64)  # (b,)
        inside = (d >= 0) & (d < lengths.shape[0])
        d = np.where(inside, d, 0)
        inside &= (p >= 1) & (p <= lengths[d])
        where = np.where(inside, offsets[d] + p - 1, 0)  # (b,)
        bad = np.flatnonzero(~inside | (tokens[where] != values[lo : lo + block]))
        if bad.size:
            i = lo + int(bad[0])
            raise RuntimeError(f"entry {i}: document {docs[i]} position {positions[i]} does not hold its value "
                               f"{values[i]}")


def _stage_index(keys: np.ndarray, settings: BuildSettings, out: Path, work: Path, progress: bool,
                 log: Callable[[str], None], parallel: ParallelStages | None = None) -> tuple[str, int]:
    """Stages 3-4: train the index on a sample (kept in work/trained.faiss), add all keys; (factory, nprobe)."""
    n_total, dim = keys.shape
    factory = settings.index_factory
    if factory is None:
        factory, reason = index_lib.default_factory(n_total, dim)
        log(f"index: {factory} ({reason}; choose another with --index)")
    else:
        log(f"index: {factory}")
    if settings.on_disk:
        index_lib.check_on_disk_factory(factory, dim)
    trained_path = work / index_lib.TRAINED_NAME
    if not (out / INDEX_NAME).exists():
        t0 = time.perf_counter()
        if not trained_path.exists():
            trained = index_lib.train_index(factory, keys, settings.seed, log, progress)
            index_lib.write_index(trained, trained_path)
        if settings.on_disk:
            index_lib.add_on_disk(keys, settings.add_chunk, out / INDEX_NAME, work, progress,
                                  None if parallel is None else parallel.add_blocks)
        else:
            index = index_lib.read_index(trained_path)
            index = index_lib.add_keys(index, keys, settings.add_chunk, log, progress)
            index_lib.write_index(index, out / INDEX_NAME)
        log(f"index trained and filled in {time.perf_counter() - t0:.1f} s")
    index = index_lib.read_index(out / INDEX_NAME, mmap=True)
    nprobe = settings.nprobe if settings.nprobe is not None else index_lib.default_nprobe(index)
    return factory, int(nprobe)


def _prepare_out_dir(out: Path, overwrite: bool, log: Callable[[str], None]) -> None:
    """Refuse to clobber a finished datastore or foreign files; clear our own files on overwrite."""
    if out.exists() and not out.is_dir():
        raise MemlmError(f"--out {out} is a file; pass a directory")
    if (out / MANIFEST_NAME).exists():
        # Scratch left by a build killed between writing its manifest and removing .build.
        shutil.rmtree(out / WORK_DIR, ignore_errors=True)
        if not overwrite:
            raise MemlmError(
                f"{out} already holds a finished datastore; pass --overwrite to rebuild it, or another --out"
            )
        with exclusive(out):  # an add, remove or compact running on this datastore finishes first
            log(f"overwriting the datastore in {out}")
            (out / MANIFEST_NAME).unlink()  # first: a half-deleted datastore must not look finished
            _remove_data_files(out)
    if out.is_dir():
        foreign = sorted(p.name for p in out.iterdir() if not _is_ours(p.name))
        if foreign:
            raise MemlmError(
                f"--out {out} holds files that are not a memlm datastore's ({', '.join(foreign[:3])}"
                f"{', ...' if len(foreign) > 3 else ''}); pass an empty or new directory"
            )
        if overwrite and (out / WORK_DIR).exists():
            _remove_data_files(out)  # --overwrite also discards a build in progress


def _is_ours(name: str) -> bool:
    """A file a datastore directory holds: the manifest, scratch, or a data file of any generation."""
    base = name.removesuffix(PARTIAL_SUFFIX)
    return (base in (MANIFEST_NAME, WORK_DIR, GENERATION_WORK_DIR, GENERATION_LOCK, index_lib.IVFDATA_NAME)
            or file_generation(base) is not None)


def _remove_data_files(out: Path) -> None:
    """Delete every data file (all generations) and all scratch; the manifest must already be gone."""
    for p in out.iterdir():
        base = p.name.removesuffix(PARTIAL_SUFFIX)
        if file_generation(base) is not None or base == index_lib.IVFDATA_NAME:
            p.unlink()
    for scratch in (WORK_DIR, GENERATION_WORK_DIR):
        shutil.rmtree(out / scratch, ignore_errors=True)


def _identity(model: Decoder, source: BuildSource, settings: BuildSettings) -> dict:
    """Everything that changes the bytes of keys, values or index: a resumed build must match it."""
    return {
        "provenance": dataclasses.asdict(source),  # the key of builds before BuildSource was named so
        "settings": dataclasses.asdict(settings),
        "key_layer": model.config.key_description,
        "dim": model.config.n_embd,
        "model_dtype": str(model.dtype),
        "weights": format_of(model),
        "device": model.device.type,
    }


def _check_identity(work: Path, identity: dict, out: Path) -> None:
    path = work / "build.json"
    if not path.exists():
        atomic_write(path, json.dumps(identity, indent=2, sort_keys=True), durable=True)
        return
    before = json.loads(path.read_text())
    if before == identity:
        return
    diffs = _differences(before, identity)
    raise MemlmError(
        f"{out} holds an unfinished build with other settings ({'; '.join(diffs[:3])}); run the same "
        "command as before to finish it, or pass --overwrite to start over"
    )


def _differences(a: dict, b: dict, prefix: str = "") -> list[str]:
    diffs = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key), b.get(key)
        if isinstance(va, dict) and isinstance(vb, dict):
            diffs += _differences(va, vb, f"{prefix}{key}.")
        elif va != vb:
            diffs.append(f"{prefix}{key} was {va!r}, now {vb!r}")
    return diffs


def _stage_tokenize(
    documents: Documents, max_tokens: int | None, tokens_path: Path, offsets_path: Path, documents_path: Path,
    existing: tuple[DocumentRecord, ...], progress: bool,
) -> None:
    """Concatenate the documents' token ids (int32) and their start offsets into two files, and write their
    records (datastore.documents.new_records after `existing`)."""
    docs = documents() if callable(documents) else documents
    chunks: list[np.ndarray] = []
    offsets = [0]
    described: list[tuple[str, int, dict]] = []
    total = 0
    with tqdm(desc="tokenize", unit="tok", file=sys.stderr, disable=not progress) as bar:
        for item in docs:
            if max_tokens is not None and total >= max_tokens:
                break
            doc = as_source(item)
            ids = np.asarray(doc.ids, dtype=np.int64)
            if max_tokens is not None:
                ids = ids[: max_tokens - total]
            if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max):
                raise MemlmError(f"document {len(offsets) - 1} holds token ids outside int32")
            chunks.append(ids.astype(VALUE_DTYPE))
            described.append((doc.fingerprint, int(ids.size), doc.meta))
            total += ids.size
            offsets.append(total)
            bar.update(ids.size)
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype=VALUE_DTYPE)
    write_documents(documents_path, new_records(described, existing))
    write_array(tokens_path, tokens, VALUE_DTYPE)
    write_array(offsets_path, np.asarray(offsets, dtype=np.int64), np.dtype("<i8"))  # renamed last: stage done


def _stage_encode(
    model: Decoder,
    tokens: np.ndarray,
    offsets: np.ndarray,
    settings: BuildSettings,
    boundary_token: int,
    shards_dir: Path,
    progress: bool,
    log: Callable[[str], None],
) -> float:
    """Write the key/value shards that are missing; returns the seconds spent."""
    window = settings.window
    lengths = np.diff(offsets)
    n_shards = planned_shards(offsets, settings.window, settings.shard_batches)
    done = complete_shards(shards_dir)
    if done >= n_shards:
        return 0.0
    done_rows = sum(shard_paths(shards_dir, s).values.stat().st_size // VALUE_DTYPE.itemsize for s in range(done))
    if done:
        log(f"resuming the encoding at shard {done} of {n_shards} ({done_rows} of {tokens.shape[0]} keys done)")

    def docs() -> Iterable[list[int]]:
        for i in range(len(lengths)):
            yield tokens[offsets[i] : offsets[i + 1]].tolist()

    windows_per_shard = settings.shard_batches * window.batch_size
    stream = score_documents(model, docs(), window, boundary_token, with_logprobs=False,
                             skip_batches=done * settings.shard_batches)
    parts: list[ShardArrays] = []
    shard = done
    t0 = time.perf_counter()
    with tqdm(total=int(tokens.shape[0]), initial=done_rows, desc="encode", unit="tok", file=sys.stderr,
              disable=not progress, smoothing=0.1) as bar:
        for scored in stream:
            parts.append(window_arrays(scored))
            bar.update(scored.targets.shape[0])
            if len(parts) == windows_per_shard:
                write_shard(shards_dir, shard, concatenate(parts))
                parts, shard = [], shard + 1
        if parts:
            write_shard(shards_dir, shard, concatenate(parts))
            shard += 1
    if shard != n_shards:
        raise RuntimeError(f"wrote {shard} shards, planned {n_shards}")
    return time.perf_counter() - t0
