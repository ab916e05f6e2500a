"""Decoding speed of the engine, every figure a ratio of two sides measured in this one run on
the same weights, device and dtype:

1. cached decoding vs full recomputation, batch 1, --new-tokens (512) greedy tokens: the engine's steps
   are all timed; full recomputation (one forward over the whole sequence per token, logits of the last
   position only) is timed at the same sampled steps (every --recompute-every-th, 1 = all of them), and
   BOTH sides' totals are integrated from those same sampled steps (the engine's measured total is
   printed beside its sampled estimate): no side is extrapolated alone (goal >= 10x on CPU);
2. batch-1 decode tokens/s vs transformers' `generate` with its KV cache, greedy, same prompt and
   length (goal >= 1.0x);
3. aggregate tokens/s at 1, 8 and 32 concurrent streams through the engine vs the same requests one
   after another (goal >= 4x at 8 on CPU) and vs transformers' static batched `generate` at the same
   batch (goal >= 1.0x);
4. kNN-LM decoding vs base decoding at batch 8 (goal >= 0.8x): one search per step for all rows, over a
   datastore of the model's own keys (--datastore DIR, or an in-memory exact one over --knn-tokens
   SOTU tokens, default; its size is printed);
6. fixed-shape decode steps (EngineConfig.cuda_graphs: a CUDA graph per row bucket on a GPU, the same step run
   eagerly on a CPU, memlm.engine.decode_graphs) vs the ordinary step, at each of --graph-streams streams,
   --decode-tokens greedy tokens each; tokens compared: they must be identical in every round (the command exits 1
   otherwise). Not in the default figures.
Prompts are real SOTU text (--prompt-tokens each, from different speeches). SmolLM2 by default; a random
model only with --synthetic (the output then says so). With --peak-gbs (the card's memory bandwidth) the
batch-1 decode bandwidth utilisation is printed (with figure 1): bytes of weights and KV cache read per step
over the median step time. Each figure is printed as soon as it is measured.

    python benchmarks/generate_speed.py [--device cpu] [--dtype float32] [--new-tokens 512]
        [--recompute-every 32] [--streams 1,8,32] [--stream-tokens 32] [--synthetic] [--peak-gbs GB/s]
        [--figures 1,2,3,4,6] [--graph-streams 1,8] [--repeats 1] [--clock wall|cpu] [--prefill-chunk 256]
        [--engine-gemm mkl|onednn] [--results DIR] [--result-name NAME]

Writes docs/results/data/generate_speed.json (benchmarks/harness.py; benchmarks/gpu_generate.sh names its result
generate_speed_gpu); the in-memory datastore of figure 4 is built before its timings, its seconds beside them.

The engine and transformers do the same work per token, and the engine more: greedy on both sides, logits of
the last position only (transformers' generate keeps one), and the engine also gives every token's log-prob
(a logsumexp over V per row) where generate gives none. Our decoder's float32 CPU projections run oneDNN's
GEMM (memlm.model.cpu_gemm.cpu_float32_gemm), transformers' nn.Linear MKL's: --engine-gemm mkl runs our side
on MKL's too (memlm.model.cpu_gemm.float32_gemm_on_mkl), to show what the kernel gives and what the rest of the engine does.
"""

from __future__ import annotations

import argparse
import statistics
import time

import _common
import harness
import numpy as np
import torch
from forward_throughput import hf_twin

from memlm.engine.engine import Engine, run_all
from memlm.engine.requests import EngineConfig, GenerationRequest
from memlm.jobs.decoding import SamplingConfig, TokenEvent
from memlm.model.cpu_gemm import CPU_GEMM_NAMES, DEFAULT_CPU_GEMM, cpu_gemm_as
from memlm.model.device import synchronize
from memlm.retrieval.knnlm import KNNLMConfig

