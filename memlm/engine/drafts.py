"""Draft continuations for speculative decoding: from the datastore (REST, He et al. 2023,
"REST: Retrieval-Based Speculative Decoding"), from the row's own text (prompt lookup decoding), or both
(SpeculativeConfig.draft_from, `--draft-from`).

What is drafted: after a row's token y was chosen at a position whose query key had the neighbours N
(the kNN-LM search of that position, or a search made only to draft when the target is the base LM), the
neighbours whose stored value is y (`matching`) are places in the corpus where a context like the row's
went on with y: the row's pointers. Each one's successor entry (memlm.retrieval.pointers.successors: the
same document at position + 1; a document's end has none, so a draft never crosses a document boundary)
stores the token that followed y there, its successor the next one, and so on: every pointer spells one
draft chain of up to `draft_tokens` tokens (from `chain_starts`). The chains are the candidate drafts; the
engine verifies one per row per step, the best-first path through their prefix tree (`best_draft`): at
each depth the token most chains agree on (ties: the chain of the nearest neighbour), following only the
chains that agree so far (REST's trie, walked greedily). After the step the pointers move along the
tokens that came (`advance`, RetoMaton's walk, Alon et al. 2022): a kNN-LM row takes fresh ones from the
neighbours of its last position (searched anyway) and walks the old ones only when those have none; a
base-LM row searches only when its walked pointers ran out. Why: REST drafts from a datastore of text
instead of a small draft model, and a kNN-LM engine already has the datastore and the neighbours of the
current position, so a draft costs a few array lookups; whether a draft is right is decided only by
verification (memlm.engine.speculative), so any draft keeps the output exact.

From the row's own text (`history_draft`; prompt lookup decoding, Saxena 2023; LLMA, Yang et al. 2023; the
document's own past as a datastore, as in the continuous cache of Grave et al. 2017): the longest suffix of the
row's tokens (boundary, prompt, generated) that occurred before in them, and what followed it there. Why: held-
apart speeches seldom go on as the 1990s speeches did (the datastore's drafts are right for ~1.3 tokens a pass
there), while a small model's greedy text repeats its prompt's phrases and itself. "both" (`RowDrafts.main`) takes the
history's draft when the row's last tokens recur (SpeculativeConfig.history_min_match: then it is often right for
many tokens), else the datastore's.

Shape legend: k neighbours, m matching neighbours (chains), L draft length, N datastore entries.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from memlm.errors import MemlmError
from memlm.retrieval.pointers import ProvenanceLookup, successors
from memlm.retrieval.searcher import Neighbors

BASE_POINTERS = ("search", "suffix")
"""SpeculativeConfig.base_pointers' choices."""
DRAFT_FROM = ("datastore", "history", "both")
"""SpeculativeConfig.draft_from's choices (`--draft-from`)."""
SUFFIX_POINTERS = 256
"""Most pointers a suffix match gives (a frequent token ends thousands of entries; the first ones, in
datastore order, are kept)."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding from the datastore (`memlm generate --speculative [--draft-tokens N]`)."""

    draft_tokens: int = 16
    """Most draft tokens verified per row per step, a draft tree's depth (the forward pass feeds 1 + this many
    tokens, or 1 + tree_nodes for a greedy row's tree; a greedy kNN-LM row searches those up to the first its base
    LM rejects, speculative._lm_path). 16 because a
    history draft of a 3-token match is right for about 10 tokens a pass, while a datastore draft stops by itself
    where fewer than min_agreeing chains agree (about 2.5 tokens) whatever the cap, and on packed weights
    (memlm.model.decoder.PACKED_ROWS) a pass of 17 positions costs about 1.4x one of 1, so the long drafts of a
    row's own loops pay; caps of 15 or 7 measure the same within the noise (benchmarks/speculative_knnlm.py)."""
    draft_k: int = 64
    """Neighbours searched to draft from when the row's target is the base LM (a kNN-LM row drafts from
    the neighbours of its own search, its k)."""
    base_pointers: str = "search"
    """How a base-LM row finds pointers when it has none (after the prompt, or when its walked ones ran
    out): "search" the draft_k neighbours of its last position's key; "suffix" the entries that end
    with the row's last two tokens (REST's exact suffix match, no search; DraftSource.suffix)."""
    draft_from: str = "both"
    """Where drafts come from: "datastore" the neighbours' successors (REST); "history" the row's own text
    (prompt lookup decoding: what followed the latest earlier occurrence of its last tokens,
    `history_draft`); "both" the history's draft when the row's text has a match, else the datastore's.
    "both" because it decodes a greedy kNN-LM row faster than either source alone and a base-LM row about as fast as
    the history alone, and where the continuation is in the datastore (REST's setting) only the datastore drafts it
    (benchmarks/speculative_knnlm.py --draft-from compares them)."""
    history_max_match: int = 3
    """Longest suffix of the row's text looked up in its own past (longer matches are tried first)."""
    history_min_match: int = 2
    """Shortest suffix of the row's text drafted from ahead of the datastore (for up to draft_tokens when it is
    history_max_match long, else short_match_tokens). Why not 1:
    the drafts of a one-token match were right for 1.55 tokens a pass (a 2-token match's for 4.7, a 3-token
    one's for 10.6; greedy kNN-LM over 8 held-apart speeches, draft_tokens 16): shorter matches draft last and
    short (fallback_tokens)."""
    short_match_tokens: int = 4
    """Most tokens a history draft takes from a match shorter than history_max_match (`own_text_draft`; a match
    that long drafts up to draft_tokens). Why: a pass's positions past 8 cost about 7% of a plain step each on
    a CPU whose panel GEMM is bound by its arithmetic there (memlm.model.panel_gemm), and a 2-token match's long
    draft is mostly wrong early (most of its long chains keep only the model's own token). Chosen on the tuning
    split's speeches, never the benchmark's, by replaying recorded greedy kNN-LM runs under timed pass costs
    (benchmarks/speculative_replay.py --pass-costs --short-match-tokens 16,4), then measured on held-apart
    speeches (benchmarks/speculative_knnlm.py)."""
    fallback_tokens: int = 4
    """When a row has no history match of history_min_match tokens and no datastore draft (draft_from "history"
    or "both"), a draft of at most this many tokens from a shorter history match, down to one token; 0: none.
    Why short: a one-token match's draft is right for 0.55 tokens a pass, and a verifying pass's extra
    positions are cheap only for a few of them (memlm.model.decoder.PACKED_ROWS, memlm.model.panel_gemm).
    Replayed over the greedy kNN-LM runs of benchmarks/speculative_knnlm.py's setting
    (benchmarks/speculative_replay.py's rule, 8 held-apart speeches): "both" 2.24 -> 2.28 tokens a pass at the
    same 4.4 draft positions a pass."""
    min_agreeing: int = 3
    """A draft token needs at least this many of the chains agreeing on it; the draft ends before the
    first that has fewer. A token few chains spell is rarely the model's, and a row with no datastore draft takes
    a one-token history match's instead (`RowDrafts.main`), which is right far more often. 3 rather than 2 or 4:
    chosen on the tuning split's speeches, never the benchmark's (benchmarks/speculative_replay.py --pass-costs
    --min-agreeing 2,3,4: the most tokens a pass and the best modelled decode ratio), then measured on held-apart
    speeches side by side (benchmarks/speculative_knnlm.py --min-agreeing 2,3), token-identical either way."""

    tree_nodes: int = 5
    """A greedy row verifies a tree of its candidates (memlm.engine.draft_trees): its main draft, then its other
    candidates' prefixes up to this many nodes in all (a main draft this long or longer is verified alone); 0: the
    main draft alone (a sampled row always). 5 because a verifying pass's first few positions cost little more than one
    (memlm.model.decoder.PACKED_ROWS, memlm.model.panel_gemm) and, with short_match_tokens 4, a main draft of 4 leaves
    a node free; 7 models no better. Chosen on the tuning split's speeches, never the benchmark's, under timed pass
    costs (benchmarks/speculative_replay.py --pass-costs --tree-nodes 3,5,7), then measured on held-apart speeches
    (benchmarks/speculative_knnlm.py --tree-nodes 3,5), token-identical either way."""
    tree_branches: int = 3
    """The datastore's branches a tree takes, each under another first token (draft_trees.datastore_branches)."""
    frequent_branches: int = 3
    """A greedy row's tree with nodes to spare after its other candidates takes up to this many one-token branches:
    the tokens that most often follow the row's last token in the datastore's text (DraftSource.frequent, bigram
    counts; only where drafts read the datastore); 0: none. Why: a row with no history match and no two agreeing
    chains would otherwise draft nothing (about one pass in eight on held-apart speeches), and a tree's spare nodes
    cost little. Chosen on the tuning split by benchmarks/speculative_replay.py's rule under timed pass costs: 3
    branches model better than none, 5 no better than 3, and counts of the last two tokens (the suffix index)
    instead of the last one slightly worse."""

    @property
    def uses_datastore(self) -> bool:
        """Whether drafts read the datastore's successors (so rows keep pointers; a base-LM row searches or
        looks up the suffix index for them)."""
        return self.draft_from != "history"

    def __post_init__(self) -> None:
        if self.draft_tokens < 1:
            raise MemlmError(f"--draft-tokens must be at least 1, got {self.draft_tokens}")
        if self.base_pointers not in BASE_POINTERS:
            raise MemlmError(f"base_pointers must be one of {', '.join(BASE_POINTERS)}, got {self.base_pointers!r}")
        if self.draft_from not in DRAFT_FROM:
            raise MemlmError(f"--draft-from must be one of {', '.join(DRAFT_FROM)}, got {self.draft_from!r}")
        if not 1 <= self.history_min_match <= self.history_max_match:
            raise MemlmError("history matches need 1 <= history_min_match <= history_max_match, got "
                             f"{self.history_min_match}, {self.history_max_match}")
        if self.draft_k < 1 or self.min_agreeing < 1:
            raise MemlmError(f"draft_k and min_agreeing must be at least 1, got {self.draft_k}, {self.min_agreeing}")
        if self.short_match_tokens < 1:
            raise MemlmError(f"short_match_tokens must be at least 1, got {self.short_match_tokens}")
        if self.fallback_tokens < 0:
            raise MemlmError(f"fallback_tokens must be at least 0, got {self.fallback_tokens}")
        if self.frequent_branches < 0:
            raise MemlmError(f"frequent_branches must be at least 0, got {self.frequent_branches}")
        if self.tree_nodes < 0 or self.tree_branches < 1:
            raise MemlmError(f"tree_nodes must be at least 0 and tree_branches at least 1, got {self.tree_nodes}, "
                             f"{self.tree_branches}")


