"""The LanguageModelService's typed call arguments (services.lm.requests parses requests into them), and the
fewer-searches part of KnnOptions: adaptive retrieval's threshold or fraction over the gate the
server loaded (`memlm serve lm --adaptive-gate DIR`, memlm.retrieval.adaptive) and RetoMaton pointers over
the datastore's successors (memlm.retrieval.pointers; through the retrieval service's Successors rpc when the
datastore is remote, for Score only: generate_retrieval_of), as `memlm eval --adaptive-* / --pointers --min-pointers` takes them; and Generate's
speculative decoding (`memlm generate --speculative [--draft-tokens N]`), whose drafts read the same successors.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import grpc

from memlm.engine.drafts import DraftSource, SpeculativeConfig, draft_source_of
from memlm.engine.speculative import refusal
from memlm.errors import MemlmError
from memlm.jobs.decoding import SamplingConfig
from memlm.jobs.knnlm_eval import Retrieval
from memlm.model.memory_config import MemoryConfig
from memlm.retrieval.adaptive import (
    AdaptiveConfig,
    GateSettings,
    RetrievalGate,
    threshold_for_fraction,
)
from memlm.retrieval.knnlm import KNNLMConfig
from memlm.retrieval.pointers import PointerConfig, PointerSource
from memlm.v1 import language_model_pb2 as lm_pb2
from services.lm.client import DRAFT_FROM_VALUES
from services.lm.spalm import SpalmSearch
from services.common.server import InvalidRequest

FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED


@dataclass(frozen=True)
class FewerSources:
    """What a server holds for fewer searches (services.lm.servicer builds it at load)."""

    gate: tuple[RetrievalGate, GateSettings] | None = None
    """The gate of --adaptive-gate, checked against the model and the datastore; None: adaptive_* refused."""
    pointers: Callable[[], PointerSource] | None = None
    """The datastore's successors (made at the first call); None: pointers refused (no kNN source)."""
    drafts: Callable[[], DraftSource] | None = None
    """Speculative decoding's draft source over the same successors (made at the first speculative call);
    None: speculative refused (no datastore in process)."""
    remote: bool = False
    """The pointers are a retrieval service's Successors rpc (services.retrieval.walk.OneGeneration): served to
    Score only (`generate_retrieval_of` says why)."""


NO_FEWER = FewerSources()
"""A server without a gate or successors (the default: fewer-search requests are refused)."""


def fewer_asked(o: lm_pb2.KnnOptions) -> bool:
    """The request asks for fewer searches (any of the four fields set)."""
    return o.HasField("adaptive_threshold") or o.HasField("adaptive_fraction") or o.pointers or o.HasField("min_pointers")


def refuse_fewer(o: lm_pb2.KnnOptions, why: str) -> None:
    """UNIMPLEMENTED naming the field when a request asks for fewer searches where they are not served."""
    for name in ("adaptive_threshold", "adaptive_fraction", "min_pointers"):
        if o.HasField(name):
            raise InvalidRequest(f"knn.{name}", why, UNIMPLEMENTED)
    if o.pointers:
        raise InvalidRequest("knn.pointers", why, UNIMPLEMENTED)


