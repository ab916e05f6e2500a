from memlm.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SearchRequest(_message.Message):
    __slots__ = ("queries", "k", "nprobe", "exact_rerank")
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    NPROBE_FIELD_NUMBER: _ClassVar[int]
    EXACT_RERANK_FIELD_NUMBER: _ClassVar[int]
    queries: _tensor_pb2.Tensor
    k: int
    nprobe: int
    exact_rerank: bool
    def __init__(self, queries: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., k: _Optional[int] = ..., nprobe: _Optional[int] = ..., exact_rerank: _Optional[bool] = ...) -> None: ...

class SearchResponse(_message.Message):
    __slots__ = ("distances", "ids", "values")
    DISTANCES_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    distances: _tensor_pb2.Tensor
    ids: _tensor_pb2.Tensor
    values: _tensor_pb2.Tensor
    def __init__(self, distances: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., values: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class RetrievalServiceGetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DatastoreInfo(_message.Message):
    __slots__ = ("n", "dim", "index", "metric", "model_fingerprint", "tokenizer_fingerprint", "nprobe", "key_layer", "model_name", "corpus", "corpus_fingerprint", "context", "stride", "boundary_token", "sink_tokens")
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
    def __init__(self, n: _Optional[int] = ..., dim: _Optional[int] = ..., index: _Optional[str] = ..., metric: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., tokenizer_fingerprint: _Optional[str] = ..., nprobe: _Optional[int] = ..., key_layer: _Optional[str] = ..., model_name: _Optional[str] = ..., corpus: _Optional[str] = ..., corpus_fingerprint: _Optional[str] = ..., context: _Optional[int] = ..., stride: _Optional[int] = ..., boundary_token: _Optional[int] = ..., sink_tokens: _Optional[int] = ...) -> None: ...

class RetrievalServiceGetInfoResponse(_message.Message):
    __slots__ = ("datastore", "max_k", "max_queries", "max_message_bytes")
    DATASTORE_FIELD_NUMBER: _ClassVar[int]
    MAX_K_FIELD_NUMBER: _ClassVar[int]
    MAX_QUERIES_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    datastore: DatastoreInfo
    max_k: int
    max_queries: int
    max_message_bytes: int
    def __init__(self, datastore: _Optional[_Union[DatastoreInfo, _Mapping]] = ..., max_k: _Optional[int] = ..., max_queries: _Optional[int] = ..., max_message_bytes: _Optional[int] = ...) -> None: ...
