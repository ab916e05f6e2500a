"""Speculative decoding inside continuous batching (drafts from memlm.engine.drafts: the
datastore's successors (REST, He et al. 2023), the row's own text (prompt lookup), or both).

A speculative row whose last token x_t is not yet fed feeds [x_t, d_1 .. d_n] (its draft, n <= draft_tokens)
in one forward pass with logits at every position; every speculative row of the step shares that pass
(left-padded, Engine._run). A greedy row feeds a tree of its candidate drafts instead (memlm.engine.draft_trees:
tree attention, SpeculativeConfig.tree_nodes), whose every node has its path's logits; a chain is a tree of one
branch, and everything below holds for trees, read "the path the target's choices take through the tree" for
"the draft's prefix". Then one search for the whole step: the keys of the kNN-LM rows' positions that
verification needs (the interpolated distribution p_i; a greedy row's up to the first draft token the base LM
rejects, _lm_path, and a further search in the rare pass where the neighbours lift that token; a sampled
row's every position), and for the rows whose target is the base LM the key of their last accepted
position, only when their pointers ran out (the datastore then only drafts). With p_0 .. p_n the row's final
distributions (memlm.engine.sampling's rules: the kNN-LM mixture, ids beyond the tokenizer's vocabulary never
chosen, temperature, top-k, top-p):
- greedy: accept the longest prefix d_1 .. d_j with d_i = argmax p_{i-1}, then the model's own token
  argmax p_j: one pass always yields >= 1 token, and exactly plain greedy decoding's tokens;
- sampling: the draft is deterministic (q = one-hot on d_i), so speculative sampling's rule (Leviathan
  et al. 2023; Chen et al. 2023) accepts d_i with probability min(1, p(d_i) / q(d_i)) = p_{i-1}(d_i), drawn
  with the row's own generator, and on rejection draws from max(0, p - q) renormalised = p_{i-1} with d_i
  removed; after n acceptances one draw from p_n. Each token is then distributed exactly as the plain
  sampler's (not the same draws for a seed: the draws differ).
The row's cache keeps x_t, d_1 .. d_j: the rejected positions' slots are marked empty (the cache has
per-row lengths; they are overwritten as the row goes on), and an accepted branch off a tree's main draft is moved
into the slots after x_t first (_roll_back). Eos, stops, max_new_tokens and sliding hold as
in plain decoding: the tokens go through Engine.advance one at a time and the row stops at the first
that ends it (a stop inside an accepted draft cuts it there); a draft is cut so that the pass never
runs past the row's capacity (no slide inside a pass) nor past max_new_tokens. A datastore draft follows the
row's pointers (memlm.engine.drafts): the neighbours of the position that chose the last token whose
value it is, or the old pointers walked along the tokens; a base-LM row searches only when those ran out
(never when it drafts from its own text alone).
Only the plain KV cache: with the XL memory a rejected position would have overwritten a ring slot that
the memory still needs.

Shape legend: B speculative rows, T fed positions (1 + longest draft), V vocab, C key width, k neighbours,
n a row's draft length.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from memlm.engine import passes
from memlm.engine.draft_trees import DraftTree, ancestors, children, depths, row_tree, walk
from memlm.engine.drafts import DraftSource, advance, matching
from memlm.engine.passes import TreeShape
from memlm.engine.kv_cache import RowCache
from memlm.engine.requests import GenerationRequest
from memlm.engine.rows import Row
from memlm.engine.sampling import argmax_rows, search_each, search_rows
from memlm.engine.score_rows import ScoreRow
from memlm.errors import MemlmError
from memlm.jobs.decoding import SamplingConfig, filter_logits, scale_logits
from memlm.retrieval.interpolation import next_token_logprobs
from memlm.retrieval.knnlm import KNNLMConfig
from memlm.retrieval.searcher import Neighbors, Searcher


class Engine(passes.Engine, Protocol):
    """What verification uses of memlm.engine.engine.Engine (a protocol: that module imports this one)."""

    cache: RowCache
    searcher: Searcher | None
    drafts: DraftSource | None
    decodable: int

    def advance(self, row: Row, token: int, logprob: float, base_logprob: float) -> None: ...

    def release(self, row: Row | ScoreRow) -> None: ...

    def fail(self, row: Row | ScoreRow, error: Exception) -> None: ...

    def holds(self, row: Row | ScoreRow) -> bool: ...


class Refusal(NamedTuple):
    """Why a speculative request is not served (`refusal`)."""

    message: str
    precondition: bool
    """What is missing is the server's (a datastore in process: FAILED_PRECONDITION), not a mode it does not
    serve (UNIMPLEMENTED)."""


def refusal(uses_datastore: bool, has_drafts: bool, memory_kind: str | None, fewer: bool) -> Refusal | None:
    """The one place of speculative decoding's refusals (the engine's check_request, the Generate parser's
    services.lm.args.speculative_of): drafts from the datastore (SpeculativeConfig.uses_datastore; history drafts
    read the row's own text only) read a datastore in process (`has_drafts`); only the plain KV cache (a rejected
    position would overwrite XL ring slots the memory still needs); not with fewer searches (drafts keep
    pointers of their own, memlm.engine.drafts, and every drafted position is searched). None: served."""
    if uses_datastore and not has_drafts:
        return Refusal("speculative decoding drafts from a datastore in process (give --datastore DIR, or draw "
                       "drafts from the row's own text: --draft-from history): there is none here, or a retrieval "
                       "service", True)
    if memory_kind is not None:
        return Refusal(f"speculative decoding serves the plain KV cache, not --memory {memory_kind}", False)
    if fewer:
        return Refusal("--pointers / --adaptive-* do not combine with --speculative (drafts keep pointers of their "
                       "own and verify every drafted position)", False)
    return None


def check_request(engine: Engine, request: GenerationRequest) -> None:
    """Refuse a speculative request the engine cannot serve, in one line (`refusal`)."""
    if request.speculative is None:
        return
    why = refusal(request.speculative.uses_datastore, engine.drafts is not None and engine.searcher is not None,
                  engine.config.xl.kind if engine.config.xl is not None else None, request.fewer is not None)
    if why is not None:
        raise MemlmError(why.message)


def split(decoding: list[tuple[Row, int]]) -> tuple[list[tuple[Row, int]], list[Row]]:
    """The step's decode rows (row, 1) -> (the plain ones, the speculative ones)."""
    return ([(r, n) for r, n in decoding if r.handle.request.speculative is None],
            [r for r, _ in decoding if r.handle.request.speculative is not None])


