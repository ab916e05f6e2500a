"""Session memories on the retrieval service (MemoryService): the server side.

A session is one `memlm.memory.knn_store.ExactMemory` that a remote client (services/
memory_client.RemoteMemory, the "service" backend of the KeyValueMemory seam) creates, appends to,
searches, clears and drops, so that an LM server can keep the Memorizing layer's memory of a very long
document on another machine. The results are those of an in-process ExactMemory on the same device
after the same calls, bit for bit: the server runs that class, and keys and values travel in its
storage dtype (bfloat16 on CPU), which widens exactly.

Bounded in bytes (MemoryOptions, the `serve retrieval --memories` flags): at most max_sessions sessions; a
session reserves streams * capacity * (dim + value_dim) * the storage dtype's size bytes when it is created
(`session_bytes`), at most max_session_bytes, and all sessions together at most max_total_bytes; a session
past either limit is refused before anything is allocated, with RESOURCE_EXHAUSTED naming the limit and its
flag. A session belongs to the tenant that created it (services.common.tenants): for any other tenant its id
is NOT_FOUND, as for an id that never existed, and each tenant's sessions count against its own
max_memory_sessions and max_memory_bytes. A session dies when it is dropped, after
idle_timeout_s without a call, or lifetime_s after its creation (its deadline); a dead session's id
is NOT_FOUND. Expiry is checked on every call and by a reaper task, so memory comes back on time even
when a client vanishes without DropMemory.

Calls of one session run one at a time (an asyncio lock: an append and the search after it keep their
order), on a small pool of worker threads, so torch work never blocks the server's event loop.

Shape legend: S streams, T entries per stream, Q queries per stream, k neighbours, d key dimension,
dv value dimension.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import numpy as np
import torch

from memlm.memory.knn_store import ExactMemory, storage_dtype
from memlm.retrieval.searcher import MAX_K
from memlm.v1 import retrieval_pb2, tensor_pb2
from services.common.server import InvalidRequest
from services.common.tenants import DEFAULT_TENANT, Tenant, current_tenant
from services.common.sizes import byte_size, format_bytes
from services.common.tensors import from_tensor, to_tensor

MEMORY_SERVICE = retrieval_pb2.DESCRIPTOR.services_by_name["MemoryService"]
FLOAT_DTYPES = (tensor_pb2.DTYPE_FLOAT32, tensor_pb2.DTYPE_FLOAT16, tensor_pb2.DTYPE_BFLOAT16)
"""Wire dtypes accepted for keys, values and queries."""
MAX_DIM = 1024
"""Largest key or value dimension a session may have, in elements (an attention head has 64-256)."""
REAP_INTERVAL_S = 1.0
"""Longest sleep of the reaper between two looks at the expiry times, in seconds."""
MESSAGE_OVERHEAD_BYTES = 4096
"""Room for a message's headers (ids, dtypes, shapes) beside its tensor bytes."""

_WIRE_OF_TORCH = {torch.float32: tensor_pb2.DTYPE_FLOAT32, torch.float16: tensor_pb2.DTYPE_FLOAT16,
                  torch.bfloat16: tensor_pb2.DTYPE_BFLOAT16}
_TORCH_OF_WIRE = {v: k for k, v in _WIRE_OF_TORCH.items()}


@dataclass(frozen=True)
class MemoryOptions:
    """The session limits of one server (`serve retrieval --memories` and the flags below it)."""

    max_sessions: int = 64
    """Sessions open at once (--max-memory-sessions); RESOURCE_EXHAUSTED past it."""
    max_session_bytes: int = 1 << 30
    """Bytes one session may reserve, `session_bytes` (--max-memory-session-bytes): 1 GiB, e.g. 8 rows x 3 kv heads
    x 85K entries at d = dv = 64 in float32."""
    max_total_bytes: int = 4 << 30
    """Bytes all sessions together may reserve (--max-memory-total-bytes): 4 GiB."""
    idle_timeout_s: float = 300.0
    """Seconds without a call after which a session that asked for no timeout is dropped (--memory-idle-timeout)."""
    max_idle_timeout_s: float = 3600.0
    """Longest idle timeout a session may ask for, in seconds (--memory-max-idle-timeout)."""
    threads: int = 2
    """Worker threads running the sessions' torch work (calls of one session still run one at a time)."""

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_session_bytes", "max_total_bytes", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0 < self.idle_timeout_s <= self.max_idle_timeout_s:
            raise ValueError(f"the idle timeout must be > 0 and <= the longest one ({self.max_idle_timeout_s:g} s), "
                             f"got {self.idle_timeout_s:g} s")


