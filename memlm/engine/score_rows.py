"""Score requests in the running batch (memlm.engine.requests.ScoreRequest): a text fed like a prompt, with
logits at every position, answered with memlm.jobs.scoring's SequenceScore (several clients' scores share
forward passes with each other and with generation).

A row reads its request's windows one after another (ScoreRequest.windows: score_tokens' sliding windows, or
one pass over the whole text in an XL engine), each from position 0 of its cache row, cleared in between.
After each pass the scored tokens' log-probabilities, greedy flags, kNN-LM mixture and top-n alternatives are
memlm.jobs.scoring's own per-chunk function (`score_part`, over memlm.jobs.token_scores.score_chunk, the
scoring that evaluation shares), and the finished text is assembled by its `assemble_scores`: the same
SequenceScore as the library up to float32 rounding of the forward pass (the KV cache attends over preallocated slots, in other batch shapes).
Every scored token of the step's kNN-LM score rows is searched in the step's ONE search, with the decode rows'
keys (memlm.engine.engine.the engine's choice of tokens; memlm.engine.sampling.search_rows: of the largest k asked, each
query keeping its row's nearest k): a pass's scores wait (`ScoredPass`) until that search, so a lane with
Score and Generate calls scans the datastore once a step, not once for each. A row whose search or scoring
fails ends alone. `passes` keeps each
score pass's padded (B, T, V) logits within one prefill budget; `split` / `join_scores` let several rows read
one long text's windows side by side. With a saved interpolation that mixes the document cache
(KNNLMConfig.interpolation), a row keeps its text's cache (`doc_cache`, from the text's start) and reads the
whole text itself: such a request is not split.

Shape legend: B rows in a forward pass, T tokens per row, n scored tokens of a row's chunk, V vocab,
C key width, k neighbours.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np
import torch

from memlm.engine.kv_cache import RowCache
from memlm.engine.requests import RequestHandle, ScoreRequest
from memlm.errors import MemlmError
from memlm.jobs.interpolation_eval import CacheConfig, DocumentCache
from memlm.jobs.scoring import ScoredPart, SequenceScore, assemble_scores, score_part
from memlm.jobs.windows import Window
from memlm.model.decoder import Decoder
from memlm.retrieval.knnlm import KNNLMConfig
from memlm.retrieval.searcher import Neighbors, Searcher


class Engine(Protocol):
    """What a score pass uses of memlm.engine.engine.Engine (a protocol: that module imports this one)."""

    model: Decoder
    cache: RowCache
    searcher: Searcher | None

    def release(self, row: ScoreRow) -> None: ...

    def fail(self, row: ScoreRow, error: Exception) -> None: ...


class ScoreEnded(MemlmError):
    """A score request ended before it was done (a partial score is no answer): cancelled or past its deadline."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"score ended before it was done: {reason}")
        self.reason = reason
        """memlm.engine.requests.FINISH_CANCELLED or FINISH_DEADLINE."""


def check_request(engine: Engine, request: ScoreRequest) -> None:
    """Refuse (MemlmError) a score this engine cannot run: a window over the rows of a plain cache, kNN-LM
    without a searcher."""
    layout = engine.cache.layout
    longest = max(w.end - w.start for w in request.windows)
    if not layout.wraps and longest > layout.ring:
        raise MemlmError(f"a score pass of {longest} tokens is over the rows' {layout.ring}; "
                         "score it in windows (ScoreRequest.window) or with the XL memory")
    if request.knn is not None and engine.searcher is None:
        raise MemlmError("kNN-LM scoring needs a datastore: this engine has no searcher")


