"""Score through the engine: a text scored inside a shared batch (generation and other scores joining)
equals it scored alone, and equals memlm.jobs.scoring.score_tokens (one window); contexts condition and
are not scored; a text over the rows is refused."""

from __future__ import annotations

import pytest
import torch
from tiny_models import sharp_tiny_model

from memlm.engine.engine import Engine, run_all
from memlm.engine.requests import EngineConfig, GenerationRequest, ScoreRequest
from memlm.errors import MemlmError
from memlm.jobs.generate import SamplingConfig
from memlm.jobs.scoring import SequenceScore, score_tokens, score_tokens_segments
from memlm.model.tokenizer import Tokenizer, document_boundary

TOK = Tokenizer.byte_level()
B = document_boundary(TOK)


@pytest.fixture(scope="module")
def model():
    return sharp_tiny_model()


def score_alone(model, req: ScoreRequest) -> SequenceScore:
    (events,) = run_all(Engine(model, TOK, EngineConfig(max_batch=1)), [req])
    assert len(events) == 1
    return events[0]


def close(a: SequenceScore, b: SequenceScore, atol: float) -> None:
    assert a.tokens.tolist() == b.tokens.tolist() and a.context_tokens == b.context_tokens
    torch.testing.assert_close(torch.tensor(a.base_logprob), torch.tensor(b.base_logprob), atol=atol, rtol=atol)
    assert a.greedy.tolist() == b.greedy.tolist()


def test_score_in_a_shared_batch_equals_score_alone_and_score_tokens(model) -> None:
    text = tuple(TOK.encode("the state of the union is strong, and so on " * 3))
    target = ScoreRequest(text, B, context=tuple(TOK.encode("Speech: ")))
    alone = score_alone(model, target)
    engine = Engine(model, TOK, EngineConfig(max_batch=4, prefill_chunk=24))
    gen = engine.submit(GenerationRequest(tuple(TOK.encode("generating")), 30, SamplingConfig(temperature=0),
                                          boundary_token=B))
    engine.step()
    other = engine.submit(ScoreRequest(tuple(TOK.encode("another text to score")), B))
    watched = engine.submit(target)
    engine.step()
    late = engine.submit(ScoreRequest(tuple(TOK.encode("late")), B))
    (shared,) = list(watched.events())
    close(shared, alone, 1e-5)
    (oracle,) = score_tokens(model, [list(text)], context=1024, stride=512, boundary_token=B,
                             contexts=[list(target.context)])
    close(shared, oracle, 1e-4)
    assert shared.context_tokens == 1 + len(target.context) and len(shared.tokens) == len(text)
    for h in (gen, other, late):
        list(h.events())
    assert not engine.busy


def test_score_refusals_and_cancellation(model) -> None:
    engine = Engine(model, TOK, EngineConfig(max_batch=1, row_capacity=16))
    with pytest.raises(MemlmError, match="over the rows' 16"):
        engine.submit(ScoreRequest(tuple(range(40)), B))
    with pytest.raises(MemlmError, match="empty"):
        ScoreRequest((), B)
    h = engine.submit(ScoreRequest(tuple(range(10)), B))
    h.cancel()
    with pytest.raises(MemlmError, match="cancelled"):
        list(h.events())


def test_xl_score_past_the_context_equals_score_tokens_segments() -> None:
    """A text three times a 32-token context, scored through the engine's XL rows (prefill chunks cutting
    segments), equals memlm.jobs.scoring's segment-recurrent scores with the same memory."""
    from memlm.memory.config import MemoryConfig
    from memlm.model.config import ModelConfig
    from memlm.model.decoder import build_model

    short = build_model(ModelConfig.from_name("tiny", max_seq_len=32))
    short.load_state_dict(sharp_tiny_model(seed=4).state_dict())
    memory = MemoryConfig(kind="xl", mem_len=12, segment=8, sink_tokens=4)
    text = tuple(TOK.encode("a long text read past the context in segments " * 2))
    engine = Engine(short.eval(), TOK, EngineConfig(max_batch=2, prefill_chunk=5, memory=memory))
    results = run_all(engine, [ScoreRequest(text, B), ScoreRequest(tuple(TOK.encode("beside it")), B)])
    (oracle,) = score_tokens_segments(short, [list(text)], memory=memory, boundary_token=B)
    close(results[0][0], oracle, 1e-4)
    plain = Engine(short, TOK, EngineConfig(max_batch=1, memory=MemoryConfig(kind="xl", mem_len=0, segment=8,
                                                                              sink_tokens=0)))
    (no_memory,) = run_all(plain, [ScoreRequest(text, B)])
    assert abs(no_memory[0].total_logprob - oracle.total_logprob) > 1e-3  # the memory matters
