"""Speculative decoding from the datastore inside continuous batching (issue 15 part 3; REST, He et al.
2023, drafts from memlm.engine.drafts).

A speculative row whose last token x_t is not yet fed feeds [x_t, d_1 .. d_n] (its draft, n <= draft_tokens)
in one forward pass with logits at every position; every speculative row of the step shares that pass
(left-padded, Engine._run). Then ONE search for the whole step: every fed position's key of the rows
with kNN-LM (the interpolated distribution p_i is needed at every position to verify), and for the rows
whose target is the base LM the key of their last accepted position, only when their pointers ran out
(the datastore then only drafts). With p_0 .. p_n the row's final distributions (memlm.engine.sampling's
rules: the kNN-LM mixture, ids beyond the tokenizer's vocabulary never chosen, temperature, top-k, top-p):
- greedy: accept the longest prefix d_1 .. d_j with d_i = argmax p_{i-1}, then the model's own token
  argmax p_j: one pass always yields >= 1 token, and exactly plain greedy decoding's tokens;
- sampling: the draft is deterministic (q = one-hot on d_i), so speculative sampling's rule (Leviathan
  et al. 2023; Chen et al. 2023) accepts d_i with probability min(1, p(d_i) / q(d_i)) = p_{i-1}(d_i), drawn
  with the row's own generator, and on rejection draws from max(0, p - q) renormalised = p_{i-1} with d_i
  removed; after n acceptances one draw from p_n. Each token is then distributed exactly as the plain
  sampler's (not the same draws for a seed: the draws differ).
The row's cache keeps x_t, d_1 .. d_j: the rejected positions' slots are marked empty (the cache has
per-row lengths; they are overwritten as the row goes on). Eos, stops, max_new_tokens and sliding hold as
in plain decoding: the tokens go through Engine._advance one at a time and the row stops at the first
that ends it (a stop inside an accepted draft cuts it there); a draft is cut so that the pass never
runs past the row's capacity (no slide inside a pass) nor past max_new_tokens. The next draft follows the
row's pointers (memlm.engine.drafts): the neighbours of the position that chose the last token whose
value it is, or the old pointers walked along the tokens; a base-LM row searches only when those ran out.
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
from memlm.engine.drafts import DraftSource, advance, matching, row_draft
from memlm.engine.kv_cache import RowCache
from memlm.engine.requests import GenerationRequest
from memlm.engine.rows import Row
from memlm.engine.sampling import search_rows
from memlm.engine.score_rows import ScoreRow
from memlm.errors import MemlmError
from memlm.jobs.generate import SamplingConfig, filter_logits
from memlm.retrieval.knnlm import KNNLMConfig, interpolate, knn_log_distribution
from memlm.retrieval.searcher import Neighbors, Searcher


class Engine(passes.Engine, Protocol):
    """What verification uses of memlm.engine.engine.Engine (a protocol: that module imports this one)."""

    cache: RowCache
    searcher: Searcher | None
    drafts: DraftSource | None
    decodable: int
    _rows: dict[int, Row | ScoreRow]

    def _advance(self, row: Row, token: int, logprob: float, base_logprob: float) -> None: ...

    def _release(self, row: Row | ScoreRow) -> None: ...


class Refusal(NamedTuple):
    """Why a speculative request is not served (`refusal`)."""

    message: str
    precondition: bool
    """What is missing is the server's (a datastore in process: FAILED_PRECONDITION), not a mode it does not
    serve (UNIMPLEMENTED)."""


def refusal(has_drafts: bool, memory_kind: str | None, fewer: bool) -> Refusal | None:
    """The one place of speculative decoding's refusals (the engine's check_request, the Generate parser's
    services.lm_args.speculative_of): drafts read a datastore in process; only the plain KV cache (a rejected
    position would overwrite XL ring slots the memory still needs); not with fewer searches (drafts keep
    pointers of their own, memlm.engine.drafts, and every drafted position is searched). None: served."""
    if not has_drafts:
        return Refusal("speculative decoding drafts from a datastore in process (give --datastore DIR): there is "
                       "none here, or a retrieval service", True)
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
    why = refusal(engine.drafts is not None and engine.searcher is not None,
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
    rows = sorted(rows, key=lambda r: r.slot)  # the slots of now (Engine._choose may have released rows)
    ring, source = engine.cache.layout.ring, engine.drafts
    drafts = []
    for row in rows:  # cut: no slide inside the pass, nothing drafted past max_new_tokens
        spec = row.handle.request.speculative
        cap = min(spec.draft_tokens, ring - row.cached - 1, row.steps_left - 1)
        drafts.append(row_draft(row.tokens, row.pointers, source, cap, spec))
    starts = [row.fed for row in rows]
    for row, d in zip(rows, drafts):
        row.tokens += d  # fed by this pass, taken back below
    logits, keys, _ = passes.run(engine, [(row, 1 + len(d)) for row, d in zip(rows, drafts)], every_position=True,
                                 verify=True)
    T = logits.shape[1]  # (B, T, V), (B, T, C)
    for row, d in zip(rows, drafts):
        del row.tokens[len(row.tokens) - len(d):]
    lm_lp = [F.log_softmax(logits[b, T - 1 - len(d):].float(), dim=-1) for b, d in enumerate(drafts)]  # (1+n, V)
    rkeys = [keys[b, T - 1 - len(d):] for b, d in enumerate(drafts)]  # (1+n, C)
    knn = [row.handle.request.knn for row in rows]
    checked = [d[: _cut(lm, d, c, row.handle.request.sampling, engine.decodable)]  # what can be accepted
               for lm, d, c, row in zip(lm_lp, drafts, knn, rows)]
    lm_lp = [lm[: 1 + len(d)] for lm, d in zip(lm_lp, checked)]  # (1+n', V): only these positions are searched
    rkeys = [k[: 1 + len(d)] for k, d in zip(rkeys, checked)]  # (1+n', C)
    accepted: list[tuple[list[int], int] | None] = [None] * len(rows)
    walked: list[np.ndarray | None] = [None] * len(rows)  # base rows' pointers walked along their tokens
    for b, row in enumerate(rows):  # base-LM targets: acceptance needs no search
        if knn[b] is None:
            accepted[b] = accept(lm_lp[b], checked[b], row.handle.request.sampling, row.generator, engine.decodable)
            walked[b] = advance(row.pointers, accepted[b][0], source)
    neighbors, failed = _search(engine, rows, rkeys, knn, accepted, walked)
    final = list(lm_lp)
    for b, row in enumerate(rows):
        if knn[b] is not None and failed is None:
            nb = neighbors[b]  # (1+n, k)
            knn_lp = knn_log_distribution(nb, lm_lp[b].shape[-1], knn[b].temperature).to(lm_lp[b].device)  # (1+n, V)
            final[b] = interpolate(lm_lp[b], knn_lp, knn[b].lmbda)  # (1+n, V)
            accepted[b] = accept(final[b], checked[b], row.handle.request.sampling, row.generator, engine.decodable)
    pointers = [_next_pointers(row, a, nb, w, source) if a is not None else None
                for row, a, nb, w in zip(rows, accepted, neighbors, walked)]
    for b, row in enumerate(rows):  # roll back before any row leaves (a release moves rows)
        if accepted[b] is not None:
            p0 = starts[b] - row.base  # x_t's position = its slot (the plain cache does not wrap)
            engine.cache.slot_pos[row.slot, p0 + 1 + accepted[b][1] : p0 + 1 + len(drafts[b])] = -1
    for b, row in enumerate(rows):
        if accepted[b] is None:  # a kNN-LM row whose search failed
            row.handle.put(failed)
            engine._release(row)
            continue
        _emit(engine, row, starts[b], accepted[b][0], final[b], lm_lp[b], pointers[b])


CUT_MARGIN = 1e-4
"""Slack on _cut's bound, far above the float32 error of the probabilities it compares."""


