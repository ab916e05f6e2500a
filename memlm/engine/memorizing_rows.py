"""Memorizing Transformer rows in the engine (Wu et al. 2022): XL rows whose layer knn_layer
also attends to the row's own kNN memory of its past keys and values.

The rules are memlm.memory.memorizing.MemorizingMemory's, per row:
- every row owns a KeyValueMemory of n_kv_head streams, opened when it is admitted by the one way a memorizing
  state opens its store (memlm.jobs.memorizing.open_knn_store, batch 1: backend exact / faiss / ivf, or a
  retrieval-service session through the engine's knn_service factory) and closed when the row leaves, however
  it leaves (a service session is dropped at once, not at its idle timeout);
- at the layer, each of the row's queries (before rotary) retrieves from that memory and is mixed with the
  local attention by the gate: memlm.memory.memorizing.KnnRetrieval.attend, the library's own function, on
  the row's real tokens of the pass (a row's slice of a padded or packed pass);
- the memory holds strictly the past of the token's segment: the one-sequence path appends a segment's keys
  and values after the segment's forward pass (a prompt segment of `segment` tokens, then every generated
  token alone). A prompt chunk stays inside one segment (memlm.engine.engine.Engine.plan), but a segment
  may take several chunks, so the row's keys wait in `pending` until the row's next position starts a new
  window (memlm.engine.rows.window_starts), then are appended: after the same tokens as one sequence.
A row whose memory fails (a service error) is ended with that error at the next step boundary (its gate is
shut for the rest of the pass it failed in); the other rows go on.

Retrieval over the rows of a step: each row searches its own store (per-row memories share no index, and the
MemoryService searches one session a call). With the service backend the rows' searches are sent at once from a
thread pool, so that their round trips to the memory server overlap; in process they run one after another
(FAISS's exact scan is per stream anyway). Over loopback, with the memory server on the
same busy cores, at once vs one after another measures 0.72-1.06x (`python benchmarks/memorizing_generate.py
--model small --synthetic --streams 8 --knn-service ...`, figure 4): no gain where the server shares the cores
and the round trip is short; the pool is for a memory server on another machine, whose round trips are long.

Shape legend: B rows in a pass, T tokens per row, nh query heads, nkv key/value heads, hs head size, N packed
tokens, t pending tokens.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from memlm.engine.kv_cache import PackedStep, StepView
from memlm.engine.requests import EngineConfig, GenerationRequest, ScoreRequest
from memlm.engine.rows import Row
from memlm.errors import MemlmError
from memlm.jobs.memorizing import check_knn_attention, open_knn_store
from memlm.model.memory_config import MemoryConfig, memorizing_layer, resolve_knn_backend
from memlm.memory.memorizing import KnnAttention, KnnRetrieval, stream_entries
from memlm.model.decoder import CachedAttention, Decoder, LayerMemory

if TYPE_CHECKING:
    from memlm.memory.knn_store import KeyValueMemory, KeyValueMemoryFactory

_log = logging.getLogger(__name__)


class Engine(Protocol):
    """What memorizing rows use of memlm.engine.engine.Engine (a protocol: that module imports this one)."""

    memorizing: MemorizingRows | None
    """The kNN memories of an engine of memory kind "memorizing"; None otherwise."""

    def release(self, row: Row) -> None: ...


@dataclass
class RowMemory:
    """One row's kNN memory and the keys of its current segment that it does not hold yet."""

    row: Row
    """The row it belongs to (the same object when the row moves slots)."""
    store: KeyValueMemory
    pending: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    """(k, v) of the segment so far, (1, nkv, T, hs) each, un-rotated, in time order."""
    held: int = 0
    """Entries appended per stream so far (0: an empty memory, the layer is exactly local attention)."""
    error: Exception | None = None
    """What broke the memory (a failed search or append); the row ends with it at the next step boundary."""


