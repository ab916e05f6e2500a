"""Draft trees: several candidate drafts of a greedy speculative row verified in one forward pass (REST,
He et al. 2023, verifies its trie's candidates the same way, and
SpecInfer, Miao et al. 2024, a token tree with a tree attention mask).

What a tree is. The candidates (memlm.engine.drafts: the row's main draft `RowDrafts.main`, then its other history
matches and the datastore's other branches) are merged into their prefix tree (`prefix_tree`): node i holds a token
and a parent (-1: the row's last token x_t, the root), the main draft's nodes first, as a chain. The pass feeds x_t
and every node; node i sits at position p_t + depth(i) (its rotary angle) but in slot p_t + 1 + i of the row's cache,
and attends to the row's cache and to its ancestors only (`ancestors`: the tree attention mask). Each node's
logits are then those of its path fed as one chain, so greedy acceptance walks the tree: from the root, the child
whose token is the target's argmax at the current node, as long as there is one (`walk`). The
accepted path's cache entries move to slots p_t + 1 .. p_t + j (memlm.engine.kv_cache.RowCache.move_slots; none
move when the path is the main draft's prefix), so the row goes on as after a chain.

Why: on a CPU a verifying pass of up to 4 positions costs about what one of 1 does (oneDNN's packed GEMM,
memlm.model.decoder.PACKED_ROWS, and the panels kernel, memlm.model.panel_gemm, cost the same for the weights'
products from 1 to 4 positions; the pass's other work grows slowly), and a row's short datastore draft leaves
those positions free: its other candidates fill them. Only greedy rows: speculative sampling's rule
here is for one draft (memlm.engine.speculative.accept); a sampled row verifies its main draft alone.

Shape legend: n nodes, m candidates, L a candidate's length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from memlm.engine.drafts import DraftSource, RowDrafts, SpeculativeConfig, best_draft


class DraftTree(NamedTuple):
    """A row's candidate drafts as one tree (module docstring)."""

    tokens: tuple[int, ...]
    """(n,) each node's token."""
    parents: tuple[int, ...]
    """(n,) each node's parent node, -1 for the root x_t; parents[i] < i."""

    @property
    def is_chain(self) -> bool:
        """One draft: node i's parent is node i - 1."""
        return all(p == i - 1 for i, p in enumerate(self.parents))


def chain(draft: Sequence[int]) -> DraftTree:
    """One draft as a tree."""
    return DraftTree(tuple(draft), tuple(range(-1, len(draft) - 1)))


def prefix_tree(drafts: Sequence[Sequence[int]], budget: int) -> DraftTree:
    """The prefix tree of `drafts`, in their order: each adds the nodes of its prefixes not yet in the tree while the
    tree has fewer than `budget` nodes; the first draft's nodes are nodes 0 .. len - 1 (a chain, when it fits)."""
    node_of: dict[tuple[int, ...], int] = {}
    tokens: list[int] = []
    parents: list[int] = []
    for draft in drafts:
        for i in range(1, len(draft) + 1):
            prefix = tuple(draft[:i])
            if prefix in node_of:
                continue
            if len(tokens) >= budget:
                break
            node_of[prefix] = len(tokens)
            tokens.append(int(draft[i - 1]))
            parents.append(node_of[prefix[:-1]] if i > 1 else -1)
    return DraftTree(tuple(tokens), tuple(parents))


def depths(tree: DraftTree) -> list[int]:
    """(1 + n,) the position of x_t and of every node past x_t's: 0, then depth(i) (a chain: 0, 1, .., n)."""
    out = [0]
    for p in tree.parents:
        out.append(out[p + 1] + 1)
    return out


def ancestors(tree: DraftTree) -> np.ndarray:
    """(1 + n, 1 + n) bool over the pass's tokens (x_t, then the nodes): [a, b] when b is a itself or one of its
    ancestors, what a attends to among them (a chain: the causal mask)."""
    n = len(tree.tokens)
    sees = np.zeros((n + 1, n + 1), dtype=bool)  # (1+n, 1+n)
    sees[:, 0] = True
    for i, p in enumerate(tree.parents):
        sees[i + 1] = sees[p + 1]
        sees[i + 1, i + 1] = True
    return sees


