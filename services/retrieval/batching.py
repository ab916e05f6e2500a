"""Micro-batching of the retrieval server (services.retrieval.server): the Search calls that arrive while the
index is busy (or within `max_wait_s` of each other) are concatenated into ONE `searcher.search` call on ONE
worker thread per index, because FAISS answers a batch of queries much faster than the same queries one by
one, and GPU indexes are not thread-safe. Requests are grouped by (k, SearchOptions) since those
are per-call arguments of the searcher; results are split back by row.

Shape legend: Q queries in one request, B queries in one batch (sum of Q), d key dimension, k neighbours.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from memlm.retrieval.attribution import (
    SourcedNeighbors,
    compact_sources,
    require_sourced,
    slice_sourced,
)
from memlm.retrieval.searcher import Neighbors, Searcher, SearchOptions


@dataclass(frozen=True)
class BatchingOptions:
    """How the server merges concurrent Search calls into one searcher call (see SearchBatcher)."""

    micro_batching: bool = True
    """False: every request is searched on its own (the baseline of benchmarks/load.py)."""
    max_batch_queries: int = 4096
    """Most queries merged into one searcher call."""
    max_wait_s: float = 0.002
    """Longest wait, in seconds, for calls still being validated to join a batch."""
    search_threads: int = 1
    """Requests searched at once, each on its own worker thread; more than 1 only without micro-batching
    (the unbatched baselines of benchmarks/load.py: FAISS CPU search is thread-safe, GPU indexes are not)."""

    def __post_init__(self) -> None:
        if self.search_threads < 1 or (self.micro_batching and self.search_threads != 1):
            raise ValueError(f"search_threads must be 1 with micro-batching and >= 1 without, got {self.search_threads}")


DEFAULT_BATCHING = BatchingOptions()
"""The servers' default batching (one instance: a default argument value)."""


@dataclass(frozen=True)
class ParsedSearch:
    """A validated SearchRequest."""

    xq: np.ndarray
    """(Q, d) float32 queries, all finite, every coordinate within MAX_QUERY_ABS."""
    k: int
    """Neighbours per query, 1 <= k <= max_k."""
    options: SearchOptions
    """nprobe (None: the searcher's default) and exact_rerank (unset: False), as the request set them."""
    with_documents: bool = False
    """Answer each neighbour's document too (services.retrieval.documents)."""




class DeadlineExceeded(Exception):
    """The call's deadline passed before its queries reached the searcher."""


@dataclass
class _Pending:
    parsed: ParsedSearch
    future: asyncio.Future
    deadline: float | None  # loop.time() by which the call must be answered, None = no deadline


