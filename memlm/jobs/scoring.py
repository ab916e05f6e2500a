"""Per-token scoring of token sequences: what the Score rpc and lm-evaluation-harness need.

`score_tokens` gives, for every scored token, the base LM log-probability, the final one (kNN-LM mixture
when a searcher is given, Khandelwal et al. 2020), whether it is the greedy choice, and optionally the
top-n alternatives. It covers both of lm-evaluation-harness's requests:
- loglikelihood_rolling: a sequence without context; every token is scored.
- loglikelihood: a context (conditioning only) and a continuation (scored).

Conventions are those of `memlm eval` (memlm.jobs.windows): each sequence is preceded by one boundary
token (memlm.model.tokenizer.document_boundary), so its first token is predicted too; long sequences are
scored in sliding windows (context length L, stride s), each token exactly once; windows run through the
same batch forward as `score_documents` (memlm.jobs.windows.forward_windows), so a sequence without
context gets bit-identical base log-probabilities, and its perplexity equals `evaluate_perplexity` on
the same tokens. Each window's scores are memlm.jobs.token_scores.score_chunk's, the computation evaluation
and the engine's score rows share, so kNN-LM perplexities agree too.

`score_tokens_segments` is the segment-recurrent counterpart (memory modes of the Score rpc): each
sequence is cut into consecutive segments that run once, attending to a Transformer-XL (or compressive)
memory of the earlier segments (memlm.memory), with the conventions of `memlm eval --memory`
(memlm.jobs.segment_eval.evaluate_segments): the same segment stream (memlm.jobs.segment_eval.SegmentStream, so the
same rows, padding and memory resets), so a sequence without context gets bit-identical base
log-probabilities and its perplexity equals evaluate_segments' on the same tokens. kNN-LM keys come from
the same forward pass, i.e. they are computed with the memory in place.

Shape legend: B windows (segment rows) in a batch, T window (segment) length, n scored tokens of a window,
Q scored tokens of a batch, k neighbours, V vocab, C key width, N top-n alternatives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from memlm.errors import MemlmError
from memlm.jobs.fewer_scoring import search_fewer
from memlm.jobs.memorizing import close_memory, open_memory
from memlm.jobs.segment_eval import SegmentBatch, SegmentStream
from memlm.jobs.token_scores import ChunkScores, score_chunk
from memlm.jobs.windows import (
    ShouldStop,
    Window,
    check_stop,
    check_window,
    forward_windows,
    plan_windows,
)
from memlm.memory.compressive import Compressor
from memlm.model.memory_config import MemoryConfig
from memlm.model.decoder import Decoder
from memlm.retrieval.adaptive import distribution_features
from memlm.retrieval.attribution import (
    SourcedNeighbors,
    TokenAttribution,
    attribute,
    require_sourced,
    slice_sourced,
)
from memlm.retrieval.knnlm import KNNLMConfig
from memlm.retrieval.searcher import Neighbors, Searcher, search_keys

if TYPE_CHECKING:
    from memlm.jobs.knnlm_eval import Retrieval
    from memlm.memory.memorizing import KnnAttention
    from memlm.memory.knn_store import KeyValueMemoryFactory


@dataclass(frozen=True)
class SequenceScore:
    """Scores of one sequence's scored tokens (its continuation; the context is never scored)."""

    tokens: np.ndarray
    """(n,) int64: the scored token ids, in order."""
    base_logprob: np.ndarray
    """(n,) float32: log p_LM(token | left context), nats."""
    logprob: np.ndarray
    """(n,) float32: final log-probability (the kNN-LM mixture when kNN-LM is on, else base_logprob), nats."""
    greedy: np.ndarray
    """(n,) bool: the token is the argmax of the final distribution."""
    top_ids: np.ndarray
    """(n, N) int64: the N most likely tokens under the final distribution, most likely first."""
    top_logprobs: np.ndarray
    """(n, N) float32: their final log-probabilities."""
    context_tokens: int
    """Tokens the first scored token was conditioned on: the boundary token plus the context."""
    attribution: tuple[TokenAttribution, ...] = ()
    """(n,) per scored token its top documents (memlm.retrieval.attribution) when attribution was asked
    for with kNN-LM; empty otherwise."""
    searched: np.ndarray | None = None
    """(n,) bool: a kNN search was made for the token (fewer with a gate or pointers; all True
    with plain kNN-LM); None without kNN-LM."""

    @property
    def searches(self) -> int:
        """kNN searches made for the scored tokens (one per token with plain kNN-LM; 0 without kNN-LM)."""
        return 0 if self.searched is None else int(self.searched.sum())

    @property
    def total_logprob(self) -> float:
        """Sum of the final log-probabilities (float64), nats."""
        return float(self.logprob.astype(np.float64).sum())

    @property
    def base_total_logprob(self) -> float:
        """Sum of the base log-probabilities (float64), nats."""
        return float(self.base_logprob.astype(np.float64).sum())

    @property
    def perplexity(self) -> float:
        """exp(-total_logprob / n); +inf when nothing was scored."""
        n = len(self.tokens)
        return math.exp(-self.total_logprob / n) if n else math.inf

    @property
    def is_greedy(self) -> bool:
        """Every scored token is greedy (lm-evaluation-harness's is_greedy)."""
        return bool(self.greedy.all())


