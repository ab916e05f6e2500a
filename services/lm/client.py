"""A synchronous LanguageModelService client, and the `memlm client score|generate` commands.

`LanguageModelClient` turns the protobuf messages into frozen dataclasses (scores) and an iterator of
deltas (generation); every grpc error becomes a ServiceError (a MemlmError: the command line prints it
as one line). Leaving a `generate` iterator early (break, close, garbage collection) cancels the call,
so the server stops generating.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TextIO

import grpc

from memlm.errors import MemlmError
from memlm.retrieval.attribution import DocumentShare, DocumentSource, TokenAttribution
from memlm.v1 import language_model_pb2 as lm_pb2
from memlm.v1 import language_model_pb2_grpc as lm_pb2_grpc
from services.lm.client_requests import KnnRequest, MemoryRequest, SpalmRequest
from services.common.security import ClientTls
from services.common.server import (
    DEFAULT_MAX_MESSAGE_BYTES,
    ServiceClient,
    ServiceError,
)

MEMORY_MODES = {
    "none": lm_pb2.MEMORY_MODE_NONE,
    "xl": lm_pb2.MEMORY_MODE_XL,
    "compressive": lm_pb2.MEMORY_MODE_COMPRESSIVE,
    "memorizing": lm_pb2.MEMORY_MODE_MEMORIZING,
    "spalm": lm_pb2.MEMORY_MODE_SPALM,
}
DRAFT_FROM_VALUES = {
    "datastore": lm_pb2.DRAFT_FROM_DATASTORE,
    "history": lm_pb2.DRAFT_FROM_HISTORY,
    "both": lm_pb2.DRAFT_FROM_BOTH,
}
"""GenerateRequest.draft_from by memlm.engine.drafts.DRAFT_FROM's names (services.lm.args reads it back)."""
FINISH_NAMES = {
    lm_pb2.FINISH_REASON_LENGTH: "length",
    lm_pb2.FINISH_REASON_STOP_SEQUENCE: "stop",
    lm_pb2.FINISH_REASON_END_OF_TEXT: "eos",
}


@dataclass(frozen=True)
class Alternative:
    """A likely token at a scored position."""

    token_id: int
    """Token id."""
    text: str
    """Its text."""
    logprob: float
    """Final log-probability, nats."""


@dataclass(frozen=True)
class ScoredToken:
    """One scored token."""

    token_id: int
    """Token id."""
    text: str
    """Its text."""
    logprob: float
    """Final log-probability (kNN-LM mixture when on), nats."""
    base_logprob: float
    """Base LM log-probability, nats."""
    is_greedy: bool
    """The most likely token under the final distribution."""
    alternatives: tuple[Alternative, ...]
    """top_n most likely tokens, most likely first."""
    gate: float | None = None
    """Memory mode "spalm": the gate g_t (the hidden state's weight; 1 - g_t the retrieved tokens'); else None."""
    attribution: TokenAttribution | None = None
    """With KnnRequest.attribution_top_n: the documents behind its probability; else None."""


@dataclass(frozen=True)
class ScoreResult:
    """Scores of one input."""

    tokens: tuple[ScoredToken, ...]
    """The scored (continuation) tokens."""
    total_logprob: float
    """Sum of final log-probabilities, nats."""
    base_total_logprob: float
    """Sum of base log-probabilities, nats."""
    perplexity: float
    """exp(-total_logprob / tokens); inf when nothing was scored."""
    is_greedy: bool
    """Every token greedy."""
    context_tokens: int
    """Tokens the continuation was conditioned on (boundary token + context)."""
    datastore_generations: tuple[int, ...] = ()
    """The datastore generations the call's searches were answered by (the same for every input of a call)."""
    searches: int = 0
    """kNN searches made for the scored tokens (0 without kNN-LM; fewer with KnnRequest's fewer searches)."""
    searches_saved: int = 0
    """Scored tokens without a search."""

    @property
    def base_perplexity(self) -> float:
        """exp(-base_total_logprob / tokens)."""
        return math.exp(-self.base_total_logprob / len(self.tokens)) if self.tokens else math.inf


