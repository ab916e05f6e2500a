"""Score requests in the running batch (memlm.engine.requests.ScoreRequest): a text fed like a prompt, with
logits at every position, answered with memlm.jobs.scoring's SequenceScore (several clients' scores share
forward passes with each other and with generation).

Shape legend: B rows in a forward pass, T tokens per row, n tokens of a row's chunk, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from memlm.engine.requests import RequestHandle
from memlm.jobs.scoring import SequenceScore


class Engine(Protocol):
    """What a score pass uses of memlm.engine.engine.Engine (a protocol: that module imports this one)."""

    def _release(self, row: ScoreRow) -> None: ...


@dataclass
class ScoreRow:
    """A score request in the running batch: its tokens are fed like a prompt (all but the last, whose
    logits predict nothing), and each chunk's log-probabilities of the next tokens are kept."""

    handle: RequestHandle
    slot: int
    deadline: float | None
    tokens: list[int]
    """[boundary, *context, *continuation]."""
    first_scored: int
    """Index in `tokens` of the first scored token (1 + the context's length)."""
    fed: int = 0
    base: int = 0
    """Always 0 (a score never slides); window_starts' and the view's bookkeeping as for Row."""
    scored: list[tuple[int, float, bool]] = field(default_factory=list)
    """(token, base log-prob, greedy) of every scored token so far."""
    compressed: int = 0
    """Compressive rows: groups compressed so far (memlm.engine.compression)."""

    @classmethod
    def start(cls, handle: RequestHandle, slot: int, deadline: float | None) -> ScoreRow:
        request = handle.request
        return cls(handle, slot, deadline, request.prefix, 1 + len(request.context))

    @property
    def to_feed(self) -> int:
        return len(self.tokens) - 1 - self.fed

    @property
    def cached(self) -> int:
        return self.fed

    @property
    def first_generated_pos(self) -> int:
        return len(self.tokens)  # every fed token is read in segments (XL), like a prompt

    @property
    def steps_left(self) -> int:
        return self.to_feed

    def feed(self, n: int) -> tuple[list[int], list[int]]:
        lo = self.fed
        return self.tokens[lo : lo + n], list(range(lo, lo + n))


def sequence_score(row: ScoreRow) -> SequenceScore:
    """memlm.jobs.scoring's result type for a finished score row (no kNN-LM: final = base; no top-n)."""
    ids, lps, greedy = zip(*row.scored)
    base = np.array(lps, dtype=np.float32)
    return SequenceScore(np.array(ids, dtype=np.int64), base, base.copy(), np.array(greedy, dtype=bool),
                         np.zeros((len(ids), 0), dtype=np.int64), np.zeros((len(ids), 0), dtype=np.float32),
                         row.first_scored)


def take_scores(engine: Engine, plan: list[tuple[ScoreRow, int]], starts: list[int], logits: torch.Tensor,
                done: list[bool]) -> None:
    """After a pass that fed score rows' chunks (`plan`, each row's `fed` before it in `starts`) with logits
    (B, T, V) at every position: keep the scored tokens' log-probabilities (base LM; greedy = the argmax), and
    deliver each finished row's (`done`) SequenceScore."""
    T = logits.shape[1]
    for i, ((row, n), lo) in enumerate(zip(plan, starts)):
        targets = torch.tensor(row.tokens[lo + 1 : lo + 1 + n], device=logits.device)  # (n,) next tokens
        lp = torch.log_softmax(logits[i, T - n :].float(), dim=-1)  # (n, V)
        picked = lp.gather(1, targets[:, None])[:, 0]  # (n,)
        greedy = lp.argmax(dim=-1) == targets  # (n,)
        keep = slice(max(0, row.first_scored - 1 - lo), n)  # the context's own tokens are not scored
        row.scored += zip(targets[keep].tolist(), picked[keep].tolist(), greedy[keep].tolist())
    for (row, _), finished in zip(plan, done):
        if finished:
            row.handle.put(sequence_score(row))
            engine._release(row)
