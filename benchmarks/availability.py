"""Availability of the LM server under hostile clients and faults: p99 latency of small Score calls.

8 well-behaved clients (each its own connection, the server's token, one small Score after another) are
measured undisturbed and while
  (a) one client sends maximal-cost Scores (max_score_tokens tokens at the window of one step, the
      smallest stride max_forward_tokens allows) and cancels each after 0.5-2 s;
  (b) the retrieval service is killed (SIGKILL) and restarted on its port, while a ninth client sends small
      kNN-LM Scores; their fast-fail latency (calls that failed while it was down) is reported too;
  (c) 64 unauthenticated health Watch streams are held open.
Phases are interleaved (undisturbed, a, b, c, repeated --rounds times) so that the other load of a shared
machine hits the undisturbed baseline as much as the scenarios; the baseline is all undisturbed phases
pooled. Goal: each scenario's p99 <= 2x the undisturbed p99, 0 errors for the well-behaved clients.

The LM server (`memlm serve lm --retrieval ... --token-file ...`) and the retrieval server (`memlm serve
retrieval`) are child processes; the datastore is a small Flat one over SOTU speeches (1990-2000) made
with the same model at the step's window, cached under ~/.cache/memlm/bench/ (never committed). SmolLM2
by default; a random model only with --synthetic, and then the output says so. No assertions. Writes
docs/results/data/availability.json (benchmarks/harness.py; a datastore built by this run is timed into its build
seconds).

What bounds the ratio: a forward step is not preemptible, so a small call that arrives during a maximal
step waits for it (the model's turns give each client an equal share of model time, services.lm.scheduler).
The server runs with serve lm's default step (services.lm.requests.LMLimits.max_step_tokens) unless
--max-step-tokens picks a shorter one; the ratio shrinks with the step.

    python benchmarks/availability.py [--synthetic] [--model NAME] [--phase-s 12] [--rounds 3] [--clients 8]
        [--max-step-tokens N] [--ds-tokens 4096] [--results DIR]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

import _common
import harness
import numpy as np

REPO = _common.ROOT
SMALL_TEXT = "The state of our Union is strong, and our economy is growing."
"""The well-behaved clients' Score: one sentence (about 15 tokens)."""
KNN = {"enabled": True, "k": 16, "lambda_weight": 0.25, "temperature": 1.0}
"""The kNN-LM options of (b)'s ninth client."""
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
"""Channel options giving a client its own TCP connection, as a separate process would have (channels of one
process to one address share a connection otherwise, and the server would see them as one client: its fair
share of the model is per connection, services.lm.scheduler)."""
START_S = 120.0
"""How long a child server may take to print its address (the model loads first)."""


class Child(NamedTuple):
    proc: subprocess.Popen
    address: str
    log: Path


def start_child(argv: list[str], log: Path) -> Child:
    """A `memlm ...` child process, once it prints `listening on HOST:PORT`; stderr goes to `log`."""
    proc, address = _common.start_memlm(argv, log, START_S)
    return Child(proc, address, log)


def stop_child(child: Child) -> None:
    if child.proc.poll() is None:
        child.proc.send_signal(signal.SIGTERM)
        try:
            child.proc.wait(30)
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait(10)


