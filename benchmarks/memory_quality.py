"""The memory quality table, on State of the Union speeches (long documents).

(a) frozen SmolLM2-135M, segment 128: XL memory of 128 to 1024 states with 4 sink tokens, 1024 without
    sinks, no memory, and a 1152-token sliding window with stride 128 (the same reach as segment + memory),
    with perplexity against memory size drawn beside the JSON;
    with --frozen-compressive also XL 512 and compressive 512 + 512 (rate 4, mean / max pooling): the
    frozen-model figures for (b).
(b) at equal attention cost (memory slots), compressive (mem M/2 + cmem M/2, rate 4, learned conv and
    mean pooling) vs XL (mem M), each on a model trained from scratch with its own memory, the same
    token budget for each (preset --model: tiny, byte tokens; or small, SmolLM2 tokens);
(c) the same from-scratch model trained with and without XL memory.
Training uses speeches before --split-year, evaluation speeches from --split-year on, in corpus order.
Budgets are flags so that the whole script fits in a few CPU minutes; the printed table is what the
JSON records (docs/results/data/memory_quality.json, benchmarks/harness.py), with the command that produced it.

    python benchmarks/memory_quality.py [--sections a b c] [--eval-docs 2] [--doc-tokens 2048]
        [--model tiny] [--train-tokens 150000] [--mem 64] [--segment 64] [--seed 0] [--frozen-compressive]
        [--results DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time

import harness
import torch

from memlm.jobs.segment_eval import evaluate_segments
from memlm.jobs.train import TrainConfig, train
from memlm.jobs.windows import WindowConfig, score_documents
from memlm.model.memory_config import MemoryConfig


def sotu_tokens(tokenizer, split: str, n_docs: int | None, doc_tokens: int | None, total: int | None = None):
    from memlm.data.documents import load_documents, tokenize_documents

    docs = []
    for ids in tokenize_documents(load_documents("sotu", split), tokenizer, total):
        if ids:
            docs.append(ids[:doc_tokens] if doc_tokens else ids)
        if n_docs is not None and len(docs) == n_docs:
            break
    return docs


def row(name: str, r: dict) -> str:
    return (f"| {name:<44} | {r['perplexity']:9.2f} | {r['memory_slots']:5} | {r['attention_span']:5} | "
            f"{r['tokens']:6} | {r['tokens_per_s']:7.0f} |")


HEADER = ("| variant                                      | perplexity | slots | span  | tokens | tok/s   |\n"
          "|----------------------------------------------|-----------:|------:|------:|-------:|--------:|")


def record(result: harness.Result, section: str, name: str, r: dict, **extra) -> None:
    result.rows.append({"section": section, "variant": name, "perplexity": r["perplexity"],
                        "memory_slots": r["memory_slots"], "attention_span": r["attention_span"],
                        "tokens": r["tokens"], "tokens_per_s": r["tokens_per_s"], **extra})


def section_a(args, result: harness.Result) -> None:
    from memlm.model.tokenizer import document_boundary
    from memlm.model.weights import load_pretrained

    pre = load_pretrained("smollm2-135m")  # the real model only: section (a) is about its frozen weights
    model, bos = pre.model, document_boundary(pre.tokenizer)  # the one boundary rule, as `memlm eval`
    docs = sotu_tokens(pre.tokenizer, f"year>={args.split_year}", args.eval_docs, args.doc_tokens)
    print(f"\n(a) frozen SmolLM2-135M-Instruct (Q4_1), segment 128, {len(docs)} speeches from {args.split_year} "
          f"x first {args.doc_tokens} tokens\n{HEADER}")
    seg = 128
    perplexities = {}
    for name, kw in [
        ("no memory", dict(memory="none")),
        *[(f"XL memory {m} + 4 sink tokens", dict(memory="xl", mem_len=m, sink_tokens=4)) for m in (128, 256, 512)],
        ("XL memory 1024 + 4 sink tokens", dict(memory="xl", mem_len=1024, sink_tokens=4)),
        ("XL memory 1024, no sink tokens", dict(memory="xl", mem_len=1024, sink_tokens=0)),
    ]:
        r = evaluate_segments(model, docs, seg, boundary_token=bos, **kw)
        perplexities[name] = r["perplexity"]
        record(result, "a", name, r)
        print(row(name, r), flush=True)
    t0 = time.perf_counter()
    scored = list(score_documents(model, docs, WindowConfig(context=1152, stride=128, batch_size=1), bos))
    secs = time.perf_counter() - t0
    n = sum(len(s.targets) for s in scored)
    ppl = math.exp(-float(torch.cat([s.lm_logprob for s in scored]).double().sum()) / n)
    win = {"perplexity": ppl, "memory_slots": 1024, "attention_span": 1152, "tokens": n, "tokens_per_s": n / secs}
    print(row("sliding window 1152, stride 128", win), flush=True)
    record(result, "a", "sliding window 1152, stride 128", win)
    xl, none = perplexities["XL memory 1024 + 4 sink tokens"], perplexities["no memory"]
    result.headline("xl_sinks", f"{xl:.2f} vs {none:.2f} vs {win['perplexity']:.2f}")
    if args.frozen_compressive:
        for name, kw in [
            ("XL memory 512 + 4 sinks", dict(memory="xl", mem_len=512)),
            ("compressive 512 + 512 (c=4, mean) + 4 sinks", dict(memory="compressive", mem_len=512, cmem_len=512)),
            ("compressive 512 + 512 (c=4, max) + 4 sinks",
             dict(memory="compressive", mem_len=512, cmem_len=512, compress_fn="max")),
        ]:
            r = evaluate_segments(model, docs, seg, boundary_token=bos, **kw)
            record(result, "a", name, r)
            print(row(name, r), flush=True)


def sections_bc(args, sections: set[str], result: harness.Result) -> None:
    from memlm.model.weights import load_pretrained

    tok = load_pretrained(args.model).tokenizer
    train_docs = sotu_tokens(tok, f"year<{args.split_year}", None, None, args.train_tokens * 2)
    eval_docs = sotu_tokens(tok, f"year>={args.split_year}", args.eval_docs, args.doc_tokens)
    steps = args.train_tokens // (args.batch * args.segment)
    M = args.mem
    variants = []
    if "c" in sections:
        variants += [("c", "no memory", MemoryConfig("none", sink_tokens=0)),
                     ("c", f"XL memory {M}", MemoryConfig("xl", mem_len=M, sink_tokens=0))]
    if "b" in sections:
        if "c" not in sections:
            variants.append(("b", f"XL memory {M}", MemoryConfig("xl", mem_len=M, sink_tokens=0)))
        variants += [
            ("b", f"compressive {M // 2} + {M // 2} (c=4, conv)", MemoryConfig("compressive", M // 2, M // 2, 4, "conv", 0)),
            ("b", f"compressive {M // 2} + {M // 2} (c=4, mean)", MemoryConfig("compressive", M // 2, M // 2, 4, "mean", 0)),
        ]
    print(f"\n(b, c) preset {args.model} trained from scratch, {steps} steps x {args.batch} rows x segment "
          f"{args.segment} = {steps * args.batch * args.segment} training tokens each (speeches before "
          f"{args.split_year}); evaluated with its own memory on {len(eval_docs)} later speeches x "
          f"{args.doc_tokens} tokens\n{HEADER}")
    for sec, name, mem in variants:
        cfg = TrainConfig(model=args.model, memory=dataclasses.replace(mem, segment=args.segment), batch_size=args.batch, steps=steps,
                          lr=args.lr, min_lr=args.lr / 10, warmup_steps=max(steps // 20, 1), log_every=0, seed=args.seed)
        t0 = time.perf_counter()
        trained = train(cfg, train_docs, eval_docs, log=lambda line: None)
        r = trained.evals[-1]
        seconds = time.perf_counter() - t0
        record(result, sec, name, r, train_s=seconds, train_tokens=steps * args.batch * args.segment)
        print(row(f"({sec}) {name}", r) + f"  train {seconds:.0f} s", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sections", nargs="+", default=["a", "b", "c"], choices=["a", "b", "c"])
    p.add_argument("--split-year", type=int, default=2000, help="train on speeches before, evaluate from it on")
    p.add_argument("--eval-docs", type=int, default=2, help="evaluation speeches")
    p.add_argument("--doc-tokens", type=int, default=2048, help="first tokens of each evaluation speech")
    p.add_argument("--frozen-compressive", action="store_true", help="(a): add XL 512 and compressive 512+512 rows")
    p.add_argument("--model", default="tiny", help="preset trained from scratch in (b), (c)")
    p.add_argument("--train-tokens", type=int, default=150_000, help="training token budget per variant")
    p.add_argument("--segment", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--mem", type=int, default=64, help="memory slots M of (b), (c)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0, help="seed of the from-scratch init in (b), (c)")
    p.add_argument("--threads", type=int, default=0)
    harness.add_options(p, "memory_quality")
    args = p.parse_args()
    result = harness.Result.from_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    print("# " + " ".join(["python", *sys.argv]))
    if "a" in args.sections:
        section_a(args, result)
    if {"b", "c"} & set(args.sections):
        sections_bc(args, set(args.sections), result)
    result.settings = {"sections": " ".join(args.sections), "split_year": args.split_year,
                       "eval_docs": args.eval_docs, "doc_tokens": args.doc_tokens,
                       "frozen_model": "SmolLM2-135M-Instruct Q4_1 (section a)",
                       **({"from_scratch_model": args.model, "train_tokens": args.train_tokens, "segment": args.segment,
                           "batch": args.batch, "mem": args.mem, "lr": args.lr, "seed": args.seed}
                          if {"b", "c"} & set(args.sections) else {}),
                       "dtype": "float32", "threads": torch.get_num_threads()}
    path = result.write()
    xl = [(r["memory_slots"], r["perplexity"]) for r in result.rows
          if r["section"] == "a" and (r["variant"] == "no memory" or r["variant"].endswith("+ 4 sink tokens"))]
    if xl:
        harness.plot_lines(path, {"XL memory + 4 sinks (0: each segment alone)": xl}, xlabel="memory slots per layer",
                           ylabel="perplexity", title="frozen SmolLM2, segment 128: perplexity vs memory size")


if __name__ == "__main__":
    main()