class _Job(NamedTuple):
    window: Window
    sequence: torch.Tensor  # (L,) int64: boundary + context + continuation


def plan_scored_windows(n_inputs: int, first: int, context: int, stride: int, doc: int = 0) -> list[Window]:
    """Windows that score input positions [first, n_inputs) exactly once (targets are the next tokens).

    first == 0 is `memlm.jobs.windows.plan_windows` itself (what `memlm eval` runs). With a context
    (first > 0) the first window ends as far right as lets its first scored token keep L - s tokens of
    left context (all of the context when the sequence fits one window), and later windows advance by
    s, as in plan_windows; positions before `first` are conditioning only.
    """
    if first == 0:
        return plan_windows(n_inputs, context, stride, doc)
    check_window(context, stride)
    windows = []
    scored_until = first
    end = min(n_inputs, max(context, first + stride))
    while scored_until < n_inputs:
        windows.append(Window(doc, max(0, end - context), end, scored_until))
        scored_until = end
        end = min(n_inputs, end + stride)
    return windows


def score_tokens(
    model: Decoder,
    token_seqs: Sequence[Sequence[int]],
    *,
    context: int,
    stride: int,
    boundary_token: int,
    contexts: Sequence[Sequence[int] | None] | None = None,
    searcher: Searcher | None = None,
    knn: KNNLMConfig | None = None,
    top_n: int = 0,
    batch_size: int = 4,
    should_stop: ShouldStop | None = None,
    attribution: int = 0,
    retrieval: Retrieval | None = None,
) -> list[SequenceScore]:
    """Score each sequence of `token_seqs`, one SequenceScore per sequence, in order.

    token_seqs: the tokens to score (continuations), ids in [0, V).
    context, stride: window length L and stride s in tokens (as `memlm eval --context/--stride`).
    boundary_token: prepended to every sequence (`memlm.model.tokenizer.document_boundary`).
    contexts: per sequence, tokens that condition the continuation but are not scored (None or empty
        = no context), placed between the boundary token and the continuation.
    searcher, knn: kNN-LM (both or neither); knn.lmbda and knn.temperature must be set (not "auto").
    top_n: alternatives per scored token (0 = none).
    batch_size: windows per forward pass (equal to `memlm eval --batch-size` for bit-identical floats).
    should_stop: polled before every forward batch; when it says True, WorkStopped is raised (a server
        whose client gave up frees its model thread within one batch). None = run to the end.
    attribution: top documents per scored token (SequenceScore.attribution; 0 = none); needs kNN-LM and a
        memlm.retrieval.attribution.SourcedSearcher (the searches then ask for provenance; scores are equal).
    retrieval: fewer searches (memlm.jobs.fewer_scoring): a gate and/or RetoMaton pointers; needs
        kNN-LM, not with attribution; None: a search for every token. SequenceScore.searched says which.
    """
    top_n = check_score_args(model, token_seqs, contexts, searcher, knn, top_n, attribution)
    check_window(context, stride, model.config.max_seq_len)
    if retrieval is not None and (knn is None or attribution):
        raise MemlmError("fewer searches need kNN-LM and no attribution (attribution needs every token's search)")

    # Per sequence, per scored token: base, final, greedy, top ids, top logprobs (filled window by window).
    parts: list[list[ScoredPart]] = [[] for _ in token_seqs]
    prefix_lens: list[int] = []
    jobs: list[_Job] = []
    for i, tokens in enumerate(token_seqs):
        ctx = list(contexts[i] or ()) if contexts is not None else []
        prefix_lens.append(1 + len(ctx))
        if len(tokens) == 0:
            continue
        sequence = torch.tensor([boundary_token, *ctx, *tokens], dtype=torch.long)  # inputs [:-1], targets [1:]
        for w in plan_scored_windows(len(sequence) - 1, len(ctx), context, stride, doc=i):
            jobs.append(_Job(w, sequence))
    for lo in range(0, len(jobs), batch_size):
        check_stop(should_stop)
        batch = jobs[lo : lo + batch_size]
        for job, scores in zip(batch, _score_batch(model, batch, searcher, knn, top_n, attribution, retrieval)):
            parts[job.window.doc].append(scores)

    return assemble_scores(token_seqs, parts, prefix_lens, top_n)


