"""One row's failure ends that row only: for each row kind of the engine (greedy, sampled, speculative, Score,
SPALM, Memorizing) one row's own search, draw or memory fails inside a batch, that row ends with the error,
and every other row yields exactly what it yields alone. Sampling is safe at any temperature > 0: a
temperature far below float32's range draws the greedy tokens.

Faults are marked by the failing row's own settings: its search asks nprobe FAULTY (a searcher that fails for
those queries, as a shard that cannot serve them), or it samples with top_k FAULTY (a draw that raises).

Shape legend: Q queries, k neighbours.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from tiny_models import RowWiseSearcher, own_text_datastore, phrase_documents, repeated_phrase_documents, sharp_tiny_model

from memlm.engine import sampling as engine_sampling
from memlm.engine import speculative as engine_speculative
from memlm.engine.drafts import SpeculativeConfig
from memlm.engine.engine import Engine, run_all
from memlm.engine.requests import EngineConfig, GenerationRequest, ScoreRequest, SpalmSettings
from memlm.errors import MemlmError
from memlm.jobs import decoding
from memlm.jobs.decoding import GenerationEnd, SamplingConfig, TokenEvent
from memlm.jobs.knnlm_eval import Retrieval
from memlm.jobs.windows import WindowConfig, WorkStopped, exact_searcher_over_documents
from memlm.memory.memorizing import new_knn_attention
from memlm.memory.spalm import SpalmHead
from memlm.model.config import ModelConfig
from memlm.model.decoder import build_model
from memlm.model.memory_config import MemoryConfig
from memlm.model.tokenizer import Tokenizer, document_boundary
from memlm.retrieval.exact import TorchExactSearcher
from memlm.retrieval.knnlm import KNNLMConfig
from memlm.retrieval.pointers import PointerConfig, PointerSource
from memlm.retrieval.searcher import SearchOptions

TOK = Tokenizer.byte_level()
BOUNDARY = document_boundary(TOK)
FAULTY = 13
"""The nprobe (a search) or top_k (a draw) that marks the row whose own work fails."""
GREEDY = SamplingConfig(temperature=0.0)
SAMPLED = SamplingConfig(temperature=1.0, top_k=40, seed=21)
KNN = KNNLMConfig(k=8, lmbda=0.5, temperature=5.0)
FAULTY_KNN = dataclasses.replace(KNN, nprobe=FAULTY)


class FaultySearcher(RowWiseSearcher):
    """Exact search, one query at a time (a query's answer does not depend on the others of its call); a call
    with nprobe FAULTY raises."""

    def search(self, xq, k, options=None):
        if options is not None and options.nprobe == FAULTY:
            raise MemlmError("the shard for these queries failed")
        return super().search(xq, k, options)


def faulty_filter(logits, top_k, top_p):
    """memlm.jobs.decoding.filter_logits, raising for top_k FAULTY (a draw that fails)."""
    if top_k == FAULTY:
        raise RuntimeError("this row's draw failed")
    return decoding.filter_logits(logits, top_k, top_p)


def pairs(events) -> list[tuple[int, float]]:
    return [(e.token_id, e.logprob) for e in events if isinstance(e, TokenEvent)]


def assert_same(got, want) -> None:
    """Tokens equal and log-probs within float32 rounding (another batch shape), the final event equal."""
    assert [t for t, _ in pairs(got)] == [t for t, _ in pairs(want)] and pairs(got)
    np.testing.assert_allclose([lp for _, lp in pairs(got)], [lp for _, lp in pairs(want)], rtol=1e-5, atol=1e-5)
    assert got[-1] == want[-1]


def run_with_one_failing(engine: Engine, requests: list, failing: int, match: str) -> list:
    """Submit `requests` at once; the one at index `failing` raises `match`; the others' events (None for it)."""
    handles = [engine.submit(r) for r in requests]
    out = []
    for i, h in enumerate(handles):
        if i == failing:
            with pytest.raises(Exception, match=match):
                list(h.events())
            out.append(None)
        else:
            out.append(list(h.events()))
    assert not engine.busy
    return out


def alone(make_engine, request) -> list:
    return run_all(make_engine(1), [request])[0]


@pytest.fixture(scope="module")
def model():
    return sharp_tiny_model()


@pytest.fixture(scope="module")
def searcher(model):
    ids = [BOUNDARY, *TOK.encode("the cat sat on the mat and the dog sat on the log; " * 3)]
    with torch.inference_mode():
        keys = model(torch.tensor([ids[:-1]])).knn_key[0]  # (N, C)
    return FaultySearcher(TorchExactSearcher(keys.float(), torch.tensor(ids[1:]).numpy()))


def gen(prompt: str, n: int, sampling: SamplingConfig = GREEDY, **kw) -> GenerationRequest:
    return GenerationRequest(tuple(TOK.encode(prompt)), n, sampling, boundary_token=BOUNDARY, **kw)


def test_a_greedy_knn_row_whose_search_fails_ends_alone(model, searcher) -> None:
    reqs = [gen("the cat", 12), gen("on the", 12, knn=KNN), gen("the dog", 12, knn=FAULTY_KNN),
            gen("a mat", 12, SAMPLED, knn=KNN), gen("sat on", 14, knn=dataclasses.replace(KNN, k=3))]

    def make(n):
        return Engine(model, TOK, EngineConfig(max_batch=n, prefill_chunk=8), searcher=searcher)

    got = run_with_one_failing(make(len(reqs)), reqs, 2, "shard for these queries")
    for req, events in zip(reqs, got):
        if events is not None:
            assert_same(events, alone(make, req))


def test_a_sampled_row_whose_draw_fails_ends_alone(model, searcher, monkeypatch) -> None:
    monkeypatch.setattr(engine_sampling, "filter_logits", faulty_filter)
    broken = dataclasses.replace(SAMPLED, top_k=FAULTY)
    reqs = [gen("the cat", 12, SAMPLED), gen("on the", 12, broken), gen("the dog", 12, GREEDY),
            gen("a mat", 12, dataclasses.replace(SAMPLED, seed=5, top_p=0.9), knn=KNN)]

    def make(n):
        return Engine(model, TOK, EngineConfig(max_batch=n, prefill_chunk=8), searcher=searcher)

    got = run_with_one_failing(make(len(reqs)), reqs, 1, "draw failed")
    for req, events in zip(reqs, got):
        if events is not None:
            assert_same(events, alone(make, req))


@pytest.mark.parametrize("temperature", [1e-38, 1e-300, 5e-324])
def test_a_temperature_below_float32_range_draws_the_greedy_tokens(model, searcher, temperature) -> None:
    """With the logits max-shifted before the division, the most likely token keeps probability 1 however
    small the temperature (unshifted, float32 logits / 1e-38 are all -inf and the draw raises on NaN)."""
    engine = Engine(model, TOK, EngineConfig(max_batch=4), searcher=searcher)
    cold = SamplingConfig(temperature=temperature, seed=3)
    reqs = [gen("the cat", 16, cold), gen("on the", 16, cold, knn=KNN), gen("the cat", 16), gen("on the", 16, knn=KNN)]
    events = run_all(engine, reqs)
    for i in range(2):
        assert [t for t, _ in pairs(events[i])] == [t for t, _ in pairs(events[i + 2])]


@pytest.fixture(scope="module")
def spec_setting():
    model = sharp_tiny_model()
    seeds = ["the cat sat", "once upon a time", "in the beginning"]
    reqs = [gen(p, 48) for p in seeds]
    docs = [[BOUNDARY, *r.prompt_ids, *[e.token_id for e in ev if isinstance(e, TokenEvent)]]
            for r, ev in zip(reqs, run_all(Engine(model, TOK), reqs))]
    exact, drafts = own_text_datastore(model, docs)
    return model, FaultySearcher(exact), drafts, docs


SPEC = SpeculativeConfig(draft_tokens=6, draft_k=16, min_agreeing=1)


def test_a_speculative_row_whose_search_or_draw_fails_ends_alone(spec_setting, monkeypatch) -> None:
    monkeypatch.setattr(engine_speculative, "filter_logits", faulty_filter)
    model, searcher, drafts, docs = spec_setting
    p = tuple(docs[0][1:12])
    base = GenerationRequest(p, 16, GREEDY, boundary_token=BOUNDARY)
    reqs = [dataclasses.replace(base, knn=KNN, speculative=SPEC),
            dataclasses.replace(base, knn=FAULTY_KNN, speculative=SPEC),
            dataclasses.replace(base, speculative=SPEC),
            dataclasses.replace(base, prompt_ids=tuple(docs[1][1:9]), sampling=SAMPLED, speculative=SPEC),
            base]

    def make(n):
        return Engine(model, TOK, EngineConfig(max_batch=n), searcher, drafts)

    got = run_with_one_failing(make(len(reqs)), reqs, 1, "shard for these queries")
    for req, events in zip(reqs, got):
        if events is not None:
            assert_same(events, alone(make, req))
    broken = dataclasses.replace(reqs[3], sampling=dataclasses.replace(SAMPLED, top_k=FAULTY))
    reqs[1] = broken  # a sampled speculative row whose draw fails
    got = run_with_one_failing(make(len(reqs)), reqs, 1, "draw failed")
    for req, events in zip(reqs, got):
        if events is not None:
            assert_same(events, alone(make, req))


def test_a_speculative_row_at_a_tiny_temperature_draws_the_greedy_tokens(spec_setting) -> None:
    model, searcher, drafts, docs = spec_setting
    base = GenerationRequest(tuple(docs[0][1:12]), 16, GREEDY, boundary_token=BOUNDARY, speculative=SPEC)
    cold = dataclasses.replace(base, sampling=SamplingConfig(temperature=1e-38, seed=2))
    got = run_all(Engine(model, TOK, EngineConfig(max_batch=2), searcher, drafts), [cold, base])
    assert [t for t, _ in pairs(got[0])] == [t for t, _ in pairs(got[1])]


def test_a_score_row_whose_search_fails_ends_alone(model, searcher) -> None:
    text = tuple(TOK.encode("the cat sat on the mat and the dog sat on the log"))
    reqs = [ScoreRequest(text, BOUNDARY, window=(24, 8), knn=KNN, top_n=3),
            ScoreRequest(text[:30], BOUNDARY, window=(24, 8), knn=FAULTY_KNN),
            ScoreRequest(text[5:], BOUNDARY, top_n=2),
            gen("on the", 10, knn=KNN)]

    def make(n):
        return Engine(model, TOK, EngineConfig(max_batch=n, prefill_chunk=16), searcher=searcher)

    got = run_with_one_failing(make(len(reqs)), reqs, 1, "shard for these queries")
    for (a,), (b,) in zip(got[:3:2], [alone(make, reqs[0]), alone(make, reqs[2])]):
        assert a.tokens.tolist() == b.tokens.tolist() and a.greedy.tolist() == b.greedy.tolist()
        assert a.top_ids.tolist() == b.top_ids.tolist()
        np.testing.assert_allclose(a.logprob, b.logprob, rtol=2e-5, atol=1e-6)
    assert_same(got[3], alone(make, reqs[3]))


SPALM = MemoryConfig(kind="spalm", segment=8, mem_len=10, sink_tokens=2)


def test_a_spalm_row_whose_search_fails_ends_alone() -> None:
    model = build_model(ModelConfig.from_name("tiny", max_seq_len=32))
    model.load_state_dict(sharp_tiny_model(seed=5).state_dict())
    model.eval()
    docs = [np.random.default_rng(1).integers(2, 256, size=384).tolist()]
    searcher = FaultySearcher(exact_searcher_over_documents(model, docs, WindowConfig(32, 16), BOUNDARY))
    torch.manual_seed(3)
    head = SpalmHead(model.config.n_embd)
    with torch.no_grad():  # a gate that varies by position, so the retrieved tokens count
        head.w_g.normal_(0, 0.5)
        head.bias.zero_()
    prompts = phrase_documents(4, 20, seed=7)
    reqs = [GenerationRequest(tuple(p), 16, s, boundary_token=BOUNDARY, spalm=SpalmSettings(k, options))
            for p, s, k, options in zip(prompts, [GREEDY, GREEDY, SAMPLED, GREEDY], [4, 4, 2, 3],
                                        [None, SearchOptions(nprobe=FAULTY), None, None])]

    def make(n):
        return Engine(model, TOK, EngineConfig(max_batch=n, prefill_chunk=8, memory=SPALM), searcher, spalm_head=head)

    got = run_with_one_failing(make(len(reqs)), reqs, 1, "shard for these queries")
    for req, events in zip(reqs, got):
        if events is not None:
            assert_same(events, alone(make, req))


MEMORIZING = MemoryConfig("memorizing", segment=8, mem_len=8, sink_tokens=2, knn_layer=1, knn_mem_size=40,
                          knn_top_k=4, knn_backend="exact")


def test_a_memorizing_row_whose_memory_fails_ends_alone(searcher) -> None:
    model = sharp_tiny_model(n_layer=3, seed=5)
    module = new_knn_attention(model.config)
    with torch.no_grad():  # gates open: the retrieved pairs change the logits
        module.gate_logit.zero_()
    prompts = phrase_documents(4, 30, seed=7)
    reqs = [GenerationRequest(tuple(p), 20, s, boundary_token=BOUNDARY)
            for p, s in zip(prompts, [GREEDY, GREEDY, SAMPLED, dataclasses.replace(SAMPLED, seed=4)])]

    def make(n):
        return Engine(model, TOK, EngineConfig(max_batch=n, memory=MEMORIZING), knn_attention=module)

    engine = make(len(reqs))
    handles = [engine.submit(r) for r in reqs]
    for _ in range(3):  # the prompts are in: every row's memory holds its prompt's segments
        engine.step()
    engine.memorizing.rows[handles[1].request_id].store.close()  # its next search raises
    with pytest.raises(ValueError, match="was closed"):
        list(handles[1].events())
    for i in (0, 2, 3):
        assert_same(list(handles[i].events()), alone(make, reqs[i]))


class FailingLookup:
    """Successor lookups that fail (a retrieval service's Successors rpc that is down)."""

    def successors_of(self, ids):
        raise RuntimeError("the successors lookup failed")


def test_pointer_rows_whose_lookups_fail_search_instead() -> None:
    """RetoMaton rows whose pointers cannot be followed lose them for the step and are searched: they generate
    plain kNN-LM's tokens, saving no search, and no row ends."""
    model = sharp_tiny_model()
    docs = [[BOUNDARY, *d] for d in repeated_phrase_documents(256)]
    exact, _ = own_text_datastore(model, docs)
    source = PointerSource(FailingLookup(), exact.keys.half().numpy())
    searcher = RowWiseSearcher(exact)
    pointed = [GenerationRequest(tuple(d[1:10]), 20, s, boundary_token=BOUNDARY, knn=KNN,
                                 fewer=Retrieval(PointerConfig(min_pointers=1), source))
               for d, s in zip(docs, [GREEDY, SAMPLED, GREEDY])]
    engine = Engine(model, TOK, EngineConfig(max_batch=4, prefill_chunk=64), searcher=searcher)
    got = run_all(engine, [*pointed, gen("the cat", 20)])
    for req, events in zip(pointed, got):
        plain = run_all(Engine(model, TOK, EngineConfig(max_batch=1), searcher=searcher),
                        [dataclasses.replace(req, fewer=None)])[0]
        assert [t for t, _ in pairs(events)] == [t for t, _ in pairs(plain)]
        end = events[-1]
        assert isinstance(end, GenerationEnd) and end.searches_saved == 0 and end.searches == end.completion_tokens


class StoppedSearcher:
    """A search whose callers all gave up."""

    def __init__(self) -> None:
        self.calls = 0

    def search(self, xq, k, options=None):
        self.calls += 1
        raise WorkStopped()


def test_search_each_retries_row_by_row_but_not_a_stopped_search(searcher) -> None:
    keys = torch.randn(5, searcher.dim)  # (Q, C)
    knn = [KNN, FAULTY_KNN, None, KNN, FAULTY_KNN]
    owners = [0, 1, 2, 3, 1]  # row 1 asks two queries
    found, errors = engine_sampling.search_each(searcher, keys, knn, owners)
    assert set(errors) == {1} and "shard" in str(errors[1])
    alone = engine_sampling.search_rows(searcher, keys[[0, 3]], [KNN, KNN])
    for got, want in zip([found[0], found[3]], alone):
        assert all(np.array_equal(a, b) for a, b in zip(got, want))
    assert found[1] is None and found[2] is None and found[4] is None
    stopped = StoppedSearcher()
    found, errors = engine_sampling.search_each(stopped, keys, knn, owners)
    assert stopped.calls == 1 and set(errors) == {0, 1, 3}
    assert all(isinstance(e, WorkStopped) for e in errors.values())


POISON = 250
"""A prompt token whose forward fails, in the engine without a row cache below."""


class OwnStateModel(torch.nn.Module):
    """The tiny decoder behind a model interface without a row cache (as transformers' models are to the engine:
    each row runs its own forward); a forward that reads POISON raises."""

    def __init__(self, inner) -> None:
        super().__init__()
        self.inner, self.config = inner, inner.config

    @property
    def device(self) -> torch.device:
        return self.inner.device

    @property
    def dtype(self) -> torch.dtype:
        return self.inner.dtype

    def forward(self, idx, state=None, logits_from=0):
        if bool((idx == POISON).any()):
            raise RuntimeError("this row's forward failed")
        return self.inner(idx, state=state, logits_from=logits_from)


def test_a_row_whose_own_forward_fails_ends_alone(model) -> None:
    own = OwnStateModel(model)
    reqs = [gen("the cat", 12), gen("on the", 12, SAMPLED),
            GenerationRequest((*TOK.encode("the "), POISON), 12, GREEDY, boundary_token=BOUNDARY), gen("a mat", 14)]

    def make(n):
        return Engine(own, TOK, EngineConfig(max_batch=n, prefill_chunk=8))

    got = run_with_one_failing(make(len(reqs)), reqs, 2, "forward failed")
    for req, events in zip(reqs, got):
        if events is not None:
            assert_same(events, alone(make, req))
            assert_same(events, run_all(Engine(model, TOK, EngineConfig(max_batch=1)), [req])[0])  # the decoder's own
