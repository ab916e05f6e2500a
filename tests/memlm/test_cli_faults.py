"""Faults on the command line: every bad input is one clear line and a non-zero exit (or a
correct answer), found before any work is done; never a traceback, never "0 means the default".

Argument errors are argparse's (exit 2, the reason on the last line); user errors found later are
memlm's (exit 1, one line).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from datastore import build_datastore
from memlm.cli import main
from memlm.errors import MemlmError
from memlm.retrieval.searcher import MAX_K

ROOT = Path(__file__).resolve().parents[2]


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def refused_by_argparse(capsys, *argv: str) -> str:
    """The reason argparse gives for refusing `argv`, which must exit 2 with one line (no usage block)."""
    with pytest.raises(SystemExit) as info:
        main(list(argv))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.splitlines()) == 1 and err.startswith("memlm: error: "), err
    return err.strip()


def assert_one_line(code: int, err: str, message: str) -> None:
    assert code == 1, err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err, err


@pytest.fixture()
def text(tmp_path) -> Path:
    path = tmp_path / "doc.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. " * 6)
    return path


def test_random_bytes_in_a_jsonl_name_the_file_and_line(capsys, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    # Random bytes with no newline among them (one could end line 2 early, and the bad bytes land on line 3),
    # led by a byte that never starts UTF-8: line 2 is the bad one whatever the draw.
    noise = bytes(b for b in random.Random(0).randbytes(2000) if b != 0x0A)
    corpus.write_bytes(json.dumps({"text": "a fine first line"}).encode() + b"\n\xff" + noise + b"\n")
    code, _, err = run(capsys, "eval", "--model", "tiny", "--data", str(corpus), "--quiet")
    assert_one_line(code, err, f"corpus {corpus}:2: not UTF-8 text")


@pytest.mark.parametrize("argv, reason", [
    (["--k", "1000000000"], f"--k: at most {MAX_K} neighbours per search, got 1000000000"),
    (["--k", "0"], "--k: must be at least 1, got 0"),
    (["--nprobe", "0"], "--nprobe: must be at least 1, got 0"),
    (["--context", "0"], "--context: must be at least 1, got 0"),
    (["--stride", "0"], "--stride: must be at least 1, got 0"),
    (["--batch-size", "0"], "--batch-size: must be at least 1, got 0"),
    (["--batch-size", "two"], "--batch-size: expected a whole number, got 'two'"),
])
def test_eval_counts_are_refused_not_defaulted(capsys, text, argv, reason):
    """0 is refused, never read as the default, and --k 10**9 never tries to allocate Q * 10**9 results."""
    assert refused_by_argparse(capsys, "eval", "--model", "tiny", "--data", str(text), *argv).endswith(reason)


@pytest.mark.parametrize("command, reason", [
    (["datastore", "build", "--model", "tiny", "--data", "x.txt", "--out", "o", "--batch-size", "0"],
     "--batch-size: must be at least 1, got 0"),
    (["datastore", "build", "--model", "tiny", "--data", "x.txt", "--out", "o", "--nprobe", "0"],
     "--nprobe: must be at least 1, got 0"),
    (["datastore", "build", "--model", "tiny", "--data", "x.txt", "--out", "o", "--context", "0"],
     "--context: must be at least 1, got 0"),
    (["train", "--data", "x.txt", "--batch-size", "0"], "--batch-size: must be at least 1, got 0"),
    (["serve", "lm", "--model", "tiny", "--k", "1000000000"], f"--k: at most {MAX_K} neighbours"),
    (["client", "score", "--address", "h:1", "--knn", "--k", "1000000000", "x"], f"--k: at most {MAX_K}"),
])
def test_other_commands_refuse_the_same_counts(capsys, command, reason):
    assert reason in refused_by_argparse(capsys, *command)


@pytest.mark.parametrize("name, value", [("context", 0), ("stride", 0), ("batch_size", 0), ("nprobe", 0)])
def test_build_datastore_refuses_zero_counts_before_loading(tmp_path, name, value):
    """The library call too: a zero is refused before the model (here: a name that cannot load) is read."""
    with pytest.raises(MemlmError, match=f"--{name.replace('_', '-')} must be at least 1, got 0"):
        build_datastore("no-such-model", "x.txt", tmp_path / "out", **{name: value})


@pytest.mark.parametrize("port", ["65536", "70000", "-1"])
def test_ports_out_of_range_are_refused(capsys, port):
    """70000 is refused, not bound as 70000 - 65536 = 4464."""
    reason = refused_by_argparse(capsys, "serve", "lm", "--model", "tiny", f"--port={port}")
    assert reason.endswith(f"--port: ports are 0 (any free port) to 65535, got {port}")


def test_json_naming_a_directory_is_refused_before_any_work(capsys, tmp_path, text):
    folder = tmp_path / "results"
    folder.mkdir()
    # A model that cannot load: the --json error must come first, before any loading or scoring.
    code, _, err = run(capsys, "eval", "--model", "no-such-model", "--data", str(text), "--json", str(folder))
    assert_one_line(code, err, f"--json {folder} is a directory")
    code, _, err = run(capsys, "eval", "--model", "no-such-model", "--data", str(text), "--json",
                       str(text / "result.json"))
    assert_one_line(code, err, f"{text} is a file, not a folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.txt", "results"]  # no *.partial anywhere
    assert list(folder.iterdir()) == []


def test_missing_tls_files_are_one_line(capsys, tmp_path):
    missing = tmp_path / "no-such-cert.pem"
    code, _, err = run(capsys, "serve", "lm", "--model", "tiny", "--tls-cert", str(missing), "--tls-key", str(missing))
    assert_one_line(code, err, str(missing))
    code, _, err = run(capsys, "client", "score", "--address", "127.0.0.1:1", "--tls-ca", str(missing), "hello")
    assert_one_line(code, err, str(missing))


def test_a_closed_pipe_exits_quietly(tmp_path, text):
    """`memlm eval ... | head -1`: the reader is gone before memlm writes; no traceback, no 'Exception ignored'."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write now fails with EPIPE, as once `head` has exited
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    try:
        proc = subprocess.run([sys.executable, "-m", "memlm.cli", "eval", "--model", "tiny", "--data", str(text),
                               "--context", "32", "--quiet"], stdout=write_end, stderr=subprocess.PIPE, cwd=ROOT,
                              env=env, timeout=120, text=True)
    finally:
        os.close(write_end)
    assert proc.stderr == "" and proc.returncode == 1, proc.stderr


@pytest.mark.parametrize("spec, message", [
    ("sotuu", "unknown corpus 'sotuu'; did you mean 'sotu'?"),
    ("Wiki-sumaries", "did you mean 'wiki-summaries'?"),
    ("my speeches!", "is no file, fetched corpus or hub dataset name"),
    ("someone/some-dataset", "needs the network, but HF_HUB_OFFLINE is set"),  # conftest: tests are offline
])
def test_a_mistyped_corpus_name_is_one_line_at_once(capsys, spec, message):
    """Refused at once, without going to the hub and retrying five times over 23 s."""
    start = time.monotonic()
    code, _, err = run(capsys, "eval", "--model", "tiny", "--data", spec)
    assert_one_line(code, err, message)
    assert "sotu, wiki-summaries" in err
    assert time.monotonic() - start < 15  # no hub retries (23 s before); generous for a loaded machine
