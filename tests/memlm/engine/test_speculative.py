"""Speculative decoding from the datastore: greedy speculative generation is token-
identical to plain greedy generation (kNN-LM, and the base LM drafting from the datastore), inside a
continuous batch with plain rows joining and leaving, with stops and max_new_tokens inside drafts.

The datastore is the tiny model's own greedy text, so drafts are often right (REST's setting: the
continuation is in the datastore) and the prompts are cut from it or unrelated.

Shape legend: N datastore entries, k neighbours.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch
from tiny_models import own_text_datastore, phrase_documents, sharp_tiny_model

from memlm.engine.drafts import (
    DraftSource,
    SpeculativeConfig,
    SuffixIndex,
    advance,
    best_draft,
    chain_starts,
    matching,
)
from memlm.engine.engine import Engine, run_all
from memlm.engine.requests import EngineConfig, GenerationRequest
from memlm.engine.rows import Row
from memlm.errors import MemlmError
from memlm.jobs.decoding import GenerationEnd, SamplingConfig, TokenEvent
from memlm.model.memory_config import MemoryConfig
from memlm.model.tokenizer import Tokenizer, document_boundary
from memlm.retrieval.knnlm import KNNLMConfig
from memlm.retrieval.searcher import Neighbors

TOK = Tokenizer.byte_level()
BOUNDARY = document_boundary(TOK)
GREEDY = SamplingConfig(temperature=0.0)
KNN = KNNLMConfig(k=8, lmbda=0.5, temperature=5.0)
KNN_LOW = KNNLMConfig(k=8, lmbda=0.1, temperature=5.0)
"""The demo's tuned lambda (speculative._cut's setting: the neighbours seldom lift a token the LM rejects)."""
SPEC = SpeculativeConfig(draft_tokens=6, draft_k=16, min_agreeing=1)
"""Drafts from the tiny datastore's few neighbours (k 8): one chain is enough to draft."""
SEEDS = ["the cat sat", "once upon a time", "in the beginning", "hello world", "a b c d", "memory lane"]


def tokens(events) -> list[int]:
    return [e.token_id for e in events if isinstance(e, TokenEvent)]


@pytest.fixture(scope="module")
def setting():
    """The model, its own greedy texts as a datastore (searcher, drafts), and those texts."""
    model = sharp_tiny_model()
    reqs = [GenerationRequest(tuple(TOK.encode(p)), 48, GREEDY, boundary_token=BOUNDARY) for p in SEEDS]
    docs = [[BOUNDARY, *r.prompt_ids, *tokens(ev)] for r, ev in zip(reqs, run_all(Engine(model, TOK), reqs))]
    searcher, drafts = own_text_datastore(model, docs)
    return model, searcher, drafts, docs


def prompts(docs: list[list[int]], n: int, seed: int = 0) -> list[tuple[int, ...]]:
    """n prompts: cuts of the datastore's texts (inside their prompts or continuations) and unrelated ones."""
    rng = random.Random(seed)
    out = [tuple(TOK.encode(p)) for p in ("xyz", "the dog sat", "upon", "zebra crossing")]
    while len(out) < n:
        doc = rng.choice(docs)
        out.append(tuple(doc[1 : rng.randrange(3, len(doc) - 8)]))
    return out


def engine(setting, max_batch: int = 4, **config) -> Engine:
    model, searcher, drafts, _ = setting
    return Engine(model, TOK, EngineConfig(max_batch=max_batch, **config), searcher, drafts)


@pytest.mark.parametrize(("knn", "base_pointers", "draft_from"),
                         [(KNN, "search", "datastore"), (KNN_LOW, "search", "datastore"), (None, "search", "datastore"),
                          (None, "suffix", "datastore"), (KNN, "search", "history"), (KNN_LOW, "search", "history"),
                          (None, "search", "history"), (KNN, "search", "both"), (KNN_LOW, "search", "both"),
                          (None, "search", "both")],
                         ids=["knnlm", "knnlm-cut", "base-drafting", "base-drafting-by-suffix", "knnlm-history",
                              "knnlm-cut-history", "base-history", "knnlm-both", "knnlm-cut-both", "base-both"])
