"""kNN-LM interpolation methods on held-out text: constant lambda and T, a learned per-token mix, each with or
without a continuous cache of the document, and the one `memlm eval --lambda auto --knn-temperature auto` picks.

The setting of `make demo` (scripts/demo.sh): SmolLM2-135M-Instruct Q4_1, the 1990-2000 SOTU datastore (default
~/.cache/memlm/demo/ds-sotu-1990-2000; its windows are the evaluation's), k 1024. Every method is fitted on the
first --tune-tokens tokens of --tune-split (memlm.jobs.interpolation_eval.fit_method); the auto choice is made on
a held-apart tail of those tokens (choose_method); the tuning split must share no document with the first
--eval-tokens tokens of --eval-split (benchmarks/harness.refuse_overlap). The evaluation text is then scored once
per method (memlm.jobs.interpolation_eval.evaluate_interpolation), each row timed whole (forward, search, cache,
mixing), after one untimed pass over the start of the tuning text; base perplexity and tokens/s come from
the constant row's forward.

    python benchmarks/knnlm_interpolation.py [--datastore DS] [--eval-split "year>=2003"] [--eval-tokens 6000]
        [--tune-split "2001<=year<=2002"] [--tune-tokens 4000] [--k 1024] [--threads 2] [--results DIR]

Writes docs/results/data/knnlm_interpolation.json (benchmarks/harness.py).
"""

from __future__ import annotations

import argparse

import _common
import harness
import torch

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _common.add_knnlm_setting_options(p)
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    harness.add_options(p, "knnlm_interpolation")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    result = harness.Result.from_args(args)

    from memlm.jobs.interpolation_eval import (
        METHODS,
        CacheConfig,
        choose_method,
        collect_interpolation_data,
        evaluate_interpolation,
        fit_method,
    )
    from memlm.retrieval.interpolation import FitConfig, method_record
    from memlm.retrieval.knnlm import KNNLMConfig

    setting = _common.knnlm_setting(args)
    bench, store, window, docs, tune_docs = setting.bench, setting.store, setting.window, setting.docs, setting.tune_docs
    model, checked, info = bench.pre.model, setting.checked_documents, setting.store.info()
    knn, cache, fit = KNNLMConfig(k=args.k), CacheConfig(), FitConfig()

    with result.build("tuning data (one forward and search of the tuning tokens)"):
        data = collect_interpolation_data(model, tune_docs, store, window, knn, cache, bench.boundary, progress=False)
    with result.build("auto choice (every method fitted without the held-apart tail)"):
        choice = choose_method(data, fit)
    methods = {}
    with result.build("fits on all the tuning tokens"):
        for name in METHODS:
            methods[name] = choice.method if name == choice.method.method else fit_method(name, data, fit)

    # One untimed pass over the start of the tuning text first, so that no row pays for first calls.
    evaluate_interpolation(model, [tune_docs[0][: window.context]], store, window, knn, bench.boundary,
                           methods["learned+cache"], cache=cache, progress=False)
    runs = {name: evaluate_interpolation(model, docs, store, window, knn, bench.boundary, method, cache=cache,
                                         progress=False) for name, method in methods.items()}
    constant = runs["constant"]
    base = constant["base_perplexity"]
    result.check("every row scores the same base tokens",
                 all(r["base_nll"] == constant["base_nll"] and r["tokens"] == constant["tokens"] for r in runs.values()))
    rows = [{"method": "base", "perplexity": base, "relative_change": 0.0,
             "tokens_per_s": constant["base_tokens_per_s"], "speed_vs_constant": None}]
    for name, r in runs.items():
        rows.append({"method": name, "perplexity": r["knnlm_perplexity"], "relative_change": r["relative_change"],
                     "tokens_per_s": r["knnlm_tokens_per_s"],
                     "speed_vs_constant": r["knnlm_tokens_per_s"] / constant["knnlm_tokens_per_s"],
                     "search_s": r["search_seconds"], "cache_s": r["cache_seconds"],
                     "interpolate_s": r["interpolate_seconds"], "forward_s": r["forward_seconds"],
                     "chosen_by_auto": name == choice.method.method})
    auto = runs[choice.method.method]
    rows.append({"method": f"auto ({choice.method.method})", "perplexity": auto["knnlm_perplexity"],
                 "relative_change": auto["relative_change"], "tokens_per_s": auto["knnlm_tokens_per_s"],
                 "speed_vs_constant": auto["knnlm_tokens_per_s"] / constant["knnlm_tokens_per_s"],
                 "same_run_as": choice.method.method})
    print(f"datastore {args.datastore} ({info.n} keys, {info.index}), context {window.context}, stride "
          f"{window.stride}, k {args.k}, {torch.get_num_threads()} threads; fitted on {data.lm.shape[0]} tokens of "
          f"{args.tune_split} (auto chose on the last {choice.held_tokens}), disjoint from the {checked} evaluated "
          f"documents; {constant['tokens']} tokens of {args.data} {args.eval_split}:")
    for row in rows:
        speed = "" if row["speed_vs_constant"] is None else f"  {row['speed_vs_constant']:.2f}x constant"
        print(f"  {row['method']:<24} {row['perplexity']:8.3f}  {row['relative_change']:+7.2%}  "
              f"{row['tokens_per_s']:7.0f} tokens/s{speed}")
    result.settings = {"model": bench.name, "dtype": "float32", "threads": torch.get_num_threads(),
                       "datastore": args.datastore, "datastore_size": info.n, "index": info.index,
                       "context": window.context, "stride": window.stride, "k": args.k, "cache_size": cache.size,
                       "cache_k": cache.k, "fit": {"hidden": fit.hidden, "steps": fit.steps, "lr": fit.lr,
                                                   "weight_decay": fit.weight_decay,
                                                   "learn_temperature": fit.learn_temperature},
                       "eval": f"{args.data} {args.eval_split}", "eval_tokens": constant["tokens"]}
    result.tuned(data=args.data, split=args.tune_split, evaluation=f"{args.data} {args.eval_split}",
                 rule="each method fitted on the tuning tokens; auto: lowest perplexity on their held-apart tail "
                      "(memlm.jobs.interpolation_eval.choose_method), then fitted on all of them",
                 chosen={"method": choice.method.method, **{k: v for k, v in method_record(choice.method).items()
                                                             if k != "state"}},
                 sweep=[{"method": m, "held_apart_perplexity": ppl, "fit_tokens": choice.fit_tokens,
                         "held_apart_tokens": choice.held_tokens} for m, ppl in choice.held_apart.items()])
    result.rows = rows
    result.figures = {"base_perplexity": base, "constant_perplexity": constant["knnlm_perplexity"],
                      "auto_method": choice.method.method, "auto_perplexity": auto["knnlm_perplexity"],
                      "auto_relative_change": auto["relative_change"],
                      "constant_relative_change": constant["relative_change"],
                      "auto_speed_vs_constant": auto["knnlm_tokens_per_s"] / constant["knnlm_tokens_per_s"]}
    result.headline("knnlm_auto", f"{base:.3f} -> {auto['knnlm_perplexity']:.3f} ({auto['relative_change']:+.2%}, "
                                  f"{choice.method.method})")
    result.write()


if __name__ == "__main__":
    main()
