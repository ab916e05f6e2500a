from memlm.v1 import retrieval_pb2 as _retrieval_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MemoryMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMORY_MODE_UNSPECIFIED: _ClassVar[MemoryMode]
    MEMORY_MODE_NONE: _ClassVar[MemoryMode]
    MEMORY_MODE_XL: _ClassVar[MemoryMode]
    MEMORY_MODE_COMPRESSIVE: _ClassVar[MemoryMode]
    MEMORY_MODE_MEMORIZING: _ClassVar[MemoryMode]
    MEMORY_MODE_SPALM: _ClassVar[MemoryMode]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_STOP_SEQUENCE: _ClassVar[FinishReason]
    FINISH_REASON_END_OF_TEXT: _ClassVar[FinishReason]

class DraftFrom(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFT_FROM_UNSPECIFIED: _ClassVar[DraftFrom]
    DRAFT_FROM_DATASTORE: _ClassVar[DraftFrom]
    DRAFT_FROM_HISTORY: _ClassVar[DraftFrom]
    DRAFT_FROM_BOTH: _ClassVar[DraftFrom]
MEMORY_MODE_UNSPECIFIED: MemoryMode
MEMORY_MODE_NONE: MemoryMode
MEMORY_MODE_XL: MemoryMode
MEMORY_MODE_COMPRESSIVE: MemoryMode
MEMORY_MODE_MEMORIZING: MemoryMode
MEMORY_MODE_SPALM: MemoryMode
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_STOP_SEQUENCE: FinishReason
FINISH_REASON_END_OF_TEXT: FinishReason
DRAFT_FROM_UNSPECIFIED: DraftFrom
DRAFT_FROM_DATASTORE: DraftFrom
DRAFT_FROM_HISTORY: DraftFrom
DRAFT_FROM_BOTH: DraftFrom

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class MemoryOptions(_message.Message):
    __slots__ = ("segment_tokens", "memory_tokens", "sink_tokens", "knn_mem_size", "knn_top_k", "compressed_memory_tokens", "compression_rate")
    SEGMENT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SINK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KNN_MEM_SIZE_FIELD_NUMBER: _ClassVar[int]
    KNN_TOP_K_FIELD_NUMBER: _ClassVar[int]
    COMPRESSED_MEMORY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_RATE_FIELD_NUMBER: _ClassVar[int]
    segment_tokens: int
    memory_tokens: int
    sink_tokens: int
    knn_mem_size: int
    knn_top_k: int
    compressed_memory_tokens: int
    compression_rate: int
    def __init__(self, segment_tokens: _Optional[int] = ..., memory_tokens: _Optional[int] = ..., sink_tokens: _Optional[int] = ..., knn_mem_size: _Optional[int] = ..., knn_top_k: _Optional[int] = ..., compressed_memory_tokens: _Optional[int] = ..., compression_rate: _Optional[int] = ...) -> None: ...

class KnnOptions(_message.Message):
    __slots__ = ("enabled", "lambda_weight", "temperature", "k", "nprobe", "attribution_top_n", "adaptive_threshold", "adaptive_fraction", "pointers", "min_pointers")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    LAMBDA_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    NPROBE_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTION_TOP_N_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_FRACTION_FIELD_NUMBER: _ClassVar[int]
    POINTERS_FIELD_NUMBER: _ClassVar[int]
    MIN_POINTERS_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    lambda_weight: float
    temperature: float
    k: int
    nprobe: int
    attribution_top_n: int
    adaptive_threshold: float
    adaptive_fraction: float
    pointers: bool
    min_pointers: int
    def __init__(self, enabled: _Optional[bool] = ..., lambda_weight: _Optional[float] = ..., temperature: _Optional[float] = ..., k: _Optional[int] = ..., nprobe: _Optional[int] = ..., attribution_top_n: _Optional[int] = ..., adaptive_threshold: _Optional[float] = ..., adaptive_fraction: _Optional[float] = ..., pointers: _Optional[bool] = ..., min_pointers: _Optional[int] = ...) -> None: ...

class DocumentAttribution(_message.Message):
    __slots__ = ("doc_id", "meta_json", "knn_mass", "final_share")
    DOC_ID_FIELD_NUMBER: _ClassVar[int]
    META_JSON_FIELD_NUMBER: _ClassVar[int]
    KNN_MASS_FIELD_NUMBER: _ClassVar[int]
    FINAL_SHARE_FIELD_NUMBER: _ClassVar[int]
    doc_id: str
    meta_json: str
    knn_mass: float
    final_share: float
    def __init__(self, doc_id: _Optional[str] = ..., meta_json: _Optional[str] = ..., knn_mass: _Optional[float] = ..., final_share: _Optional[float] = ...) -> None: ...

class TokenAttribution(_message.Message):
    __slots__ = ("knn_prob", "documents", "datastore_generation")
    KNN_PROB_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    DATASTORE_GENERATION_FIELD_NUMBER: _ClassVar[int]
    knn_prob: float
    documents: _containers.RepeatedCompositeFieldContainer[DocumentAttribution]
    datastore_generation: int
    def __init__(self, knn_prob: _Optional[float] = ..., documents: _Optional[_Iterable[_Union[DocumentAttribution, _Mapping]]] = ..., datastore_generation: _Optional[int] = ...) -> None: ...

class ScoreInput(_message.Message):
    __slots__ = ("context_text", "context_token_ids", "text", "token_ids")
    CONTEXT_TEXT_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    context_text: str
    context_token_ids: TokenIds
    text: str
    token_ids: TokenIds
    def __init__(self, context_text: _Optional[str] = ..., context_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("inputs", "knn", "memory_mode", "top_n", "window_tokens", "stride_tokens", "memory")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    KNN_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MODE_FIELD_NUMBER: _ClassVar[int]
    TOP_N_FIELD_NUMBER: _ClassVar[int]
    WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STRIDE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedCompositeFieldContainer[ScoreInput]
    knn: KnnOptions
    memory_mode: MemoryMode
    top_n: int
    window_tokens: int
    stride_tokens: int
    memory: MemoryOptions
    def __init__(self, inputs: _Optional[_Iterable[_Union[ScoreInput, _Mapping]]] = ..., knn: _Optional[_Union[KnnOptions, _Mapping]] = ..., memory_mode: _Optional[_Union[MemoryMode, str]] = ..., top_n: _Optional[int] = ..., window_tokens: _Optional[int] = ..., stride_tokens: _Optional[int] = ..., memory: _Optional[_Union[MemoryOptions, _Mapping]] = ...) -> None: ...

class TokenAlternative(_message.Message):
    __slots__ = ("token_id", "text", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    text: str
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenScore(_message.Message):
    __slots__ = ("token_id", "text", "logprob", "base_logprob", "is_greedy", "alternatives", "gate", "attribution")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    BASE_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    IS_GREEDY_FIELD_NUMBER: _ClassVar[int]
    ALTERNATIVES_FIELD_NUMBER: _ClassVar[int]
    GATE_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTION_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    text: str
    logprob: float
    base_logprob: float
    is_greedy: bool
    alternatives: _containers.RepeatedCompositeFieldContainer[TokenAlternative]
    gate: float
    attribution: TokenAttribution
    def __init__(self, token_id: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ..., base_logprob: _Optional[float] = ..., is_greedy: _Optional[bool] = ..., alternatives: _Optional[_Iterable[_Union[TokenAlternative, _Mapping]]] = ..., gate: _Optional[float] = ..., attribution: _Optional[_Union[TokenAttribution, _Mapping]] = ...) -> None: ...

class SequenceScore(_message.Message):
    __slots__ = ("tokens", "total_logprob", "base_total_logprob", "perplexity", "is_greedy", "context_tokens", "searches", "searches_saved")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    BASE_TOTAL_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    PERPLEXITY_FIELD_NUMBER: _ClassVar[int]
    IS_GREEDY_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEARCHES_FIELD_NUMBER: _ClassVar[int]
    SEARCHES_SAVED_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[TokenScore]
    total_logprob: float
    base_total_logprob: float
    perplexity: float
    is_greedy: bool
    context_tokens: int
    searches: int
    searches_saved: int
    def __init__(self, tokens: _Optional[_Iterable[_Union[TokenScore, _Mapping]]] = ..., total_logprob: _Optional[float] = ..., base_total_logprob: _Optional[float] = ..., perplexity: _Optional[float] = ..., is_greedy: _Optional[bool] = ..., context_tokens: _Optional[int] = ..., searches: _Optional[int] = ..., searches_saved: _Optional[int] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("results", "datastore_generations")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    DATASTORE_GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[SequenceScore]
    datastore_generations: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, results: _Optional[_Iterable[_Union[SequenceScore, _Mapping]]] = ..., datastore_generations: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingOptions(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("prompt_text", "prompt_token_ids", "max_new_tokens", "sampling", "stop_sequences", "knn", "memory_mode", "memory", "speculative", "draft_tokens", "draft_from")
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    KNN_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MODE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FROM_FIELD_NUMBER: _ClassVar[int]
    prompt_text: str
    prompt_token_ids: TokenIds
    max_new_tokens: int
    sampling: SamplingOptions
    stop_sequences: _containers.RepeatedScalarFieldContainer[str]
    knn: KnnOptions
    memory_mode: MemoryMode
    memory: MemoryOptions
    speculative: bool
    draft_tokens: int
    draft_from: DraftFrom
    def __init__(self, prompt_text: _Optional[str] = ..., prompt_token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[SamplingOptions, _Mapping]] = ..., stop_sequences: _Optional[_Iterable[str]] = ..., knn: _Optional[_Union[KnnOptions, _Mapping]] = ..., memory_mode: _Optional[_Union[MemoryMode, str]] = ..., memory: _Optional[_Union[MemoryOptions, _Mapping]] = ..., speculative: _Optional[bool] = ..., draft_tokens: _Optional[int] = ..., draft_from: _Optional[_Union[DraftFrom, str]] = ...) -> None: ...

class GeneratedToken(_message.Message):
    __slots__ = ("token_id", "text", "logprob", "base_logprob", "attribution")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    BASE_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTION_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    text: str
    logprob: float
    base_logprob: float
    attribution: TokenAttribution
    def __init__(self, token_id: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ..., base_logprob: _Optional[float] = ..., attribution: _Optional[_Union[TokenAttribution, _Mapping]] = ...) -> None: ...

class GenerateDelta(_message.Message):
    __slots__ = ("text", "tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    tokens: _containers.RepeatedCompositeFieldContainer[GeneratedToken]
    def __init__(self, text: _Optional[str] = ..., tokens: _Optional[_Iterable[_Union[GeneratedToken, _Mapping]]] = ...) -> None: ...

class GenerateFinish(_message.Message):
    __slots__ = ("reason", "prompt_tokens", "completion_tokens", "stop_sequence", "datastore_generations", "searches", "mean_accepted_tokens", "searches_saved")
    REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    DATASTORE_GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    SEARCHES_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEARCHES_SAVED_FIELD_NUMBER: _ClassVar[int]
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    stop_sequence: str
    datastore_generations: _containers.RepeatedScalarFieldContainer[int]
    searches: int
    mean_accepted_tokens: float
    searches_saved: int
    def __init__(self, reason: _Optional[_Union[FinishReason, str]] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., stop_sequence: _Optional[str] = ..., datastore_generations: _Optional[_Iterable[int]] = ..., searches: _Optional[int] = ..., mean_accepted_tokens: _Optional[float] = ..., searches_saved: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("delta", "finish")
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    delta: GenerateDelta
    finish: GenerateFinish
    def __init__(self, delta: _Optional[_Union[GenerateDelta, _Mapping]] = ..., finish: _Optional[_Union[GenerateFinish, _Mapping]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("texts", "add_bos")
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    ADD_BOS_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    add_bos: bool
    def __init__(self, texts: _Optional[_Iterable[str]] = ..., add_bos: _Optional[bool] = ...) -> None: ...

class TokenizedText(_message.Message):
    __slots__ = ("ids", "pieces")
    IDS_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    pieces: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., pieces: _Optional[_Iterable[str]] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[TokenizedText]
    def __init__(self, results: _Optional[_Iterable[_Union[TokenizedText, _Mapping]]] = ...) -> None: ...

class LanguageModelServiceGetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LanguageModelServiceGetInfoResponse(_message.Message):
    __slots__ = ("model", "model_fingerprint", "tokenizer_fingerprint", "vocab_size", "context_length", "datastore", "memory_modes", "default_memory_mode", "max_score_tokens", "max_score_batch", "max_new_tokens", "max_message_bytes", "default_memory", "max_memory_tokens", "max_forward_tokens", "max_score_entries", "max_text_chars", "max_step_tokens", "max_knn_mem_size", "max_knn_top_k", "knn_layer", "max_batch", "max_queue", "max_tokens_in_flight", "engine_memory_modes", "max_kv_bytes", "max_nprobe", "max_stop_sequences", "max_stop_chars", "weights", "compute_dtype")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DATASTORE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MODES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MEMORY_MODE_FIELD_NUMBER: _ClassVar[int]
    MAX_SCORE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_SCORE_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MEMORY_FIELD_NUMBER: _ClassVar[int]
    MAX_MEMORY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_FORWARD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_SCORE_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    MAX_TEXT_CHARS_FIELD_NUMBER: _ClassVar[int]
    MAX_STEP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_KNN_MEM_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_KNN_TOP_K_FIELD_NUMBER: _ClassVar[int]
    KNN_LAYER_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_MEMORY_MODES_FIELD_NUMBER: _ClassVar[int]
    MAX_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_NPROBE_FIELD_NUMBER: _ClassVar[int]
    MAX_STOP_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    MAX_STOP_CHARS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_fingerprint: str
    tokenizer_fingerprint: str
    vocab_size: int
    context_length: int
    datastore: _retrieval_pb2.DatastoreInfo
    memory_modes: _containers.RepeatedScalarFieldContainer[MemoryMode]
    default_memory_mode: MemoryMode
    max_score_tokens: int
    max_score_batch: int
    max_new_tokens: int
    max_message_bytes: int
    default_memory: MemoryOptions
    max_memory_tokens: int
    max_forward_tokens: int
    max_score_entries: int
    max_text_chars: int
    max_step_tokens: int
    max_knn_mem_size: int
    max_knn_top_k: int
    knn_layer: int
    max_batch: int
    max_queue: int
    max_tokens_in_flight: int
    engine_memory_modes: _containers.RepeatedScalarFieldContainer[MemoryMode]
    max_kv_bytes: int
    max_nprobe: int
    max_stop_sequences: int
    max_stop_chars: int
    weights: str
    compute_dtype: str
    def __init__(self, model: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., tokenizer_fingerprint: _Optional[str] = ..., vocab_size: _Optional[int] = ..., context_length: _Optional[int] = ..., datastore: _Optional[_Union[_retrieval_pb2.DatastoreInfo, _Mapping]] = ..., memory_modes: _Optional[_Iterable[_Union[MemoryMode, str]]] = ..., default_memory_mode: _Optional[_Union[MemoryMode, str]] = ..., max_score_tokens: _Optional[int] = ..., max_score_batch: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., default_memory: _Optional[_Union[MemoryOptions, _Mapping]] = ..., max_memory_tokens: _Optional[int] = ..., max_forward_tokens: _Optional[int] = ..., max_score_entries: _Optional[int] = ..., max_text_chars: _Optional[int] = ..., max_step_tokens: _Optional[int] = ..., max_knn_mem_size: _Optional[int] = ..., max_knn_top_k: _Optional[int] = ..., knn_layer: _Optional[int] = ..., max_batch: _Optional[int] = ..., max_queue: _Optional[int] = ..., max_tokens_in_flight: _Optional[int] = ..., engine_memory_modes: _Optional[_Iterable[_Union[MemoryMode, str]]] = ..., max_kv_bytes: _Optional[int] = ..., max_nprobe: _Optional[int] = ..., max_stop_sequences: _Optional[int] = ..., max_stop_chars: _Optional[int] = ..., weights: _Optional[str] = ..., compute_dtype: _Optional[str] = ...) -> None: ...