def children(tree: DraftTree) -> list[dict[int, int]]:
    """Per pass position (x_t, then the nodes) its children's {token: node} (a prefix tree's children differ)."""
    kids: list[dict[int, int]] = [{} for _ in range(len(tree.tokens) + 1)]
    for i, (token, p) in enumerate(zip(tree.tokens, tree.parents)):
        kids[p + 1][token] = i
    return kids


def walk(kids: list[dict[int, int]], chosen: dict[int, int], start: int = 0) -> list[int]:
    """Pass positions from `start` (x_t is 0, node i is i + 1), each the next's parent, while the token `chosen` at
    one (a position -> token map) is one of its children's: [start, ...]; the last one's choice is missing or has
    no child (then it is the pass's last token, the target's own)."""
    visited = [start]
    while visited[-1] in chosen and chosen[visited[-1]] in kids[visited[-1]]:
        visited.append(kids[visited[-1]][chosen[visited[-1]]] + 1)
    return visited


def datastore_branches(starts: np.ndarray, source: DraftSource, length: int, width: int, min_agreeing: int
                       ) -> list[tuple[int, ...]]:
    """Up to `width` drafts of at most `length` tokens from the chains that begin at `starts` (m,)
    (drafts.chain_starts): under each of the first tokens most chains agree on (at least min_agreeing), the
    best-first path of the chains that start with it (drafts.best_draft)."""
    if length < 1:
        return []
    first = source.values[starts]  # (m,) each chain's first token
    tokens, counts = np.unique(first, return_counts=True)
    out = []
    for i in np.argsort(-counts, kind="stable")[:width]:
        if counts[i] >= min_agreeing:
            out.append(best_draft(starts[first == tokens[i]], source, length, min_agreeing))
    return [d for d in out if d]


def row_tree(text: Sequence[int], pointers: np.ndarray, source: DraftSource, length: int, spec: SpeculativeConfig,
             greedy: bool, room: int) -> DraftTree:
    """The tree a row verifies after its `text` (drafts at most `length` tokens deep): the prefix tree of its
    `tree_candidates`, up to spec.tree_nodes nodes in all (a main draft that long is verified alone), at most `room`
    nodes (>= length: the slots left before the row's cache is full); its main draft alone (a chain) for a sampled
    row, without spec.tree_nodes, or with nothing to draft."""
    return candidate_tree(tree_candidates(text, pointers, source, length, spec, greedy), spec.tree_nodes, room)


def candidate_tree(candidates: Sequence[Sequence[int]], tree_nodes: int, room: int) -> DraftTree:
    """The tree of a row's candidates (main draft first): the main draft alone when it is the only one, else their
    prefix tree of up to tree_nodes nodes, more for a main draft that long (verified alone), at most `room`."""
    if len(candidates) == 1:
        return chain(candidates[0])
    return prefix_tree([d for d in candidates if d], min(room, max(tree_nodes, len(candidates[0]))))


def tree_candidates(text: Sequence[int], pointers: np.ndarray, source: DraftSource, length: int,
                    spec: SpeculativeConfig, greedy: bool) -> list[tuple[int, ...]]:
    """A row's candidate drafts, its main draft (RowDrafts.main) first, then, for a greedy row with spec.tree_nodes, its
    other candidates from spec.draft_from's sources, in this order: the history's draft (a match of history_min_match
    tokens or more, own_text_draft), the short one of a shorter match (fallback_tokens), the datastore's branches
    (`datastore_branches`, tree_branches of them), the tokens that most often follow the last one
    (frequent_branches, one token each). Any may be empty."""
    drafts = RowDrafts(text, pointers, source, length, spec)  # each piece made once, for main and the others
    main = drafts.main
    if not greedy or spec.tree_nodes == 0 or length < 1:
        return [main]
    candidates = [main]
    if spec.draft_from != "datastore":
        candidates += [drafts.history, drafts.fallback]
    if spec.uses_datastore:
        candidates += datastore_branches(drafts.starts, source, length, spec.tree_branches, spec.min_agreeing)
        if spec.frequent_branches and source.frequent is not None and text:
            candidates += [(t,) for t in source.frequent.after(int(text[-1]), spec.frequent_branches)]
    return candidates