def score_tokens_segments(
    model: Decoder,
    token_seqs: Sequence[Sequence[int]],
    *,
    memory: MemoryConfig,
    boundary_token: int,
    contexts: Sequence[Sequence[int] | None] | None = None,
    searcher: Searcher | None = None,
    knn: KNNLMConfig | None = None,
    top_n: int = 0,
    batch_size: int = 4,
    compressor: Compressor | None = None,
    should_stop: ShouldStop | None = None,
    knn_attention: KnnAttention | None = None,
    service: KeyValueMemoryFactory | None = None,
    attribution: int = 0,
) -> list[SequenceScore]:
    """Score each sequence segment by segment with a memory carried across segments (Dai et al. 2019).

    Arguments as `score_tokens`, except:
    memory: which memory, its sizes and its segment (memlm.model.memory_config.MemoryConfig; kind "none" runs
        each segment alone); 1 <= memory.segment <= the model's context, as `memlm eval --segment`.
    batch_size: sequences run side by side, one per row (equal to `memlm eval --batch-size` for
        bit-identical floats); a row's memory is reset when it starts the next sequence.
    compressor: the learned compressor for memory.compress_fn "conv".
    should_stop, attribution: as in score_tokens (should_stop: polled before every segment batch).
    knn_attention, service: memory.kind "memorizing" (Wu et al. 2022): the layer's parameters (required)
        and the retrieval-service memory factory (knn_backend "service"); the state is opened as
        `memlm eval --memory memorizing` opens it (memlm.jobs.memorizing.open_memory), so per-token
        log-probabilities equal evaluate_memory's.
    Each sequence is boundary + context + continuation; every position is run exactly once and only the
    continuation's targets are scored, so a context conditions the continuation through the memory
    (and the segment it shares with it).
    """
    top_n = check_score_args(model, token_seqs, contexts, searcher, knn, top_n, attribution)
    segment = memory.segment
    if segment > model.config.max_seq_len:
        raise MemlmError(f"segment must be in [1, {model.config.max_seq_len}] (the model's context), got {segment}")
    if batch_size < 1:
        raise MemlmError(f"batch_size must be >= 1, got {batch_size}")
    if memory.kind == "compressive" and memory.compress_fn == "conv" and compressor is None:
        raise MemlmError("compress_fn conv needs a trained compressor")

    parts: list[list[ScoredPart]] = [[] for _ in token_seqs]
    prefix_lens, runs, stream = plan_segments(token_seqs, contexts, batch_size, segment, boundary_token)
    if stream is not None:
        device = model.device
        state = open_memory(model, memory, stream.batch_size, compressor=compressor, knn_attention=knn_attention,
                            service=service)
        try:
            with torch.inference_mode():
                while (batch := stream.next_batch()) is not None:
                    check_stop(should_stop)
                    # Where each row's targets sit in its document: the stream has just advanced every
                    # real row by its number of scored targets.
                    where = stream.position()
                    if state is not None:
                        state = state.reset_rows(batch.reset.to(device))
                    out = model(batch.inputs.to(device), state)
                    state = out.state
                    slices = scored_slices(batch, where, runs, prefix_lens)
                    if not slices:
                        continue
                    neighbors = _search_each(searcher, knn, [out.knn_key[r, a:b] for r, _, a, b in slices],
                                             attribution)
                    for (r, seq, a, b), nb in zip(slices, neighbors):  # logits (n, V), targets (n,) of a row
                        parts[seq].append(score_part(out.logits[r, a:b], batch.targets[r, a:b], nb, knn, top_n,
                                                     attribution))
        finally:
            close_memory(state)
    return assemble_scores(token_seqs, parts, prefix_lens, top_n)


class SegmentPlan(NamedTuple):
    """How a segment-recurrent Score call runs its sequences (score_tokens_segments, SPALM's score_spalm)."""

    prefix_lens: list[int]
    """Per sequence, the boundary token plus its context."""
    runs: list[int]
    """Original index of each document the stream deals: the sequences with tokens to score, in order."""
    stream: SegmentStream | None
    """The segments of boundary + context + continuation, min(batch_size, len(runs)) rows; None: nothing to score."""