def speculative_of(request: lm_pb2.GenerateRequest, memory: MemoryConfig | None, attribution: int,
                   sources: FewerSources, max_step_tokens: int, in_row_cache: bool) -> SpeculativeConfig | None:
    """The SpeculativeConfig a GenerateRequest asks for (None without speculative), each refusal naming its
    field; draft_tokens 0 and draft_from DRAFT_FROM_UNSPECIFIED = SpeculativeConfig's defaults (the one place
    they live). in_row_cache: the call's rows are in the engine's row cache (services.lm.engine.in_row_cache),
    which alone verifies drafts."""
    if not request.speculative:
        if request.draft_tokens:
            raise InvalidRequest("draft_tokens", "needs speculative")
        if request.draft_from:
            raise InvalidRequest("draft_from", "needs speculative")
        return None
    config = SpeculativeConfig()
    if request.draft_from:
        names = {value: name for name, value in DRAFT_FROM_VALUES.items()}
        if request.draft_from not in names:
            raise InvalidRequest("draft_from", f"{request.draft_from} is not a DraftFrom value")
        config = replace(config, draft_from=names[request.draft_from])
    why = refusal(config.uses_datastore, sources.drafts is not None, memory.kind if memory is not None else None,
                  fewer_asked(request.knn))
    if why is not None:  # the engine's rules (memlm.engine.speculative.refusal), named by the field
        raise InvalidRequest("speculative", why.message, FAILED_PRECONDITION if why.precondition else UNIMPLEMENTED)
    if not in_row_cache:
        raise InvalidRequest("speculative", "drafts are verified on the decoding engine only (memlm's decoder)",
                             UNIMPLEMENTED)
    if attribution:
        raise InvalidRequest("speculative", "not with knn.attribution_top_n (a verifying pass makes several tokens)")
    if request.draft_tokens < 0:
        raise InvalidRequest("draft_tokens", f"{request.draft_tokens}, must be >= 1 (0 = the default)")
    config = replace(config, draft_tokens=request.draft_tokens) if request.draft_tokens else config
    if config.draft_tokens > max_step_tokens - 1:  # a verifying pass feeds 1 + draft_tokens tokens (the default too)
        raise InvalidRequest("draft_tokens", f"{config.draft_tokens}, at most max_step_tokens - 1 = "
                             f"{max_step_tokens - 1}", grpc.StatusCode.OUT_OF_RANGE)
    if config.uses_datastore:
        try:
            sources.drafts()  # made once (cached), here: a datastore without provenance is refused before streaming
        except MemlmError as e:
            raise InvalidRequest("speculative", str(e), FAILED_PRECONDITION) from None
    return config


def retrieval_of(o: lm_pb2.KnnOptions, knn: KNNLMConfig | None, memory: MemoryConfig | None, attribution: int,
                 sources: FewerSources) -> Retrieval | None:
    """The Retrieval a Score or Generate request's KnnOptions ask for (None: a search for every token), each
    refusal naming its field."""
    if not fewer_asked(o):
        return None
    field = "knn.pointers" if o.pointers or o.HasField("min_pointers") else "knn.adaptive_threshold"
    if knn is None:
        raise InvalidRequest(field, "needs knn.enabled (fewer kNN-LM searches)")
    if memory is not None:
        refuse_fewer(o, "fewer searches are served with MEMORY_MODE_NONE only (sliding windows)")
    if attribution:
        raise InvalidRequest(field, "not with knn.attribution_top_n (attribution needs every token's search)")
    if knn.interpolation is not None:
        raise InvalidRequest(field, "not with the server's saved interpolation (fitted on every token's search); "
                             "set lambda_weight and temperature")
    if o.HasField("min_pointers") and not o.pointers:
        raise InvalidRequest("knn.min_pointers", "needs knn.pointers")
    pointers = source = None
    if o.pointers:
        if sources.pointers is None:
            raise InvalidRequest("knn.pointers", "this server has no datastore successors to follow", FAILED_PRECONDITION)
        m = o.min_pointers if o.HasField("min_pointers") else PointerConfig().min_pointers
        if m < 1:
            raise InvalidRequest("knn.min_pointers", f"{m}, must be >= 1")
        pointers, source = PointerConfig(min_pointers=m), sources.pointers()
    return Retrieval(pointers, source, _adaptive(o, sources))


