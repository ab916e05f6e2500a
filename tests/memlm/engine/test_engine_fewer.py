"""Fewer kNN-LM searches in engine generation (memlm.engine.fewer_rows). Oracle: plain kNN-LM
generation on the engine. A gate threshold of 0 and a RetoMaton minimum above k generate the same tokens with
the same searches; with pointers on, searches are saved and every pointer is the same-document successor of
a candidate whose value is the token chosen; a pointer/gated row among joining and leaving rows equals it
alone (greedy and seeded). Independent oracle for pointed tokens: the generated text teacher-forced through
evaluation's walk (memlm.jobs.pointer_walk.walk, as memlm.jobs.fewer_scoring runs it) gives the same
per-token log-probs (within float32 rounding: WALK_ATOL) and the same tokens searched.

Shape legend: N datastore entries, C key width, k neighbours.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest
import torch
from tiny_models import (
    RowWiseSearcher,
    own_text_datastore,
    repeated_phrase_documents,
    sharp_tiny_model,
)

from memlm.engine import fewer_rows
from memlm.engine.drafts import SpeculativeConfig
from memlm.engine.engine import Engine, run_all
from memlm.engine.requests import EngineConfig, GenerationRequest
from memlm.errors import MemlmError
from memlm.jobs.decoding import SamplingConfig, TokenEvent
from memlm.jobs.knnlm_eval import Retrieval
from memlm.jobs.pointer_walk import walk
from memlm.model.tokenizer import Tokenizer, document_boundary
from memlm.retrieval.adaptive import (
    AdaptiveConfig,
    GateConfig,
    GateSettings,
    RetrievalGate,
    distribution_features,
)
from memlm.retrieval.clustered_states import cluster_states
from memlm.retrieval.knnlm import KNNLMConfig, interpolate
from memlm.retrieval.pointers import PointerConfig, PointerSource

TOK = Tokenizer.byte_level()
BOUNDARY = document_boundary(TOK)
KNN = KNNLMConfig(k=8, lmbda=0.8, temperature=5.0)
GREEDY = SamplingConfig(temperature=0.0)
SEEDED = SamplingConfig(temperature=1.0, top_k=20, seed=7)
WALK_ATOL = 2e-6
"""|generated - walked| of a token's log-prob: the engine's keys and logits come from its KV cache one token at a
time, the walk's from one forward over the whole text (float32 rounding of another summation order): measured
at most 3.6e-7 over this file's prompts (min_pointers 1 and 2), while pointer distances 1% off in the engine
show as up to 7.9e-6 (test_the_walk_oracle_sees_pointer_distances_one_percent_off)."""


CLUSTERED_WALK_ATOL = 5e-4
"""As WALK_ATOL with clustered states: the candidates are whole clusters' members, farther from the query than
pointers alone, so the engine's and the walk's float32 queries (up to 3.4e-6 apart) move their distances more
(up to 4.6e-5): measured at most 1.0e-4 over this file's prompts scored exactly, within WALK_ATOL with the sketch."""


@pytest.fixture(scope="module")
def setting():
    """The model, a row-wise exact searcher over documents of repeated phrases, their PointerSource and
    each entry's (document, position)."""
    model = sharp_tiny_model()
    docs = [[BOUNDARY, *d] for d in repeated_phrase_documents(256)]
    exact, drafts = own_text_datastore(model, docs)
    source = PointerSource.local(drafts.next_ids, drafts.values, exact.keys.half().numpy())
    where = np.array([(d, p) for d, ids in enumerate(docs) for p in range(1, len(ids))])  # (N, 2)
    return model, RowWiseSearcher(exact), source, docs, where