GREEDY = SamplingConfig(temperature=0.0)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="preset or path (default smollm2-135m)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=512, help="tokens of the cached vs recomputation figure")
    p.add_argument("--recompute-every", type=int, default=32, help="full recomputation timed every N-th step")
    p.add_argument("--decode-tokens", type=int, default=128, help="tokens of the batch-1 figure vs transformers")
    p.add_argument("--streams", default="1,8,32", help="concurrent streams of the aggregate figure")
    p.add_argument("--stream-tokens", type=int, default=32, help="new tokens per stream")
    p.add_argument("--prefill-chunk", type=int, default=EngineConfig.prefill_chunk,
                   help="the engine's prompt tokens per step (EngineConfig.prefill_chunk)")
    p.add_argument("--knn-batch", type=int, default=8)
    p.add_argument("--knn-tokens", type=int, default=4096, help="datastore size when --datastore is not given")
    p.add_argument("--datastore", default=None, help="a built datastore for the kNN-LM figure")
    p.add_argument("--repeats", type=int, default=1, help="alternating runs per side (median)")
    p.add_argument("--peak-gbs", type=float, default=None, help="the device's memory bandwidth, GB/s")
    p.add_argument("--graph-streams", default="1,8", help="concurrent streams of figure 6 (fixed-shape steps)")
    p.add_argument("--figures", default="1,2,3,4", help="which figures to measure (e.g. 2 for batch-1 only)")
    p.add_argument("--clock", default="wall", choices=sorted(CLOCKS), help="wall time, or process CPU time (cpu: "
                   "for a CPU shared with other jobs, with OMP_NUM_THREADS=1; tokens/s then per CPU-second)")
    p.add_argument("--engine-gemm", default=DEFAULT_CPU_GEMM, choices=CPU_GEMM_NAMES,
                   help=f"our side's float32 CPU GEMM: the decoder's default ({DEFAULT_CPU_GEMM}), or MKL's as transformers' nn.Linear")
    _common.add_synthetic_flag(p)
    harness.add_options(p, "generate_speed")
    return p.parse_args()


def load_bench(args: argparse.Namespace, dtype: torch.dtype) -> _common.BenchModel:
    """SmolLM2 (or --model); with --synthetic and SmolLM2 not fetched, random weights of SmolLM2's shape and the
    byte tokenizer (a GPU machine, where the 94 MB GGUF cannot travel: same shapes, same work per token)."""
    from memlm.model.config import SMOLLM2_135M, ModelConfig
    from memlm.model.pretrained import Pretrained
    from memlm.model.tokenizer import Tokenizer, document_boundary
    from memlm.model.weights import model_path, random_fingerprint, random_model

    if args.model is None and args.synthetic and not model_path(_common.REAL_MODEL).is_file():
        config = ModelConfig.from_name(SMOLLM2_135M)
        tok = Tokenizer.byte_level()
        pre = Pretrained(random_model(config, 0, args.device, dtype), tok, random_fingerprint(config, 0))
        return _common.BenchModel(pre, f"random weights of {SMOLLM2_135M}'s shape", document_boundary(tok), True)
    return _common.load_model(args.model, args.synthetic, synthetic_model="small", device=args.device, dtype=dtype)