class SearchBatcher:
    """Runs searcher.search on one worker thread, merging concurrent requests into one call.

    Queries of calls that were cancelled or whose deadline passed before their batch started are
    dropped (a FAISS search cannot be interrupted once it runs). With batching.micro_batching False every
    request is searched on its own, on one of batching.search_threads worker threads (the baselines of
    benchmarks/load.py).
    """

    def __init__(self, searcher: Searcher, batching: BatchingOptions = DEFAULT_BATCHING,
                 served: Callable[[], tuple[Searcher, int]] | None = None):
        """served: the searcher answering now and its generation, read together (GenerationWatch.served);
        None: always `searcher`, generation 0."""
        self._served = served or (lambda: (searcher, 0))
        self._micro_batching = batching.micro_batching
        self._max_batch_queries = batching.max_batch_queries
        self._max_wait_s = batching.max_wait_s
        self._threads = batching.search_threads
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=self._threads, thread_name_prefix="memlm-search")
        self._pending: collections.deque[_Pending] = collections.deque()
        self._arrived = asyncio.Event()
        self._runners: set[asyncio.Task] = set()  # at most search_threads, each searching one batch at a time
        self.arriving = 0
        """Search calls that have started but not yet enqueued (being validated). While any are,
        waiting up to max_wait_s lets them join the batch; when none are, waiting only adds latency."""
        self.batch_sizes: list[int] = []
        """Queries per searcher call, most recent last (bounded; for tests and benchmarks)."""

    @property
    def pending_queries(self) -> int:
        """Queries waiting for the worker thread (not counting the batch being searched)."""
        return sum(len(p.parsed.xq) for p in self._pending)

    @property
    def idle(self) -> bool:
        """True when nothing is queued or being searched."""
        return not self._pending and all(r.done() for r in self._runners)

    def close(self) -> None:
        """Release the worker thread (after the server stopped)."""
        self._executor.shutdown(wait=True, cancel_futures=True)

    async def search(self, parsed: ParsedSearch, time_remaining: float | None) -> Neighbors:
        return (await self.search_served(parsed, time_remaining))[0]

    async def search_served(self, parsed: ParsedSearch, time_remaining: float | None
                            ) -> tuple[Neighbors | SourcedNeighbors, int]:
        """The neighbours (sourced when parsed.with_documents) and the generation of the searcher that found them."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        deadline = None if time_remaining is None else loop.time() + time_remaining
        self._pending.append(_Pending(parsed, future, deadline))
        self._arrived.set()
        self._runners = {r for r in self._runners if not r.done()}
        if len(self._runners) < self._threads:
            # A runner lives only while there is work, so no task outlives the server's loop.
            self._runners.add(loop.create_task(self._run()))
        # A cancelled RPC cancels this await, which cancels `future`; the runner then skips it.
        return await future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            if self._micro_batching:
                await self._gather_more(loop)
            batch = self._take_batch()
            live = []
            for item in batch:
                if item.future.done():  # cancelled by the client
                    continue
                if item.deadline is not None and loop.time() >= item.deadline:
                    item.future.set_exception(DeadlineExceeded())
                    continue
                live.append(item)
            groups: dict[tuple[int, SearchOptions, bool], list[_Pending]] = {}
            for item in live:
                groups.setdefault((item.parsed.k, item.parsed.options, item.parsed.with_documents), []).append(item)
            for (k, options, with_documents), items in groups.items():
                await self._search_group(loop, items, k, options, with_documents)

    async def _gather_more(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wait up to max_wait_s for calls still being validated, unless the batch is full."""
        until = loop.time() + self._max_wait_s
        while self.arriving > 0 and self.pending_queries < self._max_batch_queries:
            remaining = until - loop.time()
            if remaining <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except TimeoutError:
                return

    def _take_batch(self) -> list[_Pending]:
        batch = [self._pending.popleft()]
        if not self._micro_batching:
            return batch
        total = len(batch[0].parsed.xq)
        while self._pending and total + len(self._pending[0].parsed.xq) <= self._max_batch_queries:
            item = self._pending.popleft()
            batch.append(item)
            total += len(item.parsed.xq)
        return batch

    async def _search_group(self, loop, items: list[_Pending], k: int, options: SearchOptions,
                            with_documents: bool) -> None:
        sizes = [len(item.parsed.xq) for item in items]
        xq = items[0].parsed.xq if len(items) == 1 else np.concatenate([i.parsed.xq for i in items])  # (B, d)
        self.batch_sizes.append(len(xq))
        del self.batch_sizes[:-1000]
        searcher, generation = self._served()  # one snapshot: the batch is answered by one generation
        try:
            if with_documents:  # neighbours and their documents from the one generation snapshot
                found = await loop.run_in_executor(
                    self._executor, lambda: require_sourced(searcher).search_sourced(xq, k, options))
                nb = found.neighbors
            else:
                nb = await loop.run_in_executor(self._executor, lambda: searcher.search(xq, k, options))
            distances, ids, values = (np.asarray(a) for a in nb)  # (B, k) each
            for name, a in (("distances", distances), ("ids", ids), ("values", values)):
                if a.shape != (len(xq), k):
                    raise RuntimeError(f"searcher returned {name} of shape {a.shape}, expected {(len(xq), k)}")
        except Exception as e:  # noqa: BLE001 -- delivered to every caller of the batch
            for item in items:
                if not item.future.done():
                    item.future.set_exception(e)
            return
        start = 0
        for item, q in zip(items, sizes):
            rows = slice(start, start + q)
            start += q
            if not item.future.done():
                mine = compact_sources(slice_sourced(found, rows)) if with_documents else \
                    Neighbors(distances[rows], ids[rows], values[rows])  # (Q, k)
                item.future.set_result((mine, generation))
