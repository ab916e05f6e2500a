"""A RetoMaton pointer walk through the retrieval service, held to one datastore generation.

The walk (memlm.jobs.pointer_walk) follows datastore rows: the ids of a search's neighbours, then their
successors, then theirs. Rows are numbers of one generation of a live datastore: `memlm datastore add`,
`remove` and `compact` commit a new one, and compaction renumbers rows, so ids found in one
generation and looked up in another name other documents' entries (the walk would follow them silently).
`OneGeneration` is both the walk's Searcher and its SuccessorLookup (memlm.retrieval.pointers): it notes
the generation of the first answer and refuses any other with ServiceError ABORTED (retry the call), as
the client refuses a sourced search split over two generations.

Shape legend: Q queries, d key dimension, k neighbours, M ids.
"""

from __future__ import annotations

import grpc
import numpy as np

from memlm.retrieval.attribution import GenerationSearcher
from memlm.retrieval.searcher import Neighbors, SearcherInfo, SearchOptions
from services.retrieval.client import RetrievalClient
from services.common.server import ServiceError


class OneGeneration:
    """One walk's searches (through `searcher`: the client, or a call's bounded searcher) and successor
    lookups (the client's Successors rpc), all answered by one generation. One walk, one thread: it holds
    the generation it met first and is not shared between calls."""

    def __init__(self, searcher: GenerationSearcher, client: RetrievalClient) -> None:
        self._searcher = searcher
        self._client = client
        self.generation: int | None = None
        """The generation of the walk's first answer; None before it."""

    def through(self, searcher: GenerationSearcher) -> OneGeneration:
        """A fresh walk whose searches go through `searcher` (a call's own), with this one's lookups."""
        return OneGeneration(searcher, self._client)

    @property
    def dim(self) -> int:
        return self._searcher.info().dim

    def info(self) -> SearcherInfo:
        return self._searcher.info()

    def search(self, xq: np.ndarray, k: int, options: SearchOptions | None = None) -> Neighbors:
        """Searcher.search: xq (Q, d) -> (Q, k), refused when another generation answered."""
        return self.search_generation(xq, k, options)[0]

    def search_generation(self, xq: np.ndarray, k: int, options: SearchOptions | None = None
                          ) -> tuple[Neighbors, int]:
        """GenerationSearcher.search_generation, refused when another generation answered."""
        found, generation = self._searcher.search_generation(xq, k, options)
        if len(xq) > 0:  # an empty search is answered locally with generation 0: no server said which it read
            self._hold(generation)
        return found, generation

    def successors_of(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """SuccessorLookup.successors_of: ids (M,) -> (next_ids (M,) int64, next_values (M,) int32), refused
        when the lookup was answered by another generation than the walk's searches."""
        if len(ids) == 0:  # nothing to look up: no call, nothing to compare
            return np.empty(0, np.int64), np.empty(0, np.int32)
        nxt, values, generation = self._client.successors_generation(ids)
        self._hold(generation)
        return nxt, values

    def _hold(self, generation: int) -> None:
        if self.generation is None:
            self.generation = generation
        elif generation != self.generation:
            raise ServiceError(self._client.address, grpc.StatusCode.ABORTED,
                               f"the datastore changed generation ({self.generation} -> {generation}) during a pointer "
                               "walk: its ids are rows of the first; retry")