def prompts(bench: _common.BenchModel, n: int, length: int, synthetic: bool) -> list[tuple[int, ...]]:
    """n prompts of `length` tokens: the starts of different SOTU speeches (random tokens if synthetic)."""
    docs, _ = _common.load_tokens(bench, "sotu", None, n * max(length, 64) * 40, synthetic)
    docs = [d for d in docs if len(d) >= length]
    if len(docs) < n:
        docs = [d[i : i + length] for d in docs for i in range(0, len(d) - length, length)]
    step = max(1, len(docs) // n)
    return [tuple(docs[i * step][:length]) for i in range(n)]


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
"""--clock: wall time, or this process's CPU time (on a shared CPU with one torch thread, the time spent
working, not waiting for a core other jobs hold; GPU work is not in it)."""
CLOCK = CLOCKS["wall"]
ENGINE_GEMM = DEFAULT_CPU_GEMM
"""--engine-gemm: the GEMM our side (engine, full recomputation) runs (memlm.model.cpu_gemm.cpu_gemm_as); transformers'
side runs as it is."""


def run_engine(engine: Engine, requests: list[GenerationRequest]) -> list:
    """run_all on our side's GEMM (--engine-gemm)."""
    with cpu_gemm_as(ENGINE_GEMM):
        return run_all(engine, requests)


def timed(fn, device: torch.device) -> float:
    synchronize(device)
    t0 = CLOCK()
    fn()
    synchronize(device)
    return CLOCK() - t0


def engine_requests(bench, ps, n: int, knn: KNNLMConfig | None = None) -> list[GenerationRequest]:
    return [GenerationRequest(p, n, GREEDY, boundary_token=bench.boundary, knn=knn) for p in ps]


def generated(events) -> list[int]:
    return [e.token_id for e in events if isinstance(e, TokenEvent)]


def cached_vs_recomputation(bench, prompt, args, device) -> dict:
    """Figure 1: every engine step timed; full recomputation timed at the sampled steps."""
    model = bench.pre.model
    engine = Engine(model, bench.pre.tokenizer, EngineConfig(max_batch=1, row_capacity=args.prompt_tokens
                                                             + args.new_tokens + 1))
    handle = engine.submit(engine_requests(bench, [prompt], args.new_tokens)[0])
    step_s = []
    while engine.busy:
        step_s.append(timed(engine.step, device))
    tokens = generated(handle.events())
    prefix = [bench.boundary, *prompt]
    sampled = sorted(set(range(0, args.new_tokens, args.recompute_every)) | {args.new_tokens - 1})
    full_s, agree = [], 0
    with torch.inference_mode():
        for i in sampled:
            seq = torch.tensor([prefix + tokens[:i]], device=device)  # (1, T): what step i reads
            out = []
            full_s.append(timed(lambda seq=seq, out=out: out.append(model(seq, logits_from=seq.shape[1] - 1)), device))
            agree += int(out[0].logits[0, -1, : bench.pre.tokenizer.vocab_size].argmax()) == tokens[i]
    steps = np.arange(args.new_tokens)
    full_total = float(np.interp(steps, sampled, full_s).sum())
    cached_sampled = float(np.interp(steps, sampled, [step_s[i] for i in sampled]).sum())
    return {"cached_measured_s": sum(step_s), "cached_sampled_s": cached_sampled, "full_sampled_s": full_total,
            "samples": len(sampled), "agree": agree, "step_s": step_s}


def hf_generate(hf, ids: torch.Tensor, n: int) -> torch.Tensor:
    """transformers' greedy generate with its KV cache, exactly n new tokens (no early stop)."""
    return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=None)


def alternate(sides: dict, repeats: int, device) -> dict[str, float]:
    """Median wall seconds of each side, the sides run alternately `repeats` times (main warms both up once)."""
    times: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(repeats):
        for k, fn in sides.items():
            times[k].append(timed(fn, device))
    return {k: statistics.median(v) for k, v in times.items()}


def batch1_vs_transformers(bench, hf, prompt, args, device) -> dict:
    """Figure 2: one stream, decode_tokens greedy tokens, the engine vs hf.generate."""
    model, tok = bench.pre.model, bench.pre.tokenizer
    req = engine_requests(bench, [prompt], args.decode_tokens)
    ids = torch.tensor([[bench.boundary, *prompt]], device=device)  # (1, T)
    out = {}

    def ours():
        out["ours"] = generated(run_engine(Engine(model, tok, EngineConfig(max_batch=1)), req)[0])

    def theirs():
        with torch.inference_mode():
            out["hf"] = hf_generate(hf, ids, args.decode_tokens)[0, ids.shape[1]:].tolist()

    secs = alternate({"engine": ours, "transformers": theirs}, args.repeats, device)
    same = sum(a == b for a, b in zip(out["ours"], out["hf"]))
    return {**secs, "same_tokens": same}


