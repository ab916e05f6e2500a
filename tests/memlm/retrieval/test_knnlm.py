"""kNN-LM scoring, interpolation, tuning and evaluation (memlm.retrieval.knnlm, memlm.jobs.knnlm_eval) and the exact torch searcher
(memlm.retrieval.exact), against brute-force oracles and the invariants of the issue: lambda 0 is the base
LM bit for bit, and a datastore of the evaluation text itself drives perplexity to about 1."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from memlm.errors import MemlmError
from memlm.jobs.evaluate import evaluate_perplexity
from memlm.jobs.knnlm_eval import TuningData, evaluate_knnlm, recall_at_k, tune
from memlm.jobs.windows import WindowConfig, score_documents
from memlm.model.config import ModelConfig
from memlm.model.decoder import build_model
from memlm.retrieval.exact import TorchExactSearcher
from memlm.retrieval.knnlm import (
    KNNLMConfig,
    interpolate,
    knn_log_distribution,
    knn_logprob_from_matches,
    knn_mixture,
    knn_target_logprob,
)
from memlm.retrieval.searcher import Neighbors, SearchOptions, search_keys

V = 50
WINDOW = WindowConfig(context=48, stride=24, batch_size=4)
BOS = 1


def random_neighbors(rng: np.random.Generator, Q: int, k: int, missing: int = 0) -> Neighbors:
    distances = np.sort(rng.uniform(0, 20, size=(Q, k)).astype(np.float32), axis=1)
    values = rng.integers(0, 8, size=(Q, k)).astype(np.int32)  # few values: many repeats per row
    ids = rng.integers(0, 10_000, size=(Q, k)).astype(np.int64)
    if missing:
        distances[:, -missing:] = np.inf
        values[:, -missing:] = -1
        ids[:, -missing:] = -1
    return Neighbors(distances, ids, values)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 10.0])
def test_sparse_target_logprob_equals_dense_distribution_at_target(temperature):
    rng = np.random.default_rng(0)
    nb = random_neighbors(rng, Q=40, k=16, missing=3)
    targets = torch.from_numpy(rng.integers(0, 10, size=40))  # some targets never retrieved (8, 9)
    sparse = knn_target_logprob(nb, targets, temperature)  # (Q,)
    dense = knn_log_distribution(nb, V, temperature)  # (Q, V)
    gathered = dense.gather(1, targets[:, None])[:, 0]
    # Oracle in float64 probability space.
    w = np.exp(-nb.distances.astype(np.float64) / temperature)  # inf distance -> weight 0
    p = np.array([w[q][nb.values[q] == t].sum() / w[q].sum() for q, t in enumerate(targets.numpy())])
    with np.errstate(divide="ignore"):
        oracle = torch.from_numpy(np.log(p)).float()
    assert torch.isneginf(sparse).any() and torch.isfinite(sparse).any()  # both cases exercised
    torch.testing.assert_close(sparse, oracle, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gathered, oracle, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dense.exp().sum(1), torch.ones(40), rtol=1e-5, atol=1e-5)


def test_rows_without_neighbours_give_minus_inf_not_nan():
    distances = torch.full((2, 4), float("inf"))
    matches = torch.zeros(2, 4, dtype=torch.bool)
    out = knn_logprob_from_matches(distances, matches, 1.0)
    assert torch.isneginf(out).all()
    nb = Neighbors(distances.numpy(), -np.ones((2, 4), np.int64), -np.ones((2, 4), np.int32))
    dense = knn_log_distribution(nb, V, 1.0)
    assert not torch.isnan(dense).any() and torch.isneginf(dense).all()


def test_interpolate_lambda_zero_is_bit_identical_and_minus_inf_is_safe():
    lm = torch.log_softmax(torch.randn(64, V), dim=-1)[:, 3]  # (Q,)
    knn = torch.randn(64).clamp(max=0)
    knn[::3] = float("-inf")
    assert torch.equal(interpolate(lm, knn, 0.0), lm)
    assert torch.equal(interpolate(lm, knn, 1.0), knn)
    for lmbda in (1e-6, 0.25, 0.9, 1 - 1e-6):
        mixed = interpolate(lm, knn, lmbda)
        assert not torch.isnan(mixed).any()
        oracle = torch.log(lmbda * knn.double().exp() + (1 - lmbda) * lm.double().exp()).float()
        torch.testing.assert_close(mixed, oracle, rtol=1e-5, atol=1e-6)
    both = interpolate(torch.tensor([float("-inf")]), torch.tensor([float("-inf")]), 0.5)
    assert torch.isneginf(both).all()


def test_interpolate_dense_distribution_is_normalised():
    rng = np.random.default_rng(1)
    nb = random_neighbors(rng, Q=5, k=8, missing=2)
    lm = torch.log_softmax(torch.randn(5, V), dim=-1)  # (Q, V)
    mixed = interpolate(lm, knn_log_distribution(nb, V, 2.0), 0.3)
    torch.testing.assert_close(mixed.exp().sum(1), torch.ones(5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lmbda", [0.0, 1e-6, 0.3, 1.0])
def test_knn_mixture_equals_the_dense_interpolation_and_a_float64_oracle(lmbda):
    """knn_mixture (the logaddexp at the neighbours' tokens only) is interpolate over the dense p_kNN: the same
    floats wherever both are finite, -inf at the same places; rows with missing neighbours (token 0 retrieved
    in some rows, absent in others) and a row without any; lambda 0 returns the LM's tensor itself."""
    rng = np.random.default_rng(7)
    nb = random_neighbors(rng, Q=6, k=12, missing=4)
    nb.values[1][nb.values[1] == 0] = 5  # row 1: token 0 only as the missing neighbours' placeholder
    nb.distances[2], nb.values[2] = np.inf, -1  # row 2: no neighbours
    assert (nb.values[0] == 0).any()
    lm = torch.log_softmax(torch.randn(6, V) * 4, dim=-1)  # (Q, V)
    got = knn_mixture(lm, nb, 2.0, lmbda)
    if lmbda == 0.0:
        assert got is lm
        return
    dense = interpolate(lm, knn_log_distribution(nb, V, 2.0), lmbda)  # (Q, V)
    np.testing.assert_array_equal(torch.isneginf(got).numpy(), torch.isneginf(dense).numpy())
    torch.testing.assert_close(got, dense, rtol=1e-6, atol=0)
    w = np.exp(-nb.distances.astype(np.float64) / 2.0)  # (Q, k)
    p_knn = np.zeros((6, V))
    for q in range(6):
        np.add.at(p_knn[q], nb.values[q][nb.values[q] >= 0], w[q][nb.values[q] >= 0])
    p_knn /= np.maximum(p_knn.sum(1, keepdims=True), 1e-300)
    with np.errstate(divide="ignore"):
        oracle = np.log(lmbda * p_knn + (1 - lmbda) * lm.double().exp().numpy())
    finite = np.isfinite(oracle)
    np.testing.assert_array_equal(torch.isfinite(got).numpy(), finite)
    np.testing.assert_allclose(got.numpy()[finite], oracle[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_torch_exact_searcher_matches_brute_force(dtype):
    rng = np.random.default_rng(2)
    keys = torch.from_numpy(rng.normal(size=(700, 16)).astype(np.float32)).to(dtype)
    values = rng.integers(0, 100, size=700).astype(np.int32)
    searcher = TorchExactSearcher(keys, values, chunk_size=128)  # several chunks to merge
    xq = rng.normal(size=(9, 16)).astype(np.float32)
    nb = searcher.search(xq, 20)
    exact = ((xq[:, None, :].astype(np.float64) - keys.float().numpy()[None].astype(np.float64)) ** 2).sum(-1)
    oracle_ids = np.argsort(exact, axis=1)[:, :20]
    np.testing.assert_array_equal(nb.ids, oracle_ids)
    np.testing.assert_allclose(nb.distances, np.take_along_axis(exact, oracle_ids, 1), rtol=1e-4, atol=1e-3)
    np.testing.assert_array_equal(nb.values, values[oracle_ids])
    assert nb.distances.dtype == np.float32 and nb.ids.dtype == np.int64 and nb.values.dtype == np.int32


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_torch_exact_searcher_on_cpu_keys_equals_its_chunked_torch_search(dtype):
    """On the CPU the keys are searched by FAISS (faiss.knn a chunk, merged in a ResultHeap) over a float32 copy
    made once; the same neighbours as the chunked matmul and top-k the searcher runs on a GPU, and a query's
    neighbours whatever else is in the call."""
    rng = np.random.default_rng(3)
    keys = torch.from_numpy(rng.normal(size=(1000, 64)).astype(np.float32)).to(dtype)
    searcher = TorchExactSearcher(keys, rng.integers(0, 50, size=1000).astype(np.int32), chunk_size=300)
    xq = rng.normal(size=(5, 64)).astype(np.float32)
    assert searcher._cpu_chunks is None
    got = searcher.search(xq, 30)
    alone = searcher.search(xq[2:3], 30)
    assert searcher._cpu_chunks is not None and len(searcher._cpu_chunks) == 4  # chunks of 300, 300, 300, 100
    want_d, want_i = searcher._torch_search(torch.from_numpy(xq), 30)
    np.testing.assert_array_equal(got.ids, want_i)
    np.testing.assert_allclose(got.distances, want_d, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(alone.ids[0], got.ids[2])


def test_torch_exact_searcher_pads_when_k_exceeds_n():
    searcher = TorchExactSearcher(torch.randn(5, 4), np.arange(5, dtype=np.int32), chunk_size=2)
    nb = searcher.search(np.zeros((2, 4), np.float16), 8)
    assert (nb.ids[:, 5:] == -1).all() and (nb.values[:, 5:] == -1).all() and np.isinf(nb.distances[:, 5:]).all()
    assert sorted(nb.ids[0, :5]) == list(range(5))
    assert recall_at_k(searcher, searcher, np.zeros((2, 4), np.float32), 8) == 1.0


# -- evaluation on a tiny random model --------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(ModelConfig.from_name("tiny", vocab_size=V)).eval()


@pytest.fixture(scope="module")
def docs():
    rng = np.random.default_rng(3)
    return [rng.integers(2, V, size=n).tolist() for n in (130, 60, 95)]


def keys_of(model, docs) -> tuple[torch.Tensor, np.ndarray]:
    chunks = list(score_documents(model, docs, WINDOW, BOS, with_logprobs=False))
    keys = torch.cat([c.keys for c in chunks]).to(torch.float16)  # (N, d), stored as a datastore would
    values = torch.cat([c.targets for c in chunks]).numpy().astype(np.int32)  # (N,)
    return keys, values


def test_lambda_zero_gives_the_base_perplexity_exactly(model, docs):
    other = [np.random.default_rng(4).integers(2, V, size=200).tolist()]
    searcher = TorchExactSearcher(*keys_of(model, other))
    result = evaluate_knnlm(model, docs, searcher, WINDOW, KNNLMConfig(k=16, lmbda=0.0, temperature=1.0), BOS,
                            progress=False)
    base = evaluate_perplexity(model, docs, WINDOW, BOS, progress=False)
    assert result["knnlm_perplexity"] == result["base_perplexity"] == base["perplexity"]
    assert result["tokens"] == sum(map(len, docs))
    assert result["relative_change"] == 0.0


def test_datastore_of_the_evaluation_text_drives_perplexity_to_one(model, docs):
    searcher = TorchExactSearcher(*keys_of(model, docs))
    result = evaluate_knnlm(model, docs, searcher, WINDOW, KNNLMConfig(k=8, lmbda=0.999, temperature=1e-3), BOS,
                            exact_searcher=searcher, progress=False)
    assert result["base_perplexity"] > 20  # a random model over 50 tokens knows nothing
    assert result["knnlm_perplexity"] < 1.05
    assert result["knn_hit_rate"] == 1.0
    assert result["recall_at_k"] == 1.0  # exact searcher against itself
    assert (result["index"], result["datastore_size"]) == ("exact", len(searcher))


class MissesTheNearest:
    """A Searcher that loses each query's nearest neighbour (returns ranks 2..k+1): recall (k-1)/k
    exactly, against exact search. Records the options it was searched with."""

    def __init__(self, exact: TorchExactSearcher) -> None:
        self.exact = exact
        self.dim = exact.dim
        self.options: list[SearchOptions | None] = []

    def info(self):
        return self.exact.info()

    def search(self, xq, k, options=None):
        self.options.append(options)
        nb = self.exact.search(xq, k + 1)
        return Neighbors(*(a[:, 1:] for a in nb))  # (Q, k)


def test_recall_is_measured_with_the_given_exact_searcher_and_the_evaluation_options(model, docs):
    exact = TorchExactSearcher(*keys_of(model, docs))
    approx = MissesTheNearest(exact)
    knn = KNNLMConfig(k=8, lmbda=0.5, temperature=1.0, nprobe=3, exact_rerank=True)
    result = evaluate_knnlm(model, docs, approx, WINDOW, knn, BOS, exact_searcher=exact, recall_queries=50,
                            progress=False)
    assert result["recall_at_k"] == pytest.approx(7 / 8) and result["recall_at_10"] == pytest.approx(7 / 8)
    assert result["recall_queries"] == 50
    assert set(approx.options) == {SearchOptions(nprobe=3, exact_rerank=True)}  # every search, recall's too
    # Without an exact searcher recall is not reported (no searcher is guessed from attributes).
    assert "recall_at_k" not in evaluate_knnlm(model, docs, approx, WINDOW, knn, BOS, progress=False)


def test_auto_parameters_need_a_tuning_split(model, docs):
    searcher = TorchExactSearcher(*keys_of(model, docs))
    with pytest.raises(MemlmError, match="tuning split"):
        evaluate_knnlm(model, docs, searcher, WINDOW, KNNLMConfig(k=8, lmbda=None, temperature=None), BOS,
                       progress=False)


def test_tuning_uses_the_tuning_split_and_finds_memorised_text(model, docs):
    # Datastore = the tuning text: tuning must find a large lambda; evaluation text is unseen.
    tune_docs = docs[:2]
    searcher = TorchExactSearcher(*keys_of(model, tune_docs))
    result = evaluate_knnlm(model, docs[2:], searcher, WINDOW, KNNLMConfig(k=8, lmbda=None, temperature=None), BOS,
                            tune_docs=tune_docs, progress=False)
    assert result["tuned"] and result["tune_tokens"] == sum(map(len, tune_docs))
    assert result["lambda"] >= 0.9
    assert result["tune_knnlm_perplexity"] < 1.2 < result["tune_base_perplexity"]


def test_tune_finds_the_grid_minimum():
    rng = np.random.default_rng(5)
    n, k = 300, 12
    lm = torch.from_numpy(np.log(rng.uniform(0.01, 0.5, n))).float()
    distances = torch.from_numpy(np.sort(rng.uniform(0, 10, (n, k)), axis=1)).float()
    matches = torch.from_numpy(rng.uniform(size=(n, k)) < 0.2)
    data = TuningData(lm, distances, matches)
    lambdas, temps = [0.0, 0.1, 0.3, 0.6], [0.5, 2.0, 8.0]
    tuned = tune(data, lambdas, temps)

    def ppl(lmbda, t):
        knn = knn_logprob_from_matches(distances, matches, t)
        return math.exp(-interpolate(lm, knn, lmbda).double().mean().item())

    grid = {(l, t): ppl(l, t) for l in lambdas for t in temps}
    best = min(grid, key=grid.get)
    assert (tuned.lmbda, tuned.temperature) == best
    assert tuned.perplexity == pytest.approx(grid[best], rel=1e-6)
    # A kNN that never predicts the target: lambda 0 (the base LM) wins.
    never = tune(TuningData(lm, distances, torch.zeros_like(matches)))
    assert never.lmbda == 0.0 and never.perplexity == pytest.approx(never.base_perplexity)


def test_config_validates():
    with pytest.raises(MemlmError, match="--lambda must be in"):
        KNNLMConfig(lmbda=1.5)
    with pytest.raises(MemlmError, match="--knn-temperature must be positive"):
        KNNLMConfig(temperature=0.0)
    with pytest.raises(MemlmError, match="nprobe"):
        KNNLMConfig(nprobe=0)
    assert KNNLMConfig(exact_rerank=True, nprobe=4).search_options == SearchOptions(nprobe=4, exact_rerank=True)
    assert KNNLMConfig().search_options == SearchOptions()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_torch_exact_searcher_on_gpu_matches_cpu():
    rng = np.random.default_rng(6)
    keys = torch.from_numpy(rng.normal(size=(3000, 32)).astype(np.float16))
    values = rng.integers(0, 100, size=3000).astype(np.int32)
    xq = rng.normal(size=(17, 32)).astype(np.float32)
    cpu = TorchExactSearcher(keys, values, chunk_size=1000).search(xq, 50)
    gpu = TorchExactSearcher(keys.cuda(), values, chunk_size=1000).search(xq, 50)
    np.testing.assert_array_equal(cpu.ids, gpu.ids)
    np.testing.assert_allclose(cpu.distances, gpu.distances, rtol=1e-4, atol=1e-3)


def test_search_keys_sends_float32_numpy_and_the_options_unchanged():
    seen = []

    class Recording:
        dim = 4

        def search(self, xq, k, options=None):
            seen.append((xq, k, options))
            return Neighbors(np.zeros((len(xq), k), np.float32), np.zeros((len(xq), k), np.int64),
                             np.zeros((len(xq), k), np.int32))

    keys = torch.randn(3, 4).to(torch.bfloat16)  # (Q, d), as a bfloat16 model makes them
    options = SearchOptions(nprobe=2, exact_rerank=True)
    search_keys(Recording(), keys, 5, options)
    ((xq, k, got),) = seen
    assert isinstance(xq, np.ndarray) and xq.dtype == np.float32 and k == 5 and got is options
    np.testing.assert_array_equal(xq, keys.float().numpy())
