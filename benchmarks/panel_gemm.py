"""The decoder's float32 CPU GEMMs at a decode step's few rows (and more): memlm.model.panel_gemm's kernel vs
oneDNN's GEMM on weights packed for decoder.PACKED_ROWS rows (Linear's path with more threads) vs MKL's (F.linear,
as transformers' nn.Linear), over every weight of SmolLM2-135M (its 210 linear layers and the tied 49152x576 head,
each called once a round, so each is read from memory as in a decode step), alternating the three in one run, on
OMP_NUM_THREADS torch threads (ours over them where it is built with OpenMP).

Prints, per row count, the milliseconds a round takes on each (the best of --repeats rounds), the ratios, and the
bandwidth each reaches (the weights' bytes a round over its time); then whether our kernel's rows are bit for bit
the same alone and together (the property the speculative verifying pass relies on) on the head. With --keys N, also
the product of a torch exact search over N random float16 keys on float16 panels against float32 panels
(memlm.retrieval.exact).

    OMP_NUM_THREADS=1|2 python benchmarks/panel_gemm.py [--rows 1,2,4,8,17,32] [--repeats 5] [--keys 81169]
        [--synthetic] [--in-cache] [--streamed 1,4]
"""

from __future__ import annotations

import argparse
import time

import _common
import torch
import torch.nn.functional as F

from memlm.model import panel_gemm
from memlm.model.decoder import Linear, pack_weight, packed_linear


def round_ms(fn, operands: list[torch.Tensor], inputs: list[int], xs: dict[int, torch.Tensor]) -> float:
    """Milliseconds of one call fn(x, operand) per weight, x the rows of that weight's input size."""
    start = time.perf_counter()
    for operand, k in zip(operands, inputs):
        fn(xs[k], operand)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,2,4,8,17,32")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--keys", type=int, default=0, help="also a search's product over this many random float16 keys "
                   "of the model's width (81169: the demo datastore's): float16 panels vs float32 panels; 0: not")
    p.add_argument("--in-cache", action="store_true", help="also our kernel's GFLOPS on one weight that stays in cache")
    p.add_argument("--streamed", default="", help="also our kernel built to stream these numbers of panels at once "
                   "(e.g. 1,4; the default build streams panel_gemm's STREAMED), alternating with the others")
    _common.add_synthetic_flag(p)
    args = p.parse_args()
    if not panel_gemm.available():
        raise SystemExit("the panel GEMM cannot be built here (no AVX-512 CPU or no C compiler; see the log)")
    bench = _common.load_model(None, args.synthetic)
    _common.synthetic_banner(bench.synthetic)
    model = bench.pre.model
    weights = [m.weight.detach().contiguous() for m in model.modules() if isinstance(m, Linear)]  # the head too
    packed = [pack_weight(w) for w in weights]
    # Panels of the weights' outputs rounded up to 16 (SmolLM2's are multiples of 16: the same work as the others).
    panels = [panel_gemm.panels(w) for w in weights]
    inputs = [w.shape[1] for w in weights]
    gigabytes = sum(w.numel() for w in weights) * 4 / 1e9
    print(f"# {bench.name}{' (random weights)' if bench.synthetic else ' (SmolLM2-135M-Instruct Q4_1, in float32)'}: "
          f"{len(weights)} weights, {gigabytes * 1e3:.0f} MB a round; {torch.get_num_threads()} torch thread(s); "
          f"best of {args.repeats} rounds")
    sides = {
        "ours": (lambda x, p: panel_gemm.linear(x, p, p.shape[0] * panel_gemm.PANEL), panels),
        "oneDNN packed": (lambda x, w: packed_linear(x, w), packed),
        "MKL": (F.linear, weights),
    }
    variants = {f"ours, {n} streamed": panel_gemm.build(streamed=int(n)) for n in args.streamed.split(",") if n}
    for name, lib in variants.items():
        sides[name] = (lambda x, p, lib=lib: panel_gemm.linear(x, p, p.shape[0] * panel_gemm.PANEL, lib=lib), panels)
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(rows, k) for k in set(inputs)}
            best = {name: float("inf") for name in sides}
            for _ in range(args.repeats):  # alternating: the machine's noise falls on all three alike
                for name, (fn, operands) in sides.items():
                    best[name] = min(best[name], round_ms(fn, operands, inputs, xs))
            print(f"{rows} rows: ours {best['ours']:.1f} ms ({gigabytes / best['ours'] * 1e3:.1f} GB/s), oneDNN packed "
                  f"{best['oneDNN packed']:.1f} ms ({best['oneDNN packed'] / best['ours']:.2f}x ours), MKL "
                  f"{best['MKL']:.1f} ms ({best['MKL'] / best['ours']:.2f}x ours)"
                  + "".join(f", {name} {best[name]:.1f} ms" for name in variants), flush=True)
        head = model.lm_head.weight.detach().contiguous()
        x = torch.randn(32, head.shape[1])  # (M, K)
        head_panels, n = panel_gemm.panels(head), head.shape[0]
        alone = torch.cat([panel_gemm.linear(x[i : i + 1], head_panels, n) for i in range(x.shape[0])])
        same = all(torch.equal(panel_gemm.linear(x[:m], head_panels, n), alone[:m]) for m in range(1, x.shape[0] + 1))
        print(f"# ours, the head's rows alone vs together (1..{x.shape[0]} rows): bit for bit {same}")
        if args.keys:
            key_products(args.keys, head.shape[1], [int(r) for r in args.rows.split(",")], args.repeats)
        if args.in_cache:
            cached = max((w for w in weights if w.numel() * 4 <= 4e6), key=torch.Tensor.numel)  # an MLP's, 3.5 MB
            in_cache(cached, [int(r) for r in args.rows.split(",")], args.repeats)


