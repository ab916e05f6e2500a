"""Exact nearest-neighbour search in torch: chunked matmul + top-k on the keys' device.

The ground truth for the recall of approximate (FAISS) indexes, and a search backend for datastores
and memories that fit in GPU memory. Answers the Searcher seam (memlm.retrieval.searcher).

Squared L2 is computed as |x|^2 - 2 x.k + |k|^2 with float32 accumulation: float16/bfloat16 keys are
cast to float32 one chunk at a time, so memory stays at one (chunk, d) float32 block plus (Q, chunk).

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
        # |k|^2 once, in float32, chunk by chunk.
        norms = [keys[lo : lo + chunk_size].float().pow(2).sum(-1) for lo in range(0, keys.shape[0], chunk_size)]
        self.key_norms = torch.cat(norms) if norms else keys.new_zeros(0, dtype=torch.float32)  # (N,)
        unknown = SearcherInfo(n=0, dim=0, index=EXACT_INDEX, metric="l2", nprobe=1, key_layer="", model_name="",
                               model_fingerprint="", tokenizer_fingerprint="", corpus="", corpus_fingerprint="",
                               context=0, stride=0, boundary_token=-1, sink_tokens=0)
        self._info = dataclasses.replace(
            info or unknown, n=int(keys.shape[0]), dim=int(keys.shape[1]), index=EXACT_INDEX, nprobe=1
        )

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
        best_d = torch.full((Q, 0), float("inf"), device=x.device)  # (Q, <=k)
        best_i = torch.zeros((Q, 0), dtype=torch.long, device=x.device)  # (Q, <=k)
        for lo in range(0, N, self.chunk_size):
            chunk = self.keys[lo : lo + self.chunk_size].float()  # (n, d)
            dist = x_norm - 2.0 * (x @ chunk.T) + self.key_norms[lo : lo + chunk.shape[0]]  # (Q, n)
            dist.clamp_(min=0.0)  # cancellation can dip below zero for near-identical vectors
            ids = torch.arange(lo, lo + chunk.shape[0], device=x.device).expand(Q, -1)  # (Q, n)
            cand_d = torch.cat([best_d, dist], dim=1)  # (Q, <=k + n)
            cand_i = torch.cat([best_i, ids], dim=1)
            top = min(k, cand_d.shape[1])
            best_d, pos = torch.topk(cand_d, top, dim=1, largest=False, sorted=True)  # (Q, top)
            best_i = cand_i.gather(1, pos)
        distances = np.full((Q, k), np.inf, dtype=np.float32)  # (Q, k), padded when k > N
        ids_out = np.full((Q, k), -1, dtype=np.int64)
        distances[:, : best_d.shape[1]] = best_d.cpu().numpy()
        ids_out[:, : best_i.shape[1]] = best_i.cpu().numpy()
        values = np.where(ids_out >= 0, self.values[np.maximum(ids_out, 0)], -1).astype(np.int32)  # (Q, k)
        return Neighbors(distances, ids_out, values)


def exact_searcher_over_documents(
    model: Any, token_docs: Any, window: Any, boundary_token: int, *, model_fingerprint: str = "",
    tokenizer_fingerprint: str = "",
) -> TorchExactSearcher:
    """An in-memory datastore: the (key, next token) pairs of `token_docs` under `model`, taken from the
    same sliding windows as the datastore builder (memlm.jobs.windows.score_documents), searched exactly.

    For tests and small corpora; keys stay on the model's device in float32, (N, C). Its info() records
    the window, boundary token and key layer, and the fingerprints given here (the Decoder knows none).
    """
    from memlm.jobs.windows import score_documents

    keys, values = [], []
    for scored in score_documents(model, token_docs, window, boundary_token, with_logprobs=False):
        keys.append(scored.keys.float())  # (n, C)
        values.append(scored.targets)  # (n,)
    info = SearcherInfo(
        n=0, dim=0, index=EXACT_INDEX, metric="l2", nprobe=1, key_layer=model.config.key_description,
        model_name="", model_fingerprint=model_fingerprint, tokenizer_fingerprint=tokenizer_fingerprint,
        corpus="in-memory documents", corpus_fingerprint="", context=window.context, stride=window.stride,
        boundary_token=boundary_token, sink_tokens=0,
    )  # n and dim: filled in by the searcher
    return TorchExactSearcher(torch.cat(keys), torch.cat(values).numpy(), info=info)  # (N, C), (N,)
