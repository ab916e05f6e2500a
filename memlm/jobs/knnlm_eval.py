"""kNN-LM evaluation (Khandelwal et al. 2020): base and kNN-LM perplexity of a corpus split in one pass, lambda
and T tuned on a separate split, and recall@k of the searcher against exact search.

The stages, in data-flow order: scored windows (memlm.jobs.windows.score_documents, whose per-token scores are
memlm.jobs.token_scores') are grouped until a group fills one search call (`gated_groups`, with the adaptive
gate's decision per token); lambda and T come from a grid search over one pass of a tuning split
(`collect_tuning_data`, `tune`); the evaluation pass (`knn_pass`) searches each group (every token, the ones
the gate lets search, or RetoMaton's pointer walk, memlm.jobs.pointer_walk) and mixes the base log-probabilities
with p_kNN (memlm.jobs.token_scores.knn_final); `recall_result` checks sampled keys against exact search.

Shape legend: Q queries (scored tokens) of a group, k neighbours, d key dimension, n tokens of one window
(or tuning tokens), L lambdas of the grid, R sampled evaluation keys.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Self

import numpy as np
import torch
from tqdm import tqdm

from memlm.errors import MemlmError
from memlm.jobs.pointer_walk import walk
from memlm.jobs.token_scores import knn_final
from memlm.jobs.windows import ScoredTokens, WindowConfig, score_documents
from memlm.model.decoder import Decoder
from memlm.model.device import synchronize
from memlm.retrieval.adaptive import AdaptiveConfig, distribution_features
from memlm.retrieval.attribution import AttributionWriter, slice_sourced, sourced_knn
from memlm.retrieval.knnlm import NEG_INF, KNNLMConfig, knn_logprob_from_matches, knn_target_logprob
from memlm.retrieval.pointers import PointerConfig, PointerSource
from memlm.retrieval.searcher import Searcher, SearchOptions


# -- groups of scored windows, one search call each ------------------------------------------------


class Timer:
    """Seconds spent inside `with timer:` blocks, the device synchronized at both ends."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds = 0.0

    def __enter__(self) -> Self:
        self._sync()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self._sync()
        self.seconds += time.perf_counter() - self._t0

    def _sync(self) -> None:
        synchronize(self.device)


def timed(stream: Iterator[ScoredTokens], timer: Timer) -> Iterator[ScoredTokens]:
    """Yield from `stream`, adding the time spent producing each item (the forward) to `timer`."""
    while True:
        with timer:
            item = next(stream, None)
        if item is None:
            return
        yield item


def groups(stream: Iterator[ScoredTokens], min_tokens: int) -> Iterator[list[ScoredTokens]]:
    """Windows grouped until they hold min_tokens scored tokens: one search call per group."""
    for group in gated_groups(((s, None) for s in stream), min_tokens, min_tokens):
        yield [s for s, _ in group]


Gated = tuple[ScoredTokens, "np.ndarray | None"]
"""A window and which of its tokens the adaptive gate lets search ((n,) bool; None: no gate)."""


def gated_groups(stream: Iterator[Gated], min_searched: int, max_tokens: int) -> Iterator[list[Gated]]:
    """Windows grouped until they hold min_searched tokens that may search (all of them without a gate),
    or max_tokens tokens: a gate that skips most tokens still gets full search calls."""
    group: list[Gated] = []
    searched = tokens = 0
    for item in stream:
        group.append(item)
        n = item[0].targets.shape[0]
        tokens += n
        searched += n if item[1] is None else int(item[1].sum())
        if searched >= min_searched or tokens >= max_tokens:
            yield group
            group, searched, tokens = [], 0, 0
    if group:
        yield group


