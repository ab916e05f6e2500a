"""Speculative kNN-LM decoding: greedy tokens/s with drafts vs without, the same engine,
weights and datastore, measured side by side in this one run; drafts from the datastore (REST, He et al.
2023), from the row's own text (prompt lookup decoding) or both (memlm.engine.drafts, --draft-from).

Setting: the SOTU kNN-LM setting of scripts/demo.sh (the datastore of the 1990-2000 speeches, lambda and
T tuned on 2001-2002, read from the run's knnlm.json beside the datastore); the prompts are cut from the
evaluation split's speeches (year >= 2003, --split), never from the datastore's (checked: no prompt
speech's fingerprint is in the datastore's documents table; --in-datastore lifts that for an upper bound,
REST's premise that the continuation is in the datastore, and says so). Figures, each ratios in one run, one
line per draft source of --draft-from against the same plain side:
1. greedy kNN-LM (the interpolated target, one search per token) vs speculative kNN-LM (every fed position
   searched in one batched search per step; drafts from the neighbours' successors and/or the row's text);
2. the base LM vs the base LM drafting (from the datastore: a search only when a row's pointers ran out);
3. the same with the datastore's pointers from the suffix index when they ran out (REST's exact match, no
   search).
Each line prints tokens/s of both sides, the ratio, mean accepted tokens (tokens per verifying forward pass),
searches per token, and whether every continuation is token-identical: in float32 it must be, in every round
(the command exits 1 otherwise). Within a figure the sides alternate (plain, then each source) over --repeats
rounds (the median per side), after one untimed warm-up request per side; the machine's load is printed, figures
are noisy on a shared CPU.
--dtype bfloat16: both sides in bfloat16 (a verifying pass then costs little more than a plain step on
avx512_bf16); on such a CPU its kernels are not batch-invariant (a verifying pass's rows round otherwise than
one-row decode steps), so the identical column is expected to fall short there (counted, not a check).

Draft settings swept (more than one value of --draft-tokens, --short-match-tokens, --frequent-branches,
--min-agreeing or --tree-nodes for a draft source) are chosen on prompts of --tune-split (default the
2001-2002 speeches, checked to share no speech with --split): per figure and draft source the setting with the
highest tokens/s ratio there, which is then measured once on the prompts of --split. The JSON
(docs/results/data/speculative_knnlm.json, benchmarks/harness.py) records the sweep, the choice and the
held-out figures.

    python benchmarks/speculative_knnlm.py [--datastore ~/.cache/memlm/demo/ds-sotu-1990-2000] [--prompts 8]
        [--prompt-tokens 64] [--new-tokens 64] [--draft-from datastore,history,both] [--draft-tokens 16[,12]]
        [--min-agreeing 2] [--tree-nodes 3,0] [--figures 1,2] [--batch 1] [--repeats 2] [--dtype float32] [--quick]
        [--tune-split "2001<=year<=2002"] [--results DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import NamedTuple

import _common
import harness
import torch

from memlm.engine.drafts import DRAFT_FROM, SpeculativeConfig, draft_source
from memlm.engine.engine import Engine, run_all
from memlm.engine.requests import EngineConfig, GenerationRequest
from memlm.jobs.decoding import SamplingConfig, TokenEvent
from memlm.model.device import DTYPES
from memlm.retrieval.knnlm import KNNLMConfig
from memlm.retrieval.searcher import DEFAULT_SEARCH_BACKEND, SEARCH_BACKENDS

GREEDY = SamplingConfig(temperature=0.0)
DEFAULT_DATASTORE = str(Path.home() / ".cache/memlm/demo/ds-sotu-1990-2000")


def add_setting_options(p: argparse.ArgumentParser) -> None:
    """The setting's flags (open_setting, knn_settings, held_apart_prompts read them): this benchmark's and
    benchmarks/fewer_generate.py's."""
    p.add_argument("--datastore", default=DEFAULT_DATASTORE, help="a datastore built by scripts/demo.sh")
    p.add_argument("--tuned", default=None, help="knnlm.json of its tuned lambda, T, k (default: beside it)")
    p.add_argument("--split", default="year>=2003", help="the evaluation split the prompts are cut from")
    p.add_argument("--tune-split", default="2001<=year<=2002", help="the split a sweep's prompts are cut from "
                   "(it chooses the setting; it must share no speech with --split)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES),
                   help="the model's float type on both sides (bfloat16: batched matmuls almost free on avx512_bf16)")
    p.add_argument("--search-backend", default=DEFAULT_SEARCH_BACKEND, choices=SEARCH_BACKENDS,
                   help="how both sides search the datastore (memlm generate's flag): its FAISS index, or torch's "
                        "exact float32 product (on the CPU one GEMM reads the keys once for all of a step's queries)")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_setting_options(p)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--draft-from", default=",".join(DRAFT_FROM),
                   help=f"draft sources to measure, comma-separated ({', '.join(DRAFT_FROM)}), each against the "
                        "same plain side")
    p.add_argument("--draft-tokens", default=str(SpeculativeConfig.draft_tokens),
                   help="the longest draft (SpeculativeConfig.draft_tokens), comma-separated: each value a line per "
                        "draft source and tree size against the same plain side")
    p.add_argument("--short-match-tokens", default=str(SpeculativeConfig.short_match_tokens),
                   help="most tokens a history draft takes from a match shorter than the longest "
                        "(SpeculativeConfig.short_match_tokens), comma-separated: each value a line per draft source, "
                        "tree size and draft length")
    p.add_argument("--frequent-branches", default=str(SpeculativeConfig.frequent_branches),
                   help="a tree's one-token branches of the datastore's most frequent next tokens "
                        "(SpeculativeConfig.frequent_branches), comma-separated: each value a line per setting above")
    p.add_argument("--min-agreeing", default=str(SpeculativeConfig.min_agreeing),
                   help="chains that must agree on a datastore draft's token (SpeculativeConfig.min_agreeing), "
                        "comma-separated: each value a line per setting above")
    p.add_argument("--tree-nodes", default=str(SpeculativeConfig.tree_nodes),
                   help="greedy rows' draft trees (SpeculativeConfig.tree_nodes; 0: one draft), comma-separated: "
                        "each value a line per draft source against the same plain side")
    p.add_argument("--batch", type=int, default=1, help="rows decoded together (1: one prompt after another)")
    p.add_argument("--repeats", type=int, default=2, help="alternating rounds per side (median)")
    p.add_argument("--figures", default="1,2", help="1: kNN-LM, 2: the base LM drafting (pointers by search), "
                   "3: the same with pointers by suffix match")
    p.add_argument("--in-datastore", action="store_true",
                   help="allow prompts from the datastore's own speeches (with --split 1990<=year<=2000): an upper "
                        "bound where the drafts are the speech itself, NOT the held-apart figure (printed so)")
    p.add_argument("--quick", action="store_true", help="a short run: 3 prompts of 32 new tokens")
    harness.add_options(p, "speculative_knnlm")
    args = p.parse_args()
    if args.quick:
        args.prompts, args.new_tokens = 3, 32
    return args


