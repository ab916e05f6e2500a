"""The OpenAI completions request, decoded and checked (services.openai_front.server): what a body may hold,
the front's limits, and the OpenAI-shaped errors. Field meanings are OpenAI's; memlm's extra
fields (top_k, knn, memory) are documented in services.openai_front.server.

Every value is checked against what its gRPC field can carry (int32, uint64, UTF-8 text) before a request
is built, so a bad body is a 400 that names the field, never an error inside the protobuf library.
"""

from __future__ import annotations

import json
import math
import reprlib
from dataclasses import dataclass
from typing import Any

from services.lm.client import MEMORY_MODES, KnnRequest, MemoryRequest

MAX_LOGPROBS = 5
"""OpenAI's bound on `logprobs` (alternatives per token)."""
MAX_JSON_DEPTH = 32
"""Deepest nesting of arrays and objects in a body (a completions body nests three deep: prompt lists of
token-id lists); deeper is refused before any field is read."""
INT32 = (-(1 << 31), (1 << 31) - 1)
"""What an int32 field of the LM service's messages holds (every integer field but the seed)."""
UINT64 = (0, (1 << 64) - 1)
"""What the uint64 `seed` field holds."""
_JSON_INTS = (-(1 << 63), (1 << 64) - 1)
"""Integers a body may hold at all (int64 and uint64 together); any longer literal is refused unread."""
_QUOTE = reprlib.Repr()
_QUOTE.maxlevel, _QUOTE.maxstring, _QUOTE.maxother, _QUOTE.maxlist, _QUOTE.maxdict = 2, 40, 40, 4, 4


def _short(value: Any) -> str:
    """`value` as an error message quotes it: a few elements and characters, however big the value."""
    return _QUOTE.repr(value)


@dataclass(frozen=True)
class FrontLimits:
    """What one request may ask of the front (the LM service enforces its own limits beyond these)."""

    max_body_bytes: int = 4 << 20
    """Largest request body; 413 beyond."""
    max_prompts: int = 64
    """Prompts per request (a list prompt); 400 beyond."""
    max_tokens: int = 4096
    """Largest max_tokens; 400 beyond."""


class ApiError(Exception):
    """A request the front refuses: HTTP status and an OpenAI-shaped error body."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, close: bool = False) -> None:
        super().__init__(message)
        self.status, self.param, self.kind, self.code = status, param, kind, code
        self.close = close
        """The connection ends after this answer (a body refused before it was read in full)."""

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Completion:
    """One parsed /v1/completions request (for one prompt of a list)."""

    prompt: str | list[int]
    """Text, or token ids (as lm-eval's local-completions sends them)."""
    max_tokens: int
    """Tokens to generate; 0 (with echo) only scores the prompt."""
    temperature: float | None
    """Sampling temperature; None = the LM service's default."""
    top_p: float | None
    """Nucleus mass in (0, 1]; None = no nucleus filter."""
    top_k: int | None
    """memlm's extra field: sample among the top_k tokens; None = no limit."""
    seed: int | None
    """Sampler seed (the same seed, the same tokens); None = a fresh one."""
    stop: tuple[str, ...]
    """Stop strings; the text ends before the first one found."""
    logprobs: int | None
    """Alternatives per token in the logprobs object (0..MAX_LOGPROBS); None = no logprobs object."""
    echo: bool
    """The prompt is part of the choice's text (and of its logprobs: Score's log-probs)."""
    knn: KnnRequest | None
    """kNN-LM options (the extra field "knn"); None = the base LM."""
    memory_mode: str | None
    """memlm's memory mode (extra field memory.mode); None = the LM service's default."""
    memory: MemoryRequest | None
    """Segment and memory sizes (extra field "memory"); None = the LM service's defaults."""


# -- decoding -----------------------------------------------------------------------------------------


def _json_int(text: str) -> int:
    digits = len(text) - text.startswith("-")
    value = int(text) if digits <= 20 else None  # int() of a long literal is quadratic: refuse it unread
    if value is None or not _JSON_INTS[0] <= value <= _JSON_INTS[1]:
        raise ApiError(400, f"the integer {text[:24]}{'...' if len(text) > 24 else ''} is out of range "
                       f"(a body's integers are within [{_JSON_INTS[0]}, {_JSON_INTS[1]}])")
    return value


def _json_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ApiError(400, f"the number {text[:24]} is out of range (not a finite float)")
    return value


def _json_constant(name: str) -> Any:
    raise ApiError(400, f"{name} is not JSON (numbers must be finite)")


def _nesting_within(value: Any, limit: int) -> bool:
    """Whether `value` nests arrays and objects at most `limit` deep (without recursion)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > limit:
            return False
        children = v.values() if isinstance(v, dict) else v
        stack.extend((c, depth + 1) for c in children if isinstance(c, (list, dict)))
    return True


def decode_json(data: bytes) -> Any:
    """The JSON value of a request body; ApiError 400 when it is not JSON (UTF-8), nests deeper than
    MAX_JSON_DEPTH, or holds a non-finite number or an integer outside int64/uint64."""
    if not data.strip():
        raise ApiError(400, "the request body is empty (a JSON object is expected)")
    try:
        value = json.loads(data, parse_int=_json_int, parse_float=_json_float, parse_constant=_json_constant)
    except RecursionError:  # the decoder's own nesting limit, far beyond MAX_JSON_DEPTH
        raise ApiError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not JSON ({e})") from None
    if isinstance(value, (list, dict)) and not _nesting_within(value, MAX_JSON_DEPTH):
        raise ApiError(400, f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
    return value


# -- parsing ----------------------------------------------------------------------------------------


def _typed(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any = None,
           bounds: tuple[int, int] = INT32) -> Any:
    """body[name] if it is one of `kinds` (an integer within `bounds`: what its gRPC field holds), else
    `default` when it is absent or null; ApiError 400 naming the field otherwise."""
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise ApiError(400, f"'{name}' must be {' or '.join(k.__name__ for k in kinds)}, got {_short(value)}", name)
    if isinstance(value, int) and not isinstance(value, bool) and float not in kinds \
            and not bounds[0] <= value <= bounds[1]:
        raise ApiError(400, f"'{name}' must be in [{bounds[0]}, {bounds[1]}], got {value}", name)
    return value


def _text(value: str, name: str) -> str:
    """`value` if it is valid Unicode text (JSON's \\ud800 escapes can make lone surrogates, which no UTF-8
    message can carry)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"'{name}' holds a lone surrogate (not UTF-8 text)", name) from None
    return value


