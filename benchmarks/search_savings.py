"""Perplexity and wall time vs the fraction of kNN-LM searches saved: adaptive retrieval (He et al.
2021), RetoMaton pointers (Alon et al. 2022) and both together, against plain kNN-LM, in one run.

The setting is the README's kNN-LM one: SmolLM2-135M-Instruct Q4_1, a datastore of SOTU speeches (default
~/.cache/memlm/demo/ds-sotu-1990-2000 of scripts/demo.sh: 81,169 keys, Flat, context 512 / stride 512). Two
splits, checked to share no document (benchmarks/harness.refuse_overlap, the rule of `memlm eval`):
- the tuning split, the first --tune-tokens tokens of sotu "2001<=year<=2002" (--tune-split): lambda and T are
  tuned on it, the gate (memlm.jobs.adaptive_train) is fitted on it (or on --gate-split, also disjoint from the
  evaluation), and EVERY setting of the sweep (adaptive fractions, RetoMaton's minimum pointers, clusters,
  sketches, widths, exact members, nearest clusters, both together) runs on it;
- the evaluation split, the first --eval-tokens tokens of sotu "year>=2003" (--eval-split): per family (adaptive
  retrieval, RetoMaton, both) the setting that saves the most searches within --budget (+1%) of plain kNN-LM's
  perplexity on the tuning split is measured there once, beside plain kNN-LM; these held-out figures are the
  result (and the README's headlines), the sweep is recorded beside them.
On each split the decoder runs once (timed: the forward); every setting then replays those windows through
memlm.jobs.knnlm_eval.knn_pass, exactly what evaluate_knnlm runs after the forward, with the same lambda, T and
k. A setting's wall time is the forward's plus its own pass (search + pointer walk + gate + interpolation, all
of it timed by one clock); the auxiliary structures it walks or reads (the gate, the successors, k-means
clusters, sketches) are built once before the passes, and their seconds are reported beside it (build_seconds,
wall_with_build_seconds). Writes docs/results/data/search_savings.json (benchmarks/harness.py; the whole
command's wall time and peak memory in it) and the curves as a PNG beside it (or --out).

    python benchmarks/search_savings.py [--datastore DS] [--eval-tokens 6000] [--tune-tokens 10000] \
        [--gate-split SPLIT --gate-tokens 30000] [--clusters 500 2000] [--sketch-dims 0 64 --clustered-widths 0 4096] \
        [--exact-members 1024] [--max-clusters 0] [--both-clusters 2000] [--repeats 2] [--budget 0.01] \
        [--out PATH] [--results DIR] [--result-name NAME]

The figures the project states, with the commands that made them: docs/results.md ("Fewer searches").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import _common
import harness

from memlm.retrieval.clustered_states import EXACT_MEMBERS

KEYS = ("knnlm_perplexity", "base_perplexity", "searches", "searches_saved", "searches_saved_fraction",
        "search_seconds", "pointer_seconds", "gate_seconds", "interpolate_seconds",
        "stream_searches", "pointer_tokens", "adaptive_skipped", "adaptive_threshold", "tokens")


def settings(args: argparse.Namespace) -> list[tuple[str, dict]]:
    """(method, parameters) of every evaluation: plain first."""
    runs: list[tuple[str, dict]] = [("plain", {})]
    runs += [("adaptive", {"fraction": f}) for f in args.fractions]
    runs += [("pointers", {"min_pointers": m}) for m in args.min_pointers]
    runs += [("pointers_kept", {"min_pointers": m, "keep": True}) for m in args.kept_min_pointers]
    kept = {"keep": True} if args.clustered_keep else {}
    runs += [("clustered", {"min_pointers": m, "clusters": c, **kept, **scoring}) for c in args.clusters
             for scoring in clustered_scorings(args) for m in args.clustered_min_pointers]
    keep = {"keep": True} if args.both_keep else {}
    if args.both_clusters:
        keep["clusters"] = args.both_clusters
    both_scorings = clustered_scorings(args) if args.both_clusters and args.both_sketched else [{}]
    runs += [("both", {"min_pointers": m, "fraction": f, **keep, **scoring}) for scoring in both_scorings
             for m in args.both_min_pointers for f in args.both_fractions]
    return [(method, {**params, **({"search_rows": n} if n else {})}) for method, params in runs
            for n in (args.search_rows if "min_pointers" in params else [0])]  # each walk per --search-rows


def clustered_scorings(args: argparse.Namespace) -> list[dict]:
    """How the clustered walks score and keep members, the i-th of --sketch-dims, --clustered-widths and
    --exact-members together: every member exactly (sketch 0) or ranked by a KeySketch of that many
    components with that many scored exactly, keeping that many candidates a clustered row (0: as many as a
    searched row, k). One --exact-members value serves every sketch."""
    if len(args.sketch_dims) != len(args.clustered_widths):
        raise SystemExit("--sketch-dims and --clustered-widths are pairs: give as many of each")
    n = len(args.sketch_dims)
    exact, nearest = (v * n if len(v) == 1 else v for v in (args.exact_members, args.max_clusters))
    if len(exact) != n or len(nearest) != n:
        raise SystemExit("--exact-members, --max-clusters: one value, or one per --sketch-dims")
    out = []
    for dims, width, members, most in zip(args.sketch_dims, args.clustered_widths, exact, nearest):
        scoring = {"sketch": dims} if dims == 0 else {"sketch": dims, "exact_members": members,
                                                       **({"max_clusters": most} if most else {})}
        out.append({**scoring, **({"cluster_width": width} if width else {})})
    return out


def retrieval_for(method: str, params: dict, sources: dict, gate, gate_settings):
    from memlm.jobs.knnlm_eval import Retrieval
    from memlm.retrieval.adaptive import AdaptiveConfig, threshold_for_fraction
    from memlm.retrieval.pointers import PointerConfig

    adaptive = pointers = None
    if "fraction" in params:
        adaptive = AdaptiveConfig(gate, gate_settings, threshold_for_fraction(gate_settings, params["fraction"]))
    if "min_pointers" in params:
        pointers = PointerConfig(min_pointers=params["min_pointers"], keep_pointers=params.get("keep", False),
                                 cluster_width=params.get("cluster_width"), search_rows=params.get("search_rows"))
    key = (params.get("clusters", 0), params.get("sketch", 0), params.get("exact_members", 0),
           params.get("max_clusters", 0))
    return Retrieval(pointers, sources[key] if pointers else None, adaptive)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--datastore", default=str(Path.home() / ".cache/memlm/demo/ds-sotu-1990-2000"),
                   help="a datastore built by scripts/demo.sh (MEMLM_DEMO_OUT=~/.cache/memlm/demo make demo)")
    p.add_argument("--data", default="sotu")
    p.add_argument("--eval-split", default="year>=2003")
    p.add_argument("--tune-split", default="2001<=year<=2002")
    p.add_argument("--eval-tokens", type=int, default=12000)
    p.add_argument("--tune-tokens", type=int, default=10000)
    p.add_argument("--gate-split", default=None, help="fit the gate on this split (default: the tuning split); "
                   "disjoint from the evaluation split (and, to be fair, from the datastore)")
    p.add_argument("--gate-tokens", type=int, default=30000)
    p.add_argument("--repeats", type=int, default=1, help="passes per setting; the least time is reported (a loaded "
                   "machine: identical work measured 19-27 s in one run)")
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--fractions", type=float, nargs="*", default=[0.25, 0.5, 0.75])
    p.add_argument("--min-pointers", type=int, nargs="*", default=[1, 2, 4, 8, 16, 64])
    p.add_argument("--kept-min-pointers", type=int, nargs="*", default=[1, 4, 16, 64],
                   help="RetoMaton with the pointers kept beside each fresh search (retomaton.py's union)")
    p.add_argument("--both-min-pointers", type=int, nargs="*", default=[4, 16])
    p.add_argument("--both-keep", action="store_true", help="'both' keeps the pointers beside each search too")
    p.add_argument("--gate-use-key", action="store_true", help="the gate reads the whole kNN key too (He et al.'s ctxt)")
    p.add_argument("--gate-key-components", type=int, default=None, help="principal components of the key the gate "
                   "reads (default GateConfig's)")
    p.add_argument("--gate-objective", default=None, help="mixture or weighted_label (default GateConfig's)")
    p.add_argument("--clusters", type=int, nargs="*", default=[], help="RetoMaton over clustered states: k-means "
                   "clusters of the datastore's keys, one walk per count and --clustered-min-pointers")
    p.add_argument("--clustered-min-pointers", type=int, nargs="*", default=[1, 4, 16])
    p.add_argument("--clustered-keep", action="store_true", help="the clustered walks keep the pointers beside each "
                   "search too (retomaton.py's union)")
    p.add_argument("--sketch-dims", type=int, nargs="*", default=[0], help="clustered walks: members ranked by a "
                   "KeySketch of this many principal components before their exact distances (0: every member "
                   "scored exactly); one walk per value, paired with --clustered-widths")
    p.add_argument("--exact-members", type=int, nargs="+", default=[EXACT_MEMBERS], help="with a sketch: members a "
                   "row scores exactly (one value for every --sketch-dims, or the i-th with the i-th)")
    p.add_argument("--max-clusters", type=int, nargs="+", default=[0], help="with a sketch: clusters a row ranks "
                   "the members of, the nearest by centroid (KeySketch.max_clusters; 0: all; one value for every "
                   "--sketch-dims, or the i-th with the i-th)")
    p.add_argument("--clustered-widths", type=int, nargs="*", default=[0], help="candidates a clustered row keeps "
                   "(PointerConfig.cluster_width; 0: k), the i-th with the i-th --sketch-dims")
    p.add_argument("--both-clusters", type=int, default=0, help="'both' walks states clustered into this many "
                   "(one of --clusters; 0: pointers alone)")
    p.add_argument("--both-sketched", action="store_true", help="'both' walks its clustered states with each of "
                   "the clustered walks' scorings (--sketch-dims, --exact-members, --max-clusters, --clustered-widths) "
                   "instead of every member scored exactly")
    p.add_argument("--both-fractions", type=float, nargs="*", default=[0.25, 0.5])
    p.add_argument("--search-rows", type=int, nargs="+", default=[0], help="each walk once per value: its waiting "
                   "streams searched once this many wait, or as many as still move (PointerConfig.search_rows; 0: "
                   "once all of them wait)")
    p.add_argument("--budget", type=float, default=0.01, help="the perplexity budget of the choice: a family's "
                   "setting saving the most searches within (1 + budget) x plain kNN-LM's perplexity on the tuning "
                   "split is measured on the evaluation split")
    p.add_argument("--out", default=None, help="writes OUT.png (default: beside the JSON result, same name)")
    p.add_argument("--replot", default=None, metavar="JSON", help="only draw OUT.png again from a run's JSON")
    harness.add_options(p, "search_savings")
    return p.parse_args()


def forward_once(model, docs, window, boundary):
    """The evaluation windows, scored once with the gate's features (CPU keys), and the forward's seconds."""
    from memlm.jobs.windows import score_documents
    from memlm.retrieval.adaptive import distribution_features

    t0 = time.perf_counter()
    windows = [s._replace(keys=s.keys.cpu()) for s in score_documents(
        model, docs, window, boundary, with_logprobs=True, lm_features=distribution_features)]
    return windows, time.perf_counter() - t0


def run_setting(windows, total, forward_seconds, store, knn, retrieval, repeats: int) -> tuple[dict, float]:
    """One setting replayed over the windows `repeats` times: its evaluate_knnlm-style result and the pass's
    least wall seconds (its timings' breakdown from that repeat)."""
    import torch

    from memlm.jobs.knnlm_eval import PassTimers, knn_pass, pass_result

    best = None
    for _ in range(repeats):  # the same work each time: the least time is the one least disturbed by the load
        timers = PassTimers(torch.device("cpu"))
        timers.forward.seconds = forward_seconds
        t0 = time.perf_counter()
        run = knn_pass(iter(windows), total, timers, store, knn, knn.lmbda, knn.temperature, 0, 1024, False,
                            retrieval)
        seconds = time.perf_counter() - t0
        if best is None or seconds < best[1]:
            best = (pass_result(run), seconds)
    return best


FAMILIES = {"adaptive": ("adaptive",), "retomaton": ("pointers", "pointers_kept", "clustered"), "both": ("both",)}
"""The choices made on the tuning split: one setting per family, measured on the evaluation split."""


def source_key(params: dict) -> tuple:
    return (params.get("clusters", 0), params.get("sketch", 0), params.get("exact_members", 0),
            params.get("max_clusters", 0))


def sweep_rows(label: str, settings_: list[tuple[str, dict]], windows, total, forward, store, knn, sources, gate,
               gate_settings, builds: dict, repeats: int) -> list[dict]:
    """Every setting replayed over one split's windows: a row each (plain first), printed as it is measured."""
    rows = []
    for method, params in settings_:
        r, pass_seconds = run_setting(windows, total, forward, store, knn, retrieval_for(method, params, sources, gate,
                                                                                         gate_settings), repeats)
        built = (builds["successors"] + builds.get(source_key(params), 0.0) if "min_pointers" in params else 0.0) + \
            (builds["gate"] if "fraction" in params else 0.0)
        row = {"method": method, **params, "pass_seconds": pass_seconds, "forward_seconds": forward,
               "wall_seconds": forward + pass_seconds, "build_seconds": built,
               "wall_with_build_seconds": forward + pass_seconds + built, **{k: r[k] for k in KEYS if k in r}}
        rows.append(row)
        plain = rows[0]
        print(f"{label} {method:>13} {json.dumps(params):<48} ppl {r['knnlm_perplexity']:8.3f} "
              f"({r['knnlm_perplexity'] / plain['knnlm_perplexity'] - 1:+6.2%})  saved {r['searches_saved_fraction']:6.1%}"
              f"  pass {pass_seconds:6.1f} s ({pass_seconds / plain['pass_seconds']:.2f}x plain)  wall "
              f"{row['wall_seconds']:6.1f} s ({row['wall_seconds'] / plain['wall_seconds']:.2f}x; built beside it "
              f"{built:.1f} s)", flush=True)
    plain = rows[0]
    for row in rows:
        row["perplexity_change"] = row["knnlm_perplexity"] / plain["knnlm_perplexity"] - 1.0
        row["pass_ratio"] = row["pass_seconds"] / plain["pass_seconds"]
        row["wall_ratio"] = row["wall_seconds"] / plain["wall_seconds"]
        row["wall_with_build_ratio"] = row["wall_with_build_seconds"] / plain["wall_seconds"]
    return rows


def choose(rows: list[dict], budget: float) -> dict[str, dict]:
    """Per family, the row saving the most searches within the perplexity budget (ties: the least wall time)."""
    chosen = {}
    for family, methods in FAMILIES.items():
        fits = [r for r in rows if r["method"] in methods and r["perplexity_change"] <= budget]
        if fits:
            chosen[family] = max(fits, key=lambda r: (r["searches_saved_fraction"], -r["wall_seconds"]))
    return chosen


def params_of(row: dict) -> tuple[str, dict]:
    """(method, parameters) of a sweep row (settings()'s form)."""
    keys = ("fraction", "min_pointers", "keep", "clusters", "sketch", "exact_members", "max_clusters",
            "cluster_width", "search_rows")
    return row["method"], {k: row[k] for k in keys if k in row}


def main() -> None:
    args = parse()
    if args.replot is not None:
        summary = json.loads(Path(args.replot).read_text())
        plot(summary, Path(args.out or Path(args.replot).with_suffix("")).with_suffix(".png"))
        return
    import faiss

    from datastore import Datastore
    from memlm.jobs.adaptive_train import train_gate
    from memlm.jobs.knnlm_eval import collect_tuning_data, tune
    from memlm.jobs.windows import WindowConfig
    from memlm.retrieval.adaptive import GateConfig
    from memlm.retrieval.compat import check_searcher
    from memlm.retrieval.knnlm import KNNLMConfig
    from memlm.retrieval.clustered_states import cluster_states, key_sketch
    from memlm.retrieval.pointers import PointerSource, successors

    result = harness.Result.from_args(args)
    bench = _common.load_model(None, False)
    model, boundary = bench.pre.model, bench.boundary
    gate_split = args.gate_split or args.tune_split
    harness.refuse_overlap(args.data, args.tune_split, args.eval_split, tokenizer=bench.pre.tokenizer,
                           tune_tokens=args.tune_tokens, eval_tokens=args.eval_tokens)
    if args.gate_split is not None:
        harness.refuse_overlap(args.data, gate_split, args.eval_split, tokenizer=bench.pre.tokenizer,
                               tune_tokens=args.gate_tokens, eval_tokens=args.eval_tokens, what="gate")
    store = Datastore.open(args.datastore)
    info = store.info()
    window = WindowConfig(info.context, info.stride, args.batch_size)
    check_searcher(info, model_fingerprint=bench.pre.fingerprint, tokenizer_fingerprint=bench.pre.tokenizer.fingerprint,
                   dim=model.config.n_embd, key_layer=model.config.key_description, boundary_token=boundary,
                   context=window.context, stride=window.stride)
    docs, _ = _common.load_tokens(bench, args.data, args.eval_split, args.eval_tokens, False)
    tune_docs, _ = _common.load_tokens(bench, args.data, args.tune_split, args.tune_tokens, False)
    gate_docs = tune_docs if args.gate_split is None else _common.load_tokens(bench, args.data, gate_split,
                                                                              args.gate_tokens, False)[0]

    tune_windows, tune_forward = forward_once(model, tune_docs, window, boundary)
    tune_total = sum(len(d) for d in tune_docs)
    t0 = time.perf_counter()
    tuned = tune(collect_tuning_data(iter(tune_windows), tune_total, store,
                                     KNNLMConfig(k=args.k, lmbda=None, temperature=None), progress=False))
    knn = KNNLMConfig(k=args.k, lmbda=tuned.lmbda, temperature=tuned.temperature)
    tuning_seconds = time.perf_counter() - t0
    g = GateConfig()
    gate_config = GateConfig(use_key=args.gate_use_key, objective=args.gate_objective or g.objective,
                             key_components=g.key_components if args.gate_key_components is None
                             else args.gate_key_components)
    with result.build("adaptive gate (fitted)"):
        gate, gate_settings = train_gate(model, gate_docs, [], store, window, knn, boundary,
                                         gate_config, model_fingerprint=bench.pre.fingerprint,
                                         tune_data=f"{args.data} {gate_split}", progress=False)
    print(f"# tuned lambda {knn.lmbda:g}, T {knn.temperature:g} on {args.tune_split} in {tuning_seconds:.0f} s; fitted "
          f"the gate on {gate_settings.tokens} tokens of {gate_split} (retrieval helps {gate_settings.positive_rate:.1%})"
          f" in {result.builds['adaptive gate (fitted)']:.0f} s", flush=True)
    builds = {"gate": result.builds["adaptive gate (fitted)"]}
    with result.build("successors"):
        found = successors(store.provenance, len(store))
    builds["successors"] = result.builds["successors"]
    sources = {(0, 0, 0, 0): PointerSource.local(found.next_ids, store.values, store.keys)}
    if args.both_clusters and args.both_clusters not in args.clusters:
        raise SystemExit("--both-clusters must be one of --clusters")
    for c in args.clusters:
        t0 = time.perf_counter()
        with result.build(f"k-means into {c} clusters"):
            states = cluster_states(store.keys, c, sketch_dims=0)
        builds[(c, 0, 0, 0)] = kmeans = result.builds[f"k-means into {c} clusters"]
        sources[(c, 0, 0, 0)] = PointerSource.local(found.next_ids, store.values, store.keys, states)
        for scoring in (s for s in clustered_scorings(args) if s["sketch"]):  # the same clusters, ranked by a sketch
            key = (c, scoring["sketch"], scoring["exact_members"], scoring.get("max_clusters", 0))
            if key not in sources:
                name = f"sketch {key[1]} of {c} clusters ({key[2]} exact, {key[3] or 'all'} nearest)"
                with result.build(name):
                    sketch = key_sketch(states.member_keys, *key[1:3], key[3] or None)
                builds[key] = kmeans + result.builds[name]  # a sketched walk needs the k-means too
                sources[key] = PointerSource.local(found.next_ids, store.values, store.keys,
                                                   dataclasses.replace(states, sketch=sketch))
        print(f"# k-means of the keys into {c} clusters (and sketches {args.sketch_dims}): "
              f"{time.perf_counter() - t0:.0f} s (built once, reported beside each walk that uses them)", flush=True)
    print(f"# successors: {int((found.next_ids >= 0).sum())} of {len(store)} entries, contiguous {found.contiguous}; "
          f"faiss BLAS threshold {int(faiss.cvar.distance_compute_blas_threshold)} (queries x d), "
          f"{faiss.omp_get_max_threads()} thread(s)")
    print(f"# sweep on the tuning split: forward over {tune_total} tokens of {args.tune_split}: {tune_forward:.1f} s",
          flush=True)
    sweep = sweep_rows("tune", settings(args), tune_windows, tune_total, tune_forward, store, knn, sources, gate,
                       gate_settings, builds, args.repeats)
    chosen = choose(sweep, args.budget)
    for family in FAMILIES:
        if family not in chosen and any(r["method"] in FAMILIES[family] for r in sweep):
            print(f"# {family}: no setting within +{args.budget:.0%} perplexity on the tuning split", flush=True)
    del tune_windows
    windows, forward = forward_once(model, docs, window, boundary)
    total = sum(len(d) for d in docs)
    print(f"# held out: forward over {total} evaluation tokens of {args.eval_split}: {forward:.1f} s; plain and the "
          f"chosen settings ({', '.join(f'{f}: {json.dumps(params_of(r)[1])}' for f, r in chosen.items())})",
          flush=True)
    held = sweep_rows("eval", [("plain", {})] + [params_of(r) for r in chosen.values()], windows, total, forward,
                      store, knn, sources, gate, gate_settings, builds, args.repeats)
    for family, row in zip(chosen, held[1:]):
        row["family"] = family
        what = json.dumps(params_of(row)[1])
        result.headline(family, f"{row['searches_saved_fraction']:.1%} at {row['perplexity_change']:+.2%} "
                                f"({row['method']} {what}; wall {row['wall_ratio']:.2f}x plain)")
    result.rows = held
    result.tuned(data=args.data, split=args.tune_split, evaluation=f"{args.data} {args.eval_split}",
                 rule=f"per family ({', '.join(FAMILIES)}), the most searches saved within +{args.budget:.0%} of plain "
                      "kNN-LM's perplexity on the tuning split",
                 chosen={family: params_of(row) for family, row in chosen.items()}, sweep=sweep)
    result.settings = {"model": bench.name, "datastore": args.datastore, "datastore_size": info.n, "index": info.index,
                       "eval": f"{args.data} {args.eval_split}", "eval_tokens": total,
                       "tune": f"{args.data} {args.tune_split}", "tune_tokens": tune_total, "k": knn.k,
                       "lambda": knn.lmbda, "temperature": knn.temperature, "gate_split": gate_split,
                       "gate_tokens": gate_settings.tokens, "gate_accuracy": gate_settings.accuracy,
                       "gate_config": json.dumps(dataclasses.asdict(gate_config)), "budget": args.budget,
                       "repeats": args.repeats, "faiss_blas_threshold": int(faiss.cvar.distance_compute_blas_threshold),
                       "threads": faiss.omp_get_max_threads()}
    result.figures = {"plain_knnlm_perplexity": held[0]["knnlm_perplexity"], "base_perplexity": held[0]["base_perplexity"],
                      "forward_seconds": forward, "tune_forward_seconds": tune_forward,
                      "lambda_t_tuning_seconds": tuning_seconds}
    path = result.write()
    out = Path(args.out) if args.out else path.with_suffix("")
    out.parent.mkdir(parents=True, exist_ok=True)
    plot(json.loads(path.read_text()), out.with_suffix(".png"))
    print(f"# wrote {out.with_suffix('.png')}")


def plot(summary: dict, path: Path) -> None:
    """The curves of the sweep (on the tuning split), with each choice's held-out point starred: from this
    benchmark's JSON (harness.Result) or an older run's file of {"runs": rows, ...}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "runs" in summary:  # an older run's file: its rows were measured on the evaluation split alone
        rows, held, title = summary["runs"], [], summary
    else:
        rows, held = summary["tuning"]["sweep"], summary["rows"]
        title = {**summary["settings"], "forward_seconds": summary["tuning"]["sweep"][0]["forward_seconds"],
                 "model": summary["settings"]["model"], "eval": summary["settings"]["tune"] + " (sweep)"}
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5.2))
    markers = {"adaptive": "o", "pointers": "s", "pointers_kept": "D", "clustered": "P", "both": "^"}
    def curve(r: dict) -> tuple:
        return (r["method"], r.get("clusters", 0), r.get("sketch", 0), r.get("cluster_width", 0), r.get("keep", False),
                r.get("exact_members", 0), r.get("max_clusters", 0), r.get("search_rows", 0))

    curves = list(dict.fromkeys(curve(r) for r in rows if r["method"] != "plain"))
    for key in curves:  # one curve per method, cluster count and scoring
        method, clusters, sketch, width, keep, exact, nearest, search_rows = key
        pts = sorted((r for r in rows if r["method"] == "plain" or curve(r) == key),
                     key=lambda r: r["searches_saved_fraction"])
        x = [100 * r["searches_saved_fraction"] for r in pts]
        label = {"pointers": "RetoMaton pointers", "pointers_kept": "RetoMaton, pointers kept beside searches",
                 "clustered": "RetoMaton", "both": "adaptive + RetoMaton"}.get(method, "adaptive retrieval")
        label += f", {clusters} clustered states" if clusters else ""
        label += f", sketch {sketch} ({exact} exact)" if sketch else ""
        label += f", {nearest} nearest clusters" if nearest else ""
        label += f", keeps {width}" if width else ""
        label += ", kept" if keep and method == "clustered" else ""
        label += f", searched from {search_rows} waiting" if search_rows else ""
        color = plt.cm.tab20(curves.index(key) % 20)  # distinct for 20 curves
        a.plot(x, [r["knnlm_perplexity"] for r in pts], marker=markers[method], label=label, color=color)
        b.plot(x, [r["wall_ratio"] for r in pts], marker=markers[method], label=label, color=color)
        b.plot(x, [r["pass_ratio"] for r in pts], marker=markers[method], ls="--", color=color, alpha=0.6)
    plain = rows[0]
    a.axhline(plain["knnlm_perplexity"] * 1.01, color="grey", ls=":", label="plain kNN-LM +1%")
    a.axhline(plain["knnlm_perplexity"], color="grey", ls="-", lw=0.8, label="plain kNN-LM")
    a.axhline(plain["base_perplexity"], color="black", ls="--", label="base LM")
    a.set(xlabel="searches saved (%)", ylabel="perplexity", title="perplexity vs searches saved")
    b.axhline(1.0, color="grey", ls="-", lw=0.8)
    b.set(xlabel="searches saved (%)", ylabel="time / plain kNN-LM's",
          title=f"wall (solid; forward {title['forward_seconds']:.0f} s in it), kNN-LM part (dashed)")
    for ax in (a, b):
        ax.grid(alpha=0.3)
    for r in held[1:]:  # the choices, measured once on the evaluation split
        x = 100 * r["searches_saved_fraction"]
        a.plot([x], [r["knnlm_perplexity"] * plain["knnlm_perplexity"] / held[0]["knnlm_perplexity"]], marker="*",
               ms=14, color="black", ls="", label=f"held out: {r['family']} (ppl scaled to the sweep's plain)")
        b.plot([x], [r["wall_ratio"]], marker="*", ms=14, color="black", ls="")
    for ax in (a, b):
        ax.legend(fontsize=6)
    fig.suptitle(f"{title['model']} kNN-LM, {title['datastore_size']:,} keys ({title['index']}), "
                 f"{plain['tokens']:,} tokens of {title['eval']}, k {title['k']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
