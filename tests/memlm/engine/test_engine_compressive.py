"""memlm.engine with compressive rows (Rae et al. 2019): the engine's compressed groups against
the reference decoder's one-sequence CompressiveMemory generation, a compressive row inside a batch = alone,
the layout's memory window against push_fifo's eviction by groups.

Shape legend: T tokens.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_models import sharp_tiny_model

from memlm.engine.engine import Engine, run_all
from memlm.engine.kv_cache import CacheLayout
from memlm.engine.requests import EngineConfig, GenerationRequest
from memlm.errors import MemlmError
from reference_decoding import reference_generate
from memlm.jobs.decoding import SamplingConfig, TokenEvent
from memlm.model.memory_config import MemoryConfig
from memlm.memory.xl import push_fifo
from memlm.model.config import ModelConfig
from memlm.model.decoder import LayerMemory, build_model
from memlm.model.tokenizer import Tokenizer, document_boundary

GREEDY = SamplingConfig(temperature=0.0)
SAMPLED = SamplingConfig(temperature=1.0, top_k=50, top_p=0.9, seed=99)
TOK = Tokenizer.byte_level()
BOUNDARY = document_boundary(TOK)
COMPRESSIVE = MemoryConfig(kind="compressive", mem_len=8, cmem_len=5, compress_rate=3, segment=6, sink_tokens=2)


def short_context_model(max_seq_len: int = 32, seed: int = 3):
    sharp = sharp_tiny_model(seed=seed)
    short = build_model(ModelConfig.from_name("tiny", max_seq_len=max_seq_len))
    short.load_state_dict(sharp.state_dict())
    return short.eval()


def request(text: str, n: int, sampling: SamplingConfig = GREEDY) -> GenerationRequest:
    return GenerationRequest(tuple(TOK.encode(text)), n, sampling, boundary_token=BOUNDARY)


def one_sequence(model, req: GenerationRequest, memory: MemoryConfig) -> list:
    return list(reference_generate(model, TOK, list(req.prompt_ids), max_new_tokens=req.max_new_tokens, sampling=req.sampling,
                                   boundary_token=BOUNDARY, memory=memory))


def tokens(events) -> list[int]:
    return [e.token_id for e in events if isinstance(e, TokenEvent)]


def logprobs(events) -> torch.Tensor:
    return torch.tensor([e.logprob for e in events if isinstance(e, TokenEvent)])


@pytest.mark.parametrize("memory", [COMPRESSIVE, dataclasses.replace(COMPRESSIVE, compress_fn="max"),
                                    dataclasses.replace(COMPRESSIVE, sink_tokens=0, compress_rate=2, cmem_len=3)],
                         ids=["mean", "max", "no-sinks"])
def test_compressive_rows_equal_one_sequence_compressive_generation(memory) -> None:
    """Far past a 32-token context, with many groups compressed and the oldest dropped from the compressed
    FIFO: every row (prompt chunks cut by the prefill budget, batched) makes the library's tokens, with its
    log-probs; the library's compressive log-probs differ from XL's, so the compressed slots are tested."""
    model = short_context_model()
    reqs = [request("a long document to compress " * 3, 50), request("y", 50), request("sampled one", 40, SAMPLED)]
    results = run_all(Engine(model, TOK, EngineConfig(max_batch=2, prefill_chunk=5, memory=memory)), reqs)
    for req, events in zip(reqs, results):
        ref = one_sequence(model, req, memory)
        assert tokens(events) == tokens(ref)
        torch.testing.assert_close(logprobs(events), logprobs(ref), atol=1e-4, rtol=1e-4)
    xl = one_sequence(model, reqs[0], dataclasses.replace(memory, kind="xl"))
    assert (logprobs(xl) - logprobs(one_sequence(model, reqs[0], memory))).abs().max() > 1e-2


def test_a_compressive_row_in_a_batch_yields_its_tokens_alone() -> None:
    model = short_context_model(seed=4)
    target = request("the watched row", 45, SAMPLED)
    alone = tokens(run_all(Engine(model, TOK, EngineConfig(max_batch=1, memory=COMPRESSIVE)), [target])[0])
    engine = Engine(model, TOK, EngineConfig(max_batch=3, prefill_chunk=4, memory=COMPRESSIVE))
    first = engine.submit(request("before it " * 4, 20))
    engine.step()
    watched = engine.submit(target)
    for _ in range(5):
        engine.step()
    later = [engine.submit(request(f"joins {i}", 10 + 7 * i)) for i in range(3)]
    assert tokens(watched.events()) == alone
    for h in [first, *later]:
        list(h.events())


@pytest.mark.parametrize(("mem_len", "rate", "sink"), [(8, 3, 2), (5, 1, 0), (0, 4, 1), (7, 2, 0)])
def test_memory_window_is_push_fifo_eviction_by_groups(mem_len, rate, sink) -> None:
    """CacheLayout.memory_start / groups_before against memlm.memory.xl.push_fifo fed segment by segment."""
    layout = CacheLayout(1, sink, mem_len + rate - 1 + 6, mem_len, 6, 4, rate)
    fifo, pos, evicted = None, sink, 0
    for T in [6, 1, 1, 6, 3, 1, 6, 6, 1, 1, 1, 2] * 3:
        p = torch.arange(pos, pos + T, dtype=torch.float32)[None]  # (1, T)
        new = LayerMemory(torch.zeros(1, T, 1, 1), torch.zeros(1, T, 1, 1), p, torch.ones(1, T, dtype=torch.bool))
        fifo, out = push_fifo(fifo, new, mem_len, rate, want_evicted=True)
        evicted += 0 if out is None else int(out.valid.sum())
        pos += T
        held = fifo.pos[fifo.valid]
        start = int(layout.memory_start(torch.tensor([[pos]]))[0, 0])
        assert max(start, sink) == (int(held.min()) if len(held) else pos)
        assert layout.groups_before(pos) * rate == evicted


def test_refuses_a_learned_compressor() -> None:
    with pytest.raises(MemlmError, match="pooling"):
        EngineConfig(memory=dataclasses.replace(COMPRESSIVE, compress_fn="conv"))
