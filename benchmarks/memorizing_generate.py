"""Memorizing generation (Wu et al. 2022) through the decoding engine, a batch of rows vs memlm.engine.generate
(one request at a time, one token a step), ratios measured side by side in one run on the
same weights, prompts and memory settings:

1. identical greedy tokens, engine (all --streams rows in one batch) vs one sequence, per prompt, in every repeat
   (the command exits 1 otherwise; so does figure 5's service backend against in-process);
2. aggregate tokens/s of --streams requests in one engine batch vs the same requests one after another on the
   one-sequence path (MEMORIZING calls taking turns, one token each);
3. batch-1 tokens/s, engine vs one sequence (the XL ring with rotary applied once vs the library's XL memory);
4. what the kNN memory costs in the engine: --streams memorizing rows vs the same rows with the XL memory alone
   (the same segment, mem_len and sinks);
5. with --knn-service HOST:PORT (`memlm serve retrieval --memories --port 0`): the --streams rows with their memories
   in that server's sessions, their searches sent at once (memlm.engine.memorizing_rows.MemorizingRows.pool) vs
   one after another (runs in the order ABBA), and vs the in-process backend (one run, counted twice).
Prompts are --prompt-tokens of different SOTU speeches (longer than a segment: the kNN memory fills during the
prompt and is read at every step). The kNN attention is a fresh module (its gate does not change the cost).

    python benchmarks/memorizing_generate.py [--model M] [--streams 8] [--prompt-tokens 256] [--new-tokens 32]
        [--segment 128] [--mem-len 128] [--knn-mem-size 4096] [--knn-top-k 32] [--knn-backend exact]
        [--repeats 1] [--knn-service HOST:PORT] [--synthetic] [--results DIR]

Writes docs/results/data/memorizing_generate.json (benchmarks/harness.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import _common
import harness
import torch

from memlm.engine.engine import Engine, run_all
from memlm.engine.requests import EngineConfig, GenerationRequest
from memlm.engine.generate import generate
from memlm.jobs.decoding import SamplingConfig, TokenEvent
from memlm.jobs.memorizing import fresh_knn_attention
from memlm.model.memory_config import MemoryConfig

GREEDY = SamplingConfig(temperature=0.0)


def tokens(events) -> list[int]:
    return [e.token_id for e in events if isinstance(e, TokenEvent)]


def one_sequence(bench, memory: MemoryConfig, module, req: GenerationRequest) -> list[int]:
    pre = bench.pre
    return tokens(generate(pre.model, pre.tokenizer, list(req.prompt_ids), max_new_tokens=req.max_new_tokens,
                           sampling=req.sampling, boundary_token=req.boundary_token, memory=memory,
                           knn_attention=module))


def engine_run(bench, memory: MemoryConfig, module, reqs: list[GenerationRequest], batch: int, service=None,
               at_once: bool = True) -> list[list[int]]:
    config = EngineConfig(max_batch=batch, memory=memory)
    engine = Engine(bench.pre.model, bench.pre.tokenizer, config, knn_attention=module, knn_service=service)
    if not at_once:  # the comparison of figure 5: the rows' service searches one after another
        engine.memorizing.pool = None
    return [tokens(ev) for ev in run_all(engine, reqs)]


def service_figure(bench, memory: MemoryConfig, module, reqs: list[GenerationRequest], address: str,
                   result: harness.Result) -> None:
    """Figure 5: the rows' memories in a memory server's sessions, searches at once vs one after another."""
    from services.retrieval.memory_client import remote_memory_factory

    remote = dataclasses.replace(memory, knn_backend="service")
    client = remote_memory_factory(address, timeout=120)
    try:
        s_local, want = timed(lambda: engine_run(bench, memory, module, reqs, len(reqs)))
        s_once = s_serial = 0.0
        same = len(reqs)
        for i, at_once in enumerate((True, False, False, True)):  # ABBA: run order alone moves the ratio
            s, got = timed(lambda a=at_once: engine_run(bench, remote, module, reqs, len(reqs), client, a))
            same = min(same, sum(g == w for g, w in zip(got, want)))
            result.check(f"5. service backend's tokens identical to in-process, run {i + 1}",
                         all(g == w for g, w in zip(got, want)))
            s_once, s_serial = (s_once + s, s_serial) if at_once else (s_once, s_serial + s)
    finally:
        client.close()
    s_local *= 2  # the same two runs' worth as each side
    result.figures.update({"5_searches_at_once_over_one_after_another": s_serial / s_once,
                           "5_service_over_in_process": s_local / s_once})
    print(f"5. service backend, {len(reqs)} streams: identical tokens {same}/{len(reqs)}; searches at once "
          f"{s_serial / s_once:.2f}x of one after another; service (at once) {s_local / s_once:.2f}x of in-process "
          f"{memory.knn_backend} (wall of two runs each: {s_once:.1f} s, {s_serial:.1f} s, {s_local:.1f} s)")


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: smollm2-135m (random presets only with --synthetic)")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--segment", type=int, default=128)
    p.add_argument("--mem-len", type=int, default=128)
    p.add_argument("--knn-mem-size", type=int, default=4096)
    p.add_argument("--knn-top-k", type=int, default=32)
    p.add_argument("--knn-backend", default="exact")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--knn-service", default=None, metavar="HOST:PORT", help="a memory server: figure 5")
    _common.add_synthetic_flag(p)
    harness.add_options(p, "memorizing_generate")
    args = p.parse_args()
    result = harness.Result.from_args(args)

    bench = _common.load_model(args.model, args.synthetic)
    docs, random_tokens = _common.load_tokens(bench, "sotu", None, args.streams * 15000,  # ~10K tokens a speech
                                              args.synthetic)
    result.set_synthetic(bench.synthetic or random_tokens)
    prompts = [d[: args.prompt_tokens] for d in docs if len(d) >= args.prompt_tokens][: args.streams]
    if len(prompts) < args.streams:
        raise SystemExit(f"only {len(prompts)} documents of >= {args.prompt_tokens} tokens")
    memory = MemoryConfig("memorizing", segment=args.segment, mem_len=args.mem_len, knn_mem_size=args.knn_mem_size,
                          knn_top_k=args.knn_top_k, knn_backend=args.knn_backend)
    module = fresh_knn_attention(bench.pre.model)
    reqs = [GenerationRequest(tuple(pr), args.new_tokens, GREEDY, boundary_token=bench.boundary) for pr in prompts]
    print(f"model {bench.name}, {args.streams} prompts x {args.prompt_tokens} tokens, {args.new_tokens} new tokens "
          f"each; memorizing layer {module.n_head} heads, segment {args.segment}, mem_len {args.mem_len}, "
          f"knn_mem_size {args.knn_mem_size}, top-k {args.knn_top_k}, backend {args.knn_backend}; "
          f"torch threads {torch.get_num_threads()}")
    batched, serial, eng1, seq1 = [], [], [], []
    for r in range(args.repeats):
        s_batch, got = timed(lambda: engine_run(bench, memory, module, reqs, args.streams))
        s_serial, want = timed(lambda: [one_sequence(bench, memory, module, r) for r in reqs])
        same = sum(g == w for g, w in zip(got, want))
        parted = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
        result.check(f"1. engine's greedy tokens identical to one sequence's, repeat {r + 1}", not parted,
                     f"prompts {parted} part" if parted else "")
        print(f"1. identical greedy tokens, engine batch {args.streams} vs one sequence: {same}/{len(reqs)}")
        s_e1, _ = timed(lambda: engine_run(bench, memory, module, reqs[:1], 1))
        s_s1, _ = timed(lambda: one_sequence(bench, memory, module, reqs[0]))
        n = args.new_tokens
        batched.append(len(reqs) * n / s_batch)
        serial.append(len(reqs) * n / s_serial)
        eng1.append(n / s_e1)
        seq1.append(n / s_s1)
        print(f"2. {args.streams} streams: engine {batched[-1]:.1f} tokens/s vs one sequence after another "
              f"{serial[-1]:.1f} tokens/s: {batched[-1] / serial[-1]:.2f}x (prefill included)")
        print(f"3. batch 1: engine {eng1[-1]:.1f} tokens/s vs one sequence {seq1[-1]:.1f} tokens/s: "
              f"{eng1[-1] / seq1[-1]:.2f}x")
        s_xl, _ = timed(lambda: engine_run(bench, dataclasses.replace(memory, kind="xl"), None, reqs, args.streams))
        print(f"4. {args.streams} streams on the engine: memorizing {s_xl / s_batch:.2f}x of XL alone's tokens/s")
        result.rows.append({"repeat": r + 1, "identical": f"{same}/{len(reqs)}",
                            "engine_tokens_per_s": batched[-1], "one_sequence_tokens_per_s": serial[-1],
                            "streams_ratio": batched[-1] / serial[-1], "batch1_ratio": eng1[-1] / seq1[-1],
                            "memorizing_over_xl": s_xl / s_batch})
        if args.knn_service is not None:
            service_figure(bench, memory, module, reqs, args.knn_service, result)
    if args.repeats > 1:
        med = statistics.median
        print(f"median of {args.repeats}: {args.streams} streams {med(b / s for b, s in zip(batched, serial)):.2f}x, "
              f"batch 1 {med(e / s for e, s in zip(eng1, seq1)):.2f}x")
    result.figures.update({"streams_ratio": harness.stats([b / s for b, s in zip(batched, serial)]),
                           "batch1_ratio": harness.stats([e / s for e, s in zip(eng1, seq1)])})
    result.settings = {"model": bench.name, "dtype": "float32", "streams": args.streams,
                       "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "segment": args.segment,
                       "mem_len": args.mem_len, "knn_mem_size": args.knn_mem_size, "knn_top_k": args.knn_top_k,
                       "knn_backend": args.knn_backend, "repeats": args.repeats,
                       "knn_service": args.knn_service is not None, "threads": torch.get_num_threads()}
    result.write()


if __name__ == "__main__":
    main()