def knn_settings(args: argparse.Namespace) -> KNNLMConfig:
    """The demo's tuned lambda and T (and its k) from knnlm.json."""
    path = Path(args.tuned) if args.tuned else Path(args.datastore).parent / "knnlm.json"
    tuned = json.loads(path.read_text())
    return KNNLMConfig(k=int(tuned["k"]), lmbda=float(tuned["lambda"]), temperature=float(tuned["temperature"]))


def held_apart_prompts(bench: _common.BenchModel, store, args: argparse.Namespace, split: str | None = None
                       ) -> list[tuple[int, ...]]:
    """--prompts prompts of --prompt-tokens tokens, each from a different speech of `split` (default the evaluation
    split, --split; more prompts than speeches: the speeches again, in order), at a seeded offset; refused if any
    of those speeches is in the datastore."""
    from memlm.data.documents import document_fingerprint, load_documents

    split = split or args.split
    speeches = list(load_documents("sotu", split))
    held = {r.fingerprint for r in store.documents()}
    if not args.in_datastore and any(document_fingerprint(d) in held for d in speeches):
        raise SystemExit(f"a speech of {split!r} is in the datastore: prompts must be held apart")
    rng = random.Random(0)
    out = []
    chosen = rng.sample(speeches, min(args.prompts, len(speeches)))
    chosen += [speeches[i % len(speeches)] for i in range(args.prompts - len(chosen))]
    for doc in chosen:
        ids = bench.pre.tokenizer.encode(doc.text)
        start = rng.randrange(0, max(1, len(ids) - args.prompt_tokens - args.new_tokens))
        out.append(tuple(ids[start : start + args.prompt_tokens]))
    return out


