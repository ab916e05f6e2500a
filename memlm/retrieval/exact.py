"""Exact nearest-neighbour search in torch: chunked matmul + top-k on the keys' device.

The ground truth for the recall of approximate (FAISS) indexes, and a search backend for datastores
and memories that fit in GPU memory. Answers the Searcher seam (memlm.retrieval.searcher).

Squared L2 is computed as |x|^2 - 2 x.k + |k|^2 with float32 accumulation: float16/bfloat16 keys are
cast to float32 one chunk at a time, so memory stays at one (chunk, d) float32 block plus (Q, chunk).
On the CPU (float32 inference, memlm.model.decoder.cpu_float32_gemm) every chunk is laid out once, on the first
search, so that x.k is one GEMM that reads the keys once for all Q queries: the panel kernel's where it runs
(memlm.model.decoder.on_panels) over a copy in its panels (memlm.model.panel_gemm.panels; float16 panels of float16
keys, N * d * 2 bytes more, widened exactly as they are read, so the products are those of float32 panels bit for
bit at half the bytes: 3.6 / 4.2 / 8.1 ms against 7.0 / 7.3 / 10.0 at 1 / 3 / 8 queries over 81,169 keys, 4 Dec,
benchmarks/panel_gemm.py --keys),
else oneDNN's over a packed float32 one (memlm.model.decoder.pack_weight, N * d * 4 bytes more); a process that
searches both ways holds both copies. Measured on the 81K-key SOTU datastore (d 576, k 1024, 2 threads, 2 Dec): 1 /
3 / 17 queries 62 / 89 / 93 ms casting float16 chunks, 4.3 / 4.5 / 5.9 ms for the packed product alone (the FAISS
Flat index scans query by query: 7.2 ms a query on one thread, 14.7 on two).
On the CPU the distances and the k nearest of each chunk come from a compiled kernel (memlm.retrieval.nearest_kernel:
the same distances bit for bit, ties broken by the smaller id) instead of torch.topk, which cost more than the product
a query shares: 81K keys, one thread, 1 / 4 / 17 queries 4.9 / 8.3 / 30.0 ms -> 4.1 / 5.6 / 20.2 ms (6 Dec, AMD EPYC).

Shape legend: Q queries, d key dimension, k neighbours, N keys, n keys of a chunk.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from memlm.model import panel_gemm
from memlm.model.decoder import cpu_float32_gemm, on_panels, pack_weight, packed_linear
from memlm.retrieval import nearest_kernel
from memlm.retrieval.searcher import Neighbors, SearcherInfo, SearchOptions

EXACT_INDEX = "exact"
"""SearcherInfo.index of the torch exact backend."""


def searcher_bytes(n: int, d: int, device: torch.device) -> int:
    """Memory a TorchExactSearcher over n float16 keys of width d takes on `device`: the keys, and on the CPU a
    copy made by the first search (float16 panels, 2 bytes a component, or float32 packed chunks, 4; both where
    both kinds of search came): at most 6 bytes a component for one kind."""
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
        self._packed: list[torch.Tensor] | None = None  # per chunk, on the CPU: made by the first search on oneDNN
        self._panels: list[torch.Tensor] | None = None  # per chunk, on the CPU: by the first on the panel kernel
        # |k|^2 once, in float32, chunk by chunk.
        norms = [keys[lo : lo + chunk_size].float().pow(2).sum(-1) for lo in range(0, keys.shape[0], chunk_size)]
        self.key_norms = torch.cat(norms) if norms else keys.new_zeros(0, dtype=torch.float32)  # (N,)
        unknown = SearcherInfo(n=0, dim=0, index=EXACT_INDEX, metric="l2", nprobe=1, key_layer="", model_name="",
                               model_fingerprint="", tokenizer_fingerprint="", corpus="", corpus_fingerprint="",
                               context=0, stride=0, boundary_token=-1, sink_tokens=0)
        self._info = dataclasses.replace(
            info or unknown, n=int(keys.shape[0]), dim=int(keys.shape[1]), index=EXACT_INDEX, nprobe=1
        )

    def _packed_chunks(self) -> list[torch.Tensor]:
        """The keys' chunks as packed float32 (memlm.model.decoder.pack_weight), made once."""
        if self._packed is None:
            self._packed = [pack_weight(self.keys[lo : lo + self.chunk_size].float())
                            for lo in range(0, self.keys.shape[0], self.chunk_size)]
        return self._packed

    def _panel_chunks(self) -> list[torch.Tensor]:
        """The keys' chunks in the panel kernel's panels (memlm.model.panel_gemm.panels), made once: float16 panels
        of float16 keys where the float16 kernel builds (half the bytes a search reads, the same products bit for
        bit), else float32 ones."""
        if self._panels is None:
            half = self.keys.dtype == torch.float16 and panel_gemm.half_kernel() is not None
            dtype = torch.float16 if half else torch.float32
            self._panels = [panel_gemm.panels(self.keys[lo : lo + self.chunk_size], dtype)
                            for lo in range(0, self.keys.shape[0], self.chunk_size)]
        return self._panels

    def _chunk_products(self, x: torch.Tensor) -> Callable[[int, int, int], torch.Tensor]:
        """For this search's queries x (Q, d) float32: (chunk, lo, n) -> x . the keys lo .. lo + n of that chunk,
        (Q, n) float32, on the GEMM chosen once here (panels, oneDNN's packed copy, or a cast and matmul)."""
        if cpu_float32_gemm(x, self.key_norms):
            if on_panels(x):
                panels = self._panel_chunks()
                return lambda chunk, lo, n: panel_gemm.linear(x, panels[chunk], n)
            packed = self._packed_chunks()
            return lambda chunk, lo, n: packed_linear(x, packed[chunk])
        return lambda chunk, lo, n: x @ self.keys[lo : lo + n].float().T

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
        Q, N = x.shape[0], self.keys.shape[0]
        x_norm = x.pow(2).sum(-1, keepdim=True)  # (Q, 1)
        products = self._chunk_products(x)
        if x.device.type == "cpu" and k >= 1 and nearest_kernel.fits(N, self.chunk_size) and nearest_kernel.available():
            distances, ids_out = nearest_kernel.empty_best(Q, k)  # (Q, k), (Q, k): inf / -1 until found
            x_norms = x_norm[:, 0].numpy()  # (Q,)
            key_norms = self.key_norms.numpy()  # (N,)
            for c, lo in enumerate(range(0, N, self.chunk_size)):
                n = min(self.chunk_size, N - lo)
                nearest_kernel.nearest_into(products(c, lo, n).numpy(), x_norms, key_norms[lo : lo + n], lo,
                                            distances, ids_out)
            return self._neighbors(distances, ids_out)
        best_d = torch.full((Q, 0), float("inf"), device=x.device)  # (Q, <=k)
        best_i = torch.zeros((Q, 0), dtype=torch.long, device=x.device)  # (Q, <=k)
        for c, lo in enumerate(range(0, N, self.chunk_size)):
            n = min(self.chunk_size, N - lo)
            # (Q, n) |x|^2 - 2 x.k + |k|^2
            dist = products(c, lo, n).mul_(-2.0).add_(x_norm).add_(self.key_norms[lo : lo + n])
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
        return self._neighbors(distances, ids_out)

    def _neighbors(self, distances: np.ndarray, ids: np.ndarray) -> Neighbors:
        """Neighbors of (Q, k) sorted distances and ids (-1 past the last key), with the ids' values."""
        values = np.where(ids >= 0, self.values[np.maximum(ids, 0)], -1).astype(np.int32)  # (Q, k)
        return Neighbors(distances, ids, values)

