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