@dataclass(frozen=True)
class TextDelta:
    """New generated text and its tokens."""

    text: str
    """New text (concatenating all deltas gives the continuation)."""
    token_ids: tuple[int, ...]
    """The new tokens."""
    logprobs: tuple[float, ...]
    """Their final log-probabilities, nats."""
    base_logprobs: tuple[float, ...]
    """Their base LM log-probabilities, nats."""
    attributions: tuple[TokenAttribution | None, ...] = ()
    """With KnnRequest.attribution_top_n: each new token's documents; else empty."""
    texts: tuple[str, ...] = ()
    """Each new token's own text."""


@dataclass(frozen=True)
class Finish:
    """The end of a generation."""

    reason: str
    """"length", "stop" or "eos"."""
    prompt_tokens: int
    """Prompt tokens."""
    completion_tokens: int
    """Generated tokens."""
    stop_sequence: str
    """The stop sequence that matched, else ""."""
    datastore_generations: tuple[int, ...] = ()
    """The datastore generations whose neighbours chose the tokens (kNN-LM); empty without searches."""
    searches: int = 0
    """kNN searches the generation made, in queries (on the server's decoding engine)."""
    mean_accepted_tokens: float = 0.0
    """With speculative: tokens per verifying forward pass (>= 1); 0 without."""
    searches_saved: int = 0
    """kNN-LM tokens chosen without a search (KnnRequest's pointers / adaptive_*; on the decoding engine)."""


@dataclass(frozen=True)
class Tokenized:
    """One tokenized text."""

    ids: tuple[int, ...]
    """Token ids."""
    pieces: tuple[str, ...]
    """Text of each token."""


def _memory_mode(name: str | None) -> int:
    if name is None:
        return lm_pb2.MEMORY_MODE_UNSPECIFIED
    if name not in MEMORY_MODES:
        raise MemlmError(f"memory mode must be one of {', '.join(MEMORY_MODES)}, got {name!r}")
    return MEMORY_MODES[name]


