"""Perplexity and wall time vs the fraction of kNN-LM searches saved (issue 15): adaptive retrieval (He et al.
2021), RetoMaton pointers (Alon et al. 2022) and both together, against plain kNN-LM, in one run.

The setting is the README's kNN-LM one: SmolLM2-135M-Instruct Q4_1, the datastore of SOTU 1990-2000
(default /tmp/demo_v3/ds-sotu-1990-2000: 81,169 keys, Flat, context 512 / stride 512), evaluation on the
first --eval-tokens tokens of sotu "year>=2003", lambda and T tuned on "2001<=year<=2002" (its first
--tune-tokens tokens), on which the gate (memlm.jobs.adaptive_train) is fitted too. Every setting is one
complete memlm.jobs.knnlm_eval.evaluate_knnlm call over the same tokens with the same lambda, T and k: its
wall clock (all of it, the forward included) and its kNN-LM overhead (search + pointer walk + gate +
interpolation; the forward is the same in every setting) are reported beside its perplexity and
searches saved. Writes the numbers as JSON and the curves as a PNG (matplotlib).

Measured here (8,000 tokens, 3,000 tuning tokens, a loaded 2-core machine, one thread): plain kNN-LM
ppl 23.31 (base 24.36), search 12.3 s; --adaptive-fraction 0.5: 49% saved, ppl 23.85, search 7.4 s;
--pointers --min-pointers 1: 57% saved, ppl 23.99, search 11.2 s + walk 2.0 s with FAISS's default BLAS
threshold, 7.4 s + 1.8 s with --faiss-blas-threshold 0 (the walk's calls hold tens to ~250 queries, which
faiss 1.15 scans without BLAS by default).

    python benchmarks/search_savings.py [--eval-tokens 20000] [--tune-tokens 3000] [--out out/search_savings]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import _common

KEYS = ("knnlm_perplexity", "base_perplexity", "searches", "searches_saved", "searches_saved_fraction",
        "forward_seconds", "search_seconds", "pointer_seconds", "gate_seconds", "interpolate_seconds",
        "stream_searches", "pointer_tokens", "adaptive_skipped", "adaptive_threshold", "tokens")


def settings(args: argparse.Namespace) -> list[tuple[str, dict]]:
    """(method, parameters) of every evaluation: plain first."""
    runs: list[tuple[str, dict]] = [("plain", {})]
    runs += [("adaptive", {"fraction": f}) for f in args.fractions]
    runs += [("pointers", {"min_pointers": m}) for m in args.min_pointers]
    runs += [("both", {"min_pointers": m, "fraction": f}) for m in args.both_min_pointers for f in args.both_fractions]
    return runs


def retrieval_for(method: str, params: dict, source, gate, gate_settings):
    from memlm.jobs.knnlm_eval import Retrieval
    from memlm.retrieval.adaptive import AdaptiveConfig, threshold_for_fraction
    from memlm.retrieval.pointers import PointerConfig

    adaptive = pointers = None
    if "fraction" in params:
        adaptive = AdaptiveConfig(gate, gate_settings, threshold_for_fraction(gate_settings, params["fraction"]))
    if "min_pointers" in params:
        pointers = PointerConfig(min_pointers=params["min_pointers"])
    return Retrieval(pointers, source if pointers else None, adaptive)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--datastore", default="/tmp/demo_v3/ds-sotu-1990-2000")
    p.add_argument("--data", default="sotu")
    p.add_argument("--eval-split", default="year>=2003")
    p.add_argument("--tune-split", default="2001<=year<=2002")
    p.add_argument("--eval-tokens", type=int, default=20000)
    p.add_argument("--tune-tokens", type=int, default=3000)
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--fractions", type=float, nargs="*", default=[0.25, 0.5, 0.75])
    p.add_argument("--min-pointers", type=int, nargs="*", default=[1, 2, 4, 8, 16, 64, 256])
    p.add_argument("--both-min-pointers", type=int, nargs="*", default=[4, 16])
    p.add_argument("--both-fractions", type=float, nargs="*", default=[0.25, 0.5])
    p.add_argument("--out", default="out/search_savings", help="writes OUT.json and OUT.png")
    p.add_argument("--faiss-blas-threshold", type=int, default=None,
                   help="faiss.cvar.distance_compute_blas_threshold (default: FAISS's own). faiss 1.15 scans a Flat "
                        "index without BLAS while queries x d < 128000 (about 220 queries of d 576), ~7x the cost "
                        "per query at k 1024 (measured here): the searches the pointer walk batches are often fewer")
    args = p.parse_args()
    import faiss

    if args.faiss_blas_threshold is not None:
        faiss.cvar.distance_compute_blas_threshold = args.faiss_blas_threshold
    blas_threshold = int(faiss.cvar.distance_compute_blas_threshold)

    from datastore import Datastore
    from memlm.jobs.adaptive_train import train_gate
    from memlm.jobs.knnlm_eval import evaluate_knnlm
    from memlm.jobs.windows import WindowConfig
    from memlm.retrieval.adaptive import GateConfig
    from memlm.retrieval.compat import check_searcher
    from memlm.retrieval.knnlm import KNNLMConfig
    from memlm.retrieval.pointers import PointerSource, successors

    bench = _common.load_model(None, False)
    model, boundary = bench.pre.model, bench.boundary
    store = Datastore.open(args.datastore)
    info = store.info()
    window = WindowConfig(info.context, info.stride, args.batch_size)
    check_searcher(info, model_fingerprint=bench.pre.fingerprint, tokenizer_fingerprint=bench.pre.tokenizer.fingerprint,
                   dim=model.config.n_embd, key_layer=model.config.key_description, boundary_token=boundary,
                   context=window.context, stride=window.stride)
    docs, _ = _common.load_tokens(bench, args.data, args.eval_split, args.eval_tokens, False)
    tune_docs, _ = _common.load_tokens(bench, args.data, args.tune_split, args.tune_tokens, False)

    t0 = time.perf_counter()
    gate, gate_settings = train_gate(model, tune_docs, [], store, window, KNNLMConfig(k=args.k, lmbda=None,
                                     temperature=None), boundary, GateConfig(), model_fingerprint=bench.pre.fingerprint,
                                     tune_data=f"{args.data} {args.tune_split}", progress=False)
    knn = KNNLMConfig(k=args.k, lmbda=gate_settings.lmbda, temperature=gate_settings.temperature)
    print(f"# tuned lambda {knn.lmbda:g}, T {knn.temperature:g} and fitted the gate on {gate_settings.tokens} tuning "
          f"tokens (retrieval helps {gate_settings.positive_rate:.1%}) in {time.perf_counter() - t0:.0f} s", flush=True)
    found = successors(store.provenance, len(store))
    source = PointerSource(found.next_ids, store.values, store.keys)
    print(f"# successors: {int((found.next_ids >= 0).sum())} of {len(store)} entries, contiguous {found.contiguous}")

    rows = []
    for method, params in settings(args):
        retrieval = retrieval_for(method, params, source, gate, gate_settings)
        t0 = time.perf_counter()
        r = evaluate_knnlm(model, docs, store, window, knn, boundary, recall_queries=0, progress=False,
                           retrieval=retrieval)
        wall = time.perf_counter() - t0
        overhead = r["search_seconds"] + r["pointer_seconds"] + r["gate_seconds"] + r["interpolate_seconds"]
        row = {"method": method, **params, "wall_seconds": wall, "knnlm_overhead_seconds": overhead,
               **{k: r[k] for k in KEYS if k in r}}
        rows.append(row)
        print(f"{method:>9} {json.dumps(params):<36} ppl {r['knnlm_perplexity']:8.3f}  saved "
              f"{r['searches_saved_fraction']:6.1%}  wall {wall:7.1f} s  overhead {overhead:6.2f} s", flush=True)
    plain = rows[0]
    for row in rows:
        row["perplexity_change"] = row["knnlm_perplexity"] / plain["knnlm_perplexity"] - 1.0
        row["overhead_ratio"] = row["knnlm_overhead_seconds"] / plain["knnlm_overhead_seconds"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = {"model": bench.name, "datastore": args.datastore, "datastore_size": info.n, "index": info.index,
               "eval": f"{args.data} {args.eval_split}", "tune": f"{args.data} {args.tune_split}",
               "lambda": knn.lmbda, "temperature": knn.temperature, "k": knn.k,
               "gate_tokens": gate_settings.tokens, "gate_accuracy": gate_settings.accuracy,
               "faiss_blas_threshold": blas_threshold, "runs": rows}
    out.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(rows, out.with_suffix(".png"), summary)
    print(f"# wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


def plot(rows: list[dict], path: Path, summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for method, marker in (("adaptive", "o"), ("pointers", "s"), ("both", "^")):
        pts = sorted((r for r in rows if r["method"] in ("plain", method)), key=lambda r: r["searches_saved_fraction"])
        x = [100 * r["searches_saved_fraction"] for r in pts]
        a.plot(x, [r["knnlm_perplexity"] for r in pts], marker=marker, label=method)
        b.plot(x, [r["knnlm_overhead_seconds"] for r in pts], marker=marker, label=method)
    plain = rows[0]
    a.axhline(plain["knnlm_perplexity"] * 1.01, color="grey", ls=":", label="plain kNN-LM +1%")
    a.axhline(plain["base_perplexity"], color="black", ls="--", label="base LM")
    a.set(xlabel="searches saved (%)", ylabel="perplexity", title="perplexity vs searches saved")
    b.set(xlabel="searches saved (%)", ylabel="kNN-LM overhead (s)", title="search + walk + gate + mixing time")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{summary['model']} kNN-LM, {summary['datastore_size']:,} keys ({summary['index']}), "
                 f"{plain['tokens']:,} tokens of {summary['eval']}, k {summary['k']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
