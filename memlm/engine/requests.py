"""What the decoding engine takes and gives: its settings, requests, the handle a caller holds, "full".

A caller (memlm generate, later the Generate and Score rpcs) submits a `GenerationRequest` and gets a
`RequestHandle`: it iterates the request's events (memlm.jobs.decoding's TokenEvent, then one
GenerationEnd; memlm.engine.generate yields the same for one request) and may cancel it. Admission is bounded
(queue length, tokens in flight); beyond, `submit` raises `EngineFull` with a retry hint, which a
server turns into RESOURCE_EXHAUSTED. A request that fails (its search, say) gets the error
from its events(); the other requests of the batch go on.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property

from memlm.engine.compression import POOLS
from memlm.engine.drafts import SpeculativeConfig
from memlm.errors import MemlmError
from memlm.jobs.decoding import GenerationEnd, SamplingConfig, TokenEvent
from memlm.jobs.knnlm_eval import Retrieval
from memlm.jobs.scoring import SequenceScore, plan_scored_windows
from memlm.jobs.windows import Window, check_window
from memlm.model.memory_config import MemoryConfig
from memlm.retrieval.knnlm import KNNLMConfig
from memlm.retrieval.searcher import SearchOptions

DEFAULT_SAMPLING = SamplingConfig()
"""A request's sampling when it names none: SamplingConfig's defaults."""
FINISH_CANCELLED = "cancelled"
"""GenerationEnd.reason of a request cancelled by its caller (its slot is freed before the next step)."""
FINISH_DEADLINE = "deadline"
"""GenerationEnd.reason of a request still running when its timeout passed."""
ENGINE_MEMORY_KINDS = ("none", "xl", "compressive", "spalm", "memorizing")
"""The memories (MemoryConfig.kind) whose per-row states the engine holds (SPALM's is the XL memory, its head
is the engine's spalm_head; memorizing's is the XL memory plus each row's kNN memory, memlm.engine.memorizing_rows)."""


@dataclass(frozen=True)
class EngineConfig:
    """The running batch, its cache, admission bounds, and the model's memory and kNN-LM mode."""

    max_batch: int = 8
    """Rows of the running batch (requests decoded together); the KV cache has this many rows."""
    row_capacity: int | None = None
    """Without a memory: positions one row's cache holds (None: the model's max_seq_len). A row that
    reaches it slides: the last half of it is encoded again into the row."""
    prefill_chunk: int = 256
    """Most prompt tokens prefilled per step over all rows: a long prompt is prefilled over several
    steps while the running batch keeps decoding (chunked prefill)."""
    max_queue: int = 64
    """Requests waiting beyond the free rows (admitted at the next step); one more is refused (EngineFull)."""
    max_tokens_in_flight: int = 1 << 20
    """Sum of prompt + max_new_tokens over running and waiting requests; beyond, refused (EngineFull)."""
    memory: MemoryConfig | None = None
    """kind "xl" (with its sinks, mem_len and segment): each row carries an XL memory, so generation runs
    past the context; kind "compressive" (compress_fn "mean" or "max"): an XL memory whose evicted groups are
    kept compressed (memlm.engine.compression); kind "spalm": XL rows whose logits come from SPALM's head
    (memlm.engine.spalm_rows; every request gives its SpalmSettings); kind "memorizing": XL rows whose layer
    knn_layer also attends to the row's own kNN memory (memlm.engine.memorizing_rows; the engine's knn_attention);
    None or kind "none": a plain KV cache."""
    cuda_graphs: bool = False
    """Decode-only steps of a plain KV cache run with fixed shapes, replayed as a CUDA graph per row bucket on a
    GPU (memlm.engine.decode_graphs; on a CPU the same step runs eagerly). Off by default: not yet measured on a
    GPU (benchmarks/gpu_generate.sh)."""

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.prefill_chunk < 1 or self.max_queue < 0 or self.max_tokens_in_flight < 1:
            raise MemlmError("max_batch, prefill_chunk and max_tokens_in_flight must be >= 1, max_queue >= 0")
        if self.row_capacity is not None and self.row_capacity < 2:
            raise MemlmError(f"row_capacity must be >= 2, got {self.row_capacity}")
        if self.memory is not None and self.memory.kind not in ENGINE_MEMORY_KINDS:
            raise MemlmError(f"the engine serves --memory {', '.join(ENGINE_MEMORY_KINDS)}, not {self.memory.kind}")
        if self.memory is not None and self.memory.kind == "compressive" and self.memory.compress_fn not in POOLS:
            raise MemlmError(f"the engine compresses by pooling ({', '.join(POOLS)}), not {self.memory.compress_fn}")
        if self.cuda_graphs and self.xl is not None:
            raise MemlmError(f"cuda_graphs serve the plain KV cache only, not --memory {self.memory.kind}")

    @property
    def xl(self) -> MemoryConfig | None:
        """The XL memory (kind "xl"; "compressive": with compressed groups; "spalm": SPALM's short-term memory;
        "memorizing": the local memory of every layer, Wu et al. 2022's XL cache), or None for a plain KV cache."""
        return self.memory if self.memory is not None and self.memory.kind in ENGINE_MEMORY_KINDS[1:] else None


@dataclass(frozen=True)
class SpalmSettings:
    """A SPALM request's retrieval (the head is the engine's; memlm.engine.spalm_rows)."""

    k: int
    """Neighbours whose next tokens' embeddings the head aggregates (memlm.memory.spalm.SPALM_DEFAULT_K)."""
    options: SearchOptions | None = None
    """nprobe / exact re-ranking of the search; None: the datastore's defaults."""

    def __post_init__(self) -> None:
        if self.k < 1:
            raise MemlmError(f"k must be >= 1, got {self.k}")


@dataclass(frozen=True)
class GenerationRequest:
    """One continuation to generate."""

    prompt_ids: tuple[int, ...]
    """Prompt token ids in [0, V); may be empty when boundary_token is given."""
    max_new_tokens: int
    """Most tokens generated (>= 1)."""
    sampling: SamplingConfig = DEFAULT_SAMPLING
    """Greedy (temperature 0) or sampled; a seed makes the tokens reproducible whatever the batch holds."""
    stop_sequences: tuple[str | tuple[int, ...], ...] = ()
    """Strings (matched on the generated text) or token-id sequences; generation ends after a match."""
    boundary_token: int | None = None
    """Prepended to the prompt (memlm.model.tokenizer.document_boundary); None: the prompt as is."""
    eos_id: int | None = None
    """Generation ends (reason "eos") when this token is drawn; None: never."""
    timeout_s: float | None = None
    """Seconds from submission after which the request ends with reason "deadline"; None: no deadline."""
    knn: KNNLMConfig | None = None
    """kNN-LM mixture over the engine's Searcher (its k, lambda and temperature; requests with different
    settings share one search per step, of the largest k); None: the base LM."""
    spalm: SpalmSettings | None = None
    """SPALM's retrieval (required by, and only by, an engine of memory kind "spalm"); None: the decoder's logits."""
    speculative: SpeculativeConfig | None = None
    """Speculative decoding with drafts from the engine's datastore (memlm.engine.speculative: the same
    tokens greedy, the same distribution sampled); None: one token per step."""
    fewer: Retrieval | None = None
    """Fewer kNN-LM searches (memlm.engine.fewer_rows): RetoMaton pointers along the generated tokens
    and/or the adaptive gate, as `memlm eval --pointers / --adaptive-*` take them; None: a search every token."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise MemlmError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.prompt_ids and self.boundary_token is None:
            raise MemlmError("empty prompt and no boundary token: nothing to condition on")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise MemlmError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.knn is not None and self.knn.needs_tuning:
            raise MemlmError("kNN-LM generation needs a fixed lambda and temperature")
        if self.fewer is not None and self.knn is None:
            raise MemlmError("fewer searches (--pointers, --adaptive-*) need kNN-LM generation")
        if self.knn is not None and self.spalm is not None:
            raise MemlmError("kNN-LM interpolation does not combine with SPALM generation (it mixes by its gate)")

    @property
    def prefix(self) -> list[int]:
        """What the model reads before generating: [boundary, *prompt]."""
        return ([self.boundary_token] if self.boundary_token is not None else []) + [int(i) for i in self.prompt_ids]

    @property
    def tokens_in_flight(self) -> int:
        """What the request counts against EngineConfig.max_tokens_in_flight."""
        return len(self.prefix) + self.max_new_tokens


@dataclass(frozen=True)
class ScoreRequest:
    """Log-probabilities of a text's tokens (lm-evaluation-harness's loglikelihood and loglikelihood_rolling),
    run in the same forward passes as generation (its prefill is chunked like a prompt's); the scores are
    memlm.jobs.scoring's (score_tokens with `window`, score_tokens_segments in an XL engine), computed by its
    own per-token functions (memlm.engine.score_rows)."""

    tokens: tuple[int, ...]
    """The tokens to score (the continuation), ids in [0, V); at least one."""
    boundary_token: int
    """Prepended (memlm.model.tokenizer.document_boundary), so the first token is scored too."""
    context: tuple[int, ...] = ()
    """Tokens between the boundary and the continuation that condition it and are not scored."""
    timeout_s: float | None = None
    """Seconds from submission after which the request fails (ScoreEnded "deadline"); None: no deadline."""
    window: tuple[int, int] | None = None
    """(context L, stride s) of score_tokens' sliding windows (memlm.jobs.scoring.plan_scored_windows: every
    token scored exactly once): the row reads each window from position 0, its cache cleared in between (a row
    that slides); None: the whole text in one pass (an XL engine's segments, or a text that fits the row)."""
    knn: KNNLMConfig | None = None
    """kNN-LM over the engine's Searcher (its k, lambda, temperature; the step's score rows share one search);
    None: the base LM."""
    top_n: int = 0
    """Alternatives per scored token under the final distribution (SequenceScore.top_ids), 0: none."""
    part: tuple[int, int] | None = None
    """Windows [a, b) of the text's plan only (a long text read by several rows side by side:
    memlm.engine.score_rows.split, its parts' scores put back in order by join_scores); None: every window."""

    def __post_init__(self) -> None:
        if not self.tokens:
            raise MemlmError("nothing to score: the continuation is empty")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise MemlmError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.knn is not None and self.knn.needs_tuning:
            raise MemlmError("kNN-LM scoring needs a fixed lambda and temperature")
        if self.top_n < 0:
            raise MemlmError(f"top_n must be >= 0, got {self.top_n}")
        if self.window is not None:
            check_window(*self.window)
        if self.part is not None and not 0 <= self.part[0] < self.part[1] <= len(self.plan):
            raise MemlmError(f"part must be windows [a, b) with 0 <= a < b <= {len(self.plan)}, got {self.part}")

    @property
    def prefix(self) -> list[int]:
        """Everything the model reads: [boundary, *context, *tokens]."""
        return [self.boundary_token, *self.context, *self.tokens]

    @cached_property  # planned once (a frozen dataclass keeps it in its __dict__)
    def plan(self) -> list[Window]:
        """The text's passes over `prefix`'s input positions (all but the last token): score_tokens' windows, or one."""
        n, first = len(self.tokens) + len(self.context), len(self.context)
        if self.window is None:
            return [Window(0, 0, n, first)]
        return plan_scored_windows(n, first, *self.window)

    @property
    def windows(self) -> list[Window]:
        """This request's passes: the plan, or its `part`."""
        return self.plan if self.part is None else self.plan[self.part[0] : self.part[1]]

    @property
    def scored(self) -> tuple[int, ...]:
        """The continuation tokens this request's windows score (all of `tokens` without a part)."""
        windows, c = self.windows, len(self.context)
        return self.tokens[windows[0].score_from - c : windows[-1].end - c]

    @property
    def tokens_in_flight(self) -> int:
        """The tokens its windows read (all of `prefix` for a text scored whole)."""
        windows = self.windows
        return windows[-1].end + 1 - windows[0].start


class EngineFull(MemlmError):
    """Admission refused: the queue or the tokens in flight are at their bound. Retry after retry_after_s."""

    def __init__(self, what: str, retry_after_s: float) -> None:
        super().__init__(f"engine full ({what}); retry in {retry_after_s:.2f} s")
        self.what = what
        """"queue" or "tokens_in_flight": the bound that was reached."""
        self.retry_after_s = retry_after_s
        """When a row is likely free: the soonest-finishing running request's remaining steps x step time."""


Event = TokenEvent | GenerationEnd | SequenceScore
"""What a handle yields: TokenEvents then one GenerationEnd (generation), or one SequenceScore (a score)."""


class RequestHandle:
    """A submitted request: its events as the engine makes them, and cancellation (thread-safe)."""

    def __init__(self, request_id: int, request: GenerationRequest | ScoreRequest, pump: Callable[[], bool],
                 wake: Callable[[], None]) -> None:
        self.request_id = request_id
        self.request = request
        self._queue: queue.SimpleQueue[Event | BaseException] = queue.SimpleQueue()
        self._cancelled = threading.Event()
        self._pump = pump  # steps the engine in the caller's thread (True), or False: an engine thread runs
        self._wake = wake  # tells a waiting engine thread that there is something to do

    def cancel(self) -> None:
        """Ask the engine to end this request; it ends (reason "cancelled") before the next step runs."""
        self._cancelled.set()
        self._wake()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def put(self, event: Event | BaseException) -> None:
        """For the engine: deliver one event (or the error that ended the request)."""
        self._queue.put(event)

    def ready(self) -> list[Event]:
        """The events delivered so far and not yet taken, without waiting or stepping (for a poller)."""
        out: list[Event] = []
        while not self._queue.empty():
            event = self._queue.get()
            if isinstance(event, BaseException):
                raise event
            out.append(event)
        return out

    def events(self, timeout_s: float | None = None) -> Iterator[Event]:
        """TokenEvents then one GenerationEnd (or the error that ended the request, raised). Without an engine
        thread, the engine is stepped here (callers in several threads take turns, one step at a time);
        with one, timeout_s bounds each wait for an event (queue.Empty when it passes)."""
        while True:
            while self._queue.empty() and self._pump():
                pass
            event = self._queue.get(timeout=timeout_s)
            if isinstance(event, BaseException):
                raise event
            yield event
            if isinstance(event, (GenerationEnd, SequenceScore)):
                return
