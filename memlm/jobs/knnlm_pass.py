"""kNN-LM evaluation, the pass: groups of scored windows (memlm.jobs.knnlm_groups) -> searches (all tokens,
the ones the adaptive gate lets search, or RetoMaton's pointer walk, memlm.jobs.pointer_walk) ->
interpolation -> sums, counts and timings.

Shape legend: Q queries (scored tokens) of a group, k neighbours, d key dimension, n tokens of one window.
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

from memlm.jobs.knnlm_groups import Timer, gated_groups, queries, timed, with_gate
from memlm.jobs.pointer_walk import walk
from memlm.jobs.windows import ScoredTokens, WindowConfig, score_documents
from memlm.model.decoder import Decoder
from memlm.retrieval.adaptive import AdaptiveConfig, distribution_features
from memlm.retrieval.attribution import AttributionWriter, slice_sourced, sourced_knn
from memlm.retrieval.knnlm import NEG_INF, KNNLMConfig, interpolate, knn_target_logprob
from memlm.retrieval.pointers import PointerConfig, PointerSource
from memlm.retrieval.searcher import Searcher


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
    """How an evaluation retrieves (issue 15): a search for every token (all None), only where a gate lets
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
    how: Retrieval,
    attribution: AttributionWriter | None = None,
) -> Pass:
    """One pass: forward (timed), searches per group of windows (timed), interpolation (timed); with
    pointers the group is walked (memlm.jobs.pointer_walk), with a gate only the tokens it lets search."""
    timers = PassTimers(model.device)
    features = distribution_features if how.adaptive is not None else None
    windows = timed(score_documents(model, token_docs, window_config, boundary_token, with_logprobs=True,
                                    lm_features=features), timers.forward)
    return knn_pass_over(windows, sum(len(d) for d in token_docs), timers, searcher, knn_config, lmbda,
                         temperature, recall_queries, search_tokens, progress, how, attribution)


def knn_pass_over(
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
    """knn_pass over scored windows already made (`windows`, `total` tokens; with a gate they carry
    distribution_features): benchmarks/search_savings.py replays one forward under every setting. The
    forward's time is whatever the caller put in timers.forward (knn_pass: the decoder, timed)."""
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
            if attribution is not None:  # every token searched, with its neighbours' documents (issue 14)
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
                    mixed = interpolate(s.lm_logprob, knn[lo : lo + n], lmbda)  # (n,)
                    mixed = torch.where(keep_base[lo : lo + n], s.lm_logprob, mixed)  # skipped: lambda 0
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
