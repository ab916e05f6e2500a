"""kNN-LM evaluation: score documents with the base LM and kNN-LM in one pass, tune lambda and T on a
separate split, measure recall@k against exact search.

Shape legend: Q queries (scored tokens), k neighbours, V vocab, d key dimension, n tuning tokens.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, Iterator, NamedTuple, Sequence

import numpy as np
import torch
from tqdm import tqdm

from memlm.errors import MemlmError
from memlm.jobs.windows import ScoredTokens, WindowConfig, score_documents
from memlm.model.decoder import Decoder
from memlm.model.device import synchronize
from memlm.retrieval.knnlm import (
    KNNLMConfig,
    interpolate,
    knn_logprob_from_matches,
    knn_target_logprob,
)
from memlm.retrieval.searcher import Searcher, SearchOptions


class _Timer:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds = 0.0

    def __enter__(self) -> "_Timer":
        self._sync()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._sync()
        self.seconds += time.perf_counter() - self._t0

    def _sync(self) -> None:
        synchronize(self.device)


def _timed(stream: Iterator[ScoredTokens], timer: _Timer) -> Iterator[ScoredTokens]:
    """Yield from `stream`, adding the time spent producing each item (the forward) to `timer`."""
    while True:
        with timer:
            item = next(stream, None)
        if item is None:
            return
        yield item


def _groups(stream: Iterator[ScoredTokens], min_tokens: int) -> Iterator[list[ScoredTokens]]:
    """Windows grouped until they hold min_tokens scored tokens: one search call per group."""
    group: list[ScoredTokens] = []
    size = 0
    for scored in stream:
        group.append(scored)
        size += scored.targets.shape[0]
        if size >= min_tokens:
            yield group
            group, size = [], 0
    if group:
        yield group


def _queries(group: list[ScoredTokens]) -> tuple[np.ndarray, torch.Tensor]:
    """The group's keys as float32 numpy (searched, and sampled for the recall check) and targets."""
    xq = torch.cat([s.keys for s in group]).float().cpu().numpy()  # (Q, d)
    targets = torch.cat([s.targets for s in group])  # (Q,)
    return xq, targets


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
        for group in _groups(stream, 1024):
            xq, targets = _queries(group)
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


# -- recall -----------------------------------------------------------------------------------------


def recall_at_k(
    searcher: Searcher,
    exact_searcher: Searcher,
    queries: np.ndarray,
    k: int,
    options: SearchOptions | None = None,
) -> float:
    """Mean fraction of the exact k nearest ids that `searcher` (searched with `options`) also returns,
    over queries (Q, d) float32."""
    approx = searcher.search(queries, k, options).ids  # (Q, k)
    exact = exact_searcher.search(queries, k).ids  # (Q, k)
    hits = 0
    count = 0
    for a, e in zip(approx, exact):
        e = e[e >= 0]
        hits += np.intersect1d(a[a >= 0], e).size
        count += e.size
    return hits / count if count else 1.0


EXACT_RECALL_MAX_BYTES = 8 << 30
"""Largest key matrix (N * d * 2 bytes) a caller copies into a TorchExactSearcher for the recall check."""


class _Pass(NamedTuple):
    """Sums and timings of one kNN-LM pass over the evaluation documents."""

    base_nll: float  # float64 sums, window by window, as evaluate_perplexity
    knn_nll: float
    tokens: int
    hits: int  # tokens whose target is among the neighbours
    forward_seconds: float
    search_seconds: float
    interpolate_seconds: float
    sample: list[np.ndarray]  # up to recall_queries evaluation keys (d,), a seeded uniform sample


def _knn_pass(
    model: Decoder,
    token_docs: Sequence[list[int]],
    searcher: Searcher,
    window_config: WindowConfig,
    knn_config: KNNLMConfig,
    boundary_token: int,
    lmbda: float,
    temperature: float,
    recall_queries: int,
    search_tokens: int,
    progress: bool,
) -> _Pass:
    """One pass: forward (timed), one search per group of windows (timed), interpolation (timed)."""
    forward, search, mix = _Timer(model.device), _Timer(torch.device("cpu")), _Timer(torch.device("cpu"))
    base_nll = knn_nll = 0.0
    scored = hits = seen = 0
    rng = np.random.default_rng(0)
    sample: list[np.ndarray] = []
    stream = _timed(score_documents(model, token_docs, window_config, boundary_token, with_logprobs=True), forward)
    total = sum(len(d) for d in token_docs)
    with tqdm(total=total, desc="eval kNN-LM", unit="tok", file=sys.stderr, disable=not progress) as bar:
        for group in _groups(stream, search_tokens):
            xq, targets = _queries(group)  # (Q, d), (Q,)
            with search:
                nb = searcher.search(xq, knn_config.k, knn_config.search_options)
            with mix:
                knn = knn_target_logprob(nb, targets, temperature)  # (Q,)
                hits += int(torch.isfinite(knn).sum())
                lo = 0
                for s in group:  # per window, summed exactly like evaluate_perplexity
                    n = s.targets.shape[0]
                    base_nll -= s.lm_logprob.double().sum().item()
                    knn_nll -= interpolate(s.lm_logprob, knn[lo : lo + n], lmbda).double().sum().item()
                    lo += n
            scored += xq.shape[0]
            for row in xq:  # reservoir sampling (Algorithm R)
                if len(sample) < recall_queries:
                    sample.append(row)
                else:
                    j = int(rng.integers(0, seen + 1))
                    if j < recall_queries:
                        sample[j] = row
                seen += 1
            bar.update(xq.shape[0])
    return _Pass(base_nll, knn_nll, scored, hits, forward.seconds, search.seconds, mix.seconds, sample)


