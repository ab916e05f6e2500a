"""kNN-LM evaluation with a chosen interpolation (memlm.retrieval.interpolation): a constant or learned mix of
the LM, the datastore's neighbours and, optionally, a continuous cache of the running document (Grave et al.
2017), and the `--lambda auto --knn-temperature auto` choice among those methods on a tuning split.

The stages: scored windows (memlm.jobs.windows.score_documents, in document order) each take their cache
neighbours from the document's earlier positions (`DocumentCache`, emptied where a document starts), are
grouped for one search call each (`retrieved_groups`), and are then either kept per token for fitting
(`collect_interpolation_data`, the tuning split) or mixed and summed window by window (`interpolation_pass`,
the evaluation split). `choose_method` fits every candidate on the tuning tokens but a held-apart tail
(`held_apart_split`, by document where there are several), keeps the one of lowest NLL on that tail and
fits it again on all the tuning tokens. Full-vocabulary log-probabilities exist for one batch of windows
at a time; a group keeps only (Q, k) neighbours.

Shape legend: Q tokens of a group, n tokens (of a window, or of the tuning split), k neighbours, c cache
neighbours, d key dimension, F features.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from tqdm import tqdm

from memlm.errors import MemlmError
from memlm.jobs.continuous_cache import DEFAULT_CACHE_SIZE
from memlm.jobs.knnlm_eval import DEFAULT_LAMBDAS, Timer, TuningData, timed, tune
from memlm.jobs.windows import ScoredTokens, WindowConfig, score_documents
from memlm.model.decoder import Decoder
from memlm.retrieval.interpolation import (
    ConstantInterpolation,
    FitConfig,
    Method,
    final_logprob,
    fit_learned,
    lm_features,
    method_record,
    token_features,
)
from memlm.retrieval.knnlm import KNNLMConfig, knn_logprob_from_matches
from memlm.retrieval.searcher import Searcher

METHODS = ("constant", "constant+cache", "learned", "learned+cache")
"""The candidates of `--lambda auto --knn-temperature auto`, simplest first (the first wins a tie)."""
HELD_APART = 0.25
"""Share of the tuning tokens held apart to choose among the methods."""


@dataclass(frozen=True)
class CacheConfig:
    """The continuous cache over sliding windows: each token's nearest earlier positions of its document."""

    size: int = DEFAULT_CACHE_SIZE
    """Earlier positions of the document held (the last ones)."""
    k: int = 1024
    """Nearest of them each token reads."""

    def __post_init__(self) -> None:
        if self.size < 1 or self.k < 1:
            raise MemlmError(f"the cache needs size and k of at least 1, got {self.size} and {self.k}")


