"""`memlm serve ... --grace SECONDS` (services.common.server.run_until_signal): on SIGTERM the server
refuses new calls, lets in-flight ones finish for up to the grace, then cancels the rest, waits for grpc's
leftover tasks and exits 0 without a traceback. A real `memlm serve lm` process over the tiny model.

The short Score is 4,000 tokens at window 256, stride 32 (about 125 one-window steps, a fraction of a second
alone, so that it ends inside the grace even on a loaded machine);
the long one is stride 1 (about 4,000 steps, several seconds), sharing the model step by step with the short.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from memlm.v1 import language_model_pb2 as lm_pb2
from memlm.v1 import language_model_pb2_grpc as lm_grpc

GRACE_S = 3.0
FAST_S = 3.0
"""Slack after the grace: the step in progress, the model's workers joined, the interpreter's exit."""
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def score(stride: int) -> lm_pb2.ScoreRequest:
    ids = [(7 * i) % 250 + 1 for i in range(4000)]
    return lm_pb2.ScoreRequest(inputs=[lm_pb2.ScoreInput(token_ids=lm_pb2.TokenIds(ids=ids))],
                               window_tokens=256, stride_tokens=stride)


def start_serve_lm(*flags: str) -> tuple[subprocess.Popen, str]:
    """A `memlm serve lm --model tiny` process and the address it printed."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "memlm", "serve", "lm", "--model", "tiny", "--port", "0", *flags],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(60)
    if not (lines and lines[0].startswith("listening on ")):
        proc.kill()
        raise AssertionError(f"no address: {lines} {proc.communicate(timeout=10)}")
    return proc, lines[0].split()[-1]


def test_sigterm_lets_in_flight_calls_finish_within_the_grace_then_cancels_and_exits_cleanly():
    proc, address = start_serve_lm("--grace", str(GRACE_S), "--max-score-tokens", "4001",
                                   "--max-forward-tokens", "2000000", "--max-step-tokens", "256")
    try:
        with grpc.insecure_channel(address) as channel:
            stub = lm_grpc.LanguageModelServiceStub(channel)
            stub.Score(score(stride=128), timeout=30)  # warm
            long_call = stub.Score.future(score(stride=1), timeout=120)
            short_call = stub.Score.future(score(stride=128), timeout=120)
            time.sleep(0.3)  # both under way
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            assert len(short_call.result(timeout=GRACE_S + FAST_S).results[0].tokens) == 4000  # finished in the grace
            with pytest.raises(grpc.RpcError) as e:
                long_call.result(timeout=GRACE_S + FAST_S)  # cancelled when the grace ran out
            assert time.monotonic() - t0 >= GRACE_S - 0.5, "the long call ended before the grace did"
            assert e.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
            _, stderr = proc.communicate(timeout=GRACE_S + 30)
            exited_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr and "CancelledError" not in stderr, stderr
    assert exited_s < GRACE_S + FAST_S, exited_s


@pytest.mark.parametrize("flags, message", [
    (["--grace", "-1"], "memlm: error: --grace: must be a finite number of seconds >= 0, got -1"),
    (["--grace", "soon"], "memlm: error: --grace: expected seconds, got 'soon'"),
    (["--max-step-tokens", "0"], "memlm: error: --max-step-tokens: must be at least 1, got 0"),
])
def test_bad_serve_flags_are_one_line(flags, message):
    done = subprocess.run([sys.executable, "-m", "memlm", "serve", "lm", "--model", "tiny", *flags], cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and done.stderr.splitlines() == [message], done.stderr


@pytest.mark.parametrize("argv, start", [
    (["serve", "retrieval", "--datastore", "d", "--port", "70000"], "memlm: error: --port: "),
    (["serve", "router", "--shard", "h:1", "--grace", "x"], "memlm: error: --grace: "),
    (["datastore", "build", "--model", "m", "--data", "d", "--out", "o", "--batch-size", "0"],
     "memlm: error: --batch-size: "),
    (["client", "score", "--address", "a", "--timeout", "x", "t"], "memlm: error: --timeout: "),
    (["serve", "lm"], "memlm: error: the following arguments are required: --model"),
])
def test_usage_errors_of_every_subcommand_are_one_line(capsys, argv, start):
    # One line naming the reason, without argparse's usage block before it.
    from memlm.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.splitlines()) == 1 and err.startswith(start), err
