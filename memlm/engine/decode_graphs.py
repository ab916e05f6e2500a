"""The decode step with fixed shapes, replayed as CUDA graphs on a GPU.

A decode step of a small model on a GPU is mostly kernel launches: SmolLM2-135M's 30 layers launch several
hundred small kernels per token, each a few microseconds, where the arithmetic of one token takes less. A
CUDA graph records the step's kernels once and replays them in one launch, but only for fixed shapes and
fixed tensor addresses, which the engine's ordinary step (memlm.engine.kv_cache.StepView) does not have:
it attends over the slots in use (its width grows by one every step) and picks the rows, slots and
padding on the host. `DecodeGraphs` is the same step with every shape fixed:
- rows: the b = `bucket(B)` first cache rows, b the smallest power of two >= B (or max_batch). The engine
  keeps its rows packed at the front (RowCache.move_row) and takes this path only when its B running rows
  are exactly the decode rows 0 .. B-1, so rows B .. b-1 are free; they run as padding: each writes its key
  and value to slot 0 of its own free row (overwritten by the first pass of the request that takes the row,
  which always writes position 0) and attends to that slot alone, so nothing it computes is NaN;
- width: w = `bucket_width` of the slots in use, the next power of two (at least MIN_WIDTH, at most the row's
  slots), so a step reads at most twice the slots it needs and a row's graphs number log2(slots / MIN_WIDTH)
  + 1 per row bucket; the cache is reserved up to w before the step (RowCache.reserve, by doubling) and
  every graph is dropped when that moves the cache tensors (at most log2(slots / 64) times), since a graph
  holds their addresses; the mask (slot_pos >= 0 and <= the query's position) is built on the device inside the step from
  slot_pos, so masked slots add exp(-inf) = 0 and the scores of the real slots are the ordinary step's;
- inputs: the token ids and positions are copied into static device buffers (one host-to-device copy per
  step); the outputs (logits (b, V), kNN keys (b, C)) are static buffers the host reads after the replay.
Nothing in the step reads a device value on the host (no .item(), no boolean indexing): what a graph needs,
and what tests/memlm/engine/test_decode_graphs.py checks on the CPU by tracing the step whole with
torch._dynamo (no graph break). Rotary is as the ordinary step's (kv_cache.rotary_at: float64 angles reduced
mod 2 pi from int64 positions), attention in float32 as a decode step's.

On a CPU the same fixed-shape step runs eagerly: tests compare it with the ordinary step there (greedy tokens
identical, logits within float32 rounding), and only the capture (`torch.cuda.CUDAGraph`, one per bucket,
recorded at the bucket's first step) is GPU-only. It serves the plain KV cache (no memory, no SPALM or
memorizing rows) and decode-only steps; any other step runs the ordinary way. Off by default
(EngineConfig.cuda_graphs, `--cuda-graphs`): what it gains has to be measured on a GPU first
(benchmarks/gpu_generate.sh prints the ratio).

Shape legend: b rows of the bucket, L slots per row, w slots attended (the width bucket), nh query heads, nkv key/value heads, g = nh / nkv,
hs head size, V vocab, C key width.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch

from memlm.engine.kv_cache import CacheLayout, RowCache, decode_attention, rotate, rotation_at, write_kv
from memlm.engine.rows import Row
from memlm.model.decoder import CachedAttention, Decoder, LayerMemory

_log = logging.getLogger(__name__)


CUDA_GRAPHS_HELP = ("decode steps with fixed shapes, replayed as CUDA graphs on a GPU (plain KV cache only; off by "
                    "default: not yet measured on a GPU; memlm.engine.decode_graphs)")
"""The --cuda-graphs flag's help (memlm generate, memlm serve lm)."""


MIN_WIDTH = 64
"""The narrowest width bucket (slots attended by a fixed-shape step)."""


def bucket(rows: int, max_batch: int) -> int:
    """The graph's row count for a step of `rows` decode rows: the next power of two, at most max_batch."""
    return min(max_batch, 1 << max(0, rows - 1).bit_length())


def bucket_width(used: int, slots: int) -> int:
    """The slots a fixed-shape step attends when its rows use `used` slots: the next power of two, at least
    MIN_WIDTH, at most the row's `slots`."""
    return min(slots, max(MIN_WIDTH, 1 << max(0, used - 1).bit_length()))