def add_memory_options(p: argparse.ArgumentParser) -> None:
    """The session-memory flags of `serve retrieval` (defaults from MemoryOptions, their one home)."""
    d = MemoryOptions()
    p.add_argument("--memories", action="store_true",
                   help="also host session memories (MemoryService) for the Memorizing layer's 'service' backend")
    p.add_argument("--max-memory-sessions", type=int, default=d.max_sessions, help="session memories open at once")
    p.add_argument("--max-memory-session-bytes", type=byte_size, default=d.max_session_bytes, metavar="SIZE",
                   help="bytes one session may reserve: streams x capacity x (dim + value_dim) x the storage dtype's "
                        "size (e.g. 512M, 4G)")
    p.add_argument("--max-memory-total-bytes", type=byte_size, default=d.max_total_bytes, metavar="SIZE",
                   help="bytes all sessions together may reserve (e.g. 4G)")
    p.add_argument("--memory-idle-timeout", type=float, default=d.idle_timeout_s,
                   help="seconds without a call after which a session is dropped (when it asks for none)")
    p.add_argument("--memory-max-idle-timeout", type=float, default=d.max_idle_timeout_s,
                   help="longest idle timeout a session may ask for, in seconds")


def memory_options_from_args(args: argparse.Namespace) -> MemoryOptions | None:
    """MemoryOptions from add_memory_options' flags; None without --memories (ValueError for a bad value)."""
    if not args.memories:
        return None
    return MemoryOptions(max_sessions=args.max_memory_sessions, max_session_bytes=args.max_memory_session_bytes,
                         max_total_bytes=args.max_memory_total_bytes, idle_timeout_s=args.memory_idle_timeout,
                         max_idle_timeout_s=args.memory_max_idle_timeout)


# ---------------------------------------------------------------------------------------------
# torch tensors on the wire (bfloat16 included, which numpy lacks)


def torch_to_tensor(t: torch.Tensor) -> tensor_pb2.Tensor:
    """A CPU-copied torch tensor as a Tensor; bfloat16 travels as its raw 2-byte patterns (DTYPE_BFLOAT16)."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        bits = t.view(torch.int16).numpy().astype("<i2", copy=False)
        return tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_BFLOAT16, shape=t.shape, data=bits.tobytes())
    return to_tensor(t.numpy())


def tensor_to_torch(tensor: tensor_pb2.Tensor, name: str, dtypes, ndim: int) -> torch.Tensor:
    """A checked Tensor (services.common.tensors.from_tensor) as a torch tensor of its own dtype (bfloat16 stays
    bfloat16: from_tensor widens it to float32 exactly, and it is narrowed back here, exactly)."""
    array = np.array(from_tensor(tensor, name, dtypes=dtypes, ndim=ndim))  # a writable copy
    out = torch.from_numpy(array)
    return out.to(torch.bfloat16) if tensor.dtype == tensor_pb2.DTYPE_BFLOAT16 else out


def session_bytes(streams: int, capacity: int, dim: int, value_dim: int, itemsize: int) -> int:
    """Bytes a session's keys and values take: streams * capacity entries of dim + value_dim elements."""
    return streams * capacity * (dim + value_dim) * itemsize


def search_response_bytes(streams: int, q: int, k: int, dim: int, value_dim: int, itemsize: int) -> int:
    """Upper bound on a SearchMemoryResponse's size: keys and values in the storage dtype, valid as bytes."""
    return streams * q * k * ((dim + value_dim) * itemsize + 1) + MESSAGE_OVERHEAD_BYTES


