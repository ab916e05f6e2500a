"""Fewer searches in kNN-LM generation (memlm.engine.fewer_rows): greedy kNN-LM tokens/s with RetoMaton
pointers (and optionally adaptive retrieval's gate) vs plain kNN-LM, the same engine, weights and datastore,
measured side by side in this one run.

Setting: speculative_knnlm.py's (its functions, called): the SOTU datastore of scripts/demo.sh, lambda, T and k
tuned on 2001-2002 (knnlm.json beside the datastore), prompts cut from held-apart speeches (year >= 2003, checked
not in the datastore). Per --min-pointers value one figure: plain vs pointers (sides alternate over --repeats
rounds, the median per side), with tokens/s of both, the ratio, searches per token, the share of searches saved,
and how many continuations are token-identical to plain kNN-LM (pointers change the neighbours, so the tokens
may differ: counted, not claimed; the first differing token's index is printed). The machine's load is printed.
More than one --min-pointers value is a sweep: it runs on prompts of --tune-split (default 2001-2002, checked to
share no speech with --split), the value with the highest tokens/s ratio there is measured once on --split's
prompts, and the JSON records the sweep, the choice and the held-out figure. The clustered states' k-means (and
sketch) and the datastore's successors are built before the timed figures; their seconds are in the JSON beside
them (docs/results/data/fewer_generate.json, benchmarks/harness.py).

    OMP_NUM_THREADS=1 python benchmarks/fewer_generate.py [--datastore ~/.cache/memlm/demo/ds-sotu-1990-2000]
        [--prompts 6] [--prompt-tokens 64] [--new-tokens 48] [--min-pointers 1 4] [--adaptive-gate DIR
        --adaptive-fraction F] [--batch 1] [--repeats 1] [--clusters C [--sketch-dims P --exact-members E
        --max-clusters M] [--cluster-width W]] [--tune-split "2001<=year<=2002"] [--results DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path

import _common
import harness
from speculative_knnlm import add_setting_options, held_apart_prompts, knn_settings, open_setting, timed

from memlm.engine.engine import Engine
from memlm.engine.requests import EngineConfig, GenerationRequest
from memlm.jobs.decoding import SamplingConfig, TokenEvent
from memlm.jobs.knnlm_eval import Retrieval
from memlm.retrieval.clustered_states import cluster_states
from memlm.retrieval.pointers import PointerConfig, PointerSource, successors

GREEDY = SamplingConfig(temperature=0.0)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_setting_options(p)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--min-pointers", type=int, nargs="+", default=[PointerConfig().min_pointers])
    p.add_argument("--adaptive-gate", default=None, help="a gate of memlm train-gate for this model and datastore")
    p.add_argument("--adaptive-fraction", type=float, default=0.5, help="with --adaptive-gate: searches to skip")
    p.add_argument("--batch", type=int, default=1, help="rows decoded together (1: one prompt after another)")
    p.add_argument("--repeats", type=int, default=1, help="alternating rounds per side (median)")
    p.add_argument("--clusters", type=int, default=0, help="RetoMaton over this many clustered states (0: pointers "
                   "alone), as benchmarks/search_savings.py --clusters")
    p.add_argument("--sketch-dims", type=int, default=0, help="with --clusters: members ranked by a KeySketch of this "
                   "many components (0: every member scored exactly)")
    p.add_argument("--exact-members", type=int, default=1024, help="with --sketch-dims: members a row scores exactly")
    p.add_argument("--max-clusters", type=int, default=0, help="with --sketch-dims: clusters a row ranks the members "
                   "of, the nearest by centroid (0: all), as benchmarks/search_savings.py --max-clusters")
    p.add_argument("--cluster-width", type=int, default=0, help="with --clusters: candidates a clustered row keeps "
                   "(PointerConfig.cluster_width; 0: k)")
    harness.add_options(p, "fewer_generate")
    args = p.parse_args()
    args.in_datastore = False  # held_apart_prompts' check stays on
    return args


def gate(args: argparse.Namespace, bench: _common.BenchModel, store):
    """The AdaptiveConfig of --adaptive-gate at --adaptive-fraction (checked against the model and datastore)."""
    from memlm.retrieval.adaptive import (
        AdaptiveConfig,
        load_gate,
        threshold_for_fraction,
    )

    net, settings = load_gate(Path(args.adaptive_gate))
    model = bench.pre.model
    if (settings.model_fingerprint, settings.key_layer) != (bench.pre.fingerprint, model.config.key_description) or \
            settings.datastore_corpus_fingerprint != store.info().corpus_fingerprint:
        raise SystemExit(f"--adaptive-gate {args.adaptive_gate} was fitted for another model or datastore")
    return AdaptiveConfig(net, settings, threshold_for_fraction(settings, args.adaptive_fraction))


def figure(name: str, engine: Engine, plain: list[GenerationRequest], fewer: Retrieval, repeats: int) -> dict:
    """Plain vs `fewer` over the same requests, alternating over `repeats` rounds; prints a line, returns its
    figures."""
    walked = [dataclasses.replace(r, fewer=fewer) for r in plain]
    times: dict[str, list[float]] = {"plain": [], "fewer": []}
    results: dict[str, list[list]] = {}
    for _ in range(repeats):
        for side, reqs in (("plain", plain), ("fewer", walked)):
            seconds, results[side] = timed(engine, reqs)
            times[side].append(seconds)
    tokens = {s: [[e.token_id for e in ev if isinstance(e, TokenEvent)] for ev in results[s]] for s in results}
    n = {s: sum(len(t) for t in tokens[s]) for s in tokens}
    same = sum(a == b for a, b in zip(tokens["plain"], tokens["fewer"]))
    first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(tokens["plain"], tokens["fewer"])]
    ends = {s: [ev[-1] for ev in results[s]] for s in results}
    searches = {s: sum(e.searches for e in ends[s]) for s in ends}
    saved = sum(e.searches_saved for e in ends["fewer"])
    rate = {s: n[s] / statistics.median(t) for s, t in times.items()}
    print(f"{name}: plain {rate['plain']:.1f} tokens/s, fewer {rate['fewer']:.1f} tokens/s, ratio "
          f"{rate['fewer'] / rate['plain']:.2f}x; searches per token plain {searches['plain'] / n['plain']:.2f}, "
          f"fewer {searches['fewer'] / n['fewer']:.2f} ({saved / (saved + searches['fewer']):.1%} saved); "
          f"token-identical {same}/{len(plain)} (first differing token {first}; {n['plain']} tokens)", flush=True)
    return {"figure": name, "plain_tokens_per_s": rate["plain"], "fewer_tokens_per_s": rate["fewer"],
            "ratio": rate["fewer"] / rate["plain"],
            "rounds_ratio": harness.stats([p / f for p, f in zip(times["plain"], times["fewer"])]),
            "searches_per_token_plain": searches["plain"] / n["plain"],
            "searches_per_token_fewer": searches["fewer"] / n["fewer"],
            "searches_saved": saved / (saved + searches["fewer"]), "token_identical": f"{same}/{len(plain)}",
            "tokens": n["plain"]}


def main() -> None:
    args = parse_args()
    result = harness.Result.from_args(args)
    bench, store = open_setting(args)
    model, tok = bench.pre.model, bench.pre.tokenizer
    knn = knn_settings(args)
    prompts = held_apart_prompts(bench, store, args)
    clusters = None
    if args.clusters:
        with result.build(f"k-means of the keys into {args.clusters} clustered states (sketch {args.sketch_dims})"):
            clusters = cluster_states(store.keys, args.clusters, sketch_dims=args.sketch_dims,
                                      exact_members=args.exact_members, max_clusters=args.max_clusters or None)
    with result.build("successors of the datastore's entries"):
        found = successors(store.provenance, len(store))
    source = PointerSource.local(found.next_ids, store.values, store.keys, clusters)
    adaptive = gate(args, bench, store) if args.adaptive_gate else None
    print(f"# SmolLM2-135M-Instruct Q4_1, datastore {args.datastore} ({store.info().n} entries, {store.info().index}), "
          f"k {knn.k}, lambda {knn.lmbda}, T {knn.temperature:.3f}; {len(prompts)} prompts of {args.prompt_tokens} "
          f"tokens from {args.split}, {args.new_tokens} new tokens greedy, batch {args.batch}"
          + (f", gate {args.adaptive_gate} at fraction {args.adaptive_fraction}" if adaptive else "")
          + (f", {args.clusters} clustered states (sketch {args.sketch_dims}, keeping {args.cluster_width or knn.k})"
             if clusters else ""), flush=True)
    engine = Engine(model, tok, EngineConfig(max_batch=args.batch), store)

    def requests(prompt_ids) -> list[GenerationRequest]:
        return [GenerationRequest(p, args.new_tokens, GREEDY, boundary_token=bench.boundary, knn=knn)
                for p in prompt_ids]

    def walk(m: int) -> Retrieval:
        return Retrieval(PointerConfig(min_pointers=m, cluster_width=args.cluster_width or None), source, adaptive)

    def label(m: int) -> str:
        return f"pointers min {m}" + (" + gate" if adaptive else "")

    chosen = args.min_pointers
    if len(args.min_pointers) > 1:  # a sweep: chosen on the tuning split's prompts, measured once on --split's
        harness.refuse_overlap("sotu", args.tune_split, args.split)
        tuning = requests(held_apart_prompts(bench, store, args, args.tune_split))
        print(f"# sweep of --min-pointers {args.min_pointers} on {len(tuning)} prompts of {args.tune_split}",
              flush=True)
        sweep = [{"min_pointers": m, **figure(f"{label(m)} [tuning split]", engine, tuning, walk(m), args.repeats)}
                 for m in args.min_pointers]
        best = max(sweep, key=lambda r: r["ratio"])["min_pointers"]
        chosen = [best]
        result.tuned(data="sotu", split=args.tune_split, evaluation=f"sotu {args.split}",
                     rule="the --min-pointers value with the highest fewer / plain tokens/s ratio on the tuning "
                          "prompts", chosen={"min_pointers": best}, sweep=sweep)
    plain = requests(prompts)
    for m in chosen:
        result.rows.append({"min_pointers": m, **figure(label(m), engine, plain, walk(m), args.repeats)})
    if adaptive is not None:
        result.rows.append(figure("gate alone", engine, plain, Retrieval(adaptive=adaptive), args.repeats))
    info = store.info()
    result.settings = {"model": bench.name, "dtype": args.dtype, "datastore": args.datastore, "entries": info.n,
                       "index": info.index, "search_backend": args.search_backend, "k": knn.k, "lambda": knn.lmbda,
                       "temperature": knn.temperature, "split": args.split, "prompts": len(prompts),
                       "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "batch": args.batch,
                       "repeats": args.repeats, "clusters": args.clusters, "sketch_dims": args.sketch_dims,
                       "exact_members": args.exact_members, "max_clusters": args.max_clusters,
                       "cluster_width": args.cluster_width, "adaptive_gate": args.adaptive_gate,
                       "adaptive_fraction": args.adaptive_fraction if adaptive else None}
    result.write()


if __name__ == "__main__":
    main()