def with_gate(stream: Iterator[ScoredTokens], adaptive: AdaptiveConfig | None, timer: Timer) -> Iterator[Gated]:
    """Each window with the gate's decision for its tokens (timed), or None without a gate."""
    for s in stream:
        if adaptive is None:
            yield s, None
            continue
        with timer:  # (not around the yield: the consumer's time would count as the gate's)
            allowed = adaptive.allowed(s.features, s.keys).numpy()  # (n,)
        yield s, allowed


def queries(group: list[ScoredTokens]) -> tuple[np.ndarray, torch.Tensor]:
    """The group's keys as float32 numpy (searched, and sampled for the recall check) and targets."""
    xq = torch.cat([s.keys for s in group]).float().cpu().numpy()  # (Q, d)
    targets = torch.cat([s.targets for s in group])  # (Q,)
    return xq, targets


# -- lambda and T from a tuning split --------------------------------------------------------------


class TuningData(NamedTuple):
    """What tuning needs from each tuning token; lambda and T are then searched without new forwards."""

    lm_logprob: torch.Tensor  # (n,) float32 log p_LM(target)
    distances: torch.Tensor  # (n, k) float32 neighbour distances (inf where missing)
    matches: torch.Tensor  # (n, k) bool, neighbour value == target


def collect_tuning_data(
    windows: Iterator[ScoredTokens], total: int, searcher: Searcher, knn_config: KNNLMConfig, progress: bool = True,
) -> TuningData:
    """Search the keys of the tuning split's scored windows (score_documents of the tuning documents, never the
    evaluation split; `total` tokens) once, keeping what lambda and T need per token."""
    lm, dist, match = [], [], []
    with tqdm(total=total, desc="tune: collect", unit="tok", file=sys.stderr, disable=not progress) as bar:
        for group in groups(windows, 1024):
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


# -- the evaluation pass ---------------------------------------------------------------------------


class Pass(NamedTuple):
    """Sums, counts and timings of one kNN-LM pass over the evaluation documents."""

    base_nll: float  # float64 sums, window by window, as evaluate_perplexity
    knn_nll: float
    tokens: int
    hits: int  # tokens whose target is among the neighbours
    searches: int  # tokens searched (a search is one query row)
    skipped: int  # tokens the adaptive gate kept on the base distribution
    stream_searches: int  # searches at the first token of a pointer stream
    seconds: dict[str, float]  # forward, search, interpolate, pointer, gate
    sample: list[np.ndarray]  # up to recall_queries evaluation keys (d,), a seeded uniform sample


@dataclass(frozen=True)
class Retrieval:
    """How an evaluation retrieves: a search for every token (all None), only where a gate lets
    it (adaptive), by pointers with a search where they run out (RetoMaton), or both."""

    pointers: PointerConfig | None = None
    """RetoMaton's walk; None: no pointers."""
    source: PointerSource | None = None
    """The datastore's successors, values and keys the walk reads; given exactly when pointers are."""
    adaptive: AdaptiveConfig | None = None
    """The fitted gate and its threshold; None: no gate."""

    def __post_init__(self) -> None:
        if (self.pointers is None) != (self.source is None):
            raise ValueError("RetoMaton pointers need both a PointerConfig and a PointerSource")


class PassTimers:
    """The time of each stage of a pass (forward, search, interpolate, pointer walk, gate)."""

    def __init__(self, device: torch.device) -> None:
        cpu = torch.device("cpu")
        self.forward, self.search, self.mix = Timer(device), Timer(cpu), Timer(cpu)
        self.walk, self.gate = Timer(cpu), Timer(cpu)
        self.walk_search = 0.0  # search time spent inside the walk (counted as search, not as pointer time)

    def seconds(self) -> dict[str, float]:
        return {"forward": self.forward.seconds, "search": self.search.seconds, "interpolate": self.mix.seconds,
                "pointer": self.walk.seconds - self.walk_search, "gate": self.gate.seconds}


