"""LanguageModelService over gRPC: Score, Generate (streamed), Tokenize and GetInfo for one model.

The servicer is thin (no model logic): it validates a request into library arguments (services.lm.requests), runs
the library and encodes the result. Model work runs ONE forward step at a time (services.lm.scheduler): each
tenant (services.common.tenants, however many connections it opens) gets an equal share of model time, so a
small Score waits for the step in progress and its fair share, never for all of a long call. Score takes one of three paths, said by
services.lm.score_engine.score_path: ENGINE (MEMORY_MODE_NONE sliding windows, XL and COMPRESSIVE, with or
without kNN-LM and top_n: each input a score row of the decoding engine's running batch of its settings,
sharing steps with other Score calls and with Generate rows), BATCHED (attribution, a model the engine does
not hold: one library call for the concurrent calls of a key, services.lm.score_batch) or ALONE (SPALM,
MEMORIZING, pointer / adaptive `retrieval` walks: the library with the call's own turns). Every Generate (every
memory mode, kNN-LM or not, memlm's decoder or a transformers model, whose rows run their own forwards) is a
request in a running batch of the decoding engine (services.lm.engine), which takes the model's turn like one
more client; a cancelled call's row is free before the next step; admission of Generate and engine Score calls
is bounded (max_batch, max_queue, the tokens in flight that max_kv_bytes holds), beyond: RESOURCE_EXHAUSTED
with a retry hint (trailing metadata retry-after-ms).

Bounded work: every request's cost, and every step's, is checked before any work, and every call
hands its library work a `CallStop` (through its StepGate), polled between steps: when the client cancels,
the deadline passes or the server stops, the work raises WorkStopped within one step. A remote kNN search
gives the model's turn away while it waits and ends by the caller's deadline.

kNN-LM searches the server's Searcher: a datastore in process (`--datastore`) or a RetrievalClient
(`--retrieval`), with identical results. Health is NOT_SERVING until model and searcher are loaded.

Memory modes: NONE (sliding windows: score_tokens' scores, on engine rows that read one window after another;
the engine's sliding KV cache for Generate), XL (Transformer-XL memory with sinks: score_tokens_segments' scores
as `memlm eval --memory xl`, on the engine's XL rows for Score and Generate), COMPRESSIVE (Rae et al. 2019,
mean pooling: no trained compressor; the engine's compressive rows), MEMORIZING (Wu et al. 2022) with a
`memlm train --memory memorizing` checkpoint's KnnAttention, SPALM (Yogatama et al. 2021; services.lm.spalm)
with a SPALM checkpoint's head and a searcher. kNN-LM combines with all but SPALM. Others: UNIMPLEMENTED.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

import grpc

from memlm.engine.requests import SpalmSettings
from memlm.errors import MemlmError
from memlm.jobs.scoring import score_tokens, score_tokens_segments
from memlm.jobs.spalm_scoring import score_spalm
from memlm.model.memory_config import MemoryConfig, memorizing_layer
from memlm.memory.memorizing import KnnAttention
from memlm.model.pretrained import Pretrained
from memlm.model.tokenizer import document_boundary
from memlm.model.weight_formats import dtype_name, format_of
from memlm.retrieval.compat import check_searcher
from memlm.retrieval.interpolation import served_knn
from memlm.retrieval.knnlm import KNNLMConfig
from memlm.memory.knn_store import KeyValueMemoryFactory
from memlm.retrieval.searcher import Searcher
from memlm.v1 import language_model_pb2 as lm_pb2
from services.common.tenants import TenantHoldings, current_tenant
from services.lm import results as lm_results
from services.lm import spalm as lm_spalm
from services.lm.args import NO_FEWER, FewerSources, call_walk
from services.lm.engine import (
    EngineLimits,
    EnginePool,
    GenerationRecord,
    LaneKey,
    Memorizing,
    engine_modes,
    engine_request,
    in_row_cache,
    stream_generation,
)
from services.lm.requests import LMLimits, RequestParser, ScoreArgs
from services.lm.results import (
    LIBRARY_ERRORS,
    ScoreOutcome,
    abort_library_error,
    call_searcher,
    encode_score,
)
from services.lm.scheduler import CallStop, ModelScheduler, StepGate
from services.lm.score_batch import BatchStop, ScoreBatcher
from services.lm.score_engine import BATCHED, ENGINE, score_on_engine, score_path
from services.retrieval.client import (
    RetrievalClient,
)
from services.retrieval.server import info_to_proto

T = TypeVar("T")


class LanguageModelServicer:
    """Validate, run with the model's turn (services.lm.scheduler), encode. Before `load` every call answers
    UNAVAILABLE."""

    def __init__(self, *, model_name: str, knn_defaults: KNNLMConfig, limits: LMLimits, max_message_bytes: int,
                 max_calls: int):
        """max_calls: calls whose work may be under way at once (the server's max_concurrent_rpcs)."""
        self._model_name = model_name
        self._knn_defaults = knn_defaults
        self._limits = limits
        self._max_message_bytes = max_message_bytes
        self.scheduler = ModelScheduler(max_calls)
        self.engine_rows = TenantHoldings("max_engine_rows")
        """Engine rows each tenant holds (one per Generate call, one per engine Score input)."""
        """The model's turns (tests look at scheduler.turns)."""
        self._loaded = False
        self._closing = threading.Event()
        self.records: list[GenerationRecord] = []
        """Finished Generate calls, oldest first (bounded)."""
        self.records_changed = threading.Condition()
        """Notified whenever a record is added."""

    # -- setup --------------------------------------------------------------------------------------

    def load(self, pretrained: Pretrained, searcher: Searcher | None = None,
             knn_attention: KnnAttention | None = None, spalm: lm_spalm.SpalmCheckpoint | None = None,
             knn_service: KeyValueMemoryFactory | None = None, fewer: FewerSources = NO_FEWER,
             accept_weights_mismatch: bool = False, interpolation: Path | None = None) -> None:
        """Attach the model (memlm.model.pretrained.Pretrained), optionally a Searcher (kNN-LM), a KnnAttention
        (MEMORY_MODE_MEMORIZING; refused when made for other heads) and a SPALM head (MEMORY_MODE_SPALM).
        knn_service: where MEMORIZING memories live when limits.knn_backend is "service" (required then):
        a retrieval server's memory sessions (services.retrieval.memory_client.remote_memory_factory).

        Refuses a datastore (searcher.info()) made with another model (with a SPALM head: than its keys'
        model) or tokenizer (its keys would be meaningless for this model, its values other tokens), keys of
        another dimension, or another document-boundary token than the one this server prepends (its keys
        saw other text), or keys computed in another weight format unless `accept_weights_mismatch`. May block:
        a RetrievalClient asks its server. interpolation: a file of `memlm eval --lambda auto --save-interpolation`
        that kNN-LM Score mixes with where a request leaves lambda and T unset (memlm.retrieval.interpolation.
        served_knn; refused when fitted with another model, key layer or datastore).
        """
        model, tokenizer = pretrained.model, pretrained.tokenizer
        boundary = document_boundary(tokenizer)
        info = None
        keys_model = lm_spalm.keys_fingerprint(spalm, pretrained.fingerprint, model.config.n_embd)
        if searcher is not None:
            info = searcher.info()
            check_searcher(info, model_fingerprint=keys_model, tokenizer_fingerprint=tokenizer.fingerprint,
                           dim=model.config.n_embd, key_layer=model.config.key_description, boundary_token=boundary,
                           weights=format_of(model), accept_weights_mismatch=accept_weights_mismatch)
        if interpolation is not None:
            if info is None:
                raise MemlmError("--interpolation needs --datastore or --retrieval: it mixes the datastore's neighbours")
            self._knn_defaults = served_knn(self._knn_defaults, interpolation, model_fingerprint=pretrained.fingerprint,
                                            key_layer=model.config.key_description,
                                            corpus_fingerprint=info.corpus_fingerprint)
        knn_layer = None
        if knn_attention is not None:
            try:  # made for these heads, at a layer the model has
                knn_attention.check_model(model.config)
                knn_layer = memorizing_layer(MemoryConfig("memorizing", knn_layer=self._limits.knn_layer),
                                             model.config.n_layer)
            except ValueError as e:
                raise MemlmError(str(e)) from None
            if self._limits.knn_backend == "service" and knn_service is None:
                raise MemlmError("kNN backend 'service' needs a retrieval server with memory sessions (--knn-service)")
        self._knn_attention, self._knn_service = knn_attention, knn_service
        self._spalm = spalm
        self._model = model
        self._tokenizer = tokenizer
        self._searcher = searcher
        self._boundary = boundary
        # Valid ids: those both the model and the tokenizer know (a random preset may pad its vocab).
        vocab = min(model.config.vocab_size, tokenizer.vocab_size)
        # Token texts once, so responses never decode token by token.
        self._pieces = [tokenizer.decode([i]) for i in range(model.config.vocab_size)]
        tokens_in_flight = self._limits.tokens_in_flight(model.config, model.dtype)  # the KV bytes' worth of tokens
        self._parser = RequestParser(tokenizer=tokenizer, vocab=vocab, max_len=model.config.max_seq_len,
                                     limits=self._limits, knn_defaults=self._knn_defaults,
                                     knn_refusal=lm_spalm.knn_refusal(keys_model, pretrained.fingerprint, info is not None),
                                     spalm_missing=lm_spalm.spalm_missing(spalm, searcher is not None),
                                     attribution_refusal=lm_results.attribution_refusal(searcher),
                                     in_row_cache=lambda memory: in_row_cache(model, memory),
                                     piece_bytes=[len(p.encode()) for p in self._pieces],
                                     max_response_bytes=self._max_message_bytes,
                                     datastore_windows=(info.context, info.stride) if info is not None else None,
                                     memorizing=knn_attention is not None, fewer=fewer,
                                     tokens_in_flight=tokens_in_flight)
        response = self._parser.info_response(model=self._model_name, model_fingerprint=pretrained.fingerprint,
                                              knn_layer=knn_layer)
        if info is not None:
            response.datastore.CopyFrom(info_to_proto(info))
        response.engine_memory_modes.extend(engine_modes(model))
        response.weights, response.compute_dtype = format_of(model), dtype_name(model.dtype)
        self._info = response
        self.engines = EnginePool(model, tokenizer, searcher, EngineLimits(
            max_batch=self._limits.max_batch, max_queue=self._limits.max_queue,
            max_tokens_in_flight=tokens_in_flight, prefill_chunk=self._limits.max_step_tokens,
            cuda_graphs=self._limits.cuda_graphs), self.scheduler.turns, spalm.head if spalm is not None else None, fewer.drafts,
            Memorizing(knn_attention, knn_service) if knn_attention is not None else None)
        """The running Generate batches (services.lm.engine)."""
        self.score_batches = ScoreBatcher(self.scheduler, self._score_work)
        """Concurrent Score calls sharing forward steps (services.lm.score_batch)."""
        self._loaded = True

    def close(self) -> None:
        """Release the model's workers (after the server stopped): work still running stops within one
        step (its calls were cancelled when the drain's grace ran out), queued work is dropped."""
        self._closing.set()
        if self._loaded:
            self.engines.close()
        self.scheduler.close()

    def _knn_attention_for(self, memory: MemoryConfig | None) -> KnnAttention | None:
        """The KnnAttention a request's memory takes: the server's for MEMORIZING, none otherwise."""
        return self._knn_attention if memory is not None and memory.kind == "memorizing" else None

    async def _require_loaded(self, context) -> None:
        if not self._loaded:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading; retry when health is SERVING")

    async def _refuse_knn_while_down(self, request: lm_pb2.ScoreRequest | lm_pb2.GenerateRequest, context) -> None:
        """A kNN-LM or SPALM call while the retrieval link is down fails at once, not after queueing for the model
        and running its first step (fast failure); the breaker still guards every search."""
        searches = request.knn.enabled or request.memory_mode == lm_pb2.MEMORY_MODE_SPALM
        if searches and isinstance(self._searcher, RetrievalClient) and self._searcher.link_up is False:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"retrieval service {self._searcher.address}: retrieval "
                                                             "link down (the channel cannot connect); failing fast")

    async def _call_library(self, context, stop: CallStop, running: Awaitable[T]) -> T:
        """Await library work run with the model's turn (scheduler.run, or a shared Score batch); searcher and
        library errors become statuses (the server keeps serving).

        The work polls its gate (whose `stop` the caller sets when its handler ends); WorkStopped means the
        caller gave up or its deadline passed: DEADLINE_EXCEEDED or CANCELLED, for a client that may still listen.
        """
        try:
            return await running
        except LIBRARY_ERRORS as e:
            await abort_library_error(context, e, stop.expired())

    def _score_work(self, args: ScoreArgs, gate: StepGate, stop: CallStop | BatchStop) -> ScoreOutcome:
        """The library's Score of `args`, polling `gate` -> scores, SPALM gates (or None), generations searched."""
        searcher = call_searcher(self._searcher, gate, stop) if args.knn or args.spalm else None
        generations = searcher.generations if searcher is not None else set()
        walker, retrieval = call_walk(searcher, args.retrieval)  # a remote pointer walk: one generation
        if args.spalm is not None:
            return ScoreOutcome(*score_spalm(
                self._model, self._spalm.head, args.token_seqs, memory=args.memory, searcher=searcher,
                k=args.spalm.k, options=args.spalm.options, boundary_token=self._boundary, contexts=args.contexts,
                top_n=args.top_n, batch_size=args.batch_size, should_stop=gate), generations)
        if args.memory is None:
            return ScoreOutcome(score_tokens(
                self._model, args.token_seqs, context=args.context, stride=args.stride, contexts=args.contexts,
                boundary_token=self._boundary, searcher=walker, knn=args.knn, top_n=args.top_n,
                batch_size=args.batch_size, should_stop=gate, attribution=args.attribution,
                retrieval=retrieval), None, generations)
        return ScoreOutcome(score_tokens_segments(
            self._model, args.token_seqs, memory=args.memory, contexts=args.contexts,
            boundary_token=self._boundary, searcher=searcher, knn=args.knn, top_n=args.top_n, batch_size=args.batch_size,
            should_stop=gate, knn_attention=self._knn_attention_for(args.memory), service=self._knn_service,
            attribution=args.attribution), None, generations)

    # -- rpcs ---------------------------------------------------------------------------------------

    async def Score(self, request: lm_pb2.ScoreRequest, context: grpc.aio.ServicerContext):
        await self._require_loaded(context)
        await self._refuse_knn_while_down(request, context)
        stop = CallStop(context, self._closing)
        tenant = current_tenant()
        gate = self.scheduler.gate(stop, tenant.name)
        # Tokenizing (up to max_text_chars) and encoding the response are work too, but not the model's:
        # on a worker, off the event loop and without the turn.
        args = await self.scheduler.run_free(self._parser.score, request)
        path = score_path(args, self._model)  # the one routing rule (services.lm.score_engine)
        rows = len(args.token_seqs) if path == ENGINE else 0
        refusal = self.engine_rows.take(tenant, rows)
        if refusal is not None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
        try:
            if path == ENGINE:  # rows of the engine's running batch of its settings
                out = await score_on_engine(self.engines, self._model, args, self._boundary, stop.deadline, context)
            else:
                running = (self.score_batches.score(args, stop, tenant.name) if path == BATCHED
                           else self.scheduler.run(gate, self._score_work, args, gate, stop))
                out = await self._call_library(context, stop, running)
            gates = out.gates if out.gates is not None else [None] * len(out.scores)
            return await self.scheduler.run_free(lambda: lm_pb2.ScoreResponse(
                results=[encode_score(s, self._pieces, g, args.knn is not None) for s, g in zip(out.scores, gates)],
                datastore_generations=sorted(out.generations)))
        finally:  # cancelled, aborted or done: a step still running stops after itself
            stop.set()
            self.engine_rows.give_back(tenant, rows)

    async def Generate(self, request: lm_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        await self._require_loaded(context)
        await self._refuse_knn_while_down(request, context)
        deadline = CallStop(context, self._closing).deadline
        args = await self.scheduler.run_free(self._parser.generate, request)  # tokenizing: without the turn
        # A row of a running engine batch (services.lm.engine), for every model and memory mode.
        spalm = SpalmSettings(args.spalm.k, args.spalm.options) if args.spalm is not None else None
        request = engine_request(args.prompt, args.max_new_tokens, args.sampling, args.stop_sequences, args.knn,
                                 self._boundary, self._tokenizer.eos_id, deadline, spalm, args.speculative,
                                 args.retrieval)
        lane = LaneKey(args.memory, args.knn is not None or spalm is not None, args.attribution,
                       args.speculative is not None)
        tenant = current_tenant()
        refusal = self.engine_rows.take(tenant, 1)
        if refusal is not None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
        try:
            async for response in stream_generation(self.engines, lane, request, deadline, context, self._record):
                yield response
        finally:
            self.engine_rows.give_back(tenant, 1)

    def _record(self, record: GenerationRecord) -> None:
        with self.records_changed:
            self.records.append(record)
            del self.records[:-1000]
            self.records_changed.notify_all()

    async def Tokenize(self, request: lm_pb2.TokenizeRequest, context: grpc.aio.ServicerContext):
        await self._require_loaded(context)
        self._parser.batch_size(len(request.texts), "texts")
        self._parser.text_budget(list(request.texts), "texts")

        def work():
            results = []
            for text in request.texts:
                ids = self._tokenizer.encode(text)
                if request.add_bos and self._tokenizer.bos_id is not None:
                    ids = [self._tokenizer.bos_id, *ids]
                results.append(lm_pb2.TokenizedText(ids=ids, pieces=[self._pieces[i] for i in ids]))
            return lm_pb2.TokenizeResponse(results=results)

        return await self.scheduler.run_free(work)  # no model work: never waits for the turn

    async def GetInfo(self, request, context: grpc.aio.ServicerContext):
        await self._require_loaded(context)
        return self._info
