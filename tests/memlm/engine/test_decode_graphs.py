"""memlm.engine.decode_graphs: the fixed-shape decode step (a CUDA graph per row bucket on a GPU) gives the
ordinary step's tokens and log-probs, with requests joining and leaving, padding rows, sliding rows and
kNN-LM; it reads nothing back to the host inside the step (traced whole by torch._dynamo); the capture on a
GPU gives the eager step's tokens (skipped without one).

Shape legend: N datastore entries, C key width.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_models import sharp_tiny_model

from memlm.engine.decode_graphs import MIN_WIDTH, DecodeGraphs, _FixedStep, bucket, bucket_width
from memlm.engine.engine import Engine, run_all
from memlm.engine.requests import EngineConfig, GenerationRequest, ScoreRequest
from memlm.errors import MemlmError
from memlm.jobs.decoding import SamplingConfig, TokenEvent
from memlm.model.memory_config import MemoryConfig
from memlm.model.tokenizer import Tokenizer, document_boundary
from memlm.retrieval.exact import TorchExactSearcher
from memlm.retrieval.knnlm import KNNLMConfig

TOK = Tokenizer.byte_level()
BOUNDARY = document_boundary(TOK)
GREEDY = SamplingConfig(temperature=0.0)
SAMPLED = SamplingConfig(temperature=1.0, top_k=40, top_p=0.9, seed=7)
KNN = KNNLMConfig(k=8, lmbda=0.6, temperature=5.0)


@pytest.fixture(scope="module")
def model():
    return sharp_tiny_model()


def requests(knn: KNNLMConfig | None = None) -> list[GenerationRequest]:
    """Seven requests of different lengths through a batch of 4: rows join and leave at different steps, and
    most steps have fewer rows than their bucket (padding rows)."""
    texts = ["the cat", "a dog sat on", "x", "the mat and the", "on the log", "sat"]
    reqs = [GenerationRequest(tuple(TOK.encode(t)), 6 + 3 * i, GREEDY if i % 2 == 0 else SAMPLED,
                              boundary_token=BOUNDARY, knn=knn) for i, t in enumerate(texts)]
    # and one that runs through the width buckets 64, 128 and 256 (bucket_width)
    return [*reqs, GenerationRequest(tuple(TOK.encode("the dog and the cat " * 3)), 200, GREEDY,
                                     boundary_token=BOUNDARY, knn=knn)]


def run(model, reqs, graphs: bool, searcher=None, **config):
    engine = Engine(model, TOK, EngineConfig(max_batch=4, prefill_chunk=8, cuda_graphs=graphs, **config), searcher)
    events = run_all(engine, reqs)
    out = [[(e.token_id, e.logprob) for e in ev if isinstance(e, TokenEvent)] for ev in events]
    return out, engine


def assert_same(got, expected) -> None:
    for g, e in zip(got, expected, strict=True):
        assert [t for t, _ in g] == [t for t, _ in e]
        assert [lp for _, lp in g] == pytest.approx([lp for _, lp in e], abs=1e-5)


def test_bucket_is_the_next_power_of_two_within_the_batch() -> None:
    assert [bucket(n, 8) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert [bucket(n, 6) for n in (3, 5, 6)] == [4, 6, 6]
    assert [bucket_width(n, 512) for n in (1, MIN_WIDTH, MIN_WIDTH + 1, 300, 512)] == [MIN_WIDTH, MIN_WIDTH, 128, 512, 512]
    assert bucket_width(100, 96) == 96


def test_fixed_steps_give_the_ordinary_steps_tokens(model) -> None:
    expected, plain = run(model, requests(), graphs=False)
    got, engine = run(model, requests(), graphs=True)
    assert_same(got, expected)
    assert plain.graphs is None and engine.graphs.replays > 10  # the fixed step ran, not the ordinary one


def test_fixed_steps_with_sliding_rows(model) -> None:
    # row_capacity 12: the longer requests fill their rows and slide (a prefill step) between fixed steps
    expected, _ = run(model, requests(), graphs=False, row_capacity=12)
    got, engine = run(model, requests(), graphs=True, row_capacity=12)
    assert_same(got, expected)
    assert engine.graphs.replays > 10


def test_fixed_steps_with_knnlm(model) -> None:
    ids = [BOUNDARY, *TOK.encode("the cat sat on the mat and the dog sat on the log; " * 3)]
    with torch.inference_mode():
        keys = model(torch.tensor([ids[:-1]])).knn_key[0]  # (N, C)
    searcher = TorchExactSearcher(keys.float(), torch.tensor(ids[1:]).numpy())
    expected, _ = run(model, requests(KNN), graphs=False, searcher=searcher)
    got, engine = run(model, requests(KNN), graphs=True, searcher=searcher)
    assert_same(got, expected)
    assert engine.graphs.replays > 10


def test_a_score_row_beside_the_decode_rows_keeps_the_ordinary_step(model) -> None:
    """A Score row in the running batch (or a speculative one) is in no fixed step: it would sit where a padding
    row writes. With it running, the decode rows take the ordinary step, and its scores are the same either way
    (taking the fixed step anyway moved its log-probs by up to 3 nats)."""
    def go(graphs: bool):
        reqs = [GenerationRequest(tuple(TOK.encode(t)), 20, GREEDY, boundary_token=BOUNDARY) for t in ("the cat", "a dog", "x")]
        reqs.append(ScoreRequest(tuple(TOK.encode("the mat and the log and the cat sat on it")), BOUNDARY))
        engine = Engine(model, TOK, EngineConfig(max_batch=4, prefill_chunk=4, cuda_graphs=graphs))
        events = run_all(engine, reqs)
        return [[e.token_id for e in ev if isinstance(e, TokenEvent)] for ev in events[:3]], events[3][-1], engine

    tokens, score, _ = go(False)
    got_tokens, got_score, engine = go(True)
    assert got_tokens == tokens
    assert got_score.logprob == pytest.approx(score.logprob, abs=1e-5)
    assert engine.graphs.replays > 0  # the decode rows took the fixed step once the score had ended


def test_only_the_plain_cache() -> None:
    with pytest.raises(MemlmError, match="plain KV cache"):
        EngineConfig(cuda_graphs=True, memory=MemoryConfig(kind="xl", mem_len=8, segment=4))


def test_the_step_reads_nothing_back_to_the_host() -> None:
    """A CUDA graph cannot hold a host read (.item(), .tolist(), boolean indexing): torch._dynamo traces the
    whole step as one graph only if there is none (each would be a graph break). In bfloat16, the dtype of the
    GPU path, whose Linear is F.linear (CPU float32 inference takes oneDNN's op, cpu_gemm.cpu_float32_gemm)."""
    model = sharp_tiny_model().to(torch.bfloat16)
    engine = Engine(model, TOK, EngineConfig(max_batch=4, cuda_graphs=True))
    graphs: DecodeGraphs = engine.graphs
    b = 4
    idx = torch.tensor([5, 6, 7, 0])
    pos = torch.tensor([3, 1, 4, 0])
    real = torch.tensor([True, True, True, False])

    def step(idx, pos, real):
        out = graphs.model(idx[:, None], state=_FixedStep(graphs.cache, pos, real, MIN_WIDTH))
        return out.logits[:, -1], out.knn_key[:, -1]

    torch._dynamo.reset()
    with torch.inference_mode():
        explained = torch._dynamo.explain(step)(idx, pos, real)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    assert b == bucket(3, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_give_the_eager_steps_tokens() -> None:
    gpu = sharp_tiny_model().to("cuda")
    greedy = [dataclasses.replace(r, sampling=GREEDY) for r in requests()]
    expected, _ = run(gpu, greedy, graphs=False)
    got, engine = run(gpu, greedy, graphs=True)
    assert_same(got, expected)
    assert engine.graphs.capture and len(engine.graphs._graphs) >= 2  # buckets captured and replayed
