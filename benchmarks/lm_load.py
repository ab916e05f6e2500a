"""Load on one LM server's Generate: 32 concurrent streams through the decoding engine.

A real `memlm serve lm` child process (SmolLM2 by default; the random `tiny` preset only with --synthetic,
and then the output says SYNTHETIC) with --max-batch equal to the streams, so every stream is a row of the
one running batch. --streams client threads, each with its own channel, make Generate calls one after
another until --calls calls were made in all (greedy, --new-tokens each, prompts of --prompt-tokens ids
drawn from one seed, one prompt per call). Measured on the client: errors, time to first token (call start
to the first token's message), inter-token latency (gap between two token messages of one stream),
aggregate tokens/s; on the server: resident memory (VmRSS from /proc) sampled every --rss-every-s over the
whole run, printed at the start (after the warm-up call), quarter points and end, with the growth from the
first to the last quarter's median ("flat" = within 5%). One run; no assertions.

    python benchmarks/lm_load.py [--synthetic] [--model NAME] [--streams 32] [--calls 96] [--new-tokens 16]
        [--prompt-tokens 24] [--max-step-tokens 1024] [--rss-every-s 0.25] [--results DIR]

Writes docs/results/data/lm_load.json (benchmarks/harness.py).
"""

from __future__ import annotations

import argparse
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import grpc

import harness  # noqa: E402  (benchmarks/ is this script's folder)
from benchmarks._common import (
    REAL_MODEL,
    SYNTHETIC_MODEL,
    SYNTHETIC_NOTE,
    add_synthetic_flag,
    start_memlm,
)
from memlm.v1 import language_model_pb2 as lm_pb2
from memlm.v1 import language_model_pb2_grpc as lm_grpc

START_S = 300.0
"""How long the child server may take to print its address (the model loads first)."""
FLAT = 0.05
"""Server memory counts as flat when the last quarter's median RSS is within this fraction of the first's."""


