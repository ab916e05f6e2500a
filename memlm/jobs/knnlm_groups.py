"""kNN-LM evaluation, first stage: scored windows (memlm.jobs.windows) -> groups of queries, one search call
per group (bigger batches search faster), with the adaptive gate's decision for each token and the time
each stage takes.

Shape legend: Q queries (scored tokens) of a group, d key dimension, n tokens of one window.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Self

import numpy as np
import torch

from memlm.jobs.windows import ScoredTokens
from memlm.model.device import synchronize
from memlm.retrieval.adaptive import AdaptiveConfig


class Timer:
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

