"""kNN-LM (Khandelwal et al. 2020): interpolate the LM with a distribution over retrieved next tokens.

    p(y | x) = lambda * p_kNN(y | x) + (1 - lambda) * p_LM(y | x)
    p_kNN(y | x) = sum_{j : v_j = y} exp(-d_j / T) / sum_j exp(-d_j / T)

over the k nearest datastore keys (distances d_j, stored next tokens v_j) of the query key x. Everything
is in log space: p_kNN of the target is a logsumexp over the matching neighbours (no (Q, V) tensor per
token), and the mixture is a logaddexp, so lambda = 0 returns the LM's log-probabilities bit for bit and
a target no neighbour predicts gives log p_kNN = -inf without NaNs. The full mixture over the vocabulary
(`knn_mixture`) is built only for generation, with the logaddexp at the neighbours' tokens only.

This module takes a Searcher (memlm.retrieval.searcher) and never imports `datastore` or `services`: the command
line or a server opens the datastore and passes it in. lambda and T are either given or tuned by grid
search on a separate tuning split (`collect_tuning_data` + `tune`), never on the evaluation split.

Shape legend: Q queries (scored tokens), k neighbours, V vocab, d key dimension, n tuning tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from memlm.errors import MemlmError
from memlm.retrieval.searcher import Neighbors, SearchOptions

if TYPE_CHECKING:
    from memlm.retrieval.interpolation import ServedInterpolation

NEG_INF = float("-inf")


@dataclass(frozen=True)
class KNNLMConfig:
    k: int = 1024
    """Neighbours retrieved per token."""
    lmbda: float | None = 0.25
    """Interpolation weight of p_kNN in [0, 1]; None: tuned on the tuning split ("--lambda auto")."""
    temperature: float | None = 1.0
    """T in p_kNN proportional to exp(-distance / T), distances being squared L2; None: tuned."""
    exact_rerank: bool = False
    """Recompute exact distances from the stored float16 keys (SearchOptions.exact_rerank)."""
    nprobe: int | None = None
    """Inverted lists visited per query; None: the datastore's default."""
    interpolation: ServedInterpolation | None = None
    """A saved interpolation (memlm.retrieval.interpolation) that mixes in place of lmbda and temperature;
    None: the constant lambda."""

    def __post_init__(self) -> None:
        if self.k < 1:
            raise MemlmError(f"--k must be at least 1, got {self.k}")
        if self.lmbda is not None and not 0.0 <= self.lmbda <= 1.0:
            raise MemlmError(f"--lambda must be in [0, 1] or auto, got {self.lmbda}")
        if self.temperature is not None and not self.temperature > 0:
            raise MemlmError(f"--knn-temperature must be positive or auto, got {self.temperature}")
        if self.nprobe is not None and self.nprobe < 1:
            raise MemlmError(f"--nprobe must be at least 1, got {self.nprobe}")

    @property
    def needs_tuning(self) -> bool:
        return self.lmbda is None or self.temperature is None

    @property
    def search_options(self) -> SearchOptions:
        """The per-call options of `Searcher.search` these settings ask for."""
        return SearchOptions(nprobe=self.nprobe, exact_rerank=self.exact_rerank)


# -- scoring ----------------------------------------------------------------------------------------


def _as_tensor(a: Any, dtype: torch.dtype) -> torch.Tensor:
    return a.to(dtype) if isinstance(a, torch.Tensor) else torch.from_numpy(np.asarray(a)).to(dtype)


def knn_logprob_from_matches(distances: torch.Tensor, matches: torch.Tensor, temperature: float) -> torch.Tensor:
    """log p_kNN(target) from distances (Q, k) float32 and matches (Q, k) bool (v_j == target).

    Missing neighbours have distance inf (weight 0). Rows without a match, or without neighbours, give -inf.
    """
    logits = -distances.float() / temperature  # (Q, k), -inf where missing
    log_norm = torch.logsumexp(logits, dim=1)  # (Q,)
    log_num = torch.logsumexp(logits.masked_fill(~matches, NEG_INF), dim=1)  # (Q,)
    # Both -inf (no neighbours at all) would give NaN; such a row predicts nothing.
    return torch.where(torch.isfinite(log_norm), log_num - log_norm, torch.full_like(log_num, NEG_INF))


def knn_target_logprob(neighbors: Neighbors, targets: torch.Tensor | np.ndarray, temperature: float) -> torch.Tensor:
    """log p_kNN(target) for each query, computed from its k neighbours only.

    neighbors: (Q, k) arrays from a Searcher; targets: (Q,) token ids. Returns (Q,) float32 (CPU).
    """
    values = _as_tensor(neighbors.values, torch.int64)  # (Q, k)
    targets = _as_tensor(targets, torch.int64).cpu()  # (Q,)
    matches = values == targets[:, None]  # (Q, k)
    return knn_logprob_from_matches(_as_tensor(neighbors.distances, torch.float32), matches, temperature)