def _group_knn(group: list[ScoredTokens], allowed: np.ndarray | None, xq: np.ndarray, targets: torch.Tensor,
               searcher: Searcher, knn_config: KNNLMConfig, temperature: float, how: Retrieval, timers: PassTimers
               ) -> tuple[torch.Tensor, np.ndarray, int, int]:
    """log p_kNN of the group's targets (Q,), which tokens keep the base (Q,) bool, searches, stream searches.
    allowed: (Q,) bool, the tokens the gate lets search (None: all)."""
    k, options = knn_config.k, knn_config.search_options
    if how.pointers is not None:
        docs = np.concatenate([np.full(s.targets.shape[0], s.doc) for s in group])  # (Q,)
        before = timers.search.seconds
        with timers.walk:
            walked = walk(xq, targets.numpy(), docs, searcher, k, options, temperature, how.pointers, how.source,
                          allowed, timers.search)
        timers.walk_search += timers.search.seconds - before
        return walked.knn_logprob, walked.skipped, int(walked.searched.sum()), walked.stream_searches
    if allowed is None:
        with timers.search:
            nb = searcher.search(xq, k, options)
        with timers.mix:
            return knn_target_logprob(nb, targets, temperature), np.zeros(xq.shape[0], bool), xq.shape[0], 0
    rows = np.flatnonzero(allowed)  # (q,)
    knn = torch.full((xq.shape[0],), NEG_INF)  # (Q,)
    if rows.size:
        with timers.search:
            nb = searcher.search(xq[rows], k, options)
        with timers.mix:
            knn[torch.from_numpy(rows)] = knn_target_logprob(nb, targets[rows], temperature)
    return knn, ~allowed, int(rows.size), 0


GATED_GROUPS = 8
"""With a gate, evaluation tokens held per group at most, in multiples of search_tokens (a gate that skips
7 of 8 tokens still fills a search call of search_tokens queries)."""


def knn_pass(
    windows: Iterator[ScoredTokens],
    total: int,
    timers: PassTimers,
    searcher: Searcher,
    knn_config: KNNLMConfig,
    lmbda: float,
    temperature: float,
    recall_queries: int,
    search_tokens: int,
    progress: bool,
    how: Retrieval,
    attribution: AttributionWriter | None = None,
) -> Pass:
    """One pass over scored windows (`windows`, `total` tokens; with a gate they carry distribution_features):
    searches per group of windows (timed), interpolation (timed); with pointers the group is walked
    (memlm.jobs.pointer_walk), with a gate only the tokens it lets search. The forward's time is whatever the
    caller put in timers.forward (evaluate_knnlm: the decoder, timed; benchmarks/search_savings.py replays one
    forward under every setting)."""
    base_nll = knn_nll = 0.0
    scored = hits = seen = searches = skipped = first = 0
    rng = np.random.default_rng(0)
    sample: list[np.ndarray] = []
    stream = windows
    if how.pointers is None:  # search_tokens searched per call, at most GATED_GROUPS times as many tokens held
        grouped = gated_groups(with_gate(stream, how.adaptive, timers.gate), search_tokens,
                                GATED_GROUPS * search_tokens)
    else:  # the walk's group: its streams' tokens
        grouped = gated_groups(with_gate(stream, how.adaptive, timers.gate), how.pointers.group_tokens,
                                how.pointers.group_tokens)
    with tqdm(total=total, desc="eval kNN-LM", unit="tok", file=sys.stderr, disable=not progress) as bar:
        for pairs in grouped:
            group = [s for s, _ in pairs]
            allowed = None if how.adaptive is None else np.concatenate([a for _, a in pairs])  # (Q,)
            xq, targets = queries(group)  # (Q, d), (Q,)
            if attribution is not None:  # every token searched, with its neighbours' documents
                with timers.search:
                    knn, found = sourced_knn(searcher, xq, targets, knn_config.k, knn_config.search_options,
                                             temperature)
                base_only, n_search, n_first = np.zeros(xq.shape[0], bool), xq.shape[0], 0
            else:
                knn, base_only, n_search, n_first = _group_knn(group, allowed, xq, targets, searcher, knn_config,
                                                               temperature, how, timers)
            searches, first, skipped = searches + n_search, first + n_first, skipped + int(base_only.sum())
            with timers.mix:
                hits += int(torch.isfinite(knn).sum())
                keep_base = torch.from_numpy(base_only)  # (Q,)
                lo = 0
                for s in group:  # per window, summed exactly like evaluate_perplexity
                    n = s.targets.shape[0]
                    base_nll -= s.lm_logprob.double().sum().item()
                    mixed = knn_final(s.lm_logprob, knn[lo : lo + n], lmbda, keep_base[lo : lo + n])  # (n,)
                    knn_nll -= mixed.double().sum().item()
                    if attribution is not None:
                        attribution.write(s.doc, s.positions.numpy(), s.targets.numpy(), s.lm_logprob.numpy(),
                                          mixed.numpy(), slice_sourced(found, slice(lo, lo + n)), temperature, lmbda)
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
    return Pass(base_nll, knn_nll, scored, hits, searches, skipped, first, timers.seconds(), sample)