@pytest.fixture(scope="module")
def crossing(setting):
    """As `setting`, with a fifth document cycling through the phrases the other way round: a phrase's end is
    followed by two different phrases, so pointed candidates disagree and their distances decide p_kNN."""
    model = setting[0]
    first = repeated_phrase_documents(256)[0]
    p0, p1, p2 = (first[9 * i : 9 * i + 9] for i in range(3))
    docs = [[BOUNDARY, *d] for d in repeated_phrase_documents(256)] + [[BOUNDARY, *((p0 + p2 + p1) * 3)]]
    exact, drafts = own_text_datastore(model, docs)
    return model, RowWiseSearcher(exact), PointerSource.local(drafts.next_ids, drafts.values, exact.keys.half().numpy())


def gate(threshold: float | None, model=None, docs=None) -> AdaptiveConfig:
    """A random gate (fixed seed) over the 5 distribution features; threshold None: standardised on the
    documents' features under the model, at their median score (about half of the searches skipped)."""
    settings = GateSettings("m", "k", "c", KNN.k, KNN.temperature, KNN.lmbda, GateConfig(hidden=8, key_components=0),
                            5, (), "t", 1, 0.5, 0.5, tuple(np.linspace(0, 1, 1001).tolist()))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        net = RetrievalGate(5, 8).eval()
    if threshold is None:
        with torch.inference_mode():
            x = torch.cat([distribution_features(model(torch.tensor([d])).logits[0].float().log_softmax(-1))
                           for d in docs])  # (n, 5)
        net.mean.copy_(x.mean(dim=0))
        net.std.copy_(x.std(dim=0))
        threshold = float(net.scores(x).median())
    return AdaptiveConfig(net, settings, threshold)


def prompts(docs) -> list[tuple[int, ...]]:
    return [tuple(docs[0][1:10]), tuple(docs[2][5:12]), tuple(TOK.encode("the cat")), tuple(docs[3][2:20])]


def run(model, searcher, reqs, max_batch=4, prefill_chunk=64):
    engine = Engine(model, TOK, EngineConfig(max_batch=max_batch, prefill_chunk=prefill_chunk), searcher=searcher)
    out = run_all(engine, reqs)
    return [[e.token_id for e in ev if isinstance(e, TokenEvent)] for ev in out], [ev[-1] for ev in out]


def request(prompt, fewer=None, sampling=GREEDY, n=24):
    return GenerationRequest(prompt, n, sampling, boundary_token=BOUNDARY, knn=KNN, fewer=fewer)


def test_threshold_zero_and_a_minimum_above_k_generate_as_plain_knnlm(setting) -> None:
    model, searcher, source, docs, _ = setting
    plain, plain_end = run(model, searcher, [request(p) for p in prompts(docs)])
    for how in (Retrieval(adaptive=gate(0.0)), Retrieval(PointerConfig(min_pointers=KNN.k + 1), source),
                Retrieval(PointerConfig(min_pointers=KNN.k + 1), source, gate(0.0))):
        got, end = run(model, searcher, [request(p, how) for p in prompts(docs)])
        assert got == plain
        assert [e.searches for e in end] == [e.searches for e in plain_end] == [len(t) for t in plain]
        assert all(e.searches_saved == 0 for e in end)


def test_pointers_save_searches_and_stay_in_their_document(setting, monkeypatch) -> None:
    model, searcher, source, docs, where = setting
    followed = []

    def spy(prev, targets, xq, src, distances):
        out = real(prev, targets, xq, src, distances)
        followed.append((prev, targets, out))
        return out

    real = fewer_rows.follow
    monkeypatch.setattr(fewer_rows, "follow", spy)
    got, end = run(model, searcher, [request(p, Retrieval(PointerConfig(min_pointers=1), source)) for p in prompts(docs)])
    saved, searched = sum(e.searches_saved for e in end), sum(e.searches for e in end)
    assert 0 < saved and searched + saved == sum(len(t) for t in got)
    assert all(e.searches >= 1 for e in end)  # the first token has nothing to follow
    for prev, targets, out in followed:  # each pointer: the next entry of a matching candidate's document
        for r in range(out.ids.shape[0]):
            for i in out.ids[r][out.ids[r] >= 0]:
                pred = prev.ids[r][(prev.ids[r] >= 0) & (prev.values[r] == targets[r])]
                assert any(where[j, 0] == where[i, 0] and where[j, 1] + 1 == where[i, 1] for j in pred)
                assert i - 1 in pred  # the builder's order: the successor is the next row