def _token_ids(value: Any) -> bool:
    """Whether `value` is a non-empty list of token ids, each a non-negative int32."""
    return (isinstance(value, list) and bool(value) and all(type(t) is int for t in value)
            and min(value) >= 0 and max(value) <= INT32[1])


def _prompts(body: dict[str, Any], limits: FrontLimits) -> list[str | list[int]]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = list(prompt)
    else:
        raise ApiError(400, "'prompt' must be a string, a list of strings or a list of token ids", "prompt")
    if len(prompts) > limits.max_prompts:
        raise ApiError(400, f"'prompt' holds {len(prompts)} prompts, at most {limits.max_prompts}", "prompt")
    for p in prompts:
        if isinstance(p, str):
            _text(p, "prompt")
        elif not _token_ids(p):
            raise ApiError(400, f"each prompt must be a string or a non-empty list of token ids in [0, {INT32[1]}]",
                           "prompt")
    return prompts


def _knn(body: dict[str, Any]) -> KnnRequest | None:
    knn = _typed(body, "knn", (dict,))
    if knn is None:
        return None
    unknown = set(knn) - {"lambda", "temperature", "k", "nprobe"}
    if unknown:
        raise ApiError(400, f"unknown 'knn' field {min(unknown)!r} (lambda, temperature, k, nprobe)", "knn")
    return KnnRequest(lmbda=_typed(knn, "lambda", (float, int)), temperature=_typed(knn, "temperature", (float, int)),
                      k=_typed(knn, "k", (int,)), nprobe=_typed(knn, "nprobe", (int,)))


def _memory(body: dict[str, Any]) -> tuple[str | None, MemoryRequest | None]:
    memory = _typed(body, "memory", (dict,))
    if memory is None:
        return None, None
    sizes = ("segment_tokens", "memory_tokens", "sink_tokens", "knn_mem_size", "knn_top_k")
    unknown = set(memory) - {"mode", *sizes}
    if unknown:
        raise ApiError(400, f"unknown 'memory' field {min(unknown)!r} (mode, {', '.join(sizes)})", "memory")
    mode = _typed(memory, "mode", (str,))
    if mode is not None and mode not in MEMORY_MODES:
        raise ApiError(400, f"'memory.mode' must be one of {', '.join(MEMORY_MODES)}, got {mode!r}", "memory")
    return mode, MemoryRequest(**{s: _typed(memory, s, (int,)) for s in sizes})


def parse_completion(body: Any, limits: FrontLimits) -> tuple[list[Completion], bool]:
    """The Completions of a /v1/completions body (one per prompt) and whether it streams; ApiError when refused."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _typed(body, "model", (str,))  # which model is served is the server's check
    if _typed(body, "n", (int,), 1) != 1:
        raise ApiError(400, "'n' must be 1 (memlm generates one completion per prompt)", "n")
    if _typed(body, "best_of", (int,), 1) != 1:
        raise ApiError(400, "'best_of' must be 1", "best_of")
    max_tokens = _typed(body, "max_tokens", (int,), 16)
    echo = _typed(body, "echo", (bool,), False)
    if not 0 <= max_tokens <= limits.max_tokens or (max_tokens == 0 and not echo):
        raise ApiError(400, f"'max_tokens' must be in [1, {limits.max_tokens}] (0 only with echo), got {max_tokens}",
                       "max_tokens")
    logprobs = _typed(body, "logprobs", (int,))
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise ApiError(400, f"'logprobs' must be in [0, {MAX_LOGPROBS}], got {logprobs}", "logprobs")
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else () if stop is None else None
    # No count bound here (OpenAI's is 4; lm-eval sends a task's `until` plus the end-of-text string): the LM
    # service bounds them (LMLimits.max_stop_sequences) and names the field.
    if stops is None or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, "'stop' must be a string or a list of non-empty strings", "stop")
    for s in stops:
        _text(s, "stop")
    stream = _typed(body, "stream", (bool,), False)
    if stream and max_tokens == 0:
        raise ApiError(400, "'stream' needs max_tokens >= 1 (scoring answers at once)", "stream")
    mode, memory = _memory(body)
    knn, prompts = _knn(body), _prompts(body, limits)
    temperature, top_p = _typed(body, "temperature", (float, int)), _typed(body, "top_p", (float, int))
    top_k, seed = _typed(body, "top_k", (int,)), _typed(body, "seed", (int,), bounds=UINT64)
    return [Completion(p, max_tokens, temperature, top_p, top_k, seed, stops, logprobs, echo, knn, mode, memory)
            for p in prompts], stream
