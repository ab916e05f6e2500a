"""The LanguageModelService server: bind, load the model (and its searcher, memorizing layer, SPALM head), serve.

The rpcs themselves are services.lm.servicer.LanguageModelServicer. `bind_lm_server` starts a server whose
health is NOT_SERVING until `load` has run (serve_lm loads the model on a thread meanwhile); `start_lm_server`
binds and loads a model already in memory (tests, port 0).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from memlm.errors import MemlmError
from memlm.jobs.memorizing import saved_knn_attention
from memlm.memory.memorizing import KnnAttention
from memlm.model.pretrained import Pretrained
from memlm.retrieval.knnlm import KNNLMConfig
from memlm.memory.knn_store import KeyValueMemoryFactory
from memlm.retrieval.searcher import DEFAULT_SEARCH_BACKEND, Searcher
from memlm.v1 import language_model_pb2 as lm_pb2
from memlm.v1 import retrieval_pb2, tensor_pb2
from services.lm import spalm as lm_spalm
from services.lm.args import NO_FEWER, FewerSources, server_sources
from services.lm.requests import LMLimits
from services.lm.servicer import LanguageModelServicer
from services.retrieval.memory_client import MemoryClient
from services.retrieval.client import (
    RetrievalClient,
    connect_retrieval,
    report_knn_health,
)
from services.common.metrics import LinkMetrics
from services.common.security import ClientTls
from services.common.server import (
    DEFAULT_HOST,
    RunningServer,
    ServerOptions,
    ServiceClient,
    close_when_stopped,
    join_host_port,
    message_classes_of,
    run_until_signal,
    start_server,
)

SERVICE = lm_pb2.DESCRIPTOR.services_by_name["LanguageModelService"]
MESSAGE_CLASSES = message_classes_of(lm_pb2, retrieval_pb2, tensor_pb2)
GENERATE, SCORE = (f"/{SERVICE.full_name}/{name}" for name in ("Generate", "Score"))


def add_lm_metrics(running: RunningServer, servicer: LanguageModelServicer) -> None:
    """The LM server's own series beside its calls' (services.common.metrics), for a loaded servicer: tokens
    generated and scored, counted from the responses, and the engine's queue and rows in use, read at scrape time."""
    metrics = running.metrics
    tokens = metrics.counter("memlm_tokens", "Tokens generated (Generate streams) and scored (Score responses)",
                             ("kind",))
    generated, scored = tokens.labels("generated"), tokens.labels("scored")
    metrics.observe_responses(GENERATE, lambda r: generated.inc(len(r.delta.tokens)) if r.HasField("delta") else None)
    metrics.observe_responses(SCORE, lambda r: scored.inc(sum(len(result.tokens) for result in r.results)))
    metrics.gauge("memlm_engine_queue_depth", "Generate calls and Score inputs waiting for an engine row",
                  lambda: sum(lane.engine.waiting for lane in servicer.engines.lanes()))
    metrics.gauge("memlm_engine_rows_in_use", "Engine rows running a Generate call or a Score input",
                  lambda: sum(len(lane.engine.rows) for lane in servicer.engines.lanes()))


def watch_links(running: RunningServer, links: list[object]) -> None:
    """Count the calls of the server's retrieval and memory links and report their breakers (before the load,
    whose GetInfo is their first call); links that are not clients (an in-process datastore) are left out."""
    link_metrics = LinkMetrics(running.metrics)
    for link in links:
        if not isinstance(link, ServiceClient):
            continue
        breaker = (lambda link=link: link.breaker_state) if isinstance(link, RetrievalClient) else None
        link_metrics.watch(link.address, link.calls, breaker)


# ---------------------------------------------------------------------------------------------
# Construction and lifecycle


@dataclass(frozen=True)
class LMServer:
    """A started language-model server and its servicer (tests look at `servicer.records`)."""

    running: RunningServer
    """Server, bound port and health."""
    servicer: LanguageModelServicer
    """The servicer (model scheduler, limits, generation records)."""


