"""SPALM + kNN-LM in evaluation (memlm.jobs.spalm.evaluate_spalm with knn): lambda 0 is SPALM
exactly, the gate forced to 1 with lambda is the XL model interpolated with kNN-LM by hand over the same
neighbours, lambda and T are tuned on the tuning documents by kNN-LM's tuner, and the command line."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from tiny_models import sharp_tiny_model

from memlm.cli import main
from memlm.jobs.segment_eval import SegmentStream
from memlm.jobs.spalm import evaluate_spalm
from memlm.jobs.windows import WindowConfig
from memlm.model.memory_config import MemoryConfig
from memlm.memory.spalm import SpalmHead
from memlm.memory.state import new_memory
from memlm.jobs.windows import exact_searcher_over_documents
from memlm.retrieval.knnlm import KNNLMConfig

BOUNDARY = 1
MEMORY = MemoryConfig(kind="spalm", segment=16, mem_len=16, sink_tokens=2)
K, KNN_K = 4, 16


def random_docs(n: int, length: int, seed: int) -> list[list[int]]:
    """Random byte documents."""
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 256, size=length).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def tiny():
    model = sharp_tiny_model()
    # ONE stored document: no two keys tie (every document's first position has the same key, and the order
    # of tied neighbours is the search's to choose), so the 16 nearest start with the 4 nearest.
    store_doc = random_docs(1, 480, seed=1)[0]
    searcher = exact_searcher_over_documents(model, [store_doc], WindowConfig(context=32, stride=16), BOUNDARY)
    counts = np.bincount(searcher.values, minlength=model.config.vocab_size)
    # Evaluation documents that share text with the datastore, so that the neighbours predict the targets.
    docs = [store_doc[100:150], store_doc[300:360], random_docs(1, 40, seed=5)[0]]
    head = SpalmHead(model.config.n_embd)
    with torch.no_grad():
        head.w_g.normal_(0, 0.3)
        head.bias.fill_(0.0)  # a gate that mixes: SPALM differs from XL
    return model, searcher, counts, docs, head


def spalm(tiny, head=None, **kw):
    model, searcher, counts, docs, trained = tiny
    return evaluate_spalm(model, head or trained, kw.pop("docs", docs), MEMORY, searcher, K, boundary_token=BOUNDARY,
                          token_counts=counts, batch_size=2, **kw)


def test_lambda_zero_is_spalm_exactly(tiny):
    alone = spalm(tiny)
    zero = spalm(tiny, knn=KNNLMConfig(k=KNN_K, lmbda=0.0, temperature=5.0))
    assert zero["nll"] == alone["nll"] and zero["spalm_nll"] == alone["nll"]
    assert zero["gate_mean"] == alone["gate_mean"] and zero["tokens"] == alone["tokens"]
    assert (zero["lambda"], zero["temperature"], zero["k"], zero["knn_k"]) == (0.0, 5.0, K, KNN_K)
    mixed = spalm(tiny, knn=KNNLMConfig(k=KNN_K, lmbda=0.3, temperature=5.0))
    assert mixed["spalm_nll"] == alone["nll"] and mixed["nll"] != alone["nll"]  # the mixture does something
    assert 0 < mixed["knn_hit_rate"] <= 1 and "lambda" not in alone


def test_gate_one_with_lambda_is_xl_plus_knnlm_by_hand(tiny):
    model, searcher, _counts, docs, _head = tiny
    forced = SpalmHead(model.config.n_embd)
    with torch.no_grad():
        forced.bias.fill_(float("inf"))  # g = 1: SPALM's logits are the XL model's
    lmbda, T = 0.3, 5.0
    result = spalm(tiny, head=forced, knn=KNNLMConfig(k=KNN_K, lmbda=lmbda, temperature=T))
    # Oracle: the XL segments, then per scored token its own search and p_kNN summed in float64.
    stream = SegmentStream(docs, 2, MEMORY.segment, BOUNDARY)
    state = new_memory(MemoryConfig(kind="xl", segment=16, mem_len=16, sink_tokens=2), 2)
    nll, n = 0.0, 0
    with torch.no_grad():
        while (batch := stream.next_batch()) is not None:
            state = state.reset_rows(batch.reset)
            out = model(batch.inputs, state)
            state = out.state
            logp = torch.log_softmax(out.logits.double(), dim=-1)  # (B, T, V)
            for b, t in batch.mask.nonzero().tolist():
                target = int(batch.targets[b, t])
                nb = searcher.search(out.knn_key[b, t][None].float().numpy(), KNN_K)
                weights = [math.exp(-float(d) / T) for d in nb.distances[0] if np.isfinite(d)]
                hit = sum(w for w, v in zip(weights, nb.values[0]) if int(v) == target)
                p = (1 - lmbda) * math.exp(float(logp[b, t, target])) + lmbda * hit / sum(weights)
                nll -= math.log(p)
                n += 1
    assert result["tokens"] == n and result["gate_mean"] == 1.0
    assert result["nll"] == pytest.approx(nll / n, rel=1e-5)
    assert result["spalm_nll"] != result["nll"]


def test_lambda_and_temperature_are_tuned_on_the_tuning_documents_by_knnlms_tuner(tiny):
    from memlm.jobs.knnlm_eval import DEFAULT_LAMBDAS

    tune_docs = [tiny[3][0][::-1], random_docs(1, 60, seed=9)[0]]
    auto = spalm(tiny, knn=KNNLMConfig(k=KNN_K, lmbda=None, temperature=None), tune_docs=tune_docs)
    assert auto["tuned"] is True and auto["lambda"] in DEFAULT_LAMBDAS and auto["temperature"] > 0
    assert auto["tune_tokens"] == sum(len(d) for d in tune_docs)
    # The tuner read SPALM's pass over the tuning documents: its perplexities are those of that pass.
    on_tune = spalm(tiny, docs=tune_docs, knn=KNNLMConfig(k=KNN_K, lmbda=auto["lambda"], temperature=auto["temperature"]))
    assert auto["tune_spalm_perplexity"] == pytest.approx(on_tune["spalm_perplexity"], rel=1e-5)
    assert auto["tune_perplexity"] == pytest.approx(on_tune["perplexity"], rel=1e-5)
    assert auto["tune_perplexity"] <= auto["tune_spalm_perplexity"]  # lambda 0 is on the grid
    fixed_t = spalm(tiny, knn=KNNLMConfig(k=KNN_K, lmbda=None, temperature=7.0), tune_docs=tune_docs)
    assert fixed_t["temperature"] == 7.0 and fixed_t["tuned"] is True
    with pytest.raises(Exception, match="need --tune-data"):
        spalm(tiny, knn=KNNLMConfig(k=KNN_K, lmbda=None))


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_memlm_eval_spalm_with_knnlm_end_to_end(capsys, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    rows = [{"text": f"Speech number {i}: the state of the union is strong and growing.", "year": 1990 + i}
            for i in range(14)]
    corpus.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    store = tmp_path / "store"
    code, _, err = run(capsys, "datastore", "build", "--model", "tiny", "--data", str(corpus), "--split", "year<2000",
                       "--out", str(store), "--context", "64", "--stride", "32", "--quiet")
    assert code == 0, err
    common = ["eval", "--model", "tiny", "--data", str(corpus), "--split", "year>=2002", "--quiet", "--memory", "spalm",
              "--datastore", str(store), "--k", "4", "--segment", "32", "--mem-len", "32"]
    out_json = tmp_path / "mixed.json"
    code, out, err = run(capsys, *common, "--lambda", "auto", "--knn-temperature", "auto", "--knn-k", "8",
                         "--tune-data", str(corpus), "--tune-split", "year>=2000[:2]", "--json", str(out_json))
    assert code == 0, err
    r = json.loads(out_json.read_text())
    assert r["tuned"] is True and r["k"] == 4 and r["knn_k"] == 8 and r["tune_documents"] == 2
    assert {"lambda", "temperature", "spalm_perplexity", "perplexity"} <= set(r) and "spalm_perplexity" in out
    code, _, err = run(capsys, *common, "--lambda", "0.25", "--json", str(out_json))
    assert code == 0, err
    r = json.loads(out_json.read_text())
    assert (r["lambda"], r["temperature"], r["knn_k"]) == (0.25, KNNLMConfig().temperature, KNNLMConfig().k)

    for flags, message in ((["--lambda", "auto", "--tune-data", str(corpus), "--tune-split", "year>=2003"],
                            "shares 1 document(s) with the evaluation data"),
                           (["--lambda", "auto"], "need --tune-data"),
                           (["--knn-k", "8"], "--knn-k is kNN-LM's in SPALM + kNN-LM: give --lambda")):
        code, _, err = run(capsys, *common, *flags)
        assert code == 1 and message in err and err.count("\n") == 1, err
    code, _, err = run(capsys, "eval", "--model", "tiny", "--data", str(corpus), "--datastore", str(store),
                       "--knn-k", "8", "--quiet")
    assert code == 1 and "--knn-k applies to --memory spalm" in err and err.count("\n") == 1, err
