"""LanguageModelService request parsing: a ScoreRequest / GenerateRequest becomes typed library arguments.

Every check raises `InvalidRequest(field, message, code)`, which `services.common.server` turns into a
status whose message starts with the field's name: INVALID_ARGUMENT for a value outside its domain,
OUT_OF_RANGE for one past a limit of `LMLimits` (what GetInfo reports), FAILED_PRECONDITION for kNN-LM
on a server without a datastore, UNIMPLEMENTED for a memory mode the server does not serve (naming what
it lacks). Nothing here runs the model; the servicer (services.lm.servicer) runs what the parser returns, and
services.lm.results.encode_score turns the library's scores into the response.

Every request's cost is bounded here, before any work: the characters of its texts before
tokenizing (`max_text_chars`), a Score's forward work (`max_forward_tokens`: the sum over its windows of
their length, priced in closed form by memlm.jobs.windows.window_cost) and its response (`max_score_entries`,
and an upper bound of its bytes against the server's message limit). A Generate's work is bounded by its
prompt (`max_score_tokens`) and `max_new_tokens`, and admission to the engine's batches by `max_batch`,
`max_queue` and the tokens in flight that `max_kv_bytes` holds (services.lm.engine). Token-id arrays are
length-checked before any element is read and range-checked at once; stop sequences are bounded in number and
characters (`max_stop_sequences`, `max_stop_chars`), knn.nprobe by `max_nprobe`.

Every forward STEP is bounded too (`max_step_tokens`): the model's turn passes between steps
(services.lm.scheduler), so one step is the longest a call waits for the call ahead of it and the longest a
cancelled call keeps the model. A Score step holds `step_rows` windows (segments) of at most
`max_step_tokens` tokens together; a window or segment longer than one step is refused, since the library
cannot split one forward pass. A Generate prompt is prefilled by the engine in chunks of max_step_tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import grpc
import numpy as np
import torch

from memlm.engine.kv_cache import kv_bytes_per_token
from memlm.engine.requests import EngineConfig
from memlm.jobs.decoding import SamplingConfig
from memlm.jobs.windows import WindowConfig, window_cost
from memlm.model.config import ModelConfig
from memlm.model.memory_config import EXACT_MAX_ENTRIES, MemoryConfig
from memlm.model.tokenizer import Tokenizer
from memlm.retrieval.attribution import MAX_ATTRIBUTION
from memlm.retrieval.knnlm import KNNLMConfig
from memlm.v1 import language_model_pb2 as lm_pb2
from services.lm.args import (
    NO_FEWER,
    FewerSources,
    GenerateArgs,
    ScoreArgs,
    generate_retrieval_of,
    refuse_fewer,
    retrieval_of,
    speculative_of,
)
from services.lm.spalm import SpalmSearch, check_search, parse_spalm_search
from services.common.server import InvalidRequest
from services.retrieval.server import MAX_NPROBE

SUPPORTED_MEMORY_MODES = (lm_pb2.MEMORY_MODE_NONE, lm_pb2.MEMORY_MODE_XL, lm_pb2.MEMORY_MODE_COMPRESSIVE)
"""What every server serves (COMPRESSIVE with mean pooling: no trained compressor); MEMORY_MODE_MEMORIZING besides with a memorizing checkpoint's KnnAttention,
MEMORY_MODE_SPALM with a SPALM checkpoint's head and a kNN source."""
DEFAULT_MEMORY_MODE = lm_pb2.MEMORY_MODE_NONE
"""What MEMORY_MODE_UNSPECIFIED means (GetInfo.default_memory_mode)."""
OUT_OF_RANGE = grpc.StatusCode.OUT_OF_RANGE
TOKEN_SCORE_BYTES = 32
"""Upper bound of one encoded TokenScore's bytes besides its text and alternatives (tags, lengths, varints, floats)."""
ALTERNATIVE_BYTES = 24
"""Upper bound of one encoded TokenAlternative's bytes besides its text."""
SEQUENCE_BYTES = 64
"""Upper bound of one encoded SequenceScore's bytes besides its tokens."""