def plan_segments(token_seqs: Sequence[Sequence[int]], contexts: Sequence[Sequence[int] | None] | None,
                  batch_size: int, segment: int, boundary_token: int) -> SegmentPlan:
    """The SegmentPlan of `token_seqs` with `contexts` (None or empty: no context) in segments of `segment` tokens."""
    ctxs = [list(c or ()) for c in contexts] if contexts is not None else [[] for _ in token_seqs]
    prefix_lens = [1 + len(c) for c in ctxs]
    runs = [i for i, tokens in enumerate(token_seqs) if len(tokens) > 0]  # nothing to score: never run
    if not runs:
        return SegmentPlan(prefix_lens, runs, None)
    docs = [[*ctxs[i], *token_seqs[i]] for i in runs]  # the stream prepends the boundary token
    return SegmentPlan(prefix_lens, runs, SegmentStream(docs, min(batch_size, len(docs)), segment, boundary_token))


def scored_slices(
    batch: SegmentBatch, where: dict[str, list[int]], runs: list[int], prefix_lens: list[int]
) -> list[tuple[int, int, int, int]]:
    """(row, original sequence index, first column, end column) of each row's continuation targets.

    where: the stream's position just after dealing `batch` (every real row advanced by its targets);
    runs: original index of each document the stream deals; prefix_lens: boundary + context per sequence.
    """
    slices = []
    for r in range(batch.mask.shape[0]):
        n = int(batch.mask[r].sum())
        if n == 0:
            continue
        seq = runs[where["row_doc"][r]]
        lo = where["row_offset"][r] - n  # document target index of column 0
        first = max(0, prefix_lens[seq] - 1 - lo)  # context targets are not scored
        if first < n:
            slices.append((r, seq, first, n))
    return slices


def check_score_args(
    model: Decoder, token_seqs: Sequence[Sequence[int]], contexts: Sequence[Sequence[int] | None] | None,
    searcher: Searcher | None, knn: KNNLMConfig | None, top_n: int, attribution: int = 0,
) -> int:
    """The argument checks score_tokens and score_tokens_segments share (MemlmError naming the argument);
    returns top_n capped at the vocabulary size."""
    if attribution:
        if searcher is None:
            raise MemlmError("attribution needs kNN-LM: its documents are the retrieved neighbours'")
        require_sourced(searcher)
    if (searcher is None) != (knn is None):
        raise MemlmError("kNN-LM scoring needs both a searcher and a KNNLMConfig")
    if knn is not None and knn.needs_tuning:
        raise MemlmError("kNN-LM scoring needs a fixed lambda and temperature (tuning is `memlm eval`'s job)")
    if top_n < 0:
        raise MemlmError(f"top_n must be >= 0, got {top_n}")
    if contexts is not None and len(contexts) != len(token_seqs):
        raise MemlmError(f"{len(contexts)} contexts for {len(token_seqs)} sequences")
    return min(top_n, model.config.vocab_size)


class ScoredPart(NamedTuple):
    """One chunk of a sequence's scored tokens (a window, a segment row, an engine pass), on the CPU: what
    assemble_scores concatenates."""

    scores: ChunkScores
    """memlm.jobs.token_scores.score_chunk's scores of the chunk's n tokens."""
    attribution: tuple[TokenAttribution, ...] = ()
    """(n,) per token its top documents when attribution was asked for; empty otherwise."""
    searched: torch.Tensor | None = None
    """(n,) bool: a kNN search was made for the token; None without kNN-LM."""


