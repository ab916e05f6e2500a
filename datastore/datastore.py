"""Datastore.open(dir).search(xq, k): a finished datastore answering the Searcher seam.

Opening checks the files against the manifest (sizes and, unless told not to, checksums). From format 4 a
datastore has generations (datastore.generations): the manifest names each role's file, and the documents
table (`documents()`) marks removed documents, whose entries no search returns (datastore.removal). Whether the
datastore fits the model in use (keys from another model live in another space; values from another
tokenizer are other tokens) is one check over `info()`, memlm.retrieval.compat.check_searcher, the same
for a local datastore and a remote one. Keys and values are read-only memmaps; the index is loaded or
memory-mapped.

Shape legend: Q queries, d key dimension, k neighbours, N datastore entries.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import faiss
import numpy as np
import torch

from datastore import index as index_lib
from datastore.documents import DocumentRecord, read_documents
from datastore.manifest import (
    DOCS_NAME,
    DOCUMENTS_NAME,
    DOCUMENTS_VERSION,
    INDEX_NAME,
    KEYS_NAME,
    POSITIONS_NAME,
    VALUES_NAME,
    Manifest,
)
from datastore.shards import KEY_DTYPE, PROVENANCE_DTYPE, VALUE_DTYPE, read_array
from memlm.errors import MemlmError
from memlm.files import sha256_file
from memlm.model.device import resolve_device
from memlm.retrieval.attribution import SourcedNeighbors, sources_of
from memlm.retrieval.exact import TorchExactSearcher
from memlm.retrieval.searcher import (
    DEFAULT_SEARCH_BACKEND,
    MAX_K,
    MAX_QUERY_ABS,
    SEARCH_BACKENDS,
    Neighbors,
    Provenance,
    Searcher,
    SearcherInfo,
    SearchOptions,
    first_unsearchable_query,
)

RERANK_ROWS = 1 << 22
"""Gathered key elements per exact re-rank step (Q_chunk * k * d float32, 16 MB)."""


class Datastore:
    """A finished datastore directory: manifest, keys (N, d) float16, values (N,) int32, FAISS index, and
    (format 3) each entry's provenance, docs and positions (N,) int32."""

    def __init__(self, path: Path, manifest: Manifest, index: faiss.Index, keys: np.ndarray, values: np.ndarray,
                 provenance: Provenance | None = None, exact: Searcher | None = None,
                 live: index_lib.LiveRows | None = None):
        self.path = path
        self.manifest = manifest
        self.index = index  # CPU index, or its clone on all GPUs
        self.keys = keys  # (N, d) float16 read-only memmap
        self.values = values  # (N,) int32 read-only memmap
        self.entry_provenance = provenance  # docs, positions (N,) int32 read-only memmaps; None in format 2
        self.exact = exact  # the exact torch searcher when opened with backend="torch", else None
        self.live = live  # rows not of removed documents; None when none were removed
        self.on_gpu = _is_gpu(index)
        self._gpu_nprobe = manifest.nprobe
        self._documents: tuple[DocumentRecord, ...] | None = None

    @classmethod
    def open(
        cls,
        directory: str | Path,
        *,
        mmap: bool = False,
        verify: bool = True,
        backend: str = DEFAULT_SEARCH_BACKEND,
        device: str | None = None,
        verified: Manifest | None = None,
    ) -> "Datastore":
        """Open a finished datastore. Whether it fits the model in use is the caller's one check:
        memlm.retrieval.compat.check_searcher(store.info(), ...) (fingerprints, key layer, boundary, windows).

        mmap: memory-map the FAISS index instead of loading it (pages come in as searches touch them).
        backend: "faiss" searches the index (cloned to all GPUs when faiss-gpu and CUDA are present and
            device is not "cpu"); "torch" searches all float16 keys exactly with chunked matmuls on
            `device` (default: cuda when available) -- for datastores that fit in GPU memory.
        verify: check every file's SHA-256 against the manifest (reads all files once).
        verified: the manifest of a generation of this directory opened (and verified) before: files it
            names with the same size and SHA-256 are not read again (a generation's files are never
            rewritten; datastore.live opens each new generation so, reading only what changed).
        """
        path = Path(directory)
        manifest = Manifest.read(path)
        for role in manifest.files:
            entry, file = manifest.files[role], path / manifest.file_name(role)
            if not file.is_file():
                raise MemlmError(f"datastore {path} lacks {file.name}; the datastore is damaged, rebuild it")
            size = file.stat().st_size
            if size != entry.bytes:
                raise MemlmError(
                    f"{file} has {size} bytes, the manifest says {entry.bytes}; the file is damaged, rebuild "
                    "the datastore"
                )
            known = verified is not None and role in verified.files and verified.file_name(role) == file.name \
                and verified.files[role] == entry
            if verify and not known and sha256_file(file, remember=False) != entry.sha256:
                raise MemlmError(
                    f"{file} fails its checksum (sha256 differs from manifest.json); the file is damaged or "
                    "was changed, rebuild the datastore"
                )
        keys = read_array(path / manifest.file_name(KEYS_NAME), KEY_DTYPE, width=manifest.dim)
        values = read_array(path / manifest.file_name(VALUES_NAME), VALUE_DTYPE)
        if keys.shape[0] != manifest.n or values.shape[0] != manifest.n:
            raise MemlmError(f"datastore {path} has {keys.shape[0]} keys and {values.shape[0]} values, "
                             f"the manifest says {manifest.n}; rebuild it")
        provenance = _read_provenance(path, manifest)
        index = index_lib.read_index(path / manifest.file_name(INDEX_NAME), mmap=mmap)
        if index.ntotal != manifest.n or index.d != manifest.dim:
            raise MemlmError(f"the index of {path} holds {index.ntotal} keys of dimension {index.d}, "
                             f"the manifest says {manifest.n} of {manifest.dim}; rebuild it")
        documents = cls.documents_of(path, manifest) if manifest.has_documents else None
        live = _live_rows(documents, provenance)
        if live is not None and backend == "faiss":
            index_lib.check_selectable(index)
        if backend == "faiss":
            if device != "cpu" and not mmap and index_lib.gpu_count() > 0 and live is None:
                # (GPU indexes take no ID selector: a datastore with removed documents searches on the CPU.)
                # GPU indexes are not thread-safe: the retrieval server searches on one worker thread.
                gpu_index = index_lib.to_gpus(index, manifest.n, lambda message: None)
                if gpu_index is not None:
                    index = gpu_index
                    _set_gpu_nprobe(index, manifest.nprobe)
        elif backend not in SEARCH_BACKENDS:
            raise MemlmError(f"search backend must be one of {', '.join(SEARCH_BACKENDS)}, got {backend!r}")
        store = cls(path, manifest, index, keys, values, provenance, live=live)
        store._documents = documents
        if backend == "torch":
            store.exact = store.exact_searcher(device)
        return store

    @property
    def dim(self) -> int:
        """Key dimension d."""
        return self.manifest.dim

    def __len__(self) -> int:
        return self.manifest.n

    def search(self, xq: np.ndarray, k: int, options: SearchOptions | None = None) -> Neighbors:
        """The k nearest keys to each query.

        xq: (Q, d) float32 or float16 (numpy, or a torch tensor on any device).
        options.nprobe: inverted lists to visit (IVF indexes); None: the manifest's default.
        options.exact_rerank: recompute squared L2 from the float16 keys for the retrieved ids and re-sort,
            so distances are exact even with a compressed (PQ/SQ) index (kNN-LM paper: 16.65 -> 16.12 ppl).
        k: 1 to memlm.retrieval.searcher.MAX_K; every query finite with coordinates within MAX_QUERY_ABS.
        Returns Neighbors with (Q, k) arrays; missing neighbours (k > N) have id -1, value -1, distance inf.
        Entries of removed documents (memlm datastore remove) are never returned: FAISS searches carry the
        live rows as an ID selector (self.live), so k counts live entries only and padding starts after them.
        """
        options = options or SearchOptions()
        xq = _as_queries(xq, self.dim)  # (Q, d) float32
        if not 1 <= k <= MAX_K:
            raise MemlmError(f"k must be 1 to {MAX_K}, got {k}")
        bad = first_unsearchable_query(xq)
        if bad is not None:
            raise MemlmError(f"query {bad} has a NaN, an infinity or a coordinate beyond {MAX_QUERY_ABS:g} "
                             "(the keys' float16 range), where float32 distances cannot order neighbours")
        if self.exact is not None:
            return self.exact.search(xq, k)  # exact already: nprobe and re-ranking do not apply
        nprobe = options.nprobe if options.nprobe is not None else self.manifest.nprobe
        if self.on_gpu:
            # GPU clones take no per-call parameters; callers search them from one thread (see open).
            if nprobe != self._gpu_nprobe:
                _set_gpu_nprobe(self.index, nprobe)
                self._gpu_nprobe = nprobe
            params = None
        else:
            params = index_lib.search_params(self.index, nprobe, self.live)
        with index_lib.blas_calls(self.index):  # BLAS from BLAS_MIN_QUERIES queries for a large index
            distances, ids = self.index.search(xq, k, params=params)  # (Q, k), (Q, k)
        missing = ids < 0
        distances = np.where(missing, np.float32(np.inf), distances).astype(np.float32)  # faiss pads with FLT_MAX
        if options.exact_rerank:
            distances, ids = exact_distances_sorted(xq, ids, self.keys)
            missing = ids < 0
        values = np.where(missing, -1, self.values[np.where(missing, 0, ids)]).astype(np.int32)  # (Q, k)
        return Neighbors(distances, ids.astype(np.int64), values)

    def provenance(self, ids: np.ndarray) -> Provenance:
        """Document and next-token position of each entry in `ids` (memlm.retrieval.searcher.Provenance).

        ids: (Q, k) int64 datastore rows, -1 for a missing neighbour (as Neighbors.ids).
        Returns docs and positions (Q, k) int32, -1 where the id is -1.
        """
        if self.entry_provenance is None:
            m = self.manifest
            raise MemlmError(f"datastore {self.path} has format version {m.format_version}, without each entry's "
                             f"document and position; rebuild it for provenance: {_rebuild_command(self.path, m)}")
        ids = np.asarray(ids)
        if ids.ndim != 2 or ids.dtype.kind not in "iu":
            raise MemlmError(f"ids must be a (Q, k) integer array, got shape {ids.shape} of {ids.dtype}")
        bad = (ids < -1) | (ids >= self.manifest.n)  # (Q, k)
        if bad.any():
            raise MemlmError(f"ids must be -1 or rows 0 to {self.manifest.n - 1} of the datastore, got "
                             f"{int(ids[bad][0])}")
        missing = ids < 0  # (Q, k)
        rows = np.where(missing, 0, ids)  # (Q, k)
        docs = np.where(missing, -1, self.entry_provenance.docs[rows]).astype(np.int32)  # (Q, k)
        positions = np.where(missing, -1, self.entry_provenance.positions[rows]).astype(np.int32)  # (Q, k)
        return Provenance(docs, positions)

    def search_generation(self, xq: np.ndarray, k: int, options: SearchOptions | None = None
                          ) -> tuple[Neighbors, int]:
        """search, and this generation (memlm.retrieval.attribution.GenerationSearcher: results that record
        which generation served them). Read-only."""
        return self.search(xq, k, options), self.manifest.generation

    def search_sourced(self, xq: np.ndarray, k: int, options: SearchOptions | None = None) -> SourcedNeighbors:
        """search, plus each neighbour's document from the documents table and this generation
        (memlm.retrieval.attribution.SourcedSearcher: attribution). Read-only."""
        nb = self.search(xq, k, options)  # (Q, k)
        documents, sources = sources_of(self.provenance(nb.ids).docs, self.documents())  # (Q, k), (S,)
        return SourcedNeighbors(nb, documents, sources, self.manifest.generation)

    def documents(self) -> tuple[DocumentRecord, ...]:
        """The documents table (datastore.documents.DocumentRecord): record i is the document whose entries
        have docs.i32 value i, with its doc_id, fingerprint, tokens, metadata and whether it was removed.
        Read from documents.jsonl at the first call (checked against the manifest when opened)."""
        if self._documents is None:
            self._documents = self.documents_of(self.path, self.manifest)
        return self._documents

    @staticmethod
    def documents_of(path: Path, m: Manifest) -> tuple[DocumentRecord, ...]:
        """The documents table of the datastore in `path` whose manifest is `m` (what documents() returns),
        without opening the rest; refused in one line for a format that predates it."""
        if not m.has_documents:
            raise MemlmError(f"datastore {path} has format version {m.format_version}, which predates the documents "
                             f"table (format {DOCUMENTS_VERSION}); rebuild it: {_rebuild_command(path, m)}")
        records = read_documents(Path(path) / m.file_name(DOCUMENTS_NAME))
        if len(records) != m.documents:
            raise MemlmError(f"datastore {path} lists {len(records)} documents, the manifest says {m.documents}; "
                             "the datastore is damaged, rebuild it")
        return records

    def info(self) -> SearcherInfo:
        """The manifest's description of this datastore (the Searcher seam; gRPC GetInfo sends it on)."""
        return _searcher_info(self.manifest)

    def exact_searcher(self, device: str | None = None) -> Searcher:
        """A TorchExactSearcher over a copy of all live float16 keys on `device` (default: cuda when
        available): the ground truth for recall@k, and the torch backend. The caller decides whether
        memlm.retrieval.exact.searcher_bytes fit (on the CPU the searcher lays the keys out again too: float16
        panels where the panel kernel runs, packed float32 chunks elsewhere).
        Rows of removed documents are not copied; ids are datastore rows all the same."""
        if self.exact is not None:
            return self.exact
        torch_device = resolve_device(device or "auto")
        if self.live is None:
            keys = torch.from_numpy(np.array(self.keys)).to(torch_device)  # (N, d) float16, a copy of the memmap
            return TorchExactSearcher(keys, self.values, info=self.info())
        rows = np.flatnonzero(self.live.live)  # (L,) live datastore rows, ascending
        keys = torch.from_numpy(np.asarray(self.keys[rows])).to(torch_device)  # (L, d) float16
        return RowsSearcher(TorchExactSearcher(keys, np.asarray(self.values[rows]), info=self.info()), rows,
                            self.info())


