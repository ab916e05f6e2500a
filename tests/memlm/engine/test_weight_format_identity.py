"""Greedy identity in every weight format on the tiny preset: a request decoded in a batch of six yields the tokens
it yields alone, and speculative decoding (drafts from the row's own text) yields plain decoding's tokens.

These hold at the tiny preset's sizes on the CPU in each format; on the real model bfloat16's kernels are not
batch-invariant (docs/decisions/weight-formats.md), which the benchmark checks rather than a test.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_models import sharp_tiny_model

from memlm.engine.drafts import SpeculativeConfig
from memlm.engine.engine import Engine, run_all
from memlm.engine.requests import EngineConfig, GenerationRequest
from memlm.jobs.decoding import SamplingConfig, TokenEvent
from memlm.model.tokenizer import Tokenizer, document_boundary
from memlm.model.weight_formats import WEIGHT_FORMATS, convert, format_of, resolve_format

TOK = Tokenizer.byte_level()
GREEDY = SamplingConfig(temperature=0.0)
HISTORY = SpeculativeConfig(draft_tokens=6, draft_k=16, min_agreeing=1, draft_from="history")
TEXTS = ("the cat sat on the mat. the cat sat on the mat. the cat", "once upon a time", "hello world hello world",
         "a b c d a b c d a", "memory lane memory", "xyz")


def tokens(events) -> list[int]:
    return [e.token_id for e in events if isinstance(e, TokenEvent)]


@pytest.fixture(scope="module", params=WEIGHT_FORMATS)
def model(request):
    converted = convert(sharp_tiny_model(), resolve_format(request.param, None, torch.device("cpu")))
    assert format_of(converted) == request.param
    return converted


def requests() -> list[GenerationRequest]:
    return [GenerationRequest(tuple(TOK.encode(t)), 20 + i, GREEDY, boundary_token=document_boundary(TOK))
            for i, t in enumerate(TEXTS)]


def test_batched_greedy_equals_alone(model) -> None:
    batched = run_all(Engine(model, TOK, EngineConfig(max_batch=len(TEXTS))), requests())
    for r, events in zip(requests(), batched):
        assert tokens(events) == tokens(run_all(Engine(model, TOK, EngineConfig(max_batch=1)), [r])[0])


def test_speculative_greedy_equals_plain(model) -> None:
    plain = run_all(Engine(model, TOK, EngineConfig(max_batch=len(TEXTS))), requests())
    spec = run_all(Engine(model, TOK, EngineConfig(max_batch=len(TEXTS))),
                   [dataclasses.replace(r, speculative=HISTORY) for r in requests()])
    assert [tokens(s) for s in spec] == [tokens(p) for p in plain]
    assert sum(s[-1].verified_tokens for s in spec) > sum(s[-1].verify_steps for s in spec)  # drafts were taken
