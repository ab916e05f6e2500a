"""The OpenAI completions request, parsed and checked (services.openai_front.server): what a body may hold, the
front's limits, and the OpenAI-shaped errors. Field meanings are OpenAI's; memlm's extra
fields (top_k, knn, memory) are documented in services.openai_front.server."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.lm.client import MEMORY_MODES, KnnRequest, MemoryRequest

MAX_LOGPROBS = 5
"""OpenAI's bound on `logprobs` (alternatives per token)."""


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
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.kind, self.code = status, param, kind, code

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


# -- parsing ----------------------------------------------------------------------------------------


def _typed(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise ApiError(400, f"'{name}' must be {' or '.join(k.__name__ for k in kinds)}, got {value!r}", name)
    return value


def _prompts(body: dict[str, Any], limits: FrontLimits) -> list[str | list[int]]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt:
        prompts = list(prompt)
    else:
        raise ApiError(400, "'prompt' must be a string, a list of strings or a list of token ids", "prompt")
    if len(prompts) > limits.max_prompts:
        raise ApiError(400, f"'prompt' holds {len(prompts)} prompts, at most {limits.max_prompts}", "prompt")
    for p in prompts:
        ok = isinstance(p, str) or (isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p))
        if not ok:
            raise ApiError(400, "each prompt must be a string or a list of token ids", "prompt")
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
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    # No count bound here (OpenAI's is 4; lm-eval sends a task's `until` plus the end-of-text string): the LM
    # service bounds them (LMLimits.max_stop_sequences) and names the field.
    if not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, "'stop' must be a string or a list of non-empty strings", "stop")
    stream = _typed(body, "stream", (bool,), False)
    if stream and max_tokens == 0:
        raise ApiError(400, "'stream' needs max_tokens >= 1 (scoring answers at once)", "stream")
    mode, memory = _memory(body)
    knn, prompts = _knn(body), _prompts(body, limits)
    temperature, top_p = _typed(body, "temperature", (float, int)), _typed(body, "top_p", (float, int))
    top_k, seed = _typed(body, "top_k", (int,)), _typed(body, "seed", (int,))
    return [Completion(p, max_tokens, temperature, top_p, top_k, seed, stops, logprobs, echo, knn, mode, memory)
            for p in prompts], stream
