"""Per-token scores of one chunk of scored positions: the computation every scoring path shares.

`score_chunk` takes the logits of a chunk's scored positions (a window's scored slice, a segment row's, the
scored tokens of a segment batch or of an engine pass) and their next tokens, and gives each token's base
log-probability, its final one (the kNN-LM mixture of Khandelwal et al. 2020 when neighbours are given),
whether it is the greedy choice, and the top-n alternatives under the final distribution. `memlm eval` (plain,
memory, kNN-LM, SPALM), the Score rpc (memlm.jobs.scoring) and the engine's score rows call it, so their floats
agree. Full-vocabulary floats exist for one chunk only: its (n, V) log-probabilities, and the full mixture,
needed only for greedy flags and top-n, DENSE_BLOCK_FLOATS at a time; the target's final log-probability is
the sparse mixture (`knn_final`), which evaluation also applies to base log-probabilities kept from earlier.
With a saved interpolation (KNNLMConfig.interpolation) the mixture is its per-token weights over the LM, the
neighbours and the document cache, as memlm.jobs.interpolation_eval evaluates it (`_interpolated`).

Shape legend: n scored tokens of a chunk, V vocab, k neighbours, N top-n alternatives, F features.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from memlm.errors import MemlmError
from memlm.retrieval.interpolation import ServedInterpolation, final_logprob, log_distribution, plan_rows
from memlm.retrieval.interpolation import lm_features as interpolation_features
from memlm.retrieval.knnlm import KNNLMConfig, interpolate, knn_mixture, knn_target_logprob
from memlm.retrieval.searcher import Neighbors

DENSE_BLOCK_FLOATS = 1 << 22
"""Largest (rows, V) float32 block of full kNN-LM distributions held at once for greedy flags and top-n (16 MiB)."""

LMFeatures = Callable[[torch.Tensor], torch.Tensor]
"""(n, V) float32 log-probabilities -> (n, F) float32 per-token statistics (adaptive retrieval's gate,
memlm.retrieval.adaptive.distribution_features), computed while the chunk's log-probabilities exist."""


class ChunkScores(NamedTuple):
    """Scores of a chunk's tokens, on the logits' device (`cpu()` moves them)."""

    base: torch.Tensor  # (n,) float32 log p_LM(target | context), nats
    final: torch.Tensor  # (n,) float32 final log-probability: the kNN-LM mixture, or base without kNN-LM
    greedy: torch.Tensor  # (n,) bool, target == argmax of the final distribution
    top_ids: torch.Tensor  # (n, N) int64, the N most likely tokens under the final distribution
    top_logprobs: torch.Tensor  # (n, N) float32, their final log-probabilities
    features: torch.Tensor | None = None  # (n, F) float32 lm_features of the base log-probabilities, when asked

    def cpu(self) -> ChunkScores:
        """The same scores on the CPU."""
        return ChunkScores(*(None if t is None else t.cpu() for t in self))