def generate_retrieval_of(o: lm_pb2.KnnOptions, knn: KNNLMConfig | None, memory: MemoryConfig | None,
                          attribution: int, sources: FewerSources) -> Retrieval | None:
    """retrieval_of for a Generate request, which refuses pointers through a retrieval service
    (FAILED_PRECONDITION naming knn.pointers). On the engine a lane's searches go through the lane's searcher
    and a row's Successors lookups through its own walk, so nothing holds them to one datastore generation
    (compaction renumbers rows, and the walk would follow other documents' rows silently), and the
    lookup inside a step is bounded by no caller's deadline. Score holds both (call_walk)."""
    retrieval = retrieval_of(o, knn, memory, attribution, sources)
    if o.pointers and sources.remote:
        raise InvalidRequest("knn.pointers", "Generate follows pointers over a datastore in process only (this server's "
                             "is behind a retrieval service: Score follows them there)", FAILED_PRECONDITION)
    return retrieval


def _adaptive(o: lm_pb2.KnnOptions, sources: FewerSources) -> AdaptiveConfig | None:
    if not (o.HasField("adaptive_threshold") or o.HasField("adaptive_fraction")):
        return None
    if o.HasField("adaptive_threshold") and o.HasField("adaptive_fraction"):
        raise InvalidRequest("knn.adaptive_fraction", "give adaptive_threshold or adaptive_fraction, not both")
    field = "knn.adaptive_threshold" if o.HasField("adaptive_threshold") else "knn.adaptive_fraction"
    if sources.gate is None:
        raise InvalidRequest(field, "this server has no retrieval gate (memlm serve lm --adaptive-gate DIR)",
                             FAILED_PRECONDITION)
    gate, settings = sources.gate
    if o.HasField("adaptive_threshold"):
        if not 0.0 <= o.adaptive_threshold <= 1.0:
            raise InvalidRequest(field, f"{o.adaptive_threshold}, must be in [0, 1]")
        return AdaptiveConfig(gate, settings, float(o.adaptive_threshold))
    if not 0.0 <= o.adaptive_fraction < 1.0:
        raise InvalidRequest(field, f"{o.adaptive_fraction}, must be in [0, 1)")
    return AdaptiveConfig(gate, settings, threshold_for_fraction(settings, float(o.adaptive_fraction)))


@dataclass(frozen=True)
class ScoreArgs:
    """A validated ScoreRequest, as memlm.jobs.scoring takes it."""

    token_seqs: list[list[int]]
    """The continuations to score, token ids."""
    contexts: list[list[int]]
    """Their contexts (conditioned on, not scored), token ids; [] for none."""
    context: int
    """Sliding-window length in tokens (MEMORY_MODE_NONE)."""
    stride: int
    """Sliding-window stride in tokens (MEMORY_MODE_NONE)."""
    knn: KNNLMConfig | None
    """kNN-LM settings, or None for the base LM."""
    top_n: int
    """Alternatives returned per token."""
    memory: MemoryConfig | None
    """MEMORY_MODE_XL / COMPRESSIVE / MEMORIZING / SPALM memory (its segment included), or None for sliding windows."""
    spalm: SpalmSearch | None
    """MEMORY_MODE_SPALM's search, None in the other modes."""
    batch_size: int
    """Windows (sliding windows) or sequences side by side (XL) per forward step: LMLimits.step_rows."""
    attribution: int = 0
    """Top documents per scored token (KnnOptions.attribution_top_n), 0: none."""
    retrieval: Retrieval | None = None
    """Fewer searches (KnnOptions adaptive_* / pointers): the gate and/or RetoMaton pointers;
    None: a search for every token."""


