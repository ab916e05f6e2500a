"""Sliding windows over documents: the one loop that scores tokens and produces kNN keys.

Perplexity jobs, the datastore builder and kNN-LM evaluation all consume `score_documents`, so every
key in a datastore sees exactly the left context that evaluation gives the same token; per-token
scoring (memlm.jobs.scoring, the Score rpc) runs the same batch forward, `forward_windows`, so its
floats are those of `memlm eval` bit for bit.

Each document is scored on its own, preceded by one boundary token (memlm.model.tokenizer.document_boundary), so its
first real token is predicted too and no window crosses a document boundary. With context length L
and stride s, windows start every s tokens; each window scores only the targets after the previous
window's end (the overlap is context only), so every target is scored exactly once.

Shape legend: B windows in a batch, T window length, n scored tokens, C key width, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple

import torch

from memlm.errors import MemlmError
from memlm.jobs.token_scores import LMFeatures, score_chunk
from memlm.model.decoder import Decoder
from memlm.retrieval.exact import EXACT_INDEX, TorchExactSearcher
from memlm.retrieval.searcher import SearcherInfo


ShouldStop = Callable[[], bool]
"""Polled by long jobs (scoring, generation) between forward passes: True = the caller gave up (its client
cancelled, its deadline passed, the server is stopping); the job then raises WorkStopped."""


class WorkStopped(Exception):
    """A long job ended early because its `should_stop()` said so; nothing was returned. Not a MemlmError:
    the user did nothing wrong, and the command line never passes should_stop."""


def check_stop(should_stop: ShouldStop | None) -> None:
    """Raise WorkStopped when should_stop (None = never) says the caller gave up."""
    if should_stop is not None and should_stop():
        raise WorkStopped("stopped: the caller gave up")


class Window(NamedTuple):
    """Inputs tokens[start:end] of one document; predictions for targets tokens[score_from+1 : end+1]."""

    doc: int  # document number in the input order
    start: int  # first input position (inclusive)
    end: int  # last input position (exclusive)
    score_from: int  # first input position whose prediction is scored; start <= score_from < end


def check_window(context: int, stride: int, max_seq_len: int | None = None) -> None:
    """MemlmError unless 1 <= stride <= context (<= max_seq_len, the model's context, when given): the
    flags of `memlm eval` and the Score rpc's window fields."""
    if context < 1:
        raise MemlmError(f"--context must be at least 1, got {context}")
    if max_seq_len is not None and context > max_seq_len:
        raise MemlmError(f"--context {context} is longer than the model supports ({max_seq_len}); "
                         f"pass --context {max_seq_len} or less")
    if not 1 <= stride <= context:
        raise MemlmError(f"--stride must be between 1 and --context ({context}), got {stride}")


def plan_windows(n_inputs: int, context: int, stride: int, doc: int = 0) -> list[Window]:
    """Windows over a sequence with n_inputs input positions (targets are the next positions).

    Every input position i in [0, n_inputs) is scored exactly once, in the first window that
    reaches it, with as much left context as that window gives (at least context - stride tokens
    once the document is longer than the context).
    """
    check_window(context, stride)
    windows = []
    scored_until = 0
    start = 0
    while scored_until < n_inputs:
        end = min(start + context, n_inputs)
        windows.append(Window(doc, start, end, scored_until))
        scored_until = end
        start += stride
    return windows


class WindowCost(NamedTuple):
    """What a plan of windows costs, known before any of it runs (the Score rpc's budget)."""

    windows: int
    """Forward rows (windows)."""
    forward_tokens: int
    """Sum over the windows of their length (end - start), in tokens."""


def window_cost(n_inputs: int, first: int, context: int, stride: int) -> WindowCost:
    """The cost of `plan_scored_windows(n_inputs, first, context, stride)` (plan_windows for first == 0),
    in closed form: a plan of millions of windows is priced without being built.

    first == 0: windows start at 0, s, 2s, ... and end at min(start + L, n); the last one is the first
    that reaches n. first > 0: windows end at e0 = min(n, max(L, first + s)), e0 + s, ... (the last at n)
    and each is min(end, L) long.
    """
    check_window(context, stride)
    if n_inputs <= first:
        return WindowCost(0, 0)
    if first == 0:
        full = max(0, -(-(n_inputs - context) // stride))  # windows before the last: all L long
        return WindowCost(full + 1, full * context + (n_inputs - full * stride))
    end0 = min(n_inputs, max(context, first + stride))
    before_last = max(0, -(-(n_inputs - end0) // stride))  # windows ending at end0 + j*s < n
    short = min(before_last, max(0, -(-(context - end0) // stride)))  # of those, ending before L: end0 + j*s long
    tokens = short * end0 + stride * short * (short - 1) // 2 + (before_last - short) * context + min(n_inputs, context)
    return WindowCost(before_last + 1, tokens)


class ScoredTokens(NamedTuple):
    """The scored targets of one window."""

    doc: int
    positions: torch.Tensor  # (n,) int64, index of each target within its document's tokens
    targets: torch.Tensor  # (n,) int64 token ids
    lm_logprob: torch.Tensor  # (n,) float32 log p_LM(target | context), empty when logprobs were not asked
    greedy: torch.Tensor  # (n,) bool, target == argmax of the LM distribution (empty likewise)
    keys: torch.Tensor  # (n, C) kNN-LM keys in the model's dtype, on the model's device
    features: torch.Tensor | None = None  # (n, F) float32 CPU, lm_features of the log-probs; None unless asked


@dataclass(frozen=True)
class WindowConfig:
    """Sliding windows of `memlm eval`, the datastore builder and the Score rpc."""

    context: int = 1024
    """Tokens of input per window (at most the model's max_seq_len)."""
    stride: int = 512
    """Tokens between window starts; only the last `stride` positions of a full window are scored."""
    batch_size: int = 4
    """Windows per forward pass."""

    @classmethod
    def for_model(
        cls, max_seq_len: int, context: int | None = None, stride: int | None = None, batch_size: int | None = None
    ) -> "WindowConfig":
        """The one defaulting rule for windows: context None -> the default context capped at the model's
        max_seq_len; stride None -> half the context (at least 1); batch_size None -> the default. Given
        values are kept as they are (an invalid one is refused where the windows are planned, `plan_windows`)."""
        if context is None:
            context = min(cls.context, max_seq_len)
        if stride is None:
            stride = max(1, context // 2)
        return cls(context=context, stride=stride, batch_size=cls.batch_size if batch_size is None else batch_size)


def score_documents(
    model: Decoder,
    documents: Iterable[list[int]],
    config: WindowConfig,
    boundary_token: int,
    with_logprobs: bool = True,
    skip_batches: int = 0,
    lm_features: LMFeatures | None = None,
) -> Iterator[ScoredTokens]:
    """Run the decoder over sliding windows of each document and yield what each window scores.

    documents: token ids per document (the boundary token is prepended here).
    with_logprobs: False skips the output head entirely (datastore building needs only keys).
    skip_batches: plan but do not run the first batches (a resumed datastore build): the batches
        after them are composed exactly as in a full run, so their floats are identical too.
    lm_features: also give each token these statistics of its log-probabilities (needs with_logprobs).
    Full-vocabulary log-probabilities exist for one batch at a time only: (B, T, V) floats.
    """
    check_window(config.context, config.stride, model.config.max_seq_len)
    pending: list[tuple[Window, torch.Tensor]] = []
    batch_index = 0
    for doc_index, tokens in enumerate(documents):
        if len(tokens) == 0:
            continue
        sequence = torch.tensor([boundary_token, *tokens], dtype=torch.long)  # inputs [:-1], targets [1:]
        for window in plan_windows(len(sequence) - 1, config.context, config.stride, doc_index):
            pending.append((window, sequence))
            if len(pending) == config.batch_size:
                if batch_index >= skip_batches:
                    yield from _score_batch(model, pending, with_logprobs, lm_features)
                batch_index += 1
                pending = []
    if pending and batch_index >= skip_batches:
        yield from _score_batch(model, pending, with_logprobs, lm_features)


class WindowOutput(NamedTuple):
    """What one forward pass gives for the scored slice of one window."""

    window: Window
    targets: torch.Tensor  # (n,) int64 token ids, on the CPU
    logits: torch.Tensor | None  # (n, V) in the model's dtype, a view of the batch's logits; None without the head
    keys: torch.Tensor  # (n, C) kNN-LM keys in the model's dtype, on the model's device


@torch.inference_mode()
def forward_windows(
    model: Decoder, batch: Sequence[tuple[Window, torch.Tensor]], with_logits: bool = True
) -> list[WindowOutput]:
    """One forward pass over a batch of windows; per window, its scored slice (memlm eval, the datastore
    builder and memlm.jobs.scoring all run this, so their floats agree bit for bit).

    batch: (window, sequence) pairs; sequence (L,) int64 holds the inputs [:-1] and the targets [1:] of
        the window's document.
    with_logits: False skips the output head entirely (datastore building needs only keys).
    """
    device = model.device
    T = max(w.end - w.start for w, _ in batch)
    # Right padding is harmless under a causal mask: padded positions come after every real one.
    inputs = torch.zeros(len(batch), T, dtype=torch.long)  # (B, T)
    for row, (w, seq) in enumerate(batch):
        inputs[row, : w.end - w.start] = seq[w.start : w.end]
    first_scored = min(w.score_from - w.start for w, _ in batch)
    out = model(inputs.to(device), logits_from=first_scored if with_logits else T)
    outputs = []
    for row, (w, seq) in enumerate(batch):
        lo, hi = w.score_from - w.start, w.end - w.start  # scored slice within the window
        logits = out.logits[row, lo - first_scored : hi - first_scored] if with_logits else None  # (n, V)
        outputs.append(WindowOutput(w, seq[w.score_from + 1 : w.end + 1], logits, out.knn_key[row, lo:hi]))
    return outputs


@torch.inference_mode()
def _score_batch(
    model: Decoder, batch: list[tuple[Window, torch.Tensor]], with_logprobs: bool,
    lm_features: LMFeatures | None = None,
) -> Iterator[ScoredTokens]:
    for o in forward_windows(model, batch, with_logprobs):
        features = None
        if with_logprobs:  # one window's (n, V) log-probabilities at a time
            scores = score_chunk(o.logits, o.targets, lm_features=lm_features).cpu()
            lm_logprob, greedy, features = scores.base, scores.greedy, scores.features  # (n,), (n,), (n, F)
        else:
            lm_logprob = torch.empty(0)
            greedy = torch.empty(0, dtype=torch.bool)
        positions = torch.arange(o.window.score_from, o.window.end)  # (n,)
        yield ScoredTokens(o.window.doc, positions, o.targets, lm_logprob, greedy, o.keys, features)


def exact_searcher_over_documents(
    model: Any, token_docs: Any, window: Any, boundary_token: int, *, model_fingerprint: str = "",
    tokenizer_fingerprint: str = "",
) -> TorchExactSearcher:
    """An in-memory datastore: the (key, next token) pairs of `token_docs` under `model`, taken from the
    same sliding windows as the datastore builder (score_documents), searched exactly.

    For tests and small corpora; keys stay on the model's device in float32, (N, C). Its info() records
    the window, boundary token and key layer, and the fingerprints given here (the Decoder knows none).
    """
    keys, values = [], []
    for scored in score_documents(model, token_docs, window, boundary_token, with_logprobs=False):
        keys.append(scored.keys.float())  # (n, C)
        values.append(scored.targets)  # (n,)
    info = SearcherInfo(
        n=0, dim=0, index=EXACT_INDEX, metric="l2", nprobe=1, key_layer=model.config.key_description,
        model_name="", model_fingerprint=model_fingerprint, tokenizer_fingerprint=tokenizer_fingerprint,
        corpus="in-memory documents", corpus_fingerprint="", context=window.context, stride=window.stride,
        boundary_token=boundary_token, sink_tokens=0,
    )  # n and dim: filled in by the searcher
    return TorchExactSearcher(torch.cat(keys), torch.cat(values).numpy(), info=info)  # (N, C), (N,)
