"""`memlm eval --datastore` with fewer searches: --pointers --min-pointers N, `memlm train-gate` and
--adaptive-gate with --adaptive-threshold / --adaptive-fraction, end to end through the command line on a
built datastore; a gate fitted on an evaluated document is refused (the same overlap rule as tuning), and
every flag that does not apply is refused in one line."""

from __future__ import annotations

import json

import pytest

from memlm.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    """Speeches that repeat sentences across years, a datastore of the early ones and a gate fitted on two."""
    tmp = tmp_path_factory.mktemp("fewer")
    corpus = tmp / "corpus.jsonl"
    sentences = ["the state of the union is strong and growing.", "we will build roads and schools for all.",
                 "our soldiers serve with honour abroad.", "taxes are lower and wages are higher."]
    rows = [{"text": " ".join(f"In {1990 + i}, {sentences[(i + j) % 4]}" for j in range(6)), "year": 1990 + i}
            for i in range(12)]
    corpus.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    store, gate = tmp / "store", tmp / "gate"
    assert main(["datastore", "build", "--model", "tiny", "--data", str(corpus), "--split", "year<1996", "--out",
                 str(store), "--context", "64", "--stride", "32", "--quiet"]) == 0
    assert main(["train-gate", "--model", "tiny", "--datastore", str(store), "--data", str(corpus), "--split",
                 "1996<=year<=1997", "--k", "8", "--knn-temperature", "10", "--steps", "50", "--out", str(gate),
                 "--quiet"]) == 0
    return corpus, store, gate


def evaluate(capsys, tmp_path, setting, *flags):
    corpus, store, _ = setting
    out = tmp_path / "result.json"
    code, _, err = run(capsys, "eval", "--model", "tiny", "--data", str(corpus), "--split", "year>=1998",
                       "--datastore", str(store), "--k", "8", "--lambda", "0.5", "--knn-temperature", "10", "--quiet",
                       "--json", str(out), *flags)
    assert code == 0, err
    return json.loads(out.read_text())


def test_pointers_and_gate_combine_and_report_searches(capsys, tmp_path, setting):
    _, _, gate = setting
    plain = evaluate(capsys, tmp_path, setting)
    assert plain["searches"] == plain["tokens"] and plain["searches_saved"] == 0
    pointers = evaluate(capsys, tmp_path, setting, "--pointers", "--min-pointers", "2")
    assert pointers["min_pointers"] == 2 and pointers["pointer_distances"] == "exact"
    assert pointers["searches_saved"] > 0 and pointers["searches"] + pointers["searches_saved"] == pointers["tokens"]
    assert pointers["base_perplexity"] == plain["base_perplexity"]
    everything = evaluate(capsys, tmp_path, setting, "--pointers", "--min-pointers", "9")  # above --k
    assert everything["knnlm_nll"] == pytest.approx(plain["knnlm_nll"], rel=1e-6) and everything["searches_saved"] == 0
    both = evaluate(capsys, tmp_path, setting, "--pointers", "--adaptive-gate", str(gate), "--adaptive-fraction", "0.5")
    assert both["adaptive_fraction"] == 0.5 and both["adaptive_gate"] == str(gate)
    assert both["searches"] < pointers["searches"] and both["adaptive_skipped"] > 0
    always = evaluate(capsys, tmp_path, setting, "--adaptive-gate", str(gate), "--adaptive-threshold", "0")
    assert always["knnlm_nll"] == plain["knnlm_nll"] and always["searches_saved"] == 0


def test_clustered_states_are_recorded_and_a_minimum_above_k_stays_plain(capsys, tmp_path, setting):
    plain = evaluate(capsys, tmp_path, setting)
    clustered = evaluate(capsys, tmp_path, setting, "--pointers", "--min-pointers", "2", "--pointer-clusters", "8")
    assert clustered["pointer_clusters"] == 8 and clustered["searches_saved"] > 0
    assert clustered["searches"] + clustered["searches_saved"] == clustered["tokens"]
    everything = evaluate(capsys, tmp_path, setting, "--pointers", "--min-pointers", "9", "--pointer-clusters", "8")
    assert everything["knnlm_nll"] == pytest.approx(plain["knnlm_nll"], rel=1e-6) and everything["searches_saved"] == 0
    sketch = ("--pointer-clusters", "8", "--pointer-sketch", "4", "--pointer-exact", "6", "--pointer-width", "16")
    sketched = evaluate(capsys, tmp_path, setting, "--pointers", "--min-pointers", "2", *sketch)
    assert (sketched["pointer_sketch"], sketched["pointer_exact"], sketched["pointer_width"]) == (4, 6, 16)
    assert sketched["searches_saved"] > 0 and sketched["knnlm_nll"] != clustered["knnlm_nll"]  # the options act
    everything = evaluate(capsys, tmp_path, setting, "--pointers", "--min-pointers", "9", *sketch)
    assert everything["knnlm_nll"] == pytest.approx(plain["knnlm_nll"], rel=1e-6) and everything["searches_saved"] == 0
    nearest = evaluate(capsys, tmp_path, setting, "--pointers", "--min-pointers", "2", *sketch,
                       "--pointer-nearest-clusters", "1")
    assert nearest["pointer_nearest_clusters"] == 1 and nearest["searches_saved"] > 0