def verify(engine: Engine, rows: list[Row]) -> None:
    """One speculative step of `rows` (each with exactly its last token to feed; none: nothing to do)."""
    if not rows:
        return
    rows = sorted(rows, key=lambda r: r.slot)  # the slots of now (the engine's choice of tokens may have released rows)
    source = engine.drafts
    starts = [row.fed for row in rows]
    trees, lm_lp, rkeys = _feed(engine, rows)
    sizes = [1 + len(t.tokens) for t in trees]  # pass positions per row: x_t, then the nodes
    kids = [children(t) for t in trees]
    knn = [row.handle.request.knn for row in rows]
    greedy = [row.handle.request.sampling.temperature == 0 for row in rows]
    lm_best = [dict(enumerate(argmax_rows(lm_lp[b][:, : engine.decodable]).tolist())) if greedy[b] else {}
               for b in range(len(rows))]  # pass position -> the base LM's argmax
    accepted: list[Accepted | None] = [None] * len(rows)
    walked: list[np.ndarray | None] = [None] * len(rows)  # base rows' pointers walked along their tokens
    errors: dict[int, Exception] = {}  # row b -> what its own search or draw raised: it ends, the others go on
    for b, row in enumerate(rows):  # base-LM targets: acceptance needs no search
        if knn[b] is None:
            try:
                accepted[b] = (_walked(trees[b], kids[b], lm_best[b], lm_lp[b]) if greedy[b] else
                               _sampled(lm_lp[b], trees[b], row, engine.decodable))
            except Exception as e:  # noqa: BLE001 - this row ends with it
                errors[b] = e
                continue
            uses_datastore = row.handle.request.speculative.uses_datastore  # history drafts keep no pointers
            walked[b] = advance(row.pointers, accepted[b].tokens, source) if uses_datastore else row.pointers[:0]
    # kNN-LM rows: the pass positions to search next. A greedy row searches its base LM's path through the tree
    # (_lm_path) and searches on from where the mixture took another child all the same; a sampled row (one draft)
    # needs every position's distribution.
    spans = {b: (_lm_path(kids[b], lm_best[b], 0) if greedy[b] else list(range(sizes[b])))
             for b in range(len(rows)) if knn[b] is not None}
    found: list[dict[int, Neighbors]] = [{} for _ in rows]  # per kNN-LM row: pass position -> its neighbours (1, k)
    mixed: list[dict[int, torch.Tensor]] = [{} for _ in rows]  # per kNN-LM row: pass position -> final log-probs
    choice: list[dict[int, int]] = [{} for _ in rows]  # per greedy kNN-LM row: pass position -> the mixture's argmax
    drafted: list[Neighbors | None] = [None] * len(rows)  # base rows: the neighbours searched to draft from
    drafting = True
    while spans or drafting:  # one search a round (one in the common case)
        got, failed = _search(engine, rows, rkeys, spans, accepted, walked, drafting)
        errors.update((b, e) for b, e in failed.items() if knn[b] is not None)  # a failed draft search: no draft
        if drafting:  # base rows' searches to draft from: the first round only
            drafted = [got[b] if knn[b] is None else None for b in range(len(rows))]
            drafting = False
        further = {}
        for b, positions in spans.items():
            if b in errors:
                continue
            c = knn[b]
            mix = next_token_logprobs(lm_lp[b][positions], got[b], c)  # (q, V)
            for i, p in enumerate(positions):
                found[b][p] = Neighbors(*(a[i : i + 1] for a in got[b]))
                mixed[b][p] = mix[i]
            if greedy[b]:
                choice[b].update(zip(positions, argmax_rows(mix[:, : engine.decodable]).tolist()))
                end = walk(kids[b], choice[b])[-1]
                if end not in choice[b]:  # the mixture took a child the LM did not: search on from there
                    further[b] = _lm_path(kids[b], lm_best[b], end)
        spans = further
    for b, row in enumerate(rows):
        if knn[b] is not None and b not in errors:
            at = sorted(mixed[b])  # the searched pass positions
            final = torch.stack([mixed[b][p] for p in at])  # (s, V)
            try:
                accepted[b] = (_walked(trees[b], kids[b], choice[b], final, at) if greedy[b] else
                               _sampled(final, trees[b], row, engine.decodable))  # sampled: a chain, all searched
            except Exception as e:  # noqa: BLE001 - this row ends with it
                errors[b] = e
    last = [(found[b].get(a.end) if knn[b] is not None else drafted[b]) if a is not None else None
            for b, a in enumerate(accepted)]
    pointers = [_next_pointers(row, a.tokens, nb, w, source) if a is not None else None
                for row, a, nb, w in zip(rows, accepted, last, walked)]
    _roll_back(engine, rows, starts, trees, accepted)  # before any row leaves (a release moves rows)
    for b, row in enumerate(rows):
        if accepted[b] is None:  # a row whose search or draw failed
            engine.fail(row, errors[b])
            continue
        a = accepted[b]
        try:
            _emit(engine, row, starts[b], a.tokens, a.final_lp, lm_lp[b][a.positions], pointers[b])
        except Exception as e:  # noqa: BLE001 - the row's own text or stops: it ends, the others go on
            engine.fail(row, e)


