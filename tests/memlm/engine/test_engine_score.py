"""Score through the engine against the library (memlm.jobs.scoring): sliding windows = score_tokens, XL rows
= score_tokens_segments, with and without kNN-LM and top-n, over texts longer than one window; a score inside
a shared batch (generation and other scores joining) equals it alone; contexts condition and are not scored;
refusals; a failed search ends only the rows that searched; a long text's later windows never starve a new score.

Tolerances (float32 rounding only): the engine's cache attends over preallocated slots in other batch shapes
than the library's plain forward, so base log-probs differ by a few float32 ulps (eps 1.2e-7; measured on the
sharp tiny model: <= 4.2e-7 relative, 2.9e-6 absolute at log-probs near -9: BASE_RTOL); kNN-LM log-probs move
with the keys' rounding through the distances (exp(-d / T)) and the top-n block's mixture (KNN_RTOL). Tokens,
greedy flags and alternatives are equal.

Shape legend: N datastore entries, C key width.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import RowWiseSearcher, own_text_datastore, repeated_phrase_documents, sharp_tiny_model

from memlm.engine import score_rows
from memlm.engine.engine import Engine, run_all
from memlm.engine.requests import EngineConfig, GenerationRequest, ScoreRequest
from memlm.engine.score_rows import ScoreEnded, ScoreRow, join_scores, split
from memlm.errors import MemlmError
from memlm.jobs.decoding import SamplingConfig, TokenEvent
from memlm.jobs.knnlm_eval import Retrieval
from memlm.jobs.scoring import SequenceScore, score_tokens, score_tokens_segments
from memlm.model.memory_config import MemoryConfig
from memlm.model.config import ModelConfig
from memlm.model.decoder import build_model
from memlm.model.tokenizer import Tokenizer, document_boundary
from memlm.retrieval.exact import TorchExactSearcher
from memlm.retrieval.knnlm import KNNLMConfig
from memlm.retrieval.pointers import PointerConfig, PointerSource

TOK = Tokenizer.byte_level()
B = document_boundary(TOK)
BASE_RTOL = 2e-6
"""|engine - library| / |library| of base log-probs: about 16 float32 ulps (measured <= 4.2e-7)."""
KNN_RTOL = 2e-5
"""Of kNN-LM log-probs and alternatives: the keys' rounding through exp(-d / T) (measured <= 4.8e-6 absolute)."""
KNN = KNNLMConfig(k=8, lmbda=0.5, temperature=5.0)
WINDOW = (48, 16)
TEXTS = [TOK.encode(t) for t in ("the state of the union is strong, and so on and on " * 3,
                                 "a second text, shorter", "x")]
CONTEXTS = [TOK.encode("Speech: "), [], TOK.encode("the long context of a one-token text, over a window " * 2)]


@pytest.fixture(scope="module")
def model():
    return sharp_tiny_model()


@pytest.fixture(scope="module")
def short():
    """The sharp model with a 32-token context, for XL rows past it."""
    m = build_model(ModelConfig.from_name("tiny", max_seq_len=32))
    m.load_state_dict(sharp_tiny_model(seed=4).state_dict())
    return m.eval()


def datastore(model) -> TorchExactSearcher:
    """(key, next token) pairs of one text under the model: keys (N, C), values (N,)."""
    ids = [B, *TOK.encode("the state of the nation is strong and the union is on; " * 3)]
    with torch.inference_mode():
        keys = model(torch.tensor([ids[:-1]])).knn_key[0]  # (N, C)
    return TorchExactSearcher(keys.float(), torch.tensor(ids[1:]).numpy())


def close(a: SequenceScore, b: SequenceScore, rtol: float) -> None:
    assert a.tokens.tolist() == b.tokens.tolist() and a.context_tokens == b.context_tokens
    np.testing.assert_allclose(a.base_logprob, b.base_logprob, rtol=BASE_RTOL, atol=1e-6)
    np.testing.assert_allclose(a.logprob, b.logprob, rtol=rtol, atol=1e-6)
    assert a.greedy.tolist() == b.greedy.tolist()
    assert a.top_ids.tolist() == b.top_ids.tolist()
    np.testing.assert_allclose(a.top_logprobs, b.top_logprobs, rtol=rtol, atol=1e-6)
    assert (a.searched is None) == (b.searched is None)
    if a.searched is not None:
        assert a.searched.tolist() == b.searched.tolist()