@dataclass(frozen=True)
class DraftSource:
    """What drafting reads from the datastore besides searches (the command line fills it in from
    datastore.Datastore: successors(store.provenance, n).next_ids and store.values)."""

    next_ids: np.ndarray
    """(N,) int64 successor of every entry, -1 at a document's end (memlm.retrieval.pointers.Successors)."""
    values: np.ndarray
    """(N,) int32 stored next token of every entry."""
    suffix: SuffixIndex | None = None
    """The entries by their last two tokens, for SpeculativeConfig.base_pointers "suffix"; None: not built."""
    frequent: FrequentNext | None = None
    """The tokens that most often follow each token, for SpeculativeConfig.frequent_branches; None: not built."""

    def __post_init__(self) -> None:
        n = self.next_ids.shape[0]
        if self.next_ids.ndim != 1 or self.values.shape != (n,):
            raise MemlmError(f"a draft source needs next_ids (N,) and values (N,), got {self.next_ids.shape} "
                             f"and {self.values.shape}")


FREQUENT_KEPT = 8
"""Most frequent next tokens FrequentNext keeps a token (SpeculativeConfig.frequent_branches takes at most these)."""


@dataclass(frozen=True)
class FrequentNext:
    """For each token, the tokens that most often follow it in the datastore's text (an entry's value, then its
    successor's), most frequent first, ties by the smaller token: bigram counts, whose top few a draft tree takes as
    one-token branches (SpeculativeConfig.frequent_branches)."""

    table: np.ndarray
    """(W, FREQUENT_KEPT) int32: row a the tokens after a, -1 past those seen (W = the largest value + 1)."""

    @classmethod
    def build(cls, next_ids: np.ndarray, values: np.ndarray, kept: int = FREQUENT_KEPT) -> FrequentNext:
        has_next = np.flatnonzero(next_ids >= 0)  # (M,)
        width = int(values.max(initial=0)) + 1
        first = values[has_next].astype(np.int64)  # (M,) a token
        after = values[next_ids[has_next]].astype(np.int64)  # (M,) the token after it
        pairs, counts = np.unique(first * width + after, return_counts=True)  # (u,)
        first, after = pairs // width, pairs % width
        order = np.lexsort((after, -counts, first))  # by token, most frequent first, ties by the smaller next
        first, after = first[order], after[order]
        rank = np.arange(first.size) - np.searchsorted(first, first)  # (u,) place among its token's
        keep = rank < kept
        table = np.full((width, kept), -1, dtype=np.int32)
        table[first[keep], rank[keep]] = after[keep]
        return cls(table)

    def after(self, token: int, n: int) -> tuple[int, ...]:
        """The (at most) n tokens that most often follow `token`, most frequent first."""
        if not 0 <= token < self.table.shape[0]:
            return ()
        row = self.table[token, : max(n, 0)]
        return tuple(int(t) for t in row[row >= 0])