# ---------------------------------------------------------------------------------------------
# Sessions


@dataclass
class Session:
    """One open session memory."""

    memory_id: str
    memory: ExactMemory
    """The in-process memory that answers the calls."""
    idle_timeout_s: float
    deadline: float | None
    """time.monotonic() seconds at which the session dies however busy it is; None = none."""
    last_used: float
    """time.monotonic() seconds of the end of its last call."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held while a call runs: one call of a session at a time, in arrival order."""
    tenant: str = DEFAULT_TENANT
    """Name of the tenant that created it, the only one that may use it (services.common.tenants)."""

    @property
    def reserved(self) -> int:
        """Entries it holds room for (streams * capacity)."""
        return self.memory.streams * self.memory.capacity

    @property
    def reserved_bytes(self) -> int:
        """Bytes of its keys and values (session_bytes of its shape)."""
        b = self.memory.buffer
        return session_bytes(b.streams, b.capacity, b.dim, b.value_dim, b.dtype.itemsize)

    def expired(self, now: float) -> bool:
        """Past its deadline or idle timeout, and no call of it running (a running call's memory is never
        closed under it; the next call finds the session dead)."""
        if self.lock.locked():
            return False
        return (self.deadline is not None and now >= self.deadline) or now - self.last_used >= self.idle_timeout_s


