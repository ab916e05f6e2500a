"""A learned drafter for the draft tree, replayed (an experiment, not an engine feature): would a small
network trained on the datastore draft the tree's one-token branches better than its bigram table?

The drafter is EAGLE's idea (Li et al. 2024) cut down to an MLP. From the kNN key of the position that chose the row's
last token b (the last layer's feed-forward input, which the verifying pass computes anyway) and b's embedding, it
predicts the token after b over the datastore's distinct values; its output layer is the model's tied embedding rows
of those values, frozen, plus a bias. A second one takes the token after b too and predicts the one after that (2-token
chains). Both train on the datastore's own (key, value, successor's value[, its successor's value]) triples, every
tenth document held out to stop on, a few epochs (seconds to a minute on 2 cores); the held-apart prompts and the
tuning split are never read by the training.

Then, over recorded greedy kNN-LM continuations (benchmarks/speculative_replay.py's `record`), it prints how often
each predictor's top-1 / top-3 is the next token on the held-out continuations of --split, and replays the engine's
tree (draft_trees.tree_candidates, and candidate_tree, as row_tree) with the bigram's branches (the defaults) against
the drafter's singles or chains in their place: tokens a pass and draft positions a pass, and with --pass-costs the
modelled decode ratio (the drafter's own forward, about 19 MB of float32 weights a pass for SmolLM2 and the SOTU
datastore, left out: it favours the drafter). The policies are a sweep: they run over the continuations of
--tune-split (default 2001-2002, checked to share no speech with --split, default year >= 2003), the best is chosen
there (speculative_replay.sweep_then_held_out's rule) and replayed once, beside the defaults, over --split's. The
drafters' training is timed into the JSON's build seconds (docs/results/data/learned_drafter_replay.json,
benchmarks/harness.py).

    OMP_NUM_THREADS=2 python benchmarks/learned_drafter_replay.py [--split "year>=2003"] [--prompts 16]
        [--search-backend torch] [--epochs 3] [--pass-costs] [--tune-split "2001<=year<=2002"] [--results DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

import harness
import numpy as np
import speculative_knnlm as bench_setting
import speculative_replay as replay_tools
import torch
import torch.nn.functional as F
from torch import nn

from memlm.engine.draft_trees import candidate_tree, tree_candidates
from memlm.engine.drafts import DraftSource, SpeculativeConfig


class Drafter(nn.Module):
    """logits over `vocab` (the datastore's distinct values) of the token after `context` tokens, from a key (B, C)
    and those tokens (B, context)."""

    def __init__(self, embedding: torch.Tensor, vocab: np.ndarray, context: int) -> None:
        super().__init__()
        width = embedding.shape[1]
        self.norm = nn.LayerNorm(width)
        self.hidden = nn.Linear((1 + context) * width, width)
        self.out = nn.Linear(width, width)
        self.bias = nn.Parameter(torch.zeros(vocab.size))
        self.register_buffer("embedding", embedding, persistent=False)  # (V, C) frozen
        self.register_buffer("rows", embedding[torch.from_numpy(vocab)].clone(), persistent=False)  # (U, C) frozen

    def forward(self, key: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        x = torch.cat([self.norm(key), self.embedding[tokens].flatten(1)], dim=-1)  # (B, (1 + context) C)
        return self.out(F.silu(self.hidden(x))) @ self.rows.T + self.bias  # (B, U)


def triples(store, source: DraftSource, context: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Entries with `context` successors: (m,) entry ids, (m, context + 1) the tokens from the entry's value on,
    (m,) their documents."""
    ids = np.arange(source.values.shape[0])
    chain = [ids]
    for _ in range(context):
        nxt = source.next_ids[np.maximum(chain[-1], 0)]
        chain.append(np.where(chain[-1] >= 0, nxt, -1))
    ok = np.all(np.stack(chain) >= 0, axis=0)
    tokens = np.stack([source.values[c[ok]] for c in chain], axis=1).astype(np.int64)  # (m, context + 1)
    return ids[ok], tokens, np.asarray(store.entry_provenance.docs)[ok]


def train(store, source: DraftSource, embedding: torch.Tensor, vocab: np.ndarray, context: int, epochs: int
          ) -> Drafter:
    """A Drafter over `context` tokens fitted on the datastore's triples, the epoch with the lowest held-out loss
    kept (documents with id % 10 == 0 held out)."""
    torch.manual_seed(0)
    ids, tokens, docs = triples(store, source, context)
    keys = torch.from_numpy(np.asarray(store.keys[ids], dtype=np.float32))  # (m, C)
    inputs = torch.from_numpy(tokens[:, :context])  # (m, context)
    remap = np.full(embedding.shape[0], -1)
    remap[vocab] = np.arange(vocab.size)
    target = torch.from_numpy(remap[tokens[:, context]])  # (m,)
    held = docs % 10 == 0
    fit, check = np.flatnonzero(~held), np.flatnonzero(held)
    model = Drafter(embedding, vocab, context)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    best: tuple[float, dict] | None = None
    for epoch in range(epochs):
        order = np.random.default_rng(epoch).permutation(fit)
        for start in range(0, order.size, 256):
            i = order[start : start + 256]
            loss = F.cross_entropy(model(keys[i], inputs[i]), target[i])
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            held_loss = F.cross_entropy(model(keys[check], inputs[check]), target[check]).item()
        print(f"# drafter over {context} token(s), epoch {epoch + 1}: held-out loss {held_loss:.3f}", flush=True)
        if best is None or held_loss < best[0]:
            best = (held_loss, {k: v.clone() for k, v in model.state_dict().items()})
    model.load_state_dict(best[1])
    return model.eval()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench_setting.add_setting_options(p)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--pass-costs", action="store_true", help="time passes here and print modelled decode ratios")
    harness.add_options(p, "learned_drafter_replay")
    args = p.parse_args()
    args.in_datastore = False
    result = harness.Result.from_args(args)
    bench, store = bench_setting.open_setting(args)
    harness.refuse_overlap("sotu", args.tune_split, args.split)
    tune_runs, source = replay_tools.record(args, bench, store, args.tune_split)
    runs, _ = replay_tools.record(args, bench, store)
    by_prompt = {tuple(run.text[: run.start]): run.keys for run in [*tune_runs, *runs]}
    embedding = bench.pre.model.embed_tokens.weight.detach().float()  # (V, C), tied with the head
    vocab = np.unique(source.values)
    print(f"# SmolLM2-135M-Instruct Q4_1, datastore {args.datastore} ({vocab.size} distinct values); "
          f"{len(tune_runs)} recorded continuations of {args.tune_split}, {len(runs)} of {args.split}", flush=True)
    with result.build("drafters (trained on the datastore)"):
        one, two = (train(store, source, embedding, vocab, c, args.epochs) for c in (1, 2))

    @torch.no_grad()
    def top(drafter: Drafter, key: torch.Tensor, tokens: Sequence[int], n: int) -> tuple[int, ...]:
        return tuple(int(vocab[j]) for j in drafter(key[None], torch.tensor([list(tokens)])).topk(n).indices[0])

    def key_of(text: Sequence[int]) -> torch.Tensor:  # the key of the position that chose text[-1]
        prompt = next(k for k in by_prompt if tuple(text[: len(k)]) == k)
        return by_prompt[prompt][len(text) - 2]

    hits = {"drafter top-1": 0, "drafter top-3": 0, "bigram top-1": 0, "bigram top-3": 0}
    total = 0
    for text, start, _, _ in runs:
        for at in range(start + 1, len(text)):
            mine, bigram = top(one, key_of(text[:at]), [text[at - 1]], 3), source.frequent.after(text[at - 1], 3)
            hits["drafter top-1"] += mine[0] == text[at]
            hits["drafter top-3"] += text[at] in mine
            hits["bigram top-1"] += bool(bigram) and bigram[0] == text[at]
            hits["bigram top-3"] += text[at] in bigram
            total += 1
    print(f"next token right, of {total} (held out): " + ", ".join(f"{k} {v / total:.1%}" for k, v in hits.items()),
          flush=True)
    result.figures = {f"{k.replace(' ', '_')}_right": v / total for k, v in hits.items()} | {"tokens": total}

    defaults = SpeculativeConfig()

    def policy(nodes: int, singles: int, chains: int):
        spec = dataclasses.replace(defaults, tree_nodes=nodes)  # the bigram's branches, or none for the drafter's
        spec = dataclasses.replace(spec, frequent_branches=0) if singles or chains else spec

        def drafts(text, pointers, cap):
            candidates = tree_candidates(text, pointers, source, cap, spec, True)
            key = key_of(text)
            candidates += [(t,) for t in top(one, key, [text[-1]], singles)] if singles else []
            candidates += [(t, top(two, key, [text[-1], t], 1)[0]) for t in top(one, key, [text[-1]], chains)]
            return replay_tools.tree_drafts(candidate_tree(candidates, nodes, cap))
        return drafts

    costs = replay_tools.pass_costs_here(bench, store, defaults.draft_tokens + 1) if args.pass_costs else None
    policies = {name: policy(nodes, singles, chains) for name, (nodes, singles, chains) in {
        "5 nodes, bigram branches (the defaults)": (5, 0, 0), "5 nodes, drafter singles 3": (5, 3, 0),
        "5 nodes, drafter chains 2": (5, 0, 2), "7 nodes, bigram branches": (7, 0, 0),
        "7 nodes, drafter singles 4": (7, 4, 0), "7 nodes, drafter chains 3": (7, 0, 3),
    }.items()}
    if costs is not None:
        print("# modelled decode ratios leave the drafter's own cost out", flush=True)
    replay_tools.sweep_then_held_out(args, result, tune_runs, runs, source, policies,
                                     "5 nodes, bigram branches (the defaults)", defaults.draft_tokens, costs)
    result.settings = {"model": bench.name, "dtype": args.dtype, "datastore": args.datastore,
                       "distinct_values": int(vocab.size), "prompts": args.prompts, "prompt_tokens": args.prompt_tokens,
                       "new_tokens": args.new_tokens, "epochs": args.epochs, "pass_costs": bool(args.pass_costs),
                       "drafter_cost": "left out of the modelled ratios"}
    result.write()


if __name__ == "__main__":
    main()
