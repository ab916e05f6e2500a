"""Sampled speculative generation keeps exactly the plain sampler's distribution.

A chi-square test over a fixed set of seeds (so it is deterministic): the first three tokens of a
kNN-LM continuation with top-k 3 (27 outcomes at most), sampled speculatively with drafts from the
model's own text, against their exact probabilities by full recomputation (the product of the three
final distributions, memlm.engine.sampling's rules). The same test FAILS a deliberately wrong acceptance
rule (on rejection, drawing from p without removing the draft token: the draft comes out too often),
so it can fail.

Shape legend: V vocab, k neighbours.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from scipy.stats import chisquare
from tiny_models import own_text_datastore, phrase_documents, sharp_tiny_model

from memlm.engine import speculative
from memlm.engine.drafts import SpeculativeConfig
from memlm.engine.engine import Engine, run_all
from memlm.engine.requests import EngineConfig, GenerationRequest
from memlm.jobs.decoding import SamplingConfig, TokenEvent, filter_logits
from memlm.model.tokenizer import Tokenizer, document_boundary
from memlm.retrieval.knnlm import KNNLMConfig, interpolate, knn_log_distribution
from memlm.retrieval.searcher import search_keys

TOK = Tokenizer.byte_level()
BOUNDARY = document_boundary(TOK)
KNN = KNNLMConfig(k=8, lmbda=0.5, temperature=5.0)
SAMPLING = SamplingConfig(temperature=1.5, top_k=3)
SEEDS = range(1200)
"""Fixed seeds: the test's outcome is the same at every run."""
TOKENS = 3


@pytest.fixture(scope="module")
def setting():
    model = sharp_tiny_model()
    greedy = SamplingConfig(temperature=0.0)
    reqs = [GenerationRequest(tuple(TOK.encode(p)), 40, greedy, boundary_token=BOUNDARY)
            for p in ("the cat sat", "once upon a time", "hello world")]
    docs = [[BOUNDARY, *r.prompt_ids, *[e.token_id for e in ev if isinstance(e, TokenEvent)]]
            for r, ev in zip(reqs, run_all(Engine(model, TOK), reqs))]
    searcher, drafts = own_text_datastore(model, docs)
    return model, searcher, drafts, tuple(docs[0][1:16])


@pytest.fixture(scope="module")
def phrases():
    """For drafts from the row's own text: a datastore of phrase-repeating documents, which kNN-LM goes on
    repeating, and a prompt of two and a half phrases (its own past drafts the next phrase)."""
    model = sharp_tiny_model()
    docs = [[BOUNDARY, *d] for d in phrase_documents(6, 60)]
    searcher, drafts = own_text_datastore(model, docs)
    return model, searcher, drafts, tuple(docs[0][1:30])


def target(model, searcher, prefix: list[int]) -> torch.Tensor:
    """The plain sampler's distribution (V,) of the next token after `prefix`, by full recomputation."""
    with torch.inference_mode():
        o = model(torch.tensor([prefix]))
    lm = F.log_softmax(o.logits[0, -1:].float(), -1)  # (1, V)
    nb = search_keys(searcher, o.knn_key[0, -1:], KNN.k, KNN.search_options)  # (1, k)
    final = interpolate(lm, knn_log_distribution(nb, lm.shape[-1], KNN.temperature), KNN.lmbda)[0]  # (V,)
    final[TOK.vocab_size:] = float("-inf")
    return filter_logits(final / SAMPLING.temperature, SAMPLING.top_k, SAMPLING.top_p).softmax(-1)  # (V,)


def exact_outcomes(model, searcher, prefix: list[int]) -> dict[tuple[int, ...], float]:
    """Probability of every sequence of TOKENS tokens (top-k keeps 3 candidates a step)."""
    out = {(): 1.0}
    for _ in range(TOKENS):
        nxt = {}
        for seq, p in out.items():
            probs = target(model, searcher, prefix + list(seq))
            for t in probs.nonzero()[:, 0].tolist():
                nxt[(*seq, t)] = p * float(probs[t])
        out = nxt
    return out


def sampled(setting, speculate: bool, draft_from: str = "datastore") -> Counter:
    model, searcher, drafts, prompt = setting
    spec = SpeculativeConfig(draft_tokens=4, draft_k=8, min_agreeing=1, draft_from=draft_from) if speculate else None
    reqs = [GenerationRequest(prompt, TOKENS, dataclasses.replace(SAMPLING, seed=s), boundary_token=BOUNDARY,
                              knn=KNN, speculative=spec) for s in SEEDS]
    results = run_all(Engine(model, TOK, EngineConfig(max_batch=64), searcher, drafts), reqs)
    return Counter(tuple(e.token_id for e in ev if isinstance(e, TokenEvent)) for ev in results)