class RowsSearcher:
    """A searcher over some rows of a datastore (its live ones) answering with datastore row ids."""

    def __init__(self, inner: Searcher, rows: np.ndarray, info: SearcherInfo):
        self.inner = inner
        self.rows = rows  # (L,) int64: inner row j is datastore row rows[j]
        self._info = info

    @property
    def dim(self) -> int:
        return self.inner.dim

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def info(self) -> SearcherInfo:
        return self._info

    def search(self, xq: Any, k: int, options: SearchOptions | None = None) -> Neighbors:
        nb = self.inner.search(xq, k, options)
        ids = np.where(nb.ids >= 0, self.rows[np.maximum(nb.ids, 0)], -1)  # (Q, k) datastore rows
        return Neighbors(nb.distances, ids.astype(np.int64), nb.values)


def _live_rows(documents: tuple[DocumentRecord, ...] | None, provenance: Provenance | None
               ) -> index_lib.LiveRows | None:
    """The rows of documents not removed, or None when no document is removed (every row is live)."""
    removed = [r.index for r in documents or () if r.removed]
    if not removed:
        return None
    return index_lib.LiveRows(~np.isin(np.asarray(provenance.docs), removed))  # (N,)


def _rebuild_command(path: Path, m: Manifest) -> str:
    """The command that rebuilds the datastore in `path` with this memlm (for refusals of older formats)."""
    return (f"memlm datastore build --model {m.model_name} --data DATA [--split SPLIT] --context {m.context} "
            f"--stride {m.stride} --out {path} --overwrite (its corpus was {m.corpus})")