def _feed(engine: Engine, rows: list[Row]) -> tuple[list[DraftTree], list[torch.Tensor], list[torch.Tensor]]:
    """The verifying pass: each row's draft tree (draft_trees.row_tree; cut so that there is no slide inside the
    pass and nothing is drafted past max_new_tokens) fed after its last token x_t. Per row: its tree, the base LM's
    log-probabilities (1+n, V) and kNN keys (1+n, C) at every pass position (x_t, then the nodes)."""
    trees = []
    for row in rows:
        spec, room = row.handle.request.speculative, engine.cache.layout.ring - row.cached - 1
        cap = min(spec.draft_tokens, room, row.steps_left - 1)
        greedy = row.handle.request.sampling.temperature == 0
        trees.append(row_tree(row.tokens, row.pointers, engine.drafts, cap, spec, greedy, room))
    for row, tree in zip(rows, trees):
        row.tokens += tree.tokens  # fed by this pass, taken back below
    shapes = None if all(t.is_chain for t in trees) else [TreeShape(depths(t), ancestors(t)) for t in trees]
    logits, keys, _ = passes.run(engine, [(row, 1 + len(t.tokens)) for row, t in zip(rows, trees)],
                                 every_position=True, verify=True, trees=shapes)
    T = logits.shape[1]  # (B, T, V), (B, T, C)
    for row, tree in zip(rows, trees):
        del row.tokens[len(row.tokens) - len(tree.tokens):]
    sizes = [1 + len(t.tokens) for t in trees]
    lm_lp = [F.log_softmax(logits[b, T - n :].float(), dim=-1) for b, n in enumerate(sizes)]  # (1+n, V)
    return trees, lm_lp, [keys[b, T - n :] for b, n in enumerate(sizes)]