def _pass_result(run: _Pass) -> dict[str, Any]:
    """Perplexities, hit rate and speeds of one pass (the kNN-LM overhead is its search + interpolation)."""
    scored, forward = run.tokens, run.forward_seconds
    base_ppl, knn_ppl = math.exp(run.base_nll / scored), math.exp(run.knn_nll / scored)
    total = forward + run.search_seconds + run.interpolate_seconds
    return {
        "tokens": scored,
        "base_nll": run.base_nll,
        "knnlm_nll": run.knn_nll,
        "base_perplexity": base_ppl,
        "knnlm_perplexity": knn_ppl,
        "perplexity": knn_ppl,
        "relative_change": knn_ppl / base_ppl - 1.0,
        "knn_hit_rate": run.hits / scored,
        "forward_seconds": forward,
        "search_seconds": run.search_seconds,
        "interpolate_seconds": run.interpolate_seconds,
        "base_tokens_per_s": scored / forward if forward > 0 else float("inf"),
        "knnlm_tokens_per_s": scored / total if total > 0 else float("inf"),
        "knnlm_speed_ratio": forward / total if total > 0 else 1.0,
    }


def evaluate_knnlm(
    model: Decoder,
    token_docs: Sequence[list[int]],
    searcher: Searcher,
    window_config: WindowConfig,
    knn_config: KNNLMConfig,
    boundary_token: int,
    *,
    tune_docs: Sequence[list[int]] | None = None,
    exact_searcher: Searcher | None = None,
    recall_queries: int = 256,
    search_tokens: int = 1024,
    progress: bool = True,
) -> dict[str, Any]:
    """Base and kNN-LM perplexity of `model` on `token_docs`, side by side.

    model, token_docs, window_config, boundary_token: as `memlm.jobs.evaluate.evaluate_perplexity` (the same
        windows, so base_perplexity equals its perplexity exactly).
    searcher: the datastore (any Searcher); its keys must come from this model and key layer.
    knn_config: k, lambda, T, exact re-rank, nprobe; lambda/T None are tuned on tune_docs first.
    tune_docs: a tuning split, disjoint from token_docs; required when knn_config.needs_tuning.
    exact_searcher: ground truth for recall (e.g. `Datastore.exact_searcher()`, built by the caller, who
        knows whether the keys fit in memory); None: recall is not measured.
    recall_queries: evaluation keys (seeded random sample) on which recall@k is measured; 0: skip.
    search_tokens: scored tokens gathered per search call (bigger batches search faster).

    Returns a dict: tokens, base_nll, knnlm_nll, base_perplexity, knnlm_perplexity, perplexity (= kNN-LM),
    relative_change (knnlm / base - 1), lambda, temperature, tuned, tune_tokens, tune_base_perplexity,
    tune_knnlm_perplexity, k, exact_rerank, nprobe, knn_hit_rate (share of tokens with the target among
    the neighbours), forward_seconds, search_seconds, interpolate_seconds, base_tokens_per_s,
    knnlm_tokens_per_s, knnlm_speed_ratio, index, datastore_size (from searcher.info()), and with an
    exact_searcher recall_at_k, recall_at_10, recall_k, recall_queries.
    """
    if knn_config.needs_tuning and not tune_docs:
        raise MemlmError("--lambda auto / --temperature auto need a tuning split (--tune-data); "
                         "they are never tuned on the evaluation split")
    total = sum(len(d) for d in token_docs)
    if total == 0:
        raise MemlmError("nothing to evaluate: the corpus split tokenized to 0 tokens")
    result: dict[str, Any] = {"tuned": False, "tune_tokens": 0}
    lmbda, temperature = knn_config.lmbda, knn_config.temperature
    if knn_config.needs_tuning:
        data = collect_tuning_data(model, tune_docs, searcher, window_config, knn_config, boundary_token, progress)
        tuned = tune(data, fixed_lmbda=knn_config.lmbda, fixed_temperature=knn_config.temperature)
        lmbda, temperature = tuned.lmbda, tuned.temperature
        result.update(tuned=True, tune_tokens=int(data.lm_logprob.shape[0]),
                      tune_base_perplexity=tuned.base_perplexity, tune_knnlm_perplexity=tuned.perplexity)
    assert lmbda is not None and temperature is not None

    run = _knn_pass(model, token_docs, searcher, window_config, knn_config, boundary_token, lmbda, temperature,
                    recall_queries, search_tokens, progress)
    assert run.tokens == total, f"scored {run.tokens} tokens of {total}"
    info = searcher.info()
    result.update(_pass_result(run), k=knn_config.k, exact_rerank=knn_config.exact_rerank, nprobe=knn_config.nprobe,
                  context=window_config.context, stride=window_config.stride, index=info.index,
                  datastore_size=info.n)
    result["lambda"] = lmbda
    result["temperature"] = temperature
    if exact_searcher is not None and run.sample:
        result.update(_recall(searcher, exact_searcher, np.stack(run.sample), knn_config))
    return result


def _recall(searcher: Searcher, exact_searcher: Searcher, queries: np.ndarray, knn_config: KNNLMConfig) -> dict:
    """recall_k, recall_at_k, recall_at_10, recall_queries over sampled evaluation keys (R, d), searched with
    the options of the evaluation itself: recall says how good the neighbours it used were."""
    options, k = knn_config.search_options, knn_config.k
    return {
        "recall_k": k,
        "recall_at_k": recall_at_k(searcher, exact_searcher, queries, k, options),
        "recall_at_10": recall_at_k(searcher, exact_searcher, queries, min(10, k), options),
        "recall_queries": int(queries.shape[0]),
    }