def serves_layout(layout: CacheLayout) -> bool:
    """Only the plain KV cache (no sinks, no XL ring, no compressed slots): a position's slot is itself."""
    return layout.mem_len is None and layout.sink == 0 and layout.cmem == 0


class _FixedStep:
    """The DecoderState of one fixed-shape decode step over cache rows 0 .. b-1 (module docstring)."""

    def __init__(self, cache: RowCache, pos: torch.Tensor, real: torch.Tensor, width: int) -> None:
        """pos: (b,) int64 on the device, each row's position (padding: 0), all below `width`; real: (b,) bool."""
        b, L, w = pos.shape[0], cache.allocated, width
        nkv = cache.config.n_kv_head
        g = cache.config.n_head // nkv
        self.cache = cache
        self.pos = pos[:, None]  # (b, 1)
        rows = torch.arange(b, device=pos.device)  # (b,)
        slot_pos = cache.slot_pos[:b, :w]  # (b, w), a view: written in place
        # Padding rows keep their slot 0 as it is (empty); real rows record their position (slot = position).
        slot_pos[rows, pos] = torch.where(real, pos, slot_pos[rows, pos])
        heads = torch.arange(nkv, device=pos.device)  # (nkv,)
        self.flat = ((rows[:, None] * nkv + heads) * L + pos[:, None]).reshape(-1)  # (b*nkv,) into (R*nkv*allocated, hs)
        seen = (slot_pos >= 0) & (slot_pos <= self.pos)  # (b, w)
        first = torch.arange(w, device=pos.device) == 0  # (w,)
        seen = seen | (~real[:, None] & first)  # a padding row attends to its own slot 0: finite, ignored
        bias = torch.zeros(b, nkv, g, w, device=pos.device).masked_fill_(~seen[:, None, None, :], float("-inf"))
        self.bias = bias.reshape(b * nkv, g, w)  # (b*nkv, g, w)
        self.width = w
        self.cos, self.sin_signed = rotation_at(self.pos, cache.inv_freq)  # (b, 1, 1, hs) each

    # -- DecoderState --
    def positions(self, batch_size: int, seq_len: int, device: torch.device) -> torch.Tensor:
        return self.pos.float()  # (b, 1): attention uses the int64 positions

    def layer_memory(self, layer: int) -> CachedAttention:
        return _FixedLayer(self, layer)

    def update(self, new_kv: list[LayerMemory]) -> _FixedStep:
        return self  # written in place


