"""Memorizing rows in the engine (memlm.engine.memorizing_rows) against the reference decoder with knn_attention (the
library's one-sequence memorizing generation): tokens identical, log-probs within float32 rounding, for prompts
longer than a segment and generations longer than the XL memory (so the kNN memory is read, and evicts FIFO);
with kNN-LM too; a memorizing row in a batch of joiners and leavers = alone (greedy and seeded sampling); every
row's memory is closed when it leaves (cancelled too); refusals. The service backend: tests/services/
test_engine_memorizing_service.py.

Shape legend: T tokens.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
from tiny_models import phrase_documents, sharp_tiny_model

from memlm.engine.engine import Engine, run_all
from memlm.engine.requests import EngineConfig, GenerationRequest, ScoreRequest
from memlm.errors import MemlmError
from reference_decoding import reference_generate
from memlm.jobs.decoding import SamplingConfig, TokenEvent
from memlm.jobs.windows import WindowConfig
from memlm.model.memory_config import MemoryConfig
from memlm.memory.memorizing import new_knn_attention
from memlm.model.tokenizer import Tokenizer, document_boundary
from memlm.jobs.windows import exact_searcher_over_documents
from memlm.retrieval.knnlm import KNNLMConfig

TOK = Tokenizer.byte_level()
BOUNDARY = document_boundary(TOK)
MEMORY = MemoryConfig("memorizing", segment=8, mem_len=8, sink_tokens=2, knn_layer=1, knn_mem_size=40, knn_top_k=4,
                      knn_backend="exact")
"""mem_len + segment = 16 < the 30-token prompts and 40-token generations below; 40 entries: FIFO eviction."""
GREEDY = SamplingConfig(temperature=0.0)
SAMPLED = SamplingConfig(temperature=1.0, top_k=40, seed=21)


@pytest.fixture(scope="module")
def setup():
    model = sharp_tiny_model(n_layer=3, seed=5)  # the memorizing layer 1 feeds layer 2: a wrong memory shows
    module = new_knn_attention(model.config)
    with torch.no_grad():  # gates open (g = 0.5 in every head): the retrieved pairs change the logits
        module.gate_logit.zero_()
    return model, module


def request(prompt: list[int], n: int, sampling: SamplingConfig = GREEDY, knn: KNNLMConfig | None = None,
            ) -> GenerationRequest:
    return GenerationRequest(tuple(prompt), n, sampling, boundary_token=BOUNDARY, knn=knn)


def library(model, module, req: GenerationRequest, memory: MemoryConfig = MEMORY, searcher=None) -> list:
    return list(reference_generate(model, TOK, list(req.prompt_ids), max_new_tokens=req.max_new_tokens, sampling=req.sampling,
                                   boundary_token=BOUNDARY, memory=memory, searcher=searcher if req.knn else None, knn=req.knn,
                                   knn_attention=module if memory.kind == "memorizing" else None))


def pairs(events) -> list[tuple[int, float]]:
    return [(e.token_id, e.logprob) for e in events if isinstance(e, TokenEvent)]


def assert_same(got, want) -> None:
    assert [t for t, _ in got] == [t for t, _ in want] and got
    torch.testing.assert_close(torch.tensor([lp for _, lp in got]), torch.tensor([lp for _, lp in want]),
                               atol=1e-5, rtol=1e-5)


def engine(model, module, max_batch: int = 2, prefill_chunk: int = 256, searcher=None) -> Engine:
    config = EngineConfig(max_batch=max_batch, prefill_chunk=prefill_chunk, memory=MEMORY)
    return Engine(model, TOK, config, searcher, knn_attention=module)


@pytest.mark.parametrize("prefill_chunk", [256, 5])  # 5: a segment of 8 takes two chunks (keys wait in pending)
def test_memorizing_rows_equal_one_sequence_generation(setup, prefill_chunk) -> None:
    model, module = setup
    docs = phrase_documents(3, 40, seed=7)
    reqs = [request(docs[0][:30], 40), request(docs[1][:5], 36, SAMPLED), request(docs[2][:19], 30)]
    eng = engine(model, module, prefill_chunk=prefill_chunk)
    for req, events in zip(reqs, run_all(eng, reqs)):
        want = pairs(library(model, module, req))
        assert_same(pairs(events), want)
        assert want != pairs(library(model, module, req, dataclasses.replace(MEMORY, kind="xl")))  # the memory counts
    assert eng.memorizing.rows == {}  # every row's memory left with it


def test_the_knn_memory_is_read_past_the_xl_memory(setup) -> None:
    # A shut gate (logit -inf: g = 0 exactly) is the XL model through the engine; an open one is not.
    model, module = setup
    shut = new_knn_attention(model.config)
    with torch.no_grad():
        shut.gate_logit.fill_(float("-inf"))
    req = request(phrase_documents(1, 30, seed=3)[0], 40)
    xl = pairs(library(model, None, req, dataclasses.replace(MEMORY, kind="xl")))
    assert_same(pairs(run_all(engine(model, shut), [req])[0]), xl)
    assert pairs(run_all(engine(model, module), [req])[0]) != xl


def test_memorizing_with_knn_lm_equals_one_sequence(setup) -> None:
    model, module = setup
    rng = np.random.default_rng(1)
    searcher = exact_searcher_over_documents(model, [rng.integers(2, 256, size=200).tolist()], WindowConfig(32, 16),
                                             BOUNDARY)
    knn = KNNLMConfig(k=4, lmbda=0.4, temperature=2.0)
    docs = phrase_documents(2, 30, seed=11)
    reqs = [request(docs[0][:25], 30, knn=knn), request(docs[1][:9], 30, SAMPLED, knn=knn)]
    for req, events in zip(reqs, run_all(engine(model, module, searcher=searcher), reqs)):
        assert_same(pairs(events), pairs(library(model, module, req, searcher=searcher)))


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED])
def test_a_memorizing_row_in_a_batch_yields_its_tokens_alone(setup, sampling) -> None:
    model, module = setup
    target = request(phrase_documents(1, 26, seed=9)[0], 34, sampling)
    alone = pairs(run_all(engine(model, module, max_batch=1), [target])[0])
    eng = engine(model, module, max_batch=3, prefill_chunk=6)
    others = [eng.submit(request(list(range(40, 40 + 3 * i + 11)), 7 + 9 * i, SAMPLED)) for i in range(2)]
    eng.step()
    eng.step()
    watched = eng.submit(target)  # joins a running batch; the first other leaves before it ends
    late = eng.submit(request(list(range(90, 110)), 12))  # waits for a row, joins when one leaves
    got = pairs(watched.events())
    assert_same(got, alone)
    for h in (*others, late):
        list(h.events())
    assert eng.memorizing.rows == {}


def test_a_cancelled_row_closes_its_memory(setup) -> None:
    model, module = setup
    eng = engine(model, module)
    stay, leave = eng.submit(request(list(range(50, 80)), 20)), eng.submit(request(list(range(60, 90)), 20))
    for _ in range(3):
        eng.step()
    stores = {i: m.store for i, m in eng.memorizing.rows.items()}
    assert set(stores) == {stay.request_id, leave.request_id} and all(m.held > 0 for m in eng.memorizing.rows.values())
    leave.cancel()
    eng.step()
    assert set(eng.memorizing.rows) == {stay.request_id} and stores[leave.request_id].closed
    assert list(leave.events())[-1].reason == "cancelled"
    list(stay.events())
    assert stores[stay.request_id].closed and eng.memorizing.rows == {}


def test_a_failed_memory_ends_its_row_only(setup) -> None:
    model, module = setup
    eng = engine(model, module)
    target = request(list(range(50, 80)), 20)
    alone = pairs(run_all(engine(model, module, max_batch=1), [target])[0])
    ok, broken = eng.submit(target), eng.submit(request(list(range(60, 90)), 20))
    for _ in range(3):
        eng.step()
    eng.memorizing.rows[broken.request_id].store.close()  # its next search raises: "this key/value memory was closed"
    with pytest.raises(ValueError, match="was closed"):
        list(broken.events())
    assert_same(pairs(ok.events()), alone)
    assert eng.memorizing.rows == {}


def test_a_memory_failing_during_its_prompt_ends_its_row_at_the_next_step(setup) -> None:
    model, module = setup
    eng = engine(model, module, prefill_chunk=4)  # boundary + 40 prompt tokens: 11 steps
    broken = eng.submit(request(list(range(60, 100)), 5))
    for _ in range(4):  # 16 tokens in: two segments in the memory, the layer searches it
        eng.step()
    mem = eng.memorizing.rows[broken.request_id]
    assert mem.held == 16 and broken.ready() == []
    mem.store.close()
    eng.step()  # the search fails inside the pass: the row is still prefilling, nothing is emitted
    assert mem.error is not None and broken.ready() == []
    eng.step()  # the step boundary ends it with the error
    assert eng.memorizing.rows == {} and not eng.busy
    with pytest.raises(ValueError, match="was closed"):
        broken.ready()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_memorizing_rows_equal_one_sequence_generation(setup) -> None:
    # On the device the exact backend is the torch scan over float16 keys (memory_store.storage_dtype), the same
    # store on both sides: greedy tokens equal.
    model, module = (copy.deepcopy(m).to("cuda") for m in setup)
    docs = phrase_documents(2, 40, seed=13)
    reqs = [request(docs[0][:30], 40), request(docs[1][:11], 30)]
    for req, events in zip(reqs, run_all(engine(model, module), reqs)):
        assert [t for t, _ in pairs(events)] == [t for t, _ in pairs(library(model, module, req))]


def test_refusals(setup) -> None:
    model, module = setup
    with pytest.raises(MemlmError, match="needs a KnnAttention"):
        Engine(model, TOK, EngineConfig(memory=MEMORY))
    with pytest.raises(MemlmError, match="memorizing only, not xl"):
        Engine(model, TOK, EngineConfig(memory=dataclasses.replace(MEMORY, kind="xl")), knn_attention=module)
    with pytest.raises(MemlmError, match="memorizing only, not none"):
        Engine(model, TOK, EngineConfig(), knn_attention=module)
    other = new_knn_attention(dataclasses.replace(model.config, n_head=2, n_kv_head=1))
    with pytest.raises(MemlmError, match="kNN attention made for heads"):
        Engine(model, TOK, EngineConfig(memory=MEMORY), knn_attention=other)
    with pytest.raises(MemlmError, match="does not score"):
        engine(model, module).submit(ScoreRequest((5, 6), BOUNDARY))