class LanguageModelClient(ServiceClient):
    """Client of a LanguageModelService (arguments as ServiceClient; the timeout covers a whole Generate
    stream)."""

    def __init__(
        self,
        address: str,
        *,
        tls: ClientTls | None = None,
        token: str | None = None,
        timeout: float | None = 300.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        wait_for_ready: bool = False,
    ) -> None:
        super().__init__(address, tls, token, timeout, max_message_bytes, wait_for_ready)
        self._stub = lm_pb2_grpc.LanguageModelServiceStub(self._channel)

    def info(self) -> lm_pb2.LanguageModelServiceGetInfoResponse:
        """The server's model, datastore and limits."""
        return self._call(self._stub.GetInfo, lm_pb2.LanguageModelServiceGetInfoRequest())

    def tokenize(self, texts: Sequence[str], *, add_bos: bool = False) -> list[Tokenized]:
        """Token ids and pieces of each text."""
        response = self._call(self._stub.Tokenize, lm_pb2.TokenizeRequest(texts=list(texts), add_bos=add_bos))
        return [Tokenized(tuple(r.ids), tuple(r.pieces)) for r in response.results]

    def score(
        self,
        inputs: Sequence[str | Sequence[int]],
        *,
        contexts: Sequence[str | Sequence[int] | None] | None = None,
        knn: KnnRequest | None = None,
        top_n: int = 0,
        window_tokens: int | None = None,
        stride_tokens: int | None = None,
        memory_mode: str | None = None,
        memory: MemoryRequest | None = None,
        spalm: SpalmRequest | None = None,
    ) -> list[ScoreResult]:
        """Score texts or token-id sequences (continuations), optionally each after a context.

        knn: None = base LM only; KnnRequest() = kNN-LM with the server's defaults.
        memory_mode: "none" (sliding windows: window_tokens, stride_tokens), "xl" (segments with a
        Transformer-XL memory: memory), ...; None = the server's default.
        memory: sizes for "xl"; None = the server's defaults. spalm: "spalm"'s search (not with knn).
        """
        request = lm_pb2.ScoreRequest(top_n=top_n, memory_mode=_memory_mode(memory_mode))
        _set_search(request, knn, spalm)
        if memory is not None:
            request.memory.CopyFrom(memory.to_proto())
        if contexts is not None and len(contexts) != len(inputs):
            raise MemlmError(f"{len(contexts)} contexts for {len(inputs)} inputs")
        for i, item in enumerate(inputs):
            entry = request.inputs.add()
            if isinstance(item, str):
                entry.text = item
            else:
                entry.token_ids.ids.extend(int(t) for t in item)
            ctx = contexts[i] if contexts is not None else None
            if isinstance(ctx, str):
                entry.context_text = ctx
            elif ctx is not None:
                entry.context_token_ids.ids.extend(int(t) for t in ctx)
        if window_tokens is not None:
            request.window_tokens = window_tokens
        if stride_tokens is not None:
            request.stride_tokens = stride_tokens
        response = self._call(self._stub.Score, request)
        return [_score_result(r, tuple(response.datastore_generations)) for r in response.results]

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        max_new_tokens: int,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: Sequence[str] = (),
        knn: KnnRequest | None = None,
        memory_mode: str | None = None,
        memory: MemoryRequest | None = None,
        spalm: SpalmRequest | None = None,
        speculative: bool = False,
        draft_tokens: int | None = None,
        draft_from: str | None = None,
    ) -> Iterator[TextDelta | Finish]:
        """Stream a continuation: TextDelta events, then one Finish. Closing the iterator early cancels
        the call (the server stops generating). temperature None = the server's default (1.0).
        memory_mode "xl": the decoder keeps an XL memory (memory: its sizes) instead of a KV cache, so
        generation runs past the model's context without re-encoding. speculative: drafts from the server's
        datastore verified in one pass each (`--speculative`); draft_tokens, draft_from (DRAFT_FROM_VALUES' names)
        None = the server's default."""
        if draft_from is not None and draft_from not in DRAFT_FROM_VALUES:
            raise MemlmError(f"draft_from must be one of {', '.join(DRAFT_FROM_VALUES)}, got {draft_from!r}")
        request = lm_pb2.GenerateRequest(
            max_new_tokens=max_new_tokens, stop_sequences=list(stop), memory_mode=_memory_mode(memory_mode),
            speculative=speculative, draft_tokens=draft_tokens or 0,
            draft_from=DRAFT_FROM_VALUES.get(draft_from, lm_pb2.DRAFT_FROM_UNSPECIFIED),
        )
        if memory is not None:
            request.memory.CopyFrom(memory.to_proto())
        if isinstance(prompt, str):
            request.prompt_text = prompt
        else:
            request.prompt_token_ids.ids.extend(int(t) for t in prompt)
        for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("seed", seed)):
            if value is not None:
                setattr(request.sampling, name, value)
        _set_search(request, knn, spalm)
        return self._stream(request)

    def _stream(self, request: lm_pb2.GenerateRequest) -> Iterator[TextDelta | Finish]:
        call = self._stub.Generate(request, **self._call_options())
        try:
            for response in call:
                if response.HasField("delta"):
                    d = response.delta
                    yield TextDelta(
                        d.text, tuple(t.token_id for t in d.tokens), tuple(t.logprob for t in d.tokens),
                        tuple(t.base_logprob for t in d.tokens), tuple(_attribution(t) for t in d.tokens),
                        tuple(t.text for t in d.tokens),
                    )
                else:
                    f = response.finish
                    yield Finish(FINISH_NAMES.get(f.reason, "unspecified"), f.prompt_tokens, f.completion_tokens,
                                 f.stop_sequence, tuple(f.datastore_generations), f.searches, f.mean_accepted_tokens,
                                 f.searches_saved)
        except grpc.RpcError as e:
            raise ServiceError(self.address, e.code(), e.details() or "") from None
        finally:
            call.cancel()  # no-op when the stream ended; stops the server's work when we left early


