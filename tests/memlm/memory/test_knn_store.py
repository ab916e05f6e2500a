"""The writable key/value memory seam and its exact torch backend, against oracles.

Oracles: a brute-force numpy top-k over the entries a FIFO should hold (a Python list of what was
appended, cut to the last `capacity`), and the entry numbers carried in the values.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from memlm.model.memory_config import (
    EXACT_MAX_ENTRIES,
    MemoryConfig,
    memorizing_layer,
    resolve_knn_backend,
)
from memlm.memory import knn_store as memory_store
from memlm.memory.knn_store_factory import open_key_value_memory
from memlm.memory.knn_store import ExactMemory


def unit(*shape: int) -> torch.Tensor:
    return torch.nn.functional.normalize(torch.randn(*shape), dim=-1)


def held_entries(memory: ExactMemory) -> list[set[int]]:
    """Entry numbers each stream holds (value[:, 0] carries the entry number), read through search."""
    S = memory.streams
    got = memory.search(unit(S, 1, memory.dim), memory.capacity)
    return [set(got.values[s, 0, got.valid[s, 0], 0].long().tolist()) for s in range(S)]


class Oracle:
    """What each stream should hold: every valid entry appended since its last clear, the last `capacity`."""

    def __init__(self, streams: int, capacity: int) -> None:
        self.capacity = capacity
        self.entries: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(streams)]

    def append(self, keys, values, valid) -> None:
        for s, row in enumerate(self.entries):
            row.extend((keys[s, t].numpy(), values[s, t].numpy()) for t in range(keys.shape[1]) if valid[s, t])
            del row[: max(0, len(row) - self.capacity)]

    def top_k(self, queries: torch.Tensor, k: int) -> list[list[np.ndarray]]:
        """Per stream, per query: the values of the k best entries, best first."""
        out = []
        for s, row in enumerate(self.entries):
            if not row:
                out.append([np.zeros((0, 0))] * queries.shape[1])  # (0, 0): nothing held
                continue
            keys = np.stack([key for key, _ in row])  # (n, d)
            values = np.stack([v for _, v in row])  # (n, dv)
            scores = queries[s].numpy() @ keys.T  # (Q, n)
            order = np.argsort(-scores, axis=1, kind="stable")[:, :k]  # (Q, <=k)
            out.append([values[o] for o in order])
        return out


def numbered(S: int, T: int, start: torch.Tensor, dv: int = 2) -> torch.Tensor:
    """Values (S, T, dv) whose first coordinate is each entry's number in its stream."""
    v = torch.zeros(S, T, dv)
    v[..., 0] = start[:, None] + torch.arange(T)[None, :]
    return v


def test_fifo_evicts_oldest_first_at_capacity():
    torch.manual_seed(0)
    S, d, cap = 3, 8, 5
    mem = ExactMemory(S, d, 2, cap, dtype=torch.float32)
    appended = [[] for _ in range(S)]  # entry numbers of the valid entries, in time order
    n = 0
    for T in (2, 4, 1, 7, 3):  # one append of 7 > capacity: only its last 5 survive
        valid = torch.rand(S, T) < 0.7
        values = numbered(S, T, torch.full((S,), float(n)))
        for s in range(S):
            appended[s] += [n + t for t in range(T) if valid[s, t]]
        mem.append(unit(S, T, d), values, valid)
        n += T
        assert [held for held in held_entries(mem)] == [set(a[-cap:]) for a in appended]
        assert mem.sizes().tolist() == [min(len(a), cap) for a in appended]


def test_fifo_order_survives_buffer_growth_and_wrap():
    # Capacity 3000 in appends of 700: the buffer grows 1024 -> 2048 -> 3000, then wraps around.
    S, d, cap = 2, 4, 3000
    mem = ExactMemory(S, d, 2, cap, dtype=torch.float32)
    for step in range(7):
        mem.append(unit(S, 700, d), numbered(S, 700, torch.full((S,), 700.0 * step)), torch.ones(S, 700, dtype=torch.bool))
        total = 700 * (step + 1)
        assert held_entries(mem) == [set(range(max(0, total - cap), total))] * S


