"""What the LM server's results say beyond the scores: which datastore generation served a call,
and which documents each token's probability came from (attribution), on the wire.

`call_searcher` is the searcher of one Score or Generate call (services.retrieval.call_searcher.CallSearcher:
a remote search ends by the caller's deadline or cancel and waits without the model's turn): it notes the
generation that answered every search (ScoreResponse / GenerateFinish.datastore_generations) and answers
the sourced searches of attribution (memlm.retrieval.attribution). `encode_score` turns a library
SequenceScore into the wire's, attribution included.

Shape legend: Q queries, d key dimension, k neighbours, n scored tokens, N alternatives.
"""

from __future__ import annotations

import json
from typing import NamedTuple

import grpc
import numpy as np

from memlm.errors import MemlmError
from memlm.jobs.scoring import SequenceScore
from memlm.jobs.windows import WorkStopped
from memlm.retrieval.attribution import TokenAttribution, require_sourced
from memlm.retrieval.searcher import Searcher
from memlm.v1 import language_model_pb2 as lm_pb2
from services.lm.scheduler import StepGate
from services.retrieval.call_searcher import CallSearcher
from services.retrieval.client import CallOptions, RetrievalClient, Wants
from services.common.server import ServiceError


def call_searcher(searcher: Searcher, gate: StepGate, stop) -> CallSearcher:
    """One call's searcher: a remote search ends by the deadline of `stop` (the call's CallStop, or a shared
    batch's BatchStop), is cancelled once stop() and waits without the model's turn; every search notes the
    generation that answered."""
    return CallSearcher(searcher, CallOptions(stop.deadline, stop, gate.outside, Wants.GENERATION))


def attribution_refusal(searcher: Searcher | None) -> str | None:
    """Why attribution (KnnOptions.attribution_top_n) cannot be served by this server's searcher, in one line,
    found once at load by one sourced search (a searcher without documents, a datastore whose format predates
    the documents table); None when it can, without a searcher (kNN-LM is refused as such), and for a
    retrieval service (which answers FAILED_PRECONDITION itself)."""
    if searcher is None or isinstance(searcher, RetrievalClient):
        return None
    try:
        require_sourced(searcher).search_sourced(np.zeros((1, searcher.info().dim), np.float32), 1)  # (1, d)
    except MemlmError as e:
        return str(e)
    return None


def attribution_to_proto(a: TokenAttribution) -> lm_pb2.TokenAttribution:
    """A token's TokenAttribution as the wire's (metadata as a JSON object)."""
    return lm_pb2.TokenAttribution(knn_prob=a.knn_prob, datastore_generation=a.generation, documents=[
        lm_pb2.DocumentAttribution(doc_id=d.source.doc_id, knn_mass=d.knn_mass, final_share=d.final_share,
                                   meta_json=json.dumps(d.source.meta, ensure_ascii=False, sort_keys=True))
        for d in a.documents])


def encode_score(s: SequenceScore, pieces: list[str], gates: np.ndarray | None = None, knn: bool = False
                 ) -> lm_pb2.SequenceScore:
    """A library SequenceScore as the wire's; pieces: each token id's text (decoded once at load);
    gates: (n,) MEMORY_MODE_SPALM's gate of each scored token, or None. With attribution, each token's.
    knn: kNN-LM was on (searches and searches_saved are counted then)."""
    tokens = []
    for j, t in enumerate(s.tokens.tolist()):
        alternatives = [
            lm_pb2.TokenAlternative(token_id=a, text=pieces[a], logprob=lp)
            for a, lp in zip(s.top_ids[j].tolist(), s.top_logprobs[j].tolist())
        ]
        tokens.append(lm_pb2.TokenScore(
            token_id=t, text=pieces[t], logprob=float(s.logprob[j]), base_logprob=float(s.base_logprob[j]),
            is_greedy=bool(s.greedy[j]), alternatives=alternatives,
            gate=float(gates[j]) if gates is not None else None,
            attribution=attribution_to_proto(s.attribution[j]) if s.attribution else None,
        ))
    return lm_pb2.SequenceScore(
        tokens=tokens, total_logprob=s.total_logprob, base_total_logprob=s.base_total_logprob,
        perplexity=s.perplexity, is_greedy=s.is_greedy, context_tokens=s.context_tokens,
        searches=s.searches if knn else 0, searches_saved=len(s.tokens) - s.searches if knn else 0,
    )


class ScoreOutcome(NamedTuple):
    """What one library Score run gives the servicer."""

    scores: list[SequenceScore]
    """One per sequence, in order."""
    gates: list | None
    """MEMORY_MODE_SPALM: each sequence's gates (n,); None in the other modes."""
    generations: set[int]
    """The datastore generations that answered its searches (ScoreResponse.datastore_generations)."""


LIBRARY_ERRORS = (WorkStopped, ServiceError, MemlmError)
"""What a call's library work (or its engine rows) may fail with and abort_library_error turns into a status."""


async def abort_library_error(context, error: BaseException, expired: bool) -> None:
    """The one mapping of a call's failed work to its status: WorkStopped (the caller gave up, its deadline passed
    or the server closes) -> DEADLINE_EXCEEDED when `expired`, else CANCELLED; a remote retrieval service's
    failure -> its own code; MemlmError -> INVALID_ARGUMENT (the message names the field); anything else ->
    INTERNAL (abort_row_error). Aborts (raises)."""
    if isinstance(error, WorkStopped):
        if expired:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed; the work was stopped")
        await context.abort(grpc.StatusCode.CANCELLED, "the call was cancelled; the work was stopped")
    if isinstance(error, ServiceError):  # the remote retrieval service failed: pass its code on
        await context.abort(error.code, f"retrieval service {error.address}: {error.details}")
    if isinstance(error, MemlmError):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
    await abort_row_error(context, error)


async def abort_row_error(context, error: BaseException) -> None:
    """A call's engine row failed in its own work (a draw, a search, a memory) with an error that is not the
    library's: INTERNAL with its message; the other calls' rows went on. Aborts (raises)."""
    await context.abort(grpc.StatusCode.INTERNAL, f"this call's row failed: {type(error).__name__}: {error}")
