"""One request in the running batch: what it has read, what it still has to feed, what it generated.

Positions: tokens[base] sits at position 0 of the row's cache (base > 0 after a sliding window without
a memory); tokens[:fed] are in the cache; the rest is fed by later steps (prompt chunks, then the last
generated token). Text deltas are memlm.jobs.decoding.text_delta's: the generated ids are decoded as a whole and
only the new complete suffix is emitted (a trailing U+FFFD waits for the bytes that complete it).

Shape legend: T tokens of a row in one forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from memlm.engine.kv_cache import CacheLayout
from memlm.engine.requests import RequestHandle
from memlm.jobs.decoding import TokenEvent, as_stop, fresh_seed, text_delta
from memlm.model.tokenizer import Tokenizer
from memlm.retrieval.searcher import Neighbors

if TYPE_CHECKING:  # score_rows imports this module
    from memlm.engine.score_rows import ScoreRow


def window_starts(pos: torch.Tensor, first_generated: int | torch.Tensor, segment: int | None) -> torch.Tensor:
    """pos: (..., T) int64 positions of rows' tokens -> (..., T) the start of each one's attention segment;
    first_generated: the position of the first generated token (an int, or (..., 1) per row).

    XL memory: the prompt is read in segments of `segment` tokens from
    position 0, each generated token is a segment of its own. Without a memory: zeros (unused)."""
    if segment is None:
        return torch.zeros_like(pos)
    return torch.where(pos < first_generated, torch.div(pos, segment, rounding_mode="floor") * segment, pos)


@dataclass
class Row:
    """The engine's bookkeeping of one running request (host-side Python values only)."""

    handle: RequestHandle
    slot: int
    """Its cache row."""
    deadline: float | None
    """time.monotonic() after which it ends with reason "deadline"; None: never."""
    generator: torch.Generator
    """The request's own sampler (seeded), on the model's device."""
    stops: list[str | tuple[int, ...]]
    tokens: list[int]
    """Everything the row has read or will read: [boundary, *prompt, *generated]."""
    n_prefix: int
    """Tokens before the first generated one."""
    base: int = 0
    fed: int = 0
    generated: list[int] = field(default_factory=list)
    emitted: str = ""
    """Text already given out in deltas."""
    stable: str = ""
    """The decoded continuation without a trailing incomplete character."""
    checked: int = 0
    """Length of the text already searched for stop strings."""
    compressed: int = 0
    """Compressive rows: groups compressed so far (memlm.engine.compression)."""
    searches: int = 0
    """kNN searches made for this row, in queries (kNN-LM: one per chosen token, fewer with pointers or a gate,
    memlm.engine.fewer_rows; speculative: one per
    fed position, or one per step to draft from when the target is the base LM)."""
    pointers: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    """Speculative rows: (m,) int64 datastore entries whose value is the last generated token, aligned
    with the row's text; the next draft follows their successors (memlm.engine.drafts)."""
    searches_saved: int = 0
    """kNN-LM tokens chosen without a search: from RetoMaton pointers, or on the base LM where the adaptive
    gate skipped the search (memlm.engine.fewer_rows)."""
    candidates: Neighbors | None = None
    """Pointer rows (memlm.engine.fewer_rows): (1, w) the kNN candidates (searched or pointed) of the position
    that chose the last generated token; None: nothing to follow (before the first token, after a gate skip)."""
    verify_steps: int = 0
    """Speculative rows: decode steps that verified a draft (each yields >= 1 token)."""
    verified_tokens: int = 0
    """Speculative rows: completion tokens those steps yielded (accepted draft tokens + the model's own; eos
    not counted, GenerationEnd.verified_tokens)."""
    model_state: Any = None
    """An engine without a row cache (memlm.model.hf_model.HFCausalLM): the row's own model state (its KV cache),
    None before its first pass and after a slide."""

    @classmethod
    def start(cls, handle: RequestHandle, slot: int, deadline: float | None, layout: CacheLayout,
              device: torch.device) -> Row:
        request = handle.request
        seed = request.sampling.seed if request.sampling.seed is not None else fresh_seed()
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
        prefix = request.prefix
        # Without a memory a prompt longer than the row keeps its last `ring` tokens (as generate's window).
        base = 0 if layout.wraps else max(0, len(prefix) - layout.ring)
        return cls(handle, slot, deadline, generator, [as_stop(s) for s in request.stop_sequences], prefix,
                   len(prefix), base=base, fed=base)

    @property
    def prompt_tokens(self) -> int:
        return len(self.handle.request.prompt_ids)

    @property
    def to_feed(self) -> int:
        """Tokens not yet in the cache."""
        return len(self.tokens) - self.fed

    @property
    def cached(self) -> int:
        """Positions the row's cache holds."""
        return self.fed - self.base

    @property
    def first_generated_pos(self) -> int:
        """Position of the first generated token (window_starts)."""
        return self.n_prefix - self.base

    @property
    def steps_left(self) -> int:
        """At most this many more tokens before the request ends (the retry hint)."""
        return self.handle.request.max_new_tokens - len(self.generated)

    def feed(self, n: int) -> tuple[list[int], list[int]]:
        """The next n tokens to feed and their positions (the caller advances `fed` after the pass)."""
        lo = self.fed
        return self.tokens[lo : lo + n], list(range(lo - self.base, lo - self.base + n))

    def slide(self, keep: int) -> None:
        """The cache was cleared: the last `keep` tokens are fed again from position 0."""
        self.base = len(self.tokens) - keep
        self.fed = self.base

    def append(self, token: int, logprob: float, base_logprob: float, tokenizer: Tokenizer) -> TokenEvent:
        """Take the chosen token; its event with the new complete text."""
        self.generated.append(token)
        self.tokens.append(token)
        self.stable, delta = text_delta(tokenizer, self.generated, self.emitted)
        self.emitted += delta
        return TokenEvent(token, tokenizer.decode([token]), delta, logprob, base_logprob)


@dataclass(frozen=True)
class StepPlan:
    """What one step feeds, built by the engine (Engine.plan) and handed to its features; rows in slot order."""

    prefill: list[tuple[Row, int]]
    """Generation rows with prompt left, (row, tokens fed now), within EngineConfig.prefill_chunk."""
    decode: list[tuple[Row, int]]
    """Rows that feed their last token, (row, 1), in the same pass as the prefill chunks."""
    verify: list[Row]
    """Speculative rows that feed their last token: they verify a draft in a pass of their own
    (memlm.engine.speculative)."""
    score: list[tuple[ScoreRow, int]]
    """Score rows' chunks, (row, tokens), in passes of their own with logits at every position
    (memlm.engine.score_rows)."""