def pass_result(run: Pass) -> dict[str, Any]:
    """Perplexities, hit rate, searches and speeds of one pass (the kNN-LM overhead is everything but the
    forward: search, interpolation, the pointer walk and the gate)."""
    scored, sec = run.tokens, run.seconds
    forward = sec["forward"]
    base_ppl, knn_ppl = math.exp(run.base_nll / scored), math.exp(run.knn_nll / scored)
    total = sum(sec.values())
    return {
        "tokens": scored,
        "base_nll": run.base_nll,
        "knnlm_nll": run.knn_nll,
        "base_perplexity": base_ppl,
        "knnlm_perplexity": knn_ppl,
        "perplexity": knn_ppl,
        "relative_change": knn_ppl / base_ppl - 1.0,
        "knn_hit_rate": run.hits / scored,
        "searches": run.searches,
        "searches_saved": scored - run.searches,
        "searches_saved_fraction": (scored - run.searches) / scored,
        "forward_seconds": forward,
        "search_seconds": sec["search"],
        "interpolate_seconds": sec["interpolate"],
        "pointer_seconds": sec["pointer"],
        "gate_seconds": sec["gate"],
        "base_tokens_per_s": scored / forward if forward > 0 else float("inf"),
        "knnlm_tokens_per_s": scored / total if total > 0 else float("inf"),
        "knnlm_speed_ratio": forward / total if total > 0 else 1.0,
    }


# -- recall of the searcher ------------------------------------------------------------------------


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
"""Most memory a TorchExactSearcher for the recall check may take (memlm.retrieval.exact.searcher_bytes)."""



def recall_result(searcher: Searcher, exact_searcher: Searcher, queries: np.ndarray, knn_config: KNNLMConfig) -> dict:
    """recall_k, recall_at_k, recall_at_10, recall_queries over sampled evaluation keys (R, d), searched with
    the options of the evaluation itself: recall says how good the neighbours it used were."""
    options, k = knn_config.search_options, knn_config.k
    return {
        "recall_k": k,
        "recall_at_k": recall_at_k(searcher, exact_searcher, queries, k, options),
        "recall_at_10": recall_at_k(searcher, exact_searcher, queries, min(10, k), options),
        "recall_queries": int(queries.shape[0]),
    }