def ensure_datastore(model: str, fingerprint: str, window: int, tokens: int, log: Path,
                     result: harness.Result | None = None) -> Path:
    """A Flat datastore over SOTU 1990-2000 at window `window` (stride half), built once by `memlm datastore
    build` and cached; its name carries the model, the size, the window and the manifest format."""
    from datastore.manifest import FORMAT_VERSION
    from memlm.files import cache_dir

    out = cache_dir() / "bench" / f"availability-{model}-{fingerprint[:12]}-n{tokens}-c{window}-v{FORMAT_VERSION}"
    if not (out / "manifest.json").exists():
        t0 = time.perf_counter()
        argv = ["datastore", "build", "--model", model, "--data", "sotu", "--split", "1990<=year<=2000",
                "--max-tokens", str(tokens), "--index", "Flat", "--context", str(window), "--stride",
                str(max(1, window // 2)), "--out", str(out), "--quiet"]
        done = subprocess.run([sys.executable, "-m", "memlm", *argv], cwd=REPO, capture_output=True, text=True,
                              check=False)
        log.write_text(done.stdout + done.stderr)
        if done.returncode != 0:
            raise SystemExit(f"datastore build failed:\n{done.stderr[-2000:]}")
        print(f"# built the datastore ({tokens} tokens, Flat) in {time.perf_counter() - t0:.0f} s -> {out}", flush=True)
        if result is not None:
            result.builds["kNN-LM datastore"] = time.perf_counter() - t0
    return out


def maximal_request(vocab: int, max_tokens: int, max_forward: int, window: int):
    """The costliest Score the limits admit at this window: max_tokens - 1 token ids (with the boundary,
    max_tokens) and the smallest stride whose forward work is within max_forward."""
    from memlm.jobs.windows import window_cost
    from memlm.v1 import language_model_pb2 as lm_pb2

    n = max_tokens - 1
    stride = next(s for s in range(1, window + 1) if window_cost(n, 0, window, s).forward_tokens <= max_forward)
    ids = np.random.default_rng(0).integers(3, vocab, size=n).tolist()
    return lm_pb2.ScoreRequest(inputs=[lm_pb2.ScoreInput(token_ids=lm_pb2.TokenIds(ids=ids))],
                               window_tokens=window, stride_tokens=stride), stride


class Calls:
    """Latencies (s) and errors (status names) of one kind of call in one phase, thread-safe."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.failed: list[tuple[float, str]] = []
        self.ok_at: list[float] = []  # monotonic time of each success
        self._lock = threading.Lock()

    def add(self, t0: float, error: str | None) -> None:
        now = time.monotonic()
        with self._lock:
            if error is None:
                self.latencies.append(now - t0)
                self.ok_at.append(now)
            else:
                self.failed.append((now - t0, error))


def call_loop(address: str, token: str, request, calls: Calls, until: threading.Event, pause_s: float = 0.0) -> None:
    """One client: its own channel, `request` after `request` until `until` is set."""
    import grpc

    from memlm.v1 import language_model_pb2_grpc as lm_grpc
    from services.common.security import auth_metadata

    with grpc.insecure_channel(address, options=OWN_CONNECTION) as channel:
        stub = lm_grpc.LanguageModelServiceStub(channel)
        while not until.is_set():
            t0 = time.monotonic()
            try:
                stub.Score(request, timeout=30, metadata=auth_metadata(token))
                calls.add(t0, None)
            except grpc.RpcError as e:
                calls.add(t0, e.code().name)
            if pause_s:
                until.wait(pause_s)


def hostile(address: str, token: str, request, until: threading.Event, sent: list[int]) -> None:
    """(a): maximal-cost Scores, each cancelled after 0.5-2 s, one after another."""
    import grpc

    from memlm.v1 import language_model_pb2_grpc as lm_grpc
    from services.common.security import auth_metadata

    rng = random.Random(1)
    with grpc.insecure_channel(address, options=OWN_CONNECTION) as channel:
        stub = lm_grpc.LanguageModelServiceStub(channel)
        while not until.is_set():
            future = stub.Score.future(request, timeout=600, metadata=auth_metadata(token))
            sent.append(1)
            until.wait(rng.uniform(0.5, 2.0))
            future.cancel()


def unauthenticated_streams(address: str, n: int, until: threading.Event, held: list[int]) -> None:
    """(c): n health Watch streams without the token, held until `until`; `held` gets how many stayed open
    (the server refuses those past its open-call budget at once)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address, options=OWN_CONNECTION) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        streams = [stub.Watch(health_pb2.HealthCheckRequest(service="")) for _ in range(n)]
        time.sleep(1.0)
        held.append(sum(1 for s in streams if not s.done()))
        until.wait()
        for s in streams:
            s.cancel()


class Env:
    """The running servers and the requests of the phases."""

    def __init__(self, args, lm: Child, retrieval: Child, datastore: Path, token: str, requests: dict) -> None:
        self.args, self.lm, self.retrieval, self.datastore, self.token = args, lm, retrieval, datastore, token
        self.requests = requests
        """"small", "knn", "maximal": the ScoreRequests."""


def retrieval_fault(env: Env, phase_s: float, events: dict) -> None:
    """(b): SIGKILL the retrieval server 2 s into the phase, restart it on its port at half the phase."""
    time.sleep(2.0)
    env.retrieval.proc.kill()
    env.retrieval.proc.wait(10)
    events["killed"] = time.monotonic()
    time.sleep(max(0.0, phase_s / 2 - 2.0))
    port = env.retrieval.address.rsplit(":", 1)[1]
    env.retrieval = start_child(["serve", "retrieval", "--datastore", str(env.datastore), "--port", port],
                                env.retrieval.log)
    events["restarted"] = time.monotonic()


def run_phase(env: Env, scenario: str) -> dict:
    """One phase of args.phase_s seconds: the well-behaved clients, and the scenario's disturbance."""
    args = env.args
    until = threading.Event()
    good, knn = Calls(), Calls()
    threads = [threading.Thread(target=call_loop, args=(env.lm.address, env.token, env.requests["small"], good, until))
               for _ in range(args.clients)]
    out: dict = {"good": good}
    if scenario == "a":
        out["sent"] = []
        threads.append(threading.Thread(target=hostile, args=(env.lm.address, env.token, env.requests["maximal"],
                                                              until, out["sent"])))
    elif scenario == "b":
        out["knn"], out["events"] = knn, {}
        threads.append(threading.Thread(target=call_loop, args=(env.lm.address, env.token, env.requests["knn"], knn,
                                                                until, 0.1)))
        fault = threading.Thread(target=retrieval_fault, args=(env, args.phase_s, out["events"]))
    elif scenario == "c":
        out["held"] = []
        threads.append(threading.Thread(target=unauthenticated_streams, args=(env.lm.address, args.unauth_streams,
                                                                              until, out["held"])))
    for t in threads:
        t.start()
    if scenario == "b":
        fault.start()
    time.sleep(args.phase_s)
    if scenario == "b":
        fault.join()  # the retrieval server is back before the phase ends
    until.set()
    for t in threads:
        t.join(60)
    return out


def percentile_ms(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values) * 1000, q)) if values else float("nan")


