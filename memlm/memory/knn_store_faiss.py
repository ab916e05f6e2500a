"""A FAISS key/value memory: the KeyValueMemory seam (memlm.memory.knn_store) with one FAISS index
per stream, for memories beyond what the exact torch backend serves.

Vectors live twice: in the FAISS index (what search scans) and in a RingBuffer (what search returns:
the stored keys and values of the top-k, gathered once). Each entry's FAISS id is its entry number in
its stream since the last clear, so FIFO eviction is `remove_ids` of the id range below
total - capacity, and the id modulo capacity is its ring-buffer slot. A clear resets the stream's index.
Flat indexes (the default up to EXACT_MAX_ENTRIES) are exact; beyond, each stream gets an inverted file
trained on its own entries (`default_factory`, FaissMemory).

CPU FAISS only, on purpose: FIFO eviction needs `remove_ids`, which FAISS's GPU indexes do not
implement (facebookresearch/faiss issues #584 and #1818: "the remove functions are not implemented for
GPU"), and copying a CPU index to the GPU and back around every segment's eviction would cost more
than the search. On a GPU the exact torch backend (memlm.memory.knn_store.
ExactMemory) is the fast one; faiss-gpu cannot be installed on the project's GPU machine anyway
(DESIGN.md). `faiss.get_num_gpus()` is reported by `gpu_note()` so results say which one ran.

Shape legend: S streams, T entries appended per stream, Q queries per stream, k neighbours, d key
dimension, dv value dimension, W entries written.
"""

from __future__ import annotations

import math

import faiss
import numpy as np
import torch

from memlm.model.memory_config import EXACT_MAX_ENTRIES
from memlm.memory.knn_store import (
    Retrieved,
    RingBuffer,
    check_entries,
    check_queries,
    faiss_top_k,
)

FLAT_FACTORY = "IDMap,Flat"
"""Exact inner product over float32 vectors, with explicit ids (the entry numbers) so that the oldest
can be removed by id range."""
IVF_NPROBE = 32
"""Inverted lists visited per query (of about 4 * sqrt(capacity)): the recall / speed trade-off."""
TRAIN_POINTS_PER_LIST = 39
"""Entries per inverted list a stream must hold before its quantizer is trained (FAISS warns below 39);
until then that stream is searched exactly over its ring buffer."""


def default_factory(capacity: int) -> str:
    """The FAISS index of each stream of a memory of `capacity` entries: flat up to EXACT_MAX_ENTRIES (where
    "auto" picks the exact backend anyway; a forced "faiss" gets an exact flat scan), `ivf_factory` beyond."""
    return FLAT_FACTORY if capacity <= EXACT_MAX_ENTRIES else ivf_factory(capacity)


def ivf_factory(capacity: int) -> str:
    """An inverted file for `capacity` entries (backend "ivf" at any size, "faiss" beyond EXACT_MAX_ENTRIES):
    "IVF<nlist>,Flat", nlist the power of two nearest 4 * sqrt(capacity) (64K entries: 1024 lists, 1M: 4096),
    FAISS's rule of thumb of 4-16 sqrt(N) lists; a search scans nprobe of them besides the nlist centroids."""
    nlist = 2 ** round(math.log2(4 * math.sqrt(capacity)))
    return f"IVF{nlist},Flat"


def gpu_note() -> str:
    """Why this memory searches on the CPU even where FAISS sees GPUs."""
    n = faiss.get_num_gpus()
    if n == 0:
        return "faiss-cpu"
    return f"faiss-cpu ({n} GPU(s) visible to FAISS, unused: GPU indexes cannot remove_ids for FIFO eviction)"