def _cut(lm_lp: torch.Tensor, draft: tuple[int, ...], knn: KNNLMConfig | None, sampling: SamplingConfig,
         decodable: int) -> int:
    """Greedy kNN-LM: the first draft index i whose token d_(i+1) cannot be the mixture's argmax whatever the
    neighbours, len(draft) if none. p = (1 - lambda) p_LM + lambda p_kNN and 0 <= p_kNN <= 1, so a token
    a with (1 - lambda) (p_LM(a) - p_LM(d)) > lambda beats d under any p_kNN: d is rejected for certain,
    and the positions after i need no search (the pass yields at most the tokens chosen at 0..i).
    lm_lp: (1+n, V) base log-probabilities. Other rows (base LM, sampling): the whole draft."""
    if knn is None or sampling.temperature != 0 or not draft:
        return len(draft)
    p = lm_lp[: len(draft), :decodable].exp()  # (n, V')
    ids = torch.tensor(draft, device=p.device)[:, None]  # (n, 1)
    p_draft = torch.where(ids < decodable, p.gather(1, ids.clamp(max=decodable - 1)), 0.0)[:, 0]  # (n,)
    certain = (1 - knn.lmbda) * (p.max(dim=-1).values - p_draft) > knn.lmbda + CUT_MARGIN  # (n,)
    first = certain.nonzero()
    return int(first[0, 0]) if first.numel() else len(draft)