def score_chunk(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    neighbors: Neighbors | None = None,
    knn: KNNLMConfig | None = None,
    keep_base: torch.Tensor | None = None,
    top_n: int = 0,
    lm_features: LMFeatures | None = None,
    cache: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> ChunkScores:
    """The scores of the next tokens `targets` (n,) int64 from `logits` (n, V) (any dtype and device) of
    the scored positions only (index a window's (T, V) logits by its scored slice or mask first).

    neighbors, knn: kNN-LM, both or neither: the (n, k) neighbours of these tokens' keys and the settings
    (lmbda and temperature fixed). keep_base: (n,) bool, tokens whose final distribution is the base one
    (an adaptive gate skipped their search). top_n: alternatives per token (0: none).
    lm_features: also the statistics of each token's base log-probabilities (ChunkScores.features).
    cache: with a knn.interpolation that mixes the document cache, these tokens' cache neighbours (distances
    (n, c) float32, next tokens (n, c) int64; memlm.jobs.interpolation_eval.DocumentCache).
    """
    x = logits.float()  # (n, V)
    lm_lp = F.log_softmax(x, dim=-1)  # (n, V)
    targets = targets.to(lm_lp.device)  # (n,)
    base = lm_lp.gather(1, targets[:, None])[:, 0]  # (n,)
    base_greedy = x.argmax(dim=-1) == targets  # (n,)
    features = lm_features(lm_lp).float() if lm_features is not None else None  # (n, F)
    if neighbors is None:
        top_ids, top_lp = _top(lm_lp, top_n)
        return ChunkScores(base, base, base_greedy, top_ids, top_lp, features)
    assert knn is not None
    if knn.interpolation is not None:
        if keep_base is not None:
            raise MemlmError("a saved interpolation mixes every token: fewer searches do not combine with it")
        final, greedy, top_ids, top_lp = _interpolated(knn.interpolation, lm_lp, base, neighbors, cache, targets, top_n)
        return ChunkScores(base, final, greedy, top_ids, top_lp, features)
    assert knn.lmbda is not None and knn.temperature is not None
    final = knn_final(base, knn_target_logprob(neighbors, targets.cpu(), knn.temperature), knn.lmbda)  # (n,)
    greedy, top_ids, top_lp = _dense_greedy_top(lm_lp, neighbors, targets, knn, top_n)
    if keep_base is not None and bool(keep_base.any()):  # skipped by the gate: lambda 0, as in evaluation
        keep = keep_base.to(lm_lp.device)  # (n,)
        final = torch.where(keep, base, final)
        greedy = torch.where(keep, base_greedy, greedy)
        if top_n:
            base_ids, base_lp = _top(lm_lp, top_n)  # (n, N) each
            top_ids = torch.where(keep[:, None], base_ids, top_ids)
            top_lp = torch.where(keep[:, None], base_lp, top_lp)
    return ChunkScores(base, final, greedy, top_ids, top_lp, features)


def knn_final(base: torch.Tensor, knn_logprob: torch.Tensor, lmbda: float,
              keep_base: torch.Tensor | None = None) -> torch.Tensor:
    """The final log-probability of each target, (n,) float32 on base's device: log(lambda p_kNN + (1 - lambda)
    p_LM) from base (n,) and knn_logprob (n,) log p_kNN(target), except base itself where keep_base (n,) bool."""
    mixed = interpolate(base, knn_logprob.to(base.device), lmbda)  # (n,)
    return mixed if keep_base is None else torch.where(keep_base.to(mixed.device), base, mixed)


def _interpolated(
    served: ServedInterpolation, lm_lp: torch.Tensor, base: torch.Tensor, nb: Neighbors,
    cache: tuple[torch.Tensor, torch.Tensor] | None, targets: torch.Tensor, top_n: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(final (n,), greedy (n,), top ids (n, N), top log-probs (n, N)) under a saved interpolation: the
    targets' log-probabilities as memlm.jobs.interpolation_eval computes them (on the CPU), greedy flags and
    top-n from the full mixture a bounded block of rows at a time. lm_lp (n, V), base (n,), nb (n, k)."""
    if served.has_cache and cache is None:
        raise MemlmError("this interpolation mixes the document cache, which only the engine's score rows keep")
    knn = (torch.from_numpy(np.asarray(nb.distances, dtype=np.float32)),
           torch.from_numpy(np.asarray(nb.values).astype(np.int64)))  # (n, k) each
    sources = [knn] + ([cache] if served.has_cache else [])
    t = targets.cpu().long()  # (n,)
    plan = served.plan(interpolation_features(lm_lp).cpu(), sources)
    final = final_logprob(plan, base.cpu(), [(d, v == t[:, None]) for d, v in sources]).to(base.device)  # (n,)
    n, V = lm_lp.shape
    rows = max(1, DENSE_BLOCK_FLOATS // V)
    greedy, top_ids, top_lp = [], [], []
    for lo in range(0, n, rows):
        hi = min(n, lo + rows)
        mixed = log_distribution(plan_rows(plan, lo, hi), lm_lp[lo:hi], [(d[lo:hi], v[lo:hi]) for d, v in sources])
        greedy.append(mixed.argmax(dim=-1) == targets[lo:hi])  # (r,)
        top = mixed.topk(top_n, dim=-1)  # (r, N)
        top_ids.append(top.indices)
        top_lp.append(top.values)
    if n == 0:
        return final, torch.empty(0, dtype=torch.bool, device=lm_lp.device), *_top(lm_lp, top_n)
    return final, torch.cat(greedy), torch.cat(top_ids), torch.cat(top_lp)


def _top(lm_lp: torch.Tensor, top_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top_n ids (n, N) and log-probabilities (n, N) of lm_lp (n, V); empty (n, 0) for top_n 0."""
    if not top_n:
        n, device = lm_lp.shape[0], lm_lp.device
        return torch.empty(n, 0, dtype=torch.long, device=device), torch.empty(n, 0, device=device)
    top = lm_lp.topk(top_n, dim=-1)  # (n, N)
    return top.indices, top.values


def _dense_greedy_top(
    lm_lp: torch.Tensor, nb: Neighbors, targets: torch.Tensor, knn: KNNLMConfig, top_n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy flags (n,) and top-n (n, N) under the full kNN-LM mixture, a bounded block of rows at a time.

    lm_lp: (n, V) base log-probabilities; nb: (n, k) neighbours; targets: (n,).
    """
    n, V = lm_lp.shape
    rows = max(1, DENSE_BLOCK_FLOATS // V)
    greedy, top_ids, top_lp = [], [], []
    for lo in range(0, n, rows):
        block = Neighbors(*(a[lo : lo + rows] for a in nb))
        mixed = knn_mixture(lm_lp[lo : lo + rows], block, knn.temperature, knn.lmbda)  # (r, V)
        greedy.append(mixed.argmax(dim=-1) == targets[lo : lo + rows])  # (r,)
        if top_n:
            top = mixed.topk(top_n, dim=-1)  # (r, N)
            top_ids.append(top.indices)
            top_lp.append(top.values)
    if not top_n or n == 0:
        device = lm_lp.device
        return (torch.cat(greedy) if greedy else torch.empty(0, dtype=torch.bool, device=device),
                torch.empty(n, top_n, dtype=torch.long, device=device), torch.empty(n, top_n, device=device))
    return torch.cat(greedy), torch.cat(top_ids), torch.cat(top_lp)