def test_greedy_speculative_is_token_identical_over_many_prompts(setting, knn, base_pointers, draft_from) -> None:
    plain = [GenerationRequest(p, 24 + i % 7, GREEDY, boundary_token=BOUNDARY, knn=knn)
             for i, p in enumerate(prompts(setting[3], 24))]
    config = dataclasses.replace(SPEC, base_pointers=base_pointers, draft_from=draft_from)
    spec = [dataclasses.replace(r, speculative=config) for r in plain]
    want = run_all(engine(setting), plain)
    got = run_all(engine(setting), spec)
    for w, g in zip(want, got):
        assert tokens(g) == tokens(w)
        assert [e.logprob for e in g[:-1]] == pytest.approx([e.logprob for e in w[:-1]], abs=1e-4)
        assert dataclasses.replace(g[-1], searches=0, verify_steps=0, verified_tokens=0) == \
            dataclasses.replace(w[-1], searches=0)
    ends = [g[-1] for g in got]
    assert all(e.mean_accepted_tokens >= 1 for e in ends)
    # Drafts are taken: cuts of the datastore's texts go on as the texts do, several tokens a pass. The tiny
    # random model's text seldom repeats itself, so history drafts are mostly rejected (the rejection path),
    # and some are accepted (the acceptance path: more tokens than passes).
    steps = sum(e.verify_steps for e in ends)
    assert sum(e.verified_tokens for e in ends) / steps > (2.0 if draft_from == "datastore" else 1.0)
    assert all(e.verified_tokens == e.completion_tokens - 1 for e in ends)  # all but the first (no slide here)
    if knn is not None:  # plain kNN-LM searches once a token; speculative once a fed position
        assert [w[-1].searches for w in want] == [w[-1].completion_tokens for w in want]
        assert all(e.searches >= e.completion_tokens for e in ends)
    elif base_pointers == "suffix" or draft_from == "history":
        assert all(e.searches == 0 for e in ends)  # drafts without a search
    else:
        assert all(w[-1].searches == 0 for w in want)
        # one search after the prompt, then only when a row's pointers ran out: at most one a pass
        assert all(0 < e.searches <= 1 + e.verify_steps for e in ends)


