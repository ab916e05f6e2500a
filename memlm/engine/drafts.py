"""Draft continuations from the datastore for speculative decoding (REST, He et al. 2023, "REST:
Retrieval-Based Speculative Decoding"), issue 15 part 3.

What is drafted: after a row's token y was chosen at a position whose query key had the neighbours N
(the kNN-LM search of that position, or a search made only to draft when the target is the base LM), the
neighbours whose stored value is y (`matching`) are places in the corpus where a context like the row's
went on with y: the row's pointers. Each one's successor entry (memlm.retrieval.pointers.successors: the
same document at position + 1; a document's end has none, so a draft never crosses a document boundary)
stores the token that followed y there, its successor the next one, and so on: every pointer spells one
draft chain of up to `draft_tokens` tokens (`draft_chains`). The chains are the candidate drafts; the
engine verifies one per row per step, the best-first path through their prefix tree (`best_draft`): at
each depth the token most chains agree on (ties: the chain of the nearest neighbour), following only the
chains that agree so far (REST's trie, walked greedily). After the step the pointers move along the
tokens that came (`advance`, RetoMaton's walk, Alon et al. 2022): a kNN-LM row takes fresh ones from the
neighbours of its last position (searched anyway) and walks the old ones only when those have none; a
base-LM row searches only when its walked pointers ran out. Why: REST drafts from a datastore of text
instead of a small draft model, and a kNN-LM engine already has the datastore and the neighbours of the
current position, so a draft costs a few array lookups; whether a draft is right is decided only by
verification (memlm.engine.speculative), so any draft keeps the output exact.

Shape legend: k neighbours, m matching neighbours (chains), L draft length, N datastore entries.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memlm.errors import MemlmError
from memlm.retrieval.pointers import ProvenanceLookup, successors
from memlm.retrieval.searcher import Neighbors


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding from the datastore (`memlm generate --speculative [--draft-tokens N]`)."""

    draft_tokens: int = 4
    """Most draft tokens verified per row per step (the forward pass feeds 1 + this many tokens, and a
    kNN-LM row searches every one of them)."""
    draft_k: int = 64
    """Neighbours searched to draft from when the row's target is the base LM (a kNN-LM row drafts from
    the neighbours of its own search, its k)."""
    min_agreeing: int = 2
    """A draft token needs at least this many of the chains agreeing on it; the draft ends before the
    first that has fewer. A token one chain alone spells is rarely the model's, and every drafted
    position costs a search for a kNN-LM row: replaying recorded greedy kNN-LM runs on the SOTU setting
    (benchmarks/speculative_knnlm.py's), 2 keeps 1.31 tokens a pass of 1's 1.32 at 2.2 searches a token
    instead of 3.4 (draft_tokens 4)."""

    def __post_init__(self) -> None:
        if self.draft_tokens < 1:
            raise MemlmError(f"--draft-tokens must be at least 1, got {self.draft_tokens}")
        if self.draft_k < 1 or self.min_agreeing < 1:
            raise MemlmError(f"draft_k and min_agreeing must be at least 1, got {self.draft_k}, {self.min_agreeing}")


@dataclass(frozen=True)
class DraftSource:
    """What drafting reads from the datastore besides searches (the command line fills it in from
    datastore.Datastore: successors(store.provenance, n).next_ids and store.values)."""

    next_ids: np.ndarray
    """(N,) int64 successor of every entry, -1 at a document's end (memlm.retrieval.pointers.Successors)."""
    values: np.ndarray
    """(N,) int32 stored next token of every entry."""

    def __post_init__(self) -> None:
        n = self.next_ids.shape[0]
        if self.next_ids.ndim != 1 or self.values.shape != (n,):
            raise MemlmError(f"a draft source needs next_ids (N,) and values (N,), got {self.next_ids.shape} "
                             f"and {self.values.shape}")


def matching(neighbors: Neighbors, chosen: int) -> np.ndarray:
    """Pointers after `chosen`: the neighbours (1, k) of the position that predicted it whose stored value
    is `chosen`, (m,) int64 entry ids in distance order."""
    ids, values = neighbors.ids[0], neighbors.values[0]  # (k,), (k,)
    return ids[(ids >= 0) & (values == chosen)]  # (m,)


def advance(pointers: np.ndarray, tokens: list[int], source: DraftSource) -> np.ndarray:
    """Pointers after the row went on with `tokens`: each pointer's successor, kept while its stored value
    is the token that came (RetoMaton's walk, Alon et al. 2022); (m',) int64, empty when all ran out."""
    for token in tokens:
        nxt = source.next_ids[pointers]  # (m,)
        nxt = nxt[nxt >= 0]
        pointers = nxt[source.values[nxt] == token]  # (m',)
    return pointers


def draft_chains(pointers: np.ndarray, source: DraftSource, length: int) -> np.ndarray:
    """The candidate drafts after the pointers' token: (m, L) int64 token chains in the pointers' order,
    -1 after a chain's end (a document's end: successors never cross one)."""
    cur = source.next_ids[pointers]  # (m,) the entries whose values come after the pointers' token
    cur = cur[cur >= 0]
    chains = np.full((cur.shape[0], length), -1, dtype=np.int64)  # (m, L)
    for step in range(length):
        alive = cur >= 0  # (m,)
        if not alive.any():
            break
        chains[alive, step] = source.values[cur[alive]]
        cur = np.where(alive, source.next_ids[np.maximum(cur, 0)], -1)  # (m,)
    return chains


def best_draft(chains: np.ndarray, min_agreeing: int = 1) -> tuple[int, ...]:
    """The best-first path through the chains' prefix tree (module docstring): at each depth the token
    most of the still-agreeing chains have (ties: the one of the nearest chain), until fewer than
    `min_agreeing` chains have it."""
    draft: list[int] = []
    rows = np.arange(chains.shape[0])  # (m',) chains agreeing with the draft so far, nearest first
    for step in range(chains.shape[1]):
        tokens = chains[rows, step]  # (m',)
        rows, tokens = rows[tokens >= 0], tokens[tokens >= 0]
        if rows.size == 0:
            break
        uniq, first, counts = np.unique(tokens, return_index=True, return_counts=True)
        best = np.lexsort((first, -counts))[0]  # most chains, then the nearest one's token
        if counts[best] < min_agreeing:
            break
        draft.append(int(uniq[best]))
        rows = rows[tokens == uniq[best]]
    return tuple(draft)


def draft_from(pointers: np.ndarray, source: DraftSource, length: int, min_agreeing: int) -> tuple[int, ...]:
    """The draft the engine verifies after the pointers' token (at most `length` tokens; () when fewer than
    min_agreeing pointers agree on its first token)."""
    return best_draft(draft_chains(pointers, source, length), min_agreeing) if length > 0 else ()


def draft_source(lookup: ProvenanceLookup, values: np.ndarray) -> DraftSource:
    """The DraftSource of a datastore from its provenance lookup (datastore.Datastore.provenance) and its
    (N,) values: successors derived once (memlm.retrieval.pointers.successors), values read into memory."""
    values = np.asarray(values, dtype=np.int32)
    return DraftSource(successors(lookup, values.shape[0]).next_ids, values)
