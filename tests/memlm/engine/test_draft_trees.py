"""Draft trees (memlm.engine.draft_trees): a tree pass gives every node the logits of its path fed as one chain
(the tree attention mask, positions by depth, slots by index), the accepted branch's cache entries move into the
slots after x_t so that decoding goes on as after that chain, and greedy speculative generation over trees that take
branches stays token-identical to plain greedy generation.

Shape legend: V vocab, n nodes.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch
from test_speculative import BOUNDARY, GREEDY, KNN, KNN_LOW, SPEC, TOK, engine, prompts, setting, tokens  # noqa: F401
from tiny_models import sharp_tiny_model

from memlm.engine import draft_trees
from memlm.engine.draft_trees import ancestors, chain, children, depths, prefix_tree, row_tree, walk
from memlm.engine.drafts import DraftSource, SpeculativeConfig
from memlm.engine.engine import run_all
from memlm.engine.kv_cache import CacheLayout, RowCache
from memlm.engine.requests import GenerationRequest
from memlm.errors import MemlmError
from memlm.jobs.decoding import SamplingConfig


def test_prefix_tree_merges_in_order_within_the_budget() -> None:
    tree = prefix_tree([(1, 2, 3), (1, 4), (5,), (1, 2, 6)], budget=10)
    assert tree.tokens == (1, 2, 3, 4, 5, 6) and tree.parents == (-1, 0, 1, 0, -1, 1)
    assert depths(tree) == [0, 1, 2, 3, 2, 1, 3]
    assert prefix_tree([(1, 2, 3), (1, 4), (5,)], budget=4) == ((1, 2, 3, 4), (-1, 0, 1, 0))
    assert prefix_tree([(1, 2, 3), (5,)], budget=2) == ((1, 2), (-1, 0))  # the main draft first, cut at the budget
    assert chain((7, 8)).is_chain and not tree.is_chain and prefix_tree([], 3) == ((), ())
    kids = children(tree)  # the walk follows the chosen child at every position, then stops
    assert walk(kids, {0: 1, 1: 4, 4: 8}) == [0, 1, 4] and walk(kids, {0: 1, 1: 2}) == [0, 1, 2]
    assert walk(kids, {0: 5}) == [0, 5] and walk(kids, {0: 9}) == [0] and walk(kids, {}, 2) == [2]


def test_ancestors_are_the_path_to_the_root() -> None:
    """Against walking the parents: [a, b] when b is a or an ancestor of a (position 0 is x_t, node i is i + 1)."""
    rng = random.Random(0)
    for _ in range(50):
        drafts = [tuple(rng.randrange(3) for _ in range(rng.randrange(1, 5))) for _ in range(4)]
        tree = prefix_tree(drafts, budget=rng.randrange(1, 12))
        sees = ancestors(tree)
        for a in range(len(tree.tokens) + 1):
            path, at = {0, a}, a - 1
            while at >= 0:
                path.add(at + 1)
                at = tree.parents[at]
            assert set(np.flatnonzero(sees[a])) == path
    assert (ancestors(chain((4, 5, 6))) == np.tril(np.ones((4, 4), dtype=bool))).all()  # a chain: causal


def _cache(model, slots: int = 32) -> RowCache:
    return RowCache(model.config, CacheLayout(1, 0, slots, None, None), model.device, model.dtype)


def _pass(model, cache: RowCache, ids: list[int], pos: list[int], slots: list[int] | None = None,
          sees: np.ndarray | None = None) -> torch.Tensor:
    """One pass of `ids` at positions `pos` into row 0: logits (T, V)."""
    p = torch.tensor([pos])  # (1, T)
    view = cache.view([0], p, torch.ones_like(p, dtype=torch.bool), torch.zeros_like(p), True,
                      None if slots is None else torch.tensor([slots]),
                      None if sees is None else torch.from_numpy(sees)[None])
    return model(torch.tensor([ids]), state=view).logits[0]  # (T, V)


def test_a_tree_pass_gives_each_node_its_paths_logits_and_a_moved_branch_decodes_on() -> None:
    model = sharp_tiny_model()
    prefix = list(TOK.encode("once upon"))
    tree = prefix_tree([(5, 6, 7), (5, 9), (11, 12)], budget=10)  # nodes 5 6 7 9 11 12
    x_t = 3
    with torch.inference_mode():
        cache = _cache(model)
        _pass(model, cache, prefix, list(range(len(prefix))))
        p0 = len(prefix)
        got = _pass(model, cache, [x_t, *tree.tokens], [p0 + d for d in depths(tree)],
                    list(range(p0, p0 + 1 + len(tree.tokens))), ancestors(tree))  # (1+n, V)
        kids = children(tree)
        for node in range(len(tree.tokens)):
            path, at = [node], tree.parents[node]
            while at >= 0:
                path.insert(0, at)
                at = tree.parents[at]
            alone = _cache(model)
            _pass(model, alone, prefix, list(range(p0)))
            want = _pass(model, alone, [x_t, *(tree.tokens[i] for i in path)], list(range(p0, p0 + 1 + len(path))))
            torch.testing.assert_close(got[node + 1], want[-1], rtol=1e-5, atol=1e-5)
        assert kids[0] == {5: 0, 11: 4} and kids[1] == {6: 1, 9: 3}
        # Accept the branch 11 12 (nodes 4, 5): moved into the slots after x_t, the next step is the chain's.
        cache.move_slots(0, [p0 + 1 + 4, p0 + 1 + 5], [p0 + 1, p0 + 2])
        cache.slot_pos[0, p0 + 3 : p0 + 1 + len(tree.tokens)] = -1
        nxt = _pass(model, cache, [13], [p0 + 3])[-1]
        alone = _cache(model)
        _pass(model, alone, prefix, list(range(p0)))
        want = _pass(model, alone, [x_t, 11, 12, 13], list(range(p0, p0 + 4)))[-1]
        torch.testing.assert_close(nxt, want, rtol=1e-5, atol=1e-5)


def test_row_tree_main_draft_first_then_candidates_within_the_budget() -> None:
    """The main draft (RowDrafts.main) is the tree's first chain; a greedy row adds its other candidates up to tree_nodes
    (a main draft that long stays alone), never more than `room`; sampled rows and tree_nodes 0 keep the main one."""
    next_ids = np.array([1, 2, 3, -1, 5, 6, -1], dtype=np.int64)  # two documents: 0 1 2 3 | 4 5 6
    source = DraftSource(next_ids, np.array([9, 1, 2, 3, 9, 4, 5], dtype=np.int32))
    pointers = np.array([0, 0, 4, 4], dtype=np.int64)  # two chains each: 1 2 3 and 4 5
    spec = SpeculativeConfig(min_agreeing=1, draft_from="both", tree_nodes=3)
    text = [7, 8, 9]  # no history match: the datastore's branches
    assert row_tree(text, pointers, source, 4, spec, True, 10) == chain((1, 2, 3))  # as long as tree_nodes: alone
    tree = row_tree(text, pointers, source, 4, dataclasses.replace(spec, tree_nodes=5), True, 10)
    assert tree.tokens == (1, 2, 3, 4, 5) and tree.parents == (-1, 0, 1, -1, 3)  # the other branch beside
    assert len(row_tree(text, pointers, source, 2, dataclasses.replace(spec, tree_nodes=6), True, 3).tokens) == 3
    short = row_tree(text, pointers, source, 1, spec, True, 10)
    assert short.tokens == (1, 4) and short.parents == (-1, -1)  # two first tokens, one deep
    assert row_tree(text, pointers, source, 1, spec, False, 10) == chain((1,))  # sampled: the main draft
    assert row_tree(text, pointers, source, 1, dataclasses.replace(spec, tree_nodes=0), True, 10) == chain((1,))


@pytest.mark.parametrize("text", [[1, 2, 3, 1, 2], [7, 8, 9, 8], [7, 8, 9]])  # a 2-token match, a 1-token one, none
def test_tree_candidates_make_each_draft_once_and_equal_the_drafts_made_alone(text, monkeypatch) -> None:
    """tree_candidates reads one RowDrafts: the history match and the pointers' chains are made once a pass (they
    were made twice, once for the main draft and once for the other candidates), and the candidates are the
    drafts each function makes alone: RowDrafts.main, own_text_draft, the fallback's history_draft, the branches."""
    from memlm.engine import drafts

    next_ids = np.array([1, 2, 3, -1, 5, 6, -1], dtype=np.int64)
    source = DraftSource(next_ids, np.array([9, 1, 2, 3, 9, 4, 5], dtype=np.int32))
    pointers = np.array([0, 0, 4, 4], dtype=np.int64)
    spec = SpeculativeConfig(min_agreeing=1, draft_from="both", tree_nodes=5, fallback_tokens=2)
    want = [drafts.RowDrafts(text, pointers, source, 4, spec).main, drafts.own_text_draft(text, 4, spec),
            drafts.history_draft(text, 2, spec.history_min_match - 1, 1)[0],
            *draft_trees.datastore_branches(drafts.chain_starts(pointers, source), source, 4, spec.tree_branches, 1)]
    calls = {"history_draft": 0, "chain_starts": 0}
    for name in calls:
        real = getattr(drafts, name)
        monkeypatch.setattr(drafts, name, lambda *a, real=real, name=name: calls.__setitem__(name, calls[name] + 1)
                            or real(*a))
    assert draft_trees.tree_candidates(text, pointers, source, 4, spec, True) == want
    assert calls["chain_starts"] == 1 and calls["history_draft"] <= 2  # the long match's, the fallback's


