"""Fewer kNN-LM searches in generation rows: RetoMaton pointers along the tokens
a row generates and/or adaptive retrieval's gate, inside the step's one batched search (memlm.engine.engine.Engine._choose).

A row whose GenerationRequest.fewer is set, at each chosen token:
- pointers (Alon et al. 2022; memlm.retrieval.pointers, whose functions are called here, never copied): the
  candidates for step t+1 are the successors of the row's step-t candidates (Row.candidates, searched or
  pointed) whose value is the token it chose (`follow`, exact distances from the stored keys in process, the
  predecessor's distance through the retrieval service's Successors rpc); the row is searched only when fewer
  than min_pointers survive (`needs_search`; a row's first token and the one after a gate skip have nothing
  to follow), and keeps the k nearest then, so a minimum above k is plain kNN-LM exactly; clustered states
  extend the pointed rows as in evaluation (`extend_by_clusters`). Through a retrieval service the row's
  lookups and the engine's searches must read one datastore generation: `memlm generate --retrieval` gives
  the engine one services.retrieval.walk.OneGeneration as both its searcher and the rows' lookups; the LM
  server refuses pointers in Generate over a remote datastore (services.lm.args.generate_retrieval_of: its
  lanes' searches are shared by calls, and its lookups would be bounded by no caller's deadline);
- the gate (He et al. 2021; memlm.retrieval.adaptive): a row that would search asks the gate over its LM
  distribution's features and its key (as memlm.jobs.fewer_scoring feeds it); where the score is below the
  threshold the search is skipped and the token comes from the base LM (lambda 0 for it), the row's pointers
  starting again from nothing (memlm.jobs.pointer_walk's rule). Threshold 0 searches always: plain kNN-LM.
Rows searched are counted in Row.searches, the others in Row.searches_saved (GenerationEnd's). A pointer
source whose lookups fail (a retrieval service's Successors) costs its rows their pointers for the step: they
are searched instead, and no row ends.

Shape legend: B ready rows, C key width, V vocab, k neighbours, w candidates of a row.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from memlm.engine.requests import GenerationRequest
from memlm.engine.rows import Row
from memlm.errors import MemlmError
from memlm.retrieval.adaptive import distribution_features
from memlm.retrieval.knnlm import KNNLMConfig
from memlm.retrieval.pointers import PointerSource, extend_by_clusters, follow, followed_distances_used, needs_search
from memlm.retrieval.searcher import Neighbors

_log = logging.getLogger(__name__)


def check_request(request: GenerationRequest) -> None:
    """Refuse in one line what fewer-search generation does not serve."""
    fewer = request.fewer
    if fewer is None:
        return
    # With --speculative: refused by memlm.engine.speculative.refusal (the one place of those rules).
    if fewer.pointers is not None and fewer.pointers.keep_pointers:
        raise MemlmError("generation keeps a searched row's k nearest only (PointerConfig.keep_pointers is off)")


def plan_searches(ready: Sequence[Row], logits: torch.Tensor, keys: torch.Tensor,
                  knn: Sequence[KNNLMConfig | None]) -> tuple[list[KNNLMConfig | None], list[Neighbors | None]]:
    """Which ready rows are searched in the step's one search (memlm.engine.engine.Engine._choose) and the
    others' neighbours (logits (B, V), keys (B, C); knn per row, None without kNN-LM): (ask, pointed), ask[i]
    the row's settings when it is searched, pointed[i] its pointed candidates (1, w) or None (no kNN-LM,
    searched, or skipped by the gate: the base LM). Counts each kNN row's search or saving."""
    fewer = [row.handle.request.fewer if c is not None else None for row, c in zip(ready, knn)]
    ask: list[KNNLMConfig | None] = list(knn)  # the rows searched now
    out: list[Neighbors | None] = [None] * len(ready)
    if any(f is not None and f.pointers is not None for f in fewer):
        xq = keys.detach().float().cpu().numpy()  # (B, C) float32, as search_keys sends it
        for i, cands in _pointed(ready, fewer, xq).items():
            out[i], ask[i] = cands, None
    gated = [i for i, (c, f) in enumerate(zip(ask, fewer)) if c is not None and f is not None and f.adaptive is not None]
    if gated:
        lm = F.log_softmax(logits[gated].float(), dim=-1)  # (G, V)
        features = distribution_features(lm)  # (G, 5)
        for adaptive in {id(fewer[i].adaptive): fewer[i].adaptive for i in gated}.values():
            mine = [j for j, i in enumerate(gated) if fewer[i].adaptive is adaptive]
            allowed = adaptive.allowed(features[mine], keys[[gated[j] for j in mine]])  # (g,)
            for j, go in zip(mine, allowed.tolist()):
                if not go:
                    ask[gated[j]] = None  # the base LM for this token; nothing to follow after it
    for i, (row, c) in enumerate(zip(ready, knn)):
        if c is not None:
            searched = ask[i] is not None
            row.searches += searched
            row.searches_saved += not searched
    return ask, out


