"""Writable key/value memories: the Memorizing Transformer's memory of the document (Wu et al. 2022).

The Searcher seam (memlm.retrieval.searcher) answers search over a fixed datastore; a memory of the
document also needs an append and a per-stream clear, and it returns the stored vectors themselves
(the layer attends to them) rather than next tokens. A stream is one (batch row, kv head): each query
head searches the stream of its kv head in its own batch row only.

Every backend keeps FIFO order: a stream over `capacity` evicts its oldest entries, one by one, and
never resets itself (lucidrains' implementation wipes a full memory). Search is maximum inner
product; the caller L2-normalises keys and queries, so it is cosine similarity.

Backends: `ExactMemory` here (a ring buffer of torch tensors on the memory's device, searched exactly:
FAISS's brute-force scan on the CPU, chunked matmul + torch.topk on a GPU), `FaissMemory` (memlm.memory.knn_store_faiss) and `RemoteMemory` on the retrieval
service (services/retrieval/memory_client.py; the library never imports services/, the caller passes a factory).

Shape legend: S streams, T entries appended per stream, Q queries per stream, k neighbours, d key
dimension, dv value dimension, N slots held in a buffer, n slots of a chunk, G blocks of a chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import numpy as np
import torch



class Retrieved(NamedTuple):
    """The top-k entries of each query's own stream, best first."""

    keys: torch.Tensor  # (S, Q, k, d) the stored (normalised) keys, in the queries' dtype
    values: torch.Tensor  # (S, Q, k, dv) their values, in the queries' dtype
    valid: torch.Tensor  # (S, Q, k) bool; False where a stream holds fewer than k entries