@dataclass(frozen=True)
class LMLimits:
    """What one request may ask for (the answers of GetInfo)."""

    max_score_tokens: int = 65536
    """Longest sequence Score (boundary + context + continuation) or a Generate prompt may have, in tokens."""
    max_score_batch: int = 64
    """Most inputs in one ScoreRequest or texts in one TokenizeRequest."""
    max_new_tokens: int = 4096
    """Largest max_new_tokens of a GenerateRequest."""
    max_top_n: int = 20
    """Largest ScoreRequest.top_n."""
    max_k: int = 4096
    """Largest knn.k: kNN-LM's neighbours, or MEMORY_MODE_SPALM's per token."""
    max_stop_sequences: int = 16
    """Most stop sequences in one GenerateRequest."""
    max_stop_chars: int = 4096
    """Most characters of all stop sequences of one GenerateRequest together (each is searched for in the
    generated text after every token)."""
    max_nprobe: int = MAX_NPROBE
    """Largest knn.nprobe (services.retrieval.server.MAX_NPROBE)."""
    score_batch_size: int = 4
    """Windows (NONE) or sequences side by side (XL) per forward pass while scoring (as `memlm eval --batch-size`)."""
    segment_tokens: int = MemoryConfig.segment
    """MEMORY_MODE_XL segment length where a request leaves it unset, in tokens (`memlm eval --segment`);
    capped at the model's context."""
    memory_tokens: int = MemoryConfig.mem_len
    """MEMORY_MODE_XL memory length (states per layer) where a request leaves it unset (`memlm eval --mem-len`)."""
    sink_tokens: int = MemoryConfig.sink_tokens
    """MEMORY_MODE_XL sink tokens where a request leaves it unset (`memlm eval --sink-tokens`)."""
    compressed_memory_tokens: int = 256
    """MEMORY_MODE_COMPRESSIVE compressed-memory slots per layer where a request leaves it unset: at the
    default rate of 4 they summarise as many older states again as the default memory holds (1024)."""
    compression_rate: int = MemoryConfig.compress_rate
    """MEMORY_MODE_COMPRESSIVE states per compressed slot where a request leaves it unset."""
    max_memory_tokens: int = 65536
    """Largest memory_tokens, sink_tokens, compressed_memory_tokens or compression_rate a request may ask for."""
    knn_layer: int | None = MemoryConfig.knn_layer
    """MEMORY_MODE_MEMORIZING: the memorizing layer, the one its KnnAttention was trained at (a checkpoint's
    settings); None = memlm.model.memory_config.memorizing_layer's default (three quarters up)."""
    knn_mem_size: int = MemoryConfig.knn_mem_size
    """MEMORY_MODE_MEMORIZING kNN memory entries per (sequence, kv head) where a request leaves it unset."""
    knn_top_k: int = MemoryConfig.knn_top_k
    """MEMORY_MODE_MEMORIZING pairs retrieved per query and head where a request leaves it unset."""
    knn_backend: str = MemoryConfig.knn_backend
    """MEMORY_MODE_MEMORIZING's kNN memory backend (MemoryConfig.knn_backend; "service": `serve lm --knn-service`)."""
    max_knn_mem_size: int = EXACT_MAX_ENTRIES
    """Largest knn_mem_size a request may ask for; the memory grows with the sequence, never past its tokens."""
    max_knn_top_k: int = 256
    """Largest knn_top_k a request may ask for."""
    max_forward_tokens: int = 1 << 18
    """Most forward work one ScoreRequest may cost: the sum over all its windows of their length in tokens
    (MEMORY_MODE_XL: boundary + context + continuation of each input, every position runs once). The
    default lets one 65536-token input run at the default stride (half the window), about twice its length."""
    max_score_entries: int = 1 << 20
    """Most entries one ScoreResponse may hold: scored tokens x (1 + top_n); bounds the server's memory."""
    max_text_chars: int = 1 << 20
    """Most characters of text in one request, all its text fields together (Tokenize's texts, Score's
    texts and contexts, a Generate prompt): tokenizing is work with the model's turn too."""
    max_step_tokens: int = 1024
    """Most input tokens of one forward step (a Score batch: windows or segment rows x their length; a
    Generate prompt's encoding; a segment). Concurrent calls interleave step by step, so this bounds how long
    a call waits for each call ahead of it and how long a cancelled call keeps the model: about 2 s for
    SmolLM2-135M on 2 CPU cores (~480 tokens/s), milliseconds on a GPU. The default admits the default
    1024-token window; MEMORY_MODE_XL memory states are attended besides (they are no inputs)."""
    max_batch: int = EngineConfig.max_batch
    """Rows decoded together in one engine step (Generate calls, engine Score inputs: rows of one running batch,
    services.lm.engine)."""
    max_queue: int = EngineConfig.max_queue
    """Requests waiting for a row of a batch; one more is refused with RESOURCE_EXHAUSTED and a retry hint (a Score
    over it waits for its own rows instead, services.lm.score_engine)."""
    max_kv_bytes: int = 4 << 30
    """KV cache bytes the tokens in flight may take (--max-kv-bytes): the engine's in-flight budget is the tokens
    whose keys and values fit in it (`tokens_in_flight`; 4 GiB: about 93K SmolLM2-135M tokens in float32)."""
    cuda_graphs: bool = EngineConfig.cuda_graphs
    """Generate batches of the plain KV cache (MEMORY_MODE_NONE) decode in fixed-shape steps, a CUDA graph per row
    bucket on a GPU (EngineConfig.cuda_graphs, memlm.engine.decode_graphs)."""

    def tokens_in_flight(self, config: ModelConfig, dtype: torch.dtype) -> int:
        """Prompt + max_new_tokens summed over every running and waiting Generate call, plus the tokens engine Score
        requests read, that max_kv_bytes holds for this model (memlm.engine.kv_cache.kv_bytes_per_token); beyond,
        RESOURCE_EXHAUSTED."""
        return max(1, self.max_kv_bytes // kv_bytes_per_token(config, dtype))

    def step_rows(self, tokens: int) -> int:
        """Windows (or segment rows) of `tokens` tokens per forward step: score_batch_size, fewer when
        max_step_tokens says so, at least 1 (the parser refuses a window over max_step_tokens)."""
        return max(1, min(self.score_batch_size, self.max_step_tokens // max(1, tokens)))


_ONEOF = {"context_text": "context", "text": "continuation"}
"""The ScoreInput oneof each text field belongs to."""


class RequestParser:
    """Checks requests against one loaded model and the server's limits.

    vocab: valid token ids are [0, vocab); max_len: the model's context in tokens; knn_refusal: why kNN-LM
    is not served (FAILED_PRECONDITION; services.lm.spalm.knn_refusal), None: it is; knn_defaults: what a request's unset kNN fields take; datastore_windows: the
    (context, stride) the searcher's keys were made with, which a Score request's unset window takes and
    which a kNN-LM Score request's given window must equal (memlm.retrieval.compat's rule for an
    artifact's settings; None: WindowConfig's defaults). piece_bytes: the UTF-8 length of each token id's
    text as responses carry it; max_response_bytes: the largest message the server may send;
    memorizing: whether MEMORY_MODE_MEMORIZING is served (the server holds a KnnAttention). spalm_missing:
    what the server lacks to serve MEMORY_MODE_SPALM (a SPALM head, a kNN source); empty: served.
    tokens_in_flight: LMLimits.tokens_in_flight for the served model (a Generate that alone needs more is refused).
    """

    def __init__(self, *, tokenizer: Tokenizer, vocab: int, max_len: int, limits: LMLimits,
                 knn_defaults: KNNLMConfig, knn_refusal: str | None, piece_bytes: list[int], max_response_bytes: int,
                 datastore_windows: tuple[int, int] | None = None, memorizing: bool = False,
                 spalm_missing: tuple[str, ...], attribution_refusal: str | None = None,
                 in_row_cache: Callable[[MemoryConfig | None], bool] = lambda memory: True,
                 fewer: FewerSources = NO_FEWER, tokens_in_flight: int) -> None:
        self._tokenizer = tokenizer
        self._piece_bytes = piece_bytes
        self._longest_piece = max(piece_bytes, default=0)
        self._max_response_bytes = max_response_bytes
        self._vocab = vocab
        self._max_len = max_len
        self._limits = limits
        self._knn_defaults = knn_defaults
        self._knn_refusal = knn_refusal
        self._attribution_refusal = attribution_refusal  # services.lm.results.attribution_refusal
        # services.lm.engine.in_row_cache for the server's model: Generate attributes, drafts and walks pointers there
        self._in_row_cache = in_row_cache
        self._spalm_missing = spalm_missing
        self._windows = datastore_windows
        self._fewer = fewer  # the gate and successors fewer-search Score requests use (services.lm.args)
        self._tokens_in_flight = tokens_in_flight
        self.default_memory = lm_pb2.MemoryOptions(
            segment_tokens=min(limits.segment_tokens, max_len), memory_tokens=limits.memory_tokens,
            sink_tokens=limits.sink_tokens, knn_mem_size=limits.knn_mem_size, knn_top_k=limits.knn_top_k,
            compressed_memory_tokens=limits.compressed_memory_tokens, compression_rate=limits.compression_rate,
        )
        """The sizes a MEMORY_MODE_XL / COMPRESSIVE / MEMORIZING request leaves unset take (GetInfo.default_memory)."""
        self.memory_modes = SUPPORTED_MEMORY_MODES + ((lm_pb2.MEMORY_MODE_MEMORIZING,) if memorizing else ()) + (
            () if spalm_missing else (lm_pb2.MEMORY_MODE_SPALM,))
        """The memory modes served (GetInfo.memory_modes)."""

    def info_response(self, *, model: str, model_fingerprint: str,
                      knn_layer: int | None) -> lm_pb2.LanguageModelServiceGetInfoResponse:
        """GetInfo's answer (without the datastore): the model, the limits, the memory modes and defaults;
        knn_layer: the memorizing layer when MEMORIZING is served."""
        limits = self._limits
        response = lm_pb2.LanguageModelServiceGetInfoResponse(
            model=model, model_fingerprint=model_fingerprint, tokenizer_fingerprint=self._tokenizer.fingerprint,
            vocab_size=self._vocab, context_length=self._max_len, memory_modes=self.memory_modes,
            default_memory_mode=DEFAULT_MEMORY_MODE, default_memory=self.default_memory,
            max_memory_tokens=limits.max_memory_tokens, max_score_tokens=limits.max_score_tokens,
            max_score_batch=limits.max_score_batch, max_new_tokens=limits.max_new_tokens,
            max_message_bytes=self._max_response_bytes, max_forward_tokens=limits.max_forward_tokens,
            max_score_entries=limits.max_score_entries, max_text_chars=limits.max_text_chars,
            max_step_tokens=limits.max_step_tokens, max_knn_mem_size=limits.max_knn_mem_size,
            max_knn_top_k=limits.max_knn_top_k, max_batch=limits.max_batch, max_queue=limits.max_queue,
            max_tokens_in_flight=self._tokens_in_flight, max_kv_bytes=limits.max_kv_bytes, max_nprobe=limits.max_nprobe,
            max_stop_sequences=limits.max_stop_sequences, max_stop_chars=limits.max_stop_chars,
        )
        if knn_layer is not None:
            response.knn_layer = knn_layer
        return response

    def ids(self, ids, field: str) -> list[int]:
        """A request's token ids: the length checked first (against max_score_tokens, before any element is
        read), then every id's range at once (numpy); OUT_OF_RANGE / INVALID_ARGUMENT naming the field."""
        if len(ids) >= self._limits.max_score_tokens:  # with the boundary token, over the longest sequence
            raise InvalidRequest(field, f"{len(ids)} token ids, at most {self._limits.max_score_tokens - 1}",
                                 OUT_OF_RANGE)
        arr = np.array(ids, dtype=np.int64)  # (n,): int32 on the wire, exact in int64
        bad = np.flatnonzero((arr < 0) | (arr >= self._vocab))
        if bad.size:
            j = int(bad[0])
            raise InvalidRequest(f"{field}[{j}]", f"token id {int(arr[j])} outside [0, {self._vocab})")
        return arr.tolist()

    def text_budget(self, texts: list[str], field: str) -> None:
        """Refuse a request whose texts together exceed max_text_chars, before any of them is tokenized
        (30 MB of text would hold the model thread for 44 s)."""
        chars = sum(len(t) for t in texts)
        if chars > self._limits.max_text_chars:
            raise InvalidRequest(field, f"{chars} characters of text in one request, at most max_text_chars "
                                        f"{self._limits.max_text_chars}", OUT_OF_RANGE)

    def text(self, text: str, field: str) -> list[int]:
        """Token ids of a text whose length text_budget has already bounded."""
        return self._tokenizer.encode(text)

    def batch_size(self, n: int, field: str) -> None:
        if n == 0:
            raise InvalidRequest(field, "empty batch: send at least one")
        if n > self._limits.max_score_batch:
            raise InvalidRequest(field, f"{n} entries, at most {self._limits.max_score_batch}", OUT_OF_RANGE)

    def memory(self, request: lm_pb2.ScoreRequest | lm_pb2.GenerateRequest) -> MemoryConfig | None:
        """The request's memory, or None for MEMORY_MODE_NONE."""
        mode = request.memory_mode
        if mode == lm_pb2.MEMORY_MODE_UNSPECIFIED:
            mode = DEFAULT_MEMORY_MODE
        if mode not in lm_pb2.MemoryMode.values():
            raise InvalidRequest("memory_mode", f"unknown value {mode}")
        if mode not in self.memory_modes:
            supported = ", ".join(lm_pb2.MemoryMode.Name(m) for m in self.memory_modes)
            why = {lm_pb2.MEMORY_MODE_MEMORIZING: " (MEMORIZING needs a server started with a memorizing checkpoint)",
                   lm_pb2.MEMORY_MODE_SPALM: f" (SPALM needs {' and '.join(self._spalm_missing)})"}.get(mode, "")
            raise InvalidRequest(
                "memory_mode",
                f"{lm_pb2.MemoryMode.Name(mode)} is not served by this server (supported: {supported}){why}",
                grpc.StatusCode.UNIMPLEMENTED,
            )
        if mode == lm_pb2.MEMORY_MODE_NONE:
            return None
        o, d = request.memory, self.default_memory
        segment = o.segment_tokens if o.HasField("segment_tokens") else d.segment_tokens
        if not 1 <= segment <= self._max_len:
            raise InvalidRequest("memory.segment_tokens",
                                 f"{segment}, must be in [1, {self._max_len}] (the model's context)")
        limits = self._limits
        sizes = {}
        for name, low, high in (("memory_tokens", 0, limits.max_memory_tokens),
                                ("sink_tokens", 0, limits.max_memory_tokens),
                                ("knn_mem_size", 1, limits.max_knn_mem_size), ("knn_top_k", 1, limits.max_knn_top_k),
                                ("compressed_memory_tokens", 0, limits.max_memory_tokens),
                                ("compression_rate", 1, limits.max_memory_tokens)):
            value = getattr(o, name) if o.HasField(name) else getattr(d, name)
            if value < low:
                raise InvalidRequest(f"memory.{name}", f"{value}, must be >= {low}")
            if value > high:
                raise InvalidRequest(f"memory.{name}", f"{value}, at most {high}", OUT_OF_RANGE)
            sizes[name] = value
        self.step_budget(segment, "memory.segment_tokens")
        xl = MemoryConfig("xl", mem_len=sizes["memory_tokens"], sink_tokens=sizes["sink_tokens"], segment=segment)
        if mode == lm_pb2.MEMORY_MODE_XL:
            return xl
        if mode == lm_pb2.MEMORY_MODE_COMPRESSIVE:  # pooled (MemoryConfig.compress_fn's default): no trained conv
            return replace(xl, kind="compressive", cmem_len=sizes["compressed_memory_tokens"],
                           compress_rate=sizes["compression_rate"])
        if mode == lm_pb2.MEMORY_MODE_SPALM:  # the XL memory is SPALM's short-term memory
            return replace(xl, kind="spalm")
        return replace(xl, kind="memorizing", knn_layer=limits.knn_layer, knn_mem_size=sizes["knn_mem_size"],
                       knn_top_k=sizes["knn_top_k"], knn_backend=limits.knn_backend)

    def step_budget(self, tokens: int, field: str, what: str = "") -> None:
        """Refuse one forward pass of more than max_step_tokens input tokens (it cannot be split)."""
        if tokens > self._limits.max_step_tokens:
            raise InvalidRequest(field, f"{what}{tokens} tokens in one forward step, at most max_step_tokens "
                                        f"{self._limits.max_step_tokens}", OUT_OF_RANGE)

    def spalm(self, request: lm_pb2.ScoreRequest | lm_pb2.GenerateRequest,
              memory: MemoryConfig | None) -> SpalmSearch | None:
        """MEMORY_MODE_SPALM's search (services.lm.spalm.parse_spalm_search), None in other modes."""
        if memory is None or memory.kind != "spalm":
            return None
        return parse_spalm_search(request.knn, self._knn_defaults, self._limits.max_k, self._limits.max_nprobe)

    def knn(self, request: lm_pb2.ScoreRequest | lm_pb2.GenerateRequest) -> KNNLMConfig | None:
        if not request.HasField("knn") or not request.knn.enabled:
            return None
        o = request.knn
        if self._knn_refusal is not None:
            raise InvalidRequest("knn.enabled", self._knn_refusal, grpc.StatusCode.FAILED_PRECONDITION)
        d = self._knn_defaults
        lmbda = o.lambda_weight if o.HasField("lambda_weight") else d.lmbda
        temperature = o.temperature if o.HasField("temperature") else d.temperature
        k = o.k if o.HasField("k") else d.k
        nprobe = o.nprobe if o.HasField("nprobe") else d.nprobe
        if lmbda is None or not (math.isfinite(lmbda) and 0.0 <= lmbda <= 1.0):
            raise InvalidRequest("knn.lambda_weight", f"{lmbda}, must be in [0, 1]")
        if temperature is None or not (math.isfinite(temperature) and temperature > 0):
            raise InvalidRequest("knn.temperature", f"{temperature}, must be a finite number > 0")
        check_search(k, nprobe, self._limits.max_k, self._limits.max_nprobe)
        # The server's saved interpolation mixes unless the request names its own constant lambda or T.
        served = None if o.HasField("lambda_weight") or o.HasField("temperature") else d.interpolation
        if served is not None and int(k) != d.k:
            raise InvalidRequest("knn.k", f"{k}: the server's interpolation was fitted with k {d.k}; set lambda_weight "
                                 "and temperature for a constant mixture at another k")
        return replace(d, k=int(k), lmbda=float(lmbda), temperature=float(temperature), nprobe=nprobe,
                       interpolation=served)

    def attribution(self, request: lm_pb2.ScoreRequest | lm_pb2.GenerateRequest, knn: KNNLMConfig | None) -> int:
        """KnnOptions.attribution_top_n checked: 0 (none), or 1 to MAX_ATTRIBUTION documents a token with kNN-LM."""
        n, field = request.knn.attribution_top_n, "knn.attribution_top_n"
        if n != 0 and knn is None:
            raise InvalidRequest(field, "needs knn.enabled: the documents are those of the kNN-LM neighbours")
        if n != 0 and knn.interpolation is not None:  # attribution splits one constant lambda's mixture
            raise InvalidRequest(field, "attributes a constant mixture: set lambda_weight and temperature with it")
        if n != 0 and self._attribution_refusal is not None:
            raise InvalidRequest(field, self._attribution_refusal, grpc.StatusCode.FAILED_PRECONDITION)
        if not 0 <= n <= MAX_ATTRIBUTION:
            raise InvalidRequest(field, f"{n}, must be in [0, {MAX_ATTRIBUTION}]", OUT_OF_RANGE)
        return n

    def _score_input(self, item: lm_pb2.ScoreInput, field: str) -> tuple[list[int], list[int]]:
        """One input's (context, continuation) token ids."""
        which = item.WhichOneof("context")
        if which == "context_text":
            ctx = self.text(item.context_text, f"{field}.context_text")
        elif which == "context_token_ids":
            ctx = self.ids(item.context_token_ids.ids, f"{field}.context_token_ids.ids")
        else:
            ctx = []
        which = item.WhichOneof("continuation")
        if which == "text":
            cont = self.text(item.text, f"{field}.text")
        elif which == "token_ids":
            cont = self.ids(item.token_ids.ids, f"{field}.token_ids.ids")
        else:
            raise InvalidRequest(f"{field}.continuation", "missing: set text or token_ids")
        total = 1 + len(ctx) + len(cont)
        if total > self._limits.max_score_tokens:
            raise InvalidRequest(
                field, f"{total} tokens (boundary + context + continuation), at most {self._limits.max_score_tokens}",
                OUT_OF_RANGE,
            )
        return ctx, cont

    def score(self, request: lm_pb2.ScoreRequest) -> ScoreArgs:
        self.batch_size(len(request.inputs), "inputs")
        memory = self.memory(request)
        if not 0 <= request.top_n <= self._limits.max_top_n:
            raise InvalidRequest("top_n", f"{request.top_n}, must be in [0, {self._limits.max_top_n}]")
        given_window = request.window_tokens if request.HasField("window_tokens") else None
        given_stride = request.stride_tokens if request.HasField("stride_tokens") else None
        if self._windows is not None and given_window in (None, self._windows[0]):
            window, stride = self._windows[0], self._windows[1] if given_stride is None else given_stride
        else:
            windows = WindowConfig.for_model(self._max_len, given_window, given_stride)
            window, stride = windows.context, windows.stride
        if not 1 <= window <= self._max_len:
            raise InvalidRequest("window_tokens", f"{window}, must be in [1, {self._max_len}] (the model's context)")
        if not 1 <= stride <= window:
            raise InvalidRequest("stride_tokens", f"{stride}, must be in [1, window_tokens = {window}]")
        spalm = self.spalm(request, memory)
        knn = self.knn(request)
        if knn is not None and self._windows is not None:
            # The one settings rule (memlm.retrieval.compat): kNN-LM queries must be made like the
            # datastore's keys; a window left unset takes the datastore's, a different one is refused.
            for name, given, recorded in (("window_tokens", given_window, self._windows[0]),
                                          ("stride_tokens", given_stride, self._windows[1])):
                if given is not None and given != recorded:
                    raise InvalidRequest(name, f"{given} differs from the datastore's {recorded}; leave it unset "
                                               "to use the datastore's (kNN-LM queries are made like its keys)")
        self.text_budget([getattr(item, name) for item in request.inputs for name in ("context_text", "text")
                          if item.WhichOneof(_ONEOF[name]) == name], "inputs")
        pairs = [self._score_input(item, f"inputs[{i}]") for i, item in enumerate(request.inputs)]
        self._score_cost(pairs, window, stride, memory, request.top_n)
        if memory is None:  # a window is as long as its input allows: a short input at a long window is short
            step = min(window, max(len(ctx) + len(cont) for ctx, cont in pairs))
            self.step_budget(step, "window_tokens")
        else:
            step = memory.segment
        attribution = self.attribution(request, knn)
        return ScoreArgs(token_seqs=[cont for _, cont in pairs], contexts=[ctx for ctx, _ in pairs], context=window,
                         stride=stride, knn=knn, top_n=request.top_n, memory=memory, spalm=spalm,
                         batch_size=self._limits.step_rows(step), attribution=attribution,
                         retrieval=retrieval_of(request.knn, knn, memory, attribution, self._fewer))

    def _score_cost(self, pairs: list[tuple[list[int], list[int]]], window: int, stride: int,
                    memory: MemoryConfig | None, top_n: int) -> None:
        """Refuse a Score whose forward work or response is over the limits, before any of it runs."""
        limits = self._limits
        forward = 0
        for ctx, cont in pairs:
            if not cont:
                continue  # nothing to score: never run
            if memory is None:  # sliding windows over boundary + context + continuation (inputs: all but the last)
                forward += window_cost(len(ctx) + len(cont), len(ctx), window, stride).forward_tokens
            else:  # segments: every position runs once
                forward += 1 + len(ctx) + len(cont)
        if forward > limits.max_forward_tokens:
            how = f"window_tokens {window}, stride_tokens {stride}" if memory is None else f"memory mode {memory.kind}"
            raise InvalidRequest("inputs", f"{forward} forward tokens (the sum of all window lengths at {how}), at "
                                           f"most max_forward_tokens {limits.max_forward_tokens}", OUT_OF_RANGE)
        field = "top_n" if top_n else "inputs"
        scored = sum(len(cont) for _, cont in pairs)
        if scored * (1 + top_n) > limits.max_score_entries:
            raise InvalidRequest(field, f"{scored} scored tokens x (1 + top_n {top_n}) = {scored * (1 + top_n)} "
                                        f"response entries, at most max_score_entries {limits.max_score_entries}",
                                 OUT_OF_RANGE)
        # An upper bound of the encoded response: scored tokens with their own texts, alternatives with
        # the longest text any token has (which ones they are is known only after the forward pass).
        size = sum(SEQUENCE_BYTES + sum(TOKEN_SCORE_BYTES + self._piece_bytes[t] for t in cont) for _, cont in pairs)
        size += scored * top_n * (ALTERNATIVE_BYTES + self._longest_piece)
        if size > self._max_response_bytes:
            raise InvalidRequest(field, f"the response could take {size} bytes, over the server's max_message_bytes "
                                        f"{self._max_response_bytes}; send fewer tokens or a smaller top_n",
                                 OUT_OF_RANGE)

    def generate(self, request: lm_pb2.GenerateRequest) -> GenerateArgs:
        which = request.WhichOneof("prompt")
        if which == "prompt_text":
            self.text_budget([request.prompt_text], "prompt_text")
            prompt = self.text(request.prompt_text, "prompt_text")
        elif which == "prompt_token_ids":
            prompt = self.ids(request.prompt_token_ids.ids, "prompt_token_ids.ids")
        else:
            raise InvalidRequest("prompt", "missing: set prompt_text or prompt_token_ids")
        limits = self._limits
        if 1 + len(prompt) > limits.max_score_tokens:
            raise InvalidRequest("prompt", f"{len(prompt)} tokens, at most {limits.max_score_tokens - 1}", OUT_OF_RANGE)
        if request.max_new_tokens < 1:
            raise InvalidRequest("max_new_tokens", f"{request.max_new_tokens}, must be >= 1")
        if request.max_new_tokens > limits.max_new_tokens:
            raise InvalidRequest("max_new_tokens", f"{request.max_new_tokens}, at most {limits.max_new_tokens}",
                                 OUT_OF_RANGE)
        needs = 1 + len(prompt) + request.max_new_tokens  # the boundary token, the prompt, the new tokens
        if needs > self._tokens_in_flight:  # alone over the engine's KV budget: no retry would admit it
            raise InvalidRequest("max_new_tokens", f"boundary + prompt + max_new_tokens = {needs} tokens, over the "
                                 f"{self._tokens_in_flight} tokens in flight the server's max_kv_bytes "
                                 f"{limits.max_kv_bytes} holds", OUT_OF_RANGE)
        if len(request.stop_sequences) > limits.max_stop_sequences:
            raise InvalidRequest("stop_sequences", f"{len(request.stop_sequences)}, at most {limits.max_stop_sequences}",
                                 OUT_OF_RANGE)
        for j, stop in enumerate(request.stop_sequences):
            if not stop:
                raise InvalidRequest(f"stop_sequences[{j}]", "empty string")
        chars = sum(len(stop) for stop in request.stop_sequences)
        if chars > limits.max_stop_chars:
            raise InvalidRequest("stop_sequences", f"{chars} characters together, at most {limits.max_stop_chars}",
                                 OUT_OF_RANGE)
        # No step budget for the prompt: MEMORY_MODE_NONE and XL run on the engine, which prefills a prompt
        # (and a sliding window's re-encoding) in chunks of at most max_step_tokens (services.lm.engine);
        # the other modes encode by segments, which memory() bounds.
        memory = self.memory(request)
        spalm, knn = self.spalm(request, memory), self.knn(request)
        if knn is not None and knn.interpolation is not None and knn.interpolation.has_cache:
            raise InvalidRequest("knn.lambda_weight", f"this server's {knn.interpolation.method.method} interpolation "
                                 "mixes a document cache, which Generate does not keep; set lambda_weight and "
                                 "temperature", grpc.StatusCode.FAILED_PRECONDITION)
        attribution = self.attribution(request, knn)
        if attribution and not self._in_row_cache(memory):  # the engine's lanes attribute (services.lm.engine)
            raise InvalidRequest("knn.attribution_top_n", "Generate attribution runs on the decoding engine only (its "
                                 "memory modes: GetInfo.engine_memory_modes)", grpc.StatusCode.UNIMPLEMENTED)
        speculative = speculative_of(request, memory, attribution, self._fewer, self._limits.max_step_tokens,
                                     self._in_row_cache(memory))
        if not self._in_row_cache(memory):  # memlm.engine.fewer_rows: the engine's rows walk pointers and ask the gate
            refuse_fewer(request.knn, "Generate with fewer searches runs on the decoding engine only (memlm's decoder)")
        retrieval = generate_retrieval_of(request.knn, knn, memory, attribution, self._fewer)
        return GenerateArgs(prompt=prompt, max_new_tokens=request.max_new_tokens, sampling=self.sampling(request.sampling),
                            stop_sequences=list(request.stop_sequences), knn=knn, memory=memory, spalm=spalm,
                            attribution=attribution, speculative=speculative, retrieval=retrieval)

    @staticmethod
    def sampling(s: lm_pb2.SamplingOptions) -> SamplingConfig:
        temperature = s.temperature if s.HasField("temperature") else 1.0
        if not (math.isfinite(temperature) and temperature >= 0):
            raise InvalidRequest("sampling.temperature", f"{temperature}, must be a finite number >= 0")
        top_k = s.top_k if s.HasField("top_k") else None
        if top_k is not None and top_k < 1:
            raise InvalidRequest("sampling.top_k", f"{top_k}, must be >= 1")
        top_p = s.top_p if s.HasField("top_p") else None
        if top_p is not None and not (math.isfinite(top_p) and 0 < top_p <= 1):
            raise InvalidRequest("sampling.top_p", f"{top_p}, must be in (0, 1]")
        return SamplingConfig(temperature, top_k, top_p, s.seed if s.HasField("seed") else None)