async def bind_lm_server(address: str, *, model_name: str, knn_defaults: KNNLMConfig, options: ServerOptions,
                 limits: LMLimits) -> LMServer:
    """Bind and start a server whose servicer has no model yet: health NOT_SERVING, calls UNAVAILABLE
    until `servicer.load(...)` and `running.mark_serving()` (serve_lm loads the model meanwhile)."""
    servicer = LanguageModelServicer(
        model_name=model_name, knn_defaults=knn_defaults, limits=limits, max_message_bytes=options.max_message_bytes,
        max_calls=options.max_concurrent_rpcs,
    )
    running = await start_server(address, [(SERVICE, servicer)], MESSAGE_CLASSES, options)

    async def release() -> None:
        # Joins the model's workers off the event loop: the cancelled handlers still need the loop to end.
        await asyncio.to_thread(servicer.close)

    close_when_stopped(running.server, release)
    return LMServer(running, servicer)


async def start_lm_server(
    address: str,
    pretrained: Pretrained,
    searcher: Searcher | None = None,
    *,
    model_name: str = "custom",
    knn_defaults: KNNLMConfig = KNNLMConfig(),
    options: ServerOptions = ServerOptions(),
    limits: LMLimits = LMLimits(),
    knn_attention: KnnAttention | None = None,
    spalm: lm_spalm.SpalmCheckpoint | None = None,
    knn_service: KeyValueMemoryFactory | None = None,
    fewer: FewerSources = NO_FEWER,
    interpolation: Path | None = None,
) -> LMServer:
    """Start a LanguageModelService for a loaded model on `address` ("HOST:PORT", port 0 = any free port).

    pretrained: memlm.model.pretrained.Pretrained (model, tokenizer, fingerprint).
    searcher: a Searcher for kNN-LM (Datastore or RetrievalClient), or None (kNN-LM requests then get
        FAILED_PRECONDITION); its info() is checked against the model and sent on in GetInfo.
    knn_defaults: k, lambda, temperature, nprobe, exact re-rank used where a request leaves them unset.
    knn_attention: the memorizing layer's parameters: MEMORY_MODE_MEMORIZING is served with it (at
        limits.knn_layer), not without.
    spalm: a SPALM head: MEMORY_MODE_SPALM is served with it and a searcher (checked against its keys' model).
    knn_service: MEMORIZING's memory factory for limits.knn_backend "service" (LanguageModelServicer.load).
    interpolation: a saved interpolation kNN-LM Score mixes with (LanguageModelServicer.load).
    Health reports SERVING once this returns. The model's workers are released when the server stops.
    """
    started = await bind_lm_server(address, model_name=model_name, knn_defaults=knn_defaults, options=options, limits=limits)
    watch_links(started.running, [searcher, knn_service])
    try:
        # A RetrievalClient asks its server (blocking): off the event loop, which may serve that server.
        await asyncio.to_thread(started.servicer.load, pretrained, searcher, knn_attention, spalm, knn_service, fewer,
                                interpolation=interpolation)
    except BaseException:
        await started.running.server.stop(None)
        raise
    await started.running.mark_serving()
    await report_knn_health(started.running.health, searcher)
    add_lm_metrics(started.running, started.servicer)
    return started


async def create_lm_server(
    address: str,
    pretrained: Pretrained,
    searcher: Searcher | None = None,
    *,
    model_name: str = "custom",
    knn_defaults: KNNLMConfig = KNNLMConfig(),
    options: ServerOptions = ServerOptions(),
    limits: LMLimits = LMLimits(),
) -> tuple[grpc.aio.Server, int]:
    """start_lm_server, returning (server, bound port)."""
    started = await start_lm_server(address, pretrained, searcher, model_name=model_name, knn_defaults=knn_defaults,
                                    options=options, limits=limits)
    return started.running.server, started.running.port