@dataclass(frozen=True)
class GenerateArgs:
    """A validated GenerateRequest, as the decoding engine takes it (services.lm.engine.engine_request)."""

    prompt: list[int]
    """Prompt token ids."""
    max_new_tokens: int
    """1 <= tokens to generate <= LMLimits.max_new_tokens."""
    sampling: SamplingConfig
    """Temperature, top-k, top-p, seed."""
    stop_sequences: list[str]
    """Non-empty strings that end the generation."""
    knn: KNNLMConfig | None
    """kNN-LM settings, or None for the base LM."""
    memory: MemoryConfig | None
    """MEMORY_MODE_XL / COMPRESSIVE / MEMORIZING / SPALM memory (its segment included), or None for a KV cache."""
    spalm: SpalmSearch | None
    """MEMORY_MODE_SPALM's search, None in the other modes."""
    attribution: int = 0
    """Top documents per generated token (KnnOptions.attribution_top_n), 0: none."""
    speculative: SpeculativeConfig | None = None
    """Speculative decoding from the datastore (GenerateRequest.speculative / draft_tokens); None: off."""
    retrieval: Retrieval | None = None
    """Fewer searches (KnnOptions adaptive_* / pointers; on the engine, memlm.engine.fewer_rows;
    pointers over a datastore in process only: generate_retrieval_of); None: a search for every token."""


def server_sources(searcher, *, remote: bool, gate_dir: str | None, model_fingerprint: str,
                   key_layer: str) -> FewerSources:
    """`memlm serve lm`'s FewerSources: the gate of --adaptive-gate (refused in one line when fitted for
    another model, key layer or datastore) and the pointers of its searcher: a local datastore.Datastore's
    successors, values and keys (exact pointer distances; made at the first request that asks), or a
    RetrievalClient's Successors rpc (remote: no keys, pointers carry their predecessor's distance; one
    services.retrieval.walk.OneGeneration a request, which call_walk binds to the call's searches; Score only,
    generate_retrieval_of refuses them in Generate). Speculative
    drafts read the same successors table of a local datastore (none through a retrieval service: a
    DraftSource holds whole arrays, not a lookup)."""
    from functools import cache
    from pathlib import Path

    from memlm.retrieval.adaptive import load_gate
    from memlm.retrieval.pointers import successors

    gate = None
    if gate_dir is not None:
        gate = load_gate(Path(gate_dir))
        settings = gate[1]
        if settings.model_fingerprint != model_fingerprint or settings.key_layer != key_layer:
            raise MemlmError(f"--adaptive-gate {gate_dir} was fitted for another model or key layer ({settings.key_layer})")
        if searcher is None or settings.datastore_corpus_fingerprint != searcher.info().corpus_fingerprint:
            raise MemlmError(f"--adaptive-gate {gate_dir} was fitted with another datastore (or none is served)")
    if searcher is None:
        return FewerSources(gate, None)

    building = threading.RLock()  # calls parse on several threads: the first builds a table, the others wait

    def once(make: Callable[[], Any]) -> Callable[[], Any]:
        made = cache(make)

        def get() -> Any:
            with building:
                return made()
        return get

    # (N,) the one successors table of pointers and drafts, and what each makes of it: built at first use.
    next_ids = once(lambda: successors(searcher.provenance, len(searcher)).next_ids)
    local = once(lambda: PointerSource.local(next_ids(), searcher.values, searcher.keys))
    drafts = once(lambda: draft_source_of(next_ids(), searcher.values))

    def pointers() -> PointerSource:
        if remote:  # one walk's own (services.retrieval.walk): its ids are rows of one generation
            from services.retrieval.walk import OneGeneration

            return PointerSource(OneGeneration(searcher, searcher), None)
        return local()

    return FewerSources(gate, pointers, None if remote else drafts, remote)


def call_walk(searcher, retrieval: Retrieval | None):
    """The searcher and Retrieval of one Score call (searcher: its services.lm.results.call_searcher): a
    remote pointer walk searches through the call's searcher and looks successors up, both held to one
    datastore generation (services.retrieval.walk.OneGeneration); anything else as given."""
    from dataclasses import replace

    from services.retrieval.walk import OneGeneration

    if retrieval is None or retrieval.source is None or not isinstance(retrieval.source.successors, OneGeneration):
        return searcher, retrieval
    walk = retrieval.source.successors.through(searcher)
    return walk, replace(retrieval, source=PointerSource(walk, None))
