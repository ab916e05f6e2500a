"""The Searcher seam: what every nearest-neighbour backend answers.

The in-process `datastore.Datastore`, the gRPC retrieval client and the shard router all implement
`Searcher`; the model library above them does not know which one it has. The seam says everything it
takes: per-call options travel in a typed `SearchOptions` (never as **kwargs), and `info()` describes
the datastore behind it (size, index, the model and the text layout its keys were made with), so that
callers check compatibility the same way whether the datastore is local or remote.

Shape legend: Q queries, d key dimension, k neighbours, N datastore entries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    import torch


MAX_K = 4096
"""Most neighbours one search may ask for: results are (Q, k) arrays allocated before searching, so a
larger k (e.g. 10**9: 16 TB for 1,000 queries) is refused up front."""

SEARCH_BACKENDS = ("faiss", "torch")
"""How a datastore searches (datastore.Datastore.open's backend): its FAISS index (cloned to the GPUs when faiss-gpu
sees CUDA), or exact chunked matmuls over all its float16 keys on a torch device (memlm.retrieval.exact), for a
datastore that fits in the device's memory: the search then runs where the model runs."""
DEFAULT_SEARCH_BACKEND = SEARCH_BACKENDS[0]

MAX_QUERY_ABS = 65504.0
"""Largest |coordinate| of a query: float16's largest finite value, the range of the stored keys. Beyond
it float32 squared L2 stops ordering neighbours (measured with FAISS: at |x| ~ 1e15 every distance
rounds to |x|^2 and the order is arbitrary; from |x| ~ 1e19 |x|^2 overflows and FAISS returns id -1,
"no neighbours"), so such queries are refused rather than answered wrongly."""


def first_unsearchable_query(xq: np.ndarray) -> int | None:
    """Row of the first query (Q, d) with a NaN, an infinity or a coordinate beyond MAX_QUERY_ABS; None
    when every row can be searched."""
    bad = ~(np.abs(xq) <= MAX_QUERY_ABS)  # (Q, d); NaN compares False, so it is bad too
    rows = np.flatnonzero(bad.any(axis=1))
    return int(rows[0]) if rows.size else None


class Neighbors(NamedTuple):
    """Result of `Searcher.search`. Rows are sorted by increasing distance.

    Missing neighbours (fewer than k entries) have id -1, value -1 and distance +inf.
    """

    distances: np.ndarray  # (Q, k) float32, squared L2 (or negative inner product) -- smaller is nearer
    ids: np.ndarray  # (Q, k) int64, row numbers in the datastore
    values: np.ndarray  # (Q, k) int32, the next token stored with each key


class Provenance(NamedTuple):
    """Where retrieved datastore entries come from (`datastore.Datastore.provenance(ids)`), for the SPALM
    leakage guard (memlm.retrieval.leakage), RetoMaton successors and attribution (DESIGN.md, provenance).

    A position counts the document boundary token as position 0: the document's tokens t_0, t_1, ...
    are at positions 1, 2, ..., i.e. a position is the index in the model's input [boundary, *document].
    An entry's position is that of its next token (its value), so the entry made from the query at input
    index i has position i + 1. Missing neighbours (id -1) have document -1 and position -1.
    """

    docs: np.ndarray  # (Q, k) int32, index of the entry's document in the datastore build's corpus order
    positions: np.ndarray  # (Q, k) int32, position of the entry's next token in its document (boundary = 0)


@dataclass(frozen=True)
class SearchOptions:
    """Per-call search settings. Every Searcher accepts all of them; an option that does not apply to its
    index (nprobe on a flat index, re-ranking on an exact search) changes nothing."""

    nprobe: int | None = None
    """Inverted lists visited per query (IVF indexes); None: the datastore's default (its manifest)."""
    exact_rerank: bool = False
    """Recompute exact squared L2 distances from the stored float16 keys for the candidates and re-sort."""

    def __post_init__(self) -> None:
        if self.nprobe is not None and self.nprobe < 1:
            raise ValueError(f"nprobe must be at least 1, got {self.nprobe}")


@dataclass(frozen=True)
class SearcherInfo:
    """What a datastore holds and how its keys were made; enough for a caller to check it matches its
    model and its text layout. Local datastores fill it from manifest.json, remote ones from GetInfo."""

    n: int
    """Number of (key, next token) entries N."""
    dim: int
    """Key dimension d."""
    index: str
    """FAISS factory string ("Flat", "IVF1024,PQ64", ...) or "exact" for the torch backend."""
    metric: str
    """"l2": distances are squared Euclidean distances."""
    nprobe: int
    """Default inverted lists visited per query (1 for flat indexes)."""
    key_layer: str
    """Which activation the keys are (ModelConfig.key_description, e.g. "ffn_input.29")."""
    model_name: str
    """The model the keys came from, as the builder named it."""
    model_fingerprint: str
    """Fingerprint of those weights; queries must come from the same model."""
    tokenizer_fingerprint: str
    """Fingerprint of the tokenizer; values are its token ids."""
    corpus: str
    """Corpus spec and split the datastore was built from."""
    corpus_fingerprint: str
    """Fingerprint of that corpus content and split (tuning/evaluation data must not overlap it)."""
    context: int
    """Window length (tokens) the keys were computed with."""
    stride: int
    """Window stride the keys were computed with."""
    boundary_token: int
    """Token prepended to every document when the keys were made; queries must use the same (-1: not known,
    as for a TorchExactSearcher given only keys; such a searcher fails memlm.retrieval.compat.check_searcher)."""
    sink_tokens: int
    """Attention-sink tokens kept when the keys were made (0: plain sliding windows, what the builder does)."""
    weights: str = "float32"
    """Weight format of the model when the keys were made (memlm.model.weight_formats.format_of); datastores
    that predate the record were float32."""


@runtime_checkable
class Searcher(Protocol):
    """Anything that finds the k nearest datastore keys to a batch of queries."""

    @property
    def dim(self) -> int:
        """Key dimension d."""
        ...

    def search(self, xq: np.ndarray, k: int, options: SearchOptions | None = None) -> Neighbors:
        """xq: (Q, d) float32 or float16 queries -> Neighbors with (Q, k) arrays; options None = defaults."""
        ...

    def info(self) -> SearcherInfo:
        """The datastore behind this searcher."""
        ...


def search_keys(searcher: Searcher, keys: "torch.Tensor", k: int, options: SearchOptions | None) -> Neighbors:
    """The one way the model library turns kNN keys into a search: keys (Q, d) of any float dtype on any
    device -> float32 numpy (what every backend and the wire accept) -> searcher.search(xq, k, options)."""
    xq = keys.detach().float().cpu().numpy()  # (Q, d) float32
    return searcher.search(xq, k, options)