def _search(engine: Engine, rows: list[Row], keys: list[torch.Tensor], knn: list[KNNLMConfig | None],
            accepted: list[tuple[list[int], int] | None], walked: list[np.ndarray | None],
            ) -> tuple[list[Neighbors | None], Exception | None]:
    """The step's one search: kNN-LM rows' every position, and the last accepted position of base rows
    whose pointers ran out (to draft from). Per row its Neighbors (1+n, k) or (1, draft_k) or None (not
    searched); on failure (None per row, the error)."""
    queries, configs, owner = [], [], []
    for b, (row, c) in enumerate(zip(rows, knn)):
        if c is not None:
            queries.append(keys[b])  # (1+n, C)
            configs += [c] * keys[b].shape[0]
        elif walked[b].size == 0 and _by_search(row, engine.drafts):
            queries.append(keys[b][accepted[b][1] : accepted[b][1] + 1])  # (1, C)
            configs.append(KNNLMConfig(k=row.handle.request.speculative.draft_k))
        else:
            continue
        owner += [b] * queries[-1].shape[0]
        row.searches += queries[-1].shape[0]
    out: list[Neighbors | None] = [None] * len(rows)
    if not queries:
        return out, None
    try:
        found = search_rows(engine.searcher, torch.cat(queries), configs)  # per query (1, k)
    except Exception as e:  # noqa: BLE001 - delivered to the kNN-LM rows it ends, with its message
        return out, e
    for b in set(owner):
        mine = [nb for nb, o in zip(found, owner) if o == b]
        out[b] = Neighbors(*(np.concatenate(parts) for parts in zip(*mine)))  # (q_b, k)
    return out, None


def _next_pointers(row: Row, accepted: tuple[list[int], int], neighbors: Neighbors | None,
                   walked: np.ndarray | None, source: DraftSource) -> np.ndarray:
    """The row's pointers after this pass's tokens (memlm.engine.drafts): fresh from the neighbours of the
    position that chose the last token when they have some, else the old ones walked along the tokens."""
    tokens, j = accepted
    if neighbors is not None:
        at = j if row.handle.request.knn is not None else 0  # a base row searched position j only
        fresh = matching(Neighbors(*(a[at : at + 1] for a in neighbors)), tokens[-1])  # (m,)
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
        best = choice.argmax(dim=-1).tolist()  # (1+n,) one transfer
        j = next((i for i in range(n) if best[i] != draft[i]), n)
        return [*draft[:j], best[j]], j
    for i in range(n + 1):
        p = filter_logits(choice[i] / sampling.temperature, sampling.top_k, sampling.top_p).softmax(-1)  # (V,)
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
    """Hand the pass's tokens to Engine._advance one at a time (it may end the row at any of them); the
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
        engine._advance(row, token, lp, base)
        if engine._rows.get(row.slot) is not row:  # it ended
            return
    # After a slide the row is prefilled again and its next token comes from Engine._choose (draft_first).
    row.pointers = pointers if row.to_feed == 1 else pointers[:0]


def draft_first(engine: Engine, ready: list[Row], neighbors: list[Neighbors | None], keys: torch.Tensor) -> None:
    """Pointers after the token Engine._choose just chose for its speculative `ready` rows (their first
    generated token, or the first after a slide): from that choice's kNN-LM neighbours (per row, None
    without kNN-LM), or, for base-LM rows, from one search of their keys (B, C) of draft_k neighbours
    (base_pointers "search") or the suffix index ("suffix"). Rows that ended are skipped."""
    alive = [b for b, row in enumerate(ready) if row.handle.request.speculative is not None
             and engine._rows.get(row.slot) is row and row.to_feed == 1]
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