def test_clear_one_stream_leaves_the_others():
    torch.manual_seed(1)
    S, d = 4, 8
    mem = ExactMemory(S, d, 2, 10, dtype=torch.float32)
    mem.append(unit(S, 6, d), numbered(S, 6, torch.zeros(S)), torch.ones(S, 6, dtype=torch.bool))
    before = held_entries(mem)
    mem.clear(torch.tensor([False, True, False, False]))
    after = held_entries(mem)
    assert after[1] == set() and mem.sizes().tolist() == [6, 0, 6, 6]
    assert [after[s] for s in (0, 2, 3)] == [before[s] for s in (0, 2, 3)]
    # The cleared stream starts again from nothing; the others keep their FIFO.
    mem.append(unit(S, 6, d), numbered(S, 6, torch.full((S,), 6.0)), torch.ones(S, 6, dtype=torch.bool))
    assert held_entries(mem) == [set(range(2, 12)), set(range(6, 12)), set(range(2, 12)), set(range(2, 12))]


@pytest.mark.parametrize(("scan", "budget"), [("faiss", 0), ("torch", 1 << 25), ("torch", 700)])
def test_exact_top_k_equals_brute_force(scan, budget, monkeypatch):
    # Both exact scans: FAISS's (float32 on CPU) and torch's (the GPU one; budget 700: many small chunks).
    monkeypatch.setattr(memory_store, "uses_faiss_scan", lambda buffer: scan == "faiss")
    monkeypatch.setattr(memory_store, "SCORE_BUDGET", budget)
    torch.manual_seed(2)
    S, d, dv, cap, k, Q = 3, 16, 5, 40, 6, 7
    mem = ExactMemory(S, d, dv, cap, dtype=torch.float32)
    oracle = Oracle(S, cap)
    for T in (9, 30, 25):
        keys, values = unit(S, T, d), torch.randn(S, T, dv)
        valid = torch.rand(S, T) < 0.8
        valid[2] = False  # stream 2 stays empty
        valid[1, 3:] = False  # stream 1 holds fewer than k entries
        mem.append(keys, values, valid)
        oracle.append(keys, values, valid)
        queries = unit(S, Q, d)
        got = mem.search(queries, k)
        assert got.keys.shape == (S, Q, k, d) and got.values.shape == (S, Q, k, dv) and got.valid.shape == (S, Q, k)
        want = oracle.top_k(queries, k)
        for s in range(S):
            for q in range(Q):
                n = len(want[s][q])
                assert got.valid[s, q].tolist() == [True] * n + [False] * (k - n)
                if n:
                    np.testing.assert_array_equal(got.values[s, q, :n].numpy(), want[s][q])
        # Returned keys are the stored keys: their scores are sorted, best first.
        scores = (got.keys * queries[:, :, None, :]).sum(-1)[0]  # (Q, k)
        assert bool((scores[:, :-1] >= scores[:, 1:]).all())


def test_search_of_an_empty_memory_finds_nothing():
    for dtype in (torch.float32, torch.bfloat16):  # the FAISS scan and the torch scan
        got = ExactMemory(2, 4, 3, 8, dtype=dtype).search(unit(2, 5, 4), 3)
        assert got.keys.shape == (2, 5, 3, 4) and got.values.shape == (2, 5, 3, 3) and not bool(got.valid.any())


