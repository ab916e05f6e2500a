"""BatchingOptions.search_threads: without micro-batching, that many requests are searched at once (the
unbatched baselines of benchmarks/load.py); with micro-batching it must stay 1."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from memlm.retrieval.searcher import Neighbors, SearchOptions
from services.retrieval.server import BatchingOptions, ParsedSearch, SearchBatcher


class BarrierSearcher:
    """Each search waits until `parties` searches are running at the same time (or the timeout)."""

    dim = 4

    def __init__(self, parties: int, timeout_s: float) -> None:
        self.barrier = threading.Barrier(parties, timeout=timeout_s)

    def search(self, xq: np.ndarray, k: int, options: SearchOptions | None = None) -> Neighbors:
        self.barrier.wait()  # BrokenBarrierError unless the other searches run concurrently
        q = xq.shape[0]
        return Neighbors(np.zeros((q, k), np.float32), np.zeros((q, k), np.int64), np.zeros((q, k), np.int32))


async def _two_concurrent_searches(threads: int, timeout_s: float) -> list:
    batcher = SearchBatcher(BarrierSearcher(2, timeout_s), BatchingOptions(micro_batching=False, search_threads=threads))
    request = ParsedSearch(np.zeros((1, 4), np.float32), 3, SearchOptions())
    try:
        return await asyncio.gather(batcher.search(request, None), batcher.search(request, None),
                                    return_exceptions=True)
    finally:
        batcher.close()


def test_two_search_threads_search_two_requests_at_once() -> None:
    results = asyncio.run(_two_concurrent_searches(threads=2, timeout_s=30))
    assert all(isinstance(r, Neighbors) and r.ids.shape == (1, 3) for r in results), results


def test_one_search_thread_searches_one_request_at_a_time() -> None:
    results = asyncio.run(_two_concurrent_searches(threads=1, timeout_s=0.5))
    assert all(isinstance(r, threading.BrokenBarrierError) for r in results), results


def test_micro_batching_keeps_one_search_thread() -> None:
    with pytest.raises(ValueError, match="search_threads must be 1 with micro-batching"):
        BatchingOptions(micro_batching=True, search_threads=2)
    with pytest.raises(ValueError, match="search_threads"):
        BatchingOptions(micro_batching=False, search_threads=0)