class KeyValueMemory(Protocol):
    """Per-stream FIFO memories of (key, value) vectors; a stream = one (batch row, kv head).
    Search is maximum inner product (keys and queries are L2-normalised by the caller)."""

    streams: int
    dim: int
    value_dim: int
    capacity: int

    def append(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> None:
        """keys (S, T, d), values (S, T, dv), valid (S, T) bool: append the valid entries of each stream in
        time order; a stream over `capacity` evicts its OLDEST entries (FIFO, never a reset)."""
        ...

    def search(self, queries: torch.Tensor, k: int) -> Retrieved:
        """queries (S, Q, d): top-k entries of each query's own stream, best first."""
        ...

    def clear(self, streams: torch.Tensor) -> None:
        """streams (S,) bool: empty those streams only (a new document starts in that batch row)."""
        ...

    def sizes(self) -> torch.Tensor:
        """(S,) int64 entries held per stream."""
        ...

    def close(self) -> None:
        """Release what the memory holds (a remote session, an index); it is unusable afterwards."""
        ...


KeyValueMemoryFactory = Callable[[int, int, int, int], KeyValueMemory]
"""(streams, dim, value_dim, capacity) -> a KeyValueMemory: how a caller (the CLI, a server) supplies the
"service" backend, which the library cannot open itself."""


def storage_dtype(device: torch.device | str) -> torch.dtype:
    """The dtype an ExactMemory stores keys and values in on `device`.

    CUDA: float16 (half the bytes of the torch scan; normalised keys lie in [-1, 1], where float16's 11-bit
    significand is finer than bfloat16's 8). CPU: float32, the dtype FAISS's scan takes (uses_faiss_scan),
    which beats the torch scan there even on CPUs where a bfloat16 matmul is faster than a float32 one
    (avx512_bf16; float16 matmuls are far slower on CPU): torch.topk, not the matmul, dominates the torch scan."""
    return torch.float16 if torch.device(device).type == "cuda" else torch.float32


def check_entries(memory: KeyValueMemory, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> None:
    """Refuse an append whose shapes do not match the memory (one line naming the argument)."""
    S, d, dv = memory.streams, memory.dim, memory.value_dim
    if keys.dim() != 3 or keys.shape[0] != S or keys.shape[2] != d:
        raise ValueError(f"keys must have shape ({S}, T, {d}), got {tuple(keys.shape)}")
    T = keys.shape[1]
    if tuple(values.shape) != (S, T, dv):
        raise ValueError(f"values must have shape ({S}, {T}, {dv}), got {tuple(values.shape)}")
    if tuple(valid.shape) != (S, T) or valid.dtype != torch.bool:
        raise ValueError(f"valid must be a bool tensor of shape ({S}, {T}), got {valid.dtype} {tuple(valid.shape)}")


def check_queries(memory: KeyValueMemory, queries: torch.Tensor, k: int) -> None:
    if queries.dim() != 3 or queries.shape[0] != memory.streams or queries.shape[2] != memory.dim:
        raise ValueError(f"queries must have shape ({memory.streams}, Q, {memory.dim}), got {tuple(queries.shape)}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")


class RingBuffer:
    """Per-stream FIFO storage of (key, value) vectors, shared by the local backends.

    Entry j of a stream (counted since its last clear) lives in slot j % capacity, so a full stream
    overwrites exactly its oldest entry, and a slot p holds a live entry iff p < min(total, capacity).
    The buffer grows by doubling up to capacity (a 64K memory that holds 2K entries costs 2K slots);
    growth only happens before any stream wraps, so copying the prefix keeps every slot where it is.
    """

    def __init__(self, streams: int, dim: int, value_dim: int, capacity: int, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        if streams < 1 or dim < 1 or value_dim < 1 or capacity < 1:
            raise ValueError(f"streams, dim, value_dim and capacity must be >= 1, got {streams}, {dim}, "
                             f"{value_dim}, {capacity}")
        self.streams, self.dim, self.value_dim, self.capacity = streams, dim, value_dim, capacity
        self.device, self.dtype = torch.device(device), dtype
        self.keys = torch.zeros(streams, 0, dim, dtype=dtype, device=self.device)  # (S, N, d)
        self.values = torch.zeros(streams, 0, value_dim, dtype=dtype, device=self.device)  # (S, N, dv)
        self.total = torch.zeros(streams, dtype=torch.long, device=self.device)  # (S,) appended since clear

    def sizes(self) -> torch.Tensor:
        return self.total.clamp(max=self.capacity)  # (S,)

    def _reserve(self, slots: int) -> None:
        n = self.keys.shape[1]
        if slots <= n:
            return
        grown = min(self.capacity, max(slots, 2 * n, 1024))
        keys = self.keys.new_zeros(self.streams, grown, self.dim)  # (S, N', d)
        values = self.values.new_zeros(self.streams, grown, self.value_dim)  # (S, N', dv)
        keys[:, :n], values[:, :n] = self.keys, self.values
        self.keys, self.values = keys, values

    @torch.no_grad()
    def append(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the valid entries (detached) in time order. Returns (stream, entry number) of each entry
        written, (W,) int64 each, in time order per stream (FaissMemory indexes them)."""
        valid = valid.to(self.device)
        rank = valid.long().cumsum(dim=1) - 1  # (S, T) position among the stream's new entries
        count = valid.sum(dim=1)  # (S,)
        # Of more than `capacity` new entries only the last `capacity` survive; writing the others would
        # put two entries in one slot within one scatter (an undefined order).
        keep = valid & (rank >= (count - self.capacity)[:, None])  # (S, T)
        entry = self.total[:, None] + rank  # (S, T) entry numbers since the last clear
        self._reserve(min(self.capacity, int((self.total + count).max())))
        s_idx, t_idx = keep.nonzero(as_tuple=True)  # (W,) each
        ids = entry[s_idx, t_idx]  # (W,)
        slot = ids % self.capacity  # (W,)
        self.keys[s_idx, slot] = keys.detach().to(self.device, self.dtype)[s_idx, t_idx]
        self.values[s_idx, slot] = values.detach().to(self.device, self.dtype)[s_idx, t_idx]
        self.total = self.total + count
        return s_idx, ids

    def clear(self, streams: torch.Tensor) -> None:
        self.total = torch.where(streams.to(self.device).bool(), torch.zeros_like(self.total), self.total)

    def gather(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """slots (S, Q, k) -> keys (S, Q, k, d), values (S, Q, k, dv) in `dtype`: one copy of the top-k only."""
        self._reserve(1)  # an empty buffer has no slot 0 for the invalid entries to point at
        rows = torch.arange(self.streams, device=self.device)[:, None, None]  # (S, 1, 1)
        return self.keys[rows, slots].to(dtype), self.values[rows, slots].to(dtype)

    def state_dict(self) -> dict:
        """The live contents, in slot order (for checkpoints; FIFO order is recovered from `total`)."""
        n = int(self.sizes().max()) if self.streams else 0
        # Copies: .cpu() of a CPU tensor is the tensor itself, and the buffer changes in place.
        return {"capacity": self.capacity, "total": self.total.cpu().clone(), "keys": self.keys[:, :n].cpu().clone(),
                "values": self.values[:, :n].cpu().clone()}

    def load_state_dict(self, d: dict) -> None:
        if d["capacity"] != self.capacity or tuple(d["keys"].shape[::2]) != (self.streams, self.dim):
            raise ValueError(f"saved memory of capacity {d['capacity']} and keys {tuple(d['keys'].shape)} does not "
                             f"fit this one ({self.streams} streams, capacity {self.capacity}, dim {self.dim})")
        n = d["keys"].shape[1]
        self._reserve(n)
        self.keys[:, :n] = d["keys"].to(self.device, self.dtype)
        self.values[:, :n] = d["values"].to(self.device, self.dtype)
        self.total = d["total"].to(self.device, torch.long, copy=True)


SCORE_BUDGET = 1 << 25
"""Most (query, slot) scores that exist at once during a torch scan (64 MB in float16): the chunk of
slots scanned per matmul is SCORE_BUDGET // (S * Q), so memory stays bounded at any capacity. Measured
on CPU (S 8, Q 512, d 64, 64K slots, bfloat16): 2^23 1.8 s, 2^24 0.78 s, 2^25 0.50 s, 2^26
0.45 s per search: wide chunks amortise torch.topk, which costs about as much as the matmul."""


def uses_faiss_scan(buffer: RingBuffer) -> bool:
    """Which exact scan serves a buffer: FAISS's brute-force kNN for float32 on the CPU, the torch scan
    otherwise (GPU). Both are exact. Measured on CPU (S 8, Q 512, d 64, 64K
    slots, k 32): faiss.knn 1.4-1.9 s vs the torch scan 2.7-3.1 s (bfloat16 or float32) under the
    same load: FAISS keeps the top-k in a heap that rejects most scores with one comparison, while
    torch.topk over the score rows costs as much as the matmul that made them."""
    return buffer.device.type == "cpu" and buffer.dtype == torch.float32


def faiss_top_k(buffer: RingBuffer, q: torch.Tensor, sizes: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k slots (S, Q, k) and their validity (S, Q, k) by faiss.knn over each stream's live
    slots (a view of the float32 ring buffer: nothing is copied)."""
    import faiss  # a project dependency (faiss-cpu or faiss-gpu); imported where it is used

    S, Q, _ = q.shape
    slots = torch.full((S, Q, k), -1, dtype=torch.long)  # (S, Q, k)
    qn = q.numpy()
    for s in range(S):
        n = int(sizes[s])
        if n:
            xq = np.ascontiguousarray(qn[s])  # (Q, d)
            _, ids = faiss.knn(xq, buffer.keys[s, :n].numpy(), min(k, n), metric=faiss.METRIC_INNER_PRODUCT)
            slots[s, :, : min(k, n)] = torch.from_numpy(ids)  # (Q, <=k)
    valid = slots >= 0  # (S, Q, k)
    return slots.clamp(min=0), valid


def torch_top_k(buffer: RingBuffer, q: torch.Tensor, sizes: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k slots (S, Q, k) and their validity (S, Q, k) by chunked batched matmul + torch.topk in
    the storage dtype, SCORE_BUDGET scores at a time."""
    S, Q, _ = q.shape
    n = int(sizes.max())
    chunk = max(k, SCORE_BUDGET // max(S * Q, 1))
    cand_s, cand_i = [], []
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        scores = torch.bmm(q, buffer.keys[:, lo:hi].transpose(1, 2))  # (S, Q, n) in the storage dtype
        live = torch.arange(lo, hi, device=buffer.device)[None, :] < sizes[:, None]  # (S, n)
        scores.masked_fill_(~live[:, None, :], float("-inf"))
        top_s, top_i = torch.topk(scores, min(k, hi - lo), dim=-1)  # (S, Q, <=k)
        cand_s.append(top_s)
        cand_i.append(top_i + lo)
    slots = torch.zeros(S, Q, k, dtype=torch.long, device=buffer.device)  # (S, Q, k)
    valid = torch.zeros(S, Q, k, dtype=torch.bool, device=buffer.device)  # (S, Q, k)
    if cand_s:
        all_s, all_i = torch.cat(cand_s, dim=-1), torch.cat(cand_i, dim=-1)  # (S, Q, chunks * k)
        _, pos = torch.topk(all_s, min(k, all_s.shape[-1]), dim=-1)  # (S, Q, k')
        kk = pos.shape[-1]
        slots[..., :kk] = all_i.gather(-1, pos)
        valid[..., :kk] = slots[..., :kk] < sizes[:, None, None]
    return torch.where(valid, slots, torch.zeros_like(slots)), valid


class ExactMemory:
    """Exact maximum-inner-product memory on one device, in torch tensors (the default up to EXACT_MAX_ENTRIES).

    Keys and values are stored in `dtype` (default `storage_dtype(device)`: float32 on CPU, float16 on
    CUDA) in a RingBuffer on the device. Search is exact: FAISS's brute-force scan over the buffer on the
    CPU, a chunked matmul + torch.topk on the device otherwise (uses_faiss_scan), ranked in the storage
    dtype (float16: scores of normalised vectors to about 0.001, so near-ties may swap; the layer
    recomputes the scores it attends with from the gathered keys). Only the top-k slots are gathered and
    copied, once, into the queries' dtype."""

    def __init__(self, streams: int, dim: int, value_dim: int, capacity: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype | None = None) -> None:
        self.streams, self.dim, self.value_dim, self.capacity = streams, dim, value_dim, capacity
        self.buffer = RingBuffer(streams, dim, value_dim, capacity, device, dtype or storage_dtype(device))
        self.closed = False

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("this key/value memory was closed")

    def append(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> None:
        self._check_open()
        check_entries(self, keys, values, valid)
        self.buffer.append(keys, values, valid)

    @torch.no_grad()
    def search(self, queries: torch.Tensor, k: int) -> Retrieved:
        self._check_open()
        check_queries(self, queries, k)
        buf = self.buffer
        sizes = buf.sizes()  # (S,)
        q = queries.detach().to(buf.device, buf.dtype)  # (S, Q, d)
        if uses_faiss_scan(buf):
            slots, valid = faiss_top_k(buf, q, sizes, k)  # (S, Q, k) each
        else:
            slots, valid = torch_top_k(buf, q, sizes, k)  # (S, Q, k) each
        keys, values = buf.gather(slots, queries.dtype)  # (S, Q, k, d), (S, Q, k, dv)
        dev = queries.device
        return Retrieved(keys.to(dev), values.to(dev), valid.to(dev))

    def clear(self, streams: torch.Tensor) -> None:
        self._check_open()
        if tuple(streams.shape) != (self.streams,):
            raise ValueError(f"streams must have shape ({self.streams},), got {tuple(streams.shape)}")
        self.buffer.clear(streams)

    def sizes(self) -> torch.Tensor:
        return self.buffer.sizes().cpu()

    def close(self) -> None:
        self.closed = True
        self.buffer = RingBuffer(1, 1, 1, 1, "cpu", torch.float32)  # drop the storage

    def state_dict(self) -> dict:
        """Contents for a checkpoint (a resumed run continues with the same memory)."""
        return {"backend": "exact", **self.buffer.state_dict()}

    def load_state_dict(self, d: dict) -> None:
        if d.get("backend") != "exact":
            raise ValueError(f"not an exact key/value memory's state: backend {d.get('backend')!r}")
        self.buffer.load_state_dict(d)
