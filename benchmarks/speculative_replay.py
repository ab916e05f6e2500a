"""Replay of speculative drafting over recorded greedy kNN-LM continuations: the exact tokens a
verifying pass would yield for draft policies the engine does not run, e.g. several drafts verified as a tree.

Greedy speculative decoding yields exactly plain greedy decoding's tokens, so a pass's outcome is decided by the
plain continuation alone: a pass after the row's text yields the longest prefix of its draft that the
continuation spells, and one token more. This script decodes the prompts of benchmarks/speculative_knnlm.py
(the same held-apart prompts, setting and datastore) once, plainly, and replays each policy over the recorded
continuations: tokens a pass (what speed-up a pass can buy) and draft positions a pass (what a pass feeds
beyond x_t: for a tree the nodes of the drafts' prefix tree, which a tree-masked pass would feed). The policies
themselves are not timed; with --pass-costs the forward pass of 1 .. draft_tokens + 1 positions and the search of
1 .. draft_tokens + 1 queries are timed where it runs (benchmarks/pass_cost.py, round-robin medians), and each
policy gets a modelled decode ratio: plain's cost, forward(1) + search(1) a token, over the policy's, forward(1 +
nodes) + search(tokens) a pass (a greedy kNN-LM row searches about its accepted tokens' positions; the engine's own
bookkeeping left out). The figure that counts is benchmarks/speculative_knnlm.py's, measured (README).

Pointers (memlm.engine.drafts) come from the neighbours of one whole-text forward pass's keys at each
position (one search), not from the decode steps' own keys, so a datastore draft may differ in a rare near tie
from the engine's; the single-draft lines are printed beside the benchmark's measured tokens a pass to check.

The policies are a sweep: they are replayed over continuations of prompts from --tune-split (default the
2001-2002 speeches, checked to share no speech with --split), the best one (the highest modelled decode ratio with
--pass-costs, else the most tokens a pass) is chosen there, and it is replayed once, beside the engine's default
policy, over continuations of prompts from --split (the held-out figures). The JSON
(docs/results/data/speculative_replay.json, benchmarks/harness.py) records the sweep, the choice and the held-out
lines; decoding the prompts of both splits is the whole command's wall time.

    python benchmarks/speculative_replay.py [--split "year>=2003"] [--prompts 8] [--new-tokens 64] [--draft-tokens 16]
        [--trees 2,3,4] [--pass-costs [--search-backend torch]] [--tree-nodes 5,7] [--short-match-tokens 4,16]
        [--min-agreeing 2,3] [--tune-split "2001<=year<=2002"] [--results DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

import harness
import numpy as np
import pass_cost
import speculative_knnlm as bench_setting
import torch

from memlm.engine.draft_trees import DraftTree, datastore_branches, row_tree
from memlm.engine.drafts import (
    DRAFT_FROM,
    DraftSource,
    SpeculativeConfig,
    advance,
    chain_starts,
    draft_source,
    matching,
)
from memlm.engine.engine import Engine, run_all
from memlm.engine.requests import EngineConfig, GenerationRequest
from memlm.jobs.decoding import TokenEvent
from memlm.retrieval.searcher import Neighbors

Policy = Callable[[list[int], np.ndarray, int], list[tuple[int, ...]]]
"""(row text, pointers, cap) -> the candidate drafts a pass verifies (one for the engine's sources)."""


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench_setting.add_setting_options(p)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--draft-tokens", type=int, default=SpeculativeConfig.draft_tokens)
    p.add_argument("--trees", default="2,3,4", help="tree widths to replay: that many history continuations and "
                   "that many datastore branches per pass")
    p.add_argument("--pass-costs", action="store_true", help="time passes and searches here and print each "
                   "policy's modelled decode ratio")
    p.add_argument("--tree-nodes", default="", help="also replay the engine's rule with these tree_nodes, "
                   "comma-separated (SpeculativeConfig's other fields as given)")
    p.add_argument("--min-agreeing", default="", help="also replay the engine's rule with these min_agreeing, "
                   "comma-separated, each with each --tree-nodes and --short-match-tokens")
    p.add_argument("--short-match-tokens", default="", help="also replay the engine's rule with these "
                   "short_match_tokens, comma-separated, each with each --tree-nodes")
    harness.add_options(p, "speculative_replay")
    args = p.parse_args()
    args.in_datastore, args.quick = False, False  # speculative_knnlm's helpers read them
    return args


def history_candidates(text: Sequence[int], length: int, width: int, max_match: int, min_match: int
                       ) -> list[tuple[int, ...]]:
    """Up to `width` distinct drafts from the row's own text: what followed the latest earlier occurrences of
    its last max_match .. min_match tokens, longest match first, latest first (drafts.history_draft's rule,
    period included, for the first of them)."""
    arr = np.asarray(text, dtype=np.int64)  # (L,)
    L, out = arr.shape[0], []
    for n in range(min(max_match, L - 1), min_match - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # (L-n, n)
        for hit in np.flatnonzero((windows == arr[L - n :]).all(axis=1))[::-1]:
            after = int(hit) + n
            draft = tuple(arr[after + np.arange(length) % (L - after)].tolist())
            if draft not in out:
                out.append(draft)
            if len(out) == width:
                return out
    return out


def tree_drafts(tree: DraftTree) -> list[tuple[int, ...]]:
    """The drafts a tree verifies: the path to each of its leaves."""
    paths: list[tuple[int, ...]] = []
    for i, token in enumerate(tree.tokens):
        parent = tree.parents[i]
        paths.append((paths[parent] if parent >= 0 else ()) + (token,))
    parents = set(tree.parents)
    return [p for i, p in enumerate(paths) if i not in parents]


def tree_nodes(drafts: list[tuple[int, ...]]) -> int:
    """Positions a tree-masked pass feeds beyond x_t: the drafts' prefix tree's nodes."""
    return len({d[:i] for d in drafts for i in range(1, len(d) + 1)})


class PassCosts(NamedTuple):
    """Median ms where it runs (benchmarks/pass_cost.py): a forward pass by its positions, a search by queries."""

    forward: dict[int, float]
    search: dict[int, float]

    def plain_step(self) -> float:
        return self.forward[1] + self.search[1]

    def verifying_pass(self, positions: int, searched: int) -> float:
        """nan past the positions timed (a wide tree policy's passes): its ratio is then not modelled."""
        return self.forward.get(positions, float("nan")) + self.search[searched]


def pass_costs_here(bench, store, most: int, rounds: int = 6) -> PassCosts:
    """PassCosts for 1 .. most positions and queries, on the setting's model and datastore."""
    counts = list(range(1, most + 1))
    forward, _ = pass_cost.forward_times(bench.pre.model, counts, rounds, 128, count_products=False)
    return PassCosts(forward, pass_cost.search_times(store, counts, rounds))


class Recorded(NamedTuple):
    """One prompt's plain greedy run."""

    text: list[int]
    """The boundary, the prompt and the continuation."""
    start: int
    """Where the continuation starts."""
    after: list[np.ndarray]
    """The pointers after each generated token."""
    keys: torch.Tensor
    """(len(text) - 1, C) the kNN key of every position: key i chose text[i + 1]."""


def record(args: argparse.Namespace, bench, store, split: str | None = None) -> tuple[list[Recorded], DraftSource]:
    """Per prompt of `split` (default --split) its Recorded run (the text, where the continuation starts, the
    pointers after each generated token, the keys of the one whole-text forward pass the pointers come from)."""
    knn = bench_setting.knn_settings(args)
    source = draft_source(store.provenance, store.values)
    engine = Engine(bench.pre.model, bench.pre.tokenizer, EngineConfig(max_batch=1), store, source)
    runs = []
    for prompt in bench_setting.held_apart_prompts(bench, store, args, split):
        request = GenerationRequest(prompt, args.new_tokens, bench_setting.GREEDY, boundary_token=bench.boundary,
                                    knn=knn)
        generated = [e.token_id for e in run_all(engine, [request])[0] if isinstance(e, TokenEvent)]
        text = [bench.boundary, *prompt, *generated]
        start = 1 + len(prompt)
        with torch.no_grad():
            keys = bench.pre.model(torch.tensor([text[:-1]]), logits_from=len(text) - 2).knn_key[0]  # (L-1, C)
        found = store.search(keys[start - 1 :].float().numpy(), knn.k)  # (g, k): the positions that chose them
        runs.append(Recorded(text, start, [matching(Neighbors(*(a[i : i + 1] for a in found)), t)
                                           for i, t in enumerate(generated)], keys.float()))
    return runs, source


def replay(runs, source: DraftSource, policy: Policy, draft_tokens: int, costs: PassCosts | None = None
           ) -> tuple[float, float, float | None]:
    """(tokens a pass, draft positions a pass, modelled decode ratio or None without costs) of `policy` over the
    recorded runs; the first token of each run comes from the prompt's step, as in the engine."""
    passes = tokens = fed = 0
    spent = 0.0
    for text, start, after, _ in runs:
        g, pointers, n = 1, after[0], len(text) - start
        while g < n:
            at = start + g
            cap = min(draft_tokens, n - g - 1)  # nothing drafted past max_new_tokens
            drafts = [d[:cap] for d in (policy(text[:at], pointers, cap) if cap > 0 else []) if d]
            right = max((next((j for j, (a, b) in enumerate(zip(d, text[at:])) if a != b), len(d)) for d in drafts),
                        default=0)
            y = min(right + 1, n - g)
            fresh = after[g + y - 1]
            pointers = fresh if fresh.size else advance(pointers, text[at : at + y], source)
            if costs is not None:
                spent += costs.verifying_pass(1 + tree_nodes(drafts), y)
            passes, tokens, fed, g = passes + 1, tokens + y, fed + tree_nodes(drafts), g + y
    ratio = tokens * costs.plain_step() / spent if costs is not None and spent == spent else None
    return tokens / passes, fed / passes, ratio


def replay_line(name: str, runs, source, policy: Policy, draft_tokens: int, costs: PassCosts | None) -> dict:
    """Replay `policy` over `runs`, print its line, return its figures."""
    per_pass, fed, ratio = replay(runs, source, policy, draft_tokens, costs)
    modelled = f", modelled decode ratio {ratio:.3f}" if ratio is not None else ""
    print(f"{name}: tokens a pass {per_pass:.3f}, draft positions a pass {fed:.1f}{modelled}", flush=True)
    return {"policy": name, "tokens_a_pass": per_pass, "draft_positions_a_pass": fed,
            **({"modelled_decode_ratio": ratio} if ratio is not None else {})}


def sweep_then_held_out(args, result: harness.Result, tune_runs, eval_runs, source, policies: dict[str, Policy],
                        default: str, draft_tokens: int, costs: PassCosts | None) -> None:
    """Every policy over the tuning split's runs; the best (modelled ratio with costs, else tokens a pass) and the
    `default` policy over the evaluation split's runs, into `result` (benchmarks/speculative_replay.py's and
    benchmarks/learned_drafter_replay.py's rule)."""
    score = "modelled_decode_ratio" if costs is not None else "tokens_a_pass"
    print(f"# sweep: {len(policies)} policies over {len(tune_runs)} continuations of {args.tune_split}", flush=True)
    sweep = [replay_line(f"[tuning split] {name}", tune_runs, source, policy, draft_tokens, costs)
             for name, policy in policies.items()]
    best = max(zip(policies, sweep), key=lambda item: item[1].get(score, float("-inf")))[0]
    print(f"# held out: the chosen policy ({best}) and the default over {len(eval_runs)} continuations of "
          f"{args.split}", flush=True)
    for name in dict.fromkeys([best, default]):
        result.rows.append({**replay_line(name, eval_runs, source, policies[name], draft_tokens, costs),
                            "role": ("chosen" if name == best else "") + (" default" if name == default else "")})
    result.tuned(data="sotu", split=args.tune_split, evaluation=f"sotu {args.split}",
                 rule=f"the policy with the highest {score.replace('_', ' ')} over the tuning split's continuations",
                 chosen=best, sweep=sweep)


def main() -> None:
    args = parse_args()
    result = harness.Result.from_args(args)
    bench, store = bench_setting.open_setting(args)
    harness.refuse_overlap("sotu", args.tune_split, args.split)
    tune_runs, source = record(args, bench, store, args.tune_split)
    runs, _ = record(args, bench, store)
    spec = SpeculativeConfig(draft_tokens=args.draft_tokens)
    costs = pass_costs_here(bench, store, args.draft_tokens + 1) if args.pass_costs else None
    if costs is not None:
        print("# forward ms by positions " + " ".join(f"{n}:{t:.1f}" for n, t in costs.forward.items())
              + "; search ms by queries " + " ".join(f"{n}:{t:.2f}" for n, t in costs.search.items()), flush=True)
    print(f"# {len(runs)} prompts, {args.new_tokens} greedy kNN-LM tokens each ({args.dtype}), draft tokens "
          f"{args.draft_tokens}; replayed" + ("; pass costs timed above" if costs else ", not timed"), flush=True)
    policies: dict[str, Policy] = {}
    for src in DRAFT_FROM:
        for n in (0, spec.tree_nodes):
            config = SpeculativeConfig(draft_tokens=args.draft_tokens, draft_from=src, tree_nodes=n)
            policies[f"{src}, trees of {n} nodes (the engine's)"] = lambda text, ptr, cap, c=config: tree_drafts(
                row_tree(text, ptr, source, cap, c, True, cap))
    for n in (int(x) for x in args.tree_nodes.split(",") if x):
        for m in [int(x) for x in args.short_match_tokens.split(",") if x] or [spec.short_match_tokens]:
            for a in [int(x) for x in args.min_agreeing.split(",") if x] or [spec.min_agreeing]:
                config = dataclasses.replace(spec, tree_nodes=n, short_match_tokens=m, min_agreeing=a)
                policies[f"{config.draft_from}, trees of {n} nodes, short matches {m}, min agreeing {a} (the "
                         "engine's)"] = (lambda text, ptr, cap, c=config: tree_drafts(row_tree(text, ptr, source, cap,
                                                                                               c, True, cap)))
    for w in (int(x) for x in args.trees.split(",")):
        for hmin in (spec.history_min_match, 1):
            policies[f"tree: {w} history (matches {spec.history_max_match}..{hmin}) + {w} datastore"] = (
                lambda text, ptr, cap, w=w, hmin=hmin: history_candidates(text, cap, w, spec.history_max_match, hmin)
                + datastore_branches(chain_starts(ptr, source), source, cap, w, spec.min_agreeing))
    default = f"{spec.draft_from}, trees of {spec.tree_nodes} nodes (the engine's)"
    sweep_then_held_out(args, result, tune_runs, runs, source, policies, default, args.draft_tokens, costs)
    result.settings = {"model": bench.name, "dtype": args.dtype, "datastore": args.datastore,
                       "entries": store.info().n, "prompts": args.prompts, "prompt_tokens": args.prompt_tokens,
                       "new_tokens": args.new_tokens, "draft_tokens": args.draft_tokens, "trees": args.trees,
                       "pass_costs": bool(args.pass_costs)}
    if costs is not None:
        result.figures = {"forward_ms": {str(n): t for n, t in costs.forward.items()},
                          "search_ms": {str(n): t for n, t in costs.search.items()}}
    result.write()


if __name__ == "__main__":
    main()
