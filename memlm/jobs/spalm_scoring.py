"""SPALM for the Score and Generate rpcs (Yogatama et al. 2021): per-token scoring and a
generation step, both over memlm.memory.spalm.spalm_forward.

`score_spalm` is `memlm.jobs.scoring.score_tokens_segments` with SPALM's head: the same segment stream
(memlm.jobs.segment_eval.SegmentStream: rows, padding, boundary token, memory resets), the same XL memory
(memlm.jobs.memorizing.open_memory), per segment ONE decoder pass and ONE batched search of the scored
positions' kNN keys (spalm_forward), each row's scores by memlm.jobs.token_scores.score_chunk; so a sequence
without context gets, token for token, the log-probabilities `memlm eval --memory spalm` (memlm.jobs.spalm.
evaluate_spalm) sums, bit for bit. A context conditions the continuation through the memory and is not
searched (its outputs are never read; the XL memory is the decoder's, which the head does not change).
There is no kNN-LM mixture here: `base_logprob` is the model's own (SPALM's) log-probability, as for the
other memories, and the gate g_t of every scored token comes beside the scores.

`spalm_step` is a SegmentStep for SPALM: the decoder with its XL memory over the step's
tokens, one search of the last position's key, the head: the logits of the next token.

Shape legend: B segment rows, T segment tokens, n scored tokens of a row, V vocab, C model width.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch

from memlm.errors import MemlmError
from memlm.jobs.memorizing import open_memory
from memlm.jobs.scoring import (
    ScoredPart,
    SequenceScore,
    assemble_scores,
    check_score_args,
    plan_segments,
    score_part,
    scored_slices,
)
from memlm.jobs.spalm import spalm_memory
from memlm.jobs.windows import ShouldStop, check_stop
from memlm.model.memory_config import MemoryConfig
from memlm.memory.spalm import SpalmHead, spalm_forward
from memlm.model.decoder import Decoder, DecoderState
from memlm.retrieval.searcher import Searcher, SearchOptions

SegmentStep = Callable[[Decoder, torch.Tensor, DecoderState], tuple[torch.Tensor, DecoderState]]
"""(model, idx (1, T), memory state) -> (the last position's next-token logits (V,), the new state): one step of a
memory with its own output head, for a caller that steps one sequence itself."""


class SpalmScores(NamedTuple):
    """What score_spalm returns: per sequence its scores and the gate of each scored token."""

    scores: list[SequenceScore]
    """One SequenceScore per sequence, in order (logprob == base_logprob: SPALM's own)."""
    gates: list[np.ndarray]
    """Per sequence, (n,) float32: g_t of each scored token (the hidden state's weight; 1 - g_t the memory's)."""


def score_spalm(
    model: Decoder,
    head: SpalmHead,
    token_seqs: Sequence[Sequence[int]],
    *,
    memory: MemoryConfig,
    searcher: Searcher,
    k: int,
    boundary_token: int,
    options: SearchOptions | None = None,
    contexts: Sequence[Sequence[int] | None] | None = None,
    top_n: int = 0,
    batch_size: int = 4,
    should_stop: ShouldStop | None = None,
) -> SpalmScores:
    """Score each sequence with SPALM, segment by segment (arguments as score_tokens_segments, except):

    head: the trained gate (memlm.memory.spalm.load_spalm_head). memory: kind "spalm" (its XL sizes and
    segment). searcher: the datastore, whose keys the caller has checked (memlm.retrieval.compat.
    check_searcher against the head's keys fingerprint). k: neighbours per scored token (>= 1).
    options: nprobe / exact re-rank of every search. batch_size: sequences side by side (equal to
    `memlm eval --batch-size` for bit-identical floats). should_stop: polled before every segment batch.
    """
    top_n = check_score_args(model, token_seqs, contexts, None, None, top_n)
    spalm_memory(memory)
    if memory.segment > model.config.max_seq_len:
        raise MemlmError(f"segment must be in [1, {model.config.max_seq_len}] (the model's context), got {memory.segment}")
    if batch_size < 1 or k < 1:
        raise MemlmError(f"batch_size and k must be >= 1, got {batch_size} and {k}")
    parts: list[list[ScoredPart]] = [[] for _ in token_seqs]
    gates: list[list[torch.Tensor]] = [[] for _ in token_seqs]
    prefix_lens, runs, stream = plan_segments(token_seqs, contexts, batch_size, memory.segment, boundary_token)
    if stream is not None:
        device = model.device
        state = open_memory(model, memory, stream.batch_size)
        with torch.inference_mode():
            while (batch := stream.next_batch()) is not None:
                check_stop(should_stop)
                where = stream.position()  # every real row has just advanced by its targets
                state = state.reset_rows(batch.reset.to(device))
                slices = scored_slices(batch, where, runs, prefix_lens)
                searched = torch.zeros_like(batch.mask)  # (B, T): the continuation targets only
                for r, _, a, b in slices:
                    searched[r, a:b] = True
                out = spalm_forward(model, head, batch.inputs.to(device), state, searcher, k, searched, options)
                state = out.state
                if not slices:
                    continue
                for r, seq, a, b in slices:  # logits (n, V), targets (n,) of a row; each target searched
                    parts[seq].append(score_part(out.logits[r, a:b], batch.targets[r, a:b], None, None, top_n,
                                                 searched=searched[r, a:b].cpu()))
                    gates[seq].append(out.gate[r, a:b].float().cpu())  # (n,)
    scores = assemble_scores(token_seqs, parts, prefix_lens, top_n)
    return SpalmScores(scores, [torch.cat(g).numpy() if g else np.zeros(0, np.float32) for g in gates])


def spalm_step(head: SpalmHead, searcher: Searcher, k: int, options: SearchOptions | None = None) -> SegmentStep:
    """A SegmentStep for SPALM: (model, idx (1, T), XL state) -> (the last position's
    SPALM logits (V,), the new state), with one search (of the last position's key) per step."""
    if k < 1:
        raise MemlmError(f"k must be >= 1, got {k}")

    def step(model: Decoder, idx: torch.Tensor, state: DecoderState) -> tuple[torch.Tensor, DecoderState]:
        last = torch.zeros(idx.shape, dtype=torch.bool)  # (1, T)
        last[:, -1] = True
        out = spalm_forward(model, head, idx, state, searcher, k, last, options)
        return out.logits[0, -1], out.state  # (V,)

    return step