@dataclass
class ScoreRow:
    """A score request in the running batch: each window's tokens are fed like a prompt (all but the last,
    whose logits predict nothing), and each chunk's scores of the next tokens are kept."""

    handle: RequestHandle
    slot: int
    deadline: float | None
    sequence: list[int]
    """[boundary, *context, *continuation]."""
    windows: list[Window]
    """The passes over the sequence's input positions (ScoreRequest.windows), read in order."""
    at: int = 0
    """The window being read."""
    fed: int = 0
    """Tokens of the current window in the cache."""
    base: int = 0
    """Always 0 (a window starts at position 0); window_starts' and the view's bookkeeping as for Row."""
    parts: list[ScoredPart] = field(default_factory=list)
    """The scores of each pass chunk, in order (memlm.jobs.scoring.assemble_scores's input)."""
    compressed: int = 0
    """Compressive rows: groups compressed so far (memlm.engine.compression)."""
    doc_cache: DocumentCache | None = None
    """The text's (key, next token) pairs scored so far, when its interpolation mixes the cache."""

    @classmethod
    def start(cls, handle: RequestHandle, slot: int, deadline: float | None) -> ScoreRow:
        request = handle.request
        served = request.knn.interpolation if request.knn is not None else None
        cache = DocumentCache(CacheConfig(served.cache_size, served.cache_k)) if served and served.has_cache else None
        return cls(handle, slot, deadline, request.prefix, request.windows, doc_cache=cache)

    @property
    def window(self) -> Window:
        return self.windows[self.at]

    @property
    def tokens(self) -> list[int]:
        """The current window's inputs and its last target: sequence[start : end + 1]."""
        return self.sequence[self.window.start : self.window.end + 1]

    @property
    def first_scored(self) -> int:
        """Index in `tokens` of the window's first scored token."""
        return self.window.score_from - self.window.start + 1

    @property
    def to_feed(self) -> int:
        return self.window.end - self.window.start - self.fed

    @property
    def cached(self) -> int:
        return self.fed

    @property
    def first_generated_pos(self) -> int:
        return len(self.tokens)  # every fed token is read in segments (XL), like a prompt

    @property
    def steps_left(self) -> int:
        """Passes left (each window takes at least one step)."""
        return len(self.windows) - self.at

    def feed(self, n: int) -> tuple[list[int], list[int]]:
        lo = self.fed
        return self.tokens[lo : lo + n], list(range(lo, lo + n))


def passes(plan: list[tuple[ScoreRow, int]], budget: int) -> Iterator[list[tuple[ScoreRow, int]]]:
    """The step's score rows (row, tokens) in passes whose left-padded block holds at most `budget` positions
    (EngineConfig.prefill_chunk): their logits are kept at every position, (B, T, V), so one long chunk beside
    short ones must not pad them all to its length (8 rows x 1024 x V 49152 float32 would be 1.6 GB; a pass
    stays within the library's one step of max_step_tokens). Longest chunks first; each pass in slot order,
    taken when it runs (an earlier pass's finished rows move others into their slots)."""
    left = sorted(plan, key=lambda p: -p[1])
    while left:
        longest, group = left[0][1], []
        while left and (len(group) + 1) * longest <= max(budget, longest):
            group.append(left.pop(0))
        yield sorted(group, key=lambda p: p[0].slot)


