"""Segment memories for the decoder: Transformer-XL (Dai et al. 2019), Compressive (Rae et al. 2019) and
Memorizing (Wu et al. 2022: the XL memory plus, at one layer, kNN attention over a large FIFO memory of
the document's earlier keys and values; memlm.memory.memorizing).

Both are `DecoderState`s (memlm.model.decoder): immutable values that the caller passes into
`Decoder.forward(idx, state)` and gets back, updated, in `LMOutput.state`. Nothing is kept in modules.

Per layer, the decoder attends to [sink tokens; compressed memory; memory; segment]:
- sink tokens: the first `sink_tokens` states of each document stay for the whole document. Pretrained
  models park much of their attention on the first tokens ("attention sinks", Xiao et al. 2023,
  StreamingLLM); once a sliding memory drops them perplexity collapses (56.2 without sinks
  vs 35.9 with 4 sinks on SmolLM2, segment 128, memory 1024). They keep their true positions.
- memory: a FIFO of the last `mem_len` states of earlier segments (stop-gradient: stored detached,
  so training is truncated backpropagation through time).
- compressed memory (CompressiveMemory only): states pushed out of the memory are compressed at rate c
  (max-pool, mean-pool or a learned Conv1d) into a second FIFO of `cmem_len` slots instead of dropped.

Keys are stored un-rotated with absolute positions (LayerMemory); the decoder applies rotary at
attention time relative to the segment start, so positions that continue across segments only ever
enter through relative distances.

Batch rows are independent streams: each row has its own positions and its own valid slots, and
`reset_rows(mask)` starts a new document in some rows only (their slots are invalidated, their
positions restart at 0). Full buffers evict their oldest states (FIFO); nothing ever resets by itself.

Shape legend:
    B batch rows, T segment tokens, S memory slots, E evicted states, nkv key/value heads,
    nh query heads, hs head size, D = nkv * hs, c compression rate, L layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MemoryKind = Literal["none", "xl", "compressive", "memorizing", "spalm"]
CompressFn = Literal["max", "mean", "conv"]
MEMORY_KINDS: tuple[str, ...] = ("none", "xl", "compressive", "memorizing", "spalm")
COMPRESS_FNS: tuple[str, ...] = ("max", "mean", "conv")
KNN_BACKENDS: tuple[str, ...] = ("auto", "exact", "faiss", "ivf", "service")
EXACT_MAX_ENTRIES = 262144
"""Largest kNN memory (entries per stream) that backend "auto" serves with the exact torch backend; FAISS
beyond. Wu et al. 2022 report gains up to 262K tokens; one stream of that size is 262144 x hs float16 keys
(32 MB at hs 64) and an exact scan of it per query block is still a few matmuls."""


@dataclass(frozen=True)
class MemoryConfig:
    """Which memory a segment-recurrent run carries, its sizes (slot counts are per layer) and its segment."""

    kind: str = "xl"
    """"none" (each segment alone), "xl" (Transformer-XL), "compressive" (Compressive Transformer) or
    "memorizing" (the XL memory in every layer plus kNN attention at `memorizing_layer`) or "spalm" (the
    XL memory in every layer plus the SPALM head over a kNN datastore, memlm.memory.spalm: the decoder's
    state is the XL memory; the head and the datastore are passed beside it)."""
    mem_len: int = 1024
    """Memory slots: the last mem_len states of earlier segments."""
    cmem_len: int = 0
    """Compressed-memory slots (compressive only)."""
    compress_rate: int = 4
    """c: states per compressed slot (compressive only)."""
    compress_fn: str = "mean"
    """"max", "mean" (parameter-free pooling over time) or "conv" (learned Conv1d, see Compressor)."""
    sink_tokens: int = 4
    """The first sink_tokens states of each document stay in memory for the whole document. The one
    default for `memlm train`, `eval` and `serve lm`, so a model is evaluated and served with its training sinks."""
    segment: int = 128
    """Tokens per segment T: the unit the memory advances by (and of truncated backpropagation in training)."""
    knn_layer: int | None = None
    """Memorizing only: the 0-based layer with kNN attention; None: about three quarters up
    (`memorizing_layer`, the one home of that default)."""
    knn_mem_size: int = 65536
    """Memorizing only: kNN memory entries per (batch row, kv head) stream; the oldest are evicted beyond."""
    knn_top_k: int = 32
    """Memorizing only: retrieved (key, value) pairs per query (Wu et al. 2022 use 32)."""
    knn_backend: str = "auto"
    """Memorizing only: "exact" (torch on the model's device), "faiss", "ivf" (a FAISS inverted file at any
    size: approximate, the CPU's fast path), "service" (the retrieval service) or "auto"
    (`resolve_knn_backend`: exact up to EXACT_MAX_ENTRIES entries per stream, FAISS beyond)."""

    def __post_init__(self) -> None:
        if self.kind not in MEMORY_KINDS:
            raise ValueError(f"memory must be one of {MEMORY_KINDS}, got {self.kind!r}")
        if self.compress_fn not in COMPRESS_FNS:
            raise ValueError(f"compress_fn must be one of {COMPRESS_FNS}, got {self.compress_fn!r}")
        if self.mem_len < 0 or self.cmem_len < 0 or self.sink_tokens < 0:
            raise ValueError("mem_len, cmem_len and sink_tokens must be >= 0")
        if self.compress_rate < 1:
            raise ValueError(f"compress_rate must be >= 1, got {self.compress_rate}")
        if self.segment < 1:
            raise ValueError(f"segment must be >= 1, got {self.segment}")
        if self.knn_layer is not None and self.knn_layer < 0:
            raise ValueError(f"knn_layer must be >= 0, got {self.knn_layer}")
        if self.knn_mem_size < 1 or self.knn_top_k < 1:
            raise ValueError(f"knn_mem_size and knn_top_k must be >= 1, got {self.knn_mem_size}, {self.knn_top_k}")
        if self.knn_backend not in KNN_BACKENDS:
            raise ValueError(f"knn_backend must be one of {KNN_BACKENDS}, got {self.knn_backend!r}")

    @property
    def memory_slots(self) -> int:
        """Slots each query attends to besides its own segment (the attention cost of the memory; for
        "memorizing" the local slots of every layer, without the knn_top_k retrieved at one layer)."""
        if self.kind == "none":
            return 0
        return self.sink_tokens + self.mem_len + (self.cmem_len if self.kind == "compressive" else 0)

    @property
    def history_tokens(self) -> int:
        """Earlier tokens one layer's memory summarises (compressed slots cover c tokens each)."""
        if self.kind == "none":
            return 0
        compressed = self.cmem_len * self.compress_rate if self.kind == "compressive" else 0
        return self.sink_tokens + self.mem_len + compressed


def memorizing_layer(memory: MemoryConfig, n_layer: int) -> int:
    """The layer with kNN attention: memory.knn_layer, or about three quarters up (Wu et al. 2022 put it
    near the top; 30 layers -> 22, 0-based). Refuses a layer the model does not have."""
    layer = memory.knn_layer if memory.knn_layer is not None else (3 * n_layer) // 4
    if not 0 <= layer < n_layer:
        raise ValueError(f"knn_layer {layer} out of range for a model of {n_layer} layers")
    return layer


def auto_knn_backend(capacity: int) -> str:
    """Backend "auto" for a memory of `capacity` entries per stream: "exact" up to EXACT_MAX_ENTRIES, "faiss" beyond."""
    return "exact" if capacity <= EXACT_MAX_ENTRIES else "faiss"


def resolve_knn_backend(memory: MemoryConfig) -> str:
    """The backend a memorizing memory uses: memory.knn_backend, with "auto" decided by its size."""
    if memory.knn_backend == "auto":
        return auto_knn_backend(memory.knn_mem_size)
    return memory.knn_backend