class _FixedLayer(CachedAttention):
    def __init__(self, step: _FixedStep, layer: int) -> None:
        self.step = step
        self.layer = layer

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: (b, nh, 1, hs), k, v: (b, nkv, 1, hs) -> (b, nh, 1, hs), as kv_cache._LayerView's decode step."""
        step, cache = self.step, self.step.cache
        b, nh, _, hs = q.shape
        nkv = k.shape[1]
        q = rotate(q, step.cos, step.sin_signed)  # (b, nh, 1, hs)
        k = rotate(k, step.cos, step.sin_signed)  # (b, nkv, 1, hs)
        kc, vc = cache.k[self.layer], cache.v[self.layer]  # (R, nkv, L, hs) each
        write_kv(kc, vc, step.flat, k.reshape(-1, hs), v.reshape(-1, hs))
        w = step.width
        keys = kc[:b, :, :w].float()  # (b, nkv, w, hs): decode steps attend in float32
        values = vc[:b, :, :w].float()  # (b, nkv, w, hs)
        qg = q.float().reshape(b * nkv, nh // nkv, hs)  # (b*nkv, g, hs): query head h reads kv head h // g
        y = decode_attention(step.bias, qg, keys, values, 1.0 / math.sqrt(hs))  # (b*nkv, g, hs)
        return y.to(q.dtype).reshape(b, nh, 1, hs)


class DecodeGraphs:
    """Fixed-shape decode steps of one engine, a CUDA graph per (row bucket, width bucket) on a GPU (module
    docstring). A bucket whose capture fails runs eagerly from then on (logged once): the rows go on."""

    def __init__(self, model: Decoder, cache: RowCache) -> None:
        if not serves_layout(cache.layout):
            raise ValueError("fixed-shape decode steps serve the plain KV cache only")
        self.model = model
        self.cache = cache
        self.capture = model.device.type == "cuda"
        self._inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # b -> ids, pos, real
        self._outputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (b, w) -> (b, V), (b, C)
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph | None] = {}  # None: its capture failed, eager
        self._allocated = cache.allocated  # the cache tensors the graphs were recorded on
        self.replays = 0
        """Steps that ran here (for tests and benchmarks)."""

    def takes(self, plan: Sequence[tuple[Row, int]], running: int) -> bool:
        """Whether a pass feeding `plan` runs here: decode rows only (one token each) that are all `running`
        rows of the engine, in cache rows 0 .. B-1 (any other row, a score or speculative one, would sit in a
        padding row's place)."""
        return (len(plan) == running and all(n == 1 for _, n in plan)
                and all(row.slot == i for i, (row, _) in enumerate(plan)))

    def _step(self, b: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        idx, pos, real = self._inputs[b]
        out = self.model(idx[:, None], state=_FixedStep(self.cache, pos, real, w))
        return out.logits[:, -1], out.knn_key[:, -1]  # (b, V), (b, C)

    def run(self, plan: Sequence[tuple[Row, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step over `plan` (takes() held): the rows' logits (B, V) and kNN keys (B, C), views of
        the bucket's output buffers (valid until the next step of that bucket)."""
        B = len(plan)
        b = bucket(B, self.cache.layout.rows)
        device = self.cache.device
        positions = [row.fed - row.base for row, _ in plan]
        w = bucket_width(max(positions) + 1, self.cache.layout.slots)  # from the host's positions: no sync
        self.cache.reserve(w)
        if self.cache.allocated != self._allocated:  # the cache tensors moved: the graphs read the old ones
            self._graphs.clear()
            self._outputs.clear()
            self._allocated = self.cache.allocated
        if b not in self._inputs:
            self._inputs[b] = (torch.zeros(b, dtype=torch.long, device=device),
                               torch.zeros(b, dtype=torch.long, device=device),
                               torch.zeros(b, dtype=torch.bool, device=device))
        idx, pos, real = self._inputs[b]
        host = torch.zeros(3, b, dtype=torch.long)  # (3, b): ids, positions, real; padding rows: 0
        host[0, :B] = torch.tensor([row.tokens[row.fed] for row, _ in plan])
        host[1, :B] = torch.tensor(positions)
        host[2, :B] = 1
        host = host.to(device, non_blocking=True)  # one host-to-device copy a step
        idx.copy_(host[0])
        pos.copy_(host[1])
        real.copy_(host[2].bool())
        if self.capture and (b, w) not in self._graphs:
            self._graphs[b, w] = self._record(b, w)
        graph = self._graphs.get((b, w)) if self.capture else None
        if graph is None:
            logits, keys = self._step(b, w)
        else:
            with torch.cuda.device(device):
                graph.replay()
            logits, keys = self._outputs[b, w]
        for row, _ in plan:
            row.fed += 1
        self.replays += 1
        return logits[:B], keys[:B]

    def _record(self, b: int, w: int) -> torch.cuda.CUDAGraph | None:
        """Capture the (b, w) step on the cache's device, warmed up on a side stream first as torch.cuda.graphs
        asks; None when the capture fails (that bucket then runs eagerly). The warm-up passes run the step for
        real: they write the same keys to the same slots as the replay that follows."""
        device = self.cache.device
        with torch.cuda.device(device):  # streams and capture on the cache's GPU, not the current one
            side = torch.cuda.Stream(device=device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._step(b, w)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                # A memory pool of its own: buckets replay in any order, and a shared pool is only safe for graphs
                # replayed in the order they were captured. thread_local: a server's other threads (a lane's
                # engine being built, handlers) may allocate meanwhile; only this thread's calls must be capturable.
                with torch.cuda.graph(graph, stream=torch.cuda.Stream(device=device), capture_error_mode="thread_local"):
                    self._outputs[b, w] = self._step(b, w)
            except RuntimeError as e:
                _log.warning("CUDA graph capture of the decode step (%d rows, width %d) failed, that bucket runs "
                             "eagerly: %s", b, w, e)
                self._outputs.pop((b, w), None)
                return None
        return graph
