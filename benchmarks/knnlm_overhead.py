"""kNN-LM evaluation vs base evaluation: two complete runs, wall clock and peak memory.

Goals: kNN-LM tokens/s >= 0.9x base tokens/s, kNN-LM peak memory <= 1.1x base. Each side runs in its own
child process on the same evaluation tokens, with the same windows (context 1024, stride 512):
- base: memlm.jobs.evaluate.evaluate_perplexity;
- kNN-LM: memlm.jobs.knnlm_eval.evaluate_knnlm with the same windows plus, per group of scored tokens,
  the query keys (device -> float32 numpy), the search (k = 1024, the index's default nprobe) and the
  mixing; recall is not measured (it is a check, not part of kNN-LM).
Two datastores over the same keys: the index `datastore build` picks by default for their number
(datastore.index.default_factory: Flat at this size) and IVF{4 sqrt N},PQ64 beside it; --index measures one.
The timed region is the evaluation call, all of it, measured by the wall clock around it; loading the
model and opening the datastore (one-time, like a server start) are printed apart. Peak memory is the
child's resident high-water mark: VmHWM of /proc/self/status, reset (clear_refs 5) just before the
evaluation call, so the peak of model loading does not hide the evaluation's; the whole-process
ru_maxrss is printed too. The sides alternate (base, kNN, base, kNN, ...) under the same machine load;
ratios use the medians.

The datastores: SOTU 1990-2000 (81,169 keys) under SmolLM2 at context 1024, stride 512; each built once
(3-5 CPU minutes) and cached under ~/.cache/memlm/bench/ (never committed); reruns reuse it.
lambda and T are fixed (--lambda, --temperature): this benchmark measures cost, not tuning.

    python benchmarks/knnlm_overhead.py [--eval-tokens 3000] [--repeats 1] [--k 1024] [--synthetic] [--results DIR]

Writes docs/results/data/knnlm_overhead.json (benchmarks/harness.py); a datastore built by this run is timed
into its build seconds (a cached one costs nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import _common
import harness

DS_SPLIT = "1990<=year<=2000"


def _hwm_mib() -> float:
    """Peak resident memory of this process since the last reset (VmHWM), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def _reset_hwm() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def _datastore_dir(bench: _common.BenchModel, args: argparse.Namespace, n: int, factory: str, random_tokens: bool) -> Path:
    from datastore.manifest import FORMAT_VERSION
    from memlm.files import cache_dir

    # The format version is in the name, so a newer memlm builds anew instead of failing on an old cache.
    tag = "random" if random_tokens else f"{args.data}-1990-2000"
    return cache_dir() / "bench" / (f"knnlm-{tag}-n{n}-c{args.context}-s{args.stride}-{factory.replace(',', '-')}-"
                                    f"{bench.pre.fingerprint[:12]}-v{FORMAT_VERSION}")


def factories(n: int, d: int, index: str | None) -> list[str]:
    """The indexes measured: --index alone, or the default for n keys and IVF-PQ beside it."""
    from datastore.index import default_factory, default_nlist, default_pq_m

    if index:
        return [index]
    ivfpq = f"IVF{default_nlist(n)},PQ{default_pq_m(d)}"
    return list(dict.fromkeys([default_factory(n, d)[0], ivfpq]))


def ensure_datastore(bench: _common.BenchModel, args: argparse.Namespace, factory: str, docs: list[list[int]],
                     random_tokens: bool, result: harness.Result | None = None) -> Path:
    """The cached benchmark datastore over `docs` with index `factory`, built first when missing (resumable, like
    any build)."""
    from datastore import BuildSettings, BuildSource, build_from_tokens
    from memlm.data.documents import corpus_fingerprint
    from memlm.jobs.windows import WindowConfig

    n = sum(map(len, docs))
    out = _datastore_dir(bench, args, n, factory, random_tokens)
    if not (out / "manifest.json").exists():
        fingerprint = "random-tokens" if random_tokens else corpus_fingerprint(args.data, DS_SPLIT)
        prov = BuildSource(bench.name, bench.pre.fingerprint, bench.pre.tokenizer.fingerprint,
                          f"{args.data} [{DS_SPLIT}]", fingerprint, bench.boundary)
        t0 = time.perf_counter()
        settings = BuildSettings(window=WindowConfig(args.context, args.stride, args.batch_size), index_factory=factory)
        with result.build(f"datastore {factory}") if result is not None else contextlib.nullcontext():
            build_from_tokens(bench.pre.model, docs, out, prov, settings, progress=False)
        print(f"# built {n} keys ({factory}) in {time.perf_counter() - t0:.0f} s -> {out}", flush=True)
    return out