def p_value(counts: Counter, exact: dict[tuple[int, ...], float]) -> float:
    """Chi-square goodness of fit, outcomes of expected count < 5 pooled into one cell."""
    n = sum(counts.values())
    assert set(counts) <= set(exact)  # never an outcome of probability 0
    big = [o for o in exact if exact[o] * n >= 5]
    observed = [counts[o] for o in big] + [n - sum(counts[o] for o in big)]
    expected = [exact[o] * n for o in big] + [n * (1 - sum(exact[o] for o in big))]
    return float(chisquare(observed, expected).pvalue)


@pytest.fixture(scope="module")
def exact(setting):
    model, searcher, _, prompt = setting
    return exact_outcomes(model, searcher, [BOUNDARY, *prompt])


@pytest.fixture(scope="module")
def exact_phrases(phrases):
    model, searcher, _, prompt = phrases
    return exact_outcomes(model, searcher, [BOUNDARY, *prompt])


def test_speculative_sampling_matches_the_plain_samplers_distribution(setting, exact) -> None:
    assert sum(exact.values()) == pytest.approx(1.0, abs=1e-5)
    assert p_value(sampled(setting, speculate=False), exact) > 1e-3  # the oracle is the plain sampler's
    assert p_value(sampled(setting, speculate=True), exact) > 1e-3


@pytest.fixture(scope="module")
def plain_phrases(phrases) -> Counter:
    """The plain sampler's outcomes on `phrases`: the same for every draft_from (it drafts nothing), so sampled once."""
    return sampled(phrases, speculate=False)


@pytest.mark.parametrize("draft_from", ["history", "both"])
def test_sampling_with_history_drafts_matches_the_plain_samplers_distribution(phrases, exact_phrases, plain_phrases,
                                                                              draft_from) -> None:
    assert sum(exact_phrases.values()) == pytest.approx(1.0, abs=1e-5)
    assert p_value(plain_phrases, exact_phrases) > 1e-3
    assert p_value(sampled(phrases, speculate=True, draft_from=draft_from), exact_phrases) > 1e-3


def wrong_accept(final_lp, draft, sampling, generator, decodable):
    """A wrong rule: accept d_i with probability p(d_i) and, on rejection, draw from p itself (d_i kept)."""
    choice = final_lp.clone()
    choice[:, decodable:] = float("-inf")
    for i in range(len(draft) + 1):
        p = filter_logits(choice[i] / sampling.temperature, sampling.top_k, sampling.top_p).softmax(-1)  # (V,)
        if i == len(draft) or not torch.rand((), generator=generator) < p[draft[i]]:
            return [*draft[:i], int(torch.multinomial(p, 1, generator=generator)[0])], i
    raise AssertionError("unreachable")


def test_a_wrong_acceptance_rule_fails_the_test(setting, exact, phrases, exact_phrases, monkeypatch) -> None:
    monkeypatch.setattr(speculative, "accept", wrong_accept)
    assert p_value(sampled(setting, speculate=True), exact) < 1e-6
    assert p_value(sampled(phrases, speculate=True, draft_from="history"), exact_phrases) < 1e-6


@pytest.mark.parametrize("draft_from", ["datastore", "history"])
def test_drafts_were_verified_in_the_sampled_runs(setting, phrases, draft_from) -> None:
    """The statistical test is about drafts: most of its rows verify one (and some of its tokens are
    accepted, some rejected)."""
    model, searcher, drafts, prompt = setting if draft_from == "datastore" else phrases
    spec = SpeculativeConfig(draft_tokens=4, draft_k=8, min_agreeing=1, draft_from=draft_from)
    reqs = [GenerationRequest(prompt, TOKENS, dataclasses.replace(SAMPLING, seed=s), boundary_token=BOUNDARY,
                              knn=KNN, speculative=spec) for s in itertools.islice(SEEDS, 200)]
    ends = [ev[-1] for ev in run_all(Engine(model, TOK, EngineConfig(max_batch=64), searcher, drafts), reqs)]
    passes = [e.verify_steps for e in ends]
    assert sum(p < 2 for p in passes) > 20 and sum(p == 2 for p in passes) > 20  # accepted / rejected