def requests(knn: KNNLMConfig | None, window: tuple[int, int] | None, top_n: int = 3) -> list[ScoreRequest]:
    return [ScoreRequest(tuple(t), B, tuple(c), window=window, knn=knn, top_n=top_n) for t, c in zip(TEXTS, CONTEXTS)]


@pytest.mark.parametrize("knn", [None, KNN], ids=["base", "knnlm"])
def test_sliding_windows_equal_score_tokens(model, knn) -> None:
    searcher = datastore(model)
    engine = Engine(model, TOK, EngineConfig(max_batch=2, prefill_chunk=40), searcher)
    got = [e for (e,) in run_all(engine, requests(knn, WINDOW))]
    want = score_tokens(model, TEXTS, context=WINDOW[0], stride=WINDOW[1], boundary_token=B, contexts=CONTEXTS,
                        searcher=searcher if knn else None, knn=knn, top_n=3)
    assert len(TEXTS[0]) + len(CONTEXTS[0]) > 3 * WINDOW[0]  # several windows, each read from a cleared row
    for g, w in zip(got, want):
        close(g, w, KNN_RTOL)
    if knn is not None:  # the mixture is on: the final log-probs are not the base ones
        assert np.abs(got[0].logprob - got[0].base_logprob).max() > 0.05


def test_a_text_split_over_rows_equals_score_tokens_in_fewer_steps(model) -> None:
    """split: a long text's windows read by 3 rows side by side; join_scores: its score, as score_tokens'."""
    searcher = datastore(model)
    (whole,) = requests(KNN, WINDOW)[:1]
    parts = split(whole, 3)
    assert [p.part for p in parts] == [(0, 3), (3, 6), (6, 9)] and split(parts[0], 2) == [parts[0]]
    assert sum(len(p.scored) for p in parts) == len(whole.tokens)
    steps = {}
    for name, batch in (("whole", [whole]), ("split", parts)):
        engine = Engine(model, TOK, EngineConfig(max_batch=3, prefill_chunk=3 * WINDOW[0]), searcher)
        got = join_scores([e for (e,) in run_all(engine, batch)])
        steps[name] = engine.steps
        (want,) = score_tokens(model, TEXTS[:1], context=WINDOW[0], stride=WINDOW[1], boundary_token=B,
                               contexts=CONTEXTS[:1], searcher=searcher, knn=KNN, top_n=3)
        close(got, want, KNN_RTOL)
    assert steps == {"whole": 9, "split": 3}  # one window a step, or three


MEMORIES = {"xl": MemoryConfig(kind="xl", mem_len=12, segment=8, sink_tokens=4),
            "compressive": MemoryConfig(kind="compressive", mem_len=8, segment=8, sink_tokens=2, cmem_len=4,
                                        compress_rate=2, compress_fn="mean")}


@pytest.mark.parametrize("kind", list(MEMORIES))
@pytest.mark.parametrize("knn", [None, KNN], ids=["base", "knnlm"])
def test_xl_rows_past_the_context_equal_score_tokens_segments(short, knn, kind) -> None:
    """Texts three times a 32-token context, through XL (compressive) rows (prefill chunks cutting segments)."""
    memory = MEMORIES[kind]
    searcher = datastore(short)
    engine = Engine(short, TOK, EngineConfig(max_batch=2, prefill_chunk=5, memory=memory), searcher)
    got = [e for (e,) in run_all(engine, requests(knn, None, top_n=2))]
    want = score_tokens_segments(short, TEXTS, memory=memory, boundary_token=B, contexts=CONTEXTS,
                                 searcher=searcher if knn else None, knn=knn, top_n=2)
    for g, w in zip(got, want):
        close(g, w, KNN_RTOL)
    plain = Engine(short, TOK, EngineConfig(max_batch=1, memory=MemoryConfig(kind="xl", mem_len=0, segment=8,
                                                                              sink_tokens=0)))
    (no_memory,) = run_all(plain, [ScoreRequest(tuple(TEXTS[0]), B, tuple(CONTEXTS[0]))])
    assert abs(no_memory[0].base_total_logprob - want[0].base_total_logprob) > 1e-3  # the memory matters