def timed(engine: Engine, requests: list[GenerationRequest]) -> tuple[float, list[list]]:
    start = time.perf_counter()
    results = run_all(engine, requests)
    return time.perf_counter() - start, results


class Timing(NamedTuple):
    """One side's run of its requests."""

    wall: float
    cpu: float
    """This process's CPU seconds (one torch and FAISS thread: what other jobs on a shared CPU do not stretch, but
    for memory bandwidth)."""
    decode: float | None
    """The wall seconds after each request's first token, summed: the decode phase, where speculative decoding
    works (the prompt's prefill and the first token it gives are the same pass on both sides). None with --batch
    above 1, where the requests' phases overlap."""
    results: list[list]


def timed_phases(engine: Engine, requests: list[GenerationRequest]) -> Timing:
    """Run `requests` (one at a time at --batch 1, timing each one's decode phase; else run_all)."""
    cpu, start = time.process_time(), time.perf_counter()
    if engine.config.max_batch > 1:
        results = run_all(engine, requests)
        return Timing(time.perf_counter() - start, time.process_time() - cpu, None, results)
    results, decode = [], 0.0
    for request in requests:
        events, first = [], None
        for event in engine.submit(request).events():  # steps the engine here, one step a wait
            if first is None and isinstance(event, TokenEvent):
                first = time.perf_counter()
            events.append(event)
        decode += time.perf_counter() - first if first is not None else 0.0
        results.append(events)
    return Timing(time.perf_counter() - start, time.process_time() - cpu, decode, results)


def token_lists(results: list[list]) -> list[list[int]]:
    return [[e.token_id for e in ev if isinstance(e, TokenEvent)] for ev in results]


def figure(name: str, engine: Engine, plain: list[GenerationRequest], specs: dict[str, SpeculativeConfig],
           repeats: int, result: harness.Result | None = None, identical: bool = True) -> dict[str, dict]:
    """Plain vs speculative with each draft source over the same requests, alternating (plain, then each
    source, per round) after one untimed warm-up request per side; prints one line per source and returns its
    figures by source. With `result` and `identical`, every round's continuations of each source must equal
    plain's of the same round (result.check)."""
    sides = {"plain": plain, **{src: [dataclasses.replace(r, speculative=c) for r in plain] for src, c in specs.items()}}
    runs: dict[str, list[Timing]] = {side: [] for side in sides}
    for reqs in sides.values():  # warm-up, untimed: else plain, timed first, pays the one-off costs (the index's
        timed(engine, reqs[:1])  # pages, oneDNN's kernels for each new shape) and the ratios come out high
    for _ in range(repeats):
        for side, reqs in sides.items():
            runs[side].append(timed_phases(engine, reqs))
    results = {side: r[-1].results for side, r in runs.items()}
    tokens = {s: [[e.token_id for e in ev if isinstance(e, TokenEvent)] for ev in results[s]] for s in results}
    n = sum(len(t) for t in tokens["plain"])
    after_first = n - sum(1 for t in tokens["plain"] if t)  # tokens of the decode phases

    def rate(side: str, field: str, count: int) -> float:
        return count / statistics.median(getattr(t, field) for t in runs[side])

    measured: dict[str, dict] = {}
    for src in specs:
        for i, (p_run, s_run) in enumerate(zip(runs["plain"], runs[src])):
            a, b = token_lists(p_run.results), token_lists(s_run.results)
            parted = [j for j, (x, y) in enumerate(zip(a, b)) if x != y]
            if result is not None and identical:
                result.check(f"{name}, drafts from {src}: tokens identical to plain, round {i + 1}", not parted,
                             f"prompts {parted} part" if parted else "")
        same = sum(a == b for a, b in zip(tokens["plain"], tokens[src]))
        ends = [ev[-1] for ev in results[src]]
        passes, verified = sum(e.verify_steps for e in ends), sum(e.verified_tokens for e in ends)
        plain_rate, spec_rate = rate("plain", "wall", n), rate(src, "wall", n)
        decode = ""
        if runs[src][0].decode is not None:
            plain_d, spec_d = rate("plain", "decode", after_first), rate(src, "decode", after_first)
            decode = (f"; decode phase (after each prompt's first token, {after_first} tokens): plain {plain_d:.1f}, "
                      f"speculative {spec_d:.1f} tokens/s, ratio {spec_d / plain_d:.2f}x")
        # Each round runs plain and then this source back to back: its own ratio shows the run's spread.
        rounds = [p.wall / t.wall for p, t in zip(runs["plain"], runs[src])]
        print(f"{name}, drafts from {src}: plain {plain_rate:.1f} tokens/s, speculative {spec_rate:.1f} tokens/s, "
              f"ratio {spec_rate / plain_rate:.2f}x (rounds {min(rounds):.2f}-{max(rounds):.2f}x; CPU clock "
              f"{rate(src, 'cpu', n) / rate('plain', 'cpu', n):.2f}x)"
              f"{decode}; mean accepted tokens {verified / passes:.2f}; searches per "
              f"token plain {sum(ev[-1].searches for ev in results['plain']) / n:.2f}, speculative "
              f"{sum(e.searches for e in ends) / n:.2f}; token-identical {same}/{len(plain)} ({n} tokens)", flush=True)
        measured[src] = {
            "figure": name, "setting": src, "plain_tokens_per_s": plain_rate, "speculative_tokens_per_s": spec_rate,
            "ratio": spec_rate / plain_rate, "rounds_ratio_min": min(rounds), "rounds_ratio_max": max(rounds),
            "cpu_ratio": rate(src, "cpu", n) / rate("plain", "cpu", n),
            **({"decode_ratio": rate(src, "decode", after_first) / rate("plain", "decode", after_first)}
               if runs[src][0].decode is not None else {}),
            "mean_accepted": verified / passes,
            "searches_per_token_plain": sum(ev[-1].searches for ev in results["plain"]) / n,
            "searches_per_token_speculative": sum(e.searches for e in ends) / n,
            "token_identical": f"{same}/{len(plain)}", "tokens": n}
    print(f"# {name}: wall / CPU / decode seconds per round " + "; ".join(
        f"{s} " + " ".join(f"{t.wall:.1f}/{t.cpu:.1f}/{t.decode or 0:.1f}" for t in r) for s, r in runs.items()),
        flush=True)
    return measured


