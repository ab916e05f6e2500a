"""Text generation: incremental decoding with a KV cache, sampling, optional kNN-LM, streamed text.

`generate` yields one `TokenEvent` per generated token, then one `GenerationEnd`. It is a plain
iterator so callers decide where each step runs (a server advances it one token at a time on its
model thread, and stops advancing it when the client goes away).

- The prompt is preceded by the boundary token (memlm.model.tokenizer.document_boundary), as in scoring
  and `memlm eval`.
- Decoding is incremental: the prompt is encoded once into a KVCache, then each new token is one
  forward step of length 1. When the cache reaches the model's context length, the last half of the
  context is re-encoded into a fresh cache (a sliding window), so generation never exceeds it.
  With a `memory` (memlm.model.memory_config.MemoryConfig, e.g. Transformer-XL with sink tokens) the state is that
  memory instead: the prompt is encoded in segments of `memory.segment` tokens, then each new token is one
  step that attends to the sinks and the last mem_len states, so generation runs past the model's
  context without ever re-encoding (what the Score rpc's MEMORY_MODE_XL does, token by token).
  A memory whose output head is not the decoder's (SPALM, issue 11: memory kind "spalm") passes a
  `segment_step` that makes the next-token logits instead (memlm.jobs.spalm_scoring.spalm_step).
- kNN-LM (Khandelwal et al. 2020) mixes the full next-token distribution:
  log p = logaddexp(log(1 - lambda) + log p_LM, log(lambda) + log p_kNN) over the vocabulary, with
  p_kNN from the k neighbours of the last position's key (`knn_mixture`).
- Sampling: temperature 0 is greedy (argmax); otherwise top-k, then top-p (nucleus) filtering, then a
  draw from a torch.Generator on the model's device seeded with `seed`, so a seed reproduces the tokens.
- Text deltas: the generated ids are decoded as a whole after every token and only the new, complete
  suffix is emitted; a trailing U+FFFD (a multi-byte UTF-8 character split across tokens) is held back
  until the bytes that complete it arrive, so concatenated deltas equal the decoded continuation.
- Ids the tokenizer cannot decode (a model vocabulary padded beyond the tokenizer's) are never drawn.

Shape legend: T prompt tokens, V vocab, C key width.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from memlm.errors import MemlmError
from memlm.jobs.memorizing import check_knn_attention, close_memory, open_memory
from memlm.jobs.windows import ShouldStop, check_stop
from memlm.model.memory_config import MemoryConfig
from memlm.model.decoder import Decoder, DecoderState, KVCache
from memlm.model.tokenizer import Tokenizer
from memlm.retrieval.knnlm import KNNLMConfig, knn_mixture
from memlm.retrieval.searcher import Searcher, search_keys

if TYPE_CHECKING:
    from memlm.memory.memorizing import KnnAttention
    from memlm.memory.knn_store import KeyValueMemoryFactory

REPLACEMENT = "\ufffd"
FINISH_LENGTH = "length"
FINISH_STOP = "stop"
FINISH_EOS = "eos"
SegmentStep = Callable[[Decoder, torch.Tensor, DecoderState], tuple[torch.Tensor, DecoderState]]
"""(model, idx (1, T), memory state) -> (the last position's next-token logits (V,), the new state): the
forward of a memory with its own output head (SPALM: memlm.jobs.spalm_scoring.spalm_step)."""


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
    """"length" (max_new_tokens reached), "stop" (a stop sequence) or "eos" (end-of-text token)."""
    text_delta: str
    """Text still held back (an incomplete UTF-8 tail), emitted now; usually ""."""
    prompt_tokens: int
    """Prompt tokens (the boundary token not counted)."""
    completion_tokens: int
    """Generated tokens (an end-of-text token is not emitted and not counted)."""
    stop_sequence: str
    """The stop sequence that matched (token-id stop sequences as their decoded text); "" otherwise."""
    searches: int = 0
    """kNN searches made for this generation, in queries (the decoding engine counts them; issue 15 part 4)."""
    verify_steps: int = 0
    """Speculative decoding: forward passes that verified a draft (0 without speculative decoding)."""
    verified_tokens: int = 0
    """Completion tokens those passes yielded (accepted draft tokens + the model's own; an end-of-text token
    is not counted, as completion_tokens does not count it). The others came from plain steps: the first
    token, and the first after each slide of the row's cache."""
    searches_saved: int = 0
    """kNN-LM tokens chosen without a search (RetoMaton pointers, or the adaptive gate's base-LM tokens; the
    decoding engine counts them, memlm.engine.fewer_rows): searches + searches_saved = the kNN-LM tokens."""

    @property
    def mean_accepted_tokens(self) -> float | None:
        """Speculative decoding: completion tokens per verifying pass; None without a verifying pass."""
        return self.verified_tokens / self.verify_steps if self.verify_steps else None


class _Opened(NamedTuple):
    """What a segment memory for generation is opened from (memlm.jobs.memorizing.open_memory)."""

    memory: MemoryConfig
    knn_attention: KnnAttention | None
    service: KeyValueMemoryFactory | None
    held: list[DecoderState | None]
    """The state opened from these (its kNN store is released when generation ends)."""
    step: SegmentStep | None = None
    """The forward that makes the logits of the last prompt segment and of every decode step; None: the decoder's."""


def as_stop(s: str | Sequence[int]) -> str | tuple[int, ...]:
    if isinstance(s, str):
        if not s:
            raise MemlmError("stop sequences must be non-empty")
        return s
    ids = tuple(int(i) for i in s)
    if not ids:
        raise MemlmError("stop sequences must be non-empty")
    return ids


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


def generate(
    model: Decoder,
    tokenizer: Tokenizer,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    stop_sequences: Sequence[str | Sequence[int]] = (),
    boundary_token: int | None = None,
    eos_id: int | None = None,
    searcher: Searcher | None = None,
    knn: KNNLMConfig | None = None,
    memory: MemoryConfig | None = None,
    should_stop: ShouldStop | None = None,
    knn_attention: KnnAttention | None = None,
    service: KeyValueMemoryFactory | None = None,
    segment_step: SegmentStep | None = None,
) -> Iterator[TokenEvent | GenerationEnd]:
    """Continue `prompt_ids`, yielding TokenEvents then exactly one GenerationEnd.

    tokenizer: decodes the text deltas and matches the stop strings (its vocab_size bounds what is drawn).
    prompt_ids: prompt token ids in [0, V); may be empty when boundary_token is given.
    stop_sequences: strings (matched on the generated text, included in it) or token-id sequences
        (matched on the generated ids).
    boundary_token: prepended to the prompt (memlm.model.tokenizer.document_boundary); None = the prompt as is.
    eos_id: generation ends (reason "eos") when this token is drawn; None = never.
    searcher, knn: kNN-LM over the whole vocabulary (both or neither).
    memory: a segment memory as the decoder state instead of a KV cache (None or kind "none" = the KV
        cache), the prompt encoded in segments of memory.segment tokens (1 <= segment <= max_seq_len).
    should_stop: polled before every forward pass (each prompt segment, each decode step); when it says
        True, the iterator raises WorkStopped (a server whose client gave up frees its model thread
        within one step, issue 9). None = never.
    knn_attention, service: memory.kind "memorizing" (Wu et al. 2022): the layer's parameters (required)
        and the retrieval-service memory factory (knn_backend "service"). Every decode step appends its
        token's keys and values to the kNN memory, so later steps retrieve them (the memory of the whole
        prompt and continuation, FIFO at knn_mem_size).
    segment_step: memory.kind "spalm" (required there, refused elsewhere): the SPALM head's forward
        (memlm.jobs.spalm_scoring.spalm_step), run on the last prompt segment and on every decode step.
    """
    if max_new_tokens < 1:
        raise MemlmError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if (searcher is None) != (knn is None):
        raise MemlmError("kNN-LM generation needs both a searcher and a KNNLMConfig")
    if knn is not None and knn.needs_tuning:
        raise MemlmError("kNN-LM generation needs a fixed lambda and temperature")
    if memory is not None and memory.kind == "none":
        memory = None
    if memory is not None and memory.segment > model.config.max_seq_len:
        raise MemlmError(f"segment must be in [1, {model.config.max_seq_len}] with a memory, got {memory.segment}")
    stops = [as_stop(s) for s in stop_sequences]
    prefix = ([boundary_token] if boundary_token is not None else []) + [int(i) for i in prompt_ids]
    if not prefix:
        raise MemlmError("empty prompt and no boundary token: nothing to condition on")
    V = model.config.vocab_size
    if any(not 0 <= i < V for i in prefix):
        raise MemlmError(f"prompt has token ids outside [0, {V})")
    if memory is not None:
        check_knn_attention(memory, knn_attention)
    if (memory is not None and memory.kind == "spalm") != (segment_step is not None):
        raise MemlmError("memory spalm generates with its segment_step (memlm.jobs.spalm_scoring.spalm_step), "
                         "and only it takes one")
    if segment_step is not None and searcher is not None:
        raise MemlmError("kNN-LM interpolation does not combine with memory spalm (it mixes by its gate)")
    opened = None if memory is None else _Opened(memory, knn_attention, service, [], segment_step)
    events = _generate(model, tokenizer, prefix, len(prompt_ids), max_new_tokens, sampling, stops, eos_id, searcher,
                       knn, opened, should_stop)
    return events if opened is None else _released(events, opened)


def _released(events: Iterator[TokenEvent | GenerationEnd], opened: _Opened) -> Iterator[TokenEvent | GenerationEnd]:
    """`events`, then (at the end, on an error, or when the caller closes the iterator) the memory's kNN
    store released (a retrieval-service session is dropped at once, not at its idle timeout)."""
    try:
        yield from events
    finally:
        for state in opened.held:
            close_memory(state)


def _generate(
    model: Decoder, tokenizer: Tokenizer, prefix: list[int], prompt_tokens: int, max_new_tokens: int,
    sampling: SamplingConfig, stops: list[str | tuple[int, ...]], eos_id: int | None, searcher: Searcher | None,
    knn: KNNLMConfig | None, opened: _Opened | None, should_stop: ShouldStop | None,
) -> Iterator[TokenEvent | GenerationEnd]:
    device = model.device
    max_len = model.config.max_seq_len
    decodable = min(model.config.vocab_size, tokenizer.vocab_size)
    seed = sampling.seed if sampling.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)

    tokens = list(prefix)  # everything the model has seen or will see
    generated: list[int] = []
    emitted = ""  # text already given out in deltas
    checked = 0  # length of the text already searched for stop strings

    def encode_window() -> tuple[torch.Tensor, torch.Tensor, KVCache]:
        # A fresh cache over the last tokens: all of them at the start (up to the context length),
        # the last half of the context when the cache is full (sliding window).
        keep = tokens[-max_len:] if not generated else tokens[-max(1, max_len // 2):]
        idx = torch.tensor([keep], dtype=torch.long, device=device)  # (1, T)
        out = model(idx, state=KVCache.empty(model.config), logits_from=idx.shape[1] - 1)
        return out.logits[0, -1], out.knn_key[0, -1], out.state  # (V,), (C,)

    def encode_segments():
        # The whole prompt, segment by segment, into the memory (never re-encoded afterwards).
        state = open_memory(model, opened.memory, 1, knn_attention=opened.knn_attention, service=opened.service)
        opened.held.append(state)
        segment = opened.memory.segment
        for lo in range(0, len(tokens), segment):
            check_stop(should_stop)
            idx = torch.tensor([tokens[lo : lo + segment]], dtype=torch.long, device=device)  # (1, T)
            if opened.step is not None and lo + segment >= len(tokens):  # the last segment's logits are read
                logits, state = opened.step(model, idx, state)  # (V,)
                return logits, None, state
            out = model(idx, state=state, logits_from=idx.shape[1] - 1)
            state = out.state
        return out.logits[0, -1], out.knn_key[0, -1], state  # (V,), (C,)

    with torch.inference_mode():
        logits, key, cache = encode_window() if opened is None else encode_segments()
    for _ in range(max_new_tokens):
        with torch.inference_mode():
            token, logprob, base_logprob = _next_token(logits, key, decodable, sampling, generator, searcher, knn)
        if eos_id is not None and token == eos_id:
            yield GenerationEnd(FINISH_EOS, flush_text(tokenizer, generated, emitted), prompt_tokens, len(generated), "")
            return
        generated.append(token)
        tokens.append(token)
        text = tokenizer.decode(generated)
        stable = text.rstrip(REPLACEMENT)
        delta = stable[len(emitted):] if stable.startswith(emitted) else ""
        emitted += delta
        yield TokenEvent(token, tokenizer.decode([token]), delta, logprob, base_logprob)

        matched = match_stop(stops, generated, stable, checked, tokenizer)
        checked = len(stable)
        if matched is not None:
            tail = flush_text(tokenizer, generated, emitted)
            yield GenerationEnd(FINISH_STOP, tail, prompt_tokens, len(generated), matched)
            return
        if len(generated) == max_new_tokens:
            break
        check_stop(should_stop)
        with torch.inference_mode():
            if opened is None and cache.length + 1 > max_len:
                logits, key, cache = encode_window()
            elif opened is not None and opened.step is not None:
                step = torch.tensor([[token]], dtype=torch.long, device=device)  # (1, 1)
                logits, cache = opened.step(model, step, cache)  # (V,)
            else:
                step = torch.tensor([[token]], dtype=torch.long, device=device)  # (1, 1)
                out = model(step, state=cache)
                logits, key, cache = out.logits[0, -1], out.knn_key[0, -1], out.state
    yield GenerationEnd(FINISH_LENGTH, flush_text(tokenizer, generated, emitted), prompt_tokens, len(generated), "")


def _next_token(
    logits: torch.Tensor, key: torch.Tensor, decodable: int, sampling: SamplingConfig, generator: torch.Generator,
    searcher: Searcher | None, knn: KNNLMConfig | None,
) -> tuple[int, float, float]:
    """Draw the next token from the last position's logits (V,) and kNN key (C,): (token, final log-prob,
    base log-prob). Ids from `decodable` on (beyond the tokenizer's vocabulary) are never drawn."""
    V = logits.shape[-1]
    lm_lp = F.log_softmax(logits.float(), dim=-1)  # (V,)
    final_lp = lm_lp
    if searcher is not None:
        nb = search_keys(searcher, key[None, :], knn.k, knn.search_options)  # (1, k)
        final_lp = knn_mixture(lm_lp[None, :], nb, knn.temperature, knn.lmbda)[0]  # (V,)
    choice = final_lp
    if decodable < V:
        choice = final_lp.clone()
        choice[decodable:] = float("-inf")
    if sampling.temperature == 0:
        token = int(choice.argmax())
    else:
        scaled = filter_logits(choice / sampling.temperature, sampling.top_k, sampling.top_p)
        token = int(torch.multinomial(scaled.softmax(-1), 1, generator=generator))
    return token, float(final_lp[token]), float(lm_lp[token])


def flush_text(tokenizer: Tokenizer, generated: list[int], emitted: str) -> str:
    """At the end, whatever was held back (an incomplete UTF-8 tail) is emitted as decoded."""
    text = tokenizer.decode(generated) if generated else ""
    return text[len(emitted):] if text.startswith(emitted) else ""


def match_stop(
    stops: list[str | tuple[int, ...]], generated: list[int], stable: str, checked: int, tokenizer: Tokenizer
) -> str | None:
    for s in stops:
        if isinstance(s, str):
            # Only text not searched before (plus an overlap of len(s) - 1) can hold a new match.
            if stable.find(s, max(0, checked - len(s) + 1)) >= 0:
                return s
        elif len(generated) >= len(s) and tuple(generated[-len(s):]) == s:
            return tokenizer.decode(list(s))
    return None