def _set_search(request: lm_pb2.ScoreRequest | lm_pb2.GenerateRequest, knn: KnnRequest | None,
                spalm: SpalmRequest | None) -> None:
    """The request's KnnOptions: kNN-LM's (enabled) or SPALM's search (enabled false), not both."""
    if knn is not None and spalm is not None:
        raise MemlmError("kNN-LM interpolation does not combine with memory mode spalm (it mixes by its gate)")
    if knn is not None or spalm is not None:
        request.knn.CopyFrom((knn or spalm).to_proto())


def _attribution(t: lm_pb2.TokenScore | lm_pb2.GeneratedToken) -> TokenAttribution | None:
    """The wire's TokenAttribution as memlm.retrieval.attribution's (None when the token has none)."""
    if not t.HasField("attribution"):
        return None
    a = t.attribution
    return TokenAttribution(a.knn_prob, tuple(DocumentShare(DocumentSource(d.doc_id, json.loads(d.meta_json or "{}")),
                                                            d.knn_mass, d.final_share) for d in a.documents),
                            a.datastore_generation)


def describe_attribution(a: TokenAttribution) -> str:
    """One line for people: p_kNN, then each document's id, its kNN mass and share of the final probability,
    and its title (else its metadata as key=value), shortened."""
    parts = [f"p_kNN {a.knn_prob:.3f}"]
    for d in a.documents:
        m = d.source.meta  # its title when it has one (sotu: "1999 State of the Union, William J. Clinton")
        meta = str(m["title"]) if "title" in m else " ".join(f"{k}={v}" for k, v in sorted(m.items()) if k != "text")
        meta = meta if len(meta) <= 60 else meta[:57] + "..."
        parts.append(f"{d.source.doc_id} mass {d.knn_mass:.3f} = {100 * d.final_share:.0f}% of p" + (f" [{meta}]" if meta else ""))
    return " | ".join(parts)


def _score_result(r: lm_pb2.SequenceScore, generations: tuple[int, ...] = ()) -> ScoreResult:
    tokens = tuple(
        ScoredToken(
            t.token_id, t.text, t.logprob, t.base_logprob, t.is_greedy,
            tuple(Alternative(a.token_id, a.text, a.logprob) for a in t.alternatives),
            t.gate if t.HasField("gate") else None, _attribution(t),
        )
        for t in r.tokens
    )
    return ScoreResult(tokens, r.total_logprob, r.base_total_logprob, r.perplexity, r.is_greedy, r.context_tokens,
                       generations, r.searches, r.searches_saved)


# ---------------------------------------------------------------------------------------------
# `memlm client score|generate`: typed entry points that print for people at a shell


