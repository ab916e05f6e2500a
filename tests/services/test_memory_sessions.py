"""MemoryService session memories: a real retrieval server on port 0 against the
in-process ExactMemory oracle (exact equality), FIFO at capacity, the server's limits, expiry,
NOT_FOUND, field-naming errors, authentication, and messages split to fit.

Shape legend: S streams, T entries per stream, Q queries per stream, k neighbours, d key dimension,
dv value dimension.
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from grpc_health.v1 import health_pb2, health_pb2_grpc

from memlm.memory.knn_store_factory import open_key_value_memory
from memlm.memory.knn_store import ExactMemory
from memlm.v1 import retrieval_pb2, retrieval_pb2_grpc
from services.retrieval.memory_client import MemoryClient, RemoteMemory, remote_memory_factory
from services.retrieval.memory_sessions import MemoryOptions, torch_to_tensor
from services.retrieval.client import RetrievalClient
from services.retrieval.server import create_retrieval_server
from services.common.server import ServerOptions, ServiceError, open_channel

S, D, DV = 3, 8, 6


DEFAULT_MEMORIES = MemoryOptions()


def start(loop_thread, memories: MemoryOptions | None = DEFAULT_MEMORIES, searcher=None, **server) -> str:
    port = loop_thread.start(create_retrieval_server, "127.0.0.1:0", searcher, memories=memories,
                             options=ServerOptions(**server))
    return f"127.0.0.1:{port}"


@pytest.fixture
def client(loop_thread):
    c = MemoryClient(start(loop_thread, MemoryOptions(max_sessions=4)), timeout=20)
    yield c
    c.close()


def entries(t: int, seed: int, p_valid: float = 0.8) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    keys = F.normalize(torch.randn(S, t, D, generator=g), dim=-1)  # (S, T, d)
    values = torch.randn(S, t, DV, generator=g)  # (S, T, dv)
    valid = torch.rand(S, t, generator=g) < p_valid  # (S, T)
    return keys, values, valid


def queries(q: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(S, q, D, generator=g), dim=-1).to(dtype)  # (S, Q, d)


def assert_same(remote, local) -> None:
    for a, b in zip(remote, local):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)


def wait_until(predicate, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.02)


# ---------------------------------------------------------------------------------------------------- the oracle


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_remote_memory_answers_what_exact_memory_answers(client, dtype):
    capacity = 10
    remote, local = client(S, D, DV, capacity), ExactMemory(S, D, DV, capacity)
    assert isinstance(remote, RemoteMemory) and remote.storage_dtype == local.buffer.dtype
    for memory in (remote, local):  # an empty memory: nothing valid
        assert not memory.search(queries(2, 0, dtype), 3).valid.any()
    steps = [("append", entries(4, 1)), ("search", 3), ("append", entries(12, 2)),  # 4 + 12 > capacity: FIFO
             ("search", 12), ("clear", torch.tensor([False, True, False])), ("search", 5),
             ("append", entries(3, 3, p_valid=1.0)), ("search", 4)]
    for i, (op, arg) in enumerate(steps):
        if op == "append":
            remote.append(*(a.to(dtype) if a.is_floating_point() else a for a in arg))
            local.append(*(a.to(dtype) if a.is_floating_point() else a for a in arg))
        elif op == "clear":
            remote.clear(arg)
            local.clear(arg)
        else:
            q = queries(7, 10 + i, dtype)
            assert_same(remote.search(q, arg), local.search(q, arg))
        assert torch.equal(remote.sizes(), local.sizes())
    assert remote.sizes().tolist()[1] == 3 and remote.sizes().tolist()[0] == capacity
    remote.close()
    remote.close()  # idempotent


def test_fifo_eviction_keeps_the_newest_entries_in_order(client):
    capacity = 4
    memory = client(S, D, 1, capacity)
    g = torch.Generator().manual_seed(5)
    for lo in (0, 3, 5):  # entries 0..2, then 3..4, then 5..8 (two calls wrap the ring)
        t = {0: 3, 3: 2, 5: 4}[lo]
        keys = F.normalize(torch.randn(S, t, D, generator=g), dim=-1)  # (S, T, d)
        numbers = torch.arange(lo, lo + t, dtype=torch.float32).expand(S, t)[..., None]  # (S, T, 1)
        memory.append(keys, numbers, torch.ones(S, t, dtype=torch.bool))
        found = memory.search(queries(1, lo), capacity)  # k = capacity: every live entry
        held = {int(v) for v in found.values[found.valid].flatten().tolist()}
        total = lo + t
        assert held == set(range(max(0, total - capacity), total))  # exactly the newest `capacity`
    assert memory.sizes().tolist() == [capacity] * S


def test_open_key_value_memory_service_backend(client):
    memory = open_key_value_memory("service", S, D, DV, 16, "cpu", service=client)
    assert isinstance(memory, RemoteMemory) and memory.capacity == 16
    memory.close()
    with pytest.raises(ValueError, match="needs a memory factory"):
        open_key_value_memory("service", S, D, DV, 16, "cpu")


# ---------------------------------------------------------------------------------------------------- limits and expiry


def test_session_and_byte_limits_are_resource_exhausted_before_any_allocation(loop_thread):
    entry = (D + DV) * 4  # bytes of one float32 entry (the CPU storage dtype)
    opts = MemoryOptions(max_sessions=2, max_session_bytes=300 * entry, max_total_bytes=500 * entry)
    with MemoryClient(start(loop_thread, opts), timeout=20) as client:
        with pytest.raises(ServiceError, match="--max-memory-session-bytes") as e:
            client(S, D, DV, 101)  # 303 entries > 300
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and f"{303 * entry} bytes" in e.value.details
        with pytest.raises(ServiceError, match="--max-memory-session-bytes"):
            client(S, D, DV, 1 << 40)  # far past any memory: refused by arithmetic, nothing allocated
        first = client(S, D, DV, 100)  # 300 entries reserved
        with pytest.raises(ServiceError, match="--max-memory-total-bytes") as e:
            client(S, D, DV, 67)  # 300 + 201 > 500
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        second = client(S, D, DV, 66)
        with pytest.raises(ServiceError, match="--max-memory-sessions") as e:
            client(1, D, DV, 1)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        info = client.info(refresh=True)
        assert (info.sessions, info.reserved_entries, info.max_sessions) == (2, 498, 2)
        assert (info.reserved_bytes, info.max_session_bytes, info.max_total_bytes) == (498 * entry, 300 * entry,
                                                                                         500 * entry)
        first.close()  # dropping frees the slot and the entries
        client(1, D, DV, 1).close()
        second.close()


def test_idle_session_is_dropped_and_then_not_found(loop_thread):
    with MemoryClient(start(loop_thread), timeout=20, idle_timeout_s=0.3) as client:
        memory = client(S, D, DV, 8)
        assert memory.idle_timeout_s == pytest.approx(0.3)
        memory.append(*entries(2, 0))
        assert client.info(refresh=True).sessions == 1
        wait_until(lambda: client.info(refresh=True).sessions == 0, timeout=5.0)  # the reaper, unasked
        with pytest.raises(ServiceError, match="memory_id: no memory session") as e:
            memory.search(queries(1, 0), 2)
        assert e.value.code == grpc.StatusCode.NOT_FOUND
        memory.close()  # an expired session: closing is no error


def test_lifetime_ends_a_busy_session(loop_thread):
    with MemoryClient(start(loop_thread), timeout=20, lifetime_s=0.5) as client:
        start_s = time.monotonic()  # before the session's clock starts on the server
        memory = client(S, D, DV, 8)
        with pytest.raises(ServiceError) as e:
            while time.monotonic() - start_s < 5.0:  # busy all along: only the deadline can end it
                memory.append(*entries(1, 0))
        assert e.value.code == grpc.StatusCode.NOT_FOUND and time.monotonic() - start_s >= 0.5
        # The remote contents are unknown after a failed append: the memory refuses to guess.
        with pytest.raises(ValueError, match="unusable: AppendMemory failed"):
            memory.search(queries(1, 0), 2)


def test_unknown_id_is_not_found(client):
    stub = retrieval_pb2_grpc.MemoryServiceStub(open_channel(client.address, None, 1 << 20))
    with pytest.raises(grpc.RpcError) as e:
        stub.DropMemory(retrieval_pb2.DropMemoryRequest(memory_id="no-such-memory"), timeout=10)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and e.value.details().startswith("memory_id:")
    memory = client(S, D, DV, 4)
    client.call("DropMemory", retrieval_pb2.DropMemoryRequest(memory_id=memory.memory_id))
    with pytest.raises(ServiceError, match="NOT_FOUND"):
        client.call("DropMemory", retrieval_pb2.DropMemoryRequest(memory_id=memory.memory_id))


# ---------------------------------------------------------------------------------------------------- bad requests


def _raw_append(memory: RemoteMemory, keys, values, valid) -> retrieval_pb2.AppendMemoryRequest:
    return retrieval_pb2.AppendMemoryRequest(memory_id=memory.memory_id, keys=torch_to_tensor(keys),
                                             values=torch_to_tensor(values), valid=torch_to_tensor(valid))


def test_bad_requests_name_the_field(client):
    memory = client(S, D, DV, 8)
    keys, values, valid = entries(2, 0)
    nan_keys = keys.clone()
    nan_keys[0, 0, 0] = float("nan")
    cases = {
        "keys.shape": _raw_append(memory, keys[:, :, :-1], values, valid),
        "values.shape": _raw_append(memory, keys, values[:, :1], valid),
        "valid.dtype": _raw_append(memory, keys, values, valid.float()),
        "keys.data": _raw_append(memory, nan_keys, values, valid),
    }
    for field, request in cases.items():
        with pytest.raises(ServiceError, match=f"INVALID_ARGUMENT: {field.replace('.', '[.]')}"):
            client.call("AppendMemory", request)
    search = {
        "k": retrieval_pb2.SearchMemoryRequest(memory_id=memory.memory_id, queries=torch_to_tensor(queries(1, 0)), k=0),
        "queries.shape[1]": retrieval_pb2.SearchMemoryRequest(
            memory_id=memory.memory_id, queries=torch_to_tensor(torch.zeros(S, 0, D)), k=1),
        "queries.shape": retrieval_pb2.SearchMemoryRequest(
            memory_id=memory.memory_id, queries=torch_to_tensor(torch.zeros(S + 1, 1, D)), k=1),
    }
    for field, request in search.items():
        with pytest.raises(ServiceError, match=f"INVALID_ARGUMENT: {field.replace('.', '[.]').replace('[1]', '.1.')}"):
            client.call("SearchMemory", request)
    create = {"capacity": {"capacity": 0}, "dim": {"dim": 4096}, "idle_timeout_s": {"idle_timeout_s": 1e9},
              "lifetime_s": {"lifetime_s": -1.0}}
    for field, change in create.items():
        request = retrieval_pb2.CreateMemoryRequest(**{"streams": S, "dim": D, "value_dim": DV, "capacity": 8, **change})
        with pytest.raises(ServiceError, match=f"INVALID_ARGUMENT: {field}") as e:
            client.call("CreateMemory", request)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    # The session survived every refusal.
    memory.append(keys, values, valid)
    assert memory.sizes().tolist() == valid.sum(1).tolist()


def test_memory_calls_need_the_token(loop_thread):
    address = start(loop_thread, token="s3cret")
    with MemoryClient(address, timeout=20) as anonymous, pytest.raises(ServiceError, match="UNAUTHENTICATED"):
        anonymous(S, D, DV, 4)
    with MemoryClient(address, timeout=20, token="s3cret") as holder:
        holder(S, D, DV, 4).close()


def test_big_calls_are_split_to_fit_the_messages(loop_thread):
    """A server taking 64 KiB messages: one (S, 512, 8) float32 append or a (S, 64, k 16) search answer is
    bigger than that, so the client splits them; the answers still equal the in-process memory's."""
    address = start(loop_thread, max_message_bytes=1 << 16)
    with MemoryClient(address, timeout=20, max_message_bytes=1 << 16) as client:
        remote, local = client(S, D, DV, 400), ExactMemory(S, D, DV, 400)
        for memory in (remote, local):
            memory.append(*entries(512, 7))
        q = queries(64, 8)
        assert_same(remote.search(q, 16), local.search(q, 16))
        whole = retrieval_pb2.SearchMemoryRequest(memory_id=remote.memory_id, queries=torch_to_tensor(q), k=16)
        with pytest.raises(ServiceError, match="OUT_OF_RANGE: queries.shape.1.*split the batch"):
            client.call("SearchMemory", whole)


