"""kNN-LM evaluation, tuning: one pass of the LM and the searcher over a tuning split (never the evaluation
split) collects what lambda and T need per token, then a grid search over them needs no new forwards.

Shape legend: n tuning tokens, k neighbours, L lambdas of the grid.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from tqdm import tqdm

from memlm.errors import MemlmError
from memlm.jobs.knnlm_groups import groups, queries
from memlm.jobs.windows import WindowConfig, score_documents
from memlm.model.decoder import Decoder
from memlm.retrieval.knnlm import KNNLMConfig, knn_logprob_from_matches
from memlm.retrieval.searcher import Searcher


class TuningData(NamedTuple):
    """What tuning needs from each tuning token; lambda and T are then searched without new forwards."""

    lm_logprob: torch.Tensor  # (n,) float32 log p_LM(target)
    distances: torch.Tensor  # (n, k) float32 neighbour distances (inf where missing)
    matches: torch.Tensor  # (n, k) bool, neighbour value == target


def collect_tuning_data(
    model: Decoder,
    token_docs: Sequence[list[int]],
    searcher: Searcher,
    window_config: WindowConfig,
    knn_config: KNNLMConfig,
    boundary_token: int,
    progress: bool = True,
) -> TuningData:
    """Run the LM and the searcher once over the tuning documents (never the evaluation split)."""
    lm, dist, match = [], [], []
    total = sum(len(d) for d in token_docs)
    stream = score_documents(model, token_docs, window_config, boundary_token, with_logprobs=True)
    with tqdm(total=total, desc="tune: collect", unit="tok", file=sys.stderr, disable=not progress) as bar:
        for group in groups(stream, 1024):
            xq, targets = queries(group)
            nb = searcher.search(xq, knn_config.k, knn_config.search_options)
            lm.append(torch.cat([s.lm_logprob for s in group]).float())
            dist.append(torch.from_numpy(nb.distances.astype(np.float32)))
            match.append(torch.from_numpy(nb.values.astype(np.int64)) == targets[:, None])
            bar.update(targets.shape[0])
    if not lm:
        raise MemlmError("the tuning split has no tokens; pass other --tune-data / --tune-split")
    return TuningData(torch.cat(lm), torch.cat(dist), torch.cat(match))


class Tuned(NamedTuple):
    lmbda: float
    temperature: float
    perplexity: float  # kNN-LM perplexity on the tuning split at (lmbda, temperature)
    base_perplexity: float  # LM perplexity on the tuning split


DEFAULT_LAMBDAS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6, 0.65,
                   0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 0.99)


def tune(
    data: TuningData,
    lambdas: Sequence[float] | None = None,
    temperatures: Sequence[float] | None = None,
    fixed_lmbda: float | None = None,
    fixed_temperature: float | None = None,
) -> Tuned:
    """Grid search of lambda and T minimising perplexity on the tuning data.

    temperatures: default a log2 grid from 2^-12 to 2^4 times the median neighbour distance (distances
    are squared L2, whose scale depends on the model and the key layer), refined around the best point.
    fixed_*: keep that parameter as given and tune only the other.
    """
    lambdas = [fixed_lmbda] if fixed_lmbda is not None else list(lambdas or DEFAULT_LAMBDAS)
    finite = data.distances[torch.isfinite(data.distances)]
    scale = float(finite.median()) if finite.numel() else 1.0
    scale = scale if scale > 0 else 1.0
    if fixed_temperature is not None:
        grid = [fixed_temperature]
    else:
        grid = list(temperatures) if temperatures is not None else [scale * 2.0**i for i in range(-12, 5)]
    lam = torch.tensor(lambdas, dtype=torch.float64)  # (L,)
    lm = data.lm_logprob.double()  # (n,)
    n = lm.shape[0]

    def score(t: float) -> tuple[float, float]:
        knn = knn_logprob_from_matches(data.distances, data.matches, t).double()  # (n,)
        with torch.no_grad():
            a = lm[None, :] + torch.log1p(-lam.clamp(max=1 - 1e-12))[:, None]  # (L, n)
            b = knn[None, :] + torch.log(lam.clamp(min=1e-300))[:, None]  # (L, n)
            mixed = torch.logaddexp(a, b)
            mixed[lam == 0] = lm  # exact base for lambda 0
            nll = -mixed.sum(dim=1) / n  # (L,)
        best = int(torch.argmin(nll))
        return float(nll[best]), lambdas[best]

    results = {t: score(t) for t in grid}
    if fixed_temperature is None and temperatures is None:
        t_best = min(results, key=lambda t: results[t][0])
        for f in (2**-0.5, 2**-0.25, 2**0.25, 2**0.5):
            results[t_best * f] = score(t_best * f)
    t_best = min(results, key=lambda t: results[t][0])
    nll, l_best = results[t_best]
    return Tuned(float(l_best), float(t_best), math.exp(nll), math.exp(float(-lm.mean())))