def test_frequent_next_tokens_count_the_datastores_pairs_and_fill_a_trees_spare_nodes() -> None:
    """FrequentNext: the tokens after each token by their count over (entry, successor) pairs, ties by the smaller,
    never across a document's end; row_tree adds the first frequent_branches of them after the last token as
    one-token branches, only in nodes its other candidates left (and only where drafts read the datastore)."""
    from memlm.engine.drafts import FrequentNext, draft_source_of

    # two documents: 5 7 5 7 5 9 | 5 8 (the 5 ending the first document is followed by nothing)
    values = np.array([5, 7, 5, 7, 5, 9, 5, 8], dtype=np.int32)
    next_ids = np.array([1, 2, 3, 4, 5, -1, 7, -1], dtype=np.int64)
    frequent = FrequentNext.build(next_ids, values)
    assert frequent.after(5, 3) == (7, 8, 9)  # 7 twice; 8 and 9 once each, the smaller first
    assert frequent.after(7, 3) == (5,) and frequent.after(9, 3) == () and frequent.after(8, 3) == ()
    assert frequent.after(5, 1) == (7,) and frequent.after(12345, 2) == () and frequent.after(-1, 2) == ()
    source = draft_source_of(next_ids, values)
    assert source.frequent is not None and source.frequent.after(5, 3) == (7, 8, 9)
    spec = SpeculativeConfig(min_agreeing=2, draft_from="both", tree_nodes=3, frequent_branches=2)
    no_pointers = np.zeros(0, dtype=np.int64)
    tree = row_tree([1, 2, 5], no_pointers, source, 4, spec, True, 10)  # no history match, no chains
    assert tree.tokens == (7, 8) and tree.parents == (-1, -1)
    assert row_tree([1, 2, 5], no_pointers, source, 4, dataclasses.replace(spec, frequent_branches=0), True, 10) \
        == chain(())
    assert row_tree([1, 2, 5], no_pointers, source, 4, dataclasses.replace(spec, draft_from="history"), True, 10) \
        == chain(())  # history drafts read no datastore
    assert row_tree([5, 7, 5], no_pointers, source, 4, spec, True, 10).tokens[:2] == (7, 5)  # the history first
    with pytest.raises(MemlmError, match="frequent_branches"):
        SpeculativeConfig(frequent_branches=-1)