def in_cache(weight: torch.Tensor, rows: list[int], repeats: int, calls: int = 200) -> None:
    """Our kernel's arithmetic rate on one weight read `calls` times in a row (it stays in cache: memory bandwidth
    out of the way), by rows, best of `repeats`: whether a few rows' time over all the weights is bound by the
    kernel's arithmetic or by the memory it streams."""
    p, (n, k) = panel_gemm.panels(weight), weight.shape
    print(f"# ours on one {n}x{k} weight ({n * k * 4 / 1e6:.1f} MB) {calls} times in a row, GFLOPS, best of {repeats}")
    for m in rows:
        x = torch.randn(m, k)  # (m, K)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                panel_gemm.linear(x, p, n)
            best = min(best, time.perf_counter() - start)
        print(f"{m} rows in cache: {2 * m * n * k * calls / best / 1e9:.0f} GFLOPS", flush=True)


def key_products(n: int, d: int, rows: list[int], repeats: int) -> None:
    """x (rows, d) @ keys.T over n random float16 keys (a torch exact search's product, memlm.retrieval.exact) on
    float16 panels (half_kernel) and on float32 panels of the same keys, alternating; best of `repeats`."""
    keys = torch.randn(n, d).half()  # (n, d)
    layouts = {"float16 panels": panel_gemm.panels(keys, torch.float16), "float32 panels": panel_gemm.panels(keys)}
    print(f"# a search's product over {n} random float16 keys of width {d}, ms, best of {repeats}")
    for m in rows:
        x = torch.randn(m, d)  # (m, d)
        best = {name: float("inf") for name in layouts}
        for _ in range(repeats):
            for name, p in layouts.items():
                start = time.perf_counter()
                panel_gemm.linear(x, p, n)
                best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
        same = torch.equal(*(panel_gemm.linear(x, p, n) for p in layouts.values()))
        print(f"{m} rows: float16 panels {best['float16 panels']:.2f} ms, float32 panels {best['float32 panels']:.2f} "
              f"ms ({best['float32 panels'] / best['float16 panels']:.2f}x); the same bit for bit {same}", flush=True)


if __name__ == "__main__":
    main()