@dataclass(frozen=True)
class SuffixIndex:
    """Entries sorted by (their predecessor's value, their value): the entries whose text ends with tokens
    a b are a sorted range (REST's exact match, here of the last two tokens, with one token as fallback)."""

    pair_keys: np.ndarray
    """(N,) int64 sorted (value of the predecessor + 1) * W + value (the predecessor's value is -1 at a
    document's start), W = the largest value + 1."""
    pair_order: np.ndarray
    """(N,) int64 entry ids in pair_keys' order."""
    value_keys: np.ndarray
    """(N,) int64 sorted values."""
    value_order: np.ndarray
    """(N,) int64 entry ids in value_keys' order."""
    width: int
    """W."""

    @classmethod
    def build(cls, next_ids: np.ndarray, values: np.ndarray) -> SuffixIndex:
        has_next = np.flatnonzero(next_ids >= 0)  # (M,)
        prev_value = np.full(values.shape[0], -1, dtype=np.int64)  # (N,)
        prev_value[next_ids[has_next]] = values[has_next]
        width = int(values.max(initial=0)) + 1
        keys = (prev_value + 1) * width + values  # (N,)
        pair_order = np.argsort(keys, kind="stable")
        value_order = np.argsort(values, kind="stable")
        return cls(keys[pair_order], pair_order, values[value_order].astype(np.int64), value_order, width)

    def pointers(self, last_two: list[int]) -> np.ndarray:
        """(m,) entries whose value is last_two[-1] and whose predecessor's is last_two[-2] (when given and
        any such entry exists; else all entries of value last_two[-1]), at most SUFFIX_POINTERS."""
        b = last_two[-1]
        if len(last_two) == 2 and b < self.width and last_two[0] < self.width:
            key = (last_two[0] + 1) * self.width + b
            lo, hi = np.searchsorted(self.pair_keys, [key, key + 1])
            if hi > lo:
                return self.pair_order[lo : min(hi, lo + SUFFIX_POINTERS)]
        lo, hi = np.searchsorted(self.value_keys, [b, b + 1])
        return self.value_order[lo : min(hi, lo + SUFFIX_POINTERS)]


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


