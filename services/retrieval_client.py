"""A synchronous RetrievalService client that answers the Searcher seam (memlm/retrieval/searcher.py).

Library code (kNN-LM scoring, evaluation) calls `search(xq, k, options)` and `info()` without knowing
whether the datastore is in-process, behind one retrieval server, or behind a shard router (STYLE.md 12).
It uses a blocking grpc channel, so it works from plain synchronous code and from threads.

Shape legend: Q queries, d key dimension, k neighbours.
"""

from __future__ import annotations

import grpc
import numpy as np

from memlm.retrieval.searcher import Neighbors, SearcherInfo, SearchOptions
from memlm.v1 import retrieval_pb2, retrieval_pb2_grpc, tensor_pb2
from services.retrieval_server import (
    RESPONSE_BYTES_PER_NEIGHBOUR,
    info_from_proto,
    response_bytes,
)
from services.security import ClientTls
from services.server_common import (
    DEFAULT_MAX_MESSAGE_BYTES,
    ServiceClient,
    ServiceError,
)
from services.tensors import TensorError, from_tensor, to_tensor


class RetrievalClient(ServiceClient):
    """Searcher backed by a remote RetrievalService (a retrieval server or a shard router).

    Arguments as ServiceClient; the timeout is per call, and a search of many queries makes several calls.
    Errors are ServiceError (a MemlmError) carrying the gRPC status code.
    """

    def __init__(
        self,
        address: str,
        *,
        tls: ClientTls | None = None,
        token: str | None = None,
        timeout: float | None = 60.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        wait_for_ready: bool = False,
    ) -> None:
        super().__init__(address, tls, token, timeout, max_message_bytes, wait_for_ready)
        self._stub = retrieval_pb2_grpc.RetrievalServiceStub(self._channel)
        self._server_info: retrieval_pb2.RetrievalServiceGetInfoResponse | None = None

    def server_info(self) -> retrieval_pb2.RetrievalServiceGetInfoResponse:
        """The server's GetInfo answer, datastore and request limits (fetched once, then cached)."""
        if self._server_info is None:
            self._server_info = self._call(self._stub.GetInfo, retrieval_pb2.RetrievalServiceGetInfoRequest())
        return self._server_info

    def info(self) -> SearcherInfo:
        """The remote datastore (for a router: the union of its shards), as the Searcher seam says."""
        return info_from_proto(self.server_info().datastore)

    @property
    def dim(self) -> int:
        """Key dimension d of the remote datastore."""
        return self.server_info().datastore.dim

    def rows_per_call(self, k: int, itemsize: int = 4) -> int:
        """Most queries one call may carry: within the server's max_queries, and so that both the
        request (Q * d * itemsize bytes) and the response (Q * k * 16 bytes) fit one message on
        both ends."""
        info = self.server_info()
        limit = min(self._max_message_bytes, info.max_message_bytes or self._max_message_bytes)
        by_response = (limit - response_bytes(0, k)) // (max(k, 1) * RESPONSE_BYTES_PER_NEIGHBOUR)  # k < 1: server says why
        by_request = (limit - 4096) // (self.dim * itemsize)  # 4096: room for the message's headers
        return max(1, min(info.max_queries or by_request, by_request, by_response))

    def search(self, xq: np.ndarray, k: int, options: SearchOptions | None = None) -> Neighbors:
        """xq: (Q, d) float32 or float16 queries -> Neighbors with (Q, k) arrays.

        options: sent with every call (nprobe only when set: unset is the datastore's default). Batches
        bigger than one message are split into several calls, made one after another.
        """
        options = options or SearchOptions()
        xq = np.asarray(xq)
        if xq.dtype != np.float16:
            xq = xq.astype(np.float32, copy=False)  # float16 travels as is: half the bytes
        if xq.ndim != 2:
            raise ValueError(f"xq must be (Q, d), got shape {xq.shape}")
        if len(xq) == 0:  # what a local FAISS index answers; the server refuses empty batches
            return Neighbors(np.empty((0, k), np.float32), np.empty((0, k), np.int64), np.empty((0, k), np.int32))
        step = self.rows_per_call(k, xq.dtype.itemsize)
        parts = []
        for start in range(0, len(xq), step):
            chunk = xq[start : start + step]  # (q, d)
            request = retrieval_pb2.SearchRequest(
                queries=to_tensor(chunk), k=k, nprobe=options.nprobe, exact_rerank=options.exact_rerank
            )
            parts.append(self._decode(self._call(self._stub.Search, request), len(chunk), k))
        if len(parts) == 1:
            return parts[0]
        return Neighbors(*(np.concatenate(arrays) for arrays in zip(*parts)))  # (Q, k) each

    def _decode(self, response: retrieval_pb2.SearchResponse, q: int, k: int) -> Neighbors:
        try:
            out = Neighbors(
                from_tensor(response.distances, "distances", dtypes=(tensor_pb2.DTYPE_FLOAT32,), ndim=2),
                from_tensor(response.ids, "ids", dtypes=(tensor_pb2.DTYPE_INT64,), ndim=2),
                from_tensor(response.values, "values", dtypes=(tensor_pb2.DTYPE_INT32,), ndim=2),
            )
        except TensorError as e:
            raise ServiceError(self.address, grpc.StatusCode.INTERNAL, f"bad response: {e}") from None
        for name, a in zip(Neighbors._fields, out):
            if a.shape != (q, k):
                raise ServiceError(
                    self.address, grpc.StatusCode.INTERNAL, f"bad response: {name} shape {a.shape}, expected {(q, k)}"
                )
        # Copies: the decoded views of the message bytes are read-only, local FAISS results are not.
        return Neighbors(*(np.array(a) for a in out))