def aggregate(bench, hf, ps, streams: int, args, device) -> dict:
    """Figure 3 at `streams`: the engine's batch vs the same requests one at a time vs hf static batch."""
    model, tok = bench.pre.model, bench.pre.tokenizer
    reqs = engine_requests(bench, ps[:streams], args.stream_tokens)
    ids = torch.tensor([[bench.boundary, *p] for p in ps[:streams]], device=device)  # (S, T), equal lengths

    def batched():
        run_engine(Engine(model, tok, EngineConfig(max_batch=streams, prefill_chunk=args.prefill_chunk)), reqs)

    def one_by_one():
        run_engine(Engine(model, tok, EngineConfig(max_batch=1)), reqs)

    def hf_static():
        with torch.inference_mode():
            hf_generate(hf, ids, args.stream_tokens)

    sides = {"engine": batched, "sequential": one_by_one, "transformers": hf_static}
    if streams == 1:
        del sides["sequential"]  # the same thing as the engine's batch of one
    return alternate(sides, args.repeats, device)


def knn_searcher(bench, args, device):
    """(searcher, description): --datastore, or the model's keys over --knn-tokens SOTU tokens, exact."""
    from memlm.retrieval.exact import TorchExactSearcher

    if args.datastore:
        from datastore import Datastore

        store = Datastore.open(args.datastore)
        return store, f"{args.datastore} ({store.info().n} entries, {store.info().index})"
    docs, _ = _common.load_tokens(bench, "sotu", "year>=1990", args.knn_tokens, args.synthetic, seed=5)
    keys, values = [], []
    with torch.inference_mode():
        for d in docs:
            for lo in range(0, len(d) - 1, 1024):
                chunk = [bench.boundary, *d[lo : lo + 1024]]
                keys.append(bench.pre.model(torch.tensor([chunk[:-1]], device=device)).knn_key[0].float())  # (n, C)
                values.append(torch.tensor(chunk[1:]))
    searcher = TorchExactSearcher(torch.cat(keys), torch.cat(values).numpy())
    return searcher, f"in-memory exact search over {len(searcher)} SOTU keys of the model (k {KNNLMConfig().k})"


def knn_vs_base(bench, ps, args, device, result: harness.Result) -> tuple[dict, str]:
    """Figure 4: the same knn_batch streams with and without kNN-LM (KNNLMConfig's defaults); the searcher's
    opening or building timed into result.builds."""
    model, tok = bench.pre.model, bench.pre.tokenizer
    with result.build("figure 4's datastore (opened, or its keys encoded)"):
        searcher, what = knn_searcher(bench, args, device)
    base = engine_requests(bench, ps[: args.knn_batch], args.stream_tokens)
    knn = engine_requests(bench, ps[: args.knn_batch], args.stream_tokens, KNNLMConfig())
    config = EngineConfig(max_batch=args.knn_batch)
    sides = {
        "base": lambda: run_engine(Engine(model, tok, config), base),
        "knn": lambda: run_engine(Engine(model, tok, config, searcher), knn),
    }
    return alternate(sides, args.repeats, device), what


def graphs_vs_ordinary(bench, ps, streams: int, args, device) -> dict:
    """Figure 6 at `streams`: the same greedy requests through one engine with fixed-shape decode steps (CUDA
    graphs on a GPU) and one without, each engine made and warmed up once (on a GPU every bucket the run needs
    is captured in the warm-up, outside the timings); per side the median wall time of a whole run and of its
    decode steps."""
    model, tok = bench.pre.model, bench.pre.tokenizer
    reqs = engine_requests(bench, ps[:streams], args.decode_tokens)
    engines = {graphs: Engine(model, tok, EngineConfig(max_batch=streams, cuda_graphs=graphs)) for graphs in (True, False)}
    runs: dict[bool, list[float]] = {True: [], False: []}
    steps: dict[bool, list[float]] = {True: [], False: []}
    tokens: dict[bool, list] = {}
    same_rounds: list[bool] = []

    def run(graphs: bool) -> list[float]:
        engine = engines[graphs]
        handles = [engine.submit(r) for r in reqs]
        step_s = []
        while engine.busy:
            step_s.append(timed(engine.step, device))
        tokens[graphs] = [generated(h.events()) for h in handles]
        return step_s

    with cpu_gemm_as(ENGINE_GEMM):
        for graphs in engines:
            run(graphs)  # warm-up: allocation, capture
        for _ in range(args.repeats):
            for graphs in engines:
                step_s = run(graphs)
                runs[graphs].append(sum(step_s))
                steps[graphs].extend(step_s[1:])  # the first step is the prompts' prefill
            same_rounds.append(tokens[True] == tokens[False])
    return {"graphs": statistics.median(runs[True]), "ordinary": statistics.median(runs[False]),
            "step_graphs": statistics.median(steps[True]), "step_ordinary": statistics.median(steps[False]),
            "same": all(same_rounds), "same_rounds": same_rounds}