def test_search_rows_batch_the_same_walk_otherwise(capsys, tmp_path, setting):
    """--pointer-search-rows (PointerConfig.search_rows) changes how the walk's searches are batched, never which
    tokens are searched nor what they get (tested on the walk itself:
    tests/memlm/retrieval/test_pointers_clusters.py)."""
    flags = ("--pointers", "--min-pointers", "2", "--pointer-clusters", "8")
    once_all_wait = evaluate(capsys, tmp_path, setting, *flags)
    sooner = evaluate(capsys, tmp_path, setting, *flags, "--pointer-search-rows", "1")
    assert sooner["pointer_search_rows"] == 1 and "pointer_search_rows" not in once_all_wait
    assert sooner["searches"] == once_all_wait["searches"]  # the rows' exact distances are batched otherwise:
    assert sooner["knnlm_nll"] == pytest.approx(once_all_wait["knnlm_nll"], rel=1e-7)  # equal up to their rounding
    assert sooner["searches_saved"] > 0


def test_nearest_clusters_flag_reaches_the_walks_sketch(setting):
    """--pointer-nearest-clusters is KeySketch.max_clusters of the walk's clusters (whose effect is tested
    against a row-by-row oracle in tests/memlm/retrieval/test_clustered_order.py)."""
    import argparse

    from datastore import Datastore
    from memlm.cli.fewer_searches import fewer_searches

    _, store, _ = setting
    args = argparse.Namespace(pointers=True, min_pointers=2, pointer_width=None, pointer_clusters=4, pointer_sketch=4,
                              pointer_exact=6, pointer_nearest_clusters=2, pointer_search_rows=None,
                              adaptive_gate=None)
    sketch = fewer_searches(args, Datastore.open(store), None).source.clusters.sketch
    assert (sketch.max_clusters, sketch.exact_members, sketch.basis.shape[1]) == (2, 6, 4)
    args.pointer_nearest_clusters = None
    assert fewer_searches(args, Datastore.open(store), None).source.clusters.sketch.max_clusters is None


def test_a_gate_fitted_on_an_evaluated_document_is_refused(capsys, setting):
    corpus, store, gate = setting
    code, _, err = run(capsys, "eval", "--model", "tiny", "--data", str(corpus), "--split", "year>=1997",
                       "--datastore", str(store), "--k", "8", "--adaptive-gate", str(gate), "--adaptive-fraction",
                       "0.5", "--quiet")
    assert code == 1 and err.count("\n") == 1
    assert "fitted on 1 document(s) of the evaluation data" in err and "never see evaluation tokens" in err


def test_a_gate_fitted_with_another_datastore_is_refused(capsys, tmp_path, setting):
    corpus, _, gate = setting
    other = tmp_path / "other"
    assert main(["datastore", "build", "--model", "tiny", "--data", str(corpus), "--split", "year<1992", "--out",
                 str(other), "--context", "64", "--stride", "32", "--quiet"]) == 0
    capsys.readouterr()
    code, _, err = run(capsys, "eval", "--model", "tiny", "--data", str(corpus), "--split", "year>=1998",
                       "--datastore", str(other), "--k", "8", "--adaptive-gate", str(gate), "--adaptive-threshold",
                       "0.5", "--quiet")
    assert code == 1 and "was fitted with another datastore" in err


@pytest.mark.parametrize("flags, message", [
    (["--min-pointers", "3"], "--min-pointers needs --pointers"),
    (["--pointer-clusters", "4"], "--pointer-clusters needs --pointers"),
    (["--pointers", "--pointer-sketch", "4"], "--pointer-sketch needs --pointer-clusters"),
    (["--pointers", "--pointer-width", "16"], "--pointer-width needs --pointer-clusters"),
    (["--pointers", "--pointer-clusters", "4", "--pointer-exact", "8"], "--pointer-exact needs --pointer-sketch"),
    (["--pointers", "--pointer-clusters", "4", "--pointer-nearest-clusters", "2"],
     "--pointer-nearest-clusters needs --pointer-sketch"),
    (["--pointer-search-rows", "8"], "--pointer-search-rows needs --pointers"),
    (["--adaptive-threshold", "0.5"], "--adaptive-threshold needs --adaptive-gate"),
    (["--adaptive-gate", "GATE"], "needs one of --adaptive-threshold X or --adaptive-fraction F"),
    (["--adaptive-gate", "GATE", "--adaptive-threshold", "0.5", "--adaptive-fraction", "0.5"], "needs one of"),
    (["--adaptive-gate", "GATE", "--adaptive-fraction", "1"], "--adaptive-fraction must be in [0, 1)"),
])
def test_flags_that_do_not_apply_are_refused_in_one_line(capsys, setting, flags, message):
    corpus, store, gate = setting
    flags = [str(gate) if f == "GATE" else f for f in flags]
    code, _, err = run(capsys, "eval", "--model", "tiny", "--data", str(corpus), "--split", "year>=1998",
                       "--datastore", str(store), "--k", "8", "--quiet", *flags)
    assert code == 1 and err.count("\n") == 1 and message in err, err


def test_fewer_searches_need_a_datastore(capsys, setting):
    corpus, _, _ = setting
    code, _, err = run(capsys, "eval", "--model", "tiny", "--data", str(corpus), "--pointers", "--quiet")
    assert code == 1 and "--pointers applies to kNN-LM evaluation (--datastore) only" in err