def chain_starts(pointers: np.ndarray, source: DraftSource) -> np.ndarray:
    """Where the pointers' chains start: (m,) int64 the successor entries of the pointers, in the pointers' order,
    those at a document's end left out (successors never cross one). Chain i spells the values of its start and of
    the start's successors, up to its document's end."""
    starts = source.next_ids[pointers]  # (m,)
    return starts[starts >= 0]


def best_draft(starts: np.ndarray, source: DraftSource, length: int, min_agreeing: int = 1) -> tuple[int, ...]:
    """The best-first path, at most `length` tokens, through the prefix tree of the chains that begin at `starts`
    (chain_starts; module docstring): at each depth the token most of the still-agreeing chains have (ties: the one
    of the nearest chain), until fewer than `min_agreeing` chains have it. Only the agreeing chains are walked: a
    row has about 140 chains on held-apart speeches, and a draft stops after a few tokens; spelling every chain
    16 deep first would build a draft tree in 342 us against 231 us walking (on recorded held-apart states)."""
    draft: list[int] = []
    entries = starts  # (m',) the agreeing chains' entries at this depth, nearest first
    for _ in range(length):
        entries = entries[entries >= 0]  # chains that ended drop out
        if entries.size == 0:
            break
        tokens = source.values[entries]  # (m',)
        token = int(tokens[0])
        if not (tokens == token).all():  # else every chain agrees (the common case past the first token)
            uniq, first, counts = np.unique(tokens, return_index=True, return_counts=True)
            token = int(uniq[np.lexsort((first, -counts))[0]])  # most chains, then the nearest one's token
        agreeing = tokens == token  # (m',)
        if agreeing.sum() < min_agreeing:
            break
        draft.append(token)
        entries = source.next_ids[entries[agreeing]]  # (m'',) their next entries, -1 at an end
    return tuple(draft)


