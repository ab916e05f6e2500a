"""A naive reference decoder: the oracle that the decoding engine's generation is tested against.

It shares no code with memlm.engine beyond memlm.jobs.decoding's public pieces (events, stops, text deltas,
top-k/top-p filtering), and is as plain as it can be:
- without a memory, every token comes from a full forward pass over the whole context, without a KV cache;
  when the context would exceed the model's max_seq_len, it keeps the last half (the engine's sliding window);
- with a segment memory (XL, compressive, memorizing, SPALM) the model's own memory state
  (memlm.jobs.memorizing.open_memory) reads the prompt in segments, then each generated token alone;
- a token is the argmax (temperature 0) or one draw from a torch.Generator on the model's device seeded with
  the request's seed, after the kNN-LM mixture of the full distribution and top-k/top-p filtering.

Shape legend: T tokens, V vocab, C key width.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from memlm.jobs.decoding import (
    FINISH_EOS,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationEnd,
    SamplingConfig,
    TokenEvent,
    as_stop,
    filter_logits,
    flush_text,
    fresh_seed,
    match_stop,
    text_delta,
)
from memlm.jobs.memorizing import close_memory, open_memory
from memlm.model.memory_config import MemoryConfig
from memlm.retrieval.knnlm import KNNLMConfig, knn_mixture
from memlm.retrieval.searcher import Searcher, search_keys

SegmentStep = Callable[..., tuple[torch.Tensor, object]]
"""(model, idx (1, T), memory state) -> (next-token logits (V,), new state): memlm.jobs.spalm_scoring.spalm_step."""


def reference_generate(
    model, tokenizer, prompt_ids: Sequence[int], *, max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(),
    stop_sequences: Sequence[str | Sequence[int]] = (), boundary_token: int | None = None, eos_id: int | None = None,
    searcher: Searcher | None = None, knn: KNNLMConfig | None = None, memory: MemoryConfig | None = None,
    knn_attention=None, service=None, segment_step: SegmentStep | None = None,
) -> Iterator[TokenEvent | GenerationEnd]:
    """TokenEvents then one GenerationEnd, as memlm.engine.generate.generate yields them for the same arguments
    (SPALM: `segment_step`, memlm.jobs.spalm_scoring.spalm_step, instead of the engine's head and settings)."""
    if memory is not None and memory.kind == "none":
        memory = None
    tokens = ([boundary_token] if boundary_token is not None else []) + [int(i) for i in prompt_ids]
    stops = [as_stop(s) for s in stop_sequences]
    decodable = min(model.config.vocab_size, tokenizer.vocab_size)
    generator = torch.Generator(device=model.device)
    generator.manual_seed(sampling.seed if sampling.seed is not None else fresh_seed())
    state = None
    if memory is not None:
        state = open_memory(model, memory, 1, knn_attention=knn_attention, service=service)
    try:
        yield from _decode(model, tokenizer, tokens, len(prompt_ids), max_new_tokens, sampling, stops, eos_id,
                           searcher, knn, memory, state, segment_step, decodable, generator)
    finally:
        if state is not None:
            close_memory(state)


def _decode(model, tokenizer, tokens, prompt_tokens, max_new_tokens, sampling, stops, eos_id, searcher, knn, memory,
            state, segment_step, decodable, generator):
    max_len = model.config.max_seq_len
    base = max(0, len(tokens) - max_len)  # the context is tokens[base:]
    generated: list[int] = []
    emitted, checked = "", 0

    def full_forward():  # no memory: the whole context, no cache
        idx = torch.tensor([tokens[base:]], dtype=torch.long, device=model.device)  # (1, T)
        out = model(idx)
        return out.logits[0, -1], out.knn_key[0, -1]  # (V,), (C,)

    def memory_forward(new: list[int]):  # a memory: the new tokens, in segments of memory.segment
        nonlocal state
        for lo in range(0, len(new), memory.segment):
            idx = torch.tensor([new[lo : lo + memory.segment]], dtype=torch.long, device=model.device)  # (1, T)
            if segment_step is not None and lo + memory.segment >= len(new):  # only the last one's logits are read
                logits, state = segment_step(model, idx, state)  # (V,)
                key = None
            else:
                out = model(idx, state=state)
                logits, key, state = out.logits[0, -1], out.knn_key[0, -1], out.state  # (V,), (C,)
        return logits, key

    with torch.inference_mode():
        logits, key = full_forward() if memory is None else memory_forward(tokens)
    while True:
        with torch.inference_mode():
            token, logprob, base_logprob = _choose(logits, key, decodable, sampling, generator, searcher, knn)
        if eos_id is not None and token == eos_id:
            yield GenerationEnd(FINISH_EOS, flush_text(tokenizer, generated, emitted), prompt_tokens, len(generated),
                                "")
            return
        generated.append(token)
        tokens.append(token)
        stable, delta = text_delta(tokenizer, generated, emitted)
        emitted += delta
        yield TokenEvent(token, tokenizer.decode([token]), delta, logprob, base_logprob)
        matched = match_stop(stops, generated, stable, checked, tokenizer)
        checked = len(stable)
        if matched is not None:
            yield GenerationEnd(FINISH_STOP, flush_text(tokenizer, generated, emitted), prompt_tokens, len(generated),
                                matched)
            return
        if len(generated) == max_new_tokens:
            yield GenerationEnd(FINISH_LENGTH, flush_text(tokenizer, generated, emitted), prompt_tokens,
                                len(generated), "")
            return
        if memory is None and len(tokens) - base > max_len:  # full: keep the last half of the context
            base = len(tokens) - max(1, max_len // 2)
        with torch.inference_mode():
            logits, key = full_forward() if memory is None else memory_forward([token])


def _choose(logits, key, decodable, sampling, generator, searcher, knn) -> tuple[int, float, float]:
    """(token, final log-prob, base log-prob) from the last position's logits (V,) and kNN key (C,)."""
    lm_lp = F.log_softmax(logits.float(), dim=-1)  # (V,)
    final_lp = lm_lp
    if knn is not None:
        nb = search_keys(searcher, key[None, :], knn.k, knn.search_options)  # (1, k)
        final_lp = knn_mixture(lm_lp[None, :], nb, knn.temperature, knn.lmbda)[0]  # (V,)
    choice = final_lp.clone()
    choice[decodable:] = float("-inf")  # ids the tokenizer cannot decode are never drawn
    if sampling.temperature == 0:
        token = int(choice.argmax())
    else:
        scaled = filter_logits(choice / sampling.temperature, sampling.top_k, sampling.top_p)  # (V,)
        token = int(torch.multinomial(scaled.softmax(-1), 1, generator=generator))
    return token, float(final_lp[token]), float(lm_lp[token])