class MemorizingRows:
    """An engine's memorizing layer: its parameters, the memory settings and every running row's RowMemory."""

    def __init__(self, model: Decoder, memory: MemoryConfig, module: KnnAttention,
                 service: KeyValueMemoryFactory | None, max_batch: int) -> None:
        self.model, self.memory, self.module, self.service = model, memory, module, service
        self.layer = memorizing_layer(memory, model.config.n_layer)
        self.rows: dict[int, RowMemory] = {}
        """Request id -> its memory (request ids stay when rows move slots)."""
        remote = resolve_knn_backend(memory) == "service"
        self.pool = ThreadPoolExecutor(max_batch, thread_name_prefix="memlm-knn") if remote and max_batch > 1 else None
        """Sends the rows' searches at once (the service backend: round trips that overlap); None: one after another."""

    def open(self, row: Row) -> None:
        """An empty memory for an admitted row (may raise: a full memory server refuses a session)."""
        self.rows[row.handle.request_id] = RowMemory(row, open_knn_store(self.model, self.memory, 1, self.service))

    def close(self, row: Row) -> None:
        """The row left: its memory is released (a service session dropped); a no-op for a row without one."""
        mem = self.rows.pop(row.handle.request_id, None)
        if mem is None:
            return
        try:
            mem.store.close()
        except Exception as e:  # noqa: BLE001 - the row is gone either way; a session left behind expires idle
            _log.warning("could not release a memorizing row's kNN memory: %s", e)

    def close_all(self) -> None:
        """Every row's memory released (the engine is discarded with rows still in it: a server that stops)."""
        for mem in list(self.rows.values()):
            self.close(mem.row)
        if self.pool is not None:
            self.pool.shutdown(wait=False)

    def retrieve(self, rows: list[Row], q: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Per row, its queries q (1, nh, T, hs) -> (memory attention (1, nh, T, hs), gate (1, nh, T)), or None where
        the layer is local attention alone (an empty or failed memory). A failure is kept in the row's memory."""
        mems = [self.rows[r.handle.request_id] for r in rows]

        def one(i: int) -> tuple[torch.Tensor, torch.Tensor] | None:
            mem = mems[i]
            if mem.error is not None or mem.held == 0:
                return None
            try:
                with torch.inference_mode():  # thread-local: a pool thread enters it too
                    return KnnRetrieval(mem.store, self.module, self.memory.knn_top_k).attend(q[i])
            except Exception as e:  # noqa: BLE001 - the row ends with it (end_failed); the others go on
                mem.error = e
                return None

        searching = [i for i, m in enumerate(mems) if m.error is None and m.held > 0]
        if self.pool is not None and len(searching) > 1:
            return list(self.pool.map(one, range(len(rows))))
        return [one(i) for i in range(len(rows))]

    def keep(self, row: Row, k: torch.Tensor, v: torch.Tensor, n: int) -> None:
        """The row fed n tokens in this pass, their k, v (1, nkv, n, hs) at the layer: pending, then appended when
        its next position starts a new window (the module docstring), as MemorizingMemory.update appends."""
        mem = self.rows[row.handle.request_id]
        if mem.error is not None:
            return
        mem.pending.append((k, v))
        after = row.cached + n  # the row's next position (row.fed moves on after the pass)
        if after < row.first_generated_pos and after % self.memory.segment != 0:
            return  # the prompt segment goes on in a later chunk
        keys = torch.cat([p[0] for p in mem.pending], dim=2).transpose(1, 2)  # (1, t, nkv, hs)
        values = torch.cat([p[1] for p in mem.pending], dim=2).transpose(1, 2)  # (1, t, nkv, hs)
        mem.pending = []
        t = keys.shape[1]
        valid = torch.ones(1, t, dtype=torch.bool, device=keys.device)  # (1, t)
        try:
            mem.store.append(*stream_entries(LayerMemory(keys, values, valid.float(), valid)))
        except Exception as e:  # noqa: BLE001 - the row ends with it (end_failed)
            mem.error = e
            return
        mem.held += t


def for_engine(model: Decoder, config: EngineConfig, knn_attention: KnnAttention | None,
               knn_service: KeyValueMemoryFactory | None) -> MemorizingRows | None:
    """The engine's MemorizingRows for memory kind "memorizing" (which needs a KnnAttention made for the model's
    heads), None for other kinds (which take none)."""
    memory = config.memory
    if memory is None:
        if knn_attention is not None:
            raise MemlmError("a KnnAttention module applies to --memory memorizing only, not none")
        return None
    check_knn_attention(memory, knn_attention)
    if knn_attention is None:
        return None
    try:
        knn_attention.check_model(model.config)
        return MemorizingRows(model, memory, knn_attention, knn_service, config.max_batch)
    except ValueError as e:
        raise MemlmError(str(e)) from None


def check_request(engine: Engine, request: GenerationRequest | ScoreRequest) -> None:
    """A memorizing engine generates only (memlm.jobs.scoring.score_tokens_segments scores memorizing)."""
    if engine.memorizing is not None and isinstance(request, ScoreRequest):
        raise MemlmError("a memorizing engine does not score: memorizing scores come from "
                         "memlm.jobs.scoring.score_tokens_segments")


def admit(engine: Engine, admitted: list[Row]) -> None:
    """At a step boundary: rows whose memory failed in the last pass end with its error, and each admitted row
    gets its memory (outside the engine's lock: a service session is a round trip; one that cannot be opened
    ends its row with the error). The other rows go on."""
    if engine.memorizing is None:
        return
    for mem in list(engine.memorizing.rows.values()):
        if mem.error is not None:
            mem.row.handle.put(mem.error)
            engine.release(mem.row)
    for row in admitted:
        try:
            engine.memorizing.open(row)
        except Exception as e:  # noqa: BLE001 - delivered to the request it ends, with its message
            row.handle.put(e)
            engine.release(row)


def end_failed(engine: Engine, ready: list[Row], logits: torch.Tensor, keys: torch.Tensor,
               ) -> tuple[list[Row], torch.Tensor, torch.Tensor]:
    """The ready rows (logits (B, V), keys (B, C)) without those whose memory failed in this pass: they end with
    its error (their logits were made with the gate shut, never a token of theirs)."""
    if engine.memorizing is None:
        return ready, logits, keys
    keep = []
    for i, row in enumerate(ready):
        mem = engine.memorizing.rows.get(row.handle.request_id)
        if mem is not None and mem.error is not None:
            row.handle.put(mem.error)
            engine.release(row)
        else:
            keep.append(i)
    return [ready[i] for i in keep], logits[keep], keys[keep]  # (b, V), (b, C)


def close_row(engine: Engine, row: Row) -> None:
    """A row leaves the batch (finished, cancelled, past its deadline or failed): its memory is released."""
    if engine.memorizing is not None and isinstance(row, Row):
        engine.memorizing.close(row)


def attach(engine: Engine, groups: list[list[Row]], state: StepView | PackedStep) -> StepView | PackedStep | _Step:
    """The state of one forward pass: `state` itself, or in a memorizing engine `state` with kNN attention at the
    memorizing layer. groups: the rows of the pass, sorted by slot; one list for a StepView, one per PackedGroup."""
    if engine.memorizing is None:
        return state
    return _Step(engine.memorizing, groups, state)


class _Step:
    """A DecoderState: the pass's own state, whose memorizing layer also attends to each row's kNN memory."""

    def __init__(self, rows: MemorizingRows, groups: list[list[Row]], inner: StepView | PackedStep) -> None:
        self.memorizing, self.groups, self.inner = rows, groups, inner

    def positions(self, batch_size: int, seq_len: int, device: torch.device) -> torch.Tensor:
        return self.inner.positions(batch_size, seq_len, device)  # (B, T)

    def layer_memory(self, layer: int) -> CachedAttention:
        local = self.inner.layer_memory(layer)
        return _KnnLayer(self, local) if layer == self.memorizing.layer else local

    def update(self, new_kv: list[LayerMemory]) -> _Step:
        return self  # the cache was written in place; the kNN memories in _KnnLayer.attend

    def mix(self, rows: list[Row], view: StepView, q: torch.Tensor, y: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor) -> torch.Tensor:
        """One StepView's rows: q (B, nh, T, hs) before rotary, y (B, nh, T, hs) the local attention, k, v
        (B, nkv, T, hs) before rotary -> y mixed with each row's memory attention by the gate (the library's
        Attention: out = g * memory + (1 - g) * local); the rows' k, v kept for their memories."""
        T = q.shape[2]
        fed = view.real_cpu.sum(dim=1).tolist()  # (B,) real tokens, the last of each row (left padding)
        got = self.memorizing.retrieve(rows, [q[b : b + 1, :, T - n :] for b, n in enumerate(fed)])
        out = y.clone()
        for b, (row, n, found) in enumerate(zip(rows, fed, got)):
            if found is not None:
                memory_y, gate = found  # (1, nh, n, hs), (1, nh, n)
                g = gate[..., None]  # (1, nh, n, 1)
                out[b : b + 1, :, T - n :] = g * memory_y + (1 - g) * y[b : b + 1, :, T - n :]
            self.memorizing.keep(row, k[b : b + 1, :, T - n :], v[b : b + 1, :, T - n :], n)
        return out


class _KnnLayer(CachedAttention):
    """The memorizing layer's view of a pass: the local attention of the pass's cache, then kNN attention."""

    def __init__(self, step: _Step, local: CachedAttention) -> None:
        self.step, self.local = step, local

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        y = self.local.attend(q, k, v)  # (B, nh, T, hs); packed: (1, nh, N, hs)
        step = self.step
        if isinstance(step.inner, StepView):
            return step.mix(step.groups[0], step.inner, q, y, k, v)
        out = y.clone()
        for group, rows in zip(step.inner.groups, step.groups):
            mixed = step.mix(rows, group.view, group.unpack(q), group.unpack(y), group.unpack(k), group.unpack(v))
            out[0].index_copy_(1, group.packed, group.pack(mixed))  # (nh, n, hs) into (nh, N, hs)
        return out