class FaissMemory:
    """Per-stream FAISS inner-product indexes with FIFO eviction by id; answers KeyValueMemory.

    factory: the index of every stream (default `default_factory(capacity)`). An index that needs
    training (IVF) is trained on its stream's own entries once it holds TRAIN_POINTS_PER_LIST per list
    (all of its live entries are then added); until then, and for capacities too small to ever train,
    the stream is searched exactly over its ring buffer. A clear empties the index and keeps its trained
    quantizer (the next document's keys are unit vectors of the same layer and head)."""

    def __init__(self, streams: int, dim: int, value_dim: int, capacity: int, device: torch.device | str = "cpu",
                 *, factory: str | None = None, nprobe: int = IVF_NPROBE) -> None:
        """device: where search results are returned (the model's device); the vectors stay on the CPU."""
        self.streams, self.dim, self.value_dim, self.capacity = streams, dim, value_dim, capacity
        self.device = torch.device(device)
        self.factory = factory or default_factory(capacity)
        self.nprobe = nprobe
        self.buffer = RingBuffer(streams, dim, value_dim, capacity, "cpu", torch.float32)
        self.indexes = [self._new_index() for _ in range(streams)]
        ivf = faiss.try_extract_index_ivf(self.indexes[0])
        self.train_size = 0 if ivf is None else TRAIN_POINTS_PER_LIST * ivf.nlist
        self.closed = False

    def _new_index(self, saved: torch.Tensor | None = None) -> faiss.Index:
        """A fresh index of the factory, or the one serialized in `saved` (state_dict's, uint8)."""
        if saved is None:
            index = faiss.index_factory(self.dim, self.factory, faiss.METRIC_INNER_PRODUCT)
        else:
            index = faiss.deserialize_index(np.ascontiguousarray(saved.cpu().numpy(), dtype=np.uint8))
        ivf = faiss.try_extract_index_ivf(index)
        if ivf is not None:
            ivf.nprobe = self.nprobe
        return index

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("this key/value memory was closed")

    def _live_ids(self, s: int) -> np.ndarray:
        total = int(self.buffer.total[s])
        return np.arange(max(0, total - self.capacity), total, dtype=np.int64)  # (n,) live entry numbers

    def _add(self, s: int, ids: np.ndarray) -> None:
        """Index stream s's entries `ids` (entry numbers, live in the buffer), then evict below the FIFO."""
        index = self.indexes[s]
        if not index.is_trained:
            if int(self.buffer.sizes()[s]) < self.train_size:
                return  # searched exactly over the buffer until it can train
            ids = self._live_ids(s)
            index.train(np.ascontiguousarray(self.buffer.keys[s, ids % self.capacity].numpy()))
        index.add_with_ids(np.ascontiguousarray(self.buffer.keys[s, ids % self.capacity].numpy()), ids)
        oldest = int(self.buffer.total[s]) - self.capacity  # entry numbers below it are evicted
        if oldest > 0:
            index.remove_ids(faiss.IDSelectorRange(0, oldest))

    def append(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> None:
        self._check_open()
        check_entries(self, keys, values, valid)
        s_idx, ids = self.buffer.append(keys, values, valid)  # (W,) each, time order within a stream
        s_np, ids_np = s_idx.numpy(), ids.numpy()
        for s in np.unique(s_np):
            self._add(int(s), ids_np[s_np == s])

    @torch.no_grad()
    def search(self, queries: torch.Tensor, k: int) -> Retrieved:
        self._check_open()
        check_queries(self, queries, k)
        xq = queries.detach().float().cpu()  # (S, Q, d)
        # Streams whose index cannot search yet (untrained IVF) are searched exactly over the buffer; the
        # others get size 0 there and their index's answer below.
        exact_sizes = self.buffer.sizes() * self._untrained()  # (S,)
        slots, valid = faiss_top_k(self.buffer, xq, exact_sizes, k)  # (S, Q, k) each
        for s, index in enumerate(self.indexes):
            if index.is_trained and index.ntotal > 0:
                kk = min(k, index.ntotal)
                _, ids = index.search(np.ascontiguousarray(xq[s].numpy()), kk)  # (Q, kk) entry numbers or -1
                ids_t = torch.from_numpy(ids)
                valid[s] = False
                valid[s, :, :kk] = ids_t >= 0
                slots[s] = 0
                slots[s, :, :kk] = torch.where(ids_t >= 0, ids_t % self.capacity, torch.zeros_like(ids_t))
        keys, values = self.buffer.gather(slots, queries.dtype)  # (S, Q, k, d), (S, Q, k, dv)
        dev = queries.device
        return Retrieved(keys.to(dev), values.to(dev), valid.to(dev))

    def _untrained(self) -> torch.Tensor:
        """(S,) bool: streams still searched exactly over the buffer."""
        return torch.tensor([not index.is_trained for index in self.indexes])

    def clear(self, streams: torch.Tensor) -> None:
        self._check_open()
        if tuple(streams.shape) != (self.streams,):
            raise ValueError(f"streams must have shape ({self.streams},), got {tuple(streams.shape)}")
        self.buffer.clear(streams)
        for s in streams.cpu().nonzero()[:, 0].tolist():
            self.indexes[s].reset()  # the ids restart at 0; a trained quantizer stays trained

    def sizes(self) -> torch.Tensor:
        return self.buffer.sizes().cpu()

    def close(self) -> None:
        self.closed = True
        self.indexes = []
        self.buffer = RingBuffer(1, 1, 1, 1, "cpu", torch.float32)

    def state_dict(self) -> dict:
        """The ring buffer's contents and each stream's index emptied, as faiss.serialize_index bytes (uint8):
        an IVF quantizer stays the one trained on the entries of its time. On load the live entries go back
        into it with the same ids, so a resumed memory is the uninterrupted one (a quantizer retrained on the
        live entries would have other centroids, and probe other lists)."""
        emptied = []
        for index in self.indexes:
            copy = faiss.clone_index(index)
            copy.reset()  # the trained quantizer without the entries (they travel in the buffer)
            emptied.append(torch.from_numpy(faiss.serialize_index(copy)))
        return {"backend": "faiss", "factory": self.factory, "indexes": emptied, **self.buffer.state_dict()}

    def load_state_dict(self, d: dict) -> None:
        if d.get("backend") != "faiss":
            raise ValueError(f"not a FAISS key/value memory's state: backend {d.get('backend')!r}")
        if d["factory"] != self.factory:
            raise ValueError(f"saved FAISS memory has index {d['factory']!r}, this one {self.factory!r}")
        if len(d.get("indexes", ())) != self.streams:
            raise ValueError(f"saved FAISS memory has {len(d.get('indexes', ()))} stream indexes, this one {self.streams} "
                             "(a state saved before the indexes were kept cannot resume an IVF memory as it was)")
        self.buffer.load_state_dict(d)
        self.indexes = [self._new_index(saved) for saved in d["indexes"]]
        for s in range(self.streams):
            ids = self._live_ids(s)
            if ids.size:
                self._add(s, ids)
