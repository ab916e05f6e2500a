"""RemoteMemory: the KeyValueMemory seam (memlm.memory.knn_store) over a retrieval server's
MemoryService, the "service" backend of the Memorizing layer's memory.

`remote_memory_factory(address, ...)` returns the callable `open_key_value_memory(backend="service",
service=...)` takes: `(streams, dim, value_dim, capacity) -> RemoteMemory`, one session each, all over
one channel (services.common.server.ServiceClient: the channel, token, TLS and per-call deadline of
every memlm client). The layer does not know whether its memory is in-process or remote (STYLE 12):
after the same appends and clears, a RemoteMemory answers exactly what an ExactMemory on the server's
device answers (the server runs ExactMemory; keys and values travel in its storage dtype).

Calls too big for one message are split (appends along T, searches along Q); appending in pieces in
time order leaves the same FIFO contents as one append. A failed append or clear leaves the remote
contents unknown, so the memory refuses every later call (it never guesses; no retries). Errors are
ServiceError (a MemlmError) carrying the gRPC status code.

Shape legend: S streams, T entries per stream, Q queries per stream, k neighbours, d key dimension,
dv value dimension.
"""

from __future__ import annotations

import grpc
import torch

from memlm.memory.knn_store import Retrieved, check_entries, check_queries
from memlm.v1 import retrieval_pb2, retrieval_pb2_grpc, tensor_pb2
from services.retrieval.memory_sessions import (
    FLOAT_DTYPES,
    MESSAGE_OVERHEAD_BYTES,
    search_response_bytes,
    tensor_to_torch,
    torch_dtype_of,
    torch_to_tensor,
)
from services.common.security import ClientTls
from services.common.server import (
    DEFAULT_MAX_MESSAGE_BYTES,
    ServiceClient,
    ServiceError,
)
from services.common.tensors import TensorError

_WIRE_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
"""Float dtypes that travel as they are; others are sent as float32."""


class MemoryClient(ServiceClient):
    """A channel to one server's MemoryService, shared by the RemoteMemory sessions opened over it.

    Arguments as ServiceClient (timeout: seconds per call; None = no deadline). Use as the factory that
    open_key_value_memory's "service" backend takes: `client(streams, dim, value_dim, capacity)`.
    idle_timeout_s / lifetime_s: what each session asks for (None = the server's default idle timeout /
    no deadline).
    """

    def __init__(self, address: str, *, tls: ClientTls | None = None, token: str | None = None,
                 timeout: float | None = 60.0, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 wait_for_ready: bool = False, idle_timeout_s: float | None = None,
                 lifetime_s: float | None = None) -> None:
        super().__init__(address, tls, token, timeout, max_message_bytes, wait_for_ready)
        self._stub = retrieval_pb2_grpc.MemoryServiceStub(self._channel)
        self.idle_timeout_s = idle_timeout_s
        self.lifetime_s = lifetime_s
        self._info: retrieval_pb2.GetMemoryInfoResponse | None = None

    def info(self, refresh: bool = False) -> retrieval_pb2.GetMemoryInfoResponse:
        """The server's session limits (fetched once; refresh=True asks again, e.g. for the sessions in use)."""
        if self._info is None or refresh:
            self._info = self.call("GetMemoryInfo", retrieval_pb2.GetMemoryInfoRequest())
        return self._info

    def message_bytes(self) -> int:
        """Largest message both ends accept, in bytes."""
        return min(self._max_message_bytes, self.info().max_message_bytes or self._max_message_bytes)

    def call(self, method: str, request):
        """One unary MemoryService call by rpc name; grpc errors become ServiceError."""
        return self._call(getattr(self._stub, method), request)

    def __call__(self, streams: int, dim: int, value_dim: int, capacity: int) -> RemoteMemory:
        """A new session memory (the KeyValueMemoryFactory signature)."""
        return RemoteMemory(self, streams, dim, value_dim, capacity)


def remote_memory_factory(address: str, *, tls: ClientTls | None = None, token: str | None = None,
                          timeout: float | None = 60.0, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                          idle_timeout_s: float | None = None, lifetime_s: float | None = None) -> MemoryClient:
    """The "service" backend's factory for open_key_value_memory: a MemoryClient on `address` (close it
    when done; its sessions first). Arguments as MemoryClient."""
    return MemoryClient(address, tls=tls, token=token, timeout=timeout, max_message_bytes=max_message_bytes,
                        idle_timeout_s=idle_timeout_s, lifetime_s=lifetime_s)


