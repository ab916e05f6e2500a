"""The decoding engine: continuous batching over a preallocated KV cache.

Requests wait in a bounded queue and are admitted into the running batch between steps, each into a
free cache row. One `step`:
1. ends cancelled requests and those past their deadline (their rows are free for this step's admissions);
2. admits waiting requests into free rows;
3. prefills: rows with more than one token to feed get chunks of their prompt, at most
   EngineConfig.prefill_chunk tokens over all rows per step (so a long prompt never stalls the running
   batch), left-padded (padding is never written to the cache);
4. decodes every non-speculative row with one token to feed (its last token), in the SAME forward pass as
   the prefill chunks (memlm.engine.passes; kv_cache.PackedStep: the weights are read once per step, decode
   rows are not padded);
5. chooses the next token of those rows at once (memlm.engine.sampling: one kNN-LM search for all that use
   it, each with its own k, lambda and temperature; rows with fewer searches follow RetoMaton pointers or ask
   the adaptive gate first and search only where they must, memlm.engine.fewer_rows) and emits TokenEvents;
   speculative rows then verify their drafts in a pass and a search of their own (memlm.engine.speculative);
   finished rows emit their GenerationEnd and leave. A row whose own work fails (its search, its draw, its kNN memory)
   ends with its error alone; the others go on.
Score requests (ScoreRequest) ride the same steps: fed like a prompt (score_tokens' sliding windows one after
another, or XL segments), with logits at every position, and answered with memlm.jobs.scoring's SequenceScore
(memlm.engine.score_rows: its per-token functions, kNN-LM and top-n included; several clients' scores share
forward passes). The step's kNN-LM search is ONE for its decode rows and its score rows' scored tokens together.
The engine is the one decode loop (memlm.engine.generate runs one request through it). Per row: the boundary
token before the prompt, text deltas that hold back split UTF-8 characters, stop strings and token ids, eos,
max new tokens (memlm.jobs.decoding's shared pieces); without a
memory a row that fills its cache slides (its last half encoded again); with the XL memory (and sinks) a
row attends to its sinks and last mem_len states, so it generates past the model's context; compressive
rows also keep their evicted states pooled (memlm.engine.compression); SPALM rows take the head's logits
(memlm.engine.spalm_rows); memorizing rows each carry a kNN memory of their past keys and values that the layer
knn_layer attends to (memlm.engine.memorizing_rows; closed, a service session dropped, when the row leaves).
A model without a row cache (transformers' models, memlm.model.hf_model) runs here too: each of its rows keeps
its own KV cache and runs its own forward in the step, one row after another (not batched), with the same
sliding window; everything after the forward (sampling, kNN-LM, stops, events, cancellation) is shared.

Work runs where `step` is called: in the caller's thread (a handle's `events()` steps the engine while
no engine thread runs; memlm generate) or in the engine's own thread (`start`, for a server, whose
handlers only submit, iterate and cancel). GPU: positions, masks and the cache stay on the device; the
host reads the chosen tokens once per step (memlm.engine.sampling).

Shape legend: B rows in a forward pass, T tokens per row, V vocab, C key width.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from types import MappingProxyType

import numpy as np
import torch

from memlm.engine import (
    fewer_rows,
    memorizing_rows,
    passes,
    score_rows,
    spalm_rows,
    speculative,
)
from memlm.engine.decode_graphs import DecodeGraphs
from memlm.engine.kv_cache import (
    CacheLayout,
    RowCache,
)
from memlm.engine.requests import (
    FINISH_CANCELLED,
    FINISH_DEADLINE,
    EngineConfig,
    EngineFull,
    Event,
    GenerationRequest,
    RequestHandle,
    ScoreRequest,
)
from memlm.engine.rows import Row, StepPlan
from memlm.engine.sampling import choose_tokens, search_each
from memlm.engine.score_rows import ScoreRow
from memlm.errors import MemlmError

from memlm.jobs.decoding import (
    FINISH_EOS,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationEnd,
    as_stop,
    flush_text,
    match_stop,
)
from memlm.memory.memorizing import KnnAttention
from memlm.memory.spalm import SpalmHead
from memlm.model.decoder import Decoder, KVCache
from memlm.model.pretrained import CausalLM, require_decoder
from memlm.model.tokenizer import Tokenizer
from memlm.memory.knn_store import KeyValueMemoryFactory
from memlm.retrieval.searcher import Searcher

_log = logging.getLogger(__name__)
STEP_TIME_DECAY = 0.9
"""Weight of the past in the running mean of a step's wall time (the retry hint's unit)."""
FIRST_STEP_GUESS_S = 0.05
"""The retry hint's step time before any step was measured."""