@pytest.mark.parametrize("knn", [None, KNN], ids=["base", "knnlm"])
def test_score_in_a_shared_batch_equals_score_alone(model, knn) -> None:
    searcher = datastore(model)
    target = ScoreRequest(tuple(TEXTS[0]), B, tuple(CONTEXTS[0]), window=WINDOW, knn=knn, top_n=2)
    (alone,) = run_all(Engine(model, TOK, EngineConfig(max_batch=1), searcher), [target])[0]
    engine = Engine(model, TOK, EngineConfig(max_batch=4, prefill_chunk=24), searcher)
    gens = [engine.submit(GenerationRequest(tuple(TOK.encode(p)), 30, SamplingConfig(temperature=0), boundary_token=B,
                                            knn=knn)) for p in ("generating", "and more")]
    engine.step()
    other = engine.submit(ScoreRequest(tuple(TOK.encode("another text to score")), B, knn=KNN, top_n=1))
    watched = engine.submit(target)
    engine.step()
    late = engine.submit(ScoreRequest(tuple(TOK.encode("late " * 20)), B, window=(16, 8)))
    (shared,) = list(watched.events())
    close(shared, alone, KNN_RTOL)
    for h in (*gens, other, late):
        list(h.events())
    assert not engine.busy


class CountingSearcher:
    """The datastore, counting its searches."""

    def __init__(self, inner) -> None:
        self.inner, self.dim, self.calls = inner, inner.dim, 0

    def info(self):
        return self.inner.info()

    def search(self, xq, k, options=None):
        self.calls += 1
        return self.inner.search(xq, k, options)


def test_a_step_with_score_and_decode_rows_searches_the_datastore_once(model) -> None:
    # One kNN-LM search per step for every row of the lane, the score rows' scored tokens included (a
    # search of their own would be a second scan of the datastore in every step that has both).
    searcher = CountingSearcher(datastore(model))
    greedy = SamplingConfig(temperature=0)
    gen_request = GenerationRequest(tuple(TOK.encode("generating")), 6, greedy, boundary_token=B, knn=KNN)
    score_request = ScoreRequest(tuple(TOK.encode("a text to score")), B, knn=KNN, top_n=2)
    engine = Engine(model, TOK, EngineConfig(max_batch=4, prefill_chunk=64), searcher)
    gen = engine.submit(gen_request)
    engine.step()  # the prompt in, its first token chosen
    score = engine.submit(score_request)
    before = searcher.calls
    engine.step()  # the whole text to score beside the decode row
    assert searcher.calls == before + 1
    (scored,) = list(score.events())
    tokens = [e.token_id for e in gen.events() if isinstance(e, TokenEvent)]
    (alone_score,) = run_all(Engine(model, TOK, EngineConfig(max_batch=1), searcher), [score_request])[0]
    alone_tokens = [e.token_id for e in run_all(Engine(model, TOK, EngineConfig(max_batch=1), searcher),
                                                [gen_request])[0] if isinstance(e, TokenEvent)]
    close(scored, alone_score, KNN_RTOL)
    assert tokens == alone_tokens and len(tokens) == 6


def test_score_refusals_and_cancellation(model) -> None:
    engine = Engine(model, TOK, EngineConfig(max_batch=1, row_capacity=16))
    with pytest.raises(MemlmError, match="of 40 tokens is over the rows' 16"):
        engine.submit(ScoreRequest(tuple(range(40)), B))
    engine.submit(ScoreRequest(tuple(range(40)), B, window=(16, 8)))  # in windows, it fits
    with pytest.raises(MemlmError, match="needs a datastore"):
        engine.submit(ScoreRequest(tuple(range(10)), B, knn=KNN))
    with pytest.raises(MemlmError, match="empty"):
        ScoreRequest((), B)
    with pytest.raises(MemlmError, match="stride"):
        ScoreRequest((1, 2), B, window=(8, 9))
    h = engine.submit(ScoreRequest(tuple(range(10)), B))
    h.cancel()
    with pytest.raises(ScoreEnded, match="cancelled") as e:
        list(h.events())
    assert e.value.reason == "cancelled"