# -- the whole evaluation --------------------------------------------------------------------------


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
    retrieval: Retrieval | None = None,
    attribution: AttributionWriter | None = None,
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
    retrieval: fewer searches (None: a search for every token): RetoMaton pointers (retrieval.pointers with retrieval.source, the
        datastore's successors, values and keys) and/or adaptive retrieval (retrieval.adaptive, a fitted gate
        and its threshold); lambda and T are tuned (when auto) with a search for every tuning token.
    attribution: write every evaluated token's top documents as it goes (memlm.retrieval.attribution); needs a
        search for every token (no pointers, no gate) and a searcher with a documents table.

    Returns a dict: tokens, base_nll, knnlm_nll, base_perplexity, knnlm_perplexity, perplexity (= kNN-LM),
    relative_change (knnlm / base - 1), lambda, temperature, tuned, tune_tokens, tune_base_perplexity,
    tune_knnlm_perplexity, k, exact_rerank, nprobe, knn_hit_rate (share of tokens with the target among
    the neighbours), forward_seconds, search_seconds, interpolate_seconds, base_tokens_per_s,
    knnlm_tokens_per_s, knnlm_speed_ratio, index, datastore_size (from searcher.info()), searches (query
    rows searched), searches_saved (tokens - searches), searches_saved_fraction, pointer_seconds and
    gate_seconds (0 without them); with pointers min_pointers, pointer_tokens (tokens scored from pointers
    alone) and stream_searches; with a gate adaptive_threshold and adaptive_skipped; and with an
    exact_searcher recall_at_k, recall_at_10, recall_k, recall_queries.
    """
    retrieval = retrieval or Retrieval()
    if attribution is not None and retrieval != Retrieval():
        raise MemlmError("--attribution needs a search for every token: not with RetoMaton pointers or a gate")
    if knn_config.needs_tuning and not tune_docs:
        raise MemlmError("--lambda auto / --temperature auto need a tuning split (--tune-data); "
                         "they are never tuned on the evaluation split")
    total = sum(len(d) for d in token_docs)
    if total == 0:
        raise MemlmError("nothing to evaluate: the corpus split tokenized to 0 tokens")
    result: dict[str, Any] = {"tuned": False, "tune_tokens": 0}
    lmbda, temperature = knn_config.lmbda, knn_config.temperature
    if knn_config.needs_tuning:
        tune_windows = score_documents(model, tune_docs, window_config, boundary_token, with_logprobs=True)
        data = collect_tuning_data(tune_windows, sum(len(d) for d in tune_docs), searcher, knn_config, progress)
        tuned = tune(data, fixed_lmbda=knn_config.lmbda, fixed_temperature=knn_config.temperature)
        lmbda, temperature = tuned.lmbda, tuned.temperature
        result.update(tuned=True, tune_tokens=int(data.lm_logprob.shape[0]),
                      tune_base_perplexity=tuned.base_perplexity, tune_knnlm_perplexity=tuned.perplexity)
    assert lmbda is not None and temperature is not None

    timers = PassTimers(model.device)
    features = distribution_features if retrieval.adaptive is not None else None  # the gate's inputs
    windows = timed(score_documents(model, token_docs, window_config, boundary_token, with_logprobs=True,
                                    lm_features=features), timers.forward)
    run = knn_pass(windows, total, timers, searcher, knn_config, lmbda, temperature, recall_queries, search_tokens,
                   progress, retrieval, attribution)
    assert run.tokens == total, f"scored {run.tokens} tokens of {total}"
    info = searcher.info()
    result.update(pass_result(run), k=knn_config.k, exact_rerank=knn_config.exact_rerank, nprobe=knn_config.nprobe,
                  context=window_config.context, stride=window_config.stride, index=info.index,
                  datastore_size=info.n)
    result["lambda"] = lmbda
    result["temperature"] = temperature
    if retrieval.pointers is not None:
        result.update(min_pointers=retrieval.pointers.min_pointers, stream_searches=run.stream_searches,
                      pointer_tokens=run.tokens - run.searches - run.skipped,
                      pointer_distances="exact" if retrieval.source.keys is not None else "carried")
    if retrieval.adaptive is not None:
        result.update(adaptive_threshold=retrieval.adaptive.threshold, adaptive_skipped=run.skipped)
    if exact_searcher is not None and run.sample:
        result.update(recall_result(searcher, exact_searcher, np.stack(run.sample), knn_config))
    return result