def keep_candidates(ready: Sequence[Row], knn: Sequence[KNNLMConfig | None], neighbors: Sequence[Neighbors | None]) -> None:
    """After the step's search: pointer rows keep their (1, w) neighbours, what the next step follows (None after
    a gate skip)."""
    for row, c, nb in zip(ready, knn, neighbors):
        if c is not None and row.handle.request.fewer is not None and row.handle.request.fewer.pointers is not None:
            row.candidates = nb


def _pointed(ready: Sequence[Row], fewer: list, xq: np.ndarray) -> dict[int, Neighbors]:
    """Pointer rows with enough candidates after following their last token: row index -> (1, w) candidates.
    One `follow` per pointer source (the rows of one datastore together), vectorised over its rows."""
    walking = [i for i, f in enumerate(fewer) if f is not None and f.pointers is not None
               and ready[i].candidates is not None]
    out: dict[int, Neighbors] = {}
    for source in {id(fewer[i].source): fewer[i].source for i in walking}.values():
        rows = [i for i in walking if fewer[i].source is source]
        try:
            out.update(_follow_source(ready, fewer, xq, source, rows))
        except Exception as e:  # noqa: BLE001 - a failed lookup (a retrieval fault): these rows search this step
            _log.warning("pointer lookups failed, %d rows search instead: %s", len(rows), e)
    return out


def _follow_source(ready: Sequence[Row], fewer: list, xq: np.ndarray, source: PointerSource,
                   rows: list[int]) -> dict[int, Neighbors]:
    """_pointed for the rows of one pointer source."""
    out: dict[int, Neighbors] = {}
    prev = _stack([ready[i].candidates for i in rows])  # (r, w)
    targets = np.array([ready[i].tokens[-1] for i in rows], dtype=np.int64)  # (r,) the tokens they chose
    # keep_pointers is refused in generation (check_request): a searched row keeps its k nearest only
    cands = follow(prev, targets, xq[rows], source, followed_distances_used(source, False))  # (r, w')
    minimum = np.array([fewer[i].pointers.min_pointers for i in rows])  # (r,)
    enough = np.flatnonzero(~needs_search(cands, minimum))  # (e,)
    width = np.array([fewer[i].pointers.extended_width(ready[i].handle.request.knn.k) for i in rows])  # (r,)
    for w in np.unique(width[enough]).tolist():  # one call per width: a row's members never depend on another's
        group = enough[width[enough] == w]  # (g,)
        extended = extend_by_clusters(cands, group, xq[rows], source, w)  # clustered states (none: as is)
        for j in group.tolist():
            out[rows[j]] = Neighbors(*(a[j : j + 1, :w] for a in extended))  # (1, w' <= w) best first
    return out


def _stack(parts: list[Neighbors]) -> Neighbors:
    """Rows' (1, w_i) candidates -> (r, max w_i), padded with missing entries (id -1, value -1, distance inf)."""
    width = max(p.ids.shape[1] for p in parts)
    out = [np.full((len(parts), width), fill, dtype=dtype)
           for fill, dtype in ((np.inf, np.float32), (-1, np.int64), (-1, np.int32))]  # (r, width) each
    for j, p in enumerate(parts):
        for o, a in zip(out, p):
            o[j, : a.shape[1]] = a[0]
    return Neighbors(*out)
