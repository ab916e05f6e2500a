"""SPALM evaluation (memlm.jobs.spalm): gate 1 is `--memory xl` exactly, the gate report adds up,
frequency buckets match a hand count, and `memlm eval --memory spalm --datastore DIR` runs end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tiny_models import phrase_documents, sharp_tiny_model

from memlm.cli import main
from memlm.jobs.segment_eval import evaluate_memory
from memlm.jobs.spalm import BUCKETS, evaluate_spalm, frequency_buckets
from memlm.jobs.windows import WindowConfig
from memlm.model.memory_config import MemoryConfig
from memlm.memory.spalm import GATE_BIAS_INIT, SpalmHead
from memlm.jobs.windows import exact_searcher_over_documents

BOUNDARY = 1


def test_frequency_buckets_match_a_hand_count():
    counts = np.array([50, 0, 30, 10, 5, 5, 0])  # 100 tokens: 50 + 30 = 80% is the frequent head
    assert frequency_buckets(counts).tolist() == [0, 2, 0, 1, 1, 1, 2]
    counts = np.array([10, 60, 25, 5])  # 60 < 80, 60 + 25 crosses the cut: the crossing token counts
    assert frequency_buckets(counts).tolist() == [1, 0, 0, 1]
    assert frequency_buckets(np.zeros(3, dtype=np.int64)).tolist() == [2, 2, 2]


@pytest.fixture(scope="module")
def tiny():
    model = sharp_tiny_model()
    store_docs = phrase_documents(4, 96, seed=1)
    searcher = exact_searcher_over_documents(model, store_docs, WindowConfig(context=32, stride=16), BOUNDARY)
    counts = np.bincount(searcher.values, minlength=model.config.vocab_size)
    return model, searcher, counts, phrase_documents(3, 70, seed=1)


def test_gate_one_is_the_xl_evaluation_exactly_and_the_gate_report_adds_up(tiny):
    model, searcher, counts, docs = tiny
    memory = MemoryConfig(kind="spalm", segment=16, mem_len=16, sink_tokens=2)
    forced = SpalmHead(model.config.n_embd)
    with torch.no_grad():
        forced.bias.fill_(float("inf"))
    xl = evaluate_memory(model, docs, MemoryConfig(kind="xl", segment=16, mem_len=16, sink_tokens=2),
                         boundary_token=BOUNDARY, batch_size=2)
    one = evaluate_spalm(model, forced, docs, memory, searcher, 4, boundary_token=BOUNDARY, token_counts=counts,
                         batch_size=2)
    assert one["nll"] == xl["nll"] and one["tokens"] == xl["tokens"] == 210 and one["gate_mean"] == 1.0
    fresh = evaluate_spalm(model, SpalmHead(model.config.n_embd), docs, memory, searcher, 4, boundary_token=BOUNDARY,
                           token_counts=counts, batch_size=2)
    assert fresh["nll"] != xl["nll"] and fresh["neighbour_rate"] == 1.0
    g0 = float(torch.sigmoid(torch.tensor(GATE_BIAS_INIT)))  # w_g = 0: every gate is sigmoid(b)
    assert fresh["gate_mean"] == pytest.approx(g0, abs=1e-6)
    by = fresh["gate_by_frequency"]
    assert set(by) == set(BUCKETS) and sum(b["tokens"] for b in by.values()) == fresh["tokens"]
    buckets = frequency_buckets(counts)
    targets = np.concatenate([np.array(d) for d in docs])
    for i, name in enumerate(BUCKETS):
        assert by[name]["tokens"] == int((buckets[targets] == i).sum())


def speeches(tmp_path, n=12):
    corpus = tmp_path / "corpus.jsonl"
    rows = [{"text": f"Speech number {i}: the state of the union is strong and growing.", "year": 1990 + i}
            for i in range(n)]
    corpus.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return corpus


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_memlm_eval_memory_spalm_end_to_end(capsys, tmp_path):
    corpus, store = speeches(tmp_path), tmp_path / "store"
    code, _, err = run(capsys, "datastore", "build", "--model", "tiny", "--data", str(corpus), "--split", "year<2000",
                       "--out", str(store), "--context", "64", "--stride", "32", "--quiet")
    assert code == 0, err
    out_json = tmp_path / "spalm.json"
    common = ["eval", "--model", "tiny", "--data", str(corpus), "--split", "year>=2000", "--quiet"]
    code, out, err = run(capsys, *common, "--memory", "spalm", "--datastore", str(store), "--k", "4", "--segment", "32",
                         "--mem-len", "32", "--json", str(out_json))
    assert code == 0, err
    assert "no trained SPALM head" in err
    result = json.loads(out_json.read_text())
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines()[10:]]
    assert result["tokens"] == sum(len(t.encode()) for t in texts)  # byte tokenizer: every token scored once
    assert result["memory"] == "spalm" and result["k"] == 4 and result["head_trained"] is False
    assert result["neighbour_rate"] == 1.0 and 0.9 < result["gate_mean"] < 1.0
    assert sum(b["tokens"] for b in result["gate_by_frequency"].values()) == result["tokens"]
    assert result["tokens_per_s"] > 0 and "gate_mean" in out
    # the fresh head's gate is near 1: close to the XL model on the same segments, not equal to it
    code, _, err = run(capsys, *common, "--memory", "xl", "--segment", "32", "--mem-len", "32", "--json",
                       str(tmp_path / "xl.json"))
    assert code == 0, err
    xl = json.loads((tmp_path / "xl.json").read_text())
    assert xl["tokens"] == result["tokens"] and xl["nll"] != result["nll"]
    assert abs(xl["nll"] - result["nll"]) < 0.5

    for flags, message in ((["--tune-data", str(corpus)], "--tune-data tunes SPALM + kNN-LM: give --lambda auto"),
                           (["--context", "64"], "--context does not apply with --memory spalm"),
                           (["--knn-top-k", "4"], "--knn-top-k does not apply with --memory spalm")):
        code, _, err = run(capsys, *common, "--memory", "spalm", "--datastore", str(store), *flags)
        assert code == 1 and message in err and err.count("\n") == 1, err
    code, _, err = run(capsys, *common, "--memory", "spalm")
    assert code == 1 and "--memory spalm needs --datastore" in err and err.count("\n") == 1, err