def _read_provenance(path: Path, manifest: Manifest) -> Provenance | None:
    """docs and positions (N,) int32 memmaps of a format-3 datastore; None for format 2 (no provenance)."""
    if not manifest.has_provenance:
        return None
    docs = read_array(path / manifest.file_name(DOCS_NAME), PROVENANCE_DTYPE)  # (N,)
    positions = read_array(path / manifest.file_name(POSITIONS_NAME), PROVENANCE_DTYPE)  # (N,)
    if docs.shape[0] != manifest.n or positions.shape[0] != manifest.n:
        raise MemlmError(f"datastore {path} has {docs.shape[0]} document ids and {positions.shape[0]} positions, "
                         f"the manifest says {manifest.n}; rebuild it")
    return Provenance(docs, positions)


def _searcher_info(m: Manifest) -> SearcherInfo:
    return SearcherInfo(
        n=m.n, dim=m.dim, index=m.index_factory, metric=m.metric, nprobe=m.nprobe, key_layer=m.key_layer,
        model_name=m.model_name, model_fingerprint=m.model_fingerprint,
        tokenizer_fingerprint=m.tokenizer_fingerprint, corpus=m.corpus, corpus_fingerprint=m.corpus_fingerprint,
        context=m.context, stride=m.stride, boundary_token=m.boundary_token, sink_tokens=m.sink_tokens,
        weights=m.weights,
    )