class MemorySessions:
    """The sessions of one server. Every method runs on the server's event loop; torch work runs on
    the worker threads (`run`)."""

    def __init__(self, options: MemoryOptions, device: torch.device | str = "cpu",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.options = options
        self.device = torch.device(device)
        self._clock = clock
        self._sessions: dict[str, Session] = {}
        self._executor = concurrent.futures.ThreadPoolExecutor(options.threads, thread_name_prefix="memlm-memory")
        self._reaper: asyncio.Task | None = None

    @property
    def reserved_entries(self) -> int:
        return sum(s.reserved for s in self._sessions.values())

    @property
    def reserved_bytes(self) -> int:
        return sum(s.reserved_bytes for s in self._sessions.values())

    def __len__(self) -> int:
        return len(self._sessions)

    def start(self) -> None:
        """Start the reaper task (on the running loop); `close` stops it."""
        self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())

    async def close(self) -> None:
        """Stop the reaper, drop every session, release the worker threads (after the server stopped)."""
        if self._reaper is not None:
            self._reaper.cancel()
            await asyncio.gather(self._reaper, return_exceptions=True)
        for memory_id in list(self._sessions):
            self._sessions.pop(memory_id).memory.close()
        self._executor.shutdown(wait=True, cancel_futures=True)

    def create(self, request: retrieval_pb2.CreateMemoryRequest) -> Session:
        """A new session for a CreateMemoryRequest, or InvalidRequest (INVALID_ARGUMENT / RESOURCE_EXHAUSTED)."""
        streams, dim, value_dim, capacity = request.streams, request.dim, request.value_dim, request.capacity
        for name, value, top in (("streams", streams, None), ("dim", dim, MAX_DIM), ("value_dim", value_dim, MAX_DIM),
                                 ("capacity", capacity, None)):
            if value < 1 or (top is not None and value > top):
                raise InvalidRequest(name, f"{value}, must be >= 1" + (f" and <= {top}" if top else ""))
        idle = request.idle_timeout_s if request.HasField("idle_timeout_s") else self.options.idle_timeout_s
        if not (math.isfinite(idle) and 0 < idle <= self.options.max_idle_timeout_s):
            raise InvalidRequest("idle_timeout_s", f"{idle:g} s, must be > 0 and <= {self.options.max_idle_timeout_s:g}")
        lifetime = request.lifetime_s if request.HasField("lifetime_s") else None
        if lifetime is not None and not (math.isfinite(lifetime) and lifetime > 0):
            raise InvalidRequest("lifetime_s", f"{lifetime:g} s, must be > 0 (leave it unset for no deadline)")
        self.reap()
        tenant = current_tenant()
        size = session_bytes(streams, capacity, dim, value_dim, storage_dtype(self.device).itemsize)
        self._check_tenant_room(size, tenant)
        self._check_room(size)
        now = self._clock()
        memory = ExactMemory(streams, dim, value_dim, capacity, self.device)
        session = Session(secrets.token_hex(16), memory, idle, None if lifetime is None else now + lifetime, now,
                          tenant=tenant.name)
        self._sessions[session.memory_id] = session
        return session

    def _check_tenant_room(self, size: int, tenant: Tenant) -> None:
        """Refuse a new session of `size` bytes past its tenant's max_memory_sessions or max_memory_bytes."""
        q, exhausted, where = tenant.quotas, grpc.StatusCode.RESOURCE_EXHAUSTED, f"tenant {tenant.name!r}"
        own = [s for s in self._sessions.values() if s.tenant == tenant.name]
        if q.max_memory_sessions is not None and len(own) >= q.max_memory_sessions:
            raise InvalidRequest(where, f"max_memory_sessions {q.max_memory_sessions} reached", exhausted)
        reserved = sum(s.reserved_bytes for s in own)
        if q.max_memory_bytes is not None and reserved + size > q.max_memory_bytes:
            raise InvalidRequest(where, f"max_memory_bytes {format_bytes(q.max_memory_bytes)} reached: {size} more "
                                 f"bytes do not fit beside the {reserved} its sessions reserve", exhausted)

    def _check_room(self, size: int) -> None:
        """Refuse a new session of `size` bytes past the session count or a byte limit (before it is allocated)."""
        o, exhausted = self.options, grpc.StatusCode.RESOURCE_EXHAUSTED
        if len(self._sessions) >= o.max_sessions:
            raise InvalidRequest("max_sessions", f"{len(self._sessions)} memory sessions open, the most this server "
                                 "holds (--max-memory-sessions); drop one or retry later", exhausted)
        if size > o.max_session_bytes:
            raise InvalidRequest("max_session_bytes", f"streams x capacity x (dim + value_dim) x dtype size = {size} "
                                 f"bytes ({format_bytes(size)}), at most {o.max_session_bytes} "
                                 f"({format_bytes(o.max_session_bytes)}) per session (--max-memory-session-bytes)",
                                 exhausted)
        reserved = self.reserved_bytes
        if reserved + size > o.max_total_bytes:
            raise InvalidRequest("max_total_bytes", f"{size} more bytes do not fit: {reserved} of {o.max_total_bytes} "
                                 f"({format_bytes(o.max_total_bytes)}) reserved (--max-memory-total-bytes)", exhausted)

    def get(self, memory_id: str) -> Session:
        """The live session `memory_id` of the calling tenant, or InvalidRequest NOT_FOUND (unknown, dropped,
        expired, or another tenant's: answered exactly as an id that never existed, so an id says nothing)."""
        session = self._sessions.get(memory_id)
        if session is not None and session.expired(self._clock()):
            self._drop(memory_id)
            session = None
        if session is not None and session.tenant != current_tenant().name:
            session = None
        if session is None:
            raise InvalidRequest("memory_id", f"no memory session {memory_id[:64]!r} (never created, dropped, or "
                                 "expired after its idle timeout or lifetime)", grpc.StatusCode.NOT_FOUND)
        return session

    async def run(self, session: Session, work: Callable[[ExactMemory], object]) -> object:
        """work(session.memory) on a worker thread, after the session's earlier calls; the session's idle
        clock restarts when it ends."""
        async with session.lock:
            if session.memory_id not in self._sessions:  # dropped while this call waited for the lock
                raise InvalidRequest("memory_id", "the memory session was dropped", grpc.StatusCode.NOT_FOUND)
            try:
                return await asyncio.get_running_loop().run_in_executor(self._executor, work, session.memory)
            finally:
                session.last_used = self._clock()

    async def drop(self, memory_id: str) -> None:
        """End session `memory_id` (NOT_FOUND when it is gone), after any call of it that is running."""
        session = self.get(memory_id)
        async with session.lock:
            self._drop(memory_id)

    def _drop(self, memory_id: str) -> None:
        session = self._sessions.pop(memory_id, None)
        if session is not None:
            session.memory.close()

    def reap(self) -> int:
        """Drop every expired session now; returns how many."""
        now = self._clock()
        dead = [i for i, s in self._sessions.items() if s.expired(now)]
        for memory_id in dead:
            self._drop(memory_id)
        return len(dead)

    def _next_expiry(self) -> float | None:
        times = [t for s in self._sessions.values()
                 for t in (s.deadline, s.last_used + s.idle_timeout_s) if t is not None]
        return min(times) if times else None

    async def _reap_forever(self) -> None:
        while True:
            self.reap()
            nxt = self._next_expiry()
            wait = REAP_INTERVAL_S if nxt is None else min(REAP_INTERVAL_S, max(0.01, nxt - self._clock()))
            await asyncio.sleep(wait)


