"""`memlm eval --datastore ... --attribution OUT.jsonl`: one JSON line per evaluated token,
written as the evaluation goes. Oracles: the interpolation identity for p_kNN, the listed masses summing to
it when every document is listed, and a stored document's tokens attributed to that document."""

from __future__ import annotations

import json

import numpy as np
import pytest

from datastore import Datastore, build_datastore
from memlm.cli import main

WORDS = ["union", "strong", "nation", "people", "congress", "war", "peace", "liberty", "freedom", "tax", "trade"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = np.random.default_rng(1)
    rows = [{"text": " ".join(rng.choice(WORDS, size=30)), "year": 1950 + i, "president": f"P{i}"} for i in range(5)]
    root = tmp_path_factory.mktemp("eval-attr")
    data = root / "corpus.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    store = build_datastore(model="tiny", data=str(data), out=root / "store", index="Flat", context=64, stride=32,
                            device="cpu", progress=False)
    return data, store


def test_every_evaluated_token_gets_its_documents(corpus, tmp_path, capsys):
    data, store = corpus
    out, result = tmp_path / "attr.jsonl", tmp_path / "result.json"
    main(["eval", "--model", "tiny", "--data", str(data), "--split", "year=1952", "--datastore", str(store),
          "--lambda", "0.5", "--knn-temperature", "1", "--k", "16", "--attribution", str(out),
          "--attribution-top-n", "5", "--device", "cpu", "--quiet", "--json", str(result)])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    summary = json.loads(result.read_text())
    assert len(lines) == summary["tokens"] == summary["attribution_tokens"] and summary["attribution_top_n"] == 5
    record = next(r for r in Datastore.open(store).documents() if r.meta["year"] == 1952)
    for line in lines:
        p_knn = (np.exp(line["logprob"]) - 0.5 * np.exp(line["base_logprob"])) / 0.5
        assert abs(line["knn_prob"] - p_knn) <= 1e-6
        assert abs(sum(d["knn_mass"] for d in line["documents"]) - line["knn_prob"]) <= 1e-9  # 5 documents: all
        assert line["documents"][0]["doc_id"] == record.doc_id and line["documents"][0]["meta"]["president"] == "P2"
        assert line["doc"] == 0 and line["generation"] == 0
    assert [line["position"] for line in lines] == list(range(len(lines)))
    nll = -sum(line["logprob"] for line in lines)  # the file's log-probs are the evaluation's
    assert np.isclose(nll, summary["knnlm_nll"], rtol=1e-6)


def test_attribution_flags_are_refused_where_they_do_not_apply(corpus, tmp_path, capsys):
    data, store = corpus
    assert main(["eval", "--model", "tiny", "--data", str(data), "--attribution", str(tmp_path / "a.jsonl"),
                 "--device", "cpu", "--quiet"]) != 0
    assert "--attribution applies to kNN-LM evaluation" in capsys.readouterr().err
    assert main(["eval", "--model", "tiny", "--data", str(data), "--datastore", str(store), "--attribution-top-n", "3",
                 "--device", "cpu", "--quiet"]) != 0
    assert "--attribution-top-n needs --attribution" in capsys.readouterr().err
    assert not (tmp_path / "a.jsonl").exists()
