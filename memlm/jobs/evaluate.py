"""Perplexity jobs: sliding-window evaluation of a decoder over a corpus split.

Only per-token log-probabilities of the targets are kept (n floats), never a full-vocabulary
distribution beyond one batch of windows.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Sequence

from memlm.errors import MemlmError
from memlm.files import atomic_write
from memlm.jobs.windows import WindowConfig, score_documents
from memlm.model.decoder import Decoder
from memlm.model.device import synchronize


class Progress:
    """A tqdm bar over tokens on stderr (silent when disabled or tqdm is missing)."""

    def __init__(self, total: int, desc: str, enabled: bool = True) -> None:
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="tok", file=sys.stderr, dynamic_ncols=True, smoothing=0.1)

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def evaluate_perplexity(
    model: Decoder,
    token_docs: Sequence[list[int]],
    window: WindowConfig,
    boundary_token: int,
    progress: bool = True,
) -> dict[str, Any]:
    """Perplexity of `model` over `token_docs`, each token scored exactly once.

    Returns a dict with tokens, nll (sum, nats), perplexity, greedy accuracy, seconds and tokens/s.
    """
    total = sum(len(d) for d in token_docs)
    if total == 0:
        raise MemlmError("nothing to evaluate: the corpus split tokenized to 0 tokens")
    bar = Progress(total, "eval", progress)
    nll = 0.0  # float64 sum on the host: exact enough for millions of tokens
    correct = 0
    scored = 0
    synchronize(model.device)
    start = time.perf_counter()
    for chunk in score_documents(model, token_docs, window, boundary_token, with_logprobs=True):
        nll -= chunk.lm_logprob.double().sum().item()
        correct += int(chunk.greedy.sum())
        scored += len(chunk.targets)
        bar.update(len(chunk.targets))
    synchronize(model.device)
    seconds = time.perf_counter() - start
    bar.close()
    assert scored == total, f"scored {scored} tokens of {total}"  # the window plan covers every token once
    return {
        "tokens": scored,
        "documents": sum(1 for d in token_docs if d),
        "nll": nll,
        "perplexity": math.exp(nll / scored),
        "greedy_accuracy": correct / scored,
        "seconds": seconds,
        "tokens_per_s": scored / seconds if seconds > 0 else float("inf"),
        "context": window.context,
        "stride": window.stride,
        "batch_size": window.batch_size,
    }


def write_json(result: dict[str, Any], path: str | os.PathLike) -> None:
    """Write a result atomically (a crash never leaves half a file)."""
    atomic_write(path, json.dumps(result, indent=2, sort_keys=True) + "\n")