class FailingSearcher:
    def __init__(self, inner) -> None:
        self.inner, self.dim = inner, inner.dim

    def info(self):
        return self.inner.info()

    def search(self, xq, k, options=None):
        raise RuntimeError("the retrieval service is down")


def test_a_failed_search_ends_only_the_rows_that_searched(model) -> None:
    engine = Engine(model, TOK, EngineConfig(max_batch=3), FailingSearcher(datastore(model)))
    base = ScoreRequest(tuple(TEXTS[0]), B, window=WINDOW)
    searching = engine.submit(ScoreRequest(tuple(TEXTS[0]), B, window=WINDOW, knn=KNN))
    plain = engine.submit(base)
    with pytest.raises(RuntimeError, match="is down"):
        list(searching.events())
    (got,) = list(plain.events())
    (alone,) = run_all(Engine(model, TOK, EngineConfig(max_batch=1)), [base])[0]
    close(got, alone, BASE_RTOL)


class ToggledSearcher(CountingSearcher):
    """The datastore, failing while `fail` is set."""

    fail = False

    def search(self, xq, k, options=None):
        if self.fail:
            raise RuntimeError("the retrieval service is down")
        return super().search(xq, k, options)


def test_a_failed_step_search_ends_the_score_rows_in_it_not_a_generate_row_that_followed_pointers(model) -> None:
    # The step's one search holds the score rows' tokens and the decode rows that search; a Generate row that
    # follows its RetoMaton pointers this step is not in it, so a failure of that search does not end it.
    docs = [[B, *d] for d in repeated_phrase_documents(256)]
    exact, drafts = own_text_datastore(model, docs)
    source = PointerSource.local(drafts.next_ids, drafts.values, exact.keys.half().numpy())
    searcher = ToggledSearcher(RowWiseSearcher(exact))
    engine = Engine(model, TOK, EngineConfig(max_batch=4, prefill_chunk=64), searcher)
    gen = engine.submit(GenerationRequest(tuple(docs[0][1:10]), 40, SamplingConfig(temperature=0), boundary_token=B,
                                          knn=KNN, fewer=Retrieval(PointerConfig(min_pointers=1), source)))
    for _ in range(40):  # until a step where the row follows pointers
        engine.step()
        (row,) = engine.rows.values()
        if row.searches_saved > 0:
            break
    assert row.searches_saved > 0
    searched = row.searches
    score = engine.submit(ScoreRequest(tuple(TOK.encode("a text to score")), B, knn=KNN))
    searcher.fail = True
    engine.step()
    assert row.searches == searched  # it followed its pointers in the failed step
    with pytest.raises(RuntimeError, match="is down"):
        list(score.events())
    searcher.fail = False
    events = list(gen.events())  # it goes on to its end (an error would be raised here)
    assert sum(isinstance(e, TokenEvent) for e in events) == 40


def test_a_long_texts_later_windows_do_not_starve_a_new_score(model) -> None:
    """One window fills a step's prefill budget; a score that comes while a long one slides is read at the
    next step, not after every window of the long one."""
    engine = Engine(model, TOK, EngineConfig(max_batch=2, prefill_chunk=32))
    long = engine.submit(ScoreRequest(tuple(TOK.encode("a long text read in windows " * 12)), B, window=(32, 8)))
    for _ in range(3):
        engine.step()
    small = engine.submit(ScoreRequest(tuple(TOK.encode("small")), B))
    steps = 0
    while not small.ready():
        engine.step()
        steps += 1
    assert steps == 1
    (done,) = list(long.events())
    assert len(done.tokens) == len(TOK.encode("a long text read in windows " * 12))


def test_a_cancelled_row_before_others_frees_its_slot_and_the_others_go_on(model) -> None:
    """Cancelling a row that has rows after it moves the last one into its slot (between steps, outside the
    forward pass, once the cache grew past its first 64 slots inside one): the others finish as alone."""
    engine = Engine(model, TOK, EngineConfig(max_batch=3, prefill_chunk=300))
    texts = [tuple(TOK.encode(t * 30)) for t in ("first ", "second ", "third ")]
    handles = [engine.submit(ScoreRequest(t, B, window=(96, 48))) for t in texts]
    engine.step()
    assert engine.cache.allocated > 64
    handles[0].cancel()
    with pytest.raises(ScoreEnded, match="cancelled"):
        list(handles[0].events())
    for h, t in zip(handles[1:], texts[1:]):
        (got,) = list(h.events())
        (alone,) = run_all(Engine(model, TOK, EngineConfig(max_batch=1)), [ScoreRequest(t, B, window=(96, 48))])[0]
        close(got, alone, BASE_RTOL)
    assert engine.slots_in_use == []


