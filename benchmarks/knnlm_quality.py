"""kNN-LM perplexity vs the base LM's on held-out text: the README's kNN-LM headline, through the harness.

The setting of `make demo` (scripts/demo.sh): SmolLM2-135M-Instruct Q4_1, a datastore of the 1990-2000 SOTU
speeches (default ~/.cache/memlm/demo/ds-sotu-1990-2000; its windows are the evaluation's), k 1024. lambda and
T are chosen by memlm's grid search (memlm.jobs.knnlm_eval.tune) on the first --tune-tokens tokens of
--tune-split (default 2001-2002), which must share no document with the first --eval-tokens tokens of
--eval-split (default year >= 2003; benchmarks/harness.refuse_overlap, `memlm eval`'s rule); the chosen lambda
and T are then measured once on the evaluation tokens, beside the base LM on the same windows
(memlm.jobs.knnlm_eval.evaluate_knnlm, what `memlm eval --datastore ... --lambda auto --knn-temperature auto`
runs).

    python benchmarks/knnlm_quality.py [--datastore DS] [--eval-split "year>=2003"] [--eval-tokens 6000]
        [--tune-split "2001<=year<=2002"] [--tune-tokens 4000] [--k 1024] [--results DIR] [--result-name NAME]

Writes docs/results/data/knnlm_quality.json (benchmarks/harness.py). The larger datastore of docs/results.md
(1980-2000, IVF2048,SQ8; eval 2001 onwards, tuned on 2004 onwards):
    python benchmarks/knnlm_quality.py --datastore DS_1980_2000 --eval-split "year>=2001" \
        --tune-split "year>=2004" --result-name knnlm_quality_1980_2000
"""

from __future__ import annotations

import argparse

import _common
import harness
import torch

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _common.add_knnlm_setting_options(p)
    harness.add_options(p, "knnlm_quality")
    args = p.parse_args()
    result = harness.Result.from_args(args)

    from memlm.jobs.knnlm_eval import evaluate_knnlm
    from memlm.retrieval.knnlm import KNNLMConfig

    setting = _common.knnlm_setting(args)
    bench, store, window, docs, tune_docs = setting.bench, setting.store, setting.window, setting.docs, setting.tune_docs
    model, checked, info = bench.pre.model, setting.checked_documents, setting.store.info()
    r = evaluate_knnlm(model, docs, store, window, KNNLMConfig(k=args.k, lmbda=None, temperature=None),
                       bench.boundary, tune_docs=tune_docs, recall_queries=0, progress=False)
    base, knn = r["base_perplexity"], r["knnlm_perplexity"]
    print(f"datastore {args.datastore} ({info.n} keys, {info.index}), context {window.context}, stride "
          f"{window.stride}, k {args.k}; lambda {r['lambda']:g}, T {r['temperature']:.3g} chosen on {r['tune_tokens']} "
          f"tokens of {args.tune_split} (disjoint from the {checked} evaluated documents)")
    print(f"{r['tokens']} tokens of {args.data} {args.eval_split}: base {base:.3f} -> kNN-LM {knn:.3f} "
          f"({knn / base - 1:+.2%}); kNN-LM {r['knnlm_tokens_per_s']:.0f} tokens/s, base {r['base_tokens_per_s']:.0f}")
    result.settings = {"model": bench.name, "dtype": "float32", "threads": torch.get_num_threads(),
                       "datastore": args.datastore, "datastore_size": info.n, "index": info.index,
                       "context": window.context, "stride": window.stride, "k": args.k,
                       "eval": f"{args.data} {args.eval_split}", "eval_tokens": r["tokens"]}
    result.tuned(data=args.data, split=args.tune_split, evaluation=f"{args.data} {args.eval_split}",
                 rule="lambda and T minimising kNN-LM perplexity on the tuning tokens (memlm.jobs.knnlm_eval.tune's "
                      "grid)", chosen={"lambda": r["lambda"], "temperature": r["temperature"]},
                 sweep=[{"tune_tokens": r["tune_tokens"], "tune_base_perplexity": r["tune_base_perplexity"],
                         "tune_knnlm_perplexity": r["tune_knnlm_perplexity"]}])
    result.figures = {"base_perplexity": base, "knnlm_perplexity": knn, "relative_change": knn / base - 1,
                      "knn_hit_rate": r["knn_hit_rate"], "base_tokens_per_s": r["base_tokens_per_s"],
                      "knnlm_tokens_per_s": r["knnlm_tokens_per_s"], "forward_s": r["forward_seconds"],
                      "search_s": r["search_seconds"]}
    result.headline("knnlm", f"{base:.3f} -> {knn:.3f} ({knn / base - 1:+.2%})")
    result.write()


if __name__ == "__main__":
    main()
