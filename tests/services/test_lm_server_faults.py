"""The LM server under hostile or careless clients: bounded work, cancellation.

Real servers on port 0 over the tiny model; the SIGTERM test runs the server in its own process. The
"maximal" request is 4,000 tokens at window 1024, stride 1: about 3,000 windows, some 20 s of forward
work on two CPU cores (about 30 ms per batch of 4 windows), so every bound below (a few seconds) is far
from both running all of it and what one batch costs.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import grpc
import pytest

from memlm.jobs.scoring import plan_scored_windows
from memlm.jobs.windows import window_cost
from memlm.v1 import language_model_pb2 as lm_pb2
from memlm.v1 import language_model_pb2_grpc as lm_grpc
from services.lm.server import LMLimits, start_lm_server
from services.common.server import ServerOptions

LONG = 4000
"""Tokens of the maximal request."""
LIMITS = LMLimits(max_score_tokens=LONG + 1, max_forward_tokens=4_000_000, max_new_tokens=16, max_text_chars=100_000)
"""Limits that allow the maximal request (its cost is about 3.1M forward tokens); texts of 100k characters."""
FAST_S = 3.0
"""What "at once" means here: far under the maximal request's ~20 s, far over one batch's ~30 ms."""


def long_ids(n: int = LONG) -> list[int]:
    return [(7 * i) % 250 + 1 for i in range(n)]  # ids the tiny tokenizer knows (259)


def maximal_request(n: int = LONG, stride: int = 1, top_n: int = 0) -> lm_pb2.ScoreRequest:
    return lm_pb2.ScoreRequest(inputs=[lm_pb2.ScoreInput(token_ids=lm_pb2.TokenIds(ids=long_ids(n)))],
                               window_tokens=1024, stride_tokens=stride, top_n=top_n)


SMALL = lm_pb2.ScoreRequest(inputs=[lm_pb2.ScoreInput(token_ids=lm_pb2.TokenIds(ids=long_ids(40)))])


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.fixture(scope="module")
def lm(tiny, module_loop):
    """(address, stub) of an LM server with LIMITS and a 1 MiB message limit."""
    started = module_loop.run(start_lm_server("127.0.0.1:0", tiny, model_name="tiny", limits=LIMITS,
                                              options=ServerOptions(max_message_bytes=2**20)))
    module_loop.servers.append(started.running.server)
    address = f"127.0.0.1:{started.running.port}"
    with grpc.insecure_channel(address) as channel:
        yield address, lm_grpc.LanguageModelServiceStub(channel)


def timed(call, request, timeout: float = 30.0) -> float:
    t0 = time.monotonic()
    call(request, timeout=timeout)
    return time.monotonic() - t0


def test_window_cost_is_the_plans_cost():
    # The closed form that prices a Score equals the plan it prices (random small plans, both branches).
    rng = random.Random(0)
    for _ in range(3000):
        context = rng.randint(1, 40)
        stride = rng.randint(1, context)
        n = rng.randint(0, 120)
        first = rng.randint(0, n + 2)
        plan = plan_scored_windows(n, first, context, stride) if first < n else []
        assert tuple(window_cost(n, first, context, stride)) == (len(plan), sum(w.end - w.start for w in plan))


@pytest.mark.parametrize("give_up", ["cancel", "deadline"])
def test_abandoned_maximal_score_frees_the_model_at_once(lm, give_up):
    # An abandoned Score must not keep the model thread for its whole ~20 s, with the next small Score waiting.
    _, stub = lm
    timed(stub.Score, SMALL)  # warm
    if give_up == "cancel":
        future = stub.Score.future(maximal_request(), timeout=60)
        with pytest.raises(grpc.FutureTimeoutError):
            future.result(timeout=0.5)  # it is running on the model thread now
        future.cancel()
        assert future.cancelled()
    else:
        with pytest.raises(grpc.RpcError) as e:
            stub.Score(maximal_request(), timeout=0.5)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert timed(stub.Score, SMALL) < FAST_S


def test_abandoned_long_prompt_generation_frees_the_model_at_once(lm):
    # An XL generation with 1-token segments encodes its prompt in 4,000 forward steps inside one model
    # job; a deadline must stop it.
    _, stub = lm
    request = lm_pb2.GenerateRequest(prompt_token_ids=lm_pb2.TokenIds(ids=long_ids()), max_new_tokens=4,
                                     memory_mode=lm_pb2.MEMORY_MODE_XL,
                                     memory=lm_pb2.MemoryOptions(segment_tokens=1))
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(request, timeout=0.5))
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert timed(stub.Score, SMALL) < FAST_S


@pytest.mark.parametrize("request_, limit", [
    (maximal_request(LONG, stride=1), "max_forward_tokens"),  # ~3.1M forward tokens > 1M (the server below)
    (maximal_request(LONG, stride=512, top_n=20), "max_message_bytes"),  # 4,000 x 21 entries > 1 MiB
])
def test_over_budget_score_is_refused_before_any_work(tiny, module_loop, request_, limit):
    # Refused up front: the first would run for ~20 s, the second compute everything, then fail on the size.
    started = module_loop.run(start_lm_server(
        "127.0.0.1:0", tiny, limits=LMLimits(max_score_tokens=LONG + 1, max_forward_tokens=1_000_000),
        options=ServerOptions(max_message_bytes=2**20)))
    module_loop.servers.append(started.running.server)
    with grpc.insecure_channel(f"127.0.0.1:{started.running.port}") as channel:
        stub = lm_grpc.LanguageModelServiceStub(channel)
        timed(stub.Score, SMALL)  # warm
        rss = rss_bytes()
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            stub.Score(request_, timeout=60)
        elapsed = time.monotonic() - t0
    assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE and limit in e.value.details()
    assert elapsed < FAST_S
    assert rss_bytes() - rss < 32 * 2**20


def test_score_entries_over_the_limit_are_refused(tiny, module_loop):
    started = module_loop.run(start_lm_server("127.0.0.1:0", tiny, limits=LMLimits(max_score_entries=1000)))
    module_loop.servers.append(started.running.server)
    with grpc.insecure_channel(f"127.0.0.1:{started.running.port}") as channel:
        stub = lm_grpc.LanguageModelServiceStub(channel)
        (result,) = stub.Score(maximal_request(200, stride=512, top_n=4), timeout=30).results  # 200 x 5: allowed
        assert len(result.tokens) == 200 and all(len(t.alternatives) == 4 for t in result.tokens)
        with pytest.raises(grpc.RpcError) as e:
            stub.Score(maximal_request(200, stride=512, top_n=5), timeout=30)  # 200 x 6 > 1000
    assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert e.value.details().startswith("top_n:") and "max_score_entries 1000" in e.value.details()


def test_tokenize_over_its_text_limit_is_refused(lm):
    # Tokenize has a length limit too (30 MB of text would hold the model thread for 44 s).
    _, stub = lm
    texts = ["the quick brown fox " * 3_000] * 2  # 120k characters > max_text_chars (100k)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        stub.Tokenize(lm_pb2.TokenizeRequest(texts=texts), timeout=30)
    assert time.monotonic() - t0 < FAST_S
    assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert e.value.details().startswith("texts:") and f"max_text_chars {LIMITS.max_text_chars}" in e.value.details()
    (ok,) = stub.Tokenize(lm_pb2.TokenizeRequest(texts=[texts[0][:1000]]), timeout=30).results  # under it: served
    assert len(ok.ids) > 0


SERVE = textwrap.dedent("""
    import asyncio
    from services.lm.requests import LMLimits
    from services.lm.server import serve_lm
    from services.common.server import ServerOptions

    asyncio.run(serve_lm("tiny", port=0, options=ServerOptions(grace_s=1.0),
                         limits=LMLimits(max_score_tokens=%d, max_forward_tokens=4_000_000)))
""") % (LONG + 1)


def test_sigterm_during_a_long_score_exits_promptly_and_cleanly():
    # The process must not live until the Score is done (minutes on a real model) nor log a CancelledError
    # traceback: the drain's grace (1 s here) ends the call, the work stops within one batch, and the
    # process exits 0 with no traceback.
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.Popen([sys.executable, "-c", SERVE], cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(60)
        assert lines and lines[0].startswith("listening on "), lines
        address = lines[0].split()[-1]
        with grpc.insecure_channel(address) as channel:
            stub = lm_grpc.LanguageModelServiceStub(channel)
            future = stub.Score.future(maximal_request(), timeout=60)
            with pytest.raises(grpc.FutureTimeoutError):
                future.result(timeout=1.0)  # the Score is running
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            _, stderr = proc.communicate(timeout=30)
            exited_s = time.monotonic() - t0
            assert future.exception(timeout=10) is not None  # the client got a status, not a hang
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr and "CancelledError" not in stderr, stderr
    assert exited_s < 1.0 + FAST_S  # the grace, then at most one batch and the shutdown