def _roll_back(engine: Engine, rows: list[Row], starts: list[int], trees: list[DraftTree],
               accepted: list[Accepted | None]) -> None:
    """Keep x_t and the accepted path in the row's cache: a path off the main draft moves into the slots after
    x_t (draft_trees), and the slots after it are marked empty (overwritten as the row goes on)."""
    for b, row in enumerate(rows):
        if accepted[b] is not None:
            p0 = starts[b] - row.base  # x_t's position = its slot (the plain cache does not wrap)
            path, n = accepted[b].path, len(trees[b].tokens)
            if path != list(range(len(path))):
                engine.cache.move_slots(row.slot, [p0 + 1 + i for i in path], [p0 + 1 + i for i in range(len(path))])
            engine.cache.slot_pos[row.slot, p0 + 1 + len(path) : p0 + 1 + n] = -1


class Accepted(NamedTuple):
    """What a row's verifying pass yields."""

    tokens: list[int]
    """The accepted draft tokens, then the target's own."""
    path: list[int]
    """The tree's nodes accepted (a chain: 0 .. j - 1)."""
    positions: list[int]
    """(1 + j,) the pass position that chose each token (x_t's is 0, node i's is i + 1)."""
    final_lp: torch.Tensor
    """(1 + j, V) the final log-probabilities at those positions."""

    @property
    def end(self) -> int:
        """The pass position that chose the last token."""
        return self.positions[-1]


def _lm_path(kids: list[dict[int, int]], lm_best: dict[int, int], start: int) -> list[int]:
    """Greedy kNN-LM: the pass positions to search from `start`: the base LM's path through the tree (`walk` of its
    argmax), its last position included (whose mixture still chooses a token: the tree's where the neighbours lift
    it). Why search no further at once: at a small lambda the mixture seldom takes a token the LM rejects, so the
    positions after it are rarely needed; where it does take another child, verify searches on from there (one more
    search), so the output stays exact at any lambda. Measured on chains (greedy kNN-LM at lambda 0.1 over 8
    held-apart speeches, drafts from both), against searching every position up to where no p_kNN could lift the
    token: searches per token 1.20 -> 1.01, tokens a pass 2.24 -> 2.22, CPU time 6-8% less."""
    return walk(kids, lm_best, start)


def _walked(tree: DraftTree, kids: list[dict[int, int]], chosen: dict[int, int], final_lp: torch.Tensor,
            rows: list[int] | None = None) -> Accepted:
    """Greedy acceptance over a tree: the path `walk` takes with the target's argmax `chosen` at each pass
    position, then the target's own token at its end. final_lp: (s, V) the target's log-probabilities at the
    pass positions `rows` (None: every position, in order)."""
    positions = walk(kids, chosen)
    path = [p - 1 for p in positions[1:]]
    tokens = [tree.tokens[i] for i in path] + [chosen[positions[-1]]]
    index = positions if rows is None else [rows.index(p) for p in positions]
    return Accepted(tokens, path, positions, final_lp[index])


