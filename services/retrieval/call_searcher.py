"""The searcher of one server call (or one engine batch): the server's searcher, bounded by its caller.

A RetrievalClient's searches run with the caller's CallOptions (services.retrieval.client): they end by its
deadline, are cancelled once it gives up, and give the model's turn away while they wait, so a slow or hung
retrieval service holds the model no longer than the caller waits and other calls' steps run meanwhile. An
in-process searcher's searches run as they are, on the cores the steps use: a search is part of its step,
and in-process work stops between steps. Either way every search's generation is noted, for the results that
say which datastore generation served them.

Shape legend: Q queries, d key dimension, k neighbours.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from memlm.retrieval.attribution import GenerationSearcher, SourcedNeighbors, require_sourced
from memlm.retrieval.searcher import Neighbors, Searcher, SearcherInfo, SearchOptions
from services.retrieval.client import CallOptions, Found, RetrievalClient, Wants


class CallSearcher:
    """Searcher, GenerationSearcher and SourcedSearcher over `searcher` for one caller (CallOptions: a RetrievalClient's
    bounds; `wants`: what a plain search asks for), noting every answer's generation."""

    def __init__(self, searcher: Searcher, options: CallOptions | Callable[[], CallOptions]) -> None:
        """options: the caller's, or a function read at every search (an engine batch's, which change with its rows)."""
        self._searcher = searcher
        self._options = options if callable(options) else lambda: options
        self.generations: set[int] = set()
        """The datastore generations that answered its searches (not those of Wants.NEIGHBORS searches)."""
        self._last: Found | None = None

    @property
    def dim(self) -> int:
        return self._searcher.dim

    def info(self) -> SearcherInfo:
        return self._searcher.info()

    def search(self, xq: np.ndarray, k: int, options: SearchOptions | None = None) -> Neighbors:
        """Searcher.search: xq (Q, d) -> (Q, k), asking for what the options' `wants` says (kept: take_last)."""
        return self._find(xq, k, options, None).neighbors

    def search_generation(self, xq: np.ndarray, k: int, options: SearchOptions | None = None
                          ) -> tuple[Neighbors, int]:
        """GenerationSearcher.search_generation (a remote pointer walk's, services.retrieval.walk)."""
        found = self._find(xq, k, options, Wants.GENERATION)
        return found.neighbors, found.generation

    def search_sourced(self, xq: np.ndarray, k: int, options: SearchOptions | None = None) -> SourcedNeighbors:
        """SourcedSearcher.search_sourced (attribution); a searcher without documents: one-line MemlmError."""
        return self._find(xq, k, options, Wants.SOURCES).sourced

    def take_last(self) -> Found | None:
        """The latest search's answer since the last take (an engine batch's step: its tokens' generation and
        documents); None when none searched."""
        last, self._last = self._last, None
        return last

    def _find(self, xq: np.ndarray, k: int, options: SearchOptions | None, wants: Wants | None) -> Found:
        call = self._options()
        wants = call.wants if wants is None else wants
        if isinstance(self._searcher, RetrievalClient):
            found = self._searcher.search_call(xq, k, options, call if wants is call.wants
                                               else dataclasses.replace(call, wants=wants))
        else:
            found = _search_in_process(self._searcher, xq, k, options, wants)
        if wants is not Wants.NEIGHBORS:
            self.generations.add(found.generation)
        self._last = found
        return found


def _search_in_process(searcher: Searcher, xq: np.ndarray, k: int, options: SearchOptions | None,
                       wants: Wants) -> Found:
    """An in-process searcher's answer to what `wants` asks (its bounds do not apply: the step is the bound)."""
    if wants is Wants.SOURCES:
        sourced = require_sourced(searcher).search_sourced(xq, k, options)
        return Found(sourced.neighbors, int(sourced.generation), sourced)
    if wants is Wants.GENERATION and isinstance(searcher, GenerationSearcher):
        nb, generation = searcher.search_generation(xq, k, options)
        return Found(nb, int(generation))
    return Found(searcher.search(xq, k, options), 0)  # without generations: 0, as SearchResponse.generation says