class DocumentCache:
    """The running document's (key, next token) pairs, for Grave et al.'s cache over sliding windows: a
    token at position t reads the positions t - size .. t - 1 of its document only (the pair at t holds its
    own target)."""

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.doc: int | None = None
        self.keys = torch.empty(0, 0)  # (m, d) float32
        self.values = torch.empty(0, dtype=torch.long)  # (m,)

    def step(self, s: ScoredTokens) -> tuple[torch.Tensor, torch.Tensor]:
        """Squared-L2 distances (n, c) float32 (inf where missing) and next tokens (n, c) int64 (-1 there) of
        the window's tokens' nearest earlier positions; then the window's positions join the cache."""
        if s.doc != self.doc:  # a new document: nothing of the last one is read
            self.doc, self.keys, self.values = s.doc, self.keys[:0], self.values[:0]
        return self.extend(s.keys, s.targets)

    def extend(self, keys: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """step for the next positions of the same document: keys (n, d), targets (n,) (Score's engine rows,
        one text per cache)."""
        q = keys.detach().float().cpu()  # (n, d)
        if self.keys.shape[1:] != q.shape[1:]:  # the first keys of this cache
            self.keys = q[:0]
        n, m = q.shape[0], self.keys.shape[0]
        keys = torch.cat([self.keys, q])  # (m + n, d)
        values = torch.cat([self.values, targets.long().cpu()])  # (m + n,)
        d = (q.pow(2).sum(1, keepdim=True) + keys.pow(2).sum(1)[None] - 2 * q @ keys.T).clamp(min=0)  # (n, m + n)
        # Token i (position p) reads entries at positions p - size .. p - 1: entry j of the m + n is at
        # position p - (m + i - j), so it is read when 0 < m + i - j <= size.
        back = m + torch.arange(n)[:, None] - torch.arange(m + n)[None, :]  # (n, m + n)
        d = d.masked_fill((back <= 0) | (back > self.config.size), math.inf)
        c = self.config.k
        top = torch.topk(d, min(c, m + n), dim=1, largest=False)  # (n, c')
        dist = torch.full((n, c), math.inf)
        vals = torch.full((n, c), -1, dtype=torch.long)
        dist[:, : top.values.shape[1]] = top.values
        vals[:, : top.values.shape[1]] = torch.where(torch.isfinite(top.values), values[top.indices], -1)
        self.keys, self.values = keys[-self.config.size :], values[-self.config.size :]
        return dist, vals  # (n, c) each


class Group(NamedTuple):
    """One search call's windows and what they retrieved."""

    windows: list[ScoredTokens]
    targets: torch.Tensor  # (Q,) int64
    lm: torch.Tensor  # (Q,) float32 log p_LM(target)
    lm_features: torch.Tensor  # (Q, 6) float32 memlm.retrieval.interpolation.lm_features
    knn: tuple[torch.Tensor, torch.Tensor]  # distances (Q, k) float32, values (Q, k) int64
    cache: tuple[torch.Tensor, torch.Tensor] | None  # distances (Q, c), values (Q, c); None without a cache


class Timers:
    """Seconds of each stage: the forward, the search, the cache, the mixing (features and model included)."""

    def __init__(self, device: torch.device) -> None:
        cpu = torch.device("cpu")
        self.forward, self.search, self.cache, self.mix = Timer(device), Timer(cpu), Timer(cpu), Timer(cpu)

    def seconds(self) -> dict[str, float]:
        return {"forward": self.forward.seconds, "search": self.search.seconds, "cache": self.cache.seconds,
                "interpolate": self.mix.seconds}


def retrieved_groups(windows: Iterator[ScoredTokens], searcher: Searcher, knn: KNNLMConfig, cache: CacheConfig | None,
                     search_tokens: int, timers: Timers) -> Iterator[Group]:
    """Windows (carrying lm_features) with their cache neighbours, grouped until search_tokens tokens, each
    group searched once."""
    doc_cache = DocumentCache(cache) if cache is not None else None
    pending: list[ScoredTokens] = []
    cached: list[tuple[torch.Tensor, torch.Tensor]] = []
    tokens = 0

    def emit() -> Group:
        xq = torch.cat([s.keys for s in pending]).float().cpu().numpy()  # (Q, d)
        with timers.search:
            nb = searcher.search(xq, knn.k, knn.search_options)
        c = None if doc_cache is None else (torch.cat([a for a, _ in cached]), torch.cat([b for _, b in cached]))
        return Group(list(pending), torch.cat([s.targets for s in pending]).long(),
                     torch.cat([s.lm_logprob for s in pending]).float(), torch.cat([s.features for s in pending]),
                     (torch.from_numpy(np.asarray(nb.distances, dtype=np.float32)),
                      torch.from_numpy(np.asarray(nb.values).astype(np.int64))), c)

    for s in windows:
        if doc_cache is not None:
            with timers.cache:
                cached.append(doc_cache.step(s))
        pending.append(s)
        tokens += s.targets.shape[0]
        if tokens >= search_tokens:
            yield emit()
            pending, cached, tokens = [], [], 0
    if pending:
        yield emit()


def _matches(group_sources: list[tuple[torch.Tensor, torch.Tensor]], targets: torch.Tensor
             ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(d, v == targets[:, None]) for d, v in group_sources]  # (Q, k) each


# -- tuning data and the choice of a method --------------------------------------------------------


class InterpolationData(NamedTuple):
    """Per tuning token, what every method's fit needs (no full-vocabulary floats)."""

    lm: torch.Tensor  # (n,) float32 log p_LM(target)
    lm_features: torch.Tensor  # (n, 6) float32
    targets: torch.Tensor  # (n,) int64
    docs: torch.Tensor  # (n,) int64 document number
    knn: tuple[torch.Tensor, torch.Tensor]  # distances (n, k) float32, values (n, k) int64
    cache: tuple[torch.Tensor, torch.Tensor]  # distances (n, c) float32, values (n, c) int64

    def rows(self, idx: torch.Tensor) -> InterpolationData:
        return InterpolationData(self.lm[idx], self.lm_features[idx], self.targets[idx], self.docs[idx],
                                 (self.knn[0][idx], self.knn[1][idx]), (self.cache[0][idx], self.cache[1][idx]))

    def sources(self, names: Sequence[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [self.knn if name == "knn" else self.cache for name in names]


def collect_interpolation_data(model: Decoder, token_docs: Sequence[list[int]], searcher: Searcher,
                               window: WindowConfig, knn: KNNLMConfig, cache: CacheConfig, boundary_token: int,
                               progress: bool = True, search_tokens: int = 1024) -> InterpolationData:
    """One forward and one search per group over the tuning documents (never the evaluation split)."""
    timers = Timers(model.device)
    stream = score_documents(model, token_docs, window, boundary_token, with_logprobs=True, lm_features=lm_features)
    parts: list[Group] = []
    total = sum(len(d) for d in token_docs)
    with tqdm(total=total, desc="tune: collect", unit="tok", file=sys.stderr, disable=not progress) as bar:
        for g in retrieved_groups(stream, searcher, knn, cache, search_tokens, timers):
            parts.append(g)
            bar.update(g.targets.shape[0])
    if not parts:
        raise MemlmError("the tuning split has no tokens; pass other --tune-data / --tune-split")
    docs = torch.cat([torch.full((s.targets.shape[0],), s.doc) for g in parts for s in g.windows])
    return InterpolationData(torch.cat([g.lm for g in parts]), torch.cat([g.lm_features for g in parts]),
                             torch.cat([g.targets for g in parts]), docs,
                             (torch.cat([g.knn[0] for g in parts]), torch.cat([g.knn[1] for g in parts])),
                             (torch.cat([g.cache[0] for g in parts]), torch.cat([g.cache[1] for g in parts])))


def held_apart_split(docs: torch.Tensor, share: float = HELD_APART) -> tuple[torch.Tensor, torch.Tensor]:
    """(fit, held) token indices of tokens in document order (docs (n,)): the tail documents holding about
    `share` of the tokens, or, with one document, the tail `share` of its tokens (the fit keeps the rest)."""
    n = docs.shape[0]
    if n < 2:
        raise MemlmError("choosing an interpolation needs at least 2 tuning tokens")
    want = max(1, round(share * n))
    ids, counts = torch.unique_consecutive(docs, return_counts=True)
    cut = n - want
    if ids.shape[0] > 1:  # the document boundary nearest the wanted cut, keeping one document each side
        ends = counts.cumsum(0)[:-1]  # (D-1,) token index where each later document starts
        cut = int(ends[torch.argmin((ends - cut).abs())])
    order = torch.arange(n)
    return order[:cut], order[cut:]


def tune_with_cache(data: InterpolationData, lmbda: float, temperature: float,
                    lambdas: Sequence[float] = DEFAULT_LAMBDAS) -> ConstantInterpolation:
    """The constant three-way mixture of minimum NLL on `data`: the datastore's T as tuned alone, then a grid
    over the datastore's and the cache's weights (summing below 1) for each cache temperature of tune's grid
    (a log2 grid around the median cache distance)."""
    knn_lp = knn_logprob_from_matches(data.knn[0], data.knn[1] == data.targets[:, None], temperature).double()
    cache_m = data.cache[1] == data.targets[:, None]  # (n, c)
    finite = data.cache[0][torch.isfinite(data.cache[0])]
    scale = float(finite.median()) if finite.numel() and float(finite.median()) > 0 else 1.0
    lam = torch.tensor(lambdas, dtype=torch.float64)  # (L,)
    pairs = [(a, b) for a in lam.tolist() for b in lam.tolist() if a + b < 1.0]
    w = torch.tensor([(1.0 - a - b, a, b) for a, b in pairs], dtype=torch.float64)  # (P, 3)
    lm = data.lm.double()  # (n,)
    best = (math.inf, (1.0 - lmbda, lmbda, 0.0), scale)
    for t in [scale * 2.0**i for i in range(-12, 5)]:
        cache_lp = knn_logprob_from_matches(data.cache[0], cache_m, t).double()  # (n,)
        terms = torch.stack([lm, knn_lp, cache_lp])[None] + torch.log(w)[:, :, None]  # (P, 3, n)
        nll = -torch.logsumexp(terms, dim=1).mean(dim=1)  # (P,)
        i = int(torch.argmin(nll))
        if float(nll[i]) < best[0]:
            best = (float(nll[i]), tuple(float(x) for x in w[i]), t)
    return ConstantInterpolation(("knn", "cache"), best[1], (temperature, best[2]))


def fit_method(name: str, data: InterpolationData, config: FitConfig) -> Method:
    """Fit one of METHODS on all of `data`: constant lambda and T by memlm.jobs.knnlm_eval.tune's grid, with
    the cache by `tune_with_cache`; learned ones start from the constant fit of the same sources (fit_learned)."""
    if name not in METHODS:
        raise MemlmError(f"unknown interpolation {name!r}; one of {', '.join(METHODS)}")
    knn_match = data.knn[1] == data.targets[:, None]  # (n, k)
    grid = tune(TuningData(data.lm, data.knn[0], knn_match))
    constant = ConstantInterpolation(("knn",), (1.0 - grid.lmbda, grid.lmbda), (grid.temperature,))
    if name.endswith("+cache"):
        constant = tune_with_cache(data, grid.lmbda, grid.temperature)
    if name.startswith("constant"):
        return constant
    features = token_features(data.lm_features, data.sources(constant.sources), constant.temperatures)  # (n, F)
    return fit_learned(constant, features, data.lm, _matches(data.sources(constant.sources), data.targets), config)


def base_temperatures(method: Method) -> tuple[float, ...]:
    """The temperatures a method's features are computed at."""
    return method.base_temperatures if isinstance(method, torch.nn.Module) else method.temperatures


def method_nll(method: Method, data: InterpolationData) -> float:
    """Mean NLL of the tokens of `data` under `method`."""
    sources = data.sources(method.sources)
    features = token_features(data.lm_features, sources, base_temperatures(method)) if method.needs_features else None
    final = final_logprob(method.plan(features), data.lm, _matches(sources, data.targets))
    return float(-final.double().mean())


class Choice(NamedTuple):
    """What `choose_method` chose, and on what."""

    method: Method  # fitted again on all the tuning tokens
    held_apart: dict[str, float]  # perplexity of each candidate on the held-apart tokens, fitted without them
    fit_tokens: int
    held_tokens: int

    def record(self) -> dict[str, Any]:
        return {**method_record(self.method), "held_apart_perplexity": self.held_apart,
                "fit_tokens": self.fit_tokens, "held_apart_tokens": self.held_tokens,
                "rule": "lowest perplexity on the held-apart tail of the tuning tokens, then fitted on all of them"}


def choose_method(data: InterpolationData, config: FitConfig, methods: Sequence[str] = METHODS) -> Choice:
    """Fit each method on the tuning tokens but the held-apart tail, keep the one of lowest NLL there (the
    first of equals), and fit it again on all the tuning tokens."""
    fit, held = held_apart_split(data.docs)
    fit_data, held_data = data.rows(fit), data.rows(held)
    scores = {name: method_nll(fit_method(name, fit_data, config), held_data) for name in methods}
    best = min(methods, key=lambda name: scores[name])
    return Choice(fit_method(best, data, config), {k: math.exp(v) for k, v in scores.items()},
                  int(fit.shape[0]), int(held.shape[0]))


# -- the evaluation pass ---------------------------------------------------------------------------


def group_logprobs(g: Group, method: Method) -> torch.Tensor:
    """The mixed log-probabilities (Q,) float32 of a group's targets under `method` (the group carries cache
    neighbours when the method mixes the cache)."""
    sources = [g.knn] + ([g.cache] if "cache" in method.sources else [])
    features = token_features(g.lm_features, sources, base_temperatures(method)) if method.needs_features else None
    return final_logprob(method.plan(features), g.lm, _matches(sources, g.targets))  # (Q,)


def interpolation_pass(windows: Iterator[ScoredTokens], total: int, timers: Timers, searcher: Searcher,
                       knn: KNNLMConfig, method: Method, cache: CacheConfig | None, search_tokens: int,
                       progress: bool) -> dict[str, float]:
    """Base and mixed NLL sums (float64, window by window as evaluate_perplexity) over scored windows that
    carry lm_features; the cache is read when the method mixes it."""
    base_nll = mixed_nll = 0.0
    tokens = hits = 0
    use_cache = cache if "cache" in method.sources else None
    with tqdm(total=total, desc=f"eval {method.method}", unit="tok", file=sys.stderr, disable=not progress) as bar:
        for g in retrieved_groups(windows, searcher, knn, use_cache, search_tokens, timers):
            with timers.mix:
                final = group_logprobs(g, method)  # (Q,)
                hits += int((g.knn[1] == g.targets[:, None]).any(dim=1).sum())
                lo = 0
                for s in g.windows:
                    n = s.targets.shape[0]
                    base_nll -= s.lm_logprob.double().sum().item()
                    mixed_nll -= final[lo : lo + n].double().sum().item()
                    lo += n
            tokens += g.targets.shape[0]
            bar.update(g.targets.shape[0])
    return {"base_nll": base_nll, "knnlm_nll": mixed_nll, "tokens": tokens, "hits": hits}


def evaluate_interpolation(model: Decoder, token_docs: Sequence[list[int]], searcher: Searcher, window: WindowConfig,
                           knn: KNNLMConfig, boundary_token: int, method: Method, *, cache: CacheConfig | None = None,
                           search_tokens: int = 1024, progress: bool = True) -> dict[str, Any]:
    """Base and kNN-LM perplexity of `model` on `token_docs` with `method`'s mixture (the same windows and
    sums as memlm.jobs.knnlm_eval.evaluate_knnlm, which a ConstantInterpolation over the datastore alone
    equals bit for bit). knn: k and search options (its lambda and T are not read). Returns tokens,
    base/knnlm perplexity and nll, relative_change, knn_hit_rate, the seconds of each stage, base_tokens_per_s,
    knnlm_tokens_per_s (everything counted), knnlm_speed_ratio and `interpolation` (the method as JSON)."""
    if "cache" in method.sources and cache is None:
        cache = CacheConfig()
    total = sum(len(d) for d in token_docs)
    if total == 0:
        raise MemlmError("nothing to evaluate: the corpus split tokenized to 0 tokens")
    timers = Timers(model.device)
    windows = timed(score_documents(model, token_docs, window, boundary_token, with_logprobs=True,
                                    lm_features=lm_features), timers.forward)
    run = interpolation_pass(windows, total, timers, searcher, knn, method, cache, search_tokens, progress)
    assert run["tokens"] == total, f"scored {run['tokens']} tokens of {total}"
    sec = timers.seconds()
    n, spent = run["tokens"], sum(sec.values())
    base_ppl, ppl = math.exp(run["base_nll"] / n), math.exp(run["knnlm_nll"] / n)
    info = searcher.info()
    return {
        "tokens": n, "base_nll": run["base_nll"], "knnlm_nll": run["knnlm_nll"], "base_perplexity": base_ppl,
        "knnlm_perplexity": ppl, "perplexity": ppl, "relative_change": ppl / base_ppl - 1.0,
        "knn_hit_rate": run["hits"] / n, "forward_seconds": sec["forward"], "search_seconds": sec["search"],
        "cache_seconds": sec["cache"], "interpolate_seconds": sec["interpolate"],
        "base_tokens_per_s": n / sec["forward"] if sec["forward"] > 0 else float("inf"),
        "knnlm_tokens_per_s": n / spent if spent > 0 else float("inf"),
        "knnlm_speed_ratio": sec["forward"] / spent if spent > 0 else 1.0,
        "k": knn.k, "context": window.context, "stride": window.stride, "index": info.index, "datastore_size": info.n,
        **({"cache_size": cache.size, "cache_k": cache.k} if "cache" in method.sources else {}),
        "interpolation": method_record(method),
    }


def evaluate_auto(model: Decoder, token_docs: Sequence[list[int]], searcher: Searcher, window: WindowConfig,
                  knn: KNNLMConfig, boundary_token: int, tune_docs: Sequence[list[int]], *,
                  cache: CacheConfig | None = None, fit: FitConfig | None = None, search_tokens: int = 1024,
                  progress: bool = True) -> tuple[dict[str, Any], Method]:
    """`--lambda auto --knn-temperature auto`: choose the interpolation on `tune_docs` (choose_method; the
    caller guarantees they share no document with `token_docs`), then evaluate it once on `token_docs`.
    Returns (result, method): evaluate_interpolation's result, its `interpolation` also holding the choice
    (interpolation_method: the chosen method's name);
    lambda and temperature are the constant datastore-only fit on all the tuning tokens (the mixture a
    server given one lambda and T uses), whichever method was chosen; tuned, tune_tokens, tune_base_perplexity."""
    cache = cache or CacheConfig()
    data = collect_interpolation_data(model, tune_docs, searcher, window, knn, cache, boundary_token, progress,
                                      search_tokens)
    choice = choose_method(data, fit or FitConfig())
    result = evaluate_interpolation(model, token_docs, searcher, window, knn, boundary_token, choice.method,
                                    cache=cache, search_tokens=search_tokens, progress=progress)
    grid = tune(TuningData(data.lm, data.knn[0], data.knn[1] == data.targets[:, None]))
    result.update(interpolation=choice.record(), interpolation_method=choice.method.method, tuned=True, tune_tokens=int(data.lm.shape[0]),
                  tune_base_perplexity=grid.base_perplexity, exact_rerank=knn.exact_rerank, nprobe=knn.nprobe)
    result["lambda"] = grid.lmbda
    result["temperature"] = grid.temperature
    return result, choice.method
