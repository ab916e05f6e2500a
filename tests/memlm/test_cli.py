"""The command line: user errors are one line on stderr and exit 1, never a traceback."""

import json

import pytest

from memlm.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["eval", "--model", "no-such-model", "--data", "x.txt"], "cannot load 'no-such-model'"),
        (["eval", "--model", "tiny", "--data", "/no/such/corpus.jsonl"], "corpus file not found"),
        (["fetch", "no-such-thing"], "unknown name"),
    ],
)
def test_user_errors_are_one_line(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 1
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_empty_corpus_is_a_user_error(capsys, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    code, _, err = run(capsys, "eval", "--model", "tiny", "--data", str(empty))
    assert code == 1 and "no documents" in err and err.count("\n") == 1


def test_context_longer_than_the_model_is_a_user_error(capsys, tmp_path):
    text = tmp_path / "doc.txt"
    text.write_text("hello world " * 20)
    code, _, err = run(capsys, "eval", "--model", "tiny", "--data", str(text), "--context", "4096")
    assert code == 1 and "--context 4096" in err and err.count("\n") == 1


def test_eval_writes_a_json_result(capsys, tmp_path):
    text = tmp_path / "doc.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 10)
    out_json = tmp_path / "result.json"
    code, out, _ = run(capsys, "eval", "--model", "tiny", "--data", str(text), "--context", "64", "--stride", "16",
                       "--quiet", "--json", str(out_json))
    assert code == 0
    result = json.loads(out_json.read_text())
    assert result["tokens"] == len(text.read_text().encode())  # byte tokenizer: one token per byte
    assert result["perplexity"] > 1 and "perplexity" in out


def test_datastore_build_info_and_knnlm_eval_end_to_end(capsys, tmp_path):
    """The CLI wiring of issue 3: build, info, and eval --datastore with tuned lambda/T."""
    corpus = tmp_path / "corpus.jsonl"
    rows = [{"text": f"Speech number {i}: the state of the union is strong and growing.", "year": 1990 + i}
            for i in range(12)]
    corpus.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    store = tmp_path / "store"
    code, out, err = run(capsys, "datastore", "build", "--model", "tiny", "--data", str(corpus), "--split",
                         "year<2000", "--out", str(store), "--context", "64", "--stride", "32", "--quiet")
    assert code == 0, err
    assert (store / "manifest.json").is_file()
    code, out, _ = run(capsys, "datastore", "info", str(store))
    assert code == 0 and "entries" in out
    # building again into a finished datastore is refused, never a silent overwrite
    code, _, err = run(capsys, "datastore", "build", "--model", "tiny", "--data", str(corpus), "--split",
                       "year<2000", "--out", str(store), "--context", "64", "--stride", "32", "--quiet")
    assert code == 1 and err.count("\n") == 1
    result_path = tmp_path / "knn.json"
    code, out, err = run(capsys, "eval", "--model", "tiny", "--data", str(corpus), "--split", "year>=2001",
                         "--context", "64", "--stride", "32", "--datastore", str(store), "--k", "8",
                         "--lambda", "auto", "--temperature", "auto", "--tune-data", str(corpus),
                         "--tune-split", "year==2000", "--quiet", "--json", str(result_path))
    assert code == 0, err
    result = json.loads(result_path.read_text())
    assert result["tuned"] is True and 0.0 <= result["lambda"] <= 1.0
    # the speeches repeat one sentence: retrieval from earlier speeches must help the random tiny model
    assert result["knnlm_perplexity"] < result["base_perplexity"]
