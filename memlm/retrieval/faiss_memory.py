"""A FAISS key/value memory: the KeyValueMemory seam (memlm.retrieval.memory_store) with one FAISS index
per stream, for memories beyond what the exact torch backend serves (issue 10).

Vectors live twice: in the FAISS index (what search scans) and in a RingBuffer (what search returns:
the stored keys and values of the top-k, gathered once). Each entry's FAISS id is its entry number in
its stream since the last clear, so FIFO eviction is `remove_ids` of the id range below
total - capacity, and the id modulo capacity is its ring-buffer slot. A clear resets the stream's index.

CPU FAISS only, on purpose: FIFO eviction needs `remove_ids`, which FAISS's GPU indexes do not
implement (GpuIndexFlat and GpuIndexIVF* refuse it), and copying a CPU index to the GPU after every
segment would cost more than the search. On a GPU the exact torch backend (memlm.retrieval.memory_store.
ExactMemory) is the fast one; faiss-gpu cannot be installed on the project's GPU machine anyway
(DESIGN.md). `faiss.get_num_gpus()` is reported by `gpu_note()` so results say which one ran.

Shape legend: S streams, T entries appended per stream, Q queries per stream, k neighbours, d key
dimension, dv value dimension, W entries written.
"""

from __future__ import annotations

import faiss
import numpy as np
import torch

from memlm.retrieval.memory_store import (
    Retrieved,
    RingBuffer,
    check_entries,
    check_queries,
)

FAISS_FACTORY = "IDMap,Flat"
"""The index of every stream: exact inner product over float32 vectors, with explicit ids (the entry
numbers) so that the oldest can be removed by id range."""


def gpu_note() -> str:
    """Why this memory searches on the CPU even where FAISS sees GPUs."""
    n = faiss.get_num_gpus()
    if n == 0:
        return "faiss-cpu"
    return f"faiss-cpu ({n} GPU(s) visible to FAISS, unused: GPU indexes cannot remove_ids for FIFO eviction)"


class FaissMemory:
    """Per-stream FAISS inner-product indexes with FIFO eviction by id; answers KeyValueMemory."""

    def __init__(self, streams: int, dim: int, value_dim: int, capacity: int, device: torch.device | str = "cpu") -> None:
        """device: where search results are returned (the model's device); the vectors stay on the CPU."""
        self.streams, self.dim, self.value_dim, self.capacity = streams, dim, value_dim, capacity
        self.device = torch.device(device)
        self.buffer = RingBuffer(streams, dim, value_dim, capacity, "cpu", torch.float32)
        self.indexes = [faiss.index_factory(dim, FAISS_FACTORY, faiss.METRIC_INNER_PRODUCT) for _ in range(streams)]
        self.closed = False

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("this key/value memory was closed")

    def append(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> None:
        self._check_open()
        check_entries(self, keys, values, valid)
        s_idx, ids = self.buffer.append(keys, values, valid)  # (W,) each, time order within a stream
        slots = ids % self.capacity  # (W,)
        written = self.buffer.keys[s_idx, slots].numpy()  # (W, d) float32, as stored
        s_np, ids_np = s_idx.numpy(), ids.numpy()
        total = self.buffer.total.numpy()
        for s in np.unique(s_np):
            rows = s_np == s
            index = self.indexes[s]
            index.add_with_ids(np.ascontiguousarray(written[rows]), ids_np[rows])
            oldest = int(total[s]) - self.capacity  # entry numbers below it are evicted
            if oldest > 0:
                index.remove_ids(faiss.IDSelectorRange(0, oldest))

    @torch.no_grad()
    def search(self, queries: torch.Tensor, k: int) -> Retrieved:
        self._check_open()
        check_queries(self, queries, k)
        S, Q, _ = queries.shape
        xq = queries.detach().float().cpu().numpy()  # (S, Q, d)
        ids = np.full((S, Q, k), -1, dtype=np.int64)  # (S, Q, k)
        for s, index in enumerate(self.indexes):
            if index.ntotal > 0:
                _, ids[s, :, : min(k, index.ntotal)] = index.search(np.ascontiguousarray(xq[s]), min(k, index.ntotal))
        ids_t = torch.from_numpy(ids)  # (S, Q, k)
        valid = ids_t >= 0  # (S, Q, k)
        slots = torch.where(valid, ids_t % self.capacity, torch.zeros_like(ids_t))  # (S, Q, k)
        keys, values = self.buffer.gather(slots, queries.dtype)  # (S, Q, k, d), (S, Q, k, dv)
        dev = queries.device
        return Retrieved(keys.to(dev), values.to(dev), valid.to(dev))

    def clear(self, streams: torch.Tensor) -> None:
        self._check_open()
        if tuple(streams.shape) != (self.streams,):
            raise ValueError(f"streams must have shape ({self.streams},), got {tuple(streams.shape)}")
        self.buffer.clear(streams)
        for s in streams.cpu().nonzero()[:, 0].tolist():
            self.indexes[s].reset()

    def sizes(self) -> torch.Tensor:
        return self.buffer.sizes().cpu()

    def close(self) -> None:
        self.closed = True
        self.indexes = []
        self.buffer = RingBuffer(1, 1, 1, 1, "cpu", torch.float32)

    def state_dict(self) -> dict:
        """The ring buffer's contents; the indexes are rebuilt from it on load (same entries, same ids)."""
        return {"backend": "faiss", **self.buffer.state_dict()}

    def load_state_dict(self, d: dict) -> None:
        if d.get("backend") != "faiss":
            raise ValueError(f"not a FAISS key/value memory's state: backend {d.get('backend')!r}")
        self.buffer.load_state_dict(d)
        total = self.buffer.total.numpy()
        for s, index in enumerate(self.indexes):
            index.reset()
            n = min(int(total[s]), self.capacity)
            ids = np.arange(int(total[s]) - n, int(total[s]), dtype=np.int64)  # (n,) the live entry numbers
            if n:
                index.add_with_ids(np.ascontiguousarray(self.buffer.keys[s, ids % self.capacity].numpy()), ids)