def bandwidth(bench, step_s: float, positions: int) -> float:
    """Bytes one batch-1 decode step reads: every weight once (tied ones once) + the cache's keys and values."""
    model = bench.pre.model
    c = model.config
    itemsize = model.dtype.itemsize
    weights = sum(p.numel() for p in model.parameters()) * itemsize
    cache = 2 * c.n_layer * c.n_kv_head * c.head_dim * positions * itemsize
    return (weights + cache) / step_s / 1e9


def report_recomputation(args, fig1) -> None:
    n = args.new_tokens
    print(f"1. cached vs full recomputation, batch 1, {n} new tokens after {args.prompt_tokens} prompt tokens")
    print(f"   engine: {fig1['cached_measured_s']:.2f} s measured over all {n} steps "
          f"({fig1['cached_sampled_s']:.2f} s integrated from the {fig1['samples']} sampled steps)")
    print(f"   full recomputation: {fig1['full_sampled_s']:.2f} s integrated from the same {fig1['samples']} steps "
          f"(argmax agrees with the engine's token at {fig1['agree']}/{fig1['samples']})")
    print(f"   ratio {fig1['full_sampled_s'] / fig1['cached_sampled_s']:.1f}x (same samples both sides; "
          f"{fig1['full_sampled_s'] / fig1['cached_measured_s']:.1f}x against the measured engine total; goal >= 10)")


def report_batch1(args, fig2) -> None:
    t = args.decode_tokens
    e, h = t / fig2["engine"], t / fig2["transformers"]
    print(f"2. batch-1 decode, {t} tokens: engine {e:.1f} tokens/s, transformers generate (KV cache) {h:.1f} "
          f"tokens/s, ratio {e / h:.2f}x (goal >= 1.0; {fig2['same_tokens']}/{t} tokens identical)")


def report_aggregate(args, fig3) -> None:
    print(f"3. aggregate tokens/s, {args.stream_tokens} new tokens per stream")
    for streams, secs in fig3.items():
        total = streams * args.stream_tokens
        line = f"   {streams:>3} streams: engine {total / secs['engine']:.1f}"
        if "sequential" in secs:
            line += (f", one after another {total / secs['sequential']:.1f} "
                     f"({secs['sequential'] / secs['engine']:.2f}x)")
        line += (f", transformers static batch {total / secs['transformers']:.1f} "
                 f"({secs['transformers'] / secs['engine']:.2f}x)")
        print(line)
    print("      goals: >= 4x one-after-another at 8 streams, >= 1.0x transformers")


def report_knn(args, fig4, knn_what) -> None:
    kt = args.knn_batch * args.stream_tokens
    print(f"4. kNN-LM vs base at batch {args.knn_batch} ({knn_what}): base {kt / fig4['base']:.1f} tokens/s, "
          f"kNN-LM {kt / fig4['knn']:.1f} tokens/s, ratio {fig4['base'] / fig4['knn']:.2f}x (goal >= 0.8)")