def test_reduced_precision_storage_keeps_recall():
    # bfloat16 (the torch scan, as float16 on a GPU) ranks scores to about 0.004: the top-k may swap
    # near-ties, not miss neighbours. The CPU default is float32 (the FAISS scan).
    torch.manual_seed(3)
    S, d, cap, k = 2, 32, 2000, 16
    assert open_key_value_memory("exact", S, d, 2, cap, "cpu").buffer.dtype == torch.float32
    mem = ExactMemory(S, d, 2, cap, dtype=torch.bfloat16)
    keys = unit(S, cap, d)
    n = torch.arange(cap, dtype=torch.float32)
    # bfloat16 holds integers exactly only up to 256: the entry number travels as (n // 64, n % 64).
    values = torch.stack([n // 64, n % 64], dim=-1).expand(S, cap, 2)  # (S, N, 2)
    mem.append(keys, values, torch.ones(S, cap, dtype=torch.bool))
    queries = unit(S, 20, d)
    got = mem.search(queries, k)
    assert got.keys.dtype == torch.float32  # the queries' dtype
    ids = (got.values[..., 0] * 64 + got.values[..., 1]).long()  # (S, Q, k)
    want = torch.topk(queries @ keys.transpose(1, 2), k, dim=-1).indices  # (S, Q, k)
    hits = [len(set(ids[s, q].tolist()) & set(want[s, q].tolist())) for s in range(S) for q in range(20)]
    assert sum(hits) / (S * 20 * k) >= 0.95


def test_state_dict_round_trip_continues_the_fifo():
    torch.manual_seed(4)
    S, d, cap = 2, 4, 7
    a = ExactMemory(S, d, 2, cap, dtype=torch.float32)
    a.append(unit(S, 10, d), numbered(S, 10, torch.zeros(S)), torch.ones(S, 10, dtype=torch.bool))
    b = ExactMemory(S, d, 2, cap, dtype=torch.float32)
    b.load_state_dict(a.state_dict())
    for m in (a, b):
        m.append(unit(S, 3, d), numbered(S, 3, torch.full((S,), 10.0)), torch.ones(S, 3, dtype=torch.bool))
    assert held_entries(a) == held_entries(b) == [set(range(6, 13))] * S
    with pytest.raises(ValueError, match="capacity"):
        ExactMemory(S, d, 2, cap + 1).load_state_dict(a.state_dict())


def test_bad_shapes_are_refused_naming_the_argument():
    mem = ExactMemory(2, 4, 3, 8)
    with pytest.raises(ValueError, match="keys"):
        mem.append(torch.zeros(2, 5, 3), torch.zeros(2, 5, 3), torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="values"):
        mem.append(torch.zeros(2, 5, 4), torch.zeros(2, 5, 4), torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="valid"):
        mem.append(torch.zeros(2, 5, 4), torch.zeros(2, 5, 3), torch.ones(2, 5))
    with pytest.raises(ValueError, match="queries"):
        mem.search(torch.zeros(3, 1, 4), 2)
    mem.close()
    with pytest.raises(ValueError, match="closed"):
        mem.search(torch.zeros(2, 1, 4), 2)


def test_factory_and_backend_rules():
    assert isinstance(open_key_value_memory("auto", 1, 4, 4, 16, "cpu"), ExactMemory)
    with pytest.raises(ValueError, match="service"):
        open_key_value_memory("service", 1, 4, 4, 16, "cpu")
    made = []

    def factory(streams, dim, value_dim, capacity):
        made.append((streams, dim, value_dim, capacity))
        return ExactMemory(streams, dim, value_dim, capacity)

    open_key_value_memory("service", 2, 4, 3, 16, "cpu", factory)
    assert made == [(2, 4, 3, 16)]
    assert resolve_knn_backend(MemoryConfig(kind="memorizing")) == "exact"
    assert resolve_knn_backend(MemoryConfig(kind="memorizing", knn_mem_size=EXACT_MAX_ENTRIES + 1)) == "faiss"
    assert resolve_knn_backend(MemoryConfig(kind="memorizing", knn_backend="service")) == "service"
    assert memorizing_layer(MemoryConfig(kind="memorizing"), 30) == 22
    assert memorizing_layer(MemoryConfig(kind="memorizing", knn_layer=1), 2) == 1
    with pytest.raises(ValueError, match="knn_layer"):
        memorizing_layer(MemoryConfig(kind="memorizing", knn_layer=2), 2)
    with pytest.raises(ValueError, match="knn_backend"):
        MemoryConfig(kind="memorizing", knn_backend="hnsw")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the torch scan in float16)")
def test_gpu_memory_is_float16_and_agrees_with_the_cpu_oracle():
    torch.manual_seed(6)
    S, d, cap, k = 4, 64, 5000, 32
    mem = open_key_value_memory("exact", S, d, 2, cap, "cuda")
    assert mem.buffer.dtype == torch.float16 and not memory_store.uses_faiss_scan(mem.buffer)
    keys = unit(S, cap + 300, d)  # 300 over capacity: the first 300 are evicted
    n = torch.arange(cap + 300, dtype=torch.float32)
    values = torch.stack([n // 64, n % 64], dim=-1).expand(S, cap + 300, 2)  # float16-exact entry numbers
    mem.append(keys.cuda(), values.cuda(), torch.ones(S, cap + 300, dtype=torch.bool, device="cuda"))
    queries = unit(S, 64, d)
    got = mem.search(queries.cuda(), k)
    assert got.keys.device.type == "cuda" and got.keys.dtype == torch.float32
    ids = (got.values[..., 0] * 64 + got.values[..., 1]).long().cpu()  # (S, Q, k)
    assert int(ids.min()) >= 300  # nothing evicted is found
    want = torch.topk(queries @ keys[:, 300:].transpose(1, 2), k, dim=-1).indices + 300  # (S, Q, k)
    hits = sum(len(set(ids[s, q].tolist()) & set(want[s, q].tolist())) for s in range(S) for q in range(64))
    assert hits / (S * 64 * k) >= 0.95