def test_inside_a_continuous_batch_with_plain_rows_joining_and_leaving(setting) -> None:
    """Speculative rows (each draft source) and plain rows (kNN-LM and base, different lengths) submitted at
    different steps into a batch of 3: each yields exactly its tokens alone (plain greedy)."""
    ps = prompts(setting[3], 12, seed=1)
    sources = [dataclasses.replace(SPEC, draft_from=f) for f in ("datastore", "history", "both")]
    reqs = [GenerationRequest(p, 6 + 5 * (i % 4), GREEDY, boundary_token=BOUNDARY, knn=KNN if i % 3 else None,
                              speculative=sources[i // 2 % 3] if i % 2 else None) for i, p in enumerate(ps)]
    eng = engine(setting, max_batch=3, prefill_chunk=7)
    handles, results, pending = [], {}, list(enumerate(reqs))
    while pending or eng.busy:
        if pending:  # one joins every other step
            i, r = pending.pop(0)
            handles.append((i, eng.submit(r)))
        eng.step()
        eng.step()
        for i, h in handles:
            results.setdefault(i, []).extend(h.ready())
    for i, r in enumerate(reqs):
        alone = run_all(engine(setting, max_batch=1), [dataclasses.replace(r, speculative=None)])[0]
        assert tokens(results[i]) == tokens(alone), i
        assert isinstance(results[i][-1], GenerationEnd) and results[i][-1].reason == alone[-1].reason


def test_stops_eos_and_max_new_tokens_inside_a_draft(setting) -> None:
    """A cut of a text whose continuation is drafted many tokens at a time: a stop string, a token-id stop,
    eos and max_new_tokens that fall inside an accepted draft end generation exactly where plain decoding
    does, with the same events."""
    doc = setting[3][1]
    prompt = tuple(doc[1:20])
    base = GenerationRequest(prompt, 30, GREEDY, boundary_token=BOUNDARY, knn=KNN)
    full = tokens(run_all(engine(setting), [base])[0])
    text = TOK.decode(full)
    variants = [dataclasses.replace(base, max_new_tokens=n) for n in (1, 2, 3, 5, 9)]
    variants += [dataclasses.replace(base, stop_sequences=(text[4:7],)),
                 dataclasses.replace(base, stop_sequences=(tuple(full[6:8]),)),
                 dataclasses.replace(base, eos_id=full[10])]
    for r in variants:
        want = run_all(engine(setting), [r])[0]
        got = run_all(engine(setting), [dataclasses.replace(r, speculative=SPEC)])[0]
        assert tokens(got) == tokens(want) and len(tokens(got)) < 30
        assert [e.text_delta for e in got] == [e.text_delta for e in want]
        end = got[-1]
        assert dataclasses.replace(end, searches=0, verify_steps=0, verified_tokens=0) == \
            dataclasses.replace(want[-1], searches=0)
        # Every completion token but the first came from a verifying pass; an eos ending it is not counted.
        assert end.verified_tokens == end.completion_tokens - 1, r
    long = run_all(engine(setting), [dataclasses.replace(base, speculative=SPEC)])[0][-1]
    assert long.mean_accepted_tokens > 2  # so the cuts above did fall inside drafts


def test_a_row_that_fills_its_cache_slides_as_plain_decoding_does(setting, monkeypatch) -> None:
    """row_capacity 24: drafts are cut so a pass never runs past the row, and the slide comes after the
    same token as in plain decoding; the token after each slide is a plain step's (not a verified one)."""
    doc = setting[3][2]
    r = GenerationRequest(tuple(doc[1:12]), 40, GREEDY, boundary_token=BOUNDARY, knn=KNN)
    want = run_all(engine(setting, row_capacity=24), [r])[0]
    slides = []
    slide = Row.slide
    monkeypatch.setattr(Row, "slide", lambda row, keep: (slides.append(keep), slide(row, keep))[1])
    got = run_all(engine(setting, row_capacity=24), [dataclasses.replace(r, speculative=SPEC)])[0]
    assert tokens(got) == tokens(want) and len(tokens(got)) == 40
    assert len(slides) > 0 and got[-1].verified_tokens == 40 - 1 - len(slides) and got[-1].verify_steps > 0


def test_drafts_follow_successors_best_first_and_never_cross_a_document() -> None:
    # entries: doc A = tokens 5 6 7 8 (ids 0-3), doc B = 5 6 9 (ids 4-6); successors within a document
    values = np.array([5, 6, 7, 8, 5, 6, 9], dtype=np.int32)
    next_ids = np.array([1, 2, 3, -1, 5, 6, -1], dtype=np.int64)
    source = DraftSource(next_ids, values)
    nb = Neighbors(np.array([[0.1, 0.2, 0.3, 0.4]], np.float32), np.array([[4, 0, 2, -1]]),
                   np.array([[5, 5, 7, -1]], np.int32))
    pointers = matching(nb, 5)
    assert pointers.tolist() == [4, 0]  # the neighbours of value 5, nearest first
    starts = chain_starts(pointers, source)
    assert starts.tolist() == [5, 1] and spelled_chains(starts, source, 4).tolist() == [[6, 9, -1, -1], [6, 7, 8, -1]]
    assert best_draft(starts, source, 4) == (6, 9)  # each chain stops at its document's end; a tie at depth 2: the
    assert best_draft(starts, source, 4, min_agreeing=2) == (6,)  # nearest chain's token; one chain alone: no draft
    assert best_draft(starts, source, 1) == (6,) and best_draft(starts, source, 0) == ()
    assert best_draft(starts, source, 4, 2) == (6,) and best_draft(starts, source, 4, 3) == ()
    assert best_draft(chain_starts(matching(nb, 8), source), source, 4, 1) == ()  # 8 ends its document
    assert best_draft(starts, source, 0, 1) == ()
    assert advance(pointers, [6, 7], source).tolist() == [2]  # only doc A went on with 6 7
    assert advance(pointers, [6, 7, 8], source).tolist() == [3] and advance(pointers, [6, 7, 8, 1], source).size == 0
    index = SuffixIndex.build(next_ids, values)
    assert index.pointers([5, 6]).tolist() == [1, 5] and index.pointers([7, 8]).tolist() == [3]
    assert index.pointers([9, 6]).tolist() == [1, 5]  # no entry ends with 9 6: those ending with 6
    assert index.pointers([6]).tolist() == [1, 5] and index.pointers([5]).tolist() == [0, 4]
    assert index.pointers([3, 5]).tolist() == [0, 4]  # a document's first entry has no predecessor
    # chains 6 7 | 6 9 1 | 6 9 2 (ids 0-1, 2-4, 5-7): most chains agree on 9, then the nearest one's 1
    three = DraftSource(np.array([1, -1, 3, 4, -1, 6, 7, -1]), np.array([6, 7, 6, 9, 1, 6, 9, 2], dtype=np.int32))
    assert best_draft(np.array([0, 2, 5]), three, 3) == (6, 9, 1)


def spelled_chains(starts: np.ndarray, source: DraftSource, length: int) -> np.ndarray:
    """The oracle's chains: (m, L) the tokens each chain spells from its start, -1 after its document's end."""
    chains = np.full((starts.shape[0], length), -1, dtype=np.int64)  # (m, L)
    for i, entry in enumerate(starts.tolist()):
        for step in range(length):
            if entry < 0:
                break
            chains[i, step] = source.values[entry]
            entry = int(source.next_ids[entry])
    return chains


def oracle_best_draft(chains: np.ndarray, min_agreeing: int) -> tuple[int, ...]:
    """The best-first rule over spelled chains, written out plainly: at each depth the token most agreeing chains
    have, ties to the nearest (first) chain's, while at least min_agreeing chains have it."""
    draft: list[int] = []
    rows = list(range(chains.shape[0]))
    for step in range(chains.shape[1]):
        rows = [r for r in rows if chains[r, step] >= 0]
        counts: dict[int, int] = {}
        for r in rows:
            counts[int(chains[r, step])] = counts.get(int(chains[r, step]), 0) + 1
        if not counts:
            break
        token = max(counts, key=lambda t: (counts[t], -next(i for i, r in enumerate(rows) if chains[r, step] == t)))
        if counts[token] < min_agreeing:
            break
        draft.append(token)
        rows = [r for r in rows if chains[r, step] == token]
    return tuple(draft)


@pytest.mark.parametrize("seed", range(4))
def test_drafts_walk_only_the_agreeing_chains_and_equal_the_best_first_rule_over_spelled_chains(seed: int) -> None:
    """best_draft and the tree's datastore branches walk the agreeing chains' entries only; they equal the rule over
    every chain spelled out first (the oracle), on a random datastore of short documents over a few tokens (many
    ties and agreements) and pointers with repeats."""
    from memlm.engine.draft_trees import datastore_branches

    rng = np.random.default_rng(seed)
    values = rng.integers(0, 4, size=300).astype(np.int32)  # (N,)
    ends = np.sort(rng.choice(np.arange(1, 300), size=40, replace=False))
    next_ids = np.arange(1, 301, dtype=np.int64)  # (N,)
    next_ids[ends - 1] = -1  # each document's last entry
    next_ids[-1] = -1
    source = DraftSource(next_ids, values)
    for _ in range(25):
        pointers = rng.integers(0, 300, size=int(rng.integers(0, 30)))
        starts = chain_starts(pointers, source)
        assert starts.tolist() == [int(next_ids[p]) for p in pointers if next_ids[p] >= 0]
        length, agreeing = int(rng.integers(1, 7)), int(rng.integers(1, 4))
        chains = spelled_chains(starts, source, length)
        assert best_draft(starts, source, length, agreeing) == oracle_best_draft(chains, agreeing)
        first = chains[:, 0].tolist()
        by_count = sorted(set(first), key=lambda t: (-first.count(t), t))[:3]  # ties: the smaller token
        want = [oracle_best_draft(chains[chains[:, 0] == t], agreeing) for t in by_count if first.count(t) >= agreeing]
        assert datastore_branches(starts, source, length, 3, agreeing) == [d for d in want if d]


@pytest.mark.parametrize("knn", [KNN, None], ids=["knnlm-searcher-only", "base-no-datastore"])
def test_history_drafts_need_no_datastore_in_the_engine(setting, knn) -> None:
    """--draft-from history reads only the row's own text: an engine without the datastore's draft source (a base
    LM with no datastore, or kNN-LM through a searcher alone, e.g. a retrieval service) serves it, token-identical
    to plain greedy decoding; the datastore's drafts are still refused there."""
    model, searcher, _, docs = setting
    repeating = [tuple(TOK.encode("the cat sat on the mat. the cat sat on the mat. the cat"))]
    plain = [GenerationRequest(p, 24 + i % 5, GREEDY, boundary_token=BOUNDARY, knn=knn)
             for i, p in enumerate([*repeating, *prompts(docs, 8, seed=3)])]
    history = dataclasses.replace(SPEC, draft_from="history")
    engine_searcher = searcher if knn is not None else None
    want = run_all(Engine(model, TOK, EngineConfig(max_batch=4), engine_searcher), plain)
    got = run_all(Engine(model, TOK, EngineConfig(max_batch=4), engine_searcher),
                  [dataclasses.replace(r, speculative=history) for r in plain])
    for w, g in zip(want, got):
        assert tokens(g) == tokens(w)
    assert all(g[-1].verify_steps > 0 for g in got)
    assert sum(g[-1].verified_tokens for g in got) > sum(g[-1].verify_steps for g in got)  # drafts were taken
    with pytest.raises(MemlmError, match="drafts from a datastore"):
        Engine(model, TOK, EngineConfig(), engine_searcher).submit(dataclasses.replace(plain[0], speculative=SPEC))


def test_refused_without_a_datastore_or_with_the_xl_memory(setting) -> None:
    model, searcher, drafts, _ = setting
    r = GenerationRequest((65, 66), 4, GREEDY, boundary_token=BOUNDARY, speculative=SPEC)
    with pytest.raises(MemlmError, match="drafts from a datastore"):
        Engine(model, TOK).submit(r)
    xl = EngineConfig(memory=MemoryConfig(kind="xl", segment=8, mem_len=16))
    with pytest.raises(MemlmError, match="not --memory xl"):
        Engine(model, TOK, xl, searcher, drafts).submit(r)
    with pytest.raises(MemlmError, match="--draft-tokens"):
        SpeculativeConfig(draft_tokens=0)
    with pytest.raises(MemlmError, match="min_agreeing"):
        SpeculativeConfig(min_agreeing=0)
    with pytest.raises(MemlmError, match="base_pointers"):
        SpeculativeConfig(base_pointers="ngram")


@pytest.mark.parametrize("knn", [KNN, None], ids=["knnlm", "base-drafting"])
def test_greedy_speculative_is_token_identical_in_bfloat16(knn) -> None:
    """bfloat16 (the GPU default): a decode step attends in float32, so the verification pass must too (before
    it did, 1 of 24 kNN-LM rows and 7 of 24 base rows parted from plain greedy decoding)."""
    model = sharp_tiny_model().to(torch.bfloat16)
    reqs = [GenerationRequest(tuple(TOK.encode(p)), 48, GREEDY, boundary_token=BOUNDARY) for p in SEEDS]
    docs = [[BOUNDARY, *r.prompt_ids, *tokens(ev)] for r, ev in zip(reqs, run_all(Engine(model, TOK), reqs))]
    bf16 = (model, *own_text_datastore(model, docs), docs)
    plain = [GenerationRequest(p, 24 + i % 7, GREEDY, boundary_token=BOUNDARY, knn=knn)
             for i, p in enumerate(prompts(docs, 24))]
    want = run_all(engine(bf16), plain)
    got = run_all(engine(bf16), [dataclasses.replace(r, speculative=SPEC) for r in plain])
    assert [tokens(g) for g in got] == [tokens(w) for w in want]
    assert sum(g[-1].mean_accepted_tokens for g in got) / len(got) > 1.5  # drafts were verified and taken


def test_greedy_kNN_search_stops_at_the_first_token_the_lm_rejects() -> None:
    """speculative._lm_path: a greedy kNN-LM row searches from `start` along its base LM's argmax through the draft
    (a chain here) up to its first draft token that is not the base LM's argmax (that position included: it still
    chooses a token), or to the draft's end. (That the output stays exact when the neighbours lift such a token is
    the identity tests' part: KNN at lambda 0.5 follows its datastore where the tiny LM does not,
    test_history_drafts_of_a_repeating_text.)"""
    from memlm.engine.draft_trees import chain, children
    from memlm.engine.speculative import _lm_path

    rng = random.Random(0)
    stops = set()
    for _ in range(300):
        best = [rng.randrange(4) for _ in range(5)]  # (1+n,) the LM's argmax per position, n = 4
        draft = tuple(t if rng.random() < 0.7 else rng.randrange(4) for t in best[:4])
        start = rng.randrange(5)
        want = next((i for i in range(start, 4) if draft[i] != best[i]), 4)
        assert _lm_path(children(chain(draft)), dict(enumerate(best)), start) == list(range(start, want + 1))
        stops.add(want)
    assert stops == {0, 1, 2, 3, 4} and _lm_path(children(chain(())), {0: 1}, 0) == [0]


class FailingAfter:
    """A searcher whose searches fail from the n-th call on (a retrieval service going down)."""

    def __init__(self, inner, n: int) -> None:
        self.inner, self.n, self.calls = inner, n, 0

    @property
    def dim(self) -> int:
        return self.inner.dim

    def info(self):
        return self.inner.info()

    def search(self, xq, k, options=None):
        self.calls += 1
        if self.calls >= self.n:
            raise MemlmError("retrieval service unavailable")
        return self.inner.search(xq, k, options)


def test_a_failed_search_ends_the_speculative_knn_rows_only(setting) -> None:
    """The step's one search fails: speculative kNN-LM rows end with its error; a plain base row and a
    speculative base row (its draft search failed: it goes on without a draft) make their tokens alone."""
    model, searcher, drafts, docs = setting
    p = tuple(docs[0][1:12])
    base = GenerationRequest(p, 16, GREEDY, boundary_token=BOUNDARY)
    reqs = [dataclasses.replace(base, knn=KNN, speculative=SPEC), base, dataclasses.replace(base, speculative=SPEC)]
    eng = Engine(model, TOK, EngineConfig(max_batch=3), FailingAfter(searcher, 3), drafts)
    handles = [eng.submit(r) for r in reqs]
    with pytest.raises(MemlmError, match="unavailable"):
        list(handles[0].events())
    alone = tokens(run_all(engine(setting, max_batch=1), [base])[0])
    assert tokens(list(handles[1].events())) == alone and tokens(list(handles[2].events())) == alone


def _history_oracle(text: list[int], length: int, max_match: int, min_match: int) -> tuple[tuple[int, ...], int]:
    """history_draft by brute force: for n = max_match .. min_match, the last start s < len - n with
    text[s:s+n] == text[-n:]; then text, extended by itself, read from s + n (the text's continuation as if it
    went on the way it went on after s: token i is the one after text[s + n + i - 1] at the same distance)."""
    for n in range(min(max_match, len(text) - 1), min_match - 1, -1):
        starts = [s for s in range(len(text) - n) if text[s : s + n] == text[len(text) - n :]]
        if starts:
            out = list(text)
            after = starts[-1] + n
            for i in range(length):  # copy forwards: the continuation repeats what followed the occurrence
                out.append(out[after + i])
            return tuple(out[len(text) :]), n
    return (), 0


def test_history_draft_is_the_continuation_of_the_latest_earlier_match() -> None:
    from memlm.engine.drafts import history_draft

    # The longest suffix that recurs wins; its latest earlier occurrence's continuation is drafted.
    text = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert history_draft(text, 4, 3, 1) == ((7, 8, 5, 2), 2)  # "2 3" last at 6..7; 3-token suffix "5 2 3" absent
    assert history_draft(text, 2, 1, 1) == ((7, 8), 1)  # "3" alone: latest earlier occurrence at 7
    assert history_draft(text, 4, 3, 3) == ((), 0)  # no 3-token match
    assert history_draft([4, 5, 6, 4, 5], 5, 2, 1) == ((6, 4, 5, 6, 4), 2)  # period 3 goes on past the text's end
    assert history_draft([7, 7, 7], 3, 3, 1) == ((7, 7, 7), 2)
    assert history_draft([1, 2], 3, 2, 1) == ((), 0) and history_draft([5], 3, 2, 1) == ((), 0)
    assert history_draft(text, 0, 3, 1) == ((), 0)
    rng = random.Random(0)
    for _ in range(500):  # against brute force over small alphabets (many repeats)
        seq = [rng.randrange(rng.choice([2, 3, 5])) for _ in range(rng.randrange(1, 40))]
        length, mx = rng.randrange(1, 9), rng.randrange(1, 5)
        mn = rng.randrange(1, mx + 1)
        assert history_draft(seq, length, mx, mn) == _history_oracle(seq, length, mx, mn), (seq, length, mx, mn)


def test_main_draft_takes_the_history_then_the_datastore() -> None:
    from memlm.engine.drafts import RowDrafts

    values = np.array([5, 6, 7, 8], dtype=np.int32)
    source = DraftSource(np.array([1, 2, 3, -1]), values)
    pointers = np.array([0])  # after token 5: the datastore drafts 6 7 8
    spec = SpeculativeConfig(min_agreeing=1, draft_from="datastore", fallback_tokens=0)
    two = [1, 3, 4, 1, 3]  # "1 3" recurs: the history drafts 4 1 3 (a 2-token match)
    one = [2, 3, 4, 1, 3]  # only "3" recurs: 4 1 3 from a 1-token match, below history_min_match 2
    history = dataclasses.replace(spec, draft_from="history")
    both = dataclasses.replace(spec, draft_from="both")
    assert RowDrafts(two, pointers, source, 3, spec).main == (6, 7, 8)  # draft_from "datastore"
    assert RowDrafts(two, pointers, source, 3, history).main == (4, 1, 3)
    assert RowDrafts(one, pointers, source, 3, history).main == ()
    assert RowDrafts(one, pointers, source, 3, dataclasses.replace(history, history_min_match=1)).main == (4, 1, 3)
    assert RowDrafts(two, pointers, source, 3, both).main == (4, 1, 3)  # a history match goes first
    assert RowDrafts(one, pointers, source, 3, both).main == (6, 7, 8)  # none: the datastore's
    assert RowDrafts(one, pointers[:0], source, 3, both).main == ()
    assert RowDrafts(two, pointers, source, 2, both).main == (4, 1)
    assert RowDrafts(two, pointers, source, 0, both).main == ()
    # Last, a short draft from a shorter history match (fallback_tokens), after the datastore's.
    assert RowDrafts(one, pointers, source, 3, dataclasses.replace(history, fallback_tokens=2)).main == (4, 1)
    assert RowDrafts(one, pointers, source, 3, dataclasses.replace(both, fallback_tokens=2)).main == (6, 7, 8)
    assert RowDrafts(one, pointers[:0], source, 3, dataclasses.replace(both, fallback_tokens=2)).main == (4, 1)
    assert RowDrafts(one, pointers[:0], source, 1, dataclasses.replace(both, fallback_tokens=2)).main == (4,)
    assert RowDrafts(one, pointers, source, 3, dataclasses.replace(spec, fallback_tokens=2)).main == (6, 7, 8)
    assert RowDrafts([2, 3, 4, 1, 5], pointers[:0], source, 3, dataclasses.replace(both, fallback_tokens=2)).main == ()
    with pytest.raises(MemlmError, match="fallback_tokens"):
        SpeculativeConfig(fallback_tokens=-1)
    with pytest.raises(MemlmError, match="--draft-from"):
        SpeculativeConfig(draft_from="ngram")
    with pytest.raises(MemlmError, match="history_min_match"):
        SpeculativeConfig(history_min_match=3, history_max_match=2)


def test_a_shorter_history_match_drafts_at_most_short_match_tokens() -> None:
    """own_text_draft: a match of history_max_match tokens drafts up to the length asked; a shorter one at most
    short_match_tokens; a row's main draft and its tree take it so."""
    from memlm.engine.draft_trees import row_tree
    from memlm.engine.drafts import RowDrafts, own_text_draft

    three = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]  # "1 2 3" recurs: 4 5 6 7 1 2 3 ... (period 7)
    two = [9, 2, 3, 4, 5, 6, 7, 1, 2, 3]  # only "2 3" recurs: a 2-token match, the same continuation
    spec = SpeculativeConfig(draft_from="history", short_match_tokens=2, tree_nodes=0)
    assert own_text_draft(three, 6, spec) == (4, 5, 6, 7, 1, 2)
    assert own_text_draft(two, 6, spec) == (4, 5)
    assert own_text_draft(two, 1, spec) == (4,)
    assert own_text_draft(two, 6, dataclasses.replace(spec, short_match_tokens=16)) == (4, 5, 6, 7, 1, 2)
    assert own_text_draft(two, 6, dataclasses.replace(spec, history_max_match=2)) == (4, 5, 6, 7, 1, 2)  # full length
    source = DraftSource(np.array([-1]), np.array([0], dtype=np.int32))
    assert RowDrafts(two, np.zeros(0, np.int64), source, 6, spec).main == (4, 5)
    tree = row_tree(two, np.zeros(0, np.int64), source, 6, dataclasses.replace(spec, tree_nodes=5), True, 6)
    assert tree.tokens[:2] == (4, 5) and len(tree.tokens) <= 5
    with pytest.raises(MemlmError, match="short_match_tokens"):
        SpeculativeConfig(short_match_tokens=0)


@pytest.mark.parametrize("draft_from", ["history", "both"])
def test_history_drafts_of_a_repeating_text_are_taken_and_never_run_past_the_row(draft_from) -> None:
    """kNN-LM over a datastore of phrase-repeating documents goes on repeating the prompt's phrase, which the
    row's own text then drafts (prompt lookup): the continuation is the document's, several tokens a pass,
    token for token plain greedy's, and a max_new_tokens or a stop inside a history draft ends it where
    plain decoding does (the draft is cut at max_new_tokens: every completion token but the first verified)."""
    model = sharp_tiny_model()
    docs = [[BOUNDARY, *d] for d in phrase_documents(6, 60)]
    searcher, drafts = own_text_datastore(model, docs)
    spec = dataclasses.replace(SPEC, draft_from=draft_from)
    eng = Engine(model, TOK, EngineConfig(max_batch=4), searcher, drafts)
    plain = [GenerationRequest(tuple(d[1:30]), 30, GREEDY, boundary_token=BOUNDARY, knn=KNN) for d in docs]
    want = run_all(eng, plain)
    got = run_all(eng, [dataclasses.replace(r, speculative=spec) for r in plain])
    assert [tokens(g) for g in got] == [tokens(w) for w in want] == [d[30:60] for d in docs]
    ends = [g[-1] for g in got]
    assert sum(e.verified_tokens for e in ends) / sum(e.verify_steps for e in ends) > 4
    assert [e.searches for e in ends] == [e.completion_tokens for e in ends]  # right drafts: one search a token
    cut = [dataclasses.replace(plain[0], max_new_tokens=n) for n in (1, 2, 3, 5, 9, 14)]
    cut.append(dataclasses.replace(plain[0], stop_sequences=(TOK.decode(docs[0][36:38]),)))
    for r in cut:
        w, g = run_all(eng, [r])[0], run_all(eng, [dataclasses.replace(r, speculative=spec)])[0]
        assert tokens(g) == tokens(w) and [e.text_delta for e in g] == [e.text_delta for e in w]
        assert g[-1].reason == w[-1].reason and g[-1].verified_tokens == g[-1].completion_tokens - 1
