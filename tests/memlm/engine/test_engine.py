"""memlm.engine: the continuous batch against one-sequence generation and full recomputation; a request
inside a batch of others equals it alone; stops, eos, cancellation, deadlines, admission bounds, chunked
prefill, sliding rows, the engine thread.

Shape legend: T tokens, V vocab.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
from tiny_models import sharp_tiny_model

from memlm.engine.engine import Engine, run_all
from memlm.engine.requests import EngineConfig, EngineFull, GenerationRequest
from memlm.errors import MemlmError
from reference_decoding import reference_generate
from memlm.jobs.decoding import GenerationEnd, SamplingConfig, TokenEvent
from memlm.model.memory_config import MemoryConfig
from memlm.model.config import ModelConfig
from memlm.model.tokenizer import Tokenizer, document_boundary
from memlm.retrieval.knnlm import KNNLMConfig

GREEDY = SamplingConfig(temperature=0.0)
SAMPLED = SamplingConfig(temperature=1.0, top_k=50, top_p=0.9, seed=1234)
TOK = Tokenizer.byte_level()
BOUNDARY = document_boundary(TOK)
XL = MemoryConfig(kind="xl", mem_len=12, segment=8, sink_tokens=4)


@pytest.fixture(scope="module")
def model():
    return sharp_tiny_model()


def short_context_model(max_seq_len: int, seed: int):
    """The sharp tiny model (tests/tiny_models.py's weights) with a short context, to run past it."""
    from memlm.model.decoder import build_model

    sharp = sharp_tiny_model(seed=seed)
    short = build_model(ModelConfig.from_name("tiny", max_seq_len=max_seq_len))
    short.load_state_dict(sharp.state_dict())
    return short.eval()


def request(text: str, n: int = 12, sampling: SamplingConfig = GREEDY, **kw) -> GenerationRequest:
    return GenerationRequest(tuple(TOK.encode(text)), n, sampling, boundary_token=BOUNDARY, **kw)


def tokens(events) -> list[int]:
    return [e.token_id for e in events if isinstance(e, TokenEvent)]


def alone(model, req: GenerationRequest) -> list[int]:
    return tokens(run_all(Engine(model, TOK, EngineConfig(max_batch=1)), [req])[0])


def one_sequence(model, req: GenerationRequest, memory: MemoryConfig | None = None) -> list:
    return list(reference_generate(model, TOK, list(req.prompt_ids), max_new_tokens=req.max_new_tokens, sampling=req.sampling,
                                   stop_sequences=req.stop_sequences, boundary_token=BOUNDARY, eos_id=req.eos_id, memory=memory))


def full_recomputation_greedy(model, prefix: list[int], n: int) -> list[int]:
    seq, out = list(prefix), []
    with torch.inference_mode():
        for _ in range(n):
            out.append(int(model(torch.tensor([seq])).logits[0, -1, : TOK.vocab_size].argmax()))  # (V,) -> id
            seq.append(out[-1])
    return out


def test_greedy_equals_full_recomputation_and_one_sequence_generation(model) -> None:
    reqs = [request("The quick brown fox", 16), request("hi", 16), request("a longer prompt " * 4, 16)]
    results = run_all(Engine(model, TOK, EngineConfig(max_batch=2, prefill_chunk=10)), reqs)
    for req, events in zip(reqs, results):
        assert tokens(events) == full_recomputation_greedy(model, req.prefix, 16)
        ref = one_sequence(model, req)
        assert tokens(events) == tokens(ref)
        assert events[-1] == ref[-1]  # the same GenerationEnd (reason, counts, held-back text)
        lp = [e.logprob for e in events if isinstance(e, TokenEvent)]
        torch.testing.assert_close(torch.tensor(lp), torch.tensor([e.logprob for e in ref[:-1]]), atol=1e-4, rtol=1e-4)
        assert "".join(e.text_delta for e in events) == "".join(e.text_delta for e in ref)


def test_xl_memory_equals_one_sequence_xl_generation_past_the_context() -> None:
    """Prompt and continuation run far past a 32-token context: the engine's XL rows (sinks, memory, segments
    cut by the prefill budget) make the reference decoder's XL tokens; the plain cache's differ."""
    model = short_context_model(32, seed=1)
    reqs = [request("memory of a long document " * 3, 60), request("x", 60), request("another one", 60, SAMPLED)]
    config = EngineConfig(max_batch=2, prefill_chunk=5, memory=XL)
    results = run_all(Engine(model, TOK, config), reqs)
    for req, events in zip(reqs, results):
        assert tokens(events) == tokens(one_sequence(model, req, XL))
    plain = run_all(Engine(model, TOK, EngineConfig(max_batch=2)), reqs[:1])[0]
    assert tokens(plain) != tokens(results[0])  # the memory matters: the test can fail


def test_plain_rows_slide_like_one_sequence_generation() -> None:
    """Without a memory a row that fills its cache re-encodes its last half, as generate's window does."""
    model = short_context_model(24, seed=2)
    reqs = [request("sliding " * 2, 40), request("window", 40)]
    results = run_all(Engine(model, TOK, EngineConfig(max_batch=2, prefill_chunk=7)), reqs)
    for req, events in zip(reqs, results):
        assert tokens(events) == tokens(one_sequence(model, req))


@pytest.mark.parametrize(("sampling", "memory"), [(GREEDY, None), (SAMPLED, None), (SAMPLED, XL)],
                         ids=["greedy", "seeded", "seeded-xl"])
def test_a_request_in_a_continuous_batch_yields_its_tokens_alone(model, sampling, memory) -> None:
    """Others join and leave at different steps (different prompt lengths, lengths, a cancellation) while
    the request runs; it yields exactly the tokens it yields alone."""
    target = request("the one we watch", 30, sampling)
    expected = tokens(run_all(Engine(model, TOK, EngineConfig(max_batch=1, memory=memory)), [target])[0])
    engine = Engine(model, TOK, EngineConfig(max_batch=4, prefill_chunk=6, memory=memory))
    early = [engine.submit(request("early bird", 5, SamplingConfig(seed=7))),
             engine.submit(request("long prompt " * 5, 20))]
    engine.step(), engine.step()
    watched = engine.submit(target)
    engine.step()
    late = [engine.submit(request("late", 8, SamplingConfig(temperature=0.7, seed=5))),
            engine.submit(request("later still", 40))]
    for _ in range(3):
        engine.step()
    late[1].cancel()
    joined_after = [engine.submit(request(f"wave {i}", 3 + i)) for i in range(4)]
    got = []
    while not got or not isinstance(got[-1], GenerationEnd):
        engine.step()
        got += watched.ready()
        assert engine.slots_in_use == list(range(len(engine.slots_in_use)))  # rows stay packed as others leave
    assert tokens(got) == expected
    for h in early + late + joined_after:
        list(h.events())  # everyone ends
    assert not engine.busy


def test_text_and_token_stop_sequences_and_eos(model) -> None:
    base = request("stop here", 20)
    free = tokens(one_sequence(model, base))
    text = TOK.decode(free)
    stop_text = text[5:8]
    by_text = run_all(Engine(model, TOK), [dataclasses.replace(base, stop_sequences=(stop_text,))])[0]
    ref = one_sequence(model, dataclasses.replace(base, stop_sequences=(stop_text,)))
    assert by_text[-1] == ref[-1] and by_text[-1].reason == "stop" and tokens(by_text) == tokens(ref)
    assert TOK.decode(tokens(by_text)).endswith(stop_text)
    ids = (free[3], free[4])
    by_ids = run_all(Engine(model, TOK), [dataclasses.replace(base, stop_sequences=(ids,))])[0]
    end = next(j for j in range(2, 6) if tuple(free[j - 2 : j]) == ids)  # the pair's first occurrence
    assert tokens(by_ids) == free[:end] and by_ids[-1].reason == "stop"
    first = free.index(free[6])  # eos ends at the token's first occurrence, not emitted
    eos = run_all(Engine(model, TOK), [dataclasses.replace(base, eos_id=free[6])])[0]
    assert tokens(eos) == free[:first] and eos[-1].reason == "eos" and eos[-1].completion_tokens == first


def test_cancellation_frees_the_row_for_a_waiting_request(model) -> None:
    engine = Engine(model, TOK, EngineConfig(max_batch=1))
    first = engine.submit(request("first", 50))
    second = engine.submit(request("second", 3))
    engine.step(), engine.step()
    first.cancel()
    engine.step()  # the cancelled row leaves before this step; the waiting request takes it
    events = list(first.events())
    assert events[-1].reason == "cancelled" and events[-1].completion_tokens == 2
    assert [isinstance(e, TokenEvent) for e in second.events()] == [True, True, True, False]


def test_deadline_ends_a_request(model) -> None:
    engine = Engine(model, TOK)
    h = engine.submit(request("slow", 1000, timeout_s=1e-9))
    assert list(h.events())[-1].reason == "deadline"


def test_admission_bounds_refuse_with_a_retry_hint(model) -> None:
    """max_queue counts the requests waiting beyond the free rows; max_tokens_in_flight prompt + new tokens."""
    engine = Engine(model, TOK, EngineConfig(max_batch=1, max_queue=2, max_tokens_in_flight=100))
    engine.submit(request("a", 10)), engine.submit(request("b", 10)), engine.submit(request("c", 10))
    with pytest.raises(EngineFull) as full:
        engine.submit(request("d", 10))
    assert full.value.what == "queue" and full.value.retry_after_s > 0
    engine.step()  # "a" takes the row and the queue holds two: still full
    with pytest.raises(EngineFull):
        engine.submit(request("d", 10))
    no_queue = Engine(model, TOK, EngineConfig(max_batch=1, max_queue=0))
    no_queue.submit(request("a", 10))  # a free row: admitted at the next step
    with pytest.raises(EngineFull):
        no_queue.submit(request("b", 10))
    tokens_bound = Engine(model, TOK, EngineConfig(max_batch=4, max_tokens_in_flight=100))
    tokens_bound.submit(request("a" * 60, 10))  # 1 + 60 + 10 = 71 tokens in flight
    with pytest.raises(EngineFull) as full:
        tokens_bound.submit(request("b" * 10, 20))  # + 31 > 100
    assert full.value.what == "tokens_in_flight" and "retry in" in str(full.value)
    tokens_bound.submit(request("e", 10))  # + 12 fits
    with pytest.raises(MemlmError, match="outside"):
        engine.submit(GenerationRequest((600,), 3, boundary_token=BOUNDARY))


def test_chunked_prefill_keeps_the_batch_decoding(model) -> None:
    """A 200-token prompt joins a decoding row: it is prefilled 16 tokens a step, and the running row gets
    one token every one of those steps."""
    engine = Engine(model, TOK, EngineConfig(max_batch=2, prefill_chunk=16))
    running = engine.submit(request("running", 40))
    engine.step()
    running.ready()
    long = engine.submit(request("p" * 199, 5))
    made, first_token = [], []
    for _ in range(13):  # ceil(200 / 16) steps of prefill
        engine.step()
        made.append(len(running.ready()))
        first_token.append(len(long.ready()))
    assert made == [1] * 13
    assert first_token == [0] * 12 + [1]  # its prompt took 13 steps; its first token came with the last
    rest = tokens(long.events())
    assert len(rest) == 4  # one token was drained above; the other four come as it decodes


def test_engine_thread_serves_concurrent_callers(model) -> None:
    engine = Engine(model, TOK, EngineConfig(max_batch=3))
    reqs = [request(f"caller {i}", 6 + i) for i in range(5)]
    expected = [alone(model, r) for r in reqs]
    engine.start()
    try:
        got: dict[int, list[int]] = {}

        def call(i: int) -> None:
            got[i] = tokens(engine.submit(reqs[i]).events(timeout_s=30))

        threads = [threading.Thread(target=call, args=(i,)) for i in range(5)]
        [t.start() for t in threads]
        [t.join(timeout=60) for t in threads]
        cancelled = engine.submit(request("never mind", 10_000))
        cancelled.cancel()
        assert list(cancelled.events(timeout_s=30))[-1].reason == "cancelled"
    finally:
        engine.stop()
    assert [got[i] for i in range(5)] == expected


def test_refusals(model) -> None:
    with pytest.raises(MemlmError, match="memorizing needs a KnnAttention"):  # memlm.engine.memorizing_rows
        Engine(model, TOK, EngineConfig(memory=MemoryConfig(kind="memorizing")))
    with pytest.raises(MemlmError, match="max_new_tokens"):
        request("x", 0)
    with pytest.raises(MemlmError, match="no searcher"):
        Engine(model, TOK).submit(request("x", 3, knn=KNNLMConfig()))
    with pytest.raises(MemlmError, match="fixed lambda"):
        request("x", 3, knn=KNNLMConfig(lmbda=None))