def test_memories_with_and_without_a_datastore(loop_thread, searcher):
    # Memories only: RetrievalService is not there at all; health knows MemoryService alone.
    address = start(loop_thread)
    with RetrievalClient(address, timeout=20) as retrieval, pytest.raises(ServiceError, match="UNIMPLEMENTED"):
        retrieval.search(np.zeros((1, 4), np.float32), 1)
    health = health_pb2_grpc.HealthStub(open_channel(address, None, 1 << 20))
    check = health_pb2.HealthCheckRequest
    assert health.Check(check(service="memlm.v1.MemoryService"), timeout=10).status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as e:
        health.Check(check(service="memlm.v1.RetrievalService"), timeout=10)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    # A datastore and memories on one server.
    address = start(loop_thread, searcher=searcher)
    with RetrievalClient(address, timeout=20) as retrieval, remote_memory_factory(address, timeout=20) as factory:
        assert retrieval.search(searcher.keys[:2], 1).ids[:, 0].tolist() == [0, 1]
        factory(S, D, DV, 4).close()
    # Neither: refused where the server is built.
    with pytest.raises(ValueError, match="needs a searcher"):
        start(loop_thread, memories=None)


# ---------------------------------------------------------------------------------------------------- the command line


def test_serve_retrieval_memories_only_process(tmp_path):
    """`memlm serve retrieval --memories` without a datastore: a real process, its limit flags in force."""
    import os
    import signal
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "memlm", "serve", "retrieval", "--memories", "--max-memory-sessions", "1",
           "--memory-idle-timeout", "30", "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()  # "listening on HOST:PORT", printed once healthy
        assert line.startswith("listening on "), (line, proc.stderr.read() if proc.poll() is not None else "")
        with MemoryClient(line.split()[-1], timeout=20) as client:
            info = client.info()
            assert (info.max_sessions, info.default_idle_timeout_s) == (1, 30.0)
            memory = client(S, D, DV, 4)
            with pytest.raises(ServiceError, match="--max-memory-sessions"):
                client(S, D, DV, 4)
            memory.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    bad = subprocess.run([sys.executable, "-m", "memlm", "serve", "retrieval", "--port", "0"], capture_output=True,
                         text=True, timeout=60, check=False)
    assert bad.returncode != 0 and "needs --datastore DIR, --memories" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------------------------------------------- the layer


