"""`memlm generate --interpolation`: greedy tokens under a saved learned interpolation are the argmax of the
mixture the library's Score gives the same text, with its log-probabilities; a file fitted with another
datastore, a cache method and --k beside the file are refused in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from datastore import Datastore
from memlm.cli import main
from memlm.jobs.interpolation_eval import CacheConfig, collect_interpolation_data, fit_method
from memlm.jobs.scoring import score_tokens
from memlm.jobs.windows import WindowConfig
from memlm.model.tokenizer import document_boundary
from memlm.model.weights import load_pretrained
from memlm.retrieval.interpolation import FitConfig, save_method, served_knn
from memlm.retrieval.knnlm import KNNLMConfig

WINDOW = WindowConfig(64, 32, 4)
KNN = KNNLMConfig(k=8)
ATOL = 2e-3
"""Generate's decode steps and Score's window differ by float32 rounding, which standardising the tiny model's
near-constant entropy feature scales by about 1e3 (tests/services/test_lm_server_interpolation.py)."""


def run(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(tiny, datastore directory, the tuning split's data) over a small corpus."""
    root = tmp_path_factory.mktemp("generate_interpolation")
    corpus = root / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"Speech {i}: the union is strong and the fox is quick."})
                                for i in range(6)) + "\n")
    store = root / "store"
    assert main(["datastore", "build", "--model", "tiny", "--data", str(corpus), "--out", str(store), "--context",
                 "64", "--stride", "32", "--quiet"]) in (0, None)
    tiny = load_pretrained("tiny")
    ds = Datastore.open(store)
    tune = [tiny.tokenizer.encode("the union is quick and the fox is strong. " * 3)]
    data = collect_interpolation_data(tiny.model, tune, ds, WINDOW, KNN, CacheConfig(), document_boundary(tiny.tokenizer),
                                      progress=False)
    return tiny, store, ds, data


def saved(built, tmp_path, name: str, **changes):
    tiny, _, ds, data = built
    cache = CacheConfig()
    settings = {"model_fingerprint": tiny.fingerprint, "key_layer": tiny.model.config.key_description,
                "datastore_corpus_fingerprint": ds.info().corpus_fingerprint, "k": KNN.k, "context": WINDOW.context,
                "stride": WINDOW.stride, "cache_size": cache.size, "cache_k": cache.k, **changes}
    return save_method(fit_method(name, data, FitConfig()), tmp_path / f"{name}.json", settings)


def test_greedy_tokens_are_the_argmax_of_scores_mixture(capsys, tmp_path, built) -> None:
    tiny, store, ds, _ = built
    path, out_json = saved(built, tmp_path, "learned"), tmp_path / "g.json"
    code, _, err = run(capsys, "generate", "--model", "tiny", "--datastore", str(store), "--interpolation", str(path),
                       "--sampling-temperature", "0", "--max-new-tokens", "8", "--json", str(out_json), "Speech 3:")
    assert code == 0, err
    result = json.loads(out_json.read_text())["results"][0]
    boundary = document_boundary(tiny.tokenizer)
    knn = served_knn(KNN, path, model_fingerprint=tiny.fingerprint, key_layer=tiny.model.config.key_description,
                     corpus_fingerprint=ds.info().corpus_fingerprint)
    scored = score_tokens(tiny.model, [result["tokens"]], context=WINDOW.context, stride=WINDOW.stride,
                          boundary_token=boundary, contexts=[tiny.tokenizer.encode("Speech 3:")], searcher=ds, knn=knn)[0]
    assert len(result["tokens"]) == 8 and scored.greedy.all()
    assert np.allclose(result["logprobs"], scored.logprob, rtol=0.0, atol=ATOL)
    assert not np.allclose(result["logprobs"], result["base_logprobs"], rtol=0.0, atol=100 * ATOL)


def test_refusals_are_one_line(capsys, tmp_path, built) -> None:
    _, store, _, _ = built
    argv = ["generate", "--model", "tiny", "--datastore", str(store), "--max-new-tokens", "2", "x"]
    elsewhere = saved(built, tmp_path, "constant", datastore_corpus_fingerprint="another")
    code, _, err = run(capsys, *argv, "--interpolation", str(elsewhere))
    assert code != 0 and "fitted with datastore_corpus_fingerprint 'another'" in err and len(err.strip().splitlines()) == 1
    cache = saved(built, tmp_path, "constant+cache")
    code, _, err = run(capsys, *argv, "--interpolation", str(cache))
    assert code != 0 and "document cache" in err
    code, _, err = run(capsys, *argv, "--interpolation", str(cache), "--k", "4")
    assert code != 0 and "--k is the --interpolation file's" in err