def test_a_gate_saves_searches_with_base_tokens(setting) -> None:
    model, searcher, source, docs, _ = setting
    half = gate(None, model, docs)
    for how in (Retrieval(adaptive=half), Retrieval(PointerConfig(min_pointers=2), source, half)):
        got, end = run(model, searcher, [request(p, how) for p in prompts(docs)])
        saved = sum(e.searches_saved for e in end)
        assert 0 < saved < sum(len(t) for t in got)
        assert all(e.searches + e.searches_saved == len(t) for e, t in zip(end, got))
    engine = Engine(model, TOK, EngineConfig(max_batch=4), searcher=searcher)
    events = run_all(engine, [request(p, Retrieval(adaptive=half)) for p in prompts(docs)])
    for ev in events:  # a skipped token is the base LM's (its final log-prob is the base one, bit for bit)
        base = sum(e.logprob == e.base_logprob for e in ev if isinstance(e, TokenEvent))
        assert base == ev[-1].searches_saved


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_fewer_row_among_joiners_and_leavers_equals_it_alone(setting, sampling) -> None:
    model, searcher, source, docs, _ = setting
    how = Retrieval(PointerConfig(min_pointers=2), source, gate(None, model, docs))
    ps = prompts(docs)
    mine = request(ps[0], how, sampling, n=30)
    alone, alone_end = run(model, searcher, [mine], max_batch=1)
    others = [request(ps[1], n=5), request(ps[2], None, SEEDED, n=9), mine, request(ps[3], how, n=3),
              GenerationRequest(ps[1], 12, GREEDY, boundary_token=BOUNDARY), request(ps[2], how, sampling, n=7)]
    together, end = run(model, searcher, others, max_batch=3, prefill_chunk=5)
    assert together[2] == alone[0]
    assert (end[2].searches, end[2].searches_saved) == (alone_end[0].searches, alone_end[0].searches_saved)
    assert alone_end[0].searches_saved > 0


def test_refusals(setting) -> None:
    model, searcher, source, docs, _ = setting
    how = Retrieval(PointerConfig(min_pointers=2), source)
    with pytest.raises(MemlmError, match="need kNN-LM"):
        GenerationRequest(prompts(docs)[0], 4, boundary_token=BOUNDARY, fewer=how)
    engine = Engine(model, TOK, EngineConfig(max_batch=2), searcher=searcher)
    with pytest.raises(MemlmError, match="speculative"):
        engine.submit(dataclasses.replace(request(prompts(docs)[0], how), speculative=SpeculativeConfig()))
    kept = Retrieval(PointerConfig(min_pointers=2, keep_pointers=True), source)
    with pytest.raises(MemlmError, match="keep_pointers"):
        engine.submit(request(prompts(docs)[0], kept))

def test_rows_without_fewer_searches_save_none(setting) -> None:
    model, searcher, _, docs, _ = setting
    plain = GenerationRequest(prompts(docs)[0], 6, GREEDY, boundary_token=BOUNDARY)
    got, end = run(model, searcher, [request(prompts(docs)[1], n=6), plain])
    assert [(e.searches, e.searches_saved) for e in end] == [(len(got[0]), 0), (0, 0)]


