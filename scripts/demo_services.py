"""The services half of `make demo`: real retrieval and LM servers as processes, Score and Generate.

Starts `memlm serve retrieval` over the datastore and `memlm serve lm --retrieval` in front of it,
waits until both are healthy, scores the evaluation speeches through Score (base and kNN-LM log-probs
of every token, mixed by the interpolation `memlm eval --lambda auto` chose in-process on a separate split
and saved, which the LM server loads with `--interpolation`), streams a short generation with and without
kNN-LM (the constant lambda and T of that tuning), prints the table and shuts both servers down with SIGTERM.

    python scripts/demo_services.py --datastore DIR --tuned ~/.cache/memlm/demo/knnlm.json
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from memlm.data.documents import load_documents
from services.lm.client import Finish, KnnRequest, LanguageModelClient

START_TIMEOUT_S = 300.0


def start_server(args: list[str], name: str) -> tuple[subprocess.Popen, str]:
    """Start `memlm serve ...` and return (process, HOST:PORT) once it prints its address."""
    proc = subprocess.Popen([sys.executable, "-m", "memlm", "serve", *args], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"{name} server exited before listening (exit code {proc.wait()})")
        if line.startswith("listening on "):
            address = line.split()[-1]
            print(f"[demo] {name} server pid {proc.pid} listening on {address}")
            return proc, address
    proc.kill()
    raise SystemExit(f"{name} server did not start within {START_TIMEOUT_S:.0f} s")


def wait_healthy(address: str) -> None:
    with grpc.insecure_channel(address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
    if status.status != health_pb2.HealthCheckResponse.SERVING:
        raise SystemExit(f"{address} is not SERVING")


def stop(proc: subprocess.Popen, name: str) -> None:
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    print(f"[demo] {name} server stopped on SIGTERM, exit code {code}")
    if code != 0:
        raise SystemExit(f"{name} server exited with {code}")


def eval_token_docs(client: LanguageModelClient, data: str, split: str, max_tokens: int) -> list[list[int]]:
    """The evaluation tokens, cut exactly as `memlm eval --max-tokens` cuts them."""
    texts = [d.text for d in load_documents(data, split)]
    docs, total = [], 0
    for tokenized in client.tokenize(texts):
        ids = list(tokenized.ids)[: max_tokens - total]
        if ids:
            docs.append(ids)
        total += len(ids)
        if total >= max_tokens:
            break
    return docs


def generate(client: LanguageModelClient, prompt: str, knn: KnnRequest | None, tokens: int) -> None:
    """Stream one sampled continuation; the same seed with and without kNN-LM, so only p(y) differs."""
    label = "kNN-LM" if knn else "base  "
    print(f"[demo] {label} | {prompt}", end="", flush=True)
    stream = client.generate(prompt, max_new_tokens=tokens, temperature=0.8, top_p=0.95, seed=1, knn=knn)
    for event in stream:
        if isinstance(event, Finish):
            print(f"  [{event.reason}, {event.completion_tokens} tokens]")
        else:
            print(event.text.replace("\n", " "), end="", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--datastore", required=True)
    parser.add_argument("--tuned", required=True, help="JSON result of `memlm eval --datastore ... --lambda auto`")
    parser.add_argument("--data", default="sotu")
    parser.add_argument("--split", default="year>=2003")
    parser.add_argument("--max-tokens", type=int, default=6000)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--stride", type=int, default=512)
    parser.add_argument("--prompt", default="My fellow Americans, tonight")
    parser.add_argument("--generate-tokens", type=int, default=32)
    args = parser.parse_args()

    tuned = json.loads(Path(args.tuned).read_text())
    knn = KnnRequest(lmbda=tuned["lambda"], temperature=tuned["temperature"], k=tuned["k"])
    saved = tuned.get("interpolation_file")  # the chosen interpolation, which Score mixes with where a call sets no lambda
    score_knn = KnnRequest() if saved else knn
    serve_lm = ["lm", "--model", args.model, *(["--interpolation", saved] if saved else [])]

    retrieval, retrieval_address = start_server(["retrieval", "--datastore", args.datastore], "retrieval")
    lm = None
    try:
        lm, lm_address = start_server([*serve_lm, "--retrieval", retrieval_address], "lm")
        wait_healthy(retrieval_address)
        wait_healthy(lm_address)
        with LanguageModelClient(lm_address) as client:
            docs = eval_token_docs(client, args.data, args.split, args.max_tokens)
            n_tokens = sum(len(d) for d in docs)
            print(f"[demo] Score: {len(docs)} speech(es) ({args.split}), {n_tokens} tokens, "
                  f"windows {args.context}/{args.stride}, kNN-LM via the retrieval server")
            t0 = time.perf_counter()
            results = client.score(docs, knn=score_knn, window_tokens=args.context, stride_tokens=args.stride)
            seconds = time.perf_counter() - t0
            print("[demo] Generate, streamed (temperature 0.8, top-p 0.95, seed 1):")
            generate(client, args.prompt, None, args.generate_tokens)
            generate(client, args.prompt, knn, args.generate_tokens)
    finally:
        if lm is not None:
            stop(lm, "lm")
        stop(retrieval, "retrieval")

    scored = sum(len(r.tokens) for r in results)
    base_ppl = math.exp(-sum(r.base_total_logprob for r in results) / scored)
    knn_ppl = math.exp(-sum(r.total_logprob for r in results) / scored)
    rows = [
        ("base perplexity", f"{base_ppl:.3f}"),
        ("kNN-LM perplexity", f"{knn_ppl:.3f}"),
        ("relative change", f"{100 * (knn_ppl / base_ppl - 1):+.2f}%"),
        ("interpolation (chosen)", str(tuned.get("interpolation_method", "constant"))),
        ("lambda (tuned)", f"{tuned['lambda']:.3f}"),
        ("temperature (tuned)", f"{tuned['temperature']:.3f}"),
        ("k", str(tuned["k"])),
        ("index", str(tuned.get("index", "?"))),
        ("datastore entries", str(tuned.get("datastore_size", "?"))),
        ("recall@k vs exact", f"{tuned['recall_at_k']:.3f}" if "recall_at_k" in tuned else "n/a"),
        ("Score tokens/s (gRPC, base+kNN)", f"{scored / seconds:.1f}"),
        ("in-process base ppl (check)", f"{tuned['base_perplexity']:.3f}"),
        ("in-process kNN-LM ppl (check)", f"{tuned['knnlm_perplexity']:.3f}"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n" + "\n".join(f"{k:<{width}}  {v}" for k, v in rows))


if __name__ == "__main__":
    main()