@pytest.mark.parametrize("knn", [KNN, KNN_LOW, None], ids=["knnlm", "knnlm-cut", "base"])
@pytest.mark.parametrize("tree_nodes", [0, 5, 8])
def test_greedy_trees_take_branches_and_stay_token_identical(setting, monkeypatch, knn, tree_nodes) -> None:
    moves = []
    real_move = RowCache.move_slots
    monkeypatch.setattr(RowCache, "move_slots", lambda self, *a: (moves.append(a), real_move(self, *a)))
    plain = [GenerationRequest(p, 20 + i % 5, GREEDY, boundary_token=BOUNDARY, knn=knn)
             for i, p in enumerate(prompts(setting[3], 16, seed=3))]
    config = dataclasses.replace(SPEC, draft_tokens=3, min_agreeing=2, tree_nodes=tree_nodes, draft_from="both")
    want = run_all(engine(setting), plain)
    got = run_all(engine(setting), [dataclasses.replace(r, speculative=config) for r in plain])
    for w, g in zip(want, got):
        assert tokens(g) == tokens(w)
        assert [e.logprob for e in g[:-1]] == pytest.approx([e.logprob for e in w[:-1]], abs=1e-4)
    assert (len(moves) > 0) == (tree_nodes > 0)  # branches off the main draft were accepted (and moved)


def test_sampled_rows_verify_a_chain(setting, monkeypatch) -> None:
    """A sampled row's acceptance rule is for one draft: its tree is its main draft alone."""
    seen = []
    real = draft_trees.row_tree
    monkeypatch.setattr("memlm.engine.speculative.row_tree", lambda *a: seen.append(real(*a)) or seen[-1])
    req = GenerationRequest(prompts(setting[3], 5)[4], 12, SamplingConfig(temperature=1.0, seed=1),
                            boundary_token=BOUNDARY, knn=KNN, speculative=SPEC)
    run_all(engine(setting), [req])
    assert seen and all(t.is_chain for t in seen)