SCENARIOS = {
    "undisturbed": "undisturbed",
    "a": "(a) maximal Scores, cancelled",
    "b": "(b) retrieval killed, restarted",
    "c": "(c) unauthenticated streams",
}


def report(results: dict[str, list[dict]], args, result: harness.Result) -> None:
    base = [x for r in results["undisturbed"] for x in r["good"].latencies]
    base_p99 = percentile_ms(base, 99)
    rounds = ", ".join(f"{percentile_ms(r['good'].latencies, 99):.0f}" for r in results["undisturbed"])
    print(f"undisturbed p99 per round (ms): {rounds}")
    print(f"{'scenario':<34} {'calls':>6} {'p50 ms':>8} {'p99 ms':>8} {'p99 / undisturbed':>18} {'errors':>7}")
    met = True
    for key, title in SCENARIOS.items():
        lat = [x for r in results[key] for x in r["good"].latencies]
        errors = [e for r in results[key] for _, e in r["good"].failed]
        ratio = percentile_ms(lat, 99) / base_p99
        met &= not errors and (key == "undisturbed" or ratio <= 2.0)
        result.rows.append({"scenario": title, "calls": len(lat), "p50_ms": percentile_ms(lat, 50),
                            "p99_ms": percentile_ms(lat, 99), "p99_over_undisturbed": ratio, "errors": len(errors)})
        print(f"{title:<34} {len(lat):>6} {percentile_ms(lat, 50):>8.0f} {percentile_ms(lat, 99):>8.0f} "
              f"{ratio:>17.2f}x {len(errors):>7}" + (f"  ({', '.join(sorted(set(errors)))})" if errors else ""))
    print(f"(a) maximal requests sent and cancelled: {sum(len(r['sent']) for r in results['a'])}")
    print(f"(c) unauthenticated streams held open of {args.unauth_streams}: "
          f"{', '.join(str(h) for r in results['c'] for h in r['held'])} (per round; the rest refused at once)")
    for i, r in enumerate(results["b"]):
        knn, ev = r["knn"], r["events"]
        down = [(lat, e) for lat, e in knn.failed]
        before = sum(1 for t in knn.ok_at if t < ev["killed"])
        after = [t for t in knn.ok_at if t > ev["restarted"]]
        first = f"{after[0] - ev['restarted']:.1f} s after the restart" if after else \
            f"none in the phase; the first after it {r['recovered_s']:.1f} s after the restart"
        print(f"(b) round {i + 1} kNN calls: {before} ok before the kill; {len(down)} failed while down "
              f"(fast-fail p50 {percentile_ms([x for x, _ in down], 50):.0f} ms, p99 "
              f"{percentile_ms([x for x, _ in down], 99):.0f} ms, max {max((x for x, _ in down), default=0) * 1000:.0f} "
              f"ms; {', '.join(sorted({e for _, e in down})) or '-'}); {len(after)} ok after the restart ({first})")
    print(f"goal (every scenario p99 <= 2x undisturbed, 0 errors): {'met' if met else 'NOT met'}")
    disturbed = [r for r in result.rows if r["scenario"] != result.rows[0]["scenario"]]
    worst = max(disturbed, key=lambda r: r["p99_over_undisturbed"], default=None)
    if worst is not None:
        result.headline("availability", f"worst p99 {worst['p99_over_undisturbed']:.2f}x undisturbed "
                                        f"({worst['scenario']}), {sum(r['errors'] for r in result.rows)} errors")
    result.figures.update({"undisturbed_p99_ms": base_p99, "goal_met": met,
                           "maximal_requests_sent": sum(len(r["sent"]) for r in results["a"])})


