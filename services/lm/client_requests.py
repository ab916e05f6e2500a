"""The options of a LanguageModelService request as a client builds them (services.lm.client): memory,
kNN-LM (fewer searches included) and SPALM's search, each turned into its proto message."""

from __future__ import annotations

from dataclasses import dataclass

from memlm.v1 import language_model_pb2 as lm_pb2


@dataclass(frozen=True)
class MemoryRequest:
    """Segment and memory sizes for memory modes "xl", "compressive", "memorizing" and "spalm", in tokens; None fields take
    the server's defaults."""

    segment_tokens: int | None = None
    """Segment length (Score) or prompt-encoding segment length (Generate), 1 <= it <= the context."""
    memory_tokens: int | None = None
    """Memory length: states per layer kept from earlier segments."""
    sink_tokens: int | None = None
    """The sequence's first tokens that stay attended for the whole sequence (attention sinks)."""
    knn_mem_size: int | None = None
    """"memorizing": kNN memory entries per (sequence, kv head), the oldest evicted beyond."""
    knn_top_k: int | None = None
    """"memorizing": (key, value) pairs retrieved per query token and head."""
    compressed_memory_tokens: int | None = None
    """"compressive": compressed-memory slots per layer."""
    compression_rate: int | None = None
    """"compressive": states pooled into one compressed slot."""

    def to_proto(self) -> lm_pb2.MemoryOptions:
        o = lm_pb2.MemoryOptions()
        for name in ("segment_tokens", "memory_tokens", "sink_tokens", "knn_mem_size", "knn_top_k",
                     "compressed_memory_tokens", "compression_rate"):
            value = getattr(self, name)
            if value is not None:
                setattr(o, name, value)
        return o


@dataclass(frozen=True)
class KnnRequest:
    """kNN-LM options of one request; None fields take the server's defaults."""

    lmbda: float | None = None
    """Interpolation weight of p_kNN in [0, 1]."""
    temperature: float | None = None
    """Softmax temperature over negative squared distances (> 0)."""
    k: int | None = None
    """Neighbours per token."""
    nprobe: int | None = None
    """IVF lists probed per search."""
    attribution_top_n: int = 0
    """Documents per token to attribute its probability to (ScoredToken / TextDelta attribution), 0: none."""
    adaptive_threshold: float | None = None
    """Adaptive retrieval: search only where the server's gate scores at least this (Score, Generate)."""
    adaptive_fraction: float | None = None
    """Adaptive retrieval by the fraction of searches to save, in [0, 1) (instead of adaptive_threshold)."""
    pointers: bool = False
    """RetoMaton pointers: search only when fewer than min_pointers survive (Score, and Generate on the engine)."""
    min_pointers: int | None = None
    """With pointers: the minimum (None: the server's, 1)."""

    def to_proto(self) -> lm_pb2.KnnOptions:
        o = lm_pb2.KnnOptions(enabled=True, attribution_top_n=self.attribution_top_n, pointers=self.pointers)
        for name in ("adaptive_threshold", "adaptive_fraction", "min_pointers"):
            if getattr(self, name) is not None:
                setattr(o, name, getattr(self, name))
        if self.lmbda is not None:
            o.lambda_weight = self.lmbda
        if self.temperature is not None:
            o.temperature = self.temperature
        if self.k is not None:
            o.k = self.k
        if self.nprobe is not None:
            o.nprobe = self.nprobe
        return o


@dataclass(frozen=True)
class SpalmRequest:
    """Memory mode "spalm"'s datastore search for one request, sent in KnnOptions with enabled false (SPALM
    mixes the retrieved tokens by its learned gate, not by kNN-LM's lambda); None fields: the server's."""

    k: int | None = None
    """Neighbours per token (the server's default: memlm.memory.spalm.SPALM_DEFAULT_K)."""
    nprobe: int | None = None
    """IVF lists probed per search."""

    def to_proto(self) -> lm_pb2.KnnOptions:
        o = lm_pb2.KnnOptions(enabled=False)
        if self.k is not None:
            o.k = self.k
        if self.nprobe is not None:
            o.nprobe = self.nprobe
        return o
