"""The Generate stream of one call, whose events a decoding-engine row makes (services.lm.engine): a response per
token, then the finish with its counts (searches, speculative decoding's mean_accepted_tokens), or a status.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass

import grpc

from memlm.engine.requests import Event
from memlm.jobs.decoding import (
    FINISH_EOS,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationEnd,
    TokenEvent,
)
from memlm.retrieval.attribution import TokenAttribution
from memlm.v1 import language_model_pb2 as lm_pb2
from services.lm.results import attribution_to_proto

FINISH_REASONS = {
    FINISH_LENGTH: lm_pb2.FINISH_REASON_LENGTH,
    FINISH_STOP: lm_pb2.FINISH_REASON_STOP_SEQUENCE,
    FINISH_EOS: lm_pb2.FINISH_REASON_END_OF_TEXT,
}
"""How a generation that ran to its end finished, on the wire (cancelled / deadline ends are statuses)."""


@dataclass(frozen=True)
class GenerationRecord:
    """How one Generate call ended on the server (for tests and logs)."""

    completion_tokens: int
    """Tokens generated before the call ended."""
    outcome: str
    """"length" / "stop" / "eos", "cancelled" (client went away or deadline passed) or "error"."""


def token_response(event: TokenEvent, attribution: TokenAttribution | None = None) -> lm_pb2.GenerateResponse:
    token = lm_pb2.GeneratedToken(token_id=event.token_id, text=event.text, logprob=event.logprob,
                                  base_logprob=event.base_logprob,
                                  attribution=attribution_to_proto(attribution) if attribution is not None else None)
    return lm_pb2.GenerateResponse(delta=lm_pb2.GenerateDelta(text=event.text_delta, tokens=[token]))


def end_responses(event: GenerationEnd, generations=()) -> list[lm_pb2.GenerateResponse]:
    """The last text delta (if any) and the finish message of a generation that ran to its end; generations:
    the datastore generations its searches were answered by."""
    out = [lm_pb2.GenerateResponse(delta=lm_pb2.GenerateDelta(text=event.text_delta))] if event.text_delta else []
    return out + [lm_pb2.GenerateResponse(finish=lm_pb2.GenerateFinish(
        reason=FINISH_REASONS[event.reason], prompt_tokens=event.prompt_tokens,
        completion_tokens=event.completion_tokens, stop_sequence=event.stop_sequence,
        datastore_generations=sorted(generations), searches=event.searches, searches_saved=event.searches_saved,
        mean_accepted_tokens=event.mean_accepted_tokens or 0.0))]



async def generate_responses(
    context: grpc.aio.ServicerContext, next_event: Callable[[], Awaitable[Event]],
    token: Callable[[TokenEvent], lm_pb2.GenerateResponse], generations: Callable[[], Iterable[int]],
    expired: Callable[[], bool], release: Callable[[], None], record: Callable[[GenerationRecord], None],
) -> AsyncIterator[lm_pb2.GenerateResponse]:
    """The Generate stream of one call (its events from next_event): a response per token (token(event)), then the finish (end_responses with generations()).
    An end that is not a finish (the engine's deadline or a cancel) and a deadline passed between tokens
    end with DEADLINE_EXCEEDED; an exception is recorded as "cancelled" when expired() else "error".
    release() frees what the call holds and record(GenerationRecord) counts it, however it ends."""
    produced, outcome = 0, "cancelled"
    try:
        while True:
            # Between tokens: a cancelled call never gets here (its await is cancelled); a call whose
            # deadline passed is ended here even if grpc has not cancelled it yet.
            if context.cancelled():
                return
            remaining = context.time_remaining()
            if remaining is not None and remaining <= 0:
                break  # to the DEADLINE_EXCEEDED below
            event = await next_event()
            if isinstance(event, TokenEvent):
                produced += 1
                yield token(event)
                continue
            if event.reason not in FINISH_REASONS:  # the engine's deadline (or a cancel): no finish message
                break
            outcome = event.reason
            for response in end_responses(event, generations()):
                yield response
            return
    except Exception:  # an abort (e.g. the retrieval service failed) or a bug; CancelledError is not one
        outcome = "cancelled" if expired() else "error"  # a step stopped at the deadline is no error
        raise
    finally:
        release()
        record(GenerationRecord(produced, outcome))
    # Ending the stream normally here would tell a client whose own timer has not fired yet that the
    # generation finished (status OK, no finish message).
    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"deadline passed after {produced} generated tokens")