def main() -> None:
    from services.lm.requests import LMLimits

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help=f"default {_common.REAL_MODEL}")
    p.add_argument("--phase-s", type=float, default=12.0, help="seconds per phase")
    p.add_argument("--rounds", type=int, default=3, help="times the four phases are repeated, interleaved")
    p.add_argument("--clients", type=int, default=8, help="well-behaved clients")
    p.add_argument("--max-step-tokens", type=int, default=LMLimits.max_step_tokens,
                   help="the LM server's step budget (serve lm --max-step-tokens); also the datastore's window")
    p.add_argument("--unauth-streams", type=int, default=64)
    p.add_argument("--ds-tokens", type=int, default=4096, help="tokens of the kNN-LM datastore")
    _common.add_synthetic_flag(p)
    harness.add_options(p, "availability")
    args = p.parse_args()
    result = harness.Result.from_args(args)
    result.children = True  # the LM and retrieval servers
    print(f"# command: python benchmarks/availability.py {' '.join(sys.argv[1:])}".rstrip(), flush=True)
    bench = _common.load_model(args.model, args.synthetic)
    vocab, fingerprint = min(bench.pre.model.config.vocab_size, bench.pre.tokenizer.vocab_size), bench.pre.fingerprint
    name, synthetic = bench.name, bench.synthetic
    del bench  # the servers load their own copies
    if synthetic and not args.synthetic:
        raise SystemExit("a random model needs --synthetic")
    result.set_synthetic(synthetic)
    with tempfile.TemporaryDirectory(prefix="memlm-availability-") as tmp:
        env = start_servers(args, name, vocab, fingerprint, Path(tmp), result)
        try:
            run_all(env, args, result)
        finally:
            stop_child(env.lm)
            stop_child(env.retrieval)
    result.settings = {"model": name, "clients": args.clients, "phase_s": args.phase_s, "rounds": args.rounds,
                       "max_step_tokens": args.max_step_tokens, "unauth_streams": args.unauth_streams,
                       "ds_tokens": args.ds_tokens, "small_score": SMALL_TEXT}
    result.write()