def _memorizing_run(model, module, client, x: torch.Tensor, backend: str, capacity: int):
    """Logits (B, n, V) of 16-token segments of x (B, n) under a memorizing state on `backend`, a new
    document in row 0 at segment 3, and the kNN sizes at the end."""
    from memlm.jobs.memorizing import open_memory
    from memlm.model.memory_config import MemoryConfig

    config = MemoryConfig(kind="memorizing", mem_len=16, sink_tokens=2, knn_mem_size=capacity, knn_top_k=4,
                          knn_backend=backend)
    state = open_memory(model, config, x.shape[0], knn_attention=module, service=client)
    assert isinstance(state.store, RemoteMemory if backend == "service" else ExactMemory)
    logits = []
    with torch.no_grad():
        for i, s in enumerate(range(0, x.shape[1], 16)):
            if i == 3:
                state = state.reset_rows(torch.tensor([True, False]))
            out = model(x[:, s : s + 16], state)
            logits.append(out.logits)
            state = out.state
    sizes = state.knn_sizes()
    state.store.close()
    return torch.cat(logits, dim=1), sizes


@pytest.mark.parametrize("capacity", [24, 256])  # 24: FIFO evicts during the run
def test_memorizing_layer_outputs_are_the_same_with_the_service_backend(client, capacity):
    """The issue's test: a tiny memorizing model over a few segments (with a document boundary in one row)
    gives bit-identical logits and memory sizes whether its kNN memory is in-process (exact, the CPU
    storage dtype) or a session on the retrieval service."""
    from memlm.memory.memorizing import new_knn_attention
    from memlm.model.config import ModelConfig
    from memlm.model.decoder import build_model

    torch.manual_seed(0)
    model = build_model(ModelConfig.from_name("tiny", n_layer=2))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else None
    model.eval()
    module = new_knn_attention(model.config)
    x = torch.randint(0, 512, (2, 80))  # (B, n)
    with torch.no_grad():
        module.gate_logit.fill_(0.0)  # g = 0.5: the retrieved half counts
    local, local_sizes = _memorizing_run(model, module, client, x, "exact", capacity)
    remote, remote_sizes = _memorizing_run(model, module, client, x, "service", capacity)
    assert torch.equal(remote, local)
    assert torch.equal(remote_sizes, local_sizes) and local_sizes.sum() > 0
    # The retrieved entries did shape those logits: beside the same run with the gate at 0 exactly, the first
    # segment (an empty memory) is the same and the later ones are not.
    with torch.no_grad():
        module.gate_logit.fill_(-1e4)
    no_memory, _ = _memorizing_run(model, module, client, x, "exact", capacity)
    assert torch.equal(no_memory[:, :16], local[:, :16])
    assert not torch.allclose(no_memory[:, 16:], local[:, 16:], atol=1e-3)
