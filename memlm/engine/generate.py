"""`generate`: one continuation as an iterator of events, run through a decoding engine of one row.

The library's convenience over memlm.engine.engine.Engine (the one decode loop): it yields one
`TokenEvent` per generated token, then one `GenerationEnd` (memlm.jobs.decoding), and steps the engine in
the caller's thread only while the caller asks for the next event, so a caller decides where each step runs.
Callers with several requests submit them to an Engine themselves (memlm.engine.engine.run_all).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from memlm.engine.engine import Engine
from memlm.engine.requests import EngineConfig, GenerationRequest, RequestHandle, SpalmSettings
from memlm.errors import MemlmError
from memlm.jobs.decoding import GenerationEnd, SamplingConfig, TokenEvent
from memlm.jobs.windows import ShouldStop, check_stop
from memlm.model.decoder import Decoder
from memlm.model.memory_config import MemoryConfig
from memlm.model.pretrained import CausalLM
from memlm.model.tokenizer import Tokenizer
from memlm.retrieval.knnlm import KNNLMConfig
from memlm.retrieval.searcher import Searcher

if TYPE_CHECKING:
    from memlm.memory.knn_store import KeyValueMemoryFactory
    from memlm.memory.memorizing import KnnAttention
    from memlm.memory.spalm import SpalmHead


def generate(
    model: Decoder | CausalLM,
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
    spalm_head: SpalmHead | None = None,
    spalm: SpalmSettings | None = None,
) -> Iterator[TokenEvent | GenerationEnd]:
    """Continue `prompt_ids`, yielding TokenEvents then exactly one GenerationEnd. Arguments are checked here,
    before the first event is asked for; the prompt is read at the first next().

    tokenizer: decodes the text deltas and matches the stop strings (its vocab_size bounds what is drawn).
    prompt_ids: prompt token ids in [0, V); may be empty when boundary_token is given.
    stop_sequences: strings (matched on the generated text, included in it) or token-id sequences.
    boundary_token: prepended to the prompt (memlm.model.tokenizer.document_boundary); None = the prompt as is.
    eos_id: generation ends (reason "eos") when this token is drawn; None = never.
    searcher, knn: kNN-LM over the whole vocabulary (both or neither; memory spalm: the searcher alone).
    memory: a segment memory instead of a KV cache (None or kind "none" = the KV cache, which slides by
        re-encoding the last half of the context when full), the prompt read in segments of memory.segment tokens.
    should_stop: polled before every step of the engine; when it says True, the iterator raises WorkStopped.
    knn_attention, service: memory.kind "memorizing" (Wu et al. 2022): the layer's parameters (required) and the
        retrieval-service memory factory (knn_backend "service"); the row's kNN memory is released when the
        iterator ends, fails or is closed.
    spalm_head, spalm: memory.kind "spalm" (both required there, refused elsewhere): SPALM's head and its
        retrieval settings (memlm.engine.spalm_rows).
    """
    if (searcher is None) != (knn is None) and spalm_head is None:
        raise MemlmError("kNN-LM generation needs both a searcher and a KNNLMConfig")
    if memory is not None and memory.kind == "none":
        memory = None
    request = GenerationRequest(tuple(int(i) for i in prompt_ids), max_new_tokens, sampling,
                                tuple(s if isinstance(s, str) else tuple(s) for s in stop_sequences),
                                boundary_token, eos_id, knn=knn, spalm=spalm)
    # One row; a prompt (or the window of a plain cache) is read in one pass, a memory's in its segments.
    config = EngineConfig(max_batch=1, max_queue=0, prefill_chunk=model.config.max_seq_len, memory=memory)
    engine = Engine(model, tokenizer, config, searcher, spalm_head=spalm_head, knn_attention=knn_attention,
                    knn_service=service)
    handle = engine.submit(request)
    return _events(engine, handle, should_stop)


def _events(engine: Engine, handle: RequestHandle, should_stop: ShouldStop | None,
            ) -> Iterator[TokenEvent | GenerationEnd]:
    """The request's events, one engine step whenever none is waiting; a request left unfinished (an error,
    WorkStopped, the caller closing the iterator) is cancelled, which frees its row and its memory."""
    ended = False
    try:
        while True:
            for event in handle.ready():
                yield event
                if isinstance(event, GenerationEnd):
                    ended = True
                    return
            check_stop(should_stop)
            if not engine.busy:
                raise RuntimeError("the engine is idle and the request has not ended")
            engine.step()
    finally:
        if not ended and engine.busy:
            handle.cancel()
            engine.step()