def main_score(
    address: str,
    texts: Sequence[str],
    *,
    contexts: Sequence[str] | None = None,
    knn: KnnRequest | None = None,
    top_n: int = 0,
    window_tokens: int | None = None,
    stride_tokens: int | None = None,
    memory_mode: str | None = None,
    memory: MemoryRequest | None = None,
    spalm: SpalmRequest | None = None,
    per_token: bool = False,
    tls: ClientTls | None = None,
    token: str | None = None,
    timeout: float | None = 300.0,
    out: TextIO | None = None,
) -> list[ScoreResult]:
    """`memlm client score`: one line per text (tokens, log-likelihood, perplexity, greedy), with the
    base LM's perplexity beside it under kNN-LM; per_token adds a line per token (and its alternatives).
    out: where to print (None = sys.stdout at call time)."""
    out = out if out is not None else sys.stdout
    with LanguageModelClient(address, tls=tls, token=token, timeout=timeout) as client:
        results = client.score(texts, contexts=contexts, knn=knn, top_n=top_n, window_tokens=window_tokens,
                               stride_tokens=stride_tokens, memory_mode=memory_mode, memory=memory, spalm=spalm)
    header = f"{'#':>3} {'tokens':>7} {'logprob':>12} {'ppl':>10}"
    header += f" {'base ppl':>10} {'searches':>8} {'saved':>6}" if knn is not None else ""
    print(header + "  greedy  text", file=out)
    for i, (text, r) in enumerate(zip(texts, results)):
        line = f"{i:>3} {len(r.tokens):>7} {r.total_logprob:>12.3f} {r.perplexity:>10.3f}"
        line += f" {r.base_perplexity:>10.3f}" if knn is not None else ""
        line += f" {r.searches:>8} {r.searches_saved:>6}" if knn is not None else ""
        preview = text if len(text) <= 40 else text[:37] + "..."
        print(f"{line}  {'yes' if r.is_greedy else 'no':<6}  {preview!r}", file=out)
        if per_token or (knn is not None and knn.attribution_top_n):
            for t in r.tokens:
                alts = "  ".join(f"{a.text!r}:{a.logprob:.2f}" for a in t.alternatives)
                gate = f" gate {t.gate:.3f}" if t.gate is not None else ""
                print(f"      {t.token_id:>6} {t.text!r:<14} {t.logprob:>9.3f} {t.base_logprob:>9.3f} "
                      f"{'*' if t.is_greedy else ' '}{gate} {alts}", file=out)
                if t.attribution is not None:
                    print(f"             from {describe_attribution(t.attribution)}", file=out)
    if results and results[0].datastore_generations:
        print(f"datastore generation {', '.join(map(str, results[0].datastore_generations))}", file=out)
    return results


def main_generate(
    address: str,
    prompt: str,
    *,
    max_new_tokens: int = 64,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    knn: KnnRequest | None = None,
    memory_mode: str | None = None,
    memory: MemoryRequest | None = None,
    spalm: SpalmRequest | None = None,
    speculative: bool = False,
    draft_tokens: int | None = None,
    draft_from: str | None = None,
    tls: ClientTls | None = None,
    token: str | None = None,
    timeout: float | None = 300.0,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> Finish:
    """`memlm client generate`: print the prompt, then the continuation as it streams, then one line on
    stderr with the finish reason and token counts. out/err: None = sys.stdout/sys.stderr at call time."""
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    finish, attributed = None, []
    with LanguageModelClient(address, tls=tls, token=token, timeout=timeout) as client:
        print(prompt, end="", file=out, flush=True)
        for event in client.generate(prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                     top_p=top_p, seed=seed, stop=stop, knn=knn, memory_mode=memory_mode,
                                     memory=memory, spalm=spalm, speculative=speculative, draft_tokens=draft_tokens,
                                     draft_from=draft_from):
            if isinstance(event, TextDelta):
                print(event.text, end="", file=out, flush=True)
                attributed += [(t, a) for t, a in zip(event.texts, event.attributions) if a is not None]
            else:
                finish = event
    print(file=out, flush=True)
    for text, a in attributed:  # after the text, one line a generated token
        print(f"{text!r:<14} from {describe_attribution(a)}", file=out)
    if finish is None:
        raise MemlmError(f"{address}: the stream ended without a finish message")
    stop_note = f" ({finish.stop_sequence!r})" if finish.stop_sequence else ""
    generations = f"; datastore generation {', '.join(map(str, finish.datastore_generations))}" \
        if finish.datastore_generations else ""
    drafts = f"; searches {finish.searches}, searches_saved {finish.searches_saved}" if finish.searches else ""
    drafts += f", mean_accepted_tokens {finish.mean_accepted_tokens:.2f}" if speculative else ""
    print(f"[finish: {finish.reason}{stop_note}; prompt {finish.prompt_tokens} tokens, "
          f"generated {finish.completion_tokens}{generations}{drafts}]", file=err, flush=True)
    return finish