def _support_logprobs(neighbors: Neighbors, vocab_size: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, log p_kNN(ids)) (Q, k) int64 and float32 (CPU): each neighbour's stored token (0 where missing) and
    that token's log p_kNN, the weights of repeated tokens summed (-inf where the token has none: a missing
    neighbour's 0 when no neighbour stores token 0). A token's value is the same wherever it repeats, so a
    scatter of these into a (Q, V) row writes each token once, whatever the order."""
    distances = _as_tensor(neighbors.distances, torch.float32)  # (Q, k)
    values = _as_tensor(neighbors.values, torch.int64)  # (Q, k)
    logits = -distances / temperature  # (Q, k)
    row_max = logits.max(dim=1, keepdim=True).values  # (Q, 1)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(logits - row_max)  # (Q, k), 0 where missing
    weights = weights.masked_fill(values < 0, 0.0)
    ids = values.clamp(min=0)  # (Q, k)
    dense = torch.zeros(values.shape[0], vocab_size, dtype=torch.float32)  # (Q, V)
    dense.scatter_add_(1, ids, weights)
    total = dense.sum(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)  # (Q, 1)
    # The log of the k summed weights only: torch.log of the (Q, V) row, mostly zeros, is ~50x slower (the
    # log(0) path, ~1.2 ms a row on one core) than of as many positive numbers.
    return ids, torch.log(dense.gather(1, ids)) - torch.log(total)  # (Q, k), (Q, k)


def knn_log_distribution(neighbors: Neighbors, vocab_size: int, temperature: float) -> torch.Tensor:
    """The full log p_kNN over the vocabulary, for generation: (Q, V) float32 (CPU), -inf off-support."""
    ids, support = _support_logprobs(neighbors, vocab_size, temperature)  # (Q, k), (Q, k)
    dense = torch.full((ids.shape[0], vocab_size), NEG_INF, dtype=torch.float32)  # (Q, V)
    return dense.scatter_(1, ids, support)  # a row without neighbours is all -inf


def knn_mixture(lm_logprob: torch.Tensor, neighbors: Neighbors, temperature: float, lmbda: float) -> torch.Tensor:
    """The kNN-LM's next-token log-distribution (Q, V) for generation: interpolate(lm_logprob,
    knn_log_distribution(neighbors, V, temperature), lmbda) for lm_logprob (Q, V) (any device), computed
    as lm_logprob + log(1 - lambda) off the neighbours' tokens (where the logaddexp with -inf is exactly that)
    and the logaddexp at their k tokens only: no dense p_kNN, no (Q, V) logaddexp."""
    if lmbda == 0.0:
        return lm_logprob
    if lmbda == 1.0:
        return knn_log_distribution(neighbors, lm_logprob.shape[-1], temperature).to(lm_logprob.device)  # (Q, V)
    ids, support = _support_logprobs(neighbors, lm_logprob.shape[-1], temperature)  # (Q, k), (Q, k)
    ids, support = ids.to(lm_logprob.device), support.to(lm_logprob.device)
    mixed = lm_logprob.float() + math.log1p(-lmbda)  # (Q, V)
    return mixed.scatter_(1, ids, interpolate(lm_logprob.gather(1, ids).float(), support, lmbda))


def interpolate(lm_logprob: torch.Tensor, knn_logprob: torch.Tensor, lmbda: float | torch.Tensor) -> torch.Tensor:
    """log(lambda * p_kNN + (1 - lambda) * p_LM), elementwise (any matching shapes, e.g. (Q,) or (Q, V)).

    lmbda: one float, or a tensor broadcasting against lm_logprob (a lambda per token, float64 so that a
    tensor of one value gives the floats of that value as a float, bit for bit). Where lambda is 0 the
    result is lm_logprob itself (bit-identical base); where it is 1, knn_logprob.
    """
    if not isinstance(lmbda, torch.Tensor):
        if lmbda == 0.0:
            return lm_logprob
        if lmbda == 1.0:
            return knn_logprob
        lm = lm_logprob.float() + math.log1p(-lmbda)
        knn = knn_logprob.float().to(lm.device) + math.log(lmbda)
    else:
        lam = lmbda.to(device=lm_logprob.device, dtype=torch.float64)
        lm = lm_logprob.float() + torch.log1p(-lam).float()
        knn = knn_logprob.float().to(lm.device) + torch.log(lam).float()
    # logaddexp(a, -inf) == a; guard the (-inf, -inf) corner explicitly (no NaN, stays -inf).
    both_inf = torch.isneginf(lm) & torch.isneginf(knn)
    mixed = torch.logaddexp(lm, knn)
    mixed = torch.where(both_inf, torch.full_like(mixed, NEG_INF), mixed)
    if isinstance(lmbda, torch.Tensor):
        mixed = torch.where(lam == 0, lm_logprob.float(), torch.where(lam == 1, knn_logprob.float().to(mixed.device), mixed))
    return mixed
