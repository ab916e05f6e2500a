"""SPALM for the Score and Generate rpcs (Yogatama et al. 2021; issue 11, part 4): per-token scoring and a
generation step, both over memlm.memory.spalm.spalm_forward.

`score_spalm` is `memlm.jobs.scoring.score_tokens_segments` with SPALM's head: the same segment stream
(memlm.jobs.segment_eval.SegmentStream: rows, padding, boundary token, memory resets), the same XL memory
(memlm.jobs.memorizing.open_memory), per segment ONE decoder pass and ONE batched search of the scored
positions' kNN keys (spalm_forward), the log-softmax over the whole (B, T, V) block; so a sequence without
context gets, token for token, the log-probabilities `memlm eval --memory spalm` (memlm.jobs.spalm.
evaluate_spalm) sums, bit for bit. A context conditions the continuation through the memory and is not
searched (its outputs are never read; the XL memory is the decoder's, which the head does not change).
There is no kNN-LM mixture here: `base_logprob` is the model's own (SPALM's) log-probability, as for the
other memories, and the gate g_t of every scored token comes beside the scores.

`spalm_step` is memlm.jobs.generate's SegmentStep for SPALM: the decoder with its XL memory over the step's
tokens, one search of the last position's key, the head: the logits of the next token.

Shape legend: B segment rows, T segment tokens, n scored tokens of a row, V vocab, C model width.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from memlm.errors import MemlmError
from memlm.jobs.generate import SegmentStep
from memlm.jobs.memorizing import open_memory
from memlm.jobs.scoring import (
    SequenceScore,
    assemble_scores,
    _check_common,
    final_scores,
    _scored_slices,
)
from memlm.jobs.segment_eval import SegmentStream
from memlm.jobs.spalm import spalm_memory
from memlm.jobs.windows import ShouldStop, check_stop
from memlm.model.memory_config import MemoryConfig
from memlm.memory.spalm import SpalmHead, spalm_forward
from memlm.model.decoder import Decoder, DecoderState
from memlm.retrieval.searcher import Searcher, SearchOptions


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
    top_n = _check_common(model, token_seqs, contexts, None, None, top_n)
    spalm_memory(memory)
    if memory.segment > model.config.max_seq_len:
        raise MemlmError(f"segment must be in [1, {model.config.max_seq_len}] (the model's context), got {memory.segment}")
    if batch_size < 1 or k < 1:
        raise MemlmError(f"batch_size and k must be >= 1, got {batch_size} and {k}")
    parts: list[list[tuple[torch.Tensor, ...]]] = [[] for _ in token_seqs]
    gates: list[list[torch.Tensor]] = [[] for _ in token_seqs]
    ctxs = [list(c or ()) for c in contexts] if contexts is not None else [[] for _ in token_seqs]
    prefix_lens = [1 + len(c) for c in ctxs]
    runs = [i for i, tokens in enumerate(token_seqs) if len(tokens) > 0]  # nothing to score: never run
    if runs:
        docs = [[*ctxs[i], *token_seqs[i]] for i in runs]  # the stream prepends the boundary token
        rows = min(batch_size, len(docs))
        stream = SegmentStream(docs, rows, memory.segment, boundary_token)
        device = model.device
        state = open_memory(model, memory, rows)
        with torch.inference_mode():
            while (batch := stream.next_batch()) is not None:
                check_stop(should_stop)
                where = stream.position()  # every real row has just advanced by its targets
                state = state.reset_rows(batch.reset.to(device))
                slices = _scored_slices(batch, where, runs, prefix_lens)
                searched = torch.zeros_like(batch.mask)  # (B, T): the continuation targets only
                for r, _, a, b in slices:
                    searched[r, a:b] = True
                out = spalm_forward(model, head, batch.inputs.to(device), state, searcher, k, searched, options)
                state = out.state
                if not slices:
                    continue
                # Over the whole (B, T, V) block, as evaluate_spalm does, for bit-identical floats.
                logp = F.log_softmax(out.logits.float(), dim=-1)  # (B, T, V)
                for r, seq, a, b in slices:
                    targets = batch.targets[r, a:b].to(device)  # (n,)
                    lp = logp[r, a:b]  # (n, V)
                    parts[seq].append(final_scores(lp, targets, lp.argmax(dim=-1) == targets, None, None, top_n,
                                                    searched=searched[r, a:b].cpu()))  # each target searched
                    gates[seq].append(out.gate[r, a:b].float().cpu())  # (n,)
    scores = assemble_scores(token_seqs, parts, prefix_lens, top_n)
    return SpalmScores(scores, [torch.cat(g).numpy() if g else np.zeros(0, np.float32) for g in gates])


def spalm_step(head: SpalmHead, searcher: Searcher, k: int, options: SearchOptions | None = None) -> SegmentStep:
    """memlm.jobs.generate's SegmentStep for SPALM: (model, idx (1, T), XL state) -> (the last position's
    SPALM logits (V,), the new state), with one search (of the last position's key) per step."""
    if k < 1:
        raise MemlmError(f"k must be >= 1, got {k}")

    def step(model: Decoder, idx: torch.Tensor, state: DecoderState) -> tuple[torch.Tensor, DecoderState]:
        last = torch.zeros(idx.shape, dtype=torch.bool)  # (1, T)
        last[:, -1] = True
        out = spalm_forward(model, head, idx, state, searcher, k, last, options)
        return out.logits[0, -1], out.state  # (V,)

    return step