def _is_gpu(index: faiss.Index) -> bool:
    """True for an index living on GPUs (a GpuIndex, or replicas/shards of them)."""
    return "Gpu" in type(index).__name__ or isinstance(index, (faiss.IndexReplicas, faiss.IndexShards))


def _set_gpu_nprobe(index: faiss.Index, nprobe: int | None) -> None:
    if nprobe is not None:
        faiss.GpuParameterSpace().set_index_parameter(index, "nprobe", int(nprobe))


def exact_distances_sorted(xq: np.ndarray, ids: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exact squared L2 between each query and its retrieved keys, rows re-sorted by it.

    xq: (Q, d) float32; ids: (Q, k) int64 (-1 = missing); keys: (N, d) float16.
    Returns distances (Q, k) float32 (inf where missing) and ids (Q, k) in the new order.
    """
    Q, k = ids.shape
    d = xq.shape[1]
    out_d = np.empty((Q, k), dtype=np.float32)
    out_i = np.empty_like(ids)
    step = max(1, RERANK_ROWS // max(1, k * d))
    for lo in range(0, Q, step):
        sl = slice(lo, min(Q, lo + step))
        block_ids = ids[sl]  # (q, k)
        missing = block_ids < 0
        flat = np.where(missing, 0, block_ids).reshape(-1)  # (q*k,)
        order = np.argsort(flat, kind="stable")  # sorted gather: sequential-ish reads of the memmap
        gathered = np.empty((flat.size, d), dtype=np.float32)  # (q*k, d)
        gathered[order] = keys[flat[order]]
        diff = gathered.reshape(block_ids.shape[0], k, d) - xq[sl, None, :]  # (q, k, d)
        dist = np.einsum("qkd,qkd->qk", diff, diff)  # (q, k) float32
        dist[missing] = np.inf
        perm = np.argsort(dist, axis=1, kind="stable")  # (q, k)
        out_d[sl] = np.take_along_axis(dist, perm, axis=1)
        out_i[sl] = np.take_along_axis(block_ids, perm, axis=1)
    return out_d, out_i


def _as_queries(xq: Any, dim: int) -> np.ndarray:
    if isinstance(xq, torch.Tensor):  # on any device
        xq = xq.detach().float().cpu().numpy()
    xq = np.asarray(xq)
    if xq.ndim != 2 or xq.shape[1] != dim:
        raise MemlmError(f"queries must have shape (Q, {dim}), got {xq.shape}")
    if xq.dtype not in (np.float32, np.float16):
        raise MemlmError(f"queries must be float32 or float16, got {xq.dtype}")
    return np.ascontiguousarray(xq, dtype=np.float32)