def open_model_and_searcher(
    model: str,
    *,
    datastore: str | None = None,
    retrieval: str | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    retrieval_tls: ClientTls | None = None,
    retrieval_token: str | None = None, key_module: str | None = None,
    search_backend: str = DEFAULT_SEARCH_BACKEND, weights: str | None = None, allow_pickle_weights: bool = False,
) -> tuple[Pretrained, Searcher | None]:
    """Load the model and, with --datastore or --retrieval, its searcher: (pretrained, searcher or None).
    search_backend: how a --datastore searches (memlm.retrieval.searcher.SEARCH_BACKENDS; "torch": on the
    model's device). weights: the weight format (memlm.model.weights.load_pretrained; None: `dtype`'s).
    allow_pickle_weights: a transformers model may load pickled *.bin weights (load_pretrained's allow_pickle)."""
    from memlm.model.weights import load_pretrained

    if datastore is not None and retrieval is not None:
        raise MemlmError("pass --datastore or --retrieval, not both")
    # The retrieval link first: an unreachable one fails in one line before the model loads.
    link = connect_retrieval(retrieval, tls=retrieval_tls, token=retrieval_token) if retrieval is not None else None
    pretrained = load_pretrained(model, device, dtype, key_module=key_module,  # key_module: memlm.model.hf_model
                                 weights=weights, allow_pickle=allow_pickle_weights)
    if datastore is not None:
        from datastore.datastore import Datastore

        # checked against the model by check_searcher in load()
        ds = Datastore.open(datastore, backend=search_backend, device=str(pretrained.model.device))
        return pretrained, ds
    return pretrained, link


async def serve_lm(
    model: str,
    *,
    datastore: str | None = None,
    retrieval: str | None = None,
    host: str = DEFAULT_HOST,
    port: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    knn_defaults: KNNLMConfig = KNNLMConfig(),
    options: ServerOptions = ServerOptions(),
    limits: LMLimits = LMLimits(),
    retrieval_tls: ClientTls | None = None,
    retrieval_token: str | None = None, key_module: str | None = None,
    knn_service: MemoryClient | None = None, adaptive_gate: str | None = None,
    search_backend: str = DEFAULT_SEARCH_BACKEND, weights: str | None = None, accept_weights_mismatch: bool = False,
    allow_pickle_weights: bool = False, interpolation: Path | None = None,
) -> None:
    """`memlm serve lm`: bind first (health NOT_SERVING), load the model and the searcher on a thread,
    then print `listening on HOST:PORT` and serve until SIGTERM/SIGINT, draining in-flight calls.
    knn_service: the memory sessions of MEMORIZING with limits.knn_backend "service" (closed at the end).
    weights, accept_weights_mismatch: the model's weight format with `dtype`, and whether a datastore of another
    format is served (LanguageModelServicer.load). allow_pickle_weights: as open_model_and_searcher.
    interpolation: the saved interpolation kNN-LM Score mixes with (LanguageModelServicer.load)."""
    started = await bind_lm_server(join_host_port(host, port), model_name=model, knn_defaults=knn_defaults,
                           options=options, limits=limits)
    try:
        pretrained, searcher = await asyncio.to_thread(
            open_model_and_searcher, model, datastore=datastore, retrieval=retrieval, device=device, dtype=dtype,
            retrieval_tls=retrieval_tls, retrieval_token=retrieval_token, key_module=key_module,
            search_backend=search_backend, weights=weights, allow_pickle_weights=allow_pickle_weights,
        )
        watch_links(started.running, [searcher if retrieval is not None else None, knn_service])
        # A `memlm train --memory memorizing` checkpoint's KnnAttention serves MEMORY_MODE_MEMORIZING.
        knn_attention = saved_knn_attention(model, pretrained.model.device) if Path(model).is_dir() else None
        # A `memlm train --memory spalm` checkpoint's head serves MEMORY_MODE_SPALM (with the searcher).
        spalm = lm_spalm.saved_spalm(model, pretrained.model.device)
        fewer = server_sources(searcher, remote=retrieval is not None, gate_dir=adaptive_gate,  # fewer searches
                               model_fingerprint=pretrained.fingerprint, key_layer=pretrained.model.config.key_description)
        await asyncio.to_thread(started.servicer.load, pretrained, searcher, knn_attention, spalm, knn_service, fewer,
                                accept_weights_mismatch, interpolation)
    except BaseException:
        await started.running.server.stop(None)
        raise
    await report_knn_health(started.running.health, searcher)
    add_lm_metrics(started.running, started.servicer)
    links = [c for c in (searcher if retrieval is not None else None, knn_service) if c is not None]
    # The RetrievalClient's and the memory client's channels.
    await run_until_signal(started.running, host, grace_s=options.grace_s,
                           on_stopped=lambda: [link.close() for link in links])