def history_draft(text: Sequence[int], length: int, max_match: int, min_match: int) -> tuple[tuple[int, ...], int]:
    """Prompt lookup decoding (Saxena 2023; LLMA, Yang et al. 2023; the document's own past as a datastore,
    as the continuous cache of Grave et al. 2017): the longest suffix of `text` (max_match down to min_match
    tokens) that also occurs earlier in it, and the tokens that followed its latest earlier occurrence, at
    most `length`. Returns (draft, the match's length); ((), 0) when no suffix recurs.

    The latest occurrence, not the first: a small greedy model that repeats itself repeats its latest
    phrase. When the continuation runs into the suffix itself (the text has period P = the distance between
    the two occurrences, shorter than the draft), the draft goes on with that period: tokens
    text[s + n + (i mod P)], the text's own continuation if the period holds."""
    if min_match < 1:
        raise ValueError(f"a history match is at least 1 token long, got min_match {min_match}")
    if length < 1 or len(text) < 2:
        return (), 0
    arr = np.asarray(text, dtype=np.int64)  # (L,)
    L = arr.shape[0]
    # Where the last token occurred before (each a possible end of an earlier occurrence), latest first: a few
    # places, checked for the longer suffixes one by one (one comparison over the text instead of one per length).
    ends = np.flatnonzero(arr[:-1] == arr[-1])[::-1].tolist()  # (h,)
    for n in range(min(max_match, L - 1), min_match - 1, -1):
        for end in ends:
            start = end - n + 1  # the earlier occurrence is arr[start : end + 1]
            if start >= 0 and all(text[start + j] == text[L - n + j] for j in range(n - 1)):
                after, period = end + 1, L - end - 1  # its next token (<= L - 1); the text's period
                return tuple(arr[after + np.arange(length) % period].tolist()), n
    return (), 0


def own_text_draft(text: Sequence[int], length: int, spec: SpeculativeConfig) -> tuple[int, ...]:
    """The history's draft of at most `length` tokens (`history_draft` over spec's history_max_match ..
    history_min_match), cut to spec.short_match_tokens when its match is shorter than history_max_match."""
    draft, match = history_draft(text, length, spec.history_max_match, spec.history_min_match)
    return draft if match >= spec.history_max_match else draft[: spec.short_match_tokens]


class RowDrafts:
    """A row's drafts after its `text` for one verifying pass, each made once, when first read: its main draft
    (`main`) and a draft tree's other candidates (memlm.engine.draft_trees) read the same
    history match and datastore chains."""

    def __init__(self, text: Sequence[int], pointers: np.ndarray, source: DraftSource, length: int,
                 spec: SpeculativeConfig) -> None:
        self.text, self.pointers, self.source, self.length, self.spec = text, pointers, source, length, spec

    @functools.cached_property
    def history(self) -> tuple[int, ...]:
        """The history's draft (own_text_draft)."""
        return own_text_draft(self.text, self.length, self.spec)

    @functools.cached_property
    def starts(self) -> np.ndarray:
        """(m,) where the pointers' chains start (chain_starts)."""
        return chain_starts(self.pointers, self.source)

    @functools.cached_property
    def stored(self) -> tuple[int, ...]:
        """The datastore's draft: the best-first path through the chains (best_draft); () when fewer than
        min_agreeing chains agree on its first token."""
        return best_draft(self.starts, self.source, self.length, self.spec.min_agreeing)

    @functools.cached_property
    def fallback(self) -> tuple[int, ...]:
        """The short draft of a history match shorter than history_min_match (SpeculativeConfig.fallback_tokens);
        () where there is none to take."""
        spec = self.spec
        if spec.fallback_tokens == 0 or spec.history_min_match == 1:
            return ()
        return history_draft(self.text, min(self.length, spec.fallback_tokens), spec.history_min_match - 1, 1)[0]

    @property
    def main(self) -> tuple[int, ...]:
        """The draft the row verifies: the history's (a match of history_min_match tokens or more), else the
        datastore's, else the fallback (draft_from "datastore": the datastore's alone; "history": no datastore)."""
        if self.length < 1:
            return ()
        if self.spec.draft_from == "datastore":
            return self.stored
        if self.history:
            return self.history
        if self.spec.draft_from == "both" and self.stored:
            return self.stored
        return self.fallback


def draft_source(lookup: ProvenanceLookup, values: np.ndarray) -> DraftSource:
    """The DraftSource of a datastore from its provenance lookup (datastore.Datastore.provenance) and its
    (N,) values: successors derived once (memlm.retrieval.pointers.successors), values read into memory,
    the suffix index built."""
    return draft_source_of(successors(lookup, len(values)).next_ids, values)


def draft_source_of(next_ids: np.ndarray, values: np.ndarray) -> DraftSource:
    """The DraftSource of a successors table next_ids (N,) (memlm.retrieval.pointers.successors) and values (N,)."""
    values = np.asarray(values, dtype=np.int32)  # (N,)
    return DraftSource(next_ids, values, SuffixIndex.build(next_ids, values), FrequentNext.build(next_ids, values))
