"""`memlm generate --pointers --min-pointers N / --adaptive-gate DIR --adaptive-threshold X | --adaptive-fraction F`:
a minimum above --k and threshold 0 generate plain kNN-LM's tokens with its searches; with savings,
--json carries searches and searches_saved (their sum: the tokens chosen), recorded with the settings;
refusals are one line. (Through a retrieval server: tests/services/test_lm_generate_fewer.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from datastore import Datastore
from memlm.cli import main
from memlm.model.weights import load_pretrained
from memlm.retrieval.adaptive import (
    GateConfig,
    GateSettings,
    RetrievalGate,
    distribution_features,
    save_gate,
    score_quantiles,
)

PROMPTS = ["Speech 1: the union", "the union is", "Speech"]


def run(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fewer_cli")
    corpus = tmp / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"Speech {i}: the union is strong and the people are free."})
                                for i in range(6)) + "\n")
    out = tmp / "store"
    assert main(["datastore", "build", "--model", "tiny", "--data", str(corpus), "--out", str(out), "--context", "64",
                 "--stride", "32", "--quiet"]) == 0
    return out


@pytest.fixture(scope="module")
def gate_dir(store, tmp_path_factory):
    """A random gate for the tiny model and this datastore, standardised on the prompts' features, its
    quantiles their scores (--adaptive-fraction 0.5: about half of the searches skipped)."""
    tiny, info = load_pretrained("tiny"), Datastore.open(store).info()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        net = RetrievalGate(5, 8).eval()
    with torch.inference_mode():
        text = [tiny.tokenizer.encode(p + " is strong and the people are free.") for p in PROMPTS]
        x = torch.cat([distribution_features(tiny.model(torch.tensor([t])).logits[0].float().log_softmax(-1))
                       for t in text])  # (n, 5)
    net.mean.copy_(x.mean(dim=0))
    net.std.copy_(x.std(dim=0))
    settings = GateSettings(tiny.fingerprint, tiny.model.config.key_description, info.corpus_fingerprint, 8, 1.0, 0.9,
                            GateConfig(hidden=8, key_components=0), 5, (), "t", 1, 0.5, 0.5,
                            score_quantiles(net.scores(x)))
    return save_gate(net.eval(), settings, tmp_path_factory.mktemp("gate") / "g")


def generate(capsys, tmp_path, store_flags, *flags):
    out = tmp_path / f"g{len(list(tmp_path.iterdir()))}.json"
    code, _, err = run(capsys, "generate", "--model", "tiny", *store_flags, "--k", "8", "--lambda", "0.9",
                       "--knn-temperature", "1", "--sampling-temperature", "0", "--max-new-tokens", "16",
                       "--json", str(out), *flags, *PROMPTS)
    assert code == 0, err
    return json.loads(out.read_text())


def test_no_savings_is_plain_knnlm_and_savings_are_reported(capsys, tmp_path, store, gate_dir):
    local = ["--datastore", str(store)]
    plain = generate(capsys, tmp_path, local)
    for flags in (["--pointers", "--min-pointers", "9"], ["--adaptive-gate", str(gate_dir), "--adaptive-threshold", "0"]):
        got = generate(capsys, tmp_path, local, *flags)
        assert [r["tokens"] for r in got["results"]] == [r["tokens"] for r in plain["results"]]
        assert got["searches"] == plain["searches"] and got["searches_saved"] == 0
    for flags in (["--pointers"], ["--adaptive-gate", str(gate_dir), "--adaptive-fraction", "0.5"],
                  ["--pointers", "--min-pointers", "2", "--adaptive-gate", str(gate_dir), "--adaptive-fraction", "0.5"]):
        got = generate(capsys, tmp_path, local, *flags)
        assert got["searches_saved"] > 0
        assert all(r["searches"] + r["searches_saved"] >= r["completion_tokens"] for r in got["results"])
        assert got["settings"]["fewer_searches"]["pointers"] == ("--pointers" in flags)


@pytest.mark.parametrize(("flags", "message"), [
    (["--pointers"], "need kNN-LM generation"),
    (["--datastore", "STORE", "--min-pointers", "2"], "--min-pointers needs --pointers"),
    (["--datastore", "STORE", "--adaptive-threshold", "0.5"], "--adaptive-threshold needs --adaptive-gate"),
    (["--datastore", "STORE", "--adaptive-threshold", "0"], "--adaptive-threshold needs --adaptive-gate"),
    (["--datastore", "STORE", "--pointers", "--speculative"], "do not combine with --speculative"),
    (["--datastore", "STORE", "--pointers", "--pointer-search-rows", "4"],
     "--pointer-search-rows applies to memlm eval"),
])
def test_refusals_are_one_line(capsys, store, flags, message) -> None:
    flags = [str(store) if f == "STORE" else f for f in flags]
    code, _, err = run(capsys, "generate", "--model", "tiny", *flags, "hello")
    assert code in (1, 2) and message in err and err.count("\n") == 1, err