def start_servers(args, model: str, vocab: int, fingerprint: str, tmp: Path, result: harness.Result) -> Env:
    """The datastore (cached), the retrieval server, the LM server with a token; the phases' requests."""
    from memlm.v1 import language_model_pb2 as lm_pb2
    from services.lm.requests import LMLimits

    datastore = ensure_datastore(model, fingerprint, args.max_step_tokens, args.ds_tokens, tmp / "build.log", result)
    retrieval = start_child(["serve", "retrieval", "--datastore", str(datastore), "--port", "0"], tmp / "retrieval.log")
    token = os.urandom(16).hex()
    (tmp / "token").write_text(token)
    flags = ["--max-step-tokens", str(args.max_step_tokens), "--grace", "1"]
    lm = start_child(["serve", "lm", "--model", model, "--retrieval", retrieval.address, "--token-file",
                      str(tmp / "token"), *flags], tmp / "lm.log")
    limits = LMLimits()
    maximal, stride = maximal_request(vocab, limits.max_score_tokens, limits.max_forward_tokens, args.max_step_tokens)
    small = lm_pb2.ScoreRequest(inputs=[lm_pb2.ScoreInput(text=SMALL_TEXT)])
    knn = lm_pb2.ScoreRequest(inputs=[lm_pb2.ScoreInput(text=SMALL_TEXT)], knn=lm_pb2.KnnOptions(**KNN))
    print(f"# model {model}; LM server: memlm serve lm {' '.join(flags)} (other limits: defaults), {args.clients} "
          f"clients x small Score ({SMALL_TEXT!r}); (a) {limits.max_score_tokens - 1} tokens at window "
          f"{args.max_step_tokens}, stride {stride}; datastore {args.ds_tokens} tokens Flat; "
          f"{args.rounds} rounds x 4 phases x {args.phase_s:.0f} s; load now: {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} CPUs", flush=True)
    return Env(args, lm, retrieval, datastore, token, {"small": small, "knn": knn, "maximal": maximal})


def recovery_s(env: Env, restarted: float, limit_s: float = 60.0) -> float:
    """Seconds from the retrieval server's restart to the first kNN Score that succeeds (inf past limit_s)."""
    import grpc

    from memlm.v1 import language_model_pb2_grpc as lm_grpc
    from services.common.security import auth_metadata

    with grpc.insecure_channel(env.lm.address) as channel:
        stub = lm_grpc.LanguageModelServiceStub(channel)
        while time.monotonic() - restarted < limit_s:
            try:
                stub.Score(env.requests["knn"], timeout=30, metadata=auth_metadata(env.token))
                return time.monotonic() - restarted
            except grpc.RpcError:
                time.sleep(0.2)
    return float("inf")


def run_all(env: Env, args, result: harness.Result) -> None:
    warm = threading.Event()
    threading.Timer(3.0, warm.set).start()
    call_loop(env.lm.address, env.token, env.requests["knn"], Calls(), warm)  # warm: model, datastore link
    results: dict[str, list[dict]] = {key: [] for key in SCENARIOS}
    for i in range(args.rounds):
        for key, title in SCENARIOS.items():
            results[key].append(run_phase(env, key))
            if key == "b":  # kNN-LM is back once a kNN Score succeeds (the link reconnects with back-off)
                results[key][-1]["recovered_s"] = recovery_s(env, results[key][-1]["events"]["restarted"])
            r = results[key][-1]["good"]
            print(f"# round {i + 1} {title}: {len(r.latencies)} calls, p99 {percentile_ms(r.latencies, 99):.0f} ms, "
                  f"{len(r.failed)} errors; load {os.getloadavg()[0]:.1f}", flush=True)
    report(results, args, result)


if __name__ == "__main__":
    main()