def score_part(
    logits: torch.Tensor, targets: torch.Tensor, neighbors: Neighbors | SourcedNeighbors | None,
    knn: KNNLMConfig | None, top_n: int, attribution: int = 0, keep_base: torch.Tensor | None = None,
    searched: torch.Tensor | None = None, cache: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> ScoredPart:
    """One chunk's ScoredPart: score_chunk of its logits (n, V) and targets (n,), with its tokens' attribution.

    neighbors: (n, k) neighbours of the chunk's keys (sourced with attribution), or None without kNN-LM.
    keep_base: (n,) bool, tokens a gate kept on the base distribution. searched: (n,) bool, which tokens were
    searched (None with neighbours: every one). cache: the tokens' document-cache neighbours (score_chunk).
    """
    sourced = None
    if attribution and neighbors is not None:
        sourced, neighbors = neighbors, neighbors.neighbors  # (n, k) neighbours with their documents
    scores = score_chunk(logits, targets, neighbors=neighbors, knn=knn, keep_base=keep_base, top_n=top_n,
                         cache=cache).cpu()
    if neighbors is not None and searched is None:  # plain kNN-LM: a search per token
        searched = torch.ones(scores.base.shape[0], dtype=torch.bool)  # (n,)
    attributed: tuple[TokenAttribution, ...] = ()
    if sourced is not None:
        attributed = tuple(attribute(sourced, targets.cpu().numpy(), scores.final.numpy(), knn.temperature,
                                     knn.lmbda, attribution))
    return ScoredPart(scores, attributed, searched)


def assemble_scores(
    token_seqs: Sequence[Sequence[int]], parts: list[list[ScoredPart]], prefix_lens: list[int], top_n: int
) -> list[SequenceScore]:
    """Concatenate each sequence's ScoredParts, in order, into one SequenceScore."""
    results = []
    for i, tokens in enumerate(token_seqs):
        attribution = tuple(a for part in parts[i] for a in part.attribution)
        flags = [part.searched for part in parts[i] if part.searched is not None]
        searched = torch.cat(flags).bool().numpy() if flags and len(flags) == len(parts[i]) else None
        if parts[i]:
            cols = [torch.cat(c) for c in list(zip(*(part.scores for part in parts[i])))[:5]]
        else:
            cols = [torch.empty(0), torch.empty(0), torch.empty(0, dtype=torch.bool),
                    torch.empty(0, top_n, dtype=torch.long), torch.empty(0, top_n)]
        base, final, greedy, top_ids, top_lp = cols
        results.append(SequenceScore(
            tokens=np.asarray(tokens, dtype=np.int64).reshape(-1),
            base_logprob=base.float().numpy(),
            logprob=final.float().numpy(),
            greedy=greedy.bool().numpy(),
            top_ids=top_ids.long().reshape(len(base), top_n).numpy(),
            top_logprobs=top_lp.float().reshape(len(base), top_n).numpy(),
            context_tokens=prefix_lens[i],
            attribution=attribution,
            searched=searched,
        ))
    return results


@torch.inference_mode()
def _score_batch(
    model: Decoder,
    batch: list[_Job],
    searcher: Searcher | None,
    knn: KNNLMConfig | None,
    top_n: int,
    attribution: int = 0,
    retrieval: Retrieval | None = None,
) -> list[ScoredPart]:
    """One forward pass over up to batch_size windows (memlm.jobs.windows.forward_windows, what
    `memlm eval` runs); returns each window's ScoredPart."""
    outputs = forward_windows(model, batch)
    if retrieval is not None:  # the gate's features per window, then the batch's fewer searches
        features = None
        if retrieval.adaptive is not None:
            features = [score_chunk(o.logits, o.targets, lm_features=distribution_features).features.cpu()
                        for o in outputs]  # (n, 5) each
        fewer = search_fewer(searcher, knn, [o.keys for o in outputs], [o.targets for o in outputs], features,
                             [job.window.doc for job in batch], retrieval)
        return [score_part(o.logits, o.targets, f.neighbors, knn, top_n, keep_base=f.keep_base, searched=f.searched)
                for o, f in zip(outputs, fewer)]
    neighbors = _search_each(searcher, knn, [o.keys for o in outputs], attribution)
    return [score_part(o.logits, o.targets, nb, knn, top_n, attribution) for o, nb in zip(outputs, neighbors)]


def _search_each(
    searcher: Searcher | None, knn: KNNLMConfig | None, keys: list[torch.Tensor], attribution: int = 0,
) -> list[Neighbors | SourcedNeighbors | None]:
    """Neighbours of each key block (n_i, C), from one search over all of them (one per forward batch);
    None for every block without kNN-LM; with attribution, sourced neighbours (the same neighbours, with
    their documents)."""
    if searcher is None:
        return [None] * len(keys)
    if attribution:
        xq = torch.cat(keys).detach().float().cpu().numpy()  # (Q, C) float32, as search_keys sends it
        found = require_sourced(searcher).search_sourced(xq, knn.k, knn.search_options)  # (Q, k)
    else:
        found = search_keys(searcher, torch.cat(keys), knn.k, knn.search_options)  # (Q, k) arrays
    blocks, offset = [], 0
    for block in keys:
        rows = slice(offset, offset + block.shape[0])
        blocks.append(slice_sourced(found, rows) if attribution else Neighbors(*(a[rows] for a in found)))  # (n, k)
        offset += block.shape[0]
    return blocks