def report_bandwidth(args, bench, fig1) -> None:
    step = statistics.median(fig1["step_s"][1:])
    gbs = bandwidth(bench, step, args.prompt_tokens + args.new_tokens // 2)
    print(f"5. batch-1 decode bandwidth: {gbs:.0f} GB/s of {args.peak_gbs:.0f} GB/s "
          f"({100 * gbs / args.peak_gbs:.1f}%), median step {1e3 * step:.2f} ms")


def report_graphs(args, bench, fig6) -> None:
    where = "CUDA graphs" if args.device.startswith("cuda") else "the fixed-shape step run eagerly (no graphs on a CPU)"
    print(f"6. fixed-shape decode steps ({where}) vs the ordinary step, {args.decode_tokens} greedy tokens per stream")
    for streams, secs in fig6.items():
        line = (f"   {streams:>3} streams: decode step {secs['step_ordinary'] / secs['step_graphs']:.2f}x (median "
                f"{1e3 * secs['step_graphs']:.2f} vs {1e3 * secs['step_ordinary']:.2f} ms), whole run "
                f"{secs['ordinary'] / secs['graphs']:.2f}x; tokens identical: {secs['same']}")
        if args.peak_gbs and streams == 1:
            positions = args.prompt_tokens + args.decode_tokens // 2
            line += (f"; batch-1 bandwidth {bandwidth(bench, secs['step_graphs'], positions):.0f} vs "
                     f"{bandwidth(bench, secs['step_ordinary'], positions):.0f} GB/s of {args.peak_gbs:.0f}")
        print(line)


def main() -> None:
    global CLOCK, ENGINE_GEMM
    args = parse_args()
    result = harness.Result.from_args(args)
    CLOCK = CLOCKS[args.clock]
    ENGINE_GEMM = args.engine_gemm
    if args.clock == "cpu" and (args.device != "cpu" or torch.get_num_threads() != 1):
        raise SystemExit("--clock cpu measures one CPU thread: run with OMP_NUM_THREADS=1 on --device cpu")
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    bench = load_bench(args, dtype)
    streams = [int(s) for s in args.streams.split(",")]
    graph_streams = [int(s) for s in args.graph_streams.split(",")]
    ps = prompts(bench, max(streams + graph_streams + [args.knn_batch]), args.prompt_tokens, args.synthetic)
    result.set_synthetic(bench.synthetic)
    print(f"model {bench.name}, device {args.device}, dtype {args.dtype}, torch threads {torch.get_num_threads()}, "
          f"{args.clock} clock, engine prefill_chunk {args.prefill_chunk}, our GEMM {args.engine_gemm}, "
          f"{args.repeats} alternating run(s) per side (median), after one warm-up of both")
    hf = hf_twin(bench.pre.model)
    warm = engine_requests(bench, ps[:2], 4)  # one-time costs (allocator, kernels, generation config) out of the timings
    run_engine(Engine(bench.pre.model, bench.pre.tokenizer, EngineConfig(max_batch=2)), warm)
    with torch.inference_mode():
        hf_generate(hf, torch.tensor([[bench.boundary, *p] for p in ps[:2]], device=device), 4)
    t0 = time.perf_counter()
    figures = {int(f) for f in args.figures.split(",")}
    out = result.figures
    if 1 in figures:
        with cpu_gemm_as(ENGINE_GEMM):
            fig1 = cached_vs_recomputation(bench, ps[0], args, device)
        report_recomputation(args, fig1)
        out["1_cached_measured_s"], out["1_full_sampled_s"] = fig1["cached_measured_s"], fig1["full_sampled_s"]
        out["1_cached_over_recomputation"] = fig1["full_sampled_s"] / fig1["cached_sampled_s"]
        out["1_argmax_agrees"] = f"{fig1['agree']}/{fig1['samples']}"
        if args.peak_gbs:
            report_bandwidth(args, bench, fig1)
            step = statistics.median(fig1["step_s"][1:])
            out["5_batch1_gb_per_s"] = bandwidth(bench, step, args.prompt_tokens + args.new_tokens // 2)
    if 2 in figures:
        fig2 = batch1_vs_transformers(bench, hf, ps[0], args, device)
        report_batch1(args, fig2)
        out["2_engine_over_transformers"] = fig2["transformers"] / fig2["engine"]
        out["2_engine_tokens_per_s"] = args.decode_tokens / fig2["engine"]
        out["2_tokens_as_transformers"] = f"{fig2['same_tokens']}/{args.decode_tokens}"
        result.headline("batch1", f"{out['2_engine_tokens_per_s']:.1f} tokens/s, "
                                  f"{out['2_engine_over_transformers']:.2f}x transformers")
    if 3 in figures:
        fig3 = {s: aggregate(bench, hf, ps, s, args, device) for s in streams}
        report_aggregate(args, fig3)
        for n, secs in fig3.items():
            result.rows.append({"figure": "3. aggregate", "streams": n,
                                "engine_tokens_per_s": n * args.stream_tokens / secs["engine"],
                                **({"over_one_after_another": secs["sequential"] / secs["engine"]}
                                   if "sequential" in secs else {}),
                                "over_transformers_static": secs["transformers"] / secs["engine"]})
        for row in result.rows:
            if row.get("over_one_after_another") is not None and row["streams"] == 8:
                result.headline("streams8", f"{row['engine_tokens_per_s']:.1f} tokens/s, "
                                            f"{row['over_one_after_another']:.2f}x one after another, "
                                            f"{row['over_transformers_static']:.2f}x transformers' static batch")
    if 4 in figures:
        fig4, what = knn_vs_base(bench, ps, args, device, result)
        report_knn(args, fig4, what)
        out["4_knn_over_base"] = fig4["base"] / fig4["knn"]
        out["4_datastore"] = what
    if 6 in figures:
        fig6 = {s: graphs_vs_ordinary(bench, ps, s, args, device) for s in graph_streams}
        report_graphs(args, bench, fig6)
        for n, secs in fig6.items():
            for i, same in enumerate(secs["same_rounds"]):
                result.check(f"6. fixed-shape steps' tokens identical to the ordinary step's, {n} streams, "
                             f"round {i + 1}", same)
            result.rows.append({"figure": "6. fixed-shape steps", "streams": n,
                                "step_ratio": secs["step_ordinary"] / secs["step_graphs"],
                                "run_ratio": secs["ordinary"] / secs["graphs"], "tokens_identical": secs["same"]})
    print(f"(whole run {time.perf_counter() - t0:.0f} s)")
    result.settings = {"model": bench.name, "device": args.device, "dtype": args.dtype, "clock": args.clock,
                       "threads": torch.get_num_threads(), "engine_gemm": args.engine_gemm,
                       "prefill_chunk": args.prefill_chunk, "prompt_tokens": args.prompt_tokens,
                       "new_tokens": args.new_tokens, "recompute_every": args.recompute_every,
                       "decode_tokens": args.decode_tokens, "streams": args.streams,
                       "stream_tokens": args.stream_tokens, "knn_batch": args.knn_batch, "repeats": args.repeats,
                       "statistic": "median of alternating runs a side, after one warm-up", "figures": args.figures}
    path = result.write()
    aggregate_rows = [r for r in result.rows if r["figure"] == "3. aggregate"]
    if aggregate_rows:
        per_side = {"engine (one batch)": [(r["streams"], r["engine_tokens_per_s"]) for r in aggregate_rows]}
        per_side["one after another"] = [(r["streams"], r["engine_tokens_per_s"] / r["over_one_after_another"])
                                         for r in aggregate_rows if r.get("over_one_after_another")]
        per_side["transformers static batch"] = [(r["streams"], r["engine_tokens_per_s"] / r["over_transformers_static"])
                                                 for r in aggregate_rows]
        harness.plot_lines(path, {k: v for k, v in per_side.items() if v}, xlabel="concurrent streams",
                           ylabel="aggregate tokens/s", title="greedy decode throughput vs streams", logx=True)


if __name__ == "__main__":
    main()