def run_side(args: argparse.Namespace) -> None:
    """Child process: one complete evaluation, printed as one JSON line."""
    from memlm.jobs.evaluate import evaluate_perplexity
    from memlm.jobs.knnlm_eval import evaluate_knnlm
    from memlm.jobs.windows import WindowConfig
    from memlm.retrieval.knnlm import KNNLMConfig

    t0 = time.perf_counter()
    bench = _common.load_model(args.model, args.synthetic)
    docs, _ = _common.load_tokens(bench, args.data, args.eval_split, args.eval_tokens, args.synthetic, seed=3)
    window = WindowConfig(args.context, args.stride, args.batch_size)
    load_s = time.perf_counter() - t0
    store = None
    open_s = 0.0
    if args.side == "knn":
        from datastore import Datastore
        from memlm.retrieval.compat import check_searcher

        t0 = time.perf_counter()
        store = Datastore.open(args.datastore)
        config = bench.pre.model.config
        check_searcher(store.info(), model_fingerprint=bench.pre.fingerprint,
                       tokenizer_fingerprint=bench.pre.tokenizer.fingerprint, dim=config.n_embd,
                       key_layer=config.key_description, boundary_token=bench.boundary,
                       context=window.context, stride=window.stride)
        open_s = time.perf_counter() - t0
    _reset_hwm()
    t0 = time.perf_counter()
    if store is None:
        r = evaluate_perplexity(bench.pre.model, docs, window, bench.boundary, progress=False)
        ppl = r["perplexity"]
    else:
        cfg = KNNLMConfig(k=args.k, lmbda=args.lmbda, temperature=args.temperature)
        r = evaluate_knnlm(bench.pre.model, docs, store, window, cfg, bench.boundary, recall_queries=0,
                           progress=False)
        ppl = r["knnlm_perplexity"]
    wall = time.perf_counter() - t0
    out = dict(side=args.side, tokens=r["tokens"], wall_s=wall, perplexity=ppl, load_s=load_s, open_s=open_s,
               eval_peak_mib=_hwm_mib(), process_peak_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if store is not None:
        info = store.info()
        out.update(forward_s=r["forward_seconds"], search_s=r["search_seconds"], mix_s=r["interpolate_seconds"],
                   base_perplexity=r["base_perplexity"], n=info.n, index=info.index, nprobe=info.nprobe)
    print("RESULT " + json.dumps(out), flush=True)


def child(args: argparse.Namespace, side: str, datastore: Path | None) -> dict:
    cmd = [sys.executable, __file__, "--side", side] + (["--datastore", str(datastore)] if datastore else [])
    for flag in ("model", "data", "eval_split", "eval_tokens", "context", "stride", "batch_size", "k", "lmbda",
                 "temperature"):
        value = getattr(args, flag)
        if value is not None:
            cmd += ["--lambda" if flag == "lmbda" else f"--{flag.replace('_', '-')}", str(value)]
    if args.synthetic:
        cmd.append("--synthetic")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{side} run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: smollm2-135m (random 'tiny' only with --synthetic)")
    p.add_argument("--data", default="sotu")
    p.add_argument("--ds-tokens", type=int, default=None, help="datastore tokens (default: all of 1990-2000)")
    p.add_argument("--eval-split", default="year>=2003")
    p.add_argument("--eval-tokens", type=int, default=3000)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--stride", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--lambda", dest="lmbda", type=float, default=0.1)
    p.add_argument("--temperature", type=float, default=2.0)
    p.add_argument("--index", default=None, help="default IVF{~4 sqrt N},PQ{m}")
    p.add_argument("--repeats", type=int, default=1, help="base/kNN pairs (alternating)")
    p.add_argument("--side", choices=["base", "knn"], help=argparse.SUPPRESS)
    p.add_argument("--datastore", default=None, help=argparse.SUPPRESS)
    _common.add_synthetic_flag(p)
    harness.add_options(p, "knnlm_overhead")
    args = p.parse_args()
    if args.side:
        return run_side(args)

    result = harness.Result.from_args(args)
    result.children = True  # each side runs in its own child process
    bench = _common.load_model(args.model, args.synthetic)
    docs, random_tokens = _common.load_tokens(bench, args.data, DS_SPLIT, args.ds_tokens, args.synthetic, seed=1)
    n = sum(map(len, docs))
    stores = {factory: ensure_datastore(bench, args, factory, docs, random_tokens, result)
              for factory in factories(n, bench.pre.model.config.n_embd, args.index)}
    del docs
    synthetic = bench.synthetic or random_tokens
    del bench  # the parent's model is not measured; free it before the children run
    result.set_synthetic(synthetic)
    runs: dict[str, list[dict]] = {"base": [], **{f"kNN-LM {f}": [] for f in stores}}
    for _ in range(args.repeats):  # the sides alternate under the same machine load
        runs["base"].append(child(args, "base", None))
        for factory, store in stores.items():
            runs[f"kNN-LM {factory}"].append(child(args, "knn", store))
    tokens = runs["base"][0]["tokens"]
    assert all(r["tokens"] == tokens for rs in runs.values() for r in rs)
    med = {side: statistics.median(r["wall_s"] for r in rs) for side, rs in runs.items()}
    peak = {side: statistics.median(r["eval_peak_mib"] for r in rs) for side, rs in runs.items()}
    proc_peak = {side: statistics.median(r["process_peak_mib"] for r in rs) for side, rs in runs.items()}
    print(f"# python {' '.join(sys.argv)}")
    print(f"datastore {n} keys, context {args.context}, stride {args.stride}, k {args.k}, lambda {args.lmbda}, "
          f"T {args.temperature}; eval {tokens} tokens of {args.data} [{args.eval_split}]; {args.repeats} "
          f"alternating round(s), each side its own process")
    print(f"{'side':<26} {'nprobe':>6} {'wall s':>8} {'tok/s':>8} {'ppl':>8} {'speed':>6} {'eval peak MiB':>13} "
          f"{'memory':>6} {'search s':>8}")
    base_ppl = runs["base"][-1]["perplexity"]
    for side, rs in runs.items():
        r = rs[-1]
        speed, mem = med["base"] / med[side], peak[side] / peak["base"]
        row = {"side": side, "index": r.get("index", "-"), "nprobe": r.get("nprobe", "-"), "wall_s": med[side],
               "tokens_per_s": tokens / med[side], "perplexity": r["perplexity"], "speed_vs_base": speed,
               "eval_peak_mib": peak[side], "memory_vs_base": mem,
               "process_peak_memory_vs_base": proc_peak[side] / proc_peak["base"],
               "forward_s": r.get("forward_s"), "search_s": r.get("search_s"), "mix_s": r.get("mix_s"),
               "wall_s_stats": harness.stats([x["wall_s"] for x in rs])}
        result.rows.append(row)
        print(f"{side:<26} {row['nprobe']!s:>6} {med[side]:8.1f} {tokens / med[side]:8.1f} {r['perplexity']:8.3f} "
              f"{speed:6.3f} {peak[side]:13.0f} {mem:6.3f} {r.get('search_s', 0.0):8.1f}")
    print("goals: speed >= 0.9, memory <= 1.1 (kNN-LM over base); lambda and T fixed, not tuned")
    _common.synthetic_banner(synthetic)
    result.settings = {"model": args.model or _common.REAL_MODEL, "data": args.data, "eval_split": args.eval_split,
                       "eval_tokens": tokens, "datastore_entries": n, "indexes": list(stores),
                       "context": args.context, "stride": args.stride, "k": args.k, "lambda": args.lmbda,
                       "temperature": args.temperature, "repeats": args.repeats,
                       "statistic": "median of alternating child processes"}
    default = result.rows[1]
    result.figures = {"base_perplexity": base_ppl, **{
        f"{row['index']}_{key}": row[key] for row in result.rows[1:]
        for key in ("speed_vs_base", "memory_vs_base", "perplexity")}}
    result.headline("overhead", f"{default['speed_vs_base']:.3f}x speed, {default['memory_vs_base']:.3f}x memory "
                                f"({default['index']})" + "".join(
                                    f"; {row['index']}: {row['speed_vs_base']:.3f}x, {row['memory_vs_base']:.3f}x"
                                    for row in result.rows[2:]))
    result.write()


if __name__ == "__main__":
    main()
