"""The pieces of decoding that every generation path shares: settings, events, stops, text deltas, filtering.

Like transformers' LogitsProcessor and StoppingCriteria, these are small public functions, so the decoding
engine (memlm.engine) and any test oracle apply the same rules:
- `SamplingConfig`: temperature 0 is greedy (argmax); otherwise the logits are scaled by the temperature
  (`scale_logits`: max-shifted, so any temperature > 0 is safe), then top-k, then top-p (nucleus) filtering
  (`filter_logits`), then a draw from a torch.Generator seeded with `seed`, so a seed reproduces the tokens.
- Events: one `TokenEvent` per generated token, then one `GenerationEnd` with a FINISH_* reason.
- Stops: strings (matched on the generated text, included in it) or token-id sequences (`as_stop`,
  `match_stop`); a matched stop ends generation with FINISH_STOP.
- Text deltas (`text_delta`, `flush_text`): the generated ids are decoded as a whole after every token and
  only the new, complete suffix is emitted; a trailing U+FFFD (a multi-byte UTF-8 character split across
  tokens) is held back until the bytes that complete it arrive, so concatenated deltas equal the decoded
  continuation.

Shape legend: V vocab.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from memlm.errors import MemlmError
from memlm.model.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"
"""What a tokenizer decodes an incomplete UTF-8 byte sequence to; held back at the end of a delta."""
FINISH_LENGTH = "length"
"""GenerationEnd.reason: max_new_tokens reached."""
FINISH_STOP = "stop"
"""GenerationEnd.reason: a stop sequence matched."""
FINISH_EOS = "eos"
"""GenerationEnd.reason: the end-of-text token was drawn."""

Stop = str | tuple[int, ...]
"""A checked stop sequence: a non-empty string or a non-empty tuple of token ids."""


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen from the final distribution."""

    temperature: float = 1.0
    """Softmax temperature (>= 0); 0 = greedy decoding."""
    top_k: int | None = None
    """Sample among the top_k most likely tokens only (>= 1); None = no limit."""
    top_p: float | None = None
    """Nucleus: the smallest set of tokens with total probability >= top_p, in (0, 1]; None = 1."""
    seed: int | None = None
    """Seed of the sampler; None = a fresh random seed."""

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and np.isfinite(self.temperature)):
            raise MemlmError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise MemlmError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise MemlmError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class TokenEvent:
    """One generated token."""

    token_id: int
    """The token id."""
    text: str
    """The token's own text (bytes that do not decode alone are replaced by U+FFFD)."""
    text_delta: str
    """New complete text since the previous event ("" while a split UTF-8 character is pending)."""
    logprob: float
    """Final log-probability of the token when it was chosen (kNN-LM mixture if on), nats."""
    base_logprob: float
    """Log-probability under the base LM alone, nats."""


@dataclass(frozen=True)
class GenerationEnd:
    """The last event: why generation stopped, the text not yet emitted, and token counts."""

    reason: str
    """A FINISH_* reason ("length", "stop", "eos"; the engine adds "cancelled" and "deadline")."""
    text_delta: str
    """Text still held back (an incomplete UTF-8 tail), emitted now; usually ""."""
    prompt_tokens: int
    """Prompt tokens (the boundary token not counted)."""
    completion_tokens: int
    """Generated tokens (an end-of-text token is not emitted and not counted)."""
    stop_sequence: str
    """The stop sequence that matched (token-id stop sequences as their decoded text); "" otherwise."""
    searches: int = 0
    """kNN searches made for this generation, in queries."""
    verify_steps: int = 0
    """Speculative decoding: forward passes that verified a draft (0 without speculative decoding)."""
    verified_tokens: int = 0
    """Completion tokens those passes yielded (accepted draft tokens + the model's own; an end-of-text token
    is not counted, as completion_tokens does not count it). The others came from plain steps: the first
    token, and the first after each slide of the row's cache."""
    searches_saved: int = 0
    """kNN-LM tokens chosen without a search (RetoMaton pointers, or the adaptive gate's base-LM tokens,
    memlm.engine.fewer_rows): searches + searches_saved = the kNN-LM tokens."""

    @property
    def mean_accepted_tokens(self) -> float | None:
        """Speculative decoding: completion tokens per verifying pass; None without a verifying pass."""
        return self.verified_tokens / self.verify_steps if self.verify_steps else None


def fresh_seed() -> int:
    """A random sampler seed for a request that gave none (63 bits, so torch.Generator takes it)."""
    return int.from_bytes(os.urandom(8), "little") >> 1


def as_stop(s: str | Sequence[int]) -> Stop:
    """A stop sequence as matched: the string, or the token ids as a tuple; empty ones are refused."""
    if isinstance(s, str):
        if not s:
            raise MemlmError("stop sequences must be non-empty")
        return s
    ids = tuple(int(i) for i in s)
    if not ids:
        raise MemlmError("stop sequences must be non-empty")
    return ids


def scale_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """(..., V) logits (or log-probs) divided by a temperature > 0, shifted so that each row's largest is 0 and
    divided in float64, back in the input's dtype: the most likely token keeps 0 and the others a finite
    value or -inf at any temperature, so the softmax is never NaN (an unshifted float32 division by a
    temperature like 1e-38 makes every logit -inf)."""
    shifted = logits - logits.amax(dim=-1, keepdim=True)  # (..., V), max 0
    return (shifted.double() / temperature).to(logits.dtype)  # (..., V)


def filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Top-k then top-p filtering of (V,) logits: removed tokens get -inf. The most likely token stays."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)  # (V,), (V,)
        probs = sorted_logits.softmax(-1)  # (V,)
        before = probs.cumsum(-1) - probs  # probability mass strictly above each token
        remove_sorted = before >= top_p
        remove_sorted[0] = False
        remove = torch.zeros_like(remove_sorted).scatter(0, order, remove_sorted)  # (V,)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


def text_delta(tokenizer: Tokenizer, generated: list[int], emitted: str) -> tuple[str, str]:
    """(stable, delta) after a token: the decoded continuation without a trailing incomplete character, and
    its part not yet emitted ("" while a split UTF-8 character is pending)."""
    stable = tokenizer.decode(generated).rstrip(REPLACEMENT)
    return stable, stable[len(emitted):] if stable.startswith(emitted) else ""


def flush_text(tokenizer: Tokenizer, generated: list[int], emitted: str) -> str:
    """At the end, whatever was held back (an incomplete UTF-8 tail) is emitted as decoded."""
    text = tokenizer.decode(generated) if generated else ""
    return text[len(emitted):] if text.startswith(emitted) else ""


def match_stop(stops: Sequence[Stop], generated: list[int], stable: str, checked: int,
               tokenizer: Tokenizer) -> str | None:
    """The first stop sequence that the continuation now ends in, as text; None when none matched.
    stable: the decoded continuation (text_delta); checked: its length when last searched."""
    for s in stops:
        if isinstance(s, str):
            # Only text not searched before (plus an overlap of len(s) - 1) can hold a new match.
            if stable.find(s, max(0, checked - len(s) + 1)) >= 0:
                return s
        elif len(generated) >= len(s) and tuple(generated[-len(s):]) == s:
            return tokenizer.decode(list(s))
    return None
