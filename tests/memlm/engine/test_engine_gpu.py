"""The engine on a CUDA device: the same tokens as on the CPU (float32), and bfloat16 runs; skipped without
a GPU (the loop is written to stay on the device; CPU is what CI tests)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import sharp_tiny_model

from memlm.engine.engine import Engine, run_all
from memlm.engine.requests import EngineConfig, GenerationRequest
from memlm.jobs.decoding import SamplingConfig, TokenEvent
from memlm.model.memory_config import MemoryConfig
from memlm.model.tokenizer import Tokenizer, document_boundary

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
TOK = Tokenizer.byte_level()


def tokens_on(model, memory=None) -> list[list[int]]:
    reqs = [GenerationRequest(tuple(TOK.encode(p)), 24, SamplingConfig(temperature=t, seed=3),
                              boundary_token=document_boundary(TOK)) for p, t in (("gpu", 0.0), ("cuda rows", 1.0))]
    results = run_all(Engine(model, TOK, EngineConfig(max_batch=2, prefill_chunk=4, memory=memory)), reqs)
    return [[e.token_id for e in ev if isinstance(e, TokenEvent)] for ev in results]


@pytest.mark.parametrize("memory", [None, MemoryConfig(kind="xl", mem_len=8, segment=4, sink_tokens=2)])
def test_cuda_greedy_equals_cpu(memory) -> None:
    cpu = sharp_tiny_model()
    expected = tokens_on(cpu, memory)
    got = tokens_on(sharp_tiny_model().to("cuda"), memory)
    assert got[0] == expected[0]  # greedy; the sampled row draws from the GPU's own generator stream
    assert len(got[1]) == 24


def test_cuda_bfloat16_runs() -> None:
    got = tokens_on(sharp_tiny_model().to("cuda", torch.bfloat16))
    assert [len(t) for t in got] == [24, 24]
