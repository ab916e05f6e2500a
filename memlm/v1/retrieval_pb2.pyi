from memlm.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SuccessorsRequest(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _tensor_pb2.Tensor
    def __init__(self, ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class SuccessorsResponse(_message.Message):
    __slots__ = ("next_ids", "values", "generation")
    NEXT_IDS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    next_ids: _tensor_pb2.Tensor
    values: _tensor_pb2.Tensor
    generation: int
    def __init__(self, next_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., values: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., generation: _Optional[int] = ...) -> None: ...

class SearchRequest(_message.Message):
    __slots__ = ("queries", "k", "nprobe", "exact_rerank", "allow_partial", "with_documents")
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    NPROBE_FIELD_NUMBER: _ClassVar[int]
    EXACT_RERANK_FIELD_NUMBER: _ClassVar[int]
    ALLOW_PARTIAL_FIELD_NUMBER: _ClassVar[int]
    WITH_DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    queries: _tensor_pb2.Tensor
    k: int
    nprobe: int
    exact_rerank: bool
    allow_partial: bool
    with_documents: bool
    def __init__(self, queries: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., k: _Optional[int] = ..., nprobe: _Optional[int] = ..., exact_rerank: _Optional[bool] = ..., allow_partial: _Optional[bool] = ..., with_documents: _Optional[bool] = ...) -> None: ...

class SourceDocument(_message.Message):
    __slots__ = ("doc_id", "meta_json")
    DOC_ID_FIELD_NUMBER: _ClassVar[int]
    META_JSON_FIELD_NUMBER: _ClassVar[int]
    doc_id: str
    meta_json: str
    def __init__(self, doc_id: _Optional[str] = ..., meta_json: _Optional[str] = ...) -> None: ...

class SearchResponse(_message.Message):
    __slots__ = ("distances", "ids", "values", "generation", "partial", "missing_shards", "documents", "sources")
    DISTANCES_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    MISSING_SHARDS_FIELD_NUMBER: _ClassVar[int]
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    distances: _tensor_pb2.Tensor
    ids: _tensor_pb2.Tensor
    values: _tensor_pb2.Tensor
    generation: int
    partial: bool
    missing_shards: _containers.RepeatedScalarFieldContainer[str]
    documents: _tensor_pb2.Tensor
    sources: _containers.RepeatedCompositeFieldContainer[SourceDocument]
    def __init__(self, distances: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., values: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., generation: _Optional[int] = ..., partial: _Optional[bool] = ..., missing_shards: _Optional[_Iterable[str]] = ..., documents: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., sources: _Optional[_Iterable[_Union[SourceDocument, _Mapping]]] = ...) -> None: ...

class RetrievalServiceGetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DatastoreInfo(_message.Message):
    __slots__ = ("n", "dim", "index", "metric", "model_fingerprint", "tokenizer_fingerprint", "nprobe", "key_layer", "model_name", "corpus", "corpus_fingerprint", "context", "stride", "boundary_token", "sink_tokens", "weights")
    N_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    METRIC_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NPROBE_FIELD_NUMBER: _ClassVar[int]
    KEY_LAYER_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    CORPUS_FIELD_NUMBER: _ClassVar[int]
    CORPUS_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SINK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    n: int
    dim: int
    index: str
    metric: str
    model_fingerprint: str
    tokenizer_fingerprint: str
    nprobe: int
    key_layer: str
    model_name: str
    corpus: str
    corpus_fingerprint: str
    context: int
    stride: int
    boundary_token: int
    sink_tokens: int
    weights: str
    def __init__(self, n: _Optional[int] = ..., dim: _Optional[int] = ..., index: _Optional[str] = ..., metric: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., tokenizer_fingerprint: _Optional[str] = ..., nprobe: _Optional[int] = ..., key_layer: _Optional[str] = ..., model_name: _Optional[str] = ..., corpus: _Optional[str] = ..., corpus_fingerprint: _Optional[str] = ..., context: _Optional[int] = ..., stride: _Optional[int] = ..., boundary_token: _Optional[int] = ..., sink_tokens: _Optional[int] = ..., weights: _Optional[str] = ...) -> None: ...

class RetrievalServiceGetInfoResponse(_message.Message):
    __slots__ = ("datastore", "max_k", "max_queries", "max_message_bytes", "generation")
    DATASTORE_FIELD_NUMBER: _ClassVar[int]
    MAX_K_FIELD_NUMBER: _ClassVar[int]
    MAX_QUERIES_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    datastore: DatastoreInfo
    max_k: int
    max_queries: int
    max_message_bytes: int
    generation: int
    def __init__(self, datastore: _Optional[_Union[DatastoreInfo, _Mapping]] = ..., max_k: _Optional[int] = ..., max_queries: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class CreateMemoryRequest(_message.Message):
    __slots__ = ("streams", "dim", "value_dim", "capacity", "idle_timeout_s", "lifetime_s")
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    VALUE_DIM_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    LIFETIME_S_FIELD_NUMBER: _ClassVar[int]
    streams: int
    dim: int
    value_dim: int
    capacity: int
    idle_timeout_s: float
    lifetime_s: float
    def __init__(self, streams: _Optional[int] = ..., dim: _Optional[int] = ..., value_dim: _Optional[int] = ..., capacity: _Optional[int] = ..., idle_timeout_s: _Optional[float] = ..., lifetime_s: _Optional[float] = ...) -> None: ...

class CreateMemoryResponse(_message.Message):
    __slots__ = ("memory_id", "idle_timeout_s", "storage_dtype")
    MEMORY_ID_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    STORAGE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    memory_id: str
    idle_timeout_s: float
    storage_dtype: _tensor_pb2.DType
    def __init__(self, memory_id: _Optional[str] = ..., idle_timeout_s: _Optional[float] = ..., storage_dtype: _Optional[_Union[_tensor_pb2.DType, str]] = ...) -> None: ...

class AppendMemoryRequest(_message.Message):
    __slots__ = ("memory_id", "keys", "values", "valid")
    MEMORY_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    VALID_FIELD_NUMBER: _ClassVar[int]
    memory_id: str
    keys: _tensor_pb2.Tensor
    values: _tensor_pb2.Tensor
    valid: _tensor_pb2.Tensor
    def __init__(self, memory_id: _Optional[str] = ..., keys: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., values: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., valid: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class AppendMemoryResponse(_message.Message):
    __slots__ = ("sizes",)
    SIZES_FIELD_NUMBER: _ClassVar[int]
    sizes: _tensor_pb2.Tensor
    def __init__(self, sizes: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class SearchMemoryRequest(_message.Message):
    __slots__ = ("memory_id", "queries", "k")
    MEMORY_ID_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    memory_id: str
    queries: _tensor_pb2.Tensor
    k: int
    def __init__(self, memory_id: _Optional[str] = ..., queries: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., k: _Optional[int] = ...) -> None: ...

class SearchMemoryResponse(_message.Message):
    __slots__ = ("keys", "values", "valid")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    VALID_FIELD_NUMBER: _ClassVar[int]
    keys: _tensor_pb2.Tensor
    values: _tensor_pb2.Tensor
    valid: _tensor_pb2.Tensor
    def __init__(self, keys: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., values: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., valid: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class ClearMemoryRequest(_message.Message):
    __slots__ = ("memory_id", "streams")
    MEMORY_ID_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    memory_id: str
    streams: _tensor_pb2.Tensor
    def __init__(self, memory_id: _Optional[str] = ..., streams: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class ClearMemoryResponse(_message.Message):
    __slots__ = ("sizes",)
    SIZES_FIELD_NUMBER: _ClassVar[int]
    sizes: _tensor_pb2.Tensor
    def __init__(self, sizes: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class DropMemoryRequest(_message.Message):
    __slots__ = ("memory_id",)
    MEMORY_ID_FIELD_NUMBER: _ClassVar[int]
    memory_id: str
    def __init__(self, memory_id: _Optional[str] = ...) -> None: ...

class DropMemoryResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetMemoryInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetMemoryInfoResponse(_message.Message):
    __slots__ = ("max_sessions", "default_idle_timeout_s", "max_idle_timeout_s", "max_k", "max_message_bytes", "sessions", "reserved_entries", "max_session_bytes", "max_total_bytes", "reserved_bytes")
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_IDLE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MAX_IDLE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    MAX_K_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSION_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    max_sessions: int
    default_idle_timeout_s: float
    max_idle_timeout_s: float
    max_k: int
    max_message_bytes: int
    sessions: int
    reserved_entries: int
    max_session_bytes: int
    max_total_bytes: int
    reserved_bytes: int
    def __init__(self, max_sessions: _Optional[int] = ..., default_idle_timeout_s: _Optional[float] = ..., max_idle_timeout_s: _Optional[float] = ..., max_k: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., sessions: _Optional[int] = ..., reserved_entries: _Optional[int] = ..., max_session_bytes: _Optional[int] = ..., max_total_bytes: _Optional[int] = ..., reserved_bytes: _Optional[int] = ...) -> None: ...