def open_setting(args: argparse.Namespace) -> tuple[_common.BenchModel, object]:
    """Print the load line, load SmolLM2 and open --datastore, checked against it (this benchmark's and
    benchmarks/fewer_generate.py's setting)."""
    from datastore import Datastore
    from memlm.retrieval.compat import check_searcher

    print(f"# load: {harness.load()} (1 min) on {os.cpu_count()} CPUs",
          f"| torch threads {torch.get_num_threads()} (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')})")
    bench = _common.load_model(None, False, dtype=DTYPES[args.dtype])
    model, tok = bench.pre.model, bench.pre.tokenizer
    store = Datastore.open(args.datastore, backend=args.search_backend, device=str(model.device))
    check_searcher(store.info(), model_fingerprint=bench.pre.fingerprint, tokenizer_fingerprint=tok.fingerprint,
                   dim=model.config.n_embd, key_layer=model.config.key_description, boundary_token=bench.boundary)
    return bench, store


def main() -> None:
    args = parse_args()
    result = harness.Result.from_args(args)
    bench, store = open_setting(args)
    model, tok = bench.pre.model, bench.pre.tokenizer
    knn = knn_settings(args)
    sources = args.draft_from.split(",")
    trees = [int(n) for n in args.tree_nodes.split(",")]
    lengths = [int(n) for n in args.draft_tokens.split(",")]
    shorts = [int(n) for n in args.short_match_tokens.split(",")]
    frequent = [int(n) for n in args.frequent_branches.split(",")]
    agreeing = [int(n) for n in args.min_agreeing.split(",")]
    specs = {f"{src}, trees of {n} nodes" + (f", drafts of {d}" if len(lengths) > 1 else "")
             + (f", short matches {m}" if len(shorts) > 1 else "")
             + (f", frequent branches {f}" if len(frequent) > 1 else "")
             + (f", min agreeing {a}" if len(agreeing) > 1 else ""):
             SpeculativeConfig(draft_tokens=d, min_agreeing=a, draft_from=src, tree_nodes=n,
                               short_match_tokens=m, frequent_branches=f)
             for src in sources for n in trees for d in lengths for m in shorts for f in frequent for a in agreeing}
    spec = next(iter(specs.values()))
    prompts = held_apart_prompts(bench, store, args)
    if args.in_datastore:
        print("# --in-datastore: prompts may come from the datastore's own speeches; NOT the held-apart figure")
    print(f"# SmolLM2-135M-Instruct Q4_1 in {args.dtype}, datastore {args.datastore} ({store.info().n} entries, "
          f"{store.info().index}, searched by {args.search_backend}), k {knn.k}, lambda {knn.lmbda}, "
          f"T {knn.temperature:.3f}; {len(prompts)} prompts of {args.prompt_tokens} tokens from {args.split}, "
          f"{args.new_tokens} new tokens greedy, batch "
          f"{args.batch}, draft tokens {args.draft_tokens}, draft k {spec.draft_k}, min agreeing {args.min_agreeing}, "
          f"history matches {spec.history_max_match}..{spec.history_min_match} tokens; "
          f"{args.repeats} rounds",
          flush=True)
    engine = Engine(model, tok, EngineConfig(max_batch=args.batch), store,
                    draft_source(store.provenance, store.values))
    figures = {int(f) for f in args.figures.split(",")}
    suffix = {src: dataclasses.replace(c, base_pointers="suffix") for src, c in specs.items() if c.uses_datastore}
    plan = [(number, name, setting, configs) for number, name, setting, configs in (
        (1, "1. kNN-LM", knn, specs), (2, "2. base LM drafting (pointers by search)", None, specs),
        (3, "3. base LM drafting (pointers by suffix)", None, suffix)) if number in figures and configs]
    identical = args.dtype == "float32"  # bfloat16's kernels are not batch-invariant: counted, not checked

    def requests(prompt_ids, setting) -> list[GenerationRequest]:
        return [GenerationRequest(p, args.new_tokens, GREEDY, boundary_token=bench.boundary, knn=setting)
                for p in prompt_ids]

    swept = any(sum(c.draft_from == src for c in specs.values()) > 1 for src in sources)
    chosen_plan = plan
    if swept:  # choose on the tuning split's prompts, measure the choice once on --split's
        harness.refuse_overlap("sotu", args.tune_split, args.split)
        tune_prompts = held_apart_prompts(bench, store, args, args.tune_split)
        print(f"# sweep: {len(specs)} settings on {len(tune_prompts)} prompts of {args.tune_split}; the best "
              f"ratio per figure and draft source is then measured on {args.split}", flush=True)
        sweep, chosen, chosen_plan = [], {}, []
        for number, name, setting, configs in plan:
            measured = figure(f"{name} [tuning split]", engine, requests(tune_prompts, setting), configs,
                              args.repeats, result, identical)
            sweep += list(measured.values())
            best = {src: max((label for label in configs if configs[label].draft_from == src),
                             key=lambda label: measured[label]["ratio"]) for src in sources
                    if any(c.draft_from == src for c in configs.values())}
            chosen[name] = best
            chosen_plan.append((number, name, setting, {label: configs[label] for label in best.values()}))
        result.tuned(data="sotu", split=args.tune_split, evaluation=f"sotu {args.split}",
                     rule="per figure and draft source, the setting with the highest speculative / plain tokens/s "
                          "ratio on the tuning prompts", chosen=chosen, sweep=sweep)
    for number, name, setting, configs in chosen_plan:
        result.rows += list(figure(name, engine, requests(prompts, setting), configs, args.repeats, result,
                                   identical).values())
    for row in result.rows:
        if row["figure"] == "1. kNN-LM":
            result.headline("speculative", f"{row['ratio']:.2f}x greedy kNN-LM tokens/s, drafts from {row['setting']}, "
                                           f"{row['token_identical']} continuations token-identical")
            break
    info = store.info()
    result.settings = {"model": bench.name, "dtype": args.dtype, "datastore": args.datastore, "entries": info.n,
                       "index": info.index, "search_backend": args.search_backend, "k": knn.k, "lambda": knn.lmbda,
                       "temperature": knn.temperature, "split": args.split, "prompts": len(prompts),
                       "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "batch": args.batch,
                       "repeats": args.repeats, "in_datastore": bool(args.in_datastore),
                       "tokens_identical_checked": identical}
    result.write()


if __name__ == "__main__":
    main()