def cache_layout(config: EngineConfig, max_seq_len: int) -> CacheLayout:
    """The cache rows for `config`: a plain cache of row_capacity positions, or an XL ring of
    sinks + mem_len + segment slots (memlm.engine.kv_cache); compressive: also cmem_len compressed slots, and
    rate - 1 more ring slots for the states that wait for their group to fill."""
    xl = config.xl
    if xl is None:
        return CacheLayout(config.max_batch, 0, config.row_capacity or max_seq_len, None, None)
    cmem, rate = (xl.cmem_len, xl.compress_rate) if xl.kind == "compressive" else (0, 1)
    return CacheLayout(config.max_batch, xl.sink_tokens, xl.mem_len + rate - 1 + xl.segment, xl.mem_len, xl.segment,
                       cmem, rate)


class Engine:
    """The running batch of one model. submit() from any thread; step() from one thread at a time."""

    def __init__(self, model: Decoder | CausalLM, tokenizer: Tokenizer, config: EngineConfig | None = None,
                 searcher: Searcher | None = None, drafts: speculative.DraftSource | None = None,
                 spalm_head: SpalmHead | None = None, knn_attention: KnnAttention | None = None,
                 knn_service: KeyValueMemoryFactory | None = None) -> None:
        """config None: EngineConfig's defaults. searcher: the kNN-LM (or SPALM) datastore; drafts: its successors;
        spalm_head: the head of memory kind "spalm" (memlm.engine.spalm_rows); knn_attention: the layer of memory
        kind "memorizing", knn_service: its rows' memories for knn_backend "service" (memlm.engine.memorizing_rows).
        A model other than memlm's Decoder (memlm.model.hf_model.HFCausalLM) has no row cache: its rows keep their own
        model state and each runs its own forward in the step (`_own_forwards`; not batched), plain KV cache only."""
        config = config or EngineConfig()
        if not isinstance(model, Decoder):
            if config.memory is not None and config.memory.kind != "none":
                require_decoder(model, f"--memory {config.memory.kind}")
            if config.cuda_graphs:
                require_decoder(model, "--cuda-graphs")
        spalm_rows.check_engine(config, spalm_head, searcher)
        xl = config.xl
        if config.row_capacity is not None and config.row_capacity > model.config.max_seq_len:
            raise MemlmError(f"row_capacity {config.row_capacity} is over the model's context "
                             f"{model.config.max_seq_len}; generate past it with --memory xl")
        if xl is not None and xl.segment > model.config.max_seq_len:
            raise MemlmError(f"segment must be in [1, {model.config.max_seq_len}] with a memory, got {xl.segment}")
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.searcher = searcher
        self.drafts = drafts
        self.spalm_head = spalm_head
        self.memorizing = memorizing_rows.for_engine(model, config, knn_attention, knn_service)
        self.layout = cache_layout(config, model.config.max_seq_len)
        """The rows' positions (with a row cache: its layout)."""
        self.cache = (RowCache(model.config, self.layout, model.device, model.dtype) if isinstance(model, Decoder)
                      else None)
        """The rows' KV cache; None for a model without one (its rows hold their own state, Row.model_state)."""
        self.graphs = DecodeGraphs(model, self.cache) if config.cuda_graphs else None
        self.decodable = min(model.config.vocab_size, tokenizer.vocab_size)
        self._waiting: deque[tuple[RequestHandle, float | None]] = deque()
        self._rows: dict[int, Row | ScoreRow] = {}  # cache row -> its request
        self._ids = itertools.count()
        self._lock = threading.Lock()  # guards _waiting and the admission bounds
        self._wake = threading.Condition(self._lock)
        self._stepping = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.step_time_s = FIRST_STEP_GUESS_S
        self.steps = 0
        """Steps that ran the model (for tests and benchmarks)."""

    # -- admission ------------------------------------------------------------------------------
    def submit(self, request: GenerationRequest | ScoreRequest) -> RequestHandle:
        """Queue `request`; EngineFull (with a retry hint) when the queue or the tokens in flight are full."""
        V = self.model.config.vocab_size
        prefix = np.fromiter(request.prefix, dtype=np.int64, count=len(request.prefix))  # (T,)
        if prefix.size and (prefix.min() < 0 or prefix.max() >= V):
            raise MemlmError(f"{'prompt' if isinstance(request, GenerationRequest) else 'text'} has token ids "
                             f"outside [0, {V})")
        spalm_rows.check_request(self, request)
        memorizing_rows.check_request(self, request)
        if self.cache is None:
            self._check_own_state(request)
        if isinstance(request, ScoreRequest):
            score_rows.check_request(self, request)
        else:
            for s in request.stop_sequences:
                as_stop(s)
            if request.knn is not None and self.searcher is None:
                raise MemlmError("kNN-LM generation needs a datastore: this engine has no searcher")
            speculative.check_request(self, request)
            fewer_rows.check_request(request)
        with self._lock:
            free = self.config.max_batch - len(self._rows)
            if len(self._waiting) >= self.config.max_queue + free:
                raise EngineFull("queue", self._retry_hint())
            if self._in_flight() + request.tokens_in_flight > self.config.max_tokens_in_flight:
                raise EngineFull("tokens_in_flight", self._retry_hint())
            handle = RequestHandle(next(self._ids), request, self._pump, self._notify)
            deadline = None if request.timeout_s is None else time.monotonic() + request.timeout_s
            self._waiting.append((handle, deadline))
            self._wake.notify()
        return handle

    def _check_own_state(self, request: GenerationRequest | ScoreRequest) -> None:
        """What rows with their own model state refuse: score rows and speculative / fewer-search rows read the
        row cache."""
        if isinstance(request, ScoreRequest):
            require_decoder(self.model, "scoring on the decoding engine")
        elif request.speculative is not None or request.fewer is not None:
            require_decoder(self.model, "--speculative" if request.fewer is None else "--pointers / --adaptive-*")

    def _in_flight(self) -> int:
        return (sum(h.request.tokens_in_flight for h, _ in self._waiting)
                + sum(r.handle.request.tokens_in_flight for r in self._rows.values()))

    def _retry_hint(self) -> float:
        """Seconds until a row is likely free: the soonest-finishing running request's steps left x step time."""
        left = [r.steps_left for r in self._rows.values()]
        return max(1, min(left, default=1)) * self.step_time_s

    def _pump(self) -> bool:
        """For a handle waiting for its next event: one step in the caller's thread (True), or False when the
        engine thread does the stepping (the caller waits on its queue)."""
        if self._thread is not None:
            return False
        if not self.busy:
            raise RuntimeError("the engine is idle and a request has not ended")
        self.step()
        return True

    def _notify(self) -> None:
        with self._lock:
            self._wake.notify()

    @property
    def busy(self) -> bool:
        """Requests are running or waiting."""
        return bool(self._rows) or bool(self._waiting)

    @property
    def waiting(self) -> int:
        """Requests submitted and not yet given a row (the queue a server's metrics report)."""
        return len(self._waiting)

    # -- the step -------------------------------------------------------------------------------
    def step(self) -> bool:
        """Run one step (see the module docstring); returns whether work remains. An error in the forward
        pass ends every running request with it (each handle raises it) and is raised here; a row's own
        failure (its search, its draw, its memory) ends that row only (_choose)."""
        with self._stepping:  # one step at a time, whichever threads call
            return self._step()

    def _step(self) -> bool:
        start = time.perf_counter()
        # The whole step in inference mode: the cache grows inside a pass (inference tensors), and a row that
        # ends between passes moves the last row into its slot, an in-place update of those tensors.
        with torch.inference_mode():
            try:
                self._end_cancelled()
                self._admit()
                ran = bool(self._rows)
                if ran:
                    self._forward_and_choose()
            except Exception as e:  # the requests of this batch cannot continue; the engine can
                for row in list(self._rows.values()):
                    row.handle.put(e)
                    self.release(row)
                raise
        if ran:
            elapsed = time.perf_counter() - start
            self.step_time_s = STEP_TIME_DECAY * self.step_time_s + (1 - STEP_TIME_DECAY) * elapsed
            self.steps += 1
        return self.busy

    def _end_cancelled(self) -> None:
        now = time.monotonic()
        with self._lock:
            kept: deque[tuple[RequestHandle, float | None]] = deque()
            for handle, deadline in self._waiting:
                reason = _ended(handle, deadline, now)
                if reason is None:
                    kept.append((handle, deadline))
                elif isinstance(handle.request, ScoreRequest):
                    handle.put(score_rows.ScoreEnded(reason))
                else:
                    handle.put(_end_event(reason, "", len(handle.request.prompt_ids), 0, ""))
            self._waiting = kept
        for row in list(self._rows.values()):
            reason = _ended(row.handle, row.deadline, now)
            if reason is not None:
                self._finish(row, reason)

    def _admit(self) -> None:
        admitted: list[Row] = []
        with self._lock:
            free = [i for i in range(self.config.max_batch) if i not in self._rows]
            while free and self._waiting:
                handle, deadline = self._waiting.popleft()
                slot = free.pop(0)
                if self.cache is not None:
                    self.cache.clear_row(slot)
                if isinstance(handle.request, ScoreRequest):
                    self._rows[slot] = ScoreRow.start(handle, slot, deadline)
                else:
                    self._rows[slot] = Row.start(handle, slot, deadline, self.layout, self.model.device)
                    admitted.append(self._rows[slot])
        memorizing_rows.admit(self, admitted)  # their kNN memories (a service session: outside the lock)

    def plan(self) -> StepPlan:
        """What the next forward passes feed (rows in slot order): prompt chunks oldest first within
        prefill_chunk, decode rows, speculative rows to verify, score rows' chunks."""
        chunks = self._prefill_plan()
        touched = {id(row) for row, _ in chunks}
        decoding = [(r, 1) for _, r in sorted(self._rows.items())
                    if id(r) not in touched and isinstance(r, Row) and r.to_feed == 1]
        decoding, verifying = speculative.split(decoding)
        return StepPlan([(r, n) for r, n in chunks if isinstance(r, Row)], decoding, verifying,
                        [(r, n) for r, n in chunks if isinstance(r, ScoreRow)])

    def _forward_and_choose(self) -> None:
        """One forward pass for the step's prompt chunks and decode rows (packed when both run; score rows
        in a pass of their own, with logits at every position), then every ready row's next token."""
        plan = self.plan()
        if self.cache is None:
            ready, logits, keys = self._own_forwards(plan)
            if ready:
                self._choose(ready, logits, keys, [])
            return
        pending = []  # score passes waiting for the step's one search (_choose); no row leaves before it
        for group in score_rows.passes(plan.score, self.config.prefill_chunk):  # passes of their own, every position
            starts = [row.fed for row, _ in group]
            logits, keys, _ = passes.run(self, group, every_position=True)  # (B, T, V), (B, T, C)
            pending.append(score_rows.scored(group, starts, logits, keys))
        prefilling, decoding, verifying = plan.prefill, plan.decode, plan.verify
        ready: list[Row] = []
        logits = keys = None
        if prefilling and decoding:
            logits, keys, ready = passes.run_packed(self, prefilling, decoding)  # (B, V), (B, C)
        elif decoding and self.graphs is not None and self.graphs.takes(decoding, len(self._rows)):
            logits, keys = self.graphs.run(decoding)  # (B, V), (B, C): fixed shapes, a CUDA graph on a GPU
            ready = [row for row, _ in decoding]
        elif prefilling or decoding:
            logits, keys, done = passes.run(self, prefilling or decoding)  # (B, V), (B, C)
            index = [i for i, d in enumerate(done) if d]  # rows whose prompt is in: their next token now
            ready, logits, keys = [(prefilling or decoding)[i][0] for i in index], logits[index], keys[index]
        if ready or pending:
            self._choose(ready, logits, keys, pending)
        speculative.verify(self, verifying)  # a pass of their own, after _choose's releases

    def _own_forwards(self, plan: StepPlan) -> tuple[list[Row], torch.Tensor | None, torch.Tensor | None]:
        """The step of a model without a row cache: each row with tokens to feed (a prompt chunk within the
        prefill budget, or its last token) runs its own forward over its own state, one row after another (a row
        whose forward raises ends with the error; the others go on).
        Returns the rows whose prompt is in, with their last position's logits (B, V) and kNN keys (B, C)."""
        ready, logits, keys = [], [], []
        for row, n in sorted(plan.prefill + plan.decode, key=lambda p: p[0].slot):
            ids, _ = row.feed(n)
            idx = torch.tensor([ids], dtype=torch.long, device=self.model.device)  # (1, T)
            state = row.model_state if row.model_state is not None else KVCache.empty(self.model.config,
                                                                                      self.layout.ring)
            try:
                out = self.model(idx, state=state, logits_from=n - 1)  # logits (1, 1, V), knn_key (1, T, C)
            except Exception as e:  # noqa: BLE001 - the row's own forward: it ends, the other rows go on
                self.fail(row, e)
                continue
            row.model_state = out.state
            row.fed += n
            if row.to_feed == 0:
                ready.append(row)
                logits.append(out.logits[0, -1])  # (V,)
                keys.append(out.knn_key[0, -1])  # (C,)
        if not ready:
            return [], None, None
        return ready, torch.stack(logits), torch.stack(keys)  # (B, V), (B, C)

    def _choose(self, ready: list[Row], logits: torch.Tensor | None, keys: torch.Tensor | None,
                pending: list[score_rows.ScoredPass]) -> None:
        """The step's ONE kNN-LM search, for the ready rows that search (logits (B, V), keys (B, C); None when
        no row is ready) and every scored token of the score passes (`pending`); then every ready row's token
        (emitted) and the score rows' scores. A row whose own work fails (its search, sampling:
        memlm.engine.sampling.search_each, Choices.errors; its text or stops) ends with that error and the others go
        on (one row's fault never ends the rest of the batch). Speculative rows verify after
        this, with a search of their own (memlm.engine.speculative)."""
        if ready:
            ready, logits, keys = memorizing_rows.end_failed(self, ready, logits, keys)  # a kNN memory failed: ends
            ready, logits, keys = spalm_rows.head_logits(self, ready, logits, keys)  # SPALM: the head's logits
        knn = [r.handle.request.knn for r in ready]
        ask, neighbors = fewer_rows.plan_searches(ready, logits, keys, knn) if ready else ([], [])  # pointers, gate
        score_keys, score_knn, score_owners = score_rows.queries(pending)  # (Q, C), Q settings, Q request ids
        score_found: list = []
        errors: dict[int, Exception] = {}
        if any(c is not None for c in ask) or score_knn:
            step_keys = torch.cat([k for k in (keys, score_keys) if k is not None])  # (B + Q, C)
            found, errors = search_each(self.searcher, step_keys, [*ask, *score_knn],
                                        [r.handle.request_id for r in ready] + score_owners)
            neighbors = [f if c is not None else nb for c, f, nb in zip(ask, found, neighbors)]
            score_found = found[len(ask):]
        if errors and ready:  # only the rows whose search failed end (not those pointed or gate-skipped)
            keep = [i for i, r in enumerate(ready) if r.handle.request_id not in errors]
            for row in ready:
                if row.handle.request_id in errors:
                    self.fail(row, errors[row.handle.request_id])
            ready, logits, keys = [ready[i] for i in keep], logits[keep], keys[keep]
            knn, neighbors = [knn[i] for i in keep], [neighbors[i] for i in keep]
        if ready:
            fewer_rows.keep_candidates(ready, knn, neighbors)
            choices = choose_tokens(logits, [r.handle.request.sampling for r in ready],
                                    [r.generator for r in ready], self.decodable, knn, neighbors)
            for row, token, lp, base, error in zip(ready, *choices):
                if error is not None:
                    self.fail(row, error)
                    continue
                try:
                    self.advance(row, token, lp, base)
                except Exception as e:  # noqa: BLE001 - the row's own text or stops: it ends, the others go on
                    self.fail(row, e)
            speculative.draft_first(self, ready, neighbors, keys)  # speculative rows: pointers after this token
        score_rows.take_scores(self, pending, score_found, errors)

    def _prefill_plan(self) -> list[tuple[Row, int]]:
        """(row, tokens to feed now) for rows with a prompt left, oldest first, within prefill_chunk."""
        budget, segment = self.config.prefill_chunk, self.layout.segment
        plan = []
        # A score row that slid to a later window goes behind the rows on their first (a long text's windows
        # never starve a newer call of the budget).
        for row in sorted(self._rows.values(), key=lambda r: (r.at if isinstance(r, ScoreRow) else 0,
                                                               r.handle.request_id)):
            if budget == 0:
                break
            if row.to_feed > 1 or (isinstance(row, ScoreRow) and row.to_feed > 0):
                n = min(row.to_feed, budget)
                if segment is not None:  # a chunk stays in one segment: the XL ring holds one segment past the memory
                    n = min(n, segment - row.cached % segment)
                plan.append((row, n))
                budget -= n
        return sorted(plan, key=lambda p: p[0].slot)

    # -- one token ------------------------------------------------------------------------------
    def advance(self, row: Row, token: int, logprob: float, base_logprob: float) -> None:
        """One chosen token of a row: eos, the event, stops, length, sliding (memlm.jobs.decoding's rules)."""
        request = row.handle.request
        if request.eos_id is not None and token == request.eos_id:
            self._finish(row, FINISH_EOS)
            return
        event = row.append(token, logprob, base_logprob, self.tokenizer)
        row.handle.put(event)
        matched = match_stop(row.stops, row.generated, row.stable, row.checked, self.tokenizer)
        row.checked = len(row.stable)
        if matched is not None:
            self._finish(row, FINISH_STOP, matched)
        elif len(row.generated) == request.max_new_tokens:
            self._finish(row, FINISH_LENGTH)
        elif not self.layout.wraps and row.cached + 1 > self.layout.ring:
            if self.cache is not None:
                self.cache.clear_row(row.slot)
            row.model_state = None
            row.slide(max(1, self.layout.ring // 2))

    def _finish(self, row: Row | ScoreRow, reason: str, stop_sequence: str = "") -> None:
        if isinstance(row, ScoreRow):  # a partial score is no answer
            row.handle.put(score_rows.ScoreEnded(reason))
            self.release(row)
            return
        tail = flush_text(self.tokenizer, row.generated, row.emitted)
        row.handle.put(GenerationEnd(reason, tail, row.prompt_tokens, len(row.generated), stop_sequence,
                                     row.searches, row.verify_steps, row.verified_tokens, row.searches_saved))
        self.release(row)

    def fail(self, row: Row | ScoreRow, error: Exception) -> None:
        """The row ends with `error` (its handle raises it) and leaves; the other rows go on. A no-op for a row that
        already left."""
        if not self.holds(row):
            return
        row.handle.put(error)
        self.release(row)

    def release(self, row: Row | ScoreRow) -> None:
        """The row leaves; the last row moves into its slot (rows stay packed at the front: contiguous rows
        are a view of the cache in the next steps, kv_cache.StepView). Between forward passes only."""
        memorizing_rows.close_row(self, row)  # its kNN memory (a service session: dropped, outside the lock)
        with self._lock:  # submit() reads the rows (tokens in flight, the retry hint) from other threads
            if self._rows.pop(row.slot, None) is None:
                return
            last = max(self._rows, default=-1)
            if last > row.slot:
                moved = self._rows.pop(last)
                if self.cache is not None:
                    self.cache.move_row(last, row.slot)
                moved.slot = row.slot
                self._rows[row.slot] = moved

    @property
    def rows(self) -> Mapping[int, Row | ScoreRow]:
        """The running rows by cache row (a read-only view; between steps only)."""
        return MappingProxyType(self._rows)

    def holds(self, row: Row | ScoreRow) -> bool:
        """Whether `row` is still running (it has not ended or left)."""
        return self._rows.get(row.slot) is row

    @property
    def slots_in_use(self) -> list[int]:
        """The cache rows held by running requests (packed: 0 to n - 1)."""
        return sorted(self._rows)

    # -- the engine thread ----------------------------------------------------------------------
    def start(self) -> None:
        """Step in a thread of the engine's own from now on (handles submitted later wait on their queue)."""
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="memlm-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the engine thread after its current step (running requests stay where they are)."""
        thread = self._thread
        if thread is None:
            return
        with self._lock:
            self._stopping = True
            self._wake.notify()
        thread.join()
        self._thread = None

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and not (self._rows or self._waiting):
                    self._wake.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - step delivered it to every request it ended; the next ones run
                _log.warning("engine step failed, its requests ended with the error: %s", e)


def _ended(handle: RequestHandle, deadline: float | None, now: float) -> str | None:
    if handle.cancelled:
        return FINISH_CANCELLED
    if deadline is not None and now >= deadline:
        return FINISH_DEADLINE
    return None


def _end_event(reason: str, tail: str, prompt_tokens: int, completion_tokens: int, stop_sequence: str) -> Event:
    return GenerationEnd(reason, tail, prompt_tokens, completion_tokens, stop_sequence)


def run_all(engine: Engine, requests: Sequence[GenerationRequest | ScoreRequest]) -> list[list[Event]]:
    """Submit `requests` (waiting for room when the engine is full) and step until each has ended;
    every request's events in submission order. For the command line and benchmarks."""
    handles: list[RequestHandle] = []
    for request in requests:
        while True:
            try:
                handles.append(engine.submit(request))
                break
            except EngineFull:
                if not engine.step():
                    raise
    return [list(h.events()) for h in handles]