# ---------------------------------------------------------------------------------------------
# Servicer


def _entries(request: retrieval_pb2.AppendMemoryRequest, memory: ExactMemory) -> tuple[torch.Tensor, ...]:
    """Checked (keys (S, T, d), values (S, T, dv), valid (S, T) bool) of an AppendMemoryRequest."""
    S, d, dv = memory.streams, memory.dim, memory.value_dim
    for name in ("keys", "values", "valid"):
        if not request.HasField(name):
            raise InvalidRequest(name, "missing")
    keys = tensor_to_torch(request.keys, "keys", FLOAT_DTYPES, 3)  # (S, T, d)
    values = tensor_to_torch(request.values, "values", FLOAT_DTYPES, 3)  # (S, T, dv)
    valid = tensor_to_torch(request.valid, "valid", (tensor_pb2.DTYPE_BOOL,), 2)  # (S, T)
    T = keys.shape[1]
    if keys.shape[0] != S or keys.shape[2] != d:
        raise InvalidRequest("keys.shape", f"{list(keys.shape)}, the memory wants [{S}, T, {d}]")
    if tuple(values.shape) != (S, T, dv):
        raise InvalidRequest("values.shape", f"{list(values.shape)}, the memory wants [{S}, {T}, {dv}] (T of keys)")
    if tuple(valid.shape) != (S, T):
        raise InvalidRequest("valid.shape", f"{list(valid.shape)}, the memory wants [{S}, {T}]")
    for name, t in (("keys", keys), ("values", values)):
        if not bool(torch.isfinite(t).all()):
            raise InvalidRequest(f"{name}.data", "contains NaN or infinity")
    return keys, values, valid


def _queries(request: retrieval_pb2.SearchMemoryRequest, memory: ExactMemory, max_message_bytes: int) -> torch.Tensor:
    """Checked queries (S, Q, d) of a SearchMemoryRequest, in the memory's storage dtype."""
    if not request.HasField("queries"):
        raise InvalidRequest("queries", "missing; send an (S, Q, d) float tensor")
    queries = tensor_to_torch(request.queries, "queries", FLOAT_DTYPES, 3)  # (S, Q, d)
    S, Q, d = queries.shape
    if S != memory.streams or d != memory.dim:
        raise InvalidRequest("queries.shape", f"{list(queries.shape)}, the memory wants [{memory.streams}, Q, {memory.dim}]")
    if Q == 0:
        raise InvalidRequest("queries.shape[1]", "no queries: send at least one per stream")
    if request.k < 1:
        raise InvalidRequest("k", f"{request.k}, must be >= 1")
    if request.k > MAX_K:
        raise InvalidRequest("k", f"{request.k}, at most {MAX_K}", grpc.StatusCode.OUT_OF_RANGE)
    dtype = memory.buffer.dtype
    if search_response_bytes(S, Q, request.k, d, memory.value_dim, dtype.itemsize) > max_message_bytes:
        raise InvalidRequest("queries.shape[1]", f"{Q} queries x k={request.k} do not fit one {max_message_bytes}-byte "
                             "response; split the batch", grpc.StatusCode.OUT_OF_RANGE)
    if not bool(torch.isfinite(queries).all()):
        raise InvalidRequest("queries.data", "contains NaN or infinity")
    # The storage dtype, as ExactMemory.search casts them: the results come back in it.
    return queries.to(dtype)


