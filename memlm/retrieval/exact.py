"""Exact nearest-neighbour search: chunked matmul + top-k in torch on a GPU, FAISS' exact search on the CPU.

The ground truth for the recall of approximate (FAISS) indexes, and a search backend for datastores
and memories that fit in GPU memory. Answers the Searcher seam (memlm.retrieval.searcher).

On the keys' device (a GPU) squared L2 is computed as |x|^2 - 2 x.k + |k|^2 with float32 accumulation:
float16/bfloat16 keys are cast to float32 one chunk at a time, so memory stays at one (chunk, d) float32 block
plus (Q, chunk), and torch.topk keeps the k nearest of each chunk. On the CPU the search is FAISS' exact one
(faiss.knn over each chunk, the chunks' results merged in a faiss.ResultHeap) over a float32 copy of the keys
made by the first search (N * d * 4 bytes more for float16 keys), so a search casts nothing.

Shape legend: Q queries, d key dimension, k neighbours, N keys, n keys of a chunk.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from memlm.retrieval.searcher import Neighbors, SearcherInfo, SearchOptions

EXACT_INDEX = "exact"
"""SearcherInfo.index of the torch exact backend."""


def searcher_bytes(n: int, d: int, device: torch.device) -> int:
    """Memory a TorchExactSearcher over n float16 keys of width d takes on `device`: the keys, and on the CPU
    the float32 copy made by the first search (4 bytes a component)."""
    return n * d * (2 if device.type != "cpu" else 2 + 4)


class TorchExactSearcher:
    """Brute-force squared-L2 search over keys (N, d) held as a torch tensor on any device."""

    def __init__(
        self, keys: torch.Tensor, values: Any, chunk_size: int = 65536, *, info: SearcherInfo | None = None
    ) -> None:
        """keys: (N, d) float16/bfloat16/float32 tensor; values: (N,) int32 next tokens (numpy or torch).

        chunk_size: keys per matmul; (Q, chunk_size) float32 scores exist at a time.
        info: how the keys were made (e.g. a Datastore's info()); its n, dim, index and nprobe are replaced
            by this searcher's own. None: only what the keys say (fingerprints "", layout 0, boundary -1).
        """
        if keys.dim() != 2:
            raise ValueError(f"keys must have shape (N, d), got {tuple(keys.shape)}")
        values_np = values.cpu().numpy() if isinstance(values, torch.Tensor) else np.asarray(values)
        if values_np.shape != (keys.shape[0],):
            raise ValueError(f"values must have shape ({keys.shape[0]},), got {values_np.shape}")
        self.keys = keys
        self.values = values_np.astype(np.int32)  # (N,)
        self.chunk_size = int(chunk_size)
        self._cpu_chunks: list[np.ndarray] | None = None  # (n, d) float32 per chunk, on the CPU: by the first search
        # |k|^2 once, in float32, chunk by chunk.
        norms = [keys[lo : lo + chunk_size].float().pow(2).sum(-1) for lo in range(0, keys.shape[0], chunk_size)]
        self.key_norms = torch.cat(norms) if norms else keys.new_zeros(0, dtype=torch.float32)  # (N,)
        unknown = SearcherInfo(n=0, dim=0, index=EXACT_INDEX, metric="l2", nprobe=1, key_layer="", model_name="",
                               model_fingerprint="", tokenizer_fingerprint="", corpus="", corpus_fingerprint="",
                               context=0, stride=0, boundary_token=-1, sink_tokens=0)
        self._info = dataclasses.replace(
            info or unknown, n=int(keys.shape[0]), dim=int(keys.shape[1]), index=EXACT_INDEX, nprobe=1
        )

    def _float32_chunks(self) -> list[np.ndarray]:
        """The keys' chunks as C-contiguous float32 numpy arrays (n, d), what faiss.knn reads, made once (views of
        float32 keys, copies of others)."""
        if self._cpu_chunks is None:
            self._cpu_chunks = [np.ascontiguousarray(self.keys[lo : lo + self.chunk_size].float().numpy())
                                for lo in range(0, self.keys.shape[0], self.chunk_size)]
        return self._cpu_chunks

    @property
    def dim(self) -> int:
        return int(self.keys.shape[1])

    def __len__(self) -> int:
        return int(self.keys.shape[0])

    def info(self) -> SearcherInfo:
        """The keys' description (as given at construction), with index "exact"."""
        return self._info

    @torch.inference_mode()
    def search(self, xq: Any, k: int, options: SearchOptions | None = None) -> Neighbors:
        """xq: (Q, d) float32/float16 numpy array or tensor -> the exact k nearest keys, sorted.

        options: accepted for the seam; nprobe and exact re-ranking change nothing on an exact search."""
        # A copy of numpy queries: they may be read-only (decoded from a message), which torch warns about.
        x = xq if isinstance(xq, torch.Tensor) else torch.tensor(np.asarray(xq))
        if x.dim() != 2 or x.shape[1] != self.dim:
            raise ValueError(f"queries must have shape (Q, {self.dim}), got {tuple(x.shape)}")
        x = x.to(device=self.keys.device, dtype=torch.float32)  # (Q, d)
        if x.device.type == "cpu":
            return self._neighbors(*self._faiss_search(np.ascontiguousarray(x.numpy()), k))
        return self._neighbors(*self._torch_search(x, k))

    def _torch_search(self, x: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The exact k nearest of queries x (Q, d) float32 on the keys' device by chunked matmul and torch.topk:
        (Q, k) sorted squared L2 distances and ids, inf / -1 past the last key."""
        Q, N = x.shape[0], self.keys.shape[0]
        x_norm = x.pow(2).sum(-1, keepdim=True)  # (Q, 1)
        best_d = torch.full((Q, 0), float("inf"), device=x.device)  # (Q, <=k)
        best_i = torch.zeros((Q, 0), dtype=torch.long, device=x.device)  # (Q, <=k)
        for lo in range(0, N, self.chunk_size):
            n = min(self.chunk_size, N - lo)
            # (Q, n) |x|^2 - 2 x.k + |k|^2
            dist = (x @ self.keys[lo : lo + n].float().T).mul_(-2.0).add_(x_norm).add_(self.key_norms[lo : lo + n])
            dist.clamp_(min=0.0)  # cancellation can dip below zero for near-identical vectors
            # The chunk's own best first (ids: their positions + lo), then merged with the best so far: no
            # (Q, n) id array, no concatenation of a whole chunk.
            chunk_d, pos = torch.topk(dist, min(k, n), dim=1, largest=False, sorted=True)  # (Q, <=k)
            if lo == 0:
                best_d, best_i = chunk_d, pos
                continue
            cand_d, cand_i = torch.cat([best_d, chunk_d], dim=1), torch.cat([best_i, pos + lo], dim=1)  # (Q, <=2k)
            best_d, at = torch.topk(cand_d, min(k, cand_d.shape[1]), dim=1, largest=False, sorted=True)  # (Q, <=k)
            best_i = cand_i.gather(1, at)
        distances = np.full((Q, k), np.inf, dtype=np.float32)  # (Q, k), padded when k > N
        ids_out = np.full((Q, k), -1, dtype=np.int64)
        distances[:, : best_d.shape[1]] = best_d.cpu().numpy()
        ids_out[:, : best_i.shape[1]] = best_i.cpu().numpy()
        return distances, ids_out

    def _faiss_search(self, x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """FAISS' exact k nearest of queries x (Q, d) float32 over the CPU keys, chunk by chunk: (Q, k) sorted
        squared L2 distances and ids, inf / -1 past the last key."""
        import faiss

        Q = x.shape[0]
        distances = np.full((Q, k), np.inf, dtype=np.float32)  # (Q, k), padded when k > N
        ids = np.full((Q, k), -1, dtype=np.int64)
        if k < 1 or Q == 0 or len(self) == 0:
            return distances, ids
        heap = faiss.ResultHeap(Q, k)  # keep_max False: the smallest distances
        for chunk, lo in zip(self._float32_chunks(), range(0, len(self), self.chunk_size)):
            chunk_d, chunk_i = faiss.knn(x, chunk, min(k, chunk.shape[0]))  # (Q, <=k), (Q, <=k)
            heap.add_result(chunk_d, chunk_i + lo)
        heap.finalize()
        found = min(k, len(self))
        distances[:, :found], ids[:, :found] = heap.D[:, :found], heap.I[:, :found]
        return distances, ids

    def _neighbors(self, distances: np.ndarray, ids: np.ndarray) -> Neighbors:
        """Neighbors of (Q, k) sorted distances and ids (-1 past the last key), with the ids' values."""
        values = np.where(ids >= 0, self.values[np.maximum(ids, 0)], -1).astype(np.int32)  # (Q, k)
        return Neighbors(distances, ids, values)

