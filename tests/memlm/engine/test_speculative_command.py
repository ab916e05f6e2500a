"""`memlm generate --speculative [--draft-tokens N] [--draft-from SOURCE]` over a built datastore: the same tokens as without,
`searches` and `mean_accepted_tokens` in --json, --lambda 0 drafting for the base LM, one-line refusals."""

from __future__ import annotations

import dataclasses
import json

import pytest

from memlm.cli import main
from memlm.engine.drafts import SpeculativeConfig

TEXT = "the union is strong and the state of the union is strong"


def run(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse's usage errors (exit 2, one line)
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A tiny-model datastore of a repeated sentence (drafts from it are often right)."""
    tmp = tmp_path_factory.mktemp("spec")
    corpus = tmp / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"{TEXT} {i}. {TEXT}"}) for i in range(4)) + "\n")
    out = tmp / "store"
    assert main(["datastore", "build", "--model", "tiny", "--data", str(corpus), "--out", str(out),
                 "--context", "64", "--stride", "32", "--quiet"]) == 0
    return out


def generate(capsys, tmp_path, store, *flags) -> dict:
    out_json = tmp_path / f"g{len(list(tmp_path.iterdir()))}.json"
    code, _, err = run(capsys, "generate", "--model", "tiny", "--datastore", str(store), "--k", "8",
                         "--max-new-tokens", "24", "--sampling-temperature", "0", "--json", str(out_json),
                         *flags, "the union", "the state of")
    assert code == 0, err
    return json.loads(out_json.read_text())


@pytest.mark.parametrize("lmbda", ["0.5", "0"], ids=["knnlm", "base-drafting"])
def test_speculative_generate_makes_the_same_tokens(capsys, tmp_path, store, lmbda) -> None:
    knn = ("--lambda", lmbda, "--knn-temperature", "10")
    plain = generate(capsys, tmp_path, store, *knn)
    spec = generate(capsys, tmp_path, store, *knn, "--speculative", "--draft-tokens", "3")
    assert [r["tokens"] for r in spec["results"]] == [r["tokens"] for r in plain["results"]]
    assert plain["mean_accepted_tokens"] is None and all(r["verify_steps"] == 0 for r in plain["results"])
    # The run's mean from the exact counts: every completion token but each prompt's first was verified.
    steps, verified = (sum(r[f] for r in spec["results"]) for f in ("verify_steps", "verified_tokens"))
    assert spec["mean_accepted_tokens"] == verified / steps
    assert all(r["verified_tokens"] == r["completion_tokens"] - 1 for r in spec["results"])
    if lmbda == "0":  # the random tiny model's own greedy text is not the datastore's: few drafts hold
        assert all(r["mean_accepted_tokens"] >= 1 for r in spec["results"])  # (the engine test's model takes them)
    else:  # the mixture follows the datastore's sentence: drafts are accepted, more than one token a pass
        assert spec["mean_accepted_tokens"] > 1 and all(r["mean_accepted_tokens"] > 1 for r in spec["results"])
    # The effective SpeculativeConfig, every field (the defaults that ran, not only what was typed).
    assert plain["settings"]["speculative"] is None
    assert spec["settings"]["speculative"] == dataclasses.asdict(SpeculativeConfig(draft_tokens=3))
    if lmbda == "0":  # the target is the base LM: a search only to draft
        assert plain["searches"] == sum(r["completion_tokens"] for r in plain["results"])
        assert 0 < spec["searches"] <= plain["searches"]
    else:
        assert plain["searches"] == sum(r["completion_tokens"] for r in plain["results"]) == 48
        assert spec["searches"] >= plain["searches"]


@pytest.mark.parametrize("source", ["history", "both", "datastore"])
def test_draft_from_makes_the_same_tokens_and_is_recorded(capsys, tmp_path, store, source) -> None:
    knn = ("--lambda", "0.5", "--knn-temperature", "10")
    plain = generate(capsys, tmp_path, store, *knn)
    spec = generate(capsys, tmp_path, store, *knn, "--speculative", "--draft-from", source)
    assert [r["tokens"] for r in spec["results"]] == [r["tokens"] for r in plain["results"]]
    assert spec["settings"]["speculative"] == dataclasses.asdict(SpeculativeConfig(draft_from=source))
    # The repeated sentence comes back in the generated text's own past too: drafts are accepted.
    assert spec["mean_accepted_tokens"] > 1


def test_history_drafts_without_a_datastore(capsys, tmp_path) -> None:
    """--speculative --draft-from history on the base LM needs no --datastore: the same tokens as without."""
    def go(*flags) -> list:
        out_json = tmp_path / f"h{len(list(tmp_path.iterdir()))}.json"
        code, _, err = run(capsys, "generate", "--model", "tiny", "--max-new-tokens", "24", "--sampling-temperature",
                           "0", "--json", str(out_json), *flags, TEXT, "the state of")
        assert code == 0, err
        return json.loads(out_json.read_text())["results"]

    plain, spec = go(), go("--speculative", "--draft-from", "history")
    assert [r["tokens"] for r in spec] == [r["tokens"] for r in plain]
    assert all(r["verify_steps"] > 0 and r["searches"] == 0 for r in spec)


@pytest.mark.parametrize(("flags", "message"), [
    (("--draft-tokens", "3"), "--draft-tokens needs --speculative"),
    (("--draft-from", "history"), "--draft-from needs --speculative"),
    (("--speculative", "--draft-from", "ngram"), "--draft-from"),
    (("--speculative",), "drafts from a local --datastore"),
    (("--speculative", "--draft-tokens", "0"), "--draft-tokens"),
])
def test_refusals_are_one_line(capsys, flags, message) -> None:
    code, _, err = run(capsys, "generate", "--model", "tiny", *flags, "x")
    assert code != 0 and message in err and len(err.strip().splitlines()) == 1
