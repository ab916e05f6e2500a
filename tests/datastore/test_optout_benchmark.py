"""benchmarks/optout.py (the SILO opt-out experiment) on a tiny model: its partition, and the
three states -- with his documents, after remove (which must equal a datastore of the background alone,
bit for bit), after add (the first perplexity again) -- and its table; the benchmark itself runs it on SmolLM2."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import optout

from datastore import BuildSettings, build_from_tokens
from datastore.documents import source_documents
from memlm.data.documents import Document
from memlm.jobs.windows import WindowConfig
from memlm.model.tokenizer import document_boundary
from memlm.model.weights import load_pretrained
from memlm.retrieval.knnlm import KNNLMConfig

PHRASE = "we shall nobly save or meanly lose the last best hope of earth. "


def corpus() -> list[Document]:
    rng = np.random.default_rng(0)
    words = ["union", "tariff", "state", "war", "bank", "land", "treaty", "navy", "coin", "mail"]

    def filler(n: int) -> str:
        return " ".join(rng.choice(words, size=n)) + ". "

    rows = []
    for year in range(1850, 1866):
        president = "Abraham Lincoln" if year >= 1861 else ("Pierce" if year < 1857 else "Buchanan")
        text = filler(30) + (PHRASE * 3 if president == "Abraham Lincoln" else "") + filler(20)
        rows.append(Document(text, {"year": year, "president_full": president}))
    return rows


def test_partition_holds_out_his_last_speech():
    docs = corpus()
    part = optout.partition(docs, "president_full", "Abraham Lincoln", 1, "1855<=year<=1870")
    assert [d.meta["year"] for d in part.evaluated] == [1865]
    assert [d.meta["year"] for d in part.opted_out] == [1861, 1862, 1863, 1864]
    assert [d.meta["year"] for d in part.store] == list(range(1855, 1865))  # in corpus order, his included
    with pytest.raises(SystemExit, match="needs more than|need more than"):
        optout.partition(docs, "president_full", "Abraham Lincoln", 5, None)


@pytest.fixture(scope="module")
def setup():
    pre = load_pretrained("tiny")
    return optout.Setup(pre, "tiny", document_boundary(pre.tokenizer), WindowConfig(context=32, stride=16),
                        KNNLMConfig(k=8, lmbda=0.5, temperature=1.0), "Flat")


def test_the_gain_appears_disappears_and_returns(setup, tmp_path):
    part = optout.partition(corpus(), "president_full", "Abraham Lincoln", 1, "1855<=year<=1870")
    result = optout.run(setup, part, tmp_path / "store", 'president_full="Abraham Lincoln"', None)
    states = result["states"]
    assert [states[s]["generation"] for s in optout.STATES] == [0, 1, 2]
    # Oracle for "removed": a datastore of the background alone, evaluated the same way.
    background = [d for d in part.store if d.meta["president_full"] != "Abraham Lincoln"]
    alone = tmp_path / "alone"
    build_from_tokens(setup.pre.model, source_documents(background, setup.pre.tokenizer), alone,
                      optout.BuildSource("tiny", setup.pre.fingerprint, setup.pre.tokenizer.fingerprint, "bg", "f",
                                         setup.boundary),
                      BuildSettings(window=setup.window, index_factory="Flat"), progress=False, log=lambda m: None)
    eval_tokens = [setup.pre.tokenizer.encode(d.text) for d in part.evaluated]
    assert states["removed"] == optout._evaluate(setup, eval_tokens, alone) | {"generation": 1}
    assert states["re-added"]["knnlm_perplexity"] == pytest.approx(states["with"]["knnlm_perplexity"], rel=1e-9)
    assert states["with"]["knnlm_perplexity"] < states["removed"]["knnlm_perplexity"]  # his phrase helped
    assert states["removed"]["entries"] < states["with"]["entries"] == states["re-added"]["entries"]
    assert len({states[s]["base_perplexity"] for s in optout.STATES}) == 1
    text = optout.table(result, "Abraham Lincoln")
    assert text.count("\n| ") == 3 and "ratio" in text


def test_main_runs_synthetic_on_a_local_corpus(tmp_path, capsys):
    path = tmp_path / "speeches.jsonl"
    path.write_text("".join(json.dumps({"text": d.text, **d.meta}) + "\n" for d in corpus()))
    optout.main(["--model", "tiny", "--synthetic", "--data", str(path), "--background", "1857<=year<=1870",
                 "--context", "32", "--stride", "16", "--k", "8", "--results", str(tmp_path / "results")])
    out = capsys.readouterr().out
    assert "SYNTHETIC" in out and "| re-added |" in out
    record = json.loads((tmp_path / "results" / "optout.json").read_text())  # benchmarks/harness.py's result
    assert record["synthetic"] and record["settings"]["opted_out_documents"] == 4
    assert [row["state"] for row in record["rows"]] == list(optout.STATES)
