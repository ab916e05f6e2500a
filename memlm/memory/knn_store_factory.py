"""The one way to open a kNN key/value memory (memlm.memory.knn_store.KeyValueMemory) by backend name.

A module of its own so that the backends (memory_store's ExactMemory, faiss_memory's FaissMemory, which
builds on memory_store) import one way only.
"""

from __future__ import annotations

import torch

from memlm.model.memory_config import KNN_BACKENDS, auto_knn_backend
from memlm.memory.knn_store_faiss import FaissMemory, ivf_factory
from memlm.memory.knn_store import (
    ExactMemory,
    KeyValueMemory,
    KeyValueMemoryFactory,
)


def open_key_value_memory(
    backend: str, streams: int, dim: int, value_dim: int, capacity: int, device: torch.device | str,
    service: KeyValueMemoryFactory | None = None,
) -> KeyValueMemory:
    """The one way to open a kNN memory: backend "exact", "faiss", "ivf", "service" (needs `service`, the factory
    the CLI or a server passes in) or "auto" (memlm.model.memory_config.auto_knn_backend decides by capacity)."""
    if backend not in KNN_BACKENDS:
        raise ValueError(f"knn backend must be one of {KNN_BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = auto_knn_backend(capacity)
    if backend == "exact":
        return ExactMemory(streams, dim, value_dim, capacity, device)
    if backend == "faiss":
        return FaissMemory(streams, dim, value_dim, capacity, device)
    if backend == "ivf":  # approximate at any size (an exact 64K scan costs more than a step allows)
        return FaissMemory(streams, dim, value_dim, capacity, device, factory=ivf_factory(capacity))
    if service is None:
        raise ValueError("knn backend 'service' needs a memory factory from the retrieval service client")
    return service(streams, dim, value_dim, capacity)