class RemoteMemory:
    """One session memory on a MemoryService, answering the KeyValueMemory seam (torch tensors in and out,
    results on the queries' device in their dtype)."""

    def __init__(self, client: MemoryClient, streams: int, dim: int, value_dim: int, capacity: int) -> None:
        self.streams, self.dim, self.value_dim, self.capacity = streams, dim, value_dim, capacity
        self._client = client
        request = retrieval_pb2.CreateMemoryRequest(streams=streams, dim=dim, value_dim=value_dim, capacity=capacity,
                                                    idle_timeout_s=client.idle_timeout_s, lifetime_s=client.lifetime_s)
        created = client.call("CreateMemory", request)
        self.memory_id: str = created.memory_id
        self.idle_timeout_s: float = created.idle_timeout_s
        self.storage_dtype = torch_dtype_of(created.storage_dtype)
        """The server's storage dtype: keys and values come back in it, then are cast to the queries' dtype."""
        self._sizes = torch.zeros(streams, dtype=torch.long)  # (S,) as the server last reported
        self._broken: str | None = None  # why the remote contents are unknown (a failed append or clear)
        self._closed = False

    def _check_usable(self) -> None:
        if self._closed:
            raise ValueError("this key/value memory was closed")
        if self._broken is not None:
            raise ValueError(f"remote memory {self.memory_id[:8]}... is unusable: {self._broken}")

    def _mutate(self, method: str, request) -> torch.Tensor:
        """An AppendMemory or ClearMemory call; returns the sizes it reports. On failure the memory is
        marked broken (the server may or may not have applied the call)."""
        try:
            response = self._client.call(method, request)
            sizes = tensor_to_torch(response.sizes, "sizes", (tensor_pb2.DTYPE_INT64,), 1)  # (S,)
        except (ServiceError, TensorError) as e:
            self._broken = f"{method} failed ({e})"
            raise
        self._sizes = sizes
        return sizes

    def append(self, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor) -> None:
        """keys (S, T, d), values (S, T, dv), valid (S, T) bool: as KeyValueMemory.append, in calls of at
        most one message each."""
        self._check_usable()
        check_entries(self, keys, values, valid)
        keys, values = _wire_float(keys), _wire_float(values)
        T = keys.shape[1]
        per_entry = self.streams * (self.dim * keys.element_size() + self.value_dim * values.element_size() + 1)
        step = max(1, (self._client.message_bytes() - MESSAGE_OVERHEAD_BYTES) // per_entry)
        for lo in range(0, max(T, 1), step):
            hi = min(T, lo + step)
            request = retrieval_pb2.AppendMemoryRequest(
                memory_id=self.memory_id, keys=torch_to_tensor(keys[:, lo:hi]),  # (S, t, d)
                values=torch_to_tensor(values[:, lo:hi]), valid=torch_to_tensor(valid[:, lo:hi].bool()))  # (S, t, dv), (S, t)
            self._mutate("AppendMemory", request)

    def search(self, queries: torch.Tensor, k: int) -> Retrieved:
        """queries (S, Q, d) -> Retrieved keys (S, Q, k, d), values (S, Q, k, dv), valid (S, Q, k), on the
        queries' device, keys and values in their dtype; as many calls as the messages need."""
        self._check_usable()
        check_queries(self, queries, k)
        S, Q, _ = queries.shape
        dev, dtype = queries.device, queries.dtype
        if Q == 0:
            return Retrieved(queries.new_zeros(S, 0, k, self.dim), queries.new_zeros(S, 0, k, self.value_dim),
                             torch.zeros(S, 0, k, dtype=torch.bool, device=dev))
        wire = _wire_float(queries)
        limit = self._client.message_bytes()
        per_query = search_response_bytes(S, 1, k, self.dim, self.value_dim, self.storage_dtype.itemsize) - MESSAGE_OVERHEAD_BYTES
        step = max(1, min((limit - MESSAGE_OVERHEAD_BYTES) // per_query,
                          (limit - MESSAGE_OVERHEAD_BYTES) // (S * self.dim * wire.element_size())))
        parts = []
        for lo in range(0, Q, step):
            chunk = wire[:, lo : lo + step]  # (S, q, d)
            request = retrieval_pb2.SearchMemoryRequest(memory_id=self.memory_id, queries=torch_to_tensor(chunk), k=k)
            parts.append(self._decode(self._client.call("SearchMemory", request), chunk.shape[1], k))
        keys, values, valid = (torch.cat(p, dim=1) if len(parts) > 1 else p[0] for p in zip(*parts))
        return Retrieved(keys.to(dev, dtype), values.to(dev, dtype), valid.to(dev))  # (S, Q, k, d), (S, Q, k, dv), (S, Q, k)

    def _decode(self, response: retrieval_pb2.SearchMemoryResponse, q: int, k: int) -> Retrieved:
        S = self.streams
        try:
            out = Retrieved(tensor_to_torch(response.keys, "keys", FLOAT_DTYPES, 4),  # (S, q, k, d)
                            tensor_to_torch(response.values, "values", FLOAT_DTYPES, 4),  # (S, q, k, dv)
                            tensor_to_torch(response.valid, "valid", (tensor_pb2.DTYPE_BOOL,), 3))  # (S, q, k)
        except TensorError as e:
            raise ServiceError(self._client.address, grpc.StatusCode.INTERNAL, f"bad SearchMemory response: {e}") from None
        for name, t, want in zip(Retrieved._fields, out, ((S, q, k, self.dim), (S, q, k, self.value_dim), (S, q, k))):
            if tuple(t.shape) != want:
                raise ServiceError(self._client.address, grpc.StatusCode.INTERNAL,
                                   f"bad SearchMemory response: {name} shape {tuple(t.shape)}, expected {want}")
        return out

    def clear(self, streams: torch.Tensor) -> None:
        """streams (S,) bool: empty those streams only."""
        self._check_usable()
        if tuple(streams.shape) != (self.streams,):
            raise ValueError(f"streams must have shape ({self.streams},), got {tuple(streams.shape)}")
        request = retrieval_pb2.ClearMemoryRequest(memory_id=self.memory_id, streams=torch_to_tensor(streams.bool()))
        self._mutate("ClearMemory", request)

    def sizes(self) -> torch.Tensor:
        """(S,) int64 entries held per stream, as the server reported after the last append or clear."""
        return self._sizes.clone()

    def close(self) -> None:
        """Drop the session (idempotent; a session the server already let expire is no error)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._client.call("DropMemory", retrieval_pb2.DropMemoryRequest(memory_id=self.memory_id))
        except ServiceError as e:
            if e.code != grpc.StatusCode.NOT_FOUND:
                raise


def _wire_float(t: torch.Tensor) -> torch.Tensor:
    """`t` detached on the CPU in a dtype the wire carries (float32, float16, bfloat16 as they are)."""
    t = t.detach().cpu()
    return t if t.dtype in _WIRE_FLOATS else t.float()