def _sampled(final_lp: torch.Tensor, tree: DraftTree, row: Row, decodable: int) -> Accepted:
    """A sampled row's acceptance over its one draft (a chain; `accept`)."""
    tokens, j = accept(final_lp, tree.tokens, row.handle.request.sampling, row.generator, decodable)
    return Accepted(tokens, list(range(j)), list(range(j + 1)), final_lp[: j + 1])


def _search(engine: Engine, rows: list[Row], keys: list[torch.Tensor], spans: dict[int, list[int]],
            accepted: list[Accepted | None], walked: list[np.ndarray | None], drafting: bool,
            ) -> tuple[list[Neighbors | None], dict[int, Exception]]:
    """One search call: the pass positions of the kNN-LM rows in spans, and (drafting) the last accepted
    position of base rows whose pointers ran out (to draft from). Per row its Neighbors (q, k) or
    (1, draft_k) or None (not searched, or failed), and the error of each row b whose search failed
    (memlm.engine.sampling.search_each: one row's fault fails that row only)."""
    queries, configs, owner = [], [], []
    for b, row in enumerate(rows):
        if b in spans:
            queries.append(keys[b][spans[b]])  # (q, C)
            configs += [row.handle.request.knn] * len(spans[b])
        elif (drafting and row.handle.request.knn is None and accepted[b] is not None and walked[b].size == 0
              and _by_search(row, engine.drafts)):
            queries.append(keys[b][accepted[b].end : accepted[b].end + 1])  # (1, C)
            configs.append(KNNLMConfig(k=row.handle.request.speculative.draft_k))
        else:
            continue
        owner += [b] * queries[-1].shape[0]
        row.searches += queries[-1].shape[0]
    out: list[Neighbors | None] = [None] * len(rows)
    if not queries:
        return out, {}
    found, errors = search_each(engine.searcher, torch.cat(queries), configs, owner)  # per query (1, k)
    for b in set(owner) - set(errors):
        mine = [nb for nb, o in zip(found, owner) if o == b]
        out[b] = Neighbors(*(np.concatenate(parts) for parts in zip(*mine)))  # (q_b, k)
    return out, errors


def _next_pointers(row: Row, tokens: list[int], neighbors: Neighbors | None, walked: np.ndarray | None,
                   source: DraftSource) -> np.ndarray:
    """The row's pointers after this pass's tokens (memlm.engine.drafts): fresh from the neighbours (1, k) of the
    position that chose the last token when they have some, else the old ones walked along the tokens; none
    for a row that drafts from its own text only (no datastore in the engine)."""
    if not row.handle.request.speculative.uses_datastore:
        return row.pointers[:0]
    if neighbors is not None:
        fresh = matching(neighbors, tokens[-1])  # (m,)
        if fresh.size:
            return fresh
    if walked is not None and walked.size == 0 and _by_suffix(row, source):
        return source.suffix.pointers((row.tokens + tokens)[-2:])  # the row's text after this pass
    return walked if walked is not None else advance(row.pointers, tokens, source)


def _by_suffix(row: Row, source: DraftSource) -> bool:
    """Whether a base-LM row without pointers takes them from the suffix index (no search)."""
    spec = row.handle.request.speculative
    return spec.uses_datastore and spec.base_pointers == "suffix" and source.suffix is not None


def _by_search(row: Row, source: DraftSource) -> bool:
    """Whether a base-LM row without pointers searches for them (draft_k neighbours of its last key)."""
    return row.handle.request.speculative.uses_datastore and not _by_suffix(row, source)