def _stream_mask(request: retrieval_pb2.ClearMemoryRequest, memory: ExactMemory) -> torch.Tensor:
    if not request.HasField("streams"):
        raise InvalidRequest("streams", "missing; send an (S,) bool mask")
    mask = tensor_to_torch(request.streams, "streams", (tensor_pb2.DTYPE_BOOL,), 1)  # (S,)
    if tuple(mask.shape) != (memory.streams,):
        raise InvalidRequest("streams.shape", f"{list(mask.shape)}, the memory has [{memory.streams}] streams")
    return mask


class MemoryServicer:
    """Thin servicer of MemoryService: validate, run on the session, encode."""

    def __init__(self, sessions: MemorySessions, max_message_bytes: int) -> None:
        self._sessions = sessions
        self._max_message_bytes = max_message_bytes

    async def CreateMemory(self, request: retrieval_pb2.CreateMemoryRequest, context):
        session = self._sessions.create(request)
        return retrieval_pb2.CreateMemoryResponse(
            memory_id=session.memory_id, idle_timeout_s=session.idle_timeout_s,
            storage_dtype=_WIRE_OF_TORCH[session.memory.buffer.dtype])

    async def AppendMemory(self, request: retrieval_pb2.AppendMemoryRequest, context):
        session = self._sessions.get(request.memory_id)
        keys, values, valid = _entries(request, session.memory)

        def append(memory: ExactMemory) -> torch.Tensor:
            memory.append(keys, values, valid)
            return memory.sizes()  # (S,)

        return retrieval_pb2.AppendMemoryResponse(sizes=torch_to_tensor(await self._sessions.run(session, append)))

    async def SearchMemory(self, request: retrieval_pb2.SearchMemoryRequest, context):
        session = self._sessions.get(request.memory_id)
        queries = _queries(request, session.memory, self._max_message_bytes)  # (S, Q, d)
        found = await self._sessions.run(session, lambda memory: memory.search(queries, request.k))
        return retrieval_pb2.SearchMemoryResponse(
            keys=torch_to_tensor(found.keys), values=torch_to_tensor(found.values), valid=torch_to_tensor(found.valid))

    async def ClearMemory(self, request: retrieval_pb2.ClearMemoryRequest, context):
        session = self._sessions.get(request.memory_id)
        mask = _stream_mask(request, session.memory)  # (S,)

        def clear(memory: ExactMemory) -> torch.Tensor:
            memory.clear(mask)
            return memory.sizes()  # (S,)

        return retrieval_pb2.ClearMemoryResponse(sizes=torch_to_tensor(await self._sessions.run(session, clear)))

    async def DropMemory(self, request: retrieval_pb2.DropMemoryRequest, context):
        await self._sessions.drop(request.memory_id)
        return retrieval_pb2.DropMemoryResponse()

    async def GetMemoryInfo(self, request, context):
        s, o = self._sessions, self._sessions.options
        s.reap()
        return retrieval_pb2.GetMemoryInfoResponse(
            max_sessions=o.max_sessions, max_session_bytes=o.max_session_bytes, max_total_bytes=o.max_total_bytes,
            default_idle_timeout_s=o.idle_timeout_s, max_idle_timeout_s=o.max_idle_timeout_s, max_k=MAX_K,
            max_message_bytes=self._max_message_bytes, sessions=len(s), reserved_entries=s.reserved_entries,
            reserved_bytes=s.reserved_bytes)


def torch_dtype_of(wire: int) -> torch.dtype:
    """The torch dtype of a float wire dtype (CreateMemoryResponse.storage_dtype)."""
    return _TORCH_OF_WIRE[wire]
