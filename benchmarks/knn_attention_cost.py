"""What the Memorizing Transformer's kNN attention costs (issue 10), ratios measured side by side in one run.

A RANDOM model (speed only: its weights, and so its retrievals, mean nothing), shaped like the issue's
measurement of lucidrains' memorizing-transformers-pytorch: dim 512, 8 layers, 8 heads of 64, vocab
20000, segment 512, batch 1, CPU, an XL memory of the previous segment in every layer, the kNN layer at
memlm.memory.config.memorizing_layer (layer 6 of 8), top-k 32:
1. a training step (forward, backward, AdamW step; everything trains) with the kNN layer over a full
   64K-entry exact memory vs the same model and XL memory without it (goal <= 1.1x; lucidrains measured
   1.15x with one memorizing layer on this machine);
2. evaluation tokens/s with a full memory of 4K and of 64K entries vs without the kNN layer;
3. the retrieval-service backend (a real retrieval server with memory sessions on port 0 on a thread of
   this process, so it shares the CPU; services/memory_sessions.py) vs in-process exact, at 4K,
   evaluation tokens/s.
Memories are filled before timing with random unit keys (a full memory costs what it costs whatever it
holds). The configurations compared run interleaved, step by step (segment by segment), so that the
load of a shared machine hits them alike; a ratio is the median of the adjacent pairs' ratios.

    python benchmarks/knn_attention_cost.py [--steps 3] [--eval-segments 4] [--repeats 3] [--threads N]

Shape legend: B rows (1), T segment, S streams (B * nkv), d head size, M memory entries per stream.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import threading
import time

import _common  # noqa: F401  (puts the repository on sys.path)
import torch
import torch.nn.functional as F

from memlm.jobs.memorizing import fresh_knn_attention, open_knn_store, open_memory
from memlm.memory.config import MemoryConfig, memorizing_layer
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


@torch.no_grad()
def time_search(store, rounds: int) -> float:
    """Median seconds of one segment's kNN search alone: B * nh * T unit queries, top-32, in `store`."""
    g = torch.Generator().manual_seed(2)
    G = MODEL.n_head // MODEL.n_kv_head
    q = F.normalize(torch.randn(store.streams, G * SEGMENT, store.dim, generator=g), dim=-1)  # (S, Q, d)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        store.search(q, 32)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def paired_ratio(times: dict[str, list[float]], name: str, base: str) -> float:
    """Median over rounds of times[name] / times[base] (each round's two runs were adjacent in time)."""
    return statistics.median(a / b for a, b in zip(times[name], times[base]))


def service_factory():
    """A real retrieval server with memory sessions (services/memory_sessions.py) on port 0, on an asyncio
    loop in a thread of this process, and its KeyValueMemory factory; (None, None) when it is missing."""
    try:
        from services.memory_client import remote_memory_factory
        from services.memory_sessions import MemoryOptions
        from services.retrieval_server import create_retrieval_server
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3, help="timed training steps per configuration and repeat")
    p.add_argument("--eval-segments", type=int, default=4, help="timed evaluation segments per configuration and repeat")
    p.add_argument("--repeats", type=int, default=3, help="repeats (rounds = steps x repeats; medians reported)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        import faiss  # the exact CPU scan runs in FAISS's OpenMP pool (memlm.retrieval.memory_store)

        torch.set_num_threads(args.threads)
        faiss.omp_set_num_threads(args.threads)
    print(f"# python benchmarks/knn_attention_cost.py --steps {args.steps} --eval-segments {args.eval_segments} "
          f"--repeats {args.repeats}" + (f" --threads {args.threads}" if args.threads else ""))
    print("# RANDOM MODEL (speed only): dim 512, 8 layers, 8 heads x 64, vocab 20000, segment 512, batch 1, "
          f"kNN layer {memorizing_layer(memory_config(1), MODEL.n_layer)}, top-k 32, XL memory 512, CPU, "
          f"{torch.get_num_threads()} torch threads, load {os.getloadavg()[0]:.2f}")
    model = random_model(MODEL, 0, "cpu", torch.float32)
    knn = fresh_knn_attention(model)
    rounds = args.steps * args.repeats
    model.train()
    state, store = filled_state(model, memory_config(65536), knn, True)
    tr = time_train(model, {"xl": (xl_state(model, True), None), "64K": (state, knn)}, rounds)
    search = time_search(store, rounds)
    store.close()
    print(f"train step  xl only {statistics.median(tr['xl']) * 1e3:8.1f} ms | kNN 64K exact "
          f"{statistics.median(tr['64K']) * 1e3:8.1f} ms | ratio {paired_ratio(tr, '64K', 'xl'):.3f}x "
          "(goal <= 1.1x; lucidrains 1.15x)")
    print(f"            of which the 64K exact search alone (one segment's queries, {SEGMENT * MODEL.n_head} per row): "
          f"{search * 1e3:.1f} ms")
    model.eval()
    lanes, stores = {"xl": xl_state(model, False)}, []
    for name, size in (("4K", 4096), ("64K", 65536)):
        lanes[name], store = filled_state(model, memory_config(size), knn, False)
        stores.append(store)
    ev = time_eval(model, lanes, args.eval_segments * args.repeats)
    for store in stores:
        store.close()
    tps = {name: SEGMENT / statistics.median(t) for name, t in ev.items()}
    print(f"eval tok/s  xl only {tps['xl']:8.0f} | kNN 4K {tps['4K']:8.0f} ({1 / paired_ratio(ev, '4K', 'xl'):.3f}x) | "
          f"kNN 64K {tps['64K']:8.0f} ({1 / paired_ratio(ev, '64K', 'xl'):.3f}x)")
    factory, stop_server = service_factory()
    if factory is not None:
        remote, remote_store = filled_state(model, memory_config(4096, "service"), knn, False, factory)
        local, local_store = filled_state(model, memory_config(4096), knn, False)
        sv = time_eval(model, {"service": remote, "local": local}, args.eval_segments * args.repeats)
        remote_store.close()
        local_store.close()
        print(f"service     kNN 4K in-process {SEGMENT / statistics.median(sv['local']):8.0f} tok/s | retrieval "
              f"service {SEGMENT / statistics.median(sv['service']):8.0f} tok/s | ratio "
              f"{1 / paired_ratio(sv, 'service', 'local'):.3f}x")
        factory.close()
        stop_server()
    print(f"# load after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