def accept(final_lp: torch.Tensor, draft: tuple[int, ...], sampling: SamplingConfig, generator: torch.Generator,
           decodable: int) -> tuple[list[int], int]:
    """The exact acceptance rule (module docstring). final_lp: (1+n, V) the row's final log-probabilities
    at x_t and every draft token. Returns the tokens the pass yields (accepted draft + one more) and j,
    the accepted draft tokens."""
    choice = final_lp
    if decodable < final_lp.shape[-1]:
        choice = final_lp.clone()
        choice[:, decodable:] = float("-inf")
    n = len(draft)
    if sampling.temperature == 0:
        best = argmax_rows(choice).tolist()  # (1+n,)
        j = next((i for i in range(n) if best[i] != draft[i]), n)
        return [*draft[:j], best[j]], j
    for i in range(n + 1):
        scaled = scale_logits(choice[i], sampling.temperature)  # (V,)
        p = filter_logits(scaled, sampling.top_k, sampling.top_p).softmax(-1)  # (V,)
        if i == n:
            return [*draft, int(torch.multinomial(p, 1, generator=generator)[0])], n
        u = torch.rand((), generator=generator, device=generator.device)
        if not u < p[draft[i]]:  # rejected: draw from p without d_i (renormalised by multinomial)
            p = p.clone()
            p[draft[i]] = 0.0
            return [*draft[:i], int(torch.multinomial(p, 1, generator=generator)[0])], i
    raise AssertionError("unreachable")


def _emit(engine: Engine, row: Row, start: int, tokens: list[int], final_lp: torch.Tensor, lm_lp: torch.Tensor,
          pointers: np.ndarray) -> None:
    """Hand the pass's tokens to Engine.advance one at a time (it may end the row at any of them); the
    row keeps `pointers` for its next draft. start: the row's `fed` before the pass (x_t's index); when
    token i is handed on, the cache holds x_t and the i draft tokens before it, as in plain decoding (so
    a slide happens after the same token)."""
    index = torch.arange(len(tokens), device=final_lp.device)  # (m,) the position that chose each token
    picked = torch.tensor(tokens, device=final_lp.device)  # (m,)
    lps = torch.stack([final_lp[index, picked], lm_lp[index, picked]]).double().cpu().tolist()  # (2, m)
    row.verify_steps += 1
    for i, (token, lp, base) in enumerate(zip(tokens, *lps)):
        row.fed = start + 1 + i
        # Counted before _advance makes the row's GenerationEnd; eos is no completion token (not counted there).
        row.verified_tokens += token != row.handle.request.eos_id
        engine.advance(row, token, lp, base)
        if not engine.holds(row):  # it ended
            return
    # After a slide the row is prefilled again and its next token comes from the engine's choice of tokens (draft_first).
    row.pointers = pointers if row.to_feed == 1 else pointers[:0]


def draft_first(engine: Engine, ready: list[Row], neighbors: list[Neighbors | None], keys: torch.Tensor) -> None:
    """Pointers after the token the engine's choice of tokens just chose for its speculative `ready` rows (their first
    generated token, or the first after a slide): from that choice's kNN-LM neighbours (per row, None
    without kNN-LM), or, for base-LM rows, from one search of their keys (B, C) of draft_k neighbours
    (base_pointers "search") or the suffix index ("suffix"). Rows that ended are skipped."""
    alive = [b for b, row in enumerate(ready) if row.handle.request.speculative is not None
             and engine.holds(row) and row.to_feed == 1]
    neighbors = list(neighbors)
    for b in alive:
        if neighbors[b] is None and _by_suffix(ready[b], engine.drafts):
            ready[b].pointers = engine.drafts.suffix.pointers(ready[b].tokens[-2:])
    base = [b for b in alive if neighbors[b] is None and _by_search(ready[b], engine.drafts)]
    if base:
        configs = [KNNLMConfig(k=ready[b].handle.request.speculative.draft_k) for b in base]
        try:
            found = search_rows(engine.searcher, keys[base], configs)  # per row (1, draft_k)
        except Exception:  # noqa: BLE001 - only drafting failed: these rows go on without a draft
            found = [None] * len(base)
        for b, nb in zip(base, found):
            neighbors[b] = nb
            ready[b].searches += 1
    for b in alive:
        if neighbors[b] is not None:
            ready[b].pointers = matching(neighbors[b], ready[b].tokens[-1])