def rss_mib(pid: int) -> float:
    """Resident memory of a process, from /proc (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def start_server(model: str, streams: int, max_step_tokens: int, log: Path) -> tuple[subprocess.Popen, str]:
    argv = ["serve", "lm", "--model", model, "--port", "0", "--max-batch", str(streams),
            "--max-step-tokens", str(max_step_tokens)]
    return start_memlm(argv, log, START_S)


class Results:
    """What the streams measured (appended under a lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.tokens = 0
        self.calls = 0
        self.errors: list[str] = []


def one_call(stub, request: lm_pb2.GenerateRequest, results: Results) -> None:
    t0 = time.perf_counter()
    last = None
    ttft, gaps, n = None, [], 0
    try:
        for response in stub.Generate(request, timeout=600):
            if not (response.HasField("delta") and response.delta.tokens):
                continue
            now = time.perf_counter()
            if last is None:
                ttft = now - t0
            else:
                gaps.append(now - last)
            last = now
            n += len(response.delta.tokens)
    except grpc.RpcError as e:
        with results.lock:
            results.errors.append(f"{e.code().name}: {e.details()}")
        return
    with results.lock:
        if ttft is not None:  # a call whose first draw was end-of-text streams no token
            results.ttft.append(ttft)
        results.calls += 1
        results.itl.extend(gaps)
        results.tokens += n


def stream_loop(address: str, requests: list[lm_pb2.GenerateRequest], next_call: list[int], results: Results,
                go: threading.Barrier) -> None:
    with grpc.insecure_channel(address) as channel:
        stub = lm_grpc.LanguageModelServiceStub(channel)
        go.wait(60)
        while True:
            with results.lock:
                i = next_call[0]
                next_call[0] += 1
            if i >= len(requests):
                return
            one_call(stub, requests[i], results)


def sample_rss(pid: int, every_s: float, until: threading.Event, out: list[float]) -> None:
    while not until.is_set():
        out.append(rss_mib(pid))
        until.wait(every_s)


def percentile_ms(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def report(args, model: str, results: Results, wall_s: float, rss: list[float], result: harness.Result) -> None:
    result.set_synthetic(model in ("tiny", "small"), SYNTHETIC_NOTE)
    print(f"model {model}; {args.streams} concurrent Generate streams, {args.calls} calls of {args.new_tokens} "
          f"greedy tokens after {args.prompt_tokens}-token prompts; serve lm --max-batch {args.streams} "
          f"--max-step-tokens {args.max_step_tokens}")
    print(f"errors {len(results.errors)}" + (f" (first: {results.errors[0]})" if results.errors else ""))
    print(f"calls done {results.calls}, tokens {results.tokens} in {wall_s:.1f} s = "
          f"{results.tokens / wall_s:.1f} tokens/s aggregate")
    print(f"time to first token  p50 {percentile_ms(results.ttft, 50):8.1f} ms   p99 {percentile_ms(results.ttft, 99):8.1f} ms")
    print(f"inter-token latency  p50 {percentile_ms(results.itl, 50):8.1f} ms   p99 {percentile_ms(results.itl, 99):8.1f} ms")
    if len(rss) >= 4:
        q = len(rss) // 4
        points = [rss[0], rss[q], rss[2 * q], rss[3 * q], rss[-1]]
        first, last = statistics.median(rss[:q]), statistics.median(rss[-q:])
        growth = (last - first) / first
        print(f"server RSS MiB (start, 1/4, 1/2, 3/4, end): {', '.join(f'{p:.0f}' for p in points)}; max {max(rss):.0f}; "
              f"median last quarter vs first {growth:+.1%} ({'flat' if abs(growth) <= FLAT else 'NOT flat'}; "
              f"{len(rss)} samples)")
        result.figures.update({"server_rss_mib_first_quarter": first, "server_rss_mib_last_quarter": last,
                               "server_rss_growth": growth, "server_rss_max_mib": max(rss)})
    result.figures.update({"errors": len(results.errors), "calls": results.calls, "tokens": results.tokens,
                           "wall_s": wall_s, "tokens_per_s": results.tokens / wall_s,
                           "ttft_p50_ms": percentile_ms(results.ttft, 50), "ttft_p99_ms": percentile_ms(results.ttft, 99),
                           "itl_p50_ms": percentile_ms(results.itl, 50), "itl_p99_ms": percentile_ms(results.itl, 99)})
    result.settings = {"model": model, "streams": args.streams, "calls": args.calls, "new_tokens": args.new_tokens,
                       "prompt_tokens": args.prompt_tokens, "max_step_tokens": args.max_step_tokens,
                       "server": f"memlm serve lm --max-batch {args.streams} --max-step-tokens {args.max_step_tokens}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_synthetic_flag(parser)
    parser.add_argument("--model", default=None, help=f"model (default {REAL_MODEL}; {SYNTHETIC_MODEL} with --synthetic)")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--calls", type=int, default=96)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=24)
    parser.add_argument("--max-step-tokens", type=int, default=1024)
    parser.add_argument("--rss-every-s", type=float, default=0.25)
    harness.add_options(parser, "lm_load")
    args = parser.parse_args()
    result = harness.Result.from_args(args)
    result.children = True  # the LM server
    model = args.model or (SYNTHETIC_MODEL if args.synthetic else REAL_MODEL)
    if model in ("tiny", "small") and not args.synthetic:
        raise SystemExit(f"{model} has random weights: pass --synthetic (the output then says SYNTHETIC)")
    with tempfile.TemporaryDirectory() as tmp:
        proc, address = start_server(model, args.streams, args.max_step_tokens, Path(tmp) / "server.log")
        try:
            with grpc.insecure_channel(address) as channel:
                stub = lm_grpc.LanguageModelServiceStub(channel)
                vocab = stub.GetInfo(lm_pb2.LanguageModelServiceGetInfoRequest(), timeout=60).vocab_size
                rng = random.Random(0)
                requests = [lm_pb2.GenerateRequest(
                    prompt_token_ids=lm_pb2.TokenIds(ids=[rng.randrange(1, min(vocab, 250 if args.synthetic else vocab))
                                                          for _ in range(args.prompt_tokens)]),
                    max_new_tokens=args.new_tokens, sampling=lm_pb2.SamplingOptions(temperature=0.0),
                ) for _ in range(args.calls)]
                warm = Results()
                one_call(stub, requests[0], warm)  # the first step's allocations before RSS is sampled
            results, rss, until = Results(), [], threading.Event()
            sampler = threading.Thread(target=sample_rss, args=(proc.pid, args.rss_every_s, until, rss), daemon=True)
            sampler.start()
            go = threading.Barrier(args.streams)
            next_call = [0]
            t0 = time.perf_counter()
            threads = [threading.Thread(target=stream_loop, args=(address, requests, next_call, results, go))
                       for _ in range(args.streams)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            until.set()
            sampler.join()
            report(args, model, results, wall, rss, result)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
    result.write()  # after the server's exit: its peak memory is the children's


if __name__ == "__main__":
    main()
