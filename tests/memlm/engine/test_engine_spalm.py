"""SPALM rows in the engine (memlm.engine.spalm_rows): the head's logits at every ready row against
the reference decoder with spalm_step (one sequence, stepped by hand), token for token with
log-probs, past the context; a SPALM row in a batch = alone; the head matters; refusals.

Shape legend: T tokens.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from tiny_models import phrase_documents, sharp_tiny_model

from memlm.engine.engine import Engine, run_all
from memlm.engine.requests import (
    EngineConfig,
    GenerationRequest,
    ScoreRequest,
    SpalmSettings,
)
from memlm.errors import MemlmError
from reference_decoding import reference_generate
from memlm.jobs.decoding import SamplingConfig, TokenEvent
from memlm.jobs.spalm_scoring import spalm_step
from memlm.jobs.windows import WindowConfig
from memlm.model.memory_config import MemoryConfig
from memlm.memory.spalm import SpalmHead
from memlm.model.config import ModelConfig
from memlm.model.decoder import build_model
from memlm.model.tokenizer import Tokenizer, document_boundary
from memlm.jobs.windows import exact_searcher_over_documents

TOK = Tokenizer.byte_level()
BOUNDARY = document_boundary(TOK)
SPALM = MemoryConfig(kind="spalm", segment=8, mem_len=10, sink_tokens=2)
GREEDY = SamplingConfig(temperature=0.0)
SAMPLED = SamplingConfig(temperature=1.0, top_k=40, seed=21)


@pytest.fixture(scope="module")
def setup():
    sharp = sharp_tiny_model(seed=5)
    model = build_model(ModelConfig.from_name("tiny", max_seq_len=32))
    model.load_state_dict(sharp.state_dict())
    model.eval()
    rng = np.random.default_rng(1)
    # One random document: every document's first key (after the boundary alone) is the same vector, and a
    # search of k and one of k' < k may order exactly tied neighbours differently (any order is exact).
    docs = [rng.integers(2, 256, size=384).tolist()]
    searcher = exact_searcher_over_documents(model, docs, WindowConfig(32, 16), BOUNDARY)
    torch.manual_seed(3)
    head = SpalmHead(model.config.n_embd)
    with torch.no_grad():  # a gate that varies by position (g near 0.5), so the retrieved tokens count
        head.w_g.normal_(0, 0.5)
        head.bias.zero_()
    return model, head, searcher


def request(prompt: list[int], n: int, sampling: SamplingConfig = GREEDY, k: int = 4) -> GenerationRequest:
    return GenerationRequest(tuple(prompt), n, sampling, boundary_token=BOUNDARY, spalm=SpalmSettings(k))


def library(model, head, searcher, req: GenerationRequest) -> list:
    return list(reference_generate(model, TOK, list(req.prompt_ids), max_new_tokens=req.max_new_tokens, sampling=req.sampling,
                                   boundary_token=BOUNDARY, memory=SPALM, segment_step=spalm_step(head, searcher, req.spalm.k)))


def pairs(events) -> list[tuple[int, float]]:
    return [(e.token_id, e.logprob) for e in events if isinstance(e, TokenEvent)]


def test_spalm_rows_equal_one_sequence_spalm_generation(setup) -> None:
    model, head, searcher = setup
    docs = phrase_documents(3, 40, seed=7)
    reqs = [request(docs[0][:30], 40), request(docs[1][:3], 40, k=2), request(docs[2][:12], 30, SAMPLED)]
    engine = Engine(model, TOK, EngineConfig(max_batch=2, prefill_chunk=5, memory=SPALM), searcher, spalm_head=head)
    for req, events in zip(reqs, run_all(engine, reqs)):
        got, want = pairs(events), pairs(library(model, head, searcher, req))
        assert [t for t, _ in got] == [t for t, _ in want]
        torch.testing.assert_close(torch.tensor([lp for _, lp in got]), torch.tensor([lp for _, lp in want]),
                                   atol=1e-4, rtol=1e-4)
    shut = SpalmHead(model.config.n_embd)  # gate 1 everywhere (bias +inf): the XL model's own logits
    with torch.no_grad():
        shut.bias.fill_(float("inf"))
    xl = Engine(model, TOK, EngineConfig(max_batch=1, memory=SPALM), searcher, spalm_head=shut)
    assert pairs(run_all(xl, reqs[:1])[0]) != pairs(library(model, head, searcher, reqs[0]))  # the head counts


def test_a_spalm_row_in_a_batch_yields_its_tokens_alone(setup) -> None:
    model, head, searcher = setup
    target = request(phrase_documents(1, 20, seed=9)[0], 35, SAMPLED)
    config = EngineConfig(max_batch=1, memory=SPALM)
    alone = pairs(run_all(Engine(model, TOK, config, searcher, spalm_head=head), [target])[0])
    engine = Engine(model, TOK, dataclasses.replace(config, max_batch=3, prefill_chunk=4), searcher, spalm_head=head)
    others = [engine.submit(request(list(range(40, 40 + 3 * i + 5)), 10 + 9 * i)) for i in range(2)]
    engine.step()
    watched = engine.submit(target)
    got = pairs(watched.events())
    assert [t for t, _ in got] == [t for t, _ in alone]
    for h in others:
        list(h.events())


def test_refusals(setup) -> None:
    model, head, searcher = setup
    with pytest.raises(MemlmError, match="SPALM head"):
        Engine(model, TOK, EngineConfig(memory=SPALM), searcher)
    with pytest.raises(MemlmError, match="no searcher"):
        Engine(model, TOK, EngineConfig(memory=SPALM), spalm_head=head)
    engine = Engine(model, TOK, EngineConfig(memory=SPALM), searcher, spalm_head=head)
    with pytest.raises(MemlmError, match="SPALM settings"):
        engine.submit(GenerationRequest((5, 6), 3, GREEDY, boundary_token=BOUNDARY))
    with pytest.raises(MemlmError, match="does not score"):
        engine.submit(ScoreRequest((5, 6), BOUNDARY))