def _scored_blocks(plan: list[tuple[ScoreRow, int]], starts: list[int], logits: torch.Tensor, keys: torch.Tensor,
                   ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per row of the pass: (logits (n, V), a copy; targets (n,); keys (n, C)) of the tokens it scores in this
    chunk (the context's own are not scored). Rows are left-padded: a row's n fed tokens are its last n positions."""
    T = logits.shape[1]
    blocks = []
    for i, ((row, n), lo) in enumerate(zip(plan, starts)):
        skip = max(0, row.first_scored - 1 - lo)
        targets = torch.tensor(row.tokens[lo + 1 + skip : lo + 1 + n], device=logits.device)  # (n,) next tokens
        row_logits = logits[i, T - n + skip :].clone()  # (n, V): the (B, T, V) block is not kept
        blocks.append((row_logits, targets, keys[i, T - n + skip :]))  # (n, C) keys
    return blocks


@dataclass(frozen=True)
class ScoredPass:
    """A score pass's rows and what each scores (`scored`), waiting for the step's one search."""

    plan: list[tuple[ScoreRow, int]]
    """(row, tokens fed) in the pass's order."""
    blocks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    """Per row: logits (n, V), targets (n,), keys (n, C) (_scored_blocks)."""


def scored(plan: list[tuple[ScoreRow, int]], starts: list[int], logits: torch.Tensor, keys: torch.Tensor) -> ScoredPass:
    """After a pass that fed score rows' chunks (`plan`, each row's `fed` before it in `starts`) with logits
    (B, T, V) and kNN keys (B, T, C) at every position: what its rows score, kept until the step's search
    (the (B, T, V) logits are not: n x V logits of the scored tokens only)."""
    return ScoredPass(plan, _scored_blocks(plan, starts, logits, keys))


def _searching(pending: list[ScoredPass]) -> Iterator[tuple[ScoreRow, tuple]]:
    """(row, block) of every kNN-LM row with tokens to score, pass by pass and row by row: `queries`' order."""
    for p in pending:
        for (row, _), block in zip(p.plan, p.blocks):
            if row.handle.request.knn is not None and len(block[1]):
                yield row, block


def queries(pending: list[ScoredPass]) -> tuple[torch.Tensor | None, list[KNNLMConfig], list[int]]:
    """The step's score queries: every scored token's key of the kNN-LM rows, (Q, C) (None: none), its row's
    settings and its row's request id, Q entries each."""
    searching = list(_searching(pending))
    knn = [row.handle.request.knn for row, block in searching for _ in range(len(block[1]))]
    owners = [row.handle.request_id for row, block in searching for _ in range(len(block[1]))]
    return (torch.cat([block[2] for _, block in searching]) if searching else None), knn, owners  # (Q, C)


def take_scores(engine: Engine, pending: list[ScoredPass], found: list[Neighbors | None],
                errors: Mapping[int, Exception]) -> None:
    """Keep each row's scores (memlm.jobs.scoring.score_part: base log-prob, the kNN-LM mixture, greedy flags
    and top-n under the final distribution) with `found`, the step search's (1, k_i) neighbours of `queries`
    in its order; a row whose window is done reads its next one from a cleared cache row, and a row whose last
    window is done delivers its SequenceScore. A row in `errors` (request id -> what its search raised), or whose
    own scoring raises, ends with that error; the others go on."""
    V = engine.model.config.vocab_size
    at = 0
    for p in pending:
        for (row, _), (row_logits, targets, keys) in zip(p.plan, p.blocks):
            request = row.handle.request
            nb = None
            searched = request.knn is not None and len(targets)
            mine = found[at : at + len(targets)] if searched else []  # n x (1, k_i)
            at += len(mine)
            if row.handle.request_id in errors:
                engine.fail(row, errors[row.handle.request_id])
                continue
            try:
                if searched:
                    nb = Neighbors(*(np.concatenate([q[f] for q in mine]) for f in range(3)))  # (n, k_i)
                if len(targets):
                    cached = row.doc_cache.extend(keys, targets) if row.doc_cache is not None else None
                    row.parts.append(score_part(row_logits, targets, nb, request.knn, min(request.top_n, V),
                                                cache=cached))
            except Exception as e:  # noqa: BLE001 - this row ends with it; the others go on
                engine.fail(row, e)
                continue
            if row.to_feed > 0:
                continue
            if row.at + 1 < len(row.windows):  # the next window, from position 0 of a cleared row
                engine.cache.clear_row(row.slot)
                row.at, row.fed = row.at + 1, 0
                continue
            row.handle.put(sequence_score(row, V))
            engine.release(row)


def sequence_score(row: ScoreRow, vocab: int) -> SequenceScore:
    """memlm.jobs.scoring's result for a finished score row (its assemble_scores over the row's parts): the tokens
    its windows scored (ScoreRequest.scored)."""
    request = row.handle.request
    return assemble_scores([request.scored], [row.parts], [1 + len(request.context)], min(request.top_n, vocab))[0]


def split(request: ScoreRequest, parts: int) -> list[ScoreRequest]:
    """A text's windows over at most `parts` requests of contiguous windows, so that several rows read one long
    text side by side (as score_tokens runs batch_size windows a pass); join_scores puts their scores together.
    A request without windows (XL segments), already a part, or keeping a document cache stays whole."""
    served = request.knn.interpolation if request.knn is not None else None
    if request.window is None or request.part is not None or (served is not None and served.has_cache):
        return [request]
    w = len(request.plan)
    n = max(1, min(parts, w))
    bounds = [i * w // n for i in range(n + 1)]
    return [replace(request, part=(a, b)) for a, b in itertools.pairwise(bounds)]


def join_scores(scores: list[SequenceScore]) -> SequenceScore:
    """The SequenceScore of a text from its parts' (split's requests, in order)."""
    if len(scores) == 1:
        return scores[0]

    def cat(name: str) -> np.ndarray:
        return np.concatenate([getattr(s, name) for s in scores])  # along the scored tokens

    searched = None if scores[0].searched is None else cat("searched")
    return SequenceScore(cat("tokens"), cat("base_logprob"), cat("logprob"), cat("greedy"), cat("top_ids"),
                         cat("top_logprobs"), scores[0].context_tokens, tuple(a for s in scores for a in s.attribution),
                         searched)
