"""Memorizing on the command line: the memorizing options (refused in one line with another memory kind),
`memlm eval --continuous-cache`, and `memlm eval --memory memorizing` records what it ran."""

from __future__ import annotations

import json

import pytest

from memlm.cli import build_parser, main
from memlm.model.memory_config import MemoryConfig
from memlm.cli.options import memory_config


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture()
def corpus(tmp_path):
    rows = [{"text": "the cat sat on the mat and the dog sat on the log. " * (6 + i), "year": 2000 + i} for i in range(4)]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("command", [["train", "--data", "x"], ["eval", "--model", "tiny", "--data", "x"]])
@pytest.mark.parametrize("flag, value", [("--knn-mem-size", "64"), ("--knn-top-k", "4"), ("--knn-layer", "1"),
                                         ("--knn-backend", "exact")])
def test_memorizing_options_with_another_kind_are_one_line(capsys, command, flag, value) -> None:
    code, _, err = run(capsys, *command, "--memory", "xl", flag, value)
    assert code == 1 and err.count("\n") == 1
    assert f"{flag} applies to --memory memorizing only, not xl" in err


def test_knn_train_needs_memorizing(capsys) -> None:
    code, _, err = run(capsys, "train", "--data", "x", "--knn-train", "top")
    assert code == 1 and "--knn-train applies to --memory memorizing only" in err and err.count("\n") == 1


def test_memorizing_options_set_the_memory_config() -> None:
    args = build_parser().parse_args(["train", "--data", "x", "--memory", "memorizing", "--knn-mem-size", "512",
                                      "--knn-top-k", "8", "--knn-layer", "1", "--knn-backend", "exact"])
    memory = memory_config(args, MemoryConfig())
    assert (memory.kind, memory.knn_mem_size, memory.knn_top_k, memory.knn_layer, memory.knn_backend) == (
        "memorizing", 512, 8, 1, "exact")
    assert args.knn_train is None  # unset: memlm.jobs.memorizing.resolved_knn_train decides


@pytest.mark.parametrize("argv, message", [
    (["--cache-size", "8"], "--cache-size needs --continuous-cache"),
    (["--continuous-cache", "--nprobe", "2"], "--nprobe applies to --datastore only"),
    (["--continuous-cache", "--context", "32"], "--context does not apply with --continuous-cache"),
    (["--continuous-cache", "--lambda", "auto"], "need --tune-data"),
    (["--continuous-cache", "--memory", "compressive"], "runs over --memory none or xl"),
])
def test_continuous_cache_flag_errors_are_one_line(capsys, corpus, argv, message) -> None:
    code, _, err = run(capsys, "eval", "--model", "tiny", "--data", str(corpus), "--quiet", *argv)
    assert code == 1 and message in err and err.count("\n") == 1


def test_continuous_cache_eval_tunes_on_other_documents(capsys, corpus, tmp_path) -> None:
    out = tmp_path / "r.json"
    code, _, err = run(capsys, "eval", "--model", "tiny", "--data", str(corpus), "--split", "[0:2]", "--quiet",
                       "--continuous-cache", "--cache-size", "64", "--k", "16", "--memory", "xl", "--segment", "32",
                       "--mem-len", "32", "--lambda", "auto", "--knn-temperature", "auto", "--tune-data", str(corpus),
                       "--tune-split", "[2:4]", "--json", str(out))
    assert code == 0, err
    r = json.loads(out.read_text())
    assert r["continuous_cache"] and r["cache_size"] == 64 and r["k"] == 16 and r["memory"] == "xl"
    assert r["tuned"] and r["tune_documents"] == 2 and r["tune_overlap_documents"] == 0
    code, _, err = run(capsys, "eval", "--model", "tiny", "--data", str(corpus), "--quiet", "--continuous-cache",
                       "--lambda", "auto", "--tune-data", str(corpus))
    assert code == 1 and "shares 4 document(s)" in err


def test_memorizing_eval_over_the_retrieval_service_equals_in_process(capsys, corpus, tmp_path) -> None:
    """--knn-backend service --knn-service: a real retrieval server with memory sessions on port 0."""
    import asyncio
    import threading

    from services.retrieval.memory_sessions import MemoryOptions
    from services.retrieval.server import create_retrieval_server

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server, port = asyncio.run_coroutine_threadsafe(
        create_retrieval_server("127.0.0.1:0", None, memories=MemoryOptions()), loop).result(30)
    try:
        common = ["eval", "--model", "tiny", "--data", str(corpus), "--quiet", "--memory", "memorizing",
                  "--segment", "32", "--mem-len", "16", "--knn-mem-size", "64", "--knn-top-k", "4"]
        results = {}
        for backend, extra in (("exact", []), ("service", ["--knn-service", f"127.0.0.1:{port}"])):
            out = tmp_path / f"{backend}.json"
            code, _, err = run(capsys, *common, "--knn-backend", backend, *extra, "--json", str(out))
            assert code == 0, err
            results[backend] = json.loads(out.read_text())
        assert results["service"]["knn_backend"] == "service"
        assert results["service"]["nll"] == results["exact"]["nll"]
        code, _, err = run(capsys, *common, "--knn-backend", "service")
        assert code == 1 and "needs --knn-service HOST:PORT" in err and err.count("\n") == 1
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
    code, _, err = run(capsys, "eval", "--model", "tiny", "--data", str(corpus), "--knn-service", "127.0.0.1:1")
    assert code == 1 and "--knn-service needs --memory memorizing --knn-backend service" in err