def test_a_long_chunk_beside_short_ones_runs_in_a_pass_of_its_own(model) -> None:
    """Score passes keep logits at every position: a 60-token chunk and six 2-token ones in one left-padded pass
    would hold 7 x 60 positions; within the 64-token budget they run as [60] and [2 x 6], and score as alone."""
    engine = Engine(model, TOK, EngineConfig(max_batch=7, prefill_chunk=64))
    long = ScoreRequest(tuple(TOK.encode("x" * 60)), B)
    short = [ScoreRequest(tuple(TOK.encode(c * 2)), B) for c in "abcdef"]
    groups = list(score_rows.passes([(ScoreRow.start(engine.submit(r), i, None), len(r.tokens))
                                     for i, r in enumerate([*short[:3], long, *short[3:]])], 64))
    assert [[n for _, n in g] for g in groups] == [[60], [2] * 6]
    assert [[row.slot for row, _ in g] for g in groups] == [[3], [0, 1, 2, 4, 5, 6]]
    engine = Engine(model, TOK, EngineConfig(max_batch=7, prefill_chunk=64))
    for got, request in zip(run_all(engine, [long, *short]), [long, *short]):
        (alone,) = run_all(Engine(model, TOK, EngineConfig(max_batch=1)), [request])[0]
        close(got[0], alone, BASE_RTOL)


def test_a_decode_row_moved_into_a_finished_score_rows_slot_still_decodes_that_step(model) -> None:
    """A score row that finishes in a step leaves before the decode pass; the generation moved into its slot
    still makes its token in that step (it was skipped once, as if its new slot had been fed already)."""
    engine = Engine(model, TOK, EngineConfig(max_batch=2, prefill_chunk=16))
    score = engine.submit(ScoreRequest(tuple(TOK.encode("x" * 40)), B, window=(16, 8)))
    engine.step()
    gen = engine.submit(GenerationRequest(tuple(TOK.encode("ab")), 20, SamplingConfig(temperature=0),
                                          boundary_token=B))
    per_step = []
    while not score.ready():
        engine.step()
        per_step.append(len(gen.ready()))
    assert engine.slots_in_use == [0] and per_step == [1] * len(per_step)  # a token every step, the last too


def test_prompt_rows_never_read_another_rows_cache_after_a_score_leaves() -> None:
    """A score row that finishes in a step is released before that step's prompt pass, and the last row moves
    into its slot: the prompt rows are then out of slot order ([0, 3, 2]), and read as one slice of the cache a
    prompt would attend to a live generation's keys (B's first token would be D's). Every row
    must yield exactly what it yields alone."""
    model = sharp_tiny_model()
    greedy = SamplingConfig(temperature=0.0)

    def gen(prompt: str, n: int = 6) -> GenerationRequest:
        return GenerationRequest(tuple(TOK.encode(prompt)), n, sampling=greedy, boundary_token=B)

    def tokens(events) -> list[int]:
        return [e.token_id for e in events if isinstance(e, TokenEvent)]

    X, D = gen("x", 1), gen("d", 12)
    A = gen("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron")  # > one chunk
    Bq, C = gen("the union is strong"), gen("a third prompt here")
    cfg = EngineConfig(max_batch=5, prefill_chunk=64)
    alone = [tokens(run_all(Engine(model, TOK, cfg), [r])[0]) for r in (A, D, Bq, C)]
    engine = Engine(model, TOK, cfg)
    handles = [engine.submit(r) for r in (X, D, A)]  # slots 0 X, 1 D, 2 A
    engine.step()  # X ends: A moves into slot 0 with prompt left; D decodes from now on
    handles += [engine.submit(r) for r in (ScoreRequest(tuple(TOK.encode("short")), B), Bq, C)]  # slots 2, 3, 4
    got = [tokens(list(h.events())) for h in handles]
    assert [got[2], got[1], got[4], got[5]] == alone