def walked(model, searcher, source, prompt, generated, config: PointerConfig):
    """(final log-prob per generated token (n,), searched (n,) bool) of `generated` teacher-forced after
    [boundary, *prompt] through evaluation's pointer walk (one stream: its first token searches, as a row's)."""
    ids = [BOUNDARY, *prompt, *generated]
    with torch.inference_mode():
        out = model(torch.tensor([ids[:-1]]))
    at = slice(len(prompt), len(ids) - 1)  # the positions that predict the generated tokens
    xq = out.knn_key[0, at].float().numpy()  # (n, C)
    lm = out.logits[0, at].float().log_softmax(-1)  # (n, V)
    targets = np.array(generated, dtype=np.int64)  # (n,)
    w = walk(xq, targets, np.zeros(len(generated), np.int64), searcher, KNN.k, KNN.search_options, KNN.temperature,
             config, source, None, contextlib.nullcontext(), stream_tokens=len(generated))
    return interpolate(lm.gather(1, torch.from_numpy(targets)[:, None])[:, 0], w.knn_logprob, KNN.lmbda), w.searched


def against_the_walk(setting, crossing, config: PointerConfig) -> tuple[float, bool, int]:
    """Pointer generation of the prompts vs `walked` over its text: (max |log-prob difference|, the searches
    agree for every prompt, searches saved)."""
    docs = setting[3]
    model, searcher, source = crossing
    engine = Engine(model, TOK, EngineConfig(max_batch=4), searcher=searcher)
    events = run_all(engine, [request(p, Retrieval(config, source)) for p in prompts(docs)])
    worst, same_searches = 0.0, True
    for prompt, ev in zip(prompts(docs), events):
        tokens = [e for e in ev if isinstance(e, TokenEvent)]
        want, searched = walked(model, searcher, source, prompt, [e.token_id for e in tokens], config)
        worst = max(worst, float((torch.tensor([e.logprob for e in tokens]) - want).abs().max()))
        same_searches &= (ev[-1].searches, ev[-1].searches_saved) == (int(searched.sum()), int((~searched).sum()))
    return worst, same_searches, sum(ev[-1].searches_saved for ev in events)


@pytest.mark.parametrize("minimum", [1, 2])
def test_pointer_generation_equals_evaluations_walk_over_its_own_text(setting, crossing, minimum) -> None:
    worst, same_searches, saved = against_the_walk(setting, crossing, PointerConfig(min_pointers=minimum))
    assert worst <= WALK_ATOL and same_searches
    assert saved > 0  # pointed tokens were compared, not only searched ones


def test_the_walk_oracle_sees_pointer_distances_one_percent_off(setting, crossing, monkeypatch) -> None:
    real = fewer_rows.follow

    def off(prev, targets, xq, src, distances):  # the engine's pointed candidates only (the walk imports its own)
        out = real(prev, targets, xq, src, distances)
        return out._replace(distances=out.distances * 1.01)

    monkeypatch.setattr(fewer_rows, "follow", off)
    worst, _, _ = against_the_walk(setting, crossing, PointerConfig(min_pointers=1))
    assert worst > WALK_ATOL


@pytest.mark.parametrize("sketch_dims, exact_members, cluster_width", [(0, 1, None), (4, 3, 16)])
def test_clustered_generation_equals_evaluations_walk(setting, crossing, sketch_dims, exact_members,
                                                      cluster_width) -> None:
    """Clustered states in generation, scored exactly or by a KeySketch (3 exact a row, the others followed
    only, 16 kept: wider than k 8): the engine's rows and evaluation's walk call the same extend_by_clusters,
    so the same log-probs and the same tokens searched."""
    model, searcher, source = crossing
    clusters = cluster_states(source.keys, 6, sketch_dims=sketch_dims, exact_members=exact_members)
    assert (clusters.sketch is None) == (sketch_dims == 0)
    clustered = PointerSource.local(source.successors.next_ids, source.successors.values, source.keys, clusters)
    config = PointerConfig(min_pointers=1, cluster_width=cluster_width)
    worst, same_searches, saved = against_the_walk(setting, (model, searcher, clustered), config)
    assert same_searches and saved > 0  # the candidate sets decide which tokens search: exactly the same
    assert worst <= CLUSTERED_WALK_ATOL
